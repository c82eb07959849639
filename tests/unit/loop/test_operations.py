"""Operations beside the loop: what may start next to what (`admit`), and the tracker's bookkeeping.

The executor is replaced by a fake that blocks until the test releases it, so "in flight" is a fact of the test,
not a race; the clock is a fake too.
"""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

from reconciler.core.observed import ServeFlags
from reconciler.core.planning import Step
from reconciler.edge.execute import Outcome, StepResult
from reconciler.edge.steps import StepContext
from reconciler.loop.operations import FlagsQuery, Operations, admit

WEIGHTS = Step("weights", "w", "sync")
LINK_H = Step("link", "h", "down")
STOP_CT = Step("stop-container", "w", "not allowed", container="x")
STOP_SERVING = Step("stop-serving", "h", "restart", (WEIGHTS.id,), container="vllm")
START_W = Step("start-serving", "w", "rank 1", (STOP_SERVING.id,))
START_H = Step("start-serving", "h", "rank 0", (START_W.id,))
AWAIT = Step("await-health", "h", "health", (START_H.id,))
PLAN = [LINK_H, STOP_CT, WEIGHTS, STOP_SERVING, START_W, START_H, AWAIT]


def ids(steps):
    return [s.id for s in steps]


def test_nothing_in_flight_everything_is_admitted():
    admitted, waiting = admit(PLAN, [])
    assert ids(admitted) == ids(PLAN) and waiting == {}


def test_a_weight_sync_in_flight_lets_link_and_co_tenant_repairs_run_but_not_what_comes_after_it():
    admitted, waiting = admit(PLAN, [WEIGHTS])
    assert ids(admitted) == [LINK_H.id, STOP_CT.id]
    assert waiting[WEIGHTS.id] == "already in flight"
    assert set(waiting) == {WEIGHTS.id, STOP_SERVING.id, START_W.id, START_H.id, AWAIT.id}
    assert "weights/w, which is in flight" in waiting[STOP_SERVING.id]
    assert "stop-serving/h/vllm, which is waiting" in waiting[START_W.id]


def test_any_part_of_the_serving_chain_in_flight_holds_the_whole_chain():
    """A restart is one ordered unit: with await-health of the last restart still running, a new restart's stop
    (which has no dependency in common with it) must not start."""
    plan = [LINK_H, Step("stop-serving", "w", "restart", container="vllm"), START_W]
    admitted, waiting = admit(plan, [AWAIT])
    assert ids(admitted) == [LINK_H.id]
    assert waiting["stop-serving/w/vllm"] == "the serving chain is in flight (await-health/h)"


def test_vetoed_steps_wait_with_their_reason_and_so_do_their_dependants():
    admitted, waiting = admit(PLAN, [], {WEIGHTS.id: "held after 5 failure(s)"})
    assert ids(admitted) == [LINK_H.id, STOP_CT.id]
    assert waiting[WEIGHTS.id] == "held after 5 failure(s)"
    assert AWAIT.id in waiting


class Gate:
    """A fake executor: records each batch, emits step.start for every step, and returns once released."""

    def __init__(self):
        self.release = threading.Event()
        self.batches: list[list[str]] = []
        self.entered = threading.Semaphore(0)

    def __call__(self, plan, ctx, on_event, skip=lambda step: None, cancel_of=None):
        self.batches.append(ids(plan.steps))
        for step in plan.steps:
            on_event("step.start", {"step": step})
        self.entered.release()
        assert self.release.wait(10), "the test never released the batch"
        results = [StepResult(s, "failed" if s.kind == "weights" else "success", 1.0, "boom") for s in plan.steps]
        for r in results[:1]:  # one reported through the event, the others only in the outcome
            on_event("step.end", {"result": r})
        return Outcome(results)


def Ctx() -> StepContext:
    """A StepContext with just what Operations reads: the step timeouts."""
    timeouts = SimpleNamespace(weights_sync=43200.0, image_sync=3600.0, step=120.0)
    desired = SimpleNamespace(policy=SimpleNamespace(timeouts=timeouts), serving=SimpleNamespace(health_timeout=3600.0))
    return StepContext(desired=desired, sessions=None, observed=None)  # type: ignore[arg-type]


@pytest.fixture
def tracked():
    gate, ended = Gate(), threading.Event()
    clock = [1000.0]
    ops = Operations(on_end=ended.set, clock=lambda: clock[0], run=gate)
    yield ops, gate, ended, clock
    gate.release.set()
    assert ops.join(10)


def test_a_launched_batch_is_busy_until_its_results_are_drained(tracked):
    ops, gate, ended, clock = tracked
    ops.launch([WEIGHTS, STOP_CT], Ctx(), on_event=lambda e, f: None)
    assert gate.entered.acquire(timeout=10)
    assert set(ids(ops.busy())) == {WEIGHTS.id, STOP_CT.id}
    clock[0] += 30
    ops.progress("weights", "w", 2**26, 2**27)
    view = {v["step"]: v for v in ops.view()}
    assert view[WEIGHTS.id]["bytesDone"] == 2**26 and view[WEIGHTS.id]["bytesTotal"] == 2**27
    assert view[WEIGHTS.id]["state"] == "running" and view[WEIGHTS.id]["seconds"] == 30.0
    assert view[WEIGHTS.id]["deadlineIn"] == 43200.0 - 30
    assert view[STOP_CT.id]["deadlineIn"] == 120.0 - 30
    assert view[WEIGHTS.id]["bytesPerSecond"] is None, "one report is no rate yet"
    clock[0] += 8
    ops.progress("weights", "w", 2**26 + 8 * 10**9, 2**36)
    view = {v["step"]: v for v in ops.view()}
    assert view[WEIGHTS.id]["bytesPerSecond"] == 10**9, "from the first report, not from the launch"
    assert view[STOP_CT.id]["bytesPerSecond"] is None

    gate.release.set()
    assert ended.wait(10), "a batch's end is a trigger"
    assert ops.view() == []
    assert set(ids(ops.busy())) == {WEIGHTS.id, STOP_CT.id}, "ended, but not drained: must not start again yet"
    results = {r.step.id: r.result for r in ops.drain()}
    assert results == {WEIGHTS.id: "failed", STOP_CT.id: "success"}, "each result handed out once"
    assert ops.drain() == [] and ops.busy() == []


def test_an_executor_that_crashes_still_frees_its_steps_with_a_failure(tracked):
    _, _, _, clock = tracked
    ended = threading.Event()

    def broken(plan, ctx, on_event, skip, cancel_of):
        raise RuntimeError("bug")

    ops = Operations(on_end=ended.set, clock=lambda: clock[0], run=broken)
    ops.launch([LINK_H], Ctx(), on_event=lambda e, f: None)
    assert ended.wait(10)
    [result] = ops.drain()
    assert result.result == "failed" and "RuntimeError('bug')" in result.message
    assert ops.busy() == []


def test_the_flag_list_is_asked_once_beside_the_loop_and_its_answer_is_a_trigger():
    asked, answered, release = [], threading.Event(), threading.Event()

    def ask(holder, image_id):
        asked.append((holder, image_id))
        assert release.wait(10)
        return ServeFlags(image_id=image_id, flags=["--max-model-len"])

    query = FlagsQuery(ask, on_answer=answered.set)
    assert query.get(None) is None
    first = query.get(("h", "sha256:1"))
    assert first is not None and first.pending
    again = query.get(("h", "sha256:1"))
    assert again is not None and again.pending
    release.set()
    assert answered.wait(10)
    done = query.get(("h", "sha256:1"))
    assert done is not None and not done.pending and done.flags == ["--max-model-len"]
    assert asked == [("h", "sha256:1")], "asked once per image id"


def test_a_question_that_raises_still_answers_so_serving_does_not_wait_forever():
    answered = threading.Event()

    def ask(holder, image_id):
        raise OSError("channel refused")

    query = FlagsQuery(ask, on_answer=answered.set)
    query.get(("h", "sha256:2"))
    assert answered.wait(10)
    answer = query.get(("h", "sha256:2"))
    assert answer is not None and not answer.pending and "channel refused" in (answer.error or "")


def test_an_answer_that_could_not_be_had_is_asked_again_with_backoff_never_kept():
    """Issue 29: a failed question once judged nothing for the life of the daemon; now it refuses, then asks again."""
    now, calls, answered = [100.0], [], threading.Event()

    def ask(holder, image_id):
        calls.append(now[0])
        return ServeFlags(image_id=image_id, error="exec format error") if len(calls) < 3 else \
            ServeFlags(image_id=image_id, flags=["--port"])

    def settled():
        assert answered.wait(10)
        answered.clear()
        return query.get(("h", "sha256:3"))

    query = FlagsQuery(ask, on_answer=answered.set, clock=lambda: now[0])
    query.get(("h", "sha256:3"))
    assert settled().error == "exec format error"
    now[0] += 14.0
    assert query.get(("h", "sha256:3")).error == "exec format error" and calls == [100.0]
    now[0] += 1.0  # 15 s after the failure
    assert query.get(("h", "sha256:3")).pending
    assert settled().error == "exec format error" and calls == [100.0, 115.0]
    now[0] += 29.0
    assert query.get(("h", "sha256:3")).error, "the wait doubled: 30 s"
    now[0] += 1.0
    query.get(("h", "sha256:3"))
    assert settled().flags == ["--port"] and calls == [100.0, 115.0, 145.0]
    now[0] += 10_000
    assert query.get(("h", "sha256:3")).flags == ["--port"] and len(calls) == 3, "a real answer is kept"


def test_cancel_all_reaches_every_batch_and_each_of_its_steps():
    ended, seen = threading.Event(), []

    def waits_for_cancel(plan, ctx, on_event, skip, cancel_of):
        seen.append(ctx.cancel.wait(10) and all(cancel_of(s).is_set() for s in plan.steps))
        return Outcome([StepResult(s, "cancelled", 0.0, "shutting down") for s in plan.steps])

    ops = Operations(on_end=ended.set, run=waits_for_cancel)
    ctx = Ctx()
    ctx.cancel = threading.Event()
    ops.launch([WEIGHTS], ctx, on_event=lambda e, f: None)
    ops.launch([LINK_H], ctx, on_event=lambda e, f: None)
    assert ops.cancel_all() == 2
    assert ops.join(10) and seen == [True, True]
    assert not ctx.cancel.is_set(), "the loop's own event is not touched: only the batches are cancelled"
    assert {r.result for r in ops.drain()} == {"cancelled"}
