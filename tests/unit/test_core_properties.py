"""Property tests for the pure core (drift, plan, simulate): convergence, idempotence, safety, order, determinism."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from reconciler import spec
from reconciler.drift import diff
from reconciler.plan import plan
from reconciler.simulate import apply_plan
from tests.unit.strategies import desired_dict, desireds, observations

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def cases(draw, all_reachable: bool = False):
    desired = draw(desireds())
    return desired, draw(observations(desired, all_reachable=all_reachable))


@SETTINGS
@given(cases())
def test_applying_a_plan_converges(case):
    desired, observed = case
    first = plan(desired, observed)
    after = apply_plan(desired, observed, first)
    second = plan(desired, after)
    assert second.steps == [], (first.steps, second.steps, second.drift)


@SETTINGS
@given(cases(all_reachable=True))
def test_fully_reachable_cluster_ends_with_only_unactionable_drift(case):
    desired, observed = case
    after = apply_plan(desired, observed, plan(desired, observed))
    leftover = [d for d in diff(desired, after) if d.actionable and not d.blocking]
    blocked = plan(desired, after).blocked
    assert not leftover or blocked, leftover


@SETTINGS
@given(cases())
def test_converged_state_plans_nothing_twice(case):
    desired, observed = case
    once = apply_plan(desired, observed, plan(desired, observed))
    twice = apply_plan(desired, once, plan(desired, once))
    assert plan(desired, twice) == plan(desired, once)
    assert plan(desired, twice).steps == []


@SETTINGS
@given(cases())
def test_never_stops_allowed_protected_or_foreign_managed_containers(case):
    desired, observed = case
    ct = desired.co_tenants
    for step in plan(desired, observed).steps:
        if step.kind == "stop-container":
            name = step.params["container"]
            container = observed.node(step.node).container(name)
            assert container is not None and container.running
            assert not ct.is_allowed(step.node, name)
            assert not ct.is_protected(step.node, name)
            assert not container.managed
            assert ct.unlisted == "stop"
        if step.kind == "stop-serving":
            container = observed.node(step.node).container(step.params["container"])
            assert container is not None and container.managed, "only containers the reconciler created"


@SETTINGS
@given(cases())
def test_every_step_comes_after_what_it_needs(case):
    desired, observed = case
    steps = plan(desired, observed).steps
    position = {s.id: i for i, s in enumerate(steps)}
    assert len(position) == len(steps), "step ids are unique"
    for i, s in enumerate(steps):
        for dep in s.after:
            assert dep in position and position[dep] < i, (s.id, dep)
    starts = [i for i, s in enumerate(steps) if s.kind == "start-serving"]
    prereqs = [i for i, s in enumerate(steps) if s.kind in ("stop-container", "link", "image", "weights")]
    if starts:
        assert max(prereqs, default=-1) < min(starts)
        head = desired.head.name
        head_start = next(i for i in starts if steps[i].node == head)
        worker_starts = [i for i in starts if steps[i].node != head]
        if desired.serving.launcher == "native":
            assert all(w < head_start for w in worker_starts), "workers (headless) before the head"
        else:
            assert all(w > head_start for w in worker_starts), "Ray: the head's GCS before the workers"
        assert steps[-1].kind == "await-health"
        starting = {steps[i].id for i in starts}
        for s in steps:
            if s.kind == "stop-serving":
                assert all(position[s.id] < position[x] for x in starting)


@SETTINGS
@given(cases())
def test_same_input_same_plan(case):
    desired, observed = case
    rebuilt = type(observed).model_validate_json(observed.model_dump_json())
    assert plan(desired, observed) == plan(desired, rebuilt)


@SETTINGS
@given(cases(), st.sampled_from(["observe", "paused"]))
def test_observe_and_paused_report_drift_but_plan_no_steps(case, mode):
    desired, observed = case
    raw = desired.model_dump(mode="json")
    raw["policy"] = {"mode": "observe"} if mode == "observe" else {"paused": True}
    quiet = spec.Desired.model_validate(raw)
    result = plan(quiet, observed)
    assert result.steps == []
    assert result.drift == diff(desired, observed)


def test_unreachable_worker_blocks_serving_but_not_the_head_cleanup():
    from reconciler.observed import Container, NodeObservation, Observed

    desired = spec.Desired.model_validate(desired_dict())
    head = NodeObservation(name="head", reachable=True, docker_reachable=True,
                           containers=[Container(name="rogue-1", id="x", image="i", state="running")])
    observed = Observed(nodes={"head": head, "worker1": NodeObservation(name="worker1", reachable=False,
                                                                       error="connection timed out")})
    result = plan(desired, observed)
    assert [s.id for s in result.steps] == ["stop-container/head/rogue-1"]
    assert any(b.node == "worker1" for b in result.blocked)
