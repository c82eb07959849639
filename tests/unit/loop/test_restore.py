"""Generation 0 (issue 52, item 2): a first generation that stopped the owner's co-tenants and then failed brings
them back. The seed story: the head served GLM (`vllm_node`), the reconciler's first plan stops it to make room,
the start fails after the stop; the daemon then stops the failed ranks and `docker start`s GLM, the very container
it stopped, and says RolledBack "to: the co-tenants as found" until the file changes.

The oracle is the observation itself: which containers run after the restore plan is applied by the simulator
(core/simulate, the plans' own physics), never the plan's step list alone.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

from reconciler.core.observed import Container, Observed
from reconciler.core.planning import plan
from reconciler.core.restore import AS_FOUND, StoppedCoTenant, restore_plan
from reconciler.core.simulate import apply_plan
from reconciler.core.spec import load
from reconciler.loop import history
from reconciler.loop.metrics import REGISTRY
from reconciler.loop.reasons import Reason
from tests.unit.loop.test_controller_loop import Gate, Script, _condition, _controller

HEAD, WORKER = "spark-1a32", "spark-5be3"


def _seed(seed_snapshot) -> Observed:
    return Observed.model_validate(json.loads(seed_snapshot.read_text()))


def _glm(observed: Observed) -> Container:
    glm = observed.node(HEAD).container("vllm_node")
    assert glm is not None
    return glm


def _running(observed: Observed, node: str) -> set[str]:
    return {c.name for c in observed.node(node).containers if c.running}


def _failed_first_start(desired, seed: Observed) -> Observed:
    """The seed after the first generation's plan ran: GLM stopped, our ranks up (and, in the story, failing)."""
    return apply_plan(desired, seed, plan(desired, seed))


def test_the_restore_plan_stops_the_failed_ranks_then_starts_what_they_stopped(desired_path, seed_snapshot):
    desired, seed = load(desired_path, {"VLLM_API_KEY": "k"}), _seed(seed_snapshot)
    after = _failed_first_start(desired, seed)
    assert "vllm_node" not in _running(after, HEAD) and "vllm_serving" in _running(after, HEAD), "the premise"
    stopped = (StoppedCoTenant(HEAD, "vllm_node", _glm(seed).id),)

    restore = restore_plan(desired, after, stopped, 1)
    start = next(s for s in restore.steps if s.kind == "start-container")
    assert (start.node, start.container, start.container_id) == (HEAD, "vllm_node", _glm(seed).id)
    assert f"stop-serving/{HEAD}/vllm_serving" in start.after, "GLM starts only once the failed rank is stopped"
    assert {s.kind for s in restore.steps} == {"stop-serving", "start-container"}, "nothing else: no copy, no link"
    restored = apply_plan(desired, after, restore)
    assert _running(restored, HEAD) == _running(seed, HEAD), "the head runs what it ran before generation 1"
    assert "vllm_serving" not in _running(restored, WORKER)
    assert not restore_plan(desired, restored, stopped, 1).changes, "and then there is nothing left to do"


def test_only_the_very_container_it_stopped_is_started(desired_path, seed_snapshot):
    desired, seed = load(desired_path, {"VLLM_API_KEY": "k"}), _seed(seed_snapshot)
    after = _failed_first_start(desired, seed)
    others = [StoppedCoTenant(HEAD, "vllm_node", "f" * 64),        # recreated since: another id
              StoppedCoTenant(HEAD, "vllm_gone", _glm(seed).id),    # removed meanwhile
              StoppedCoTenant(HEAD, "vllm_embeddings", "a2")]       # never stopped: it runs
    assert not [s for s in restore_plan(desired, after, tuple(others), 1).steps if s.kind == "start-container"]


def test_a_node_that_does_not_answer_holds_its_restore_saying_so(desired_path, seed_snapshot):
    desired, seed = load(desired_path, {"VLLM_API_KEY": "k"}), _seed(seed_snapshot)
    after = _failed_first_start(desired, seed)
    down = after.model_copy(update={"nodes": {**after.nodes, HEAD: after.node(HEAD).model_copy(
        update={"reachable": False, "probed": False})}})
    restore = restore_plan(desired, down, (StoppedCoTenant(HEAD, "vllm_node", _glm(seed).id),), 1)
    assert not [s for s in restore.steps if s.node == HEAD]
    assert [b.node for b in restore.blocked] == [HEAD] and "vllm_node" in restore.blocked[0].reason


class ReportingGate(Gate):
    """The fake executor, which also reports what a real co-tenant stop reports (`co-tenant.stopped`, with the
    id it read): the controller learns what its generation stopped only from the steps."""

    def __init__(self, observed: Observed, failing: tuple[str, ...]):
        super().__init__(failing)
        self.observed = observed

    def __call__(self, plan_, ctx, on_event, skip=lambda step: None, cancel_of=None):
        for step in plan_.steps:
            if step.kind == "stop-container":
                seen = self.observed.node(step.node).container(step.container or "")
                assert seen is not None
                ctx.progress("co-tenant.stopped", {"node": step.node, "container": step.container, "id": seen.id})
        return super().__call__(plan_, ctx, on_event, skip, cancel_of)


def test_a_failed_first_deploy_brings_back_the_co_tenants_it_stopped(desired_path, tmp_path, seed_snapshot):
    """The seed story through the controller: generation 1 stops GLM and its await-health fails; the next
    reconcile holds it, plans the restore, and says so; a daemon restart keeps the restore; an edit ends it."""
    seed = _seed(seed_snapshot)
    desired = load(desired_path, {"VLLM_API_KEY": "k"})
    after = _failed_first_start(desired, seed)
    stopped = (StoppedCoTenant(HEAD, "vllm_node", _glm(seed).id),)
    restored = apply_plan(desired, after, restore_plan(desired, after, stopped, 1))
    gate = ReportingGate(seed, failing=("await-health",))
    gate.release.set()
    c, _ = _controller(desired_path, tmp_path, Script(seed, after, restored), gate)
    c.image.query = SimpleNamespace(get=lambda wanted: None)  # type: ignore[assignment]  # no image to ask here
    before = REGISTRY.get_sample_value("reconciler_rollbacks_total") or 0
    c.reconcile({Reason("start")})
    assert f"stop-container/{HEAD}/vllm_node" in gate.batches[-1] and f"await-health/{HEAD}" in gate.batches[-1]
    assert c.operations.join(20)

    c.reconcile({Reason("operation")})
    assert c.held is not None and (c.held.generation, c.held.to) == (1, 0)
    rolled = _condition(c.status, "", "RolledBack")
    assert rolled["status"] == "True" and f"to: {AS_FOUND}" in rolled["message"], rolled
    assert REGISTRY.get_sample_value("reconciler_rollbacks_total") == before + 1
    assert f"start-container/{HEAD}/vllm_node" in gate.batches[-1], gate.batches[-1]
    assert {b.split("/")[0] for b in gate.batches[-1]} == {"stop-serving", "start-container"}
    kept = history.read(tmp_path / "state", desired_path)
    assert kept.entries[0].stopped == stopped
    assert kept.entries[0].outcome == f"rolled back to {AS_FOUND}"
    assert c.operations.join(20)
    assert c.reconcile({Reason("operation")}).phase == "RolledBack", "what ran before serves again: said as such"
    assert _condition(c.status, "", "Ready")["status"] == "False", "the file's generation is not what runs"

    again, _ = _controller(desired_path, tmp_path, Script(restored), ReportingGate(restored, ()))
    again.image.query = SimpleNamespace(get=lambda wanted: None)  # type: ignore[assignment]
    assert again.reconcile({Reason("start")}).phase == "RolledBack"
    assert again.held is not None and again.held.to == 0, "a restart does not try the failed generation again"
    text = desired_path.read_text()
    desired_path.write_text(text.replace("max_model_len: 32768", "max_model_len: 16384"))
    again.reconcile({Reason("file")})
    assert again.held is None and again.store.generation == 2, "an edit is a new attempt: the restore ends"


def test_the_history_keeps_what_a_generation_stopped(tmp_path):
    store = history.HistoryStore(tmp_path, tmp_path / "f.yaml")
    store.taken(1, "h1", "text", 1.0)
    tenant = StoppedCoTenant(HEAD, "vllm_node", "a1")
    store.stopped(1, tenant)
    store.stopped(1, tenant)
    assert history.read(tmp_path, tmp_path / "f.yaml").entries[0].stopped == (tenant,)
