"""Every condition /status carries, field by field (reconciler/loop/conditions.py): the node it is on, its type,
status, reason and message exactly as docs/cli.md (`status --json`, the CONDITIONS table) and
docs/troubleshooting.md name them. test_conditions.py judges the phase and the status of Ready; these pin the rest
of each condition (the reason and message an operator reads, and the dashboards colour), which the first mutation
run over the loop found unpinned (docs/mutation-survivors-edge.md, `loop.conditions.*`)."""

from __future__ import annotations

import pytest

from reconciler.core.drift import Drift
from reconciler.core.observed import EngineLoad, GpuStack, NodeObservation, Observed, ServingApi
from reconciler.core.planning import Blocker, Plan, Step
from reconciler.loop.conditions import Condition, Snapshot, conditions, phase_of

LINK = Drift("n1", "link", "link/eth1/mtu", "9000", "1500")
RDMA = Drift("n1", "rdma", "rdma/rocep1s0f1", "4: ACTIVE", "1: DOWN")
WEIGHTS = Drift("n1", "weights", "weights/org/model", "rev abc", "missing")
UNREACHABLE = Drift("n2", "unreachable", "node/n2", "reachable", "timed out", actionable=False, blocking=True)
TWIN_DOWN = Drift("n1", "rdma", "rdma/rocep1s0f1/twin", "4: ACTIVE", "1: DOWN", actionable=False)
REPORT_ONLY = Drift("n1", "co-tenant", "container/x", "absent", "running", actionable=False)
UP = NodeObservation(name="n1", reachable=True, docker_reachable=True)
LINK_STEP = Step("link", "n1", "mtu")


def _one(conds: list[Condition], node: str, type_: str) -> dict:
    """The condition without its transition time and generation (test_conditions.py pins those)."""
    [c] = [c for c in conds if (c["node"], c["type"]) == (node, type_)]
    return {k: c[k] for k in ("node", "type", "status", "reason", "message")}


def _node(obs: NodeObservation | None, plan: Plan | None = None, held: dict[str, str] | None = None) -> list:
    snap = Snapshot(generation=1, observed_generation=1, plan=plan or Plan([], [], []), held=held or {},
                    observed=Observed(nodes={"n1": obs}) if obs is not None else Observed(nodes={}))
    return conditions(snap, ["n1"], [], now=0.0)


def _cluster(**snap) -> list[Condition]:
    return conditions(Snapshot(generation=1, observed_generation=1, **snap), [], [], now=0.0)


def c(node: str, type_: str, status: str, reason: str, message: str = "") -> dict:
    return {"node": node, "type": type_, "status": status, "reason": reason, "message": message}


# ------------------------------------------------------------------------------------------------ reachability

def test_a_node_this_reconcile_did_not_observe_is_unknown_on_its_own_row_with_no_message():
    """A node the file declares but the observation lacks (a snapshot's, a reconcile that stopped early) is not
    said to be down: Unknown, NotObserved, and the probe and docker reasons say what is missing."""
    out = _node(None)
    assert _one(out, "n1", "Reachable") == c("n1", "Reachable", "Unknown", "NotObserved")
    assert _one(out, "n1", "Probed") == c("n1", "Probed", "Unknown", "ProbeFailed")
    assert _one(out, "n1", "DockerReachable") == c("n1", "DockerReachable", "Unknown", "DockerUnreachable")


def test_a_node_that_answers_says_so_with_empty_messages():
    out = _node(UP)
    assert _one(out, "n1", "Reachable") == c("n1", "Reachable", "True", "SshOk")
    assert _one(out, "n1", "Probed") == c("n1", "Probed", "True", "ProbeOk")
    assert _one(out, "n1", "DockerReachable") == c("n1", "DockerReachable", "True", "DockerOk")


def test_an_unreachable_node_is_false_with_ssh_s_error_and_its_probe_and_docker_are_unknown():
    """docs/troubleshooting.md, ReconcilerNodeUnreachable: what cannot be asked is not known to be broken."""
    out = _node(NodeObservation(name="n1", reachable=False, error="ssh: connect to host n1 port 22: timed out"))
    assert _one(out, "n1", "Reachable") == c("n1", "Reachable", "False", "Unreachable",
                                             "ssh: connect to host n1 port 22: timed out")
    assert _one(out, "n1", "Probed") == c("n1", "Probed", "Unknown", "ProbeFailed")
    assert _one(out, "n1", "DockerReachable") == c("n1", "DockerReachable", "Unknown", "DockerUnreachable")


def test_docker_that_does_not_answer_is_false_with_its_error():
    out = _node(NodeObservation(name="n1", reachable=True, docker_reachable=False,
                                docker_error="Cannot connect to the Docker daemon"))
    assert _one(out, "n1", "DockerReachable") == c("n1", "DockerReachable", "False", "DockerUnreachable",
                                                   "Cannot connect to the Docker daemon")
    assert _one(out, "n1", "Reachable") == c("n1", "Reachable", "True", "SshOk")


def test_a_probe_that_did_not_parse_is_false_and_every_drift_condition_is_unknown_for_that_reason():
    """The node answered but its output did not parse: nothing else of it is known (observed.py), so the drift
    conditions are Unknown with ProbeFailed, not True (nothing seen) nor NodeUnreachable (it did answer)."""
    obs = NodeObservation(name="n1", reachable=True, docker_reachable=True, probe_error="section link: odd output")
    out = _node(obs, Plan([LINK], [], []))
    assert _one(out, "n1", "Probed") == c("n1", "Probed", "False", "ProbeFailed", "section link: odd output")
    for type_ in ("FabricLinkUp", "WeightsInSync", "GpuReady", "ImageInSync", "ServingRunning"):
        assert _one(out, "n1", type_) == c("n1", type_, "Unknown", "ProbeFailed"), type_


# ------------------------------------------------------------------------------------------------ from drift

def test_no_drift_is_true_with_each_condition_s_good_reason():
    out = _node(UP)
    assert [_one(out, "n1", t) for t in ("FabricLinkUp", "WeightsInSync", "GpuReady", "ImageInSync",
                                         "ServingRunning")] == [
        c("n1", "FabricLinkUp", "True", "LinkUp"), c("n1", "WeightsInSync", "True", "InSync"),
        c("n1", "GpuReady", "True", "GpuAnswers"), c("n1", "ImageInSync", "True", "InSync"),
        c("n1", "ServingRunning", "True", "Running")]


def test_two_drifts_of_one_condition_are_said_in_one_message_separated_by_semicolons():
    out = _node(UP, Plan([LINK, RDMA, WEIGHTS], [], []))
    assert _one(out, "n1", "FabricLinkUp") == c(
        "n1", "FabricLinkUp", "False", "LinkDrift",
        "link/eth1/mtu: expected 9000, observed 1500; rdma/rocep1s0f1: expected 4: ACTIVE, observed 1: DOWN")
    assert _one(out, "n1", "WeightsInSync") == c("n1", "WeightsInSync", "False", "WeightsDrift",
                                                 "weights/org/model: expected rev abc, observed missing")


def test_a_port_no_step_can_fix_is_port_degraded_and_drift_to_act_on_beside_it_is_link_drift():
    """docs/troubleshooting.md, ReconcilerFabricPortDegraded: `FabricLinkUp=False`, reason `PortDegraded`, for
    report-only fabric drift; with a link to repair too, the repair is what the condition says."""
    degraded = _node(UP, Plan([TWIN_DOWN], [], []))
    assert _one(degraded, "n1", "FabricLinkUp") == c(
        "n1", "FabricLinkUp", "False", "PortDegraded",
        "rdma/rocep1s0f1/twin: expected 4: ACTIVE, observed 1: DOWN (not the reconciler's to fix: the peer's "
        "port, the cable or the firmware)")
    both = _node(UP, Plan([TWIN_DOWN, LINK], [], []))
    assert _one(both, "n1", "FabricLinkUp") == c("n1", "FabricLinkUp", "False", "LinkDrift",
                                                 "link/eth1/mtu: expected 9000, observed 1500")
    report_only = _node(UP, Plan([REPORT_ONLY], [], []))  # report-only, but not fabric: no PortDegraded
    assert _one(report_only, "n1", "ServingRunning") == c("n1", "ServingRunning", "True", "Running")


# ------------------------------------------------------------------------------------------------ the head

def _head(serving: ServingApi) -> list[Condition]:
    return _node(UP.model_copy(update={"serving": serving}))


ENGINE = EngineLoad(running=4, waiting=2.5, tokens=1000)


def test_a_busy_head_is_serving_busy_queue_full_with_the_engine_s_counts():
    """docs/troubleshooting.md, "A busy cluster taken for a wedged one": `ServingBusy=True` (`QueueFull`, with
    the running and waiting counts); nothing restarts."""
    out = _head(ServingApi(reachable=True, healthy=True, busy=True, engine=ENGINE))
    assert _one(out, "n1", "ServingBusy") == c(
        "n1", "ServingBusy", "True", "QueueFull",
        "a completion queued behind every slot while tokens keep coming (4 running, 2.5 waiting): busy, not "
        "wedged; nothing restarts")


def test_a_head_that_answers_is_not_busy_and_says_its_load():
    out = _head(ServingApi(reachable=True, healthy=True, engine=ENGINE))
    assert _one(out, "n1", "ServingBusy") == c("n1", "ServingBusy", "False", "Answering", "4 running, 2.5 waiting")


def test_a_head_whose_counters_were_not_read_says_no_load():
    out = _head(ServingApi(reachable=True, healthy=False))
    assert _one(out, "n1", "ServingBusy") == c("n1", "ServingBusy", "False", "Answering")


def test_a_node_without_serving_has_no_serving_busy():
    assert [x for x in _node(UP) if x["type"] == "ServingBusy"] == []


# ------------------------------------------------------------------------------------------------ holds

def test_a_node_without_holds_says_no_holds_and_its_holds_are_listed_with_their_errors():
    """docs/troubleshooting.md, ReconcilerStepHeld: the node's `StepsHeld` condition carries the last error."""
    assert _one(_node(UP), "n1", "StepsHeld") == c("n1", "StepsHeld", "False", "NoHolds")
    held = _node(UP, held={"link/n1": "mtu stays 1500", "weights/n1": "rsync: reset", "weights/n2": "other"})
    assert _one(held, "n1", "StepsHeld") == c("n1", "StepsHeld", "True", "StepsHeld",
                                              "link/n1: mtu stays 1500; weights/n1: rsync: reset")


# ------------------------------------------------------------------------------------------------ GPU stack

GB10 = GpuStack(gpu="NVIDIA GB10", driver="580.95.05", hook=True, kernel="6.17.0-1014-nvidia", dgx_os="7.4.0")


def _gpu(**stacks: GpuStack | None) -> dict:
    observed = Observed(nodes={n: UP.model_copy(update={"name": n, "gpu_stack": s}) for n, s in stacks.items()})
    return _one(conditions(Snapshot(1, 1, observed=observed), list(stacks), [], now=0.0), "", "GpuStackUniform")


def test_the_gpu_stack_is_a_cluster_condition_not_read_same_or_skewed():
    """docs/cli.md: `GpuStackUniform` is a cluster condition (`node: ""`): one driver, kernel and DGX OS on every
    node; Unknown when nothing was read."""
    assert _gpu(n1=None, n2=None) == c("", "GpuStackUniform", "Unknown", "NotRead")
    assert _gpu(n1=GB10, n2=GB10) == c("", "GpuStackUniform", "True", "SameStack")
    assert _gpu(n1=GB10, n2=GB10.model_copy(update={"kernel": "6.11.0-1016-nvidia"})) == c(
        "", "GpuStackUniform", "False", "StackSkew", "kernel 6.17.0-1014-nvidia on n1, 6.11.0-1016-nvidia on n2")


# ------------------------------------------------------------------------------------------------ the cluster

def test_ready_counts_what_needs_action_or_blocks_and_is_converged_with_no_message():
    """docs/cli.md's table: `Ready False Converging 5 drifted resources`; report-only drift is not counted."""
    drifted = _one(_cluster(plan=Plan([LINK, WEIGHTS, UNREACHABLE, REPORT_ONLY], [LINK_STEP], [])), "", "Ready")
    assert drifted == c("", "Ready", "False", "Blocked", "3 drifted resources")
    assert _one(_cluster(plan=None), "", "Ready") == c("", "Ready", "False", "Degraded", "0 drifted resources")
    assert _one(_cluster(plan=Plan([REPORT_ONLY], [], [])), "", "Ready") == c("", "Ready", "True", "Converged")
    paused = _one(_cluster(plan=Plan([], [], []), paused=True), "", "Ready")  # the phase is Paused; Ready holds
    assert paused == c("", "Ready", "True", "Converged")


def test_desired_state_valid_carries_the_file_s_problem_or_nothing():
    assert _one(_cluster(plan=Plan([], [], [])), "", "DesiredStateValid") == c("", "DesiredStateValid", "True",
                                                                               "Valid")
    bad = _one(_cluster(file_error="cluster.yaml:3:5: bad"), "", "DesiredStateValid")
    assert bad == c("", "DesiredStateValid", "False", "DesiredStateInvalid", "cluster.yaml:3:5: bad")


@pytest.mark.parametrize(("snap", "expected"), [
    ({"plan": Plan([LINK], [LINK_STEP], [])}, ("True", "StepsPlanned", "link/n1")),
    ({"plan": Plan([], [], [])}, ("False", "Idle", "")),
    ({"plan": None}, ("False", "Idle", "")),
    ({"plan": Plan([LINK], [LINK_STEP], []), "mode": "observe"}, ("False", "StepsPlanned", "link/n1")),
    ({"plan": Plan([LINK], [LINK_STEP], []), "paused": True}, ("False", "StepsPlanned", "link/n1")),
    ({"plan": Plan([LINK], [LINK_STEP], []), "in_flight": ["weights/n2", "image/n2"]},
     ("True", "StepsRunning", "weights/n2; image/n2")),
    ({"plan": Plan([], [], []), "in_flight": ["weights/n2"], "paused": True}, ("True", "StepsRunning", "weights/n2")),
], ids=["planned", "idle", "no-plan", "observe", "paused", "in-flight", "in-flight-while-paused"])
def test_progressing_is_true_while_steps_run_or_will_run(snap, expected):
    """docs/operations.md: `Progressing=True` (steps planned, or running beside the loop) and False (idle); a plan
    that observes or is paused plans steps it will not run. The message names the steps."""
    status, reason, message = expected
    assert _one(_cluster(**snap), "", "Progressing") == c("", "Progressing", status, reason, message)


def test_observe_mode_is_degraded_even_without_step_failures():
    """docs/troubleshooting.md's phases: drift while only observing is Degraded, not Converging."""
    snap = Snapshot(generation=1, observed_generation=1, plan=Plan([LINK], [LINK_STEP], [], "observe"),
                    mode="observe")
    assert phase_of(snap) == "Degraded"
    blocked = Snapshot(generation=1, observed_generation=1, plan=Plan([LINK], [], [Blocker("n2", "waits")]))
    assert phase_of(blocked) == "Blocked"
