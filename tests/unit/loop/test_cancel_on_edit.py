"""Issue 34: a new generation cancels only the operations it makes wrong, not every one.

The judgement is one pure function, `operations.stale(step, old, new)` (and `verify.verify_stale` for a verify),
tested here from data: an edit of the sample file, and for every step in flight whether it is cancelled (with the
words of its reason) or kept. Then `Operations.cancel_stale` applies it to a batch run by the real executor (only
the step bodies are fakes): a waiting step is vetoed and its batch goes on, a running one ends with its batch, and a
batch whose steps are partly wrong ends cleanly. Then the controller: an edit of max_model_len while a weight sync
is in flight keeps the sync (it cancelled every batch before), an edit of the model cancels it.
"""

from __future__ import annotations

import dataclasses
import os
import threading
from pathlib import Path

import pytest

from reconciler.core.kinds import KINDS, STEP_KINDS
from reconciler.core.planning import Blocker, Plan, Step
from reconciler.core.spec import Desired, load
from reconciler.edge.steps import StepContext
from reconciler.loop.operations import STALE_RULES, Operations, stale
from reconciler.loop.reasons import Reason
from reconciler.loop.verify import verify_stale
from tests.unit.loop.test_controller_loop import HEAD, WORKER, Gate, Script, _controller, _with

H, W = HEAD, WORKER
WEIGHTS = Step("weights", W, "sync", source=H, path="/home/spark/.cache/huggingface/hub")
DOWNLOAD = Step("download", H, "fetch")
IMAGE = Step("image", W, "copy", source=H, image="nvcr.io/nvidia/vllm:26.05-py3", content="sha256:1")
PULL = Step("pull-image", H, "pull")
START_W = Step("start-serving", W, "rank 1", rank=1)
AWAIT = Step("await-health", H, "health")
STOP_CT = Step("stop-container", W, "not allowed", container="intruder")
LINK_H, LINK_W = Step("link", H, "down"), Step("link", W, "down")
PRUNE = Step("prune-weights", W, "older copy", remove=("/home/spark/old",))
ALL = (WEIGHTS, DOWNLOAD, IMAGE, PULL, START_W, AWAIT, STOP_CT, LINK_H, LINK_W, PRUNE)
CHAIN = {START_W.id: "launch spec changed", AWAIT.id: "launch spec changed"}

#: (name, the edit (old text, new text) of the sample file, step id -> words of its reason: every step not named
#: is kept).
CASES = [
    ("max_model_len", ("max_model_len: 32768", "max_model_len: 16384"), CHAIN),
    ("gpu_memory_utilization", ("gpu_memory_utilization: 0.8", "gpu_memory_utilization: 0.7"), CHAIN),
    ("resync_interval", ("resync_interval: 30s", "resync_interval: 45s"), {}),
    ("model id", ("id: Qwen/Qwen3.5-122B-A10B-FP8", "id: Qwen/Qwen3-8B"),
     {WEIGHTS.id: "model", DOWNLOAD.id: "model", PRUNE.id: "retention", **CHAIN}),
    ("revision", ("revision: main", "revision: 0123abc"),
     {WEIGHTS.id: "model", DOWNLOAD.id: "model", PRUNE.id: "retention", **CHAIN}),
    ("model path", ("path: /home/spark/.cache/huggingface/hub", "path: /srv/models"),
     {WEIGHTS.id: "model", DOWNLOAD.id: "model", PRUNE.id: "retention", **CHAIN}),
    ("image", ("image: nvcr.io/nvidia/vllm:26.05-py3", "image: nvcr.io/nvidia/vllm:26.06-py3"),
     {IMAGE.id: "serving image", PULL.id: "serving image", PRUNE.id: "retention", **CHAIN}),
    ("co-tenant allowed", ("spark-5be3: [vllm_embeddings]", "spark-5be3: [vllm_embeddings, intruder]"),
     {STOP_CT.id: "intruder may now run on spark-5be3"}),
    ("worker's ssh host", ("host: 192.168.200.13", "host: 192.168.200.14"),
     {s.id: f"the connection to {W} changed" for s in ALL if W in (s.node, s.source)}),
    ("head's fabric address", ("address: 192.168.200.12/24", "address: 192.168.200.22/24"),
     {LINK_H.id: f"the fabric of {H} changed", WEIGHTS.id: f"the fabric of {H} changed",
      IMAGE.id: f"the fabric of {H} changed", **CHAIN}),
    ("paused", ("paused: false", "paused: true"), {s.id: "no longer enforces" for s in ALL}),
    ("observe", ("mode: enforce", "mode: observe"), {s.id: "no longer enforces" for s in ALL}),
    ("another head", ("host: 10.1.230.180", "host: 10.1.230.181"),
     {s.id: "the cluster's lease is given back" for s in ALL}),
]


def edited(base: Path, tmp_path: Path, old: str, new: str) -> Desired:
    text = base.read_text()
    assert text.count(old) == 1, f"the edit {old!r} must name one place of the sample file"
    path = tmp_path / "edited.yaml"
    path.write_text(text.replace(old, new))
    return load(path, os.environ)


@pytest.mark.parametrize(("name", "edit", "cancelled"), CASES, ids=[c[0] for c in CASES])
def test_a_new_generation_cancels_exactly_the_steps_it_makes_wrong(desired_path, tmp_path, name, edit, cancelled):
    old, new = load(desired_path, os.environ), edited(desired_path, tmp_path, *edit)
    judged = {s.id: stale(s, old, new) for s in ALL}
    assert {sid for sid, why in judged.items() if why} == set(cancelled), name
    for sid, words in cancelled.items():
        assert words in str(judged[sid]), (sid, judged[sid])


def without_the_worker(base: Path, tmp_path: Path) -> Desired:
    """The sample file with its worker removed: its node entry, its co-tenants, and tensor parallel 1 (the head
    alone serves), so the file stays valid."""
    text = base.read_text()
    block = text[text.index(f"  - name: {W}\n"):text.index("\nmodel:")]
    for old, new in ((block, ""), ("tensor_parallel_size: 2", "tensor_parallel_size: 1"),
                     (f"    {W}: [vllm_embeddings]\n", "")):
        assert text.count(old) == 1, f"the edit {old[:40]!r} must name one place of the sample file"
        text = text.replace(old, new)
    path = tmp_path / "edited.yaml"
    path.write_text(text)
    return load(path, os.environ)


def test_a_node_removed_from_the_file_cancels_its_steps_with_that_reason(desired_path, tmp_path):
    """docs/architecture.md: "any step whose node is no longer declared" is cancelled; the edit table above has no
    such row (a removal is several edits of the file). Every step on the worker, or copying from it, says why."""
    old, new = load(desired_path, os.environ), without_the_worker(desired_path, tmp_path)
    assert W not in {n.name for n in new.nodes}
    on_worker = [s for s in ALL if W in (s.node, s.source)]
    assert on_worker, "the table's steps include the worker's"
    for step in on_worker:
        assert stale(step, old, new) == f"{W} is no longer declared", step.id
    assert stale(LINK_H, old, new) is None, "the head's own link is the head's: it runs on"


def test_the_same_desired_state_cancels_nothing(desired_path):
    desired = load(desired_path, os.environ)
    assert [stale(s, desired, desired) for s in ALL] == [None] * len(ALL)


def test_every_step_kind_has_its_judgement():
    """A new step kind cannot be forgotten: `stale` looks its kind's rule up (`StepKindInfo.stale`), and this says
    every kind's rule is there."""
    assert {KINDS[kind].stale for kind in STEP_KINDS} <= set(STALE_RULES)


VERIFY_CASES = [
    ("max_model_len", ("max_model_len: 32768", "max_model_len: 16384"), False, None),
    ("resync_interval", ("resync_interval: 30s", "resync_interval: 45s"), True, None),
    ("revision", ("revision: main", "revision: 0123abc"), False, f"the weights to verify on {W} changed"),
    ("model path", ("path: /home/spark/.cache/huggingface/hub", "path: /srv/models"), False, "weights to verify"),
    ("worker's ssh host", ("host: 192.168.200.13", "host: 192.168.200.14"), False, "weights to verify"),
    ("paused, a check", ("paused: false", "paused: true"), False, None),
    ("paused, a repair", ("paused: false", "paused: true"), True, "a repair ends"),
]


@pytest.mark.parametrize(("name", "edit", "repair", "words"), VERIFY_CASES, ids=[c[0] for c in VERIFY_CASES])
def test_a_new_generation_cancels_a_verify_only_when_the_weights_it_checks_changed(
        desired_path, tmp_path, name, edit, repair, words):
    old, new = load(desired_path, os.environ), edited(desired_path, tmp_path, *edit)
    why = verify_stale(old, new, [W], repair)
    assert (why is None) == (words is None), (name, why)
    assert words is None or words in str(why)


# -- Operations.cancel_stale over the real executor ----------------------------------------------------------------


class Bodies:
    """The step bodies (`steps.runner`), each running until the test ends it or its batch is cancelled."""

    def __init__(self):
        self.started: dict[str, threading.Event] = {}
        self.finish: dict[str, threading.Event] = {}
        self.ended: dict[str, threading.Event] = {}

    def runner(self, kind):
        def body(ctx, step):
            self.started.setdefault(step.id, threading.Event()).set()
            done = self.finish.setdefault(step.id, threading.Event())
            try:
                while not done.wait(0.01):
                    if ctx.cancel.is_set():
                        raise InterruptedError("cancelled")
                    assert ctx.remaining() > 1, "the test never ended the step"
            finally:
                self.ended.setdefault(step.id, threading.Event()).set()
        return body

    def wait_ended(self, step: Step) -> None:
        assert self.ended.setdefault(step.id, threading.Event()).wait(10), f"{step.id} never ended"

    def wait_started(self, step: Step) -> None:
        assert self.started.setdefault(step.id, threading.Event()).wait(10), f"{step.id} never started"

    def end(self, step: Step) -> None:
        self.finish.setdefault(step.id, threading.Event()).set()


@pytest.fixture
def running(monkeypatch, desired_path):
    """A sync with the serving chain after it in one batch (as one reconcile admits them), on the real executor."""
    bodies = Bodies()
    monkeypatch.setattr("reconciler.edge.execute.runner", bodies.runner)
    ended = threading.Event()
    ops = Operations(on_end=ended.set)
    stop = dataclasses.replace(Step("stop-serving", H, "restart", container="vllm_serving"), after=(WEIGHTS.id,))
    start = dataclasses.replace(START_W, after=(stop.id,))
    ctx = StepContext(desired=load(desired_path, os.environ), sessions=None, observed=None)  # type: ignore[arg-type]
    ops.launch([WEIGHTS, IMAGE, stop, start], ctx, on_event=lambda e, f: None)
    bodies.wait_started(WEIGHTS)
    bodies.wait_started(IMAGE)
    yield ops, bodies, ended, stop, start
    for step in (WEIGHTS, IMAGE, stop, start):
        bodies.end(step)
    assert ops.join(10)


def test_a_waiting_step_made_wrong_is_skipped_and_its_batch_goes_on(running):
    ops, bodies, ended, stop, start = running
    cancelled = ops.cancel_stale(lambda s: "the launch spec changed" if s.kind in ("stop-serving",
                                                                                   "start-serving") else None)
    assert cancelled == {stop.id: "the launch spec changed", start.id: "the launch spec changed"}
    assert {s.id for s in ops.busy()} == {WEIGHTS.id, IMAGE.id, stop.id, start.id}, "still in its batch"
    bodies.end(WEIGHTS)
    bodies.end(IMAGE)
    assert ended.wait(10), "the batch ends cleanly"
    results = {r.step.id: r for r in ops.drain()}
    assert {sid: r.result for sid, r in results.items()} == {
        WEIGHTS.id: "success", IMAGE.id: "success", stop.id: "skipped", start.id: "skipped"}
    assert results[stop.id].message == "cancelled: the launch spec changed"
    assert stop.id not in bodies.started, "a vetoed step never runs"
    assert ops.busy() == []


def test_a_running_step_made_wrong_is_cancelled_alone_and_its_batch_goes_on(running):
    """Each step has its own cancel: an image no longer wanted ends its copy, not the weight sync admitted
    beside it (a batch-wide cancel ended both, and the sync started again from its partial data)."""
    ops, bodies, ended, stop, start = running
    assert ops.cancel_stale(lambda s: "the image changed" if s.kind == "image" else None) == {
        IMAGE.id: "the image changed"}
    bodies.wait_ended(IMAGE)
    assert {s.id for s in ops.busy()} >= {WEIGHTS.id, stop.id, start.id}, "the sync and its chain go on"
    for step in (WEIGHTS, stop, start):
        bodies.end(step)
    assert ended.wait(10), "the batch ends cleanly"
    results = {r.step.id: r.result for r in ops.drain()}
    assert results == {WEIGHTS.id: "success", IMAGE.id: "cancelled", stop.id: "success", start.id: "success"}
    assert ops.busy() == [] and ops.view() == []


def test_nothing_made_wrong_cancels_nothing(running):
    ops, bodies, ended, stop, start = running
    assert ops.cancel_stale(lambda s: None) == {}
    for step in (WEIGHTS, IMAGE):
        bodies.end(step)
    bodies.wait_started(stop)
    bodies.end(stop)
    bodies.wait_started(start)
    bodies.end(start)
    assert ended.wait(10)
    assert {r.result for r in ops.drain()} == {"success"}


# -- the controller: an edit while a weight sync is in flight ---------------------------------------------------


def _syncing(desired_path, tmp_path, converged):
    gate = Gate()
    c, _ = _controller(desired_path, tmp_path, Script(_with(converged, WORKER, weights=None)), gate)
    c.reconcile({Reason("start")})
    assert gate.batches == [[f"weights/{WORKER}"]]
    return c, gate


def test_an_edit_of_max_model_len_keeps_the_weight_sync_in_flight(desired_path, tmp_path, converged):
    """It cancelled every batch before (Controller._end_generation: cancel_all): a 12-hour sync lost for an edit
    that changes only the launch."""
    c, gate = _syncing(desired_path, tmp_path, converged)
    try:
        desired_path.write_text(desired_path.read_text().replace("max_model_len: 32768", "max_model_len: 16384"))
        c.reconcile({Reason("file")})
        assert c.store.generation == 2
        assert not gate.cancelled(f"weights/{WORKER}"), "the sync was cancelled"
        assert [s.id for s in c.operations.busy()] == [f"weights/{WORKER}"]
        assert gate.batches == [[f"weights/{WORKER}"]], "nothing else started beside it"
    finally:
        gate.release.set()
        assert c.operations.join(20)
    assert [r.result for r in c.operations.drain()] == ["success"]


def test_an_edit_of_the_model_cancels_the_weight_sync_in_flight(desired_path, tmp_path, converged):
    c, gate = _syncing(desired_path, tmp_path, converged)
    try:
        desired_path.write_text(desired_path.read_text().replace("revision: main", "revision: 0123abc"))
        c.reconcile({Reason("file")})
        assert gate.cancelled(f"weights/{WORKER}")
    finally:
        gate.release.set()
        assert c.operations.join(20)
    results = {r.step.id: r.result for r in c.operations.drain()}
    assert results[f"weights/{WORKER}"] == "cancelled"


# -- the plan is not mutated --------------------------------------------------------------------------------------


class HeldElsewhere:
    """The head's lease companion answers that another reconciler holds the cluster."""

    def __init__(self, desired):
        pass

    def __getitem__(self, node):
        return self

    def companion(self, argv, *, timeout, stdin, open_timeout):
        import contextlib

        class Refused:
            def line(self, timeout):
                return "held\tapply pid 7 on laptop for /home/me/cluster.yaml"

            def end(self, timeout):
                from reconciler.edge.ssh import Result

                return Result("", "", 0)

        return contextlib.nullcontext(Refused())

    def update(self, desired):
        pass

    def close(self):
        pass


def test_a_lease_held_elsewhere_is_a_blocker_of_a_new_plan_the_planned_one_untouched(
        desired_path, tmp_path, converged, monkeypatch):
    """Finding 5: the controller appended the blocker to the frozen Plan `planning.plan` returned."""
    from reconciler.core import planning
    from reconciler.loop.triggers import ReconcileRequests
    from tests.unit.controllers import make_controller

    planned: list[Plan] = []
    original = planning.plan

    def plan(desired, observed):
        planned.append(original(desired, observed))
        return planned[-1]

    monkeypatch.setattr("reconciler.loop.controller.planning.plan", plan)
    c = make_controller(desired_path, tmp_path / "state", ReconcileRequests(), threading.Event(), events=False,
                   observe_fn=Script(_with(converged, WORKER, weights=None)), sessions_factory=HeldElsewhere,
                   operations=Operations(on_end=lambda: None, run=Gate()))
    c.reconcile({Reason("start")})
    [first] = planned
    assert first.blocked == [], "the plan as planned is not changed afterwards"
    blocked = c.status["lastPlan"]["blocked"]
    assert [b["reason"] for b in blocked] == [
        "nothing starts: the cluster is held by apply pid 7 on laptop for /home/me/cluster.yaml"]
    assert Blocker(HEAD, blocked[0]["reason"]) not in first.blocked


def test_a_judgement_that_crashes_cancels_the_step_and_the_generation_is_still_taken(
        desired_path, tmp_path, converged, monkeypatch):
    """The new generation is recorded before the steps are judged: a bug in the judgement must not leave the old
    desired state enforced under the new generation's number (the file would never be read again)."""
    c, gate = _syncing(desired_path, tmp_path, converged)

    def broken(step, old, new):
        raise KeyError("bug")

    monkeypatch.setattr("reconciler.loop.enforcement.stale", broken)
    try:
        desired_path.write_text(desired_path.read_text().replace("max_model_len: 32768", "max_model_len: 16384"))
        c.reconcile({Reason("file")})
        assert c.store.generation == 2 and c.desired is not None and c.desired.serving.max_model_len == 16384
        assert gate.cancelled(f"weights/{WORKER}"), "a step not judged is cancelled"
    finally:
        gate.release.set()
        assert c.operations.join(20)
