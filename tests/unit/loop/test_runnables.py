"""What the daemon process runs, named in one list (reconciler.loop.runnables): started in its order, stopped in
the reverse one, each stop told whether everything before it ended; and the daemon's own list, which is what
`Daemon._shutdown` stops (it reaches into no controller's internals)."""

from __future__ import annotations

import pytest

from reconciler.loop.daemon import Daemon
from reconciler.loop.runnables import Runnable, Runnables
from tests.unit.loop.test_daemon_loop import FakeController


def test_started_in_order_stopped_in_reverse_and_told_what_ended_before():
    said: list[str] = []

    def stop(name: str, ends: bool):
        def it(_seconds: float, ended: bool) -> bool:
            said.append(f"stop {name} after {'all ended' if ended else 'something still runs'}")
            return ends
        return it

    runnables = Runnables()
    for name, ends in (("sessions", True), ("operations", False), ("streams", True)):
        runnables.add(Runnable(name, start=lambda name=name: said.append(f"start {name}"), stop=stop(name, ends)))
    runnables.start()
    assert not runnables.stop(3.0), "an operation still runs"
    assert said == ["start sessions", "start operations", "start streams",
                    "stop streams after all ended", "stop operations after all ended",
                    "stop sessions after something still runs"]


def test_each_stop_gets_what_is_left_of_the_deadline():
    now = [0.0]
    given: list[float] = []

    def slow(seconds: float, _ended: bool) -> bool:
        given.append(seconds)
        now[0] += 1.0
        return True

    runnables = Runnables()
    for name in ("a", "b", "c"):
        runnables.add(Runnable(name, stop=slow))
    runnables.start()
    assert runnables.stop(2.5, clock=lambda: now[0])
    assert given == [2.5, 1.5, 0.5]


def test_only_what_started_is_stopped_and_a_name_is_listed_once():
    runnables = Runnables()
    stopped: list[str] = []
    runnables.add(Runnable("one", stop=lambda _s, _e: stopped.append("one") or True))
    with pytest.raises(ValueError, match="already"):
        runnables.add(Runnable("one"))
    assert runnables.stop(1.0) and stopped == [], "never started: nothing to stop"


def test_the_daemon_names_everything_it_runs(tmp_path, desired_path):
    import threading

    from reconciler.loop.triggers import ReconcileRequests
    from tests.unit.controllers import make_controller

    c = make_controller(desired_path, tmp_path / "state", ReconcileRequests(), threading.Event(), events=False)
    daemon = Daemon(desired_path, tmp_path / "state", controller=c, manager=c.manager)
    assert daemon.runnables().names() == ["sessions-and-lease", "listener", "image-flags", "operations",
                                          "event-streams", "file-watch", "watchdog", "exit-deadline"]
    made = Daemon(desired_path, tmp_path / "state2")
    assert made.runnables().names() == daemon.runnables().names(), "the daemon builds the manager it lists"


def test_a_daemon_given_only_a_controller_lists_no_manager_of_its_own(tmp_path):
    daemon = Daemon(tmp_path / "cluster.yaml", tmp_path / "state", controller=_Runs())  # type: ignore[arg-type]
    assert daemon.runnables().names() == ["listener", "work", "file-watch", "watchdog", "exit-deadline"]


class _Runs(FakeController):
    def __init__(self) -> None:
        super().__init__([])

    def runnables(self) -> list[Runnable]:
        return [Runnable("work")]


def test_the_shutdown_stops_the_list_last_started_first_and_keeps_the_lease_while_a_step_runs(tmp_path, desired_path):
    """Daemon._shutdown: the streams end, the operations are cancelled and awaited, the listener closes, and the
    manager closes last, told that a step still runs (so the lease is not given back)."""
    import threading

    from reconciler.loop.triggers import ReconcileRequests
    from tests.unit.controllers import make_controller

    c = make_controller(desired_path, tmp_path / "state", ReconcileRequests(), threading.Event(), events=False)
    daemon = Daemon(desired_path, tmp_path / "state", listen="127.0.0.1:0", controller=c, manager=c.manager)
    said: list[str] = []
    c.manager.stop_streams = lambda: said.append("streams")
    c.operations.cancel_all = lambda: said.append("cancel")
    c.operations.join = lambda seconds: said.append("join") or False
    c.manager.close = lambda ended: said.append(f"close ended={ended}")
    runnables = daemon.runnables()
    runnables.start()
    assert daemon.server is not None
    daemon.stopped.set()  # the exit deadline has nothing to force
    daemon.stop.set()
    daemon._shutdown(runnables, deadline=1.0)
    assert said == ["streams", "cancel", "join", "close ended=False"]
