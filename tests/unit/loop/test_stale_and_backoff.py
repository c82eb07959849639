"""The loop's pure parts beside the conditions: what a new generation makes stale (reconciler/loop/operations.py), the
tracker's bookkeeping of a batch, the head's health history (health_watch.py) and a step's wait reason
(backoff.py), on the cases the first mutation run over the loop found untested (docs/mutation-survivors-edge.md:
`loop.operations.*`, `loop.health_watch.*`, `loop.backoff.*`).

The expectations come from the modules' contracts and docs/troubleshooting.md, not from the code: a per-node
`model.path` (docs/desired-state.md) is the case the stale judgements of the weights and of retention were never
run on; docker's StartedAt is RFC 3339 in UTC with nanoseconds whatever the reconciler host's timezone.
"""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

from reconciler.core.observed import ServeFlags
from reconciler.core.planning import Step
from reconciler.core.spec import Desired, Retries, load
from reconciler.edge.execute import Outcome, StepResult
from reconciler.loop.backoff import Backoff
from reconciler.loop.operations import FlagsQuery, Operations, model_on, stale, verify_waits
from tests.unit.loop.test_operations import Ctx

H, W = "spark-1a32", "spark-5be3"
MODEL = "Qwen/Qwen3.5-122B-A10B-FP8"
HUB = "/home/spark/.cache/huggingface/hub"
TREE = f"models--{MODEL.replace('/', '--')}"
PATH = f"path: {HUB}"
PER_NODE = f"path: {{{H}: {HUB}, {W}: /srv/models/hub}}"
TP1 = ("tensor_parallel_size: 2", "tensor_parallel_size: 1")

WEIGHTS = Step("weights", W, "sync", source=H, path="/srv/models/hub")
DOWNLOAD = Step("download", H, "fetch")
START_W = Step("start-serving", W, "rank 1", rank=1)
STOP_CT = Step("stop-container", W, "not allowed", container="intruder")
PRUNE = Step("prune-weights", W, "older copy", remove=("/srv/models/old",))


@pytest.fixture
def sample(cluster_yaml, tmp_path):
    """The sample file with edits (old text, new text), each naming one place of it, loaded as the daemon does."""
    count = iter(range(100))

    def edited(*edits: tuple[str, str]) -> Desired:
        text = cluster_yaml.read_text()
        for old, new in edits:
            assert text.count(old) == 1, old
            text = text.replace(old, new)
        path = tmp_path / f"cluster-{next(count)}.yaml"
        path.write_text(text)
        return load(path, {"VLLM_API_KEY": "test-key"})

    return edited


# ------------------------------------------------------------------------------------------------ model_on

def test_a_per_node_path_gives_each_node_its_own_tree_and_the_source_s(sample):
    """docs/desired-state.md: `model.path` is a path on every node or a mapping node -> path. A copy to the worker
    writes the worker's tree and reads the source's."""
    desired = sample((PATH, PER_NODE))
    assert model_on(desired, W) == (MODEL, "main", "hf-cache", H, f"/srv/models/hub/{TREE}", f"{HUB}/{TREE}")
    assert model_on(desired, H) == (MODEL, "main", "hf-cache", H, f"{HUB}/{TREE}", f"{HUB}/{TREE}")


def test_a_node_the_per_node_path_does_not_name_has_no_tree(sample):
    """With tensor parallel 1 the worker does not serve, so the mapping may leave it out: it has no tree."""
    desired = sample(TP1, (PATH, f"path: {{{H}: {HUB}}}"))
    assert model_on(desired, W) == (MODEL, "main", "hf-cache", H, None, f"{HUB}/{TREE}")


# ------------------------------------------------------------------------------------------------ stale

def test_with_per_node_paths_an_edit_of_the_launch_keeps_the_weight_copies_and_the_retention(sample):
    """The issue-34 promise (an edit of max_model_len leaves a 12-hour weight sync running) holds for a per-node
    `model.path` too: the weights, the download and a removal by retention are kept; the serving chain is not."""
    old = sample((PATH, PER_NODE))
    new = sample((PATH, PER_NODE), ("max_model_len: 32768", "max_model_len: 16384"))
    assert [stale(s, old, new) for s in (WEIGHTS, DOWNLOAD, PRUNE)] == [None, None, None]
    assert stale(START_W, old, new) == f"the launch spec changed (spec hash of {H}, {W})"


def test_the_launch_spec_names_only_the_nodes_whose_spec_changed(sample):
    """The worker's own model path changes the worker's launch (its mount), not the head's."""
    old, new = sample(), sample((PATH, PER_NODE))
    assert stale(START_W, old, new) == f"the launch spec changed (spec hash of {W})"


def test_a_node_that_leaves_the_serving_group_is_named_among_the_changed_launches(sample):
    old, new = sample(), sample(TP1)
    assert stale(START_W, old, new) == f"the launch spec changed (spec hash of {H}, {W})"


def test_a_download_whose_node_loses_the_internet_is_cancelled(sample):
    old, new = sample(), sample(("internet: true", "internet: false"))
    assert stale(DOWNLOAD, old, new) == f"{H} may no longer reach the internet"


def test_a_co_tenant_now_protected_is_not_stopped(sample):
    """docs/desired-state.md: `co_tenants.protected` containers are never touched, whatever else the file says."""
    old, new = sample(), sample(("protected: {}", f"protected: {{{W}: [intruder]}}"))
    assert stale(STOP_CT, old, new) == f"intruder may now run on {W} (co_tenants)"
    elsewhere = sample(("protected: {}", f"protected: {{{H}: [intruder]}}"))
    assert stale(STOP_CT, old, elsewhere) is None, "protected on the other node only"


def test_a_verify_waits_for_a_download_on_its_source():
    """A download writes the tree the verify hashes on the source (operations.VERIFY_CONFLICTS)."""
    assert verify_waits(W, H, [DOWNLOAD]) == f"download/{H} is in flight"
    assert verify_waits(W, H, [Step("link", H, "mtu")]) is None


# ------------------------------------------------------------------------------------------------ Operations

LINK_H = Step("link", "h", "down")
IMAGE_H = Step("image", "h", "copy")
WEIGHTS_H = Step("weights", "h", "sync")


class Held:
    """A fake executor that emits step.start for each step, then waits until the test lets it go (at most 5 s, so
    a test that never does still ends), asks `skip` for each step and returns their results."""

    def __init__(self):
        self.go = threading.Event()
        self.started = threading.Semaphore(0)
        self.skipped: list[str | None] = []
        self.threads: list[tuple[str, bool]] = []

    def __call__(self, plan, ctx, on_event, skip, cancel_of):
        me = threading.current_thread()
        self.threads.append((me.name, me.daemon))
        for step in plan.steps:
            on_event("step.start", {"step": step})
        self.started.release()
        self.go.wait(5)
        results = []
        for step in plan.steps:
            why = skip(step)
            self.skipped.append(why)
            results.append(StepResult(step, "cancelled" if why else "success", 1.0, why or ""))
        return Outcome(results)


@pytest.fixture
def held():
    run, ended, clock, events = Held(), threading.Semaphore(0), [1000.0], []
    ops = Operations(on_end=ended.release, clock=lambda: clock[0], run=run)
    yield SimpleNamespace(ops=ops, run=run, ended=ended, clock=clock, events=events,
                          on_event=lambda name, fields: events.append((name, fields)))
    run.go.set()
    assert ops.join(10)


def test_the_view_rounds_to_a_tenth_of_a_second(held):
    """docs/cli.md's `operations`: "seconds": 312.4, "deadlineIn": 3287.6."""
    held.ops.launch([LINK_H], Ctx(), held.on_event)
    assert held.run.started.acquire(timeout=10)
    held.clock[0] = 1012.3456
    [view] = held.ops.view()
    assert (view["seconds"], view["deadlineIn"]) == (12.3, 107.7)


def test_the_caller_hears_every_event_of_the_batch_as_the_executor_said_it(held):
    held.ops.launch([LINK_H], Ctx(), held.on_event)
    assert held.run.started.acquire(timeout=10)
    assert held.events == [("step.start", {"step": LINK_H})]


def test_a_progress_report_without_a_total_keeps_the_total_known(held):
    """rsync's progress lines give the bytes moved; the total, once known, stays for the percentage."""
    held.ops.launch([WEIGHTS_H], Ctx(), held.on_event)
    assert held.run.started.acquire(timeout=10)
    held.ops.progress("weights", "h", 10, 1000)
    held.ops.progress("weights", "h", 20)
    [view] = held.ops.view()
    assert (view["bytesDone"], view["bytesTotal"]) == (20, 1000)


def test_a_stage_is_said_of_its_own_step_only(held):
    """Two steps on one node: the image copy's stage is not the weight sync's."""
    held.ops.launch([IMAGE_H, WEIGHTS_H], Ctx(), held.on_event)
    assert held.run.started.acquire(timeout=10)
    held.ops.stage("image", "h", "loading", 45, "line")
    view = {v["step"]: v for v in held.ops.view()}
    assert (view[IMAGE_H.id]["stage"], view[IMAGE_H.id]["percent"], view[IMAGE_H.id]["detail"]) == (
        "loading", 45, "line")
    assert (view[WEIGHTS_H.id]["stage"], view[WEIGHTS_H.id]["percent"], view[WEIGHTS_H.id]["detail"]) == (
        None, None, None)


def test_a_cancel_ends_with_its_batch_and_does_not_veto_the_step_s_next_launch(held):
    """cancel_stale vetoes a step that has not started (its reason until its batch ends); the next generation's
    plan may admit the same step again, and it runs: the old veto is gone with the old batch."""
    held.ops.launch([LINK_H], Ctx(), held.on_event)
    assert held.run.started.acquire(timeout=10)
    assert held.ops.cancel_stale(lambda step: "the fabric of h changed") == {LINK_H.id: "the fabric of h changed"}
    held.run.go.set()
    assert held.ended.acquire(timeout=10)
    assert [(r.step.id, r.result) for r in held.ops.drain()] == [(LINK_H.id, "cancelled")]
    held.ops.launch([LINK_H], Ctx(), held.on_event)
    assert held.ended.acquire(timeout=10)
    assert held.run.skipped == ["cancelled: the fabric of h changed", None]
    assert [(r.step.id, r.result) for r in held.ops.drain()] == [(LINK_H.id, "success")]


class EarlyEnd:
    """A fake executor whose batch reports the end of the steps in `early` at once (as the executor does for a
    step that finished while others of its batch run on), then waits for its own release (at most 10 s)."""

    def __init__(self, early: set[str]):
        self.early = early
        self.gates: list[threading.Event] = []
        self.entered = threading.Semaphore(0)

    def __call__(self, plan, ctx, on_event, skip, cancel_of):
        gate = threading.Event()
        self.gates.append(gate)
        results = [StepResult(step, "success", 1.0, f"batch {len(self.gates)}") for step in plan.steps]
        for result in results:
            on_event("step.start", {"step": result.step})
            if result.step.id in self.early:
                on_event("step.end", {"result": result})
        self.entered.release()
        gate.wait(10)
        return Outcome(results)


def test_a_step_that_ended_early_and_runs_again_in_a_new_batch_is_not_ended_by_the_old_batch():
    """A step whose end was reported while its batch ran on is drained, admitted again and launched in a new
    batch. When the old batch then ends, its outcome names that step too: it must not end the new run (which
    would free the step for a third, concurrent launch, and hand the old result out twice)."""
    run, ended = EarlyEnd({LINK_H.id}), threading.Semaphore(0)
    ops = Operations(on_end=ended.release, clock=lambda: 1000.0, run=run)
    ops.launch([LINK_H, IMAGE_H], Ctx(), on_event=lambda e, f: None)
    assert run.entered.acquire(timeout=10)
    assert [(r.step.id, r.message) for r in ops.drain()] == [(LINK_H.id, "batch 1")]
    run.early.clear()
    ops.launch([LINK_H], Ctx(), on_event=lambda e, f: None)
    assert run.entered.acquire(timeout=10)
    run.gates[0].set()
    assert ended.acquire(timeout=10)
    assert [v["step"] for v in ops.view()] == [LINK_H.id], "the new run of the link step is still in flight"
    assert [(r.step.id, r.message) for r in ops.drain()] == [(IMAGE_H.id, "batch 1")]
    run.gates[1].set()
    assert ended.acquire(timeout=10) and ops.join(10)
    assert [(r.step.id, r.message) for r in ops.drain()] == [(LINK_H.id, "batch 2")]


def test_a_step_the_executor_gave_no_result_for_is_not_left_in_flight():
    ended = threading.Event()
    ops = Operations(on_end=ended.set, run=lambda plan, ctx, on_event, skip, cancel_of: Outcome([]))
    ops.launch([LINK_H, IMAGE_H], Ctx(), on_event=lambda e, f: None)
    assert ended.wait(10) and ops.join(10)
    assert ops.view() == [] and ops.busy() == [] and ops.drain() == []


def test_a_crashed_executor_s_steps_took_no_time():
    ended = threading.Event()

    def broken(plan, ctx, on_event, skip, cancel_of):
        raise RuntimeError("bug")

    ops = Operations(on_end=ended.set, run=broken)
    ops.launch([LINK_H], Ctx(), on_event=lambda e, f: None)
    assert ended.wait(10)
    assert ops.drain() == [StepResult(LINK_H, "failed", 0.0, "executor crashed: RuntimeError('bug')")]


def test_join_gives_up_at_its_deadline_and_says_a_batch_still_runs(held):
    """The daemon's shutdown waits a bounded time (join after cancel_all): a batch that has not ended by then is
    reported, not waited for."""
    held.ops.launch([LINK_H], Ctx(), held.on_event)
    assert held.run.started.acquire(timeout=10)
    assert held.ops.join(0.0) is False
    held.run.go.set()
    assert held.ops.join(10) is True


def test_a_batch_runs_in_a_daemon_thread_named_after_its_first_step(held):
    """A batch stuck in a step must not keep the interpreter from exiting, and a stack dump names it."""
    held.ops.launch([LINK_H, IMAGE_H], Ctx(), held.on_event)
    assert held.run.started.acquire(timeout=10)
    assert held.run.threads == [("operations-link/h", True)]


def test_the_flags_question_runs_in_a_daemon_thread_named_after_the_short_image_id():
    """`vllm serve --help=all` imports torch: a hung question must not keep the daemon from exiting. The thread is
    named after the image's short id (docker's: 12 hex digits after `sha256:`)."""
    answered, seen = threading.Event(), []

    def ask(holder, image_id):
        me = threading.current_thread()
        seen.append((me.name, me.daemon))
        return ServeFlags(image_id=image_id, flags=[])

    FlagsQuery(ask, on_answer=answered.set).get(("h", "sha256:0123456789abcdef0123456789abcdef"))
    assert answered.wait(10)
    assert seen == [("flags-sha256:0123456789ab", True)]


# ------------------------------------------------------------------------------------------------ backoff

class _Middle:
    """rng.random() at the middle of the jitter: the delay is the nominal one."""

    def random(self) -> float:
        return 0.5


def test_the_wait_reason_says_the_time_left_and_the_first_300_characters_of_the_error():
    """docs/troubleshooting.md, ReconcilerStepHeld: the error is read from status; it is bounded."""
    backoff = Backoff(Retries(backoff_initial="10s", backoff_max="60s", hold_after=4), rng=_Middle())  # type: ignore[arg-type]
    error = "e" * 300 + "tail that is cut"
    backoff.failed("link/n1", error, now=5000.0)
    assert backoff.wait_reason("link/n1", now=5004.0) == (
        f"backing off after 1 failure(s), next try in 6s; last error: {'e' * 300}")
