"""Status conditions and the phase (reconciler/loop/conditions.py), judged by the table operators read: the phases of
docs/troubleshooting.md ("ReconcilerNotConverged") and the conditions of docs/cli.md (`status --json`)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from reconciler.core.drift import Drift
from reconciler.core.observed import NodeObservation, Observed
from reconciler.core.planning import Blocker, Plan, Step
from reconciler.loop.conditions import Snapshot, conditions, phase_of
from tests.unit.examples import examples

LINK = Drift("n1", "link", "link/eth1/mtu", "9000", "1500")
UNREACHABLE = Drift("n2", "unreachable", "node/n2", "reachable", "timed out", actionable=False, blocking=True)
REPORT_ONLY = Drift("n1", "co-tenant", "container/x", "absent", "running", actionable=False)


@st.composite
def snapshots(draw) -> Snapshot:
    drift = draw(st.lists(st.sampled_from([LINK, UNREACHABLE, REPORT_ONLY]), max_size=3, unique=True))
    steps = [Step("link", "n1", "mtu")] if draw(st.booleans()) else []
    blocked = [Blocker("n2", "waits for n2")] if draw(st.booleans()) else []
    plan = draw(st.sampled_from([None, Plan(drift, steps, blocked)]))
    return Snapshot(generation=2, observed_generation=2, plan=plan,
                    file_error=draw(st.sampled_from([None, "cluster.yaml:3:5: bad"])),
                    step_failures=draw(st.sampled_from([[], ["link/n1: exit 1"]])),
                    held=draw(st.sampled_from([{}, {"weights/n2": "rsync: reset"}])),
                    paused=draw(st.booleans()), mode=draw(st.sampled_from(["enforce", "observe"])))


def documented_phase(s: Snapshot) -> str:
    """docs/troubleshooting.md's table, most specific first."""
    plan = s.plan
    changes = plan is not None and (bool(plan.steps) or any(d.actionable or d.blocking for d in plan.drift))
    if s.file_error:
        return "Invalid"
    if s.paused:
        return "Paused"
    if plan is not None and not changes:
        return "Converged"
    if s.held or (plan is not None and (plan.blocked or any(d.blocking for d in plan.drift))):
        return "Blocked"
    if s.step_failures or s.mode == "observe" or plan is None:
        return "Degraded"
    return "Converging"


@settings(**examples(300))
@given(snapshots())
def test_the_phase_is_the_documented_one(snap):
    assert phase_of(snap) == documented_phase(snap)


@settings(**examples(100))
@given(snapshots())
def test_ready_is_true_exactly_when_the_cluster_matches_a_valid_file_and_says_the_phase_otherwise(snap):
    """Ready: the last plan found nothing to act on and nothing blocking (paused or not), for a valid file."""
    ready = next(c for c in conditions(snap, [], [], now=0.0) if c["type"] == "Ready")
    plan = snap.plan
    matches = plan is not None and not plan.steps and not any(d.actionable or d.blocking for d in plan.drift)
    assert (ready["status"] == "True") == (matches and not snap.file_error)
    if ready["status"] == "False":
        assert ready["reason"] == phase_of(snap)


def _observed(n1: NodeObservation) -> Observed:
    return Observed(nodes={"n1": n1})


def test_a_node_that_cannot_be_asked_is_unknown_not_false():
    snap = Snapshot(generation=1, observed_generation=1,
                    observed=_observed(NodeObservation(name="n1", reachable=False, error="timed out")),
                    plan=Plan([LINK], [], []))
    by_type = {c["type"]: c for c in conditions(snap, ["n1"], [], now=0.0) if c["node"] == "n1"}
    assert by_type["Reachable"]["status"] == "False" and by_type["Reachable"]["message"] == "timed out"
    for t in ("FabricLinkUp", "WeightsInSync", "ImageInSync", "ServingRunning"):
        assert (by_type[t]["status"], by_type[t]["reason"]) == ("Unknown", "NodeUnreachable"), t


def test_drift_shows_on_its_own_node_and_condition_with_what_was_expected():
    seen = NodeObservation(name="n1", reachable=True, docker_reachable=True)
    snap = Snapshot(generation=1, observed_generation=1, observed=Observed(nodes={"n1": seen, "n2": seen.model_copy(
        update={"name": "n2"})}), plan=Plan([LINK], [], []), held={"weights/n2": "rsync: reset"})
    out = {(c["node"], c["type"]): c for c in conditions(snap, ["n1", "n2"], [], now=0.0)}
    link = out[("n1", "FabricLinkUp")]
    assert (link["status"], link["reason"]) == ("False", "LinkDrift")
    assert link["message"] == "link/eth1/mtu: expected 9000, observed 1500"
    assert out[("n2", "FabricLinkUp")]["status"] == "True"
    assert out[("n1", "StepsHeld")]["status"] == "False"
    assert (out[("n2", "StepsHeld")]["status"], out[("n2", "StepsHeld")]["message"]) == (
        "True", "weights/n2: rsync: reset")


def test_the_transition_time_moves_only_when_the_status_flips():
    snap = Snapshot(generation=1, observed_generation=1, plan=Plan([LINK], [], []))
    first = conditions(snap, [], [], now=1000.0)
    same = conditions(snap, [], first, now=2000.0)
    assert [c["lastTransitionTime"] for c in same] == [c["lastTransitionTime"] for c in first]
    fixed = Snapshot(generation=2, observed_generation=2, plan=Plan([], [], []))
    flipped = {c["type"]: c for c in conditions(fixed, [], same, now=3000.0)}
    assert flipped["Ready"]["lastTransitionTime"] == "1970-01-01T00:50:00Z"
    assert flipped["DesiredStateValid"]["lastTransitionTime"] == "1970-01-01T00:16:40Z"
    assert flipped["Ready"]["observedGeneration"] == 2
