"""Status as Kubernetes-style conditions and one phase, computed from what the last reconcile saw. Pure.

Conditions carry type, status (True/False/Unknown), reason (CamelCase), message, lastTransitionTime (kept while
the status does not flip) and observedGeneration, so `reconciler status`, /status, the metrics and the alerts all
tell the same story.

A node's conditions come from its drift by the condition each drift kind declares (`drift.CONDITION_OF`), never
from a list of kinds kept here: a new kind shows in /status the day it is declared.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Literal, NotRequired, TypedDict

from reconciler.core.drift import (
    CONDITION_OF,
    DOCKER_REACHABLE,
    DRIFT_CONDITIONS,
    FABRIC_LINK_UP,
    PROBED,
    REACHABLE,
    Drift,
    NodeCondition,
)
from reconciler.core.nccl import Transport, judge
from reconciler.core.observed import GpuStack, NodeObservation, Observed, ServingApi
from reconciler.core.planning import Plan, kind_and_node
from reconciler.core.restore import AS_FOUND
from reconciler.core.spec import SINGLE, Desired
from reconciler.loop.history import Hold


@dataclass(frozen=True)
class Verified:
    """One deployment's serving.verify as status tells it (`verify_results`): its API's node, whether its last
    check passed (`ok`; None: not checked for what runs now) and what it said."""

    deployment: str
    node: str
    ok: bool | None
    message: str


def verify_results(desired: Desired, observed: Observed | None,
                   reports: Mapping[str, Mapping[str, Any]]) -> list[Verified]:
    """Each declared serving.verify of `desired`, judged by the last `serving.verify` report of its deployment
    (await-health's, at the end of every start: `reports`, by deployment). A report counts for what runs now only:
    while the head's serving container it checked still runs (a new container is checked at its own start) and the
    file still declares the same verify (an edit restarts nothing, so it is checked at the next start); else, or
    with no report since the daemon started, not checked (Unknown). A head this observation did not see keeps its
    last report (a node whose containers could not be read keeps it too)."""
    out: list[Verified] = []
    for view in desired.views():
        verify = view.serving.verify
        if verify is None:
            continue
        name, head = view.deployment.name, view.api_node.name
        report = reports.get(name)
        seen = observed.view(name).nodes.get(head) if observed is not None else None
        looked = seen is not None and seen.usable  # its containers were read
        container = seen.container(view.serving.container_name) if seen is not None and looked else None
        if report is None:
            why = "no start was checked since the reconciler started"
        elif report.get("verify") != verify.model_dump():
            why = "serving.verify changed since the last check; an edit of it restarts nothing"
        elif looked and (container is None or not container.running or container.id != report.get("container")):
            why = f"{view.serving.container_name} on {head} is not the container last checked"
        else:
            out.append(Verified(name, head, bool(report.get("ok")), str(report.get("message", ""))))
            continue
        out.append(Verified(name, head, None, f"not checked: {why}; checked at the next start"))
    return out


@dataclass(frozen=True)
class RankTransport:
    """The network one rank's NCCL chose, as status tells it (`transport_results`)."""

    deployment: str
    node: str
    transport: Transport


def transport_results(desired: Desired, observed: Observed | None,
                      reports: Mapping[tuple[str, str], Mapping[str, Any]]) -> list[RankTransport]:
    """Each rank of a deployment across nodes, judged by the last `serving.transport` report of its node
    (await-health's, once the deployment served: `reports`, by node and deployment) against the RDMA devices its
    node's fabric declares (`core.nccl.judge`); a node that declares none is left out (sockets are what it asks
    for, and the testbed's veths are such nodes). A report counts for what runs now only: while the rank container
    it read still runs (a new one is read at its own start; a node this observation could not read keeps it). A
    rank with no report that counts is left out: nothing is known of it, and no start of it was read."""
    out: list[RankTransport] = []
    for view in desired.views():
        nodes = view.serving_nodes
        if len(nodes) < 2:
            continue
        name = view.deployment.name
        for node in nodes:
            report = reports.get((node.name, name))
            if report is None:
                continue
            seen = observed.view(name).nodes.get(node.name) if observed is not None else None
            if seen is not None and seen.usable:
                running = seen.container(view.serving.container_name)
                if running is None or not running.running or running.id != report.get("container"):
                    continue
            devices = [p.rdma_device for p in node.fabric.ports() if p.rdma_device]
            if not devices:  # sockets are what the file declares there: nothing to tell
                continue
            networks = report.get("networks")
            out.append(RankTransport(name, node.name, judge(None if networks is None else tuple(networks), devices)))
    return out


@dataclass
class Snapshot:
    """What one reconcile knows, for status purposes."""

    generation: int
    observed_generation: int
    file_error: str | None = None
    observed: Observed | None = None
    plan: Plan | None = None
    step_failures: list[str] = field(default_factory=list)
    held: dict[str, str] = field(default_factory=dict)  # step id -> last error
    paused: bool = False
    mode: str = "enforce"
    in_flight: list[str] = field(default_factory=list)  # step ids of operations running beside the loop
    held_change: Hold | None = None  # the file's generation failed and is held: an earlier one is enforced
    verified: list[Verified] = field(default_factory=list)  # each declared serving.verify (`verify_results`)
    transports: list[RankTransport] = field(default_factory=list)  # each rank's NCCL network (`transport_results`)

    @property
    def wrong_answers(self) -> list[str]:
        """The deployments whose serving.verify failed for what runs now: not Ready, whatever the plan says."""
        return [v.deployment for v in self.verified if v.ok is False]


def _iso(now: float) -> str:
    return datetime.fromtimestamp(now, tz=UTC).isoformat(timespec="seconds").replace("+00:00", "Z")


class Condition(TypedDict):
    """One condition as /status carries it; `conditions` adds when its status last flipped and the generation."""

    node: str  # "" for the cluster's own
    type: str
    status: Literal["True", "False", "Unknown"]
    reason: str
    message: str
    lastTransitionTime: NotRequired[str]
    observedGeneration: NotRequired[int]


def _cond(node: str, type_: str, ok: bool | None, reason: str, message: str = "") -> Condition:
    status: Literal["True", "False", "Unknown"] = "Unknown" if ok is None else ("True" if ok else "False")
    return {"node": node, "type": type_, "status": status, "reason": reason, "message": message}


def _said(found: list[Drift]) -> str:
    return "; ".join(f"{d.resource}: expected {d.expected}, observed {d.observed}" for d in found)


def _reachability(name: str, obs: NodeObservation | None) -> list[Condition]:
    """Reachable, Probed, DockerReachable: from the observation itself, which says why (the `unreachable`,
    `probe` and `docker` drifts say the same)."""
    if obs is None:
        return [_cond(name, REACHABLE.type, None, "NotObserved"), _cond(name, PROBED.type, None, PROBED.bad),
                _cond(name, DOCKER_REACHABLE.type, None, DOCKER_REACHABLE.bad)]
    docker = DOCKER_REACHABLE.good if obs.docker_reachable else DOCKER_REACHABLE.bad
    return [_cond(name, REACHABLE.type, obs.reachable, REACHABLE.good if obs.reachable else REACHABLE.bad,
                  obs.error or ""),
            _cond(name, PROBED.type, obs.probed if obs.reachable else None,
                  PROBED.good if obs.probed else PROBED.bad, obs.probe_error or ""),
            _cond(name, DOCKER_REACHABLE.type, obs.docker_reachable if obs.probed else None, docker,
                  obs.docker_error or "")]


def _from_drift(name: str, obs: NodeObservation | None, drift: list[Drift], which: NodeCondition) -> Condition:
    """One condition from the node's drift of the kinds that declare it (`drift.CONDITION_OF`): False with what
    needs action or blocks, else True; Unknown while the node cannot be read. FabricLinkUp also says a port that
    no step can fix (the peer's port, the cable, the firmware): PortDegraded."""
    if obs is None or not obs.reachable:
        return _cond(name, which.type, None, "NodeUnreachable")
    if obs.probe_error is not None:
        return _cond(name, which.type, None, PROBED.bad)
    return _judged(name, [d for d in drift if CONDITION_OF[d.kind] == which], which)


def _judged(name: str, mine: list[Drift], which: NodeCondition) -> Condition:
    """The condition of a node that was read, from its drift of the condition's kinds (`mine`)."""
    found = [d for d in mine if d.actionable or d.blocking]
    said = [d for d in mine if not (d.actionable or d.blocking)]
    if which == FABRIC_LINK_UP and said and not found:  # nothing to do, nothing blocked, still not as declared
        return _cond(name, which.type, False, "PortDegraded", _said(said) + " (not the reconciler's to fix: the "
                     "peer's port, the cable or the firmware)")
    return _cond(name, which.type, not found, which.bad if found else which.good, _said(found))


def _load(api: ServingApi) -> str:
    engine = api.engine
    return f"{engine.running:g} running, {engine.waiting:g} waiting" if engine else ""


def _node_conditions(name: str, snap: Snapshot) -> list[Condition]:
    obs = snap.observed.nodes.get(name) if snap.observed else None  # None: a node this reconcile did not observe
    drift = [d for d in (snap.plan.drift if snap.plan else []) if d.node == name]
    out = _reachability(name, obs)
    out += [_from_drift(name, obs, drift, which) for which in DRIFT_CONDITIONS]
    if apis := _serving_apis(obs):  # the head: vLLM at capacity is said, never drift (each deployment's)
        out.append(_serving_busy(name, apis))
    if checks := [v for v in snap.verified if v.node == name]:  # the API's node of a deployment declaring one
        out.append(_verified(name, checks))
    if ranks := [r for r in snap.transports if r.node == name]:  # a rank of a deployment across nodes
        out.append(_transport(name, ranks))
    out.append(_steps_held(name, snap.held))
    return out


def _serving_apis(obs: NodeObservation | None) -> list[tuple[str, ServingApi]]:
    """The serving APIs the node answers for, each with how a message names it ("" for a file of one, else
    `DEPLOYMENT: `); none on a node that serves no API or was not observed."""
    if obs is None:
        return []
    return ([("", obs.serving)] if obs.serving is not None else []) + [
        (f"{d}: ", f.serving) for d, f in obs.deployments.items() if f.serving is not None]


def _serving_busy(name: str, apis: list[tuple[str, ServingApi]]) -> Condition:
    """ServingBusy: True while a vLLM has a completion queued behind every slot (busy, not wedged)."""
    busy = [(who, api) for who, api in apis if api.busy]
    said = [f"{who}{_load(api)}" for who, api in (busy or apis) if _load(api) or who]
    return _cond(name, "ServingBusy", bool(busy), "QueueFull" if busy else "Answering",
                 (f"a completion queued behind every slot while tokens keep coming ({'; '.join(said)}): "
                  "busy, not wedged; nothing restarts" if busy else "; ".join(said)))


def _steps_held(name: str, held_steps: dict[str, str]) -> Condition:
    """StepsHeld: the node's steps held after failing (step id -> last error)."""
    held = {sid: msg for sid, msg in held_steps.items() if kind_and_node(sid)[1] == name}
    return _cond(name, "StepsHeld", bool(held), "StepsHeld" if held else "NoHolds",
                 "; ".join(f"{sid}: {msg}" for sid, msg in held.items()))


def _verified(name: str, checks: list[Verified]) -> Condition:
    """ServingVerified on a deployment's API node: False while a serving.verify there failed for what runs now (a
    wrong answer, an error answer, none), True when every one there passed, Unknown while one is not checked."""
    said = "; ".join((f"{v.deployment}: " if v.deployment != SINGLE else "") + v.message for v in checks)
    if any(v.ok is False for v in checks):
        return _cond(name, "ServingVerified", False, "WrongAnswer", said)
    if all(v.ok for v in checks):
        return _cond(name, "ServingVerified", True, "Answered", said)
    return _cond(name, "ServingVerified", None, "NotChecked", said)


def _transport(name: str, ranks: list[RankTransport]) -> Condition:
    """NcclTransport on a rank's node: False while a rank there fell back to sockets on a fabric that declares RDMA
    devices, Unknown while one's network is not known, else True; the reason is the worst rank's."""
    said = "; ".join((f"{r.deployment}: " if r.deployment != SINGLE else "") + r.transport.message for r in ranks)
    worst = min(ranks, key=lambda r: {False: 0, None: 1, True: 2}[r.transport.ok]).transport
    return _cond(name, "NcclTransport", worst.ok, worst.reason, said)


def phase_of(snap: Snapshot) -> str:
    plan = snap.plan
    if snap.file_error is not None:
        return "Invalid"
    if snap.paused:
        return "Paused"
    if plan is not None and not plan.changes:
        return _settled_phase(snap)
    return _changing_phase(snap, plan)


def _settled_phase(snap: Snapshot) -> str:
    """The phase when the plan changes nothing."""
    if snap.held_change is not None:  # what was brought back serves
        return "RolledBack"  # (until it does, the phase says how its start goes; the condition says it is held)
    if snap.wrong_answers:  # it runs as declared, and answers wrong
        return "Degraded"
    return "Converged"


def _changing_phase(snap: Snapshot, plan: Plan | None) -> str:
    """The phase while there is a change to make (or no plan to tell)."""
    if snap.held or (plan is not None and (plan.blocked or any(d.blocking for d in plan.drift))):
        return "Blocked"
    if snap.step_failures or snap.mode != "enforce" or plan is None:
        return "Degraded"
    return "Converging"


def _uniform_gpu_stack(snap: Snapshot, nodes: list[str]) -> Condition:
    """The nodes run the same driver, kernel and DGX OS. A warning, not drift: NCCL across two drivers or
    kernels may still work, but an update that reached one node only (an OTA run on one Spark, a reboot still
    pending on the other) is the usual cause of a tensor-parallel start that hangs or a rank that fails alone."""
    seen = snap.observed.nodes if snap.observed else {}
    stacks = {n: s for n in nodes if n in seen and (s := seen[n].gpu_stack) is not None}
    if not stacks:
        return _cond("", "GpuStackUniform", None, "NotRead")
    differ = [said for what, attribute in _STACK_PARTS if (said := _skew(what, stacks, attribute))]
    return _cond("", "GpuStackUniform", not differ, "StackSkew" if differ else "SameStack", "; ".join(differ))


#: The parts of a GPU stack that should be the same on every node: (how a message names it, GpuStack's field).
_STACK_PARTS = (("driver", "driver"), ("kernel", "kernel"), ("DGX OS", "dgx_os"))


def _skew(what: str, stacks: dict[str, GpuStack], attribute: str) -> str:
    """`what` and its value on each node that read it, when the nodes differ; else ""."""
    values = {n: value for n, s in stacks.items() if (value := getattr(s, attribute))}
    if len(set(values.values())) > 1:
        return f"{what} " + ", ".join(f"{v} on {n}" for n, v in values.items())
    return ""


def _rolled_back(hold: Hold | None) -> Condition:
    """RolledBack: True while a failed change is held and an earlier generation serves in its place
    (reconciler.loop.history)."""
    if hold is None:
        return _cond("", "RolledBack", False, "FileInForce")
    if hold.to == 0:  # a first generation: what ran before it (core/restore)
        return _cond("", "RolledBack", True, "FailedFirstGeneration",
                     f"generation {hold.generation} never served ({hold.why}); to: {AS_FOUND} (its ranks stopped, the "
                     "co-tenants it stopped started again) until the file changes: fix the file, and it is tried "
                     "again")
    return _cond("", "RolledBack", True, "FailedChange",
                 f"generation {hold.generation} never served ({hold.why}); generation {hold.to} is served in its "
                 f"place until the file changes: fix the file, or `reconciler rollback {hold.to}` to make the file "
                 "say so")


def _ready(snap: Snapshot) -> Condition:
    """Ready: the plan changes nothing, the file is valid and in force, and every serving.verify passes."""
    plan = snap.plan
    ready = (plan is not None and not plan.changes and snap.file_error is None and snap.held_change is None
             and not snap.wrong_answers)
    drift_count = sum(1 for d in plan.drift if d.actionable or d.blocking) if plan else 0
    wrong = f"; serving.verify failed: {', '.join(snap.wrong_answers)}" if snap.wrong_answers else ""
    return _cond("", "Ready", ready, "Converged" if ready else phase_of(snap),
                 "" if ready else f"{drift_count} drifted resources{wrong}")


def _progressing(snap: Snapshot) -> Condition:
    """Progressing: steps run beside the loop, or are planned and will start (enforcing, not paused)."""
    plan = snap.plan
    return _cond("", "Progressing", bool(snap.in_flight or (plan and plan.steps and snap.mode == "enforce"
                                                            and not snap.paused)),
                 "StepsRunning" if snap.in_flight else ("StepsPlanned" if plan and plan.steps else "Idle"),
                 "; ".join(snap.in_flight or [s.id for s in (plan.steps if plan else [])]))


def _stamped(out: list[Condition], previous: list[Condition], generation: int, now: float) -> list[Condition]:
    """Each condition with when its status last flipped (kept from `previous` while it holds) and the generation."""
    before = {(c["node"], c["type"]): c for c in previous}
    for c in out:
        old = before.get((c["node"], c["type"]))
        c["lastTransitionTime"] = old["lastTransitionTime"] if old and old["status"] == c["status"] else _iso(now)
        c["observedGeneration"] = generation
    return out


def conditions(snap: Snapshot, nodes: list[str], previous: list[Condition], now: float) -> list[Condition]:
    out = [
        _ready(snap),
        _cond("", "DesiredStateValid", snap.file_error is None,
              "Valid" if snap.file_error is None else "DesiredStateInvalid", snap.file_error or ""),
        _progressing(snap),
        _rolled_back(snap.held_change),
        _uniform_gpu_stack(snap, nodes),
    ]
    for node in nodes:
        out += _node_conditions(node, snap)
    return _stamped(out, previous, snap.generation, now)
