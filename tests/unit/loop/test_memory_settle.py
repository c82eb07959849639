"""After a stop, GB10 hands the stopped generation's memory back with a lag of up to a minute (sovgrid.org,
"SGLang Restart OOM Fix"). A start that follows a stop on its node reads MemAvailable again until it suffices or
the settle time ends; then it is deferred — said, tried again at the next reconcile, never counted toward backoff
and holds (issue 30, finding 4). A start with no stop before it blocks at once, as before."""

from __future__ import annotations

import threading
import time

import pytest

from reconciler.core.observed import NodeObservation, Observed
from reconciler.core.planning import Step
from reconciler.edge import execute
from reconciler.edge.ssh import Result
from reconciler.edge.steps import StepBlocked, StepContext, StepDeferred, StepFailed, serving
from testbed.recordings import answer
from tests.unit.recorded import load

GIB_KB = 1 << 20


class Node:
    """/proc/meminfo as a node returns memory: `available` GiB, one value per read, the last one repeated."""

    def __init__(self, *available: int):
        self.available, self.reads, self.ran = list(available), 0, []

    def run(self, argv, *, timeout, sudo=False, stdin=None, check=True, on_output=None, cancel=None,
            supervised=False):  # the drop before the start (policy.drop_caches)
        self.ran.append(argv[0])
        return Result("", "", 0)

    def run_script(self, script, timeout, cancel=None):
        assert "/proc/meminfo" in script
        value = self.available[min(self.reads, len(self.available) - 1)]
        self.reads += 1
        return Result(answer(script, f"@@meminfo\nMemTotal: {8 * GIB_KB} kB\nMemAvailable: {value * GIB_KB} kB\n"
                                     "@@rc 0\n"), "", 0)


def _preflight(node: Node, after_stop: bool, seconds: float = 300, cancel: threading.Event | None = None) -> None:
    """The preflight through the one executor (`StepContext.perform`): its waits under the step's real deadline."""
    desired = load()
    answered = Observed(nodes={n.name: NodeObservation(name=n.name, reachable=True) for n in desired.nodes})
    ctx = StepContext(desired=desired, sessions={"worker1": node}, observed=answered,
                      deadline=time.monotonic() + seconds, cancel=cancel or threading.Event())
    ctx.perform(serving.memory_preflight(ctx.given, "worker1", after_stop))


@pytest.fixture(autouse=True)
def quick_polls(monkeypatch):
    monkeypatch.setattr(serving, "SETTLE_POLL", 0.01)


def test_memory_that_comes_back_after_the_stop_lets_the_start_go_on():
    node = Node(0, 0, 0, 7)  # the recorded cluster needs 1.4 GiB; the fourth read has it
    _preflight(node, after_stop=True)
    assert node.reads == 4


def test_memory_that_does_not_come_back_in_time_defers_the_start(monkeypatch):
    monkeypatch.setattr(serving, "MEMORY_SETTLE", 0.05)
    with pytest.raises(StepDeferred, match="after the stop on worker1"):
        _preflight(Node(0), after_stop=True)


def test_without_a_stop_before_it_a_short_node_blocks_at_once():
    node = Node(0, 7)
    with pytest.raises(StepBlocked) as blocked:
        _preflight(node, after_stop=False)
    assert not isinstance(blocked.value, StepDeferred) and node.reads == 1


def test_a_shutdown_during_the_settle_is_no_deferral():
    """The executor ends the wait on a shutdown; the step says so (cancelled), never `deferred`."""
    cancel = threading.Event()
    cancel.set()
    with pytest.raises(StepFailed, match="cancelled while waiting for memory") as failed:
        _preflight(Node(0), after_stop=True, cancel=cancel)
    assert not isinstance(failed.value, StepBlocked)


def test_the_settle_applies_to_a_start_after_a_stop_on_its_node():
    stop = Step("stop-serving", "worker1", "r", container="vllm_serving")
    other = Step("stop-container", "head", "r", container="reranker")
    assert serving._after_a_stop(Step("start-serving", "worker1", "r", (stop.id,), rank=1))
    assert not serving._after_a_stop(Step("start-serving", "worker1", "r", (other.id,), rank=1))


def test_a_deferred_start_is_a_result_of_its_own(monkeypatch):
    """The executor says `deferred`; the controller counts only `failed` and `blocked` toward holds."""
    def short(ctx, step):
        raise StepDeferred("memory not yet back")

    monkeypatch.setattr(execute, "runner", lambda kind: short)
    ctx = StepContext(desired=load(), sessions={}, observed=Observed(nodes={}), cancel=threading.Event())
    result = execute.run_step(ctx, Step("start-serving", "worker1", "r", rank=1), lambda e, f: None)
    assert result.result == "deferred" and "not yet back" in result.message


def test_the_controller_holds_nothing_for_a_deferred_start(tmp_path):
    from reconciler.core.spec import Retries
    from reconciler.edge.execute import StepResult
    from reconciler.loop.backoff import Backoff
    from reconciler.loop.triggers import ReconcileRequests
    from tests.unit.controllers import make_controller

    desired, state = tmp_path / "cluster.yaml", tmp_path / "state"
    desired.write_text("not read by this test\n")
    state.mkdir()
    controller = make_controller(desired, state, ReconcileRequests(), threading.Event())
    controller.enforcement.backoff = Backoff(Retries())
    start = Step("start-serving", "worker1", "r", rank=1)
    failures = controller._record([StepResult(start, "deferred", 90.0, "memory not yet back")])
    assert failures == [f"{start.id}: memory not yet back"], "said in status"
    assert controller.backoff.wait_reason(start.id, now=0.0) is None, "and tried again at once"
    controller._record([StepResult(start, "blocked", 0.1, "a foreign container")])
    assert controller.backoff.wait_reason(start.id, now=0.0) is not None, "a real block backs off"


def test_a_step_with_no_time_left_for_the_wait_defers_at_once():
    """The settle never eats the time the start itself needs (`START_RESERVE`, the wait's `reserve`): with less
    left, the wait reads once more (a memory back by then is used) and the start is deferred, not failed."""
    node = Node(0)
    with pytest.raises(StepDeferred):
        _preflight(node, after_stop=True, seconds=30)
    assert node.reads == 2, "the first read, and the wait's one read (no time for a second)"
