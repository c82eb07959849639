"""Status as Kubernetes-style conditions and one phase, computed from what the last reconcile saw. Pure.

Conditions carry type, status (True/False/Unknown), reason (CamelCase), message, lastTransitionTime (kept while
the status does not flip) and observedGeneration, so `reconciler status`, /status, the metrics and the alerts all
tell the same story.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime

from reconciler.core.drift import Drift
from reconciler.core.observed import Observed
from reconciler.core.planning import Plan, kind_and_node


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


def _iso(now: float) -> str:
    return datetime.fromtimestamp(now, tz=UTC).isoformat(timespec="seconds").replace("+00:00", "Z")


def _cond(node: str, type_: str, ok: bool | None, reason: str, message: str = "") -> dict:
    status = "Unknown" if ok is None else ("True" if ok else "False")
    return {"node": node, "type": type_, "status": status, "reason": reason, "message": message}


def _node_conditions(name: str, snap: Snapshot) -> list[dict]:
    obs = snap.observed.node(name) if snap.observed else None
    drift = [d for d in (snap.plan.drift if snap.plan else []) if d.node == name]

    def about(kinds: tuple[str, ...]) -> list[Drift]:
        return [d for d in drift if d.kind in kinds and (d.actionable or d.blocking)]

    def from_drift(type_: str, kinds: tuple[str, ...], good: str, bad: str) -> dict:
        if obs is None or not obs.reachable:
            return _cond(name, type_, None, "NodeUnreachable")
        if obs.probe_error is not None:
            return _cond(name, type_, None, "ProbeFailed")
        found = about(kinds)
        text = "; ".join(f"{d.resource}: expected {d.expected}, observed {d.observed}" for d in found)
        return _cond(name, type_, not found, bad if found else good, text)

    out = []
    if obs is None:
        out.append(_cond(name, "Reachable", None, "NotObserved"))
    else:
        out.append(_cond(name, "Reachable", obs.reachable, "SshOk" if obs.reachable else "Unreachable",
                         obs.error or ""))
    reached = obs is not None and obs.reachable
    probed = reached and obs is not None and obs.probe_error is None
    out.append(_cond(name, "Probed", probed if reached else None, "ProbeOk" if probed else "ProbeFailed",
                     (obs.probe_error or "") if obs else ""))
    out.append(_cond(name, "DockerReachable", obs.docker_reachable if probed and obs else None,
                     "DockerOk" if obs and obs.docker_reachable else "DockerUnreachable",
                     (obs.docker_error or "") if obs else ""))
    fabric = from_drift("FabricLinkUp", ("link", "rdma"), "LinkUp", "LinkDrift")
    said = [d for d in drift if d.kind in ("link", "rdma") and not (d.actionable or d.blocking)]
    if said and fabric["status"] == "True":  # nothing to do, nothing blocked, and still not the link declared
        fabric = _cond(name, "FabricLinkUp", False, "PortDegraded", "; ".join(
            f"{d.resource}: expected {d.expected}, observed {d.observed}" for d in said)
            + " (not the reconciler's to fix: the peer's port, the cable or the firmware)")
    out.append(fabric)
    out.append(from_drift("WeightsInSync", ("weights",), "InSync", "WeightsDrift"))
    out.append(from_drift("GpuReady", ("gpu",), "GpuAnswers", "GpuStackFailing"))
    out.append(from_drift("ImageInSync", ("image",), "InSync", "ImageDrift"))
    out.append(from_drift("ServingRunning", ("serving", "memory"), "Running", "ServingDrift"))
    if obs is not None and obs.serving is not None:  # the head: vLLM at capacity is said, never drift
        engine = obs.serving.engine
        load = f"{engine.running:g} running, {engine.waiting:g} waiting" if engine else ""
        out.append(_cond(name, "ServingBusy", obs.serving.busy, "QueueFull" if obs.serving.busy else "Answering",
                         (f"a completion queued behind every slot while tokens keep coming ({load}): busy, not "
                          "wedged; nothing restarts" if obs.serving.busy else load)))
    held = {sid: msg for sid, msg in snap.held.items() if kind_and_node(sid)[1] == name}
    out.append(_cond(name, "StepsHeld", bool(held), "StepsHeld" if held else "NoHolds",
                     "; ".join(f"{sid}: {msg}" for sid, msg in held.items())))
    return out


def phase_of(snap: Snapshot) -> str:
    plan = snap.plan
    if snap.file_error is not None:
        return "Invalid"
    if snap.paused:
        return "Paused"
    if plan is not None and not plan.changes:
        return "Converged"
    if snap.held or (plan is not None and (plan.blocked or any(d.blocking for d in plan.drift))):
        return "Blocked"
    if snap.step_failures or snap.mode != "enforce" or plan is None:
        return "Degraded"
    return "Converging"


def _uniform_gpu_stack(snap: Snapshot, nodes: list[str]) -> dict:
    """The nodes run the same driver, kernel and DGX OS. A warning, not drift: NCCL across two drivers or
    kernels may still work, but an update that reached one node only (an OTA run on one Spark, a reboot still
    pending on the other) is the usual cause of a tensor-parallel start that hangs or a rank that fails alone."""
    stacks = {n: s for n in nodes if snap.observed and n in snap.observed.nodes
              and (s := snap.observed.node(n).gpu_stack) is not None}
    if not stacks:
        return _cond("", "GpuStackUniform", None, "NotRead")
    differ = []
    for what, values in (("driver", {n: s.driver for n, s in stacks.items() if s.driver}),
                         ("kernel", {n: s.kernel for n, s in stacks.items() if s.kernel}),
                         ("DGX OS", {n: s.dgx_os for n, s in stacks.items() if s.dgx_os})):
        if len(set(values.values())) > 1:
            differ.append(f"{what} " + ", ".join(f"{v} on {n}" for n, v in values.items()))
    return _cond("", "GpuStackUniform", not differ, "StackSkew" if differ else "SameStack", "; ".join(differ))


def conditions(snap: Snapshot, nodes: list[str], previous: list[dict], now: float) -> list[dict]:
    plan = snap.plan
    ready = plan is not None and not plan.changes and snap.file_error is None
    drift_count = sum(1 for d in plan.drift if d.actionable or d.blocking) if plan else 0
    out = [
        _cond("", "Ready", ready, "Converged" if ready else phase_of(snap),
              "" if ready else f"{drift_count} drifted resources"),
        _cond("", "DesiredStateValid", snap.file_error is None,
              "Valid" if snap.file_error is None else "DesiredStateInvalid", snap.file_error or ""),
        _cond("", "Progressing", bool(snap.in_flight or (plan and plan.steps and snap.mode == "enforce"
                                                         and not snap.paused)),
              "StepsRunning" if snap.in_flight else ("StepsPlanned" if plan and plan.steps else "Idle"),
              "; ".join(snap.in_flight or [s.id for s in (plan.steps if plan else [])])),
    ]
    out.append(_uniform_gpu_stack(snap, nodes))
    for node in nodes:
        out += _node_conditions(node, snap)
    before = {(c["node"], c["type"]): c for c in previous}
    for c in out:
        old = before.get((c["node"], c["type"]))
        c["lastTransitionTime"] = old["lastTransitionTime"] if old and old["status"] == c["status"] else _iso(now)
        c["observedGeneration"] = snap.generation
    return out
