"""The daemon's loop with a fake controller: what triggers a reconcile, what a requeue does, that the heartbeat
moves while nothing happens, and that a reconcile that raises neither ends the loop nor makes it spin."""

from __future__ import annotations

import threading

from reconciler.loop.controller import Result
from reconciler.loop.daemon import STALE_AFTER, TICK, Daemon, heartbeat_fresh
from reconciler.loop.reasons import Reason


class FakeController:
    """Records each reconcile's reasons; `script` says what each returns (a Result, or an exception to raise)."""

    def __init__(self, script):
        self.script = list(script)
        self.calls: list[set[Reason]] = []
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

    def wait_calls(self, n: int, timeout: float = 10) -> list[set[Reason]]:
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
    daemon.requests.request(Reason("signal"))
    thread.join(10)
    assert not thread.is_alive()


def test_the_first_reconcile_starts_at_once_and_triggers_coalesce(tmp_path):
    fake = FakeController([Result()])
    daemon, thread = run_loop(tmp_path, fake)
    try:
        assert fake.wait_calls(1)[0] == {Reason("start")}
        daemon.requests.request(Reason("docker", "worker"))
        daemon.requests.request(Reason("operation"))
        calls = fake.wait_calls(2)
        assert calls[1] <= {Reason("docker", "worker"), Reason("operation")}
        assert Reason("operation") in set().union(*calls[1:])
    finally:
        stop(daemon, thread)


def test_a_requeue_reconciles_when_due_without_any_trigger(tmp_path):
    fake = FakeController([Result(requeue_after=0.2), Result(requeue_after=0.1, requeue_reason="backoff-ended:x")])
    daemon, thread = run_loop(tmp_path, fake)
    try:
        calls = fake.wait_calls(3)
        assert calls[1] == {Reason("requeue")}
        assert calls[2] == {Reason("requeue", detail="backoff-ended:x")}, "the reconcile says what it was requeued for"
        assert str(next(iter(calls[2]))) == "requeue:backoff-ended:x", "and its log line as before"
    finally:
        stop(daemon, thread)


def test_a_reconcile_that_raises_does_not_end_the_loop_nor_make_it_spin(tmp_path):
    fake = FakeController([Result(requeue_after=0.0), RuntimeError("bug"), Result()])
    daemon, thread = run_loop(tmp_path, fake)
    try:
        fake.wait_calls(2)
        daemon.requests.request(Reason("file"))
        calls = fake.wait_calls(3)
        assert calls[2] == {Reason("file")}, "after the crash only a trigger reconciles again (no stale requeue)"
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


def test_a_sighup_is_said_by_the_reconcile_it_triggers(desired_path, tmp_path, converged):
    """Issue 33, item 5: a SIGHUP was invisible in the log (the file as it was: no line at all). The real signal, the
    real handler, loop and controller (fakes for the nodes): the reconcile it triggers names it, and so does the
    re-read it asks for."""
    import os
    import signal

    from structlog.testing import capture_logs

    from testbed.proc import wait_for
    from tests.unit.loop.test_controller_loop import Gate, Script, _controller

    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    with capture_logs() as logs:
        c, _ = _controller(desired_path, tmp_path, Script(converged), Gate())
        daemon = Daemon(desired_path, tmp_path / "state", controller=c)
        daemon.requests = c.requests
        daemon.install_signals()
        thread = threading.Thread(target=daemon._loop, daemon=True)
        thread.start()
        try:
            def ends(trigger):
                return [e for e in logs if e["event"] == "reconcile.end" and trigger in e["trigger"]]

            wait_for(lambda: ends("start"), 10, "the first reconcile")
            os.kill(os.getpid(), signal.SIGHUP)
            end = wait_for(lambda: ends("sighup"), 10, "a reconcile that says SIGHUP triggered it")[0]
        finally:
            stop(daemon, thread)
            for sig, handler in saved.items():
                signal.signal(sig, handler)
            import faulthandler
            faulthandler.unregister(signal.SIGUSR1)
    assert end["log_level"] == "info" and end["trigger"] == ["sighup"]
    reread = [e for e in logs if e["event"] == "desired_state.reread"]
    assert reread and reread[-1]["trigger"] == ["sighup"] and reread[-1]["new_generation"] is False


def test_a_crash_is_logged_with_its_triggers_as_text(tmp_path):
    """The typed reasons read in the journal as the strings they always were."""
    from structlog.testing import capture_logs

    fake = FakeController([RuntimeError("bug")])
    with capture_logs() as logs:
        daemon, thread = run_loop(tmp_path, fake)
        try:
            fake.wait_calls(1)
        finally:
            stop(daemon, thread)
    crashed = [e for e in logs if e["event"] == "reconcile.crashed"]
    assert crashed and crashed[0]["trigger"] == ["start"]
