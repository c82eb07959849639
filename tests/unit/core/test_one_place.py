"""One place per concept (issue 34, finding 4): each is asked the same way everywhere, and each case here names
what the code did before it was one place.

- a port that passes traffic: `Link.up` (admin up, carrier, and an operstate that passes traffic);
- a node the plan may work on: `NodeObservation.usable` (and `probed`);
- the grace before a restart for health: `planning.health_grace`;
- whose a container is, on its labels alone: `observed.whose` (`owned_by`, `is_managed`);
- which node condition a drift shows in: `drift.CONDITION_OF`, declared by every `DriftKind`;
- a node the observation does not hold: `Observed.node` raises, `Observed.covering` says it was not observed.
"""

from __future__ import annotations

import dataclasses
from typing import get_args

import pytest

from reconciler.cli.plan_text import observed_text
from reconciler.core.drift import (
    CONDITION_OF,
    DRIFT_CONDITIONS,
    DRIFT_KINDS,
    REACHABILITY_CONDITIONS,
    SERVING_RUNNING,
    UNUSABLE_KINDS,
    Drift,
    DriftKind,
    diff,
)
from reconciler.core.fabric import carries
from reconciler.core.kinds import STEP_KINDS, StepKind
from reconciler.core.observed import (
    LABEL_INSTANCE,
    LABEL_MANAGED,
    Container,
    Link,
    NodeObservation,
    Observed,
    ServingApi,
    UnknownNode,
    is_managed,
    owned_by,
    whose,
)
from reconciler.core.ownership import Owner
from reconciler.core.planning import (
    MAX_GRACE_DOUBLINGS,
    Plan,
    Restart,
    Step,
    _why_restart,
    health_grace,
)
from reconciler.core.planning import plan as make_plan
from reconciler.core.preflight import _port_state
from reconciler.core.retention import _mounts
from reconciler.core.spec import FabricPort
from reconciler.loop.conditions import Snapshot, conditions
from reconciler.loop.health_watch import HealthWatch
from tests.unit.recorded import IF0, changed, link, serving_with

# ------------------------------------------------------------------------------------------------ Link.up

UP = Link(name="eth1", operstate="up", admin_up=True, carrier=True, mtu=9000)


@pytest.mark.parametrize(("fields", "up"), [
    ({}, True),
    ({"operstate": "unknown"}, True),  # a driver that reports no operstate: carrier decides
    ({"operstate": "dormant"}, False),  # 802.1X waiting: carrier, and no traffic
    ({"operstate": "testing"}, False),
    ({"operstate": "lowerlayerdown"}, False),
    ({"carrier": False, "operstate": "down"}, False),
    ({"admin_up": False, "carrier": False, "operstate": "down"}, False),
    ({"exists": False}, False),
])
def test_a_port_is_up_when_it_exists_is_admin_up_has_carrier_and_the_kernel_passes_traffic(fields, up):
    assert Link(**{**UP.model_dump(), **fields}).up is up


def test_the_plan_text_says_down_for_a_dormant_port_with_carrier():
    """It once judged `admin_up and carrier` on its own, and called this port up."""
    dormant = UP.model_copy(update={"operstate": "dormant"})
    text = observed_text(Observed(nodes={"n1": NodeObservation(name="n1", reachable=True, fabric=dormant)}))
    assert "fabric eth1: DOWN, mtu 9000" in text
    port = FabricPort(interface="eth1", address="10.0.0.1/24")
    assert carries(port, dormant) is False  # the metrics' and NCCL_IB_HCA's judgement says the same


def test_a_dormant_port_with_carrier_is_drift_the_operator_reads(desired, seen):
    """It once showed no drift at all, while the start left the port out of NCCL_IB_HCA."""
    port = link(seen, "head", operstate="dormant")
    assert diff(desired, changed(seen, "head", fabric=port)) == [
        Drift("head", "link", f"link/{IF0}/operstate", "operstate up", "operstate dormant (admin up with carrier, "
              "but the kernel passes no traffic)", actionable=False)]


def test_the_doctor_says_a_dormant_first_port_cannot_carry_the_hop(desired, seen):
    port = link(seen, "head", operstate="dormant")
    assert _port_state(desired.node("head"), port) == "operstate dormant"
    assert _port_state(desired.node("head"), link(seen, "head")) is None


# ------------------------------------------------------------------------------------------------ usable node


@pytest.mark.parametrize(("fields", "probed", "usable"), [
    ({"reachable": True, "docker_reachable": True}, True, True),
    ({"reachable": True, "docker_reachable": False}, True, False),
    ({"reachable": True, "docker_reachable": True, "probe_error": "bad"}, False, False),
    ({"reachable": False, "docker_reachable": True}, False, False),
])
def test_a_usable_node_answered_parsed_and_its_docker_answers(fields, probed, usable):
    obs = NodeObservation(name="n1", **fields)
    assert (obs.probed, obs.usable) == (probed, usable)


def test_a_node_whose_probe_failed_is_judged_on_nothing_even_with_docker_said_to_answer(desired, seen):
    """A snapshot's node with a probe error and `docker_reachable` still true: the serving drift once judged it
    usable (SSH and docker answer) and planned a start on it, while every other judgement held it back."""
    after = changed(seen, "worker1", probe_error="docker section: not JSON", fabric=None, fabric_twin=None,
                    containers=[])
    assert [d for d in diff(desired, after) if d.node == "worker1"] == [
        Drift("worker1", "probe", "probe/worker1", "probe output that parses", "docker section: not JSON",
              actionable=False, blocking=True)]


def test_the_kinds_that_make_a_node_unusable_are_those_of_its_reachability_conditions():
    assert {"unreachable", "probe", "docker"} == UNUSABLE_KINDS


# ------------------------------------------------------------------------------------------------ the grace


def test_the_grace_doubles_per_restart_that_did_not_hold_up_to_16x():
    assert [health_grace(300.0, n) for n in range(7)] == [300.0, 600.0, 1200.0, 2400.0, 4800.0, 4800.0, 4800.0]
    assert health_grace(300.0, MAX_GRACE_DOUBLINGS) == 16 * 300.0


def test_the_watch_forgets_the_restarts_after_serving_for_the_longest_grace(desired, seen):
    """The watch's forgetting and the plan's cap are one formula: serving well for exactly the longest grace
    resets the count, a second less does not."""
    watch = HealthWatch(wall=lambda: 0.0)
    watch.restarts = 3
    longest = health_grace(desired.serving.unhealthy_grace, MAX_GRACE_DOUBLINGS)
    running = changed(seen, "head", containers=serving_with(seen, "head", started_at=None))
    watch.annotate(desired, running, now=0.0)
    watch.annotate(desired, running, now=longest - 1)
    assert watch.restarts == 3
    watch.annotate(desired, running, now=longest)
    assert watch.restarts == 0


# ------------------------------------------------------------------------------------------------ ownership

OURS = Owner("cluster-a", frozenset({"cluster-a", "10.0.0.1:22"}), "head", True, True)


@pytest.mark.parametrize(("labels", "verdict", "owned"), [
    ({}, "unmanaged", False),
    ({LABEL_MANAGED: "false", LABEL_INSTANCE: "cluster-a"}, "unmanaged", False),
    ({LABEL_MANAGED: "true"}, "unlabelled", True),  # from before the instance label: an upgrade adopts it
    ({LABEL_MANAGED: "true", LABEL_INSTANCE: "cluster-a"}, "ours", True),
    ({LABEL_MANAGED: "true", LABEL_INSTANCE: "10.0.0.1:22"}, "ours", True),  # a former name of the head
    ({LABEL_MANAGED: "true", LABEL_INSTANCE: "cluster-b"}, "another", False),
])
def test_whose_a_container_is_is_judged_on_its_labels_once(labels, verdict, owned):
    container = Container(name="x", id="1", image="i", state="running", labels=labels)
    assert whose(labels, OURS.names) == verdict
    assert owned_by(labels, OURS) is owned is container.owned_by(OURS)
    assert is_managed(labels) is (verdict != "unmanaged") is container.managed


def test_retention_believes_the_weights_label_only_of_a_container_labelled_ours():
    """The stricter rule, in the same words: a managed container without an instance label claims nothing."""
    mounts = Container(name="x", id="1", image="i", state="exited", mounts=["/srv/hub"],
                       labels={LABEL_MANAGED: "true", "spark-reconciler.weights": "/srv/hub/a"})
    labelled = mounts.model_copy(update={"labels": {**mounts.labels, LABEL_INSTANCE: "cluster-a"}})
    assert _mounts(labelled, "/srv/hub/b", OURS.names) is False  # ours: it names /srv/hub/a as the one it serves
    assert _mounts(mounts, "/srv/hub/b", OURS.names) is True  # unlabelled: the whole hub counts as used


# ------------------------------------------------------------------------------------------------ conditions


def test_every_drift_kind_declares_its_node_condition():
    assert set(CONDITION_OF) == set(get_args(DriftKind)) == set(DRIFT_KINDS)
    assert all(c is None or c in (*REACHABILITY_CONDITIONS, *DRIFT_CONDITIONS) for c in CONDITION_OF.values())


@pytest.mark.parametrize("kind", [k for k in DRIFT_KINDS if CONDITION_OF[k] in DRIFT_CONDITIONS])
def test_a_drift_that_needs_action_turns_its_declared_condition_false(kind):
    """For every kind, derived from the table alone: a new kind that declares a condition shows there."""
    which = CONDITION_OF[kind]
    assert which is not None
    found = Drift("n1", kind, f"{kind}/x", "as declared", "otherwise")
    snap = Snapshot(generation=1, observed_generation=1, plan=Plan([found], [], []),
                    observed=Observed(nodes={"n1": NodeObservation(name="n1", reachable=True,
                                                                   docker_reachable=True)}))
    by_type = {c["type"]: c for c in conditions(snap, ["n1"], [], now=0.0) if c["node"] == "n1"}
    assert (by_type[which.type]["status"], by_type[which.type]["reason"]) == ("False", which.bad)
    assert by_type[which.type]["message"] == f"{kind}/x: expected as declared, observed otherwise"
    assert all(c["status"] == "True" for t, c in by_type.items() if t not in (which.type, "StepsHeld"))


def test_a_co_tenant_to_stop_shows_in_serving_running(desired, seen):
    """It once showed in no node condition: /status and `reconciler status` said all was well on the node."""
    from tests.unit.core.test_drift_cases import _foreign

    after = changed(seen, "worker1", containers=[*seen.node("worker1").containers, _foreign("vllm_node")])
    snap = Snapshot(generation=1, observed_generation=1, observed=after, plan=make_plan(desired, after))
    out = {(c["node"], c["type"]): c for c in conditions(snap, [n.name for n in desired.nodes], [], now=0.0)}
    serving = out[("worker1", "ServingRunning")]
    assert (serving["status"], serving["reason"], serving["message"]) == (
        "False", "ServingDrift", "container/vllm_node: expected not running (not allowed), observed running "
        "(glm-4.5-air:latest)")
    assert out[("worker2", "ServingRunning")]["status"] == "True"
    assert CONDITION_OF["co-tenant"] == SERVING_RUNNING


# ------------------------------------------------------------------------------------------------ Observed.node


def test_a_name_the_observation_does_not_hold_is_an_error_not_an_unreachable_node(seen):
    with pytest.raises(UnknownNode, match="no node 'haed'"):
        seen.node("haed")
    with pytest.raises(KeyError):  # what a caller that catches lookups expects
        seen.node("haed")


def test_a_snapshot_without_a_node_of_the_file_plans_it_as_not_observed(desired, seen):
    nodes = {n: o for n, o in seen.nodes.items() if n != "worker3"}
    lacking = seen.model_copy(update={"nodes": nodes})
    covered = lacking.covering(n.name for n in desired.nodes)
    assert covered.node("worker3").reachable is False and covered.node("worker3").error == "not observed"
    assert lacking.covering(["head"]) is lacking
    drift = make_plan(desired, lacking).drift
    assert drift[0] == Drift("worker3", "unreachable", "node/worker3", "reachable over SSH", "not observed",
                             actionable=False, blocking=True)


# ------------------------------------------------------------------------------------------------ no out-parameters


def test_why_restart_returns_the_wait_instead_of_appending_it(desired, seen):
    head = seen.node("head")
    assert head.serving is not None
    cold = changed(seen, "head", serving=head.serving.model_copy(update={"healthy": False}))
    drift = diff(desired, cold)
    why = _why_restart(desired, cold, drift, [], set())
    assert why.reason is None and why.blocked == ()
    assert [(s.kind, s.node) for s in why.steps] == [("await-health", "head")]
    wedged = changed(seen, "head", serving=ServingApi(reachable=True, served_before=True, unhealthy_for=1.0))
    waiting = _why_restart(desired, wedged, diff(desired, wedged), [], set())
    assert waiting.reason is None and waiting.steps == () and len(waiting.blocked) == 1
    assert _why_restart(desired, seen, diff(desired, seen), [], set()) == Restart()


def test_the_kind_tuples_are_the_literals():
    assert get_args(StepKind) == STEP_KINDS and "await-health" in STEP_KINDS


def test_every_typed_field_of_a_step_is_in_its_params():
    """`params` names the fields one by one (no getattr by name): a field added to Step and not there fails here.
    The deployment is not a parameter but whose step it is, like its node: in the id and in `as_dict`."""
    values = {"container": "c", "source": "s", "image": "i", "content": "x", "path": "/p", "rank": 1,
              "wrapper": ("a", "b"), "remove": ("r",), "grace": 1, "container_id": "0123abcd"}
    own = {f.name for f in dataclasses.fields(Step)} - {"kind", "node", "reason", "after", "deployment"}
    assert own == set(values)
    assert Step("image", "n1", "why", **values).params == {
        "container": "c", "source": "s", "image": "i", "content": "x", "path": "/p", "rank": "1", "wrapper": "a b",
        "remove": "r", "grace": "1", "container_id": "0123abcd"}


def test_a_snapshot_from_before_issue_34_still_loads_without_its_restart_count() -> None:
    """`restart_count` was read and never judged (finding 7): gone from the model, dropped from old snapshots."""
    from reconciler.core.observed import Container

    old = {"name": "vllm", "id": "c1", "image": "i", "state": "running", "labels": {}, "restart_count": 3}
    assert Container.model_validate(old) == Container(name="vllm", id="c1", image="i", state="running")
    assert "restart_count" not in Container.model_fields
