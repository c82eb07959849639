"""The daemon's loop with a fake controller: what triggers a reconcile, what a requeue does, that the heartbeat
moves while nothing happens, and that a reconcile that raises neither ends the loop nor makes it spin."""

from __future__ import annotations

import threading

from reconciler.loop.controller import Result
from reconciler.loop.daemon import STALE_AFTER, TICK, Daemon, heartbeat_fresh


class FakeController:
    """Records each reconcile's reasons; `script` says what each returns (a Result, or an exception to raise)."""

    def __init__(self, script):
        self.script = list(script)
        self.calls: list[set[str]] = []
        self.called = threading.Condition()
        self.desired = None

    def reconcile(self, reasons):
        with self.called:
            self.calls.append(reasons)
            self.called.notify_all()
        item = self.script.pop(0) if self.script else Result()
        if isinstance(item, Exception):
            raise item
        return item

    def wait_calls(self, n: int, timeout: float = 10) -> list[set[str]]:
        with self.called:
            assert self.called.wait_for(lambda: len(self.calls) >= n, timeout), self.calls
            return list(self.calls)


def run_loop(tmp_path, fake):
    daemon = Daemon(tmp_path / "cluster.yaml", tmp_path / "state", controller=fake)  # type: ignore[arg-type]
    thread = threading.Thread(target=daemon._loop, daemon=True)
    thread.start()
    return daemon, thread


def stop(daemon, thread):
    daemon.stop.set()
    daemon.requests.request("signal")
    thread.join(10)
    assert not thread.is_alive()


def test_the_first_reconcile_starts_at_once_and_triggers_coalesce(tmp_path):
    fake = FakeController([Result()])
    daemon, thread = run_loop(tmp_path, fake)
    try:
        assert fake.wait_calls(1)[0] == {"start"}
        daemon.requests.request("docker:worker")
        daemon.requests.request("operation")
        calls = fake.wait_calls(2)
        assert calls[1] <= {"docker:worker", "operation"} and "operation" in set().union(*calls[1:])
    finally:
        stop(daemon, thread)


def test_a_requeue_reconciles_when_due_without_any_trigger(tmp_path):
    fake = FakeController([Result(requeue_after=0.2)])
    daemon, thread = run_loop(tmp_path, fake)
    try:
        assert fake.wait_calls(2)[1] == {"requeue"}
    finally:
        stop(daemon, thread)


def test_a_reconcile_that_raises_does_not_end_the_loop_nor_make_it_spin(tmp_path):
    fake = FakeController([Result(requeue_after=0.0), RuntimeError("bug"), Result()])
    daemon, thread = run_loop(tmp_path, fake)
    try:
        fake.wait_calls(2)
        daemon.requests.request("file")
        calls = fake.wait_calls(3)
        assert calls[2] == {"file"}, "after the crash only a trigger reconciles again (no stale requeue)"
        assert thread.is_alive()
    finally:
        stop(daemon, thread)


def test_an_idle_loop_still_beats(tmp_path, monkeypatch):
    """The watchdog is fed from the heartbeat; an idle loop (resync far away) must keep it moving."""
    import time

    from reconciler.loop import daemon as daemon_module

    monkeypatch.setattr(daemon_module, "TICK", 0.05)
    fake = FakeController([Result()])
    daemon, thread = run_loop(tmp_path, fake)
    try:
        fake.wait_calls(1)
        first = daemon.heartbeat
        deadline = time.monotonic() + 10
        while daemon.heartbeat == first and time.monotonic() < deadline:
            daemon.stop.wait(0.01)
        assert daemon.heartbeat > first
        assert len(fake.calls) == 1, "ticks are not reconciles"
    finally:
        stop(daemon, thread)


def test_the_heartbeat_goes_stale_only_after_the_window():
    assert TICK < STALE_AFTER / 10, "an idle loop wakes many times within the staleness window"
    assert heartbeat_fresh(100.0, 100.0 + STALE_AFTER - 1)
    assert not heartbeat_fresh(100.0, 100.0 + STALE_AFTER)
