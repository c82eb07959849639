"""The status publisher: one reconcile's knowledge, told the same way everywhere.

/status (JSON), the Prometheus metrics, systemd's status line: all are written here from one `conditions.Snapshot`,
at the end of every reconcile, crashed or not, so none of them can keep saying Converged after a reconcile that
could not tell. `reconciler_last_reconcile_timestamp_seconds` moves every time; an alert fires when it stops.
A state dir that cannot be written is said the same way (`stateError`, `lastError`, the status line): the
generation shown is then the one recorded and in force, never one that a restart would not know again.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from reconciler.core.budget import overshoot
from reconciler.core.drift import DRIFT_KINDS
from reconciler.core.fabric import carries, ports_seen
from reconciler.core.observed import NodeObservation, Observed
from reconciler.core.planning import kind_and_node
from reconciler.core.spec import Desired
from reconciler.edge.log import redact
from reconciler.loop import conditions, metrics, systemd
from reconciler.loop.health_watch import started_timestamp


class StatusPublisher:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.status: dict[str, Any] = {"phase": "Converging", "conditions": [], "generation": 0,
                                       "observedGeneration": 0, "lastPlan": None, "lastError": None, "memory": []}
        self._held: set[tuple[str, str]] = set()  # (kind, node) shown as 1 on the step_hold gauge
        self._failing: set[tuple[str, str]] = set()  # (kind, node) above 0 on the step_failures gauge
        self._roles: set[tuple[str, str]] = set()  # (node, role) on the node_role gauge
        self._desired: Desired | None = None  # the desired state in force (`roles`): what a memory reading is judged by
        # (node, deployment) -> a rank's `serving.memory` reading and its time, kept until its deployment leaves the
        # node; written from the steps' threads (`memory`), so under a lock
        self._readings: dict[tuple[str, str], tuple[Mapping[str, Any], float]] = {}
        self._memory_view: list[dict[str, Any]] = []
        self._memory_lock = threading.Lock()
        # deployment -> its last `serving.verify` report (await-health's, from a step's thread: under the lock)
        self._verifies: dict[str, Mapping[str, Any]] = {}
        # (node, deployment) -> its rank's last `serving.transport` report (await-health's: under the lock)
        self._transports: dict[tuple[str, str], Mapping[str, Any]] = {}

    def publish(self, snap: conditions.Snapshot, nodes: list[str], error: str | None, now: float,
                state_error: str | None = None) -> None:
        """`now`: unix time (the timestamps people read); `state_error`: why the state dir could not be written
        (generations.GenerationStore.unsaved)."""
        snap = self._judged(snap)
        conds = conditions.conditions(snap, nodes, self.status.get("conditions", []), now)
        phase = conditions.phase_of(snap)
        drift = snap.plan.drift if snap.plan else []
        # through `redact` before it is stored: a step's error, a file error, a drift's observed text, a blocker's
        # reason may quote a command line or a header with a secret in it, and /status serves this dict as it is
        self.status = redact({
            "phase": phase, "generation": snap.generation, "observedGeneration": snap.observed_generation,
            "file": str(self.path), "conditions": conds,
            "drift": [d.as_dict() for d in drift],
            "lastPlan": snap.plan.as_dict() if snap.plan else None,
            "lastError": error or (snap.step_failures[-1] if snap.step_failures else snap.file_error) or state_error,
            "held": snap.held, "time": now, "stateSaved": state_error is None, "stateError": state_error,
            "rollback": _rollback(snap),
            "memory": self.memory_view(),
        })
        metrics.set_phase(phase)
        metrics.set_conditions([{"node": c["node"], "type": c["type"], "status": c["status"]} for c in conds])
        counts = _drift_counts(snap)
        metrics.set_drift(counts, nodes, DRIFT_KINDS)
        metrics.converged.set(1 if snap.plan is not None and not snap.plan.changes and error is None
                              and snap.held_change is None and not snap.wrong_answers else 0)
        metrics.observed_generation.set(snap.observed_generation)
        metrics.last_reconcile.set(now)
        systemd.status(f"{phase}; generation {snap.generation}, {sum(counts.values())} drifted"
                       + ("; state dir not writable" if state_error else ""))

    def _judged(self, snap: conditions.Snapshot) -> conditions.Snapshot:
        """The snapshot with the starts' answer checks and NCCL transports the steps reported (unless it carries
        its own), their gauges set."""
        if self._desired is not None and not snap.verified:
            snap = dataclasses.replace(snap, verified=self.verify_results(self._desired, snap.observed))
        self._verify_gauge(snap.verified)
        if self._desired is not None and not snap.transports:
            snap = dataclasses.replace(snap, transports=self.transport_results(self._desired, snap.observed))
        metrics.set_socket_fallback({(r.node, r.deployment): r.transport.socket_fallback
                                     for r in snap.transports if r.transport.ok is not None})
        return snap

    def holds(self, held: dict[str, str]) -> None:
        """The step_hold gauge: 1 while held, back to 0 once no longer held — also when the hold ended by a success
        or a new generation, which drop the step's record (the gauge once stayed 1 until the daemon restarted,
        and ReconcilerStepHeld kept firing)."""
        now = {kind_and_node(sid) for sid in held}
        for kind, node in self._held - now:
            metrics.step_hold.labels(kind=kind, node=node).set(0)
        for kind, node in now:
            metrics.step_hold.labels(kind=kind, node=node).set(1)
        self._held = now

    def failures(self, failures: dict[str, int]) -> None:
        """The step_failures gauge: each step's consecutive failures (the most of the steps of one kind and node),
        back to 0 once its record goes (a success, a new generation)."""
        now: dict[tuple[str, str], int] = {}
        for sid, count in failures.items():
            key = kind_and_node(sid)
            now[key] = max(now.get(key, 0), count)
        for kind, node in self._failing - now.keys():
            metrics.step_failures.labels(kind=kind, node=node).set(0)
        for (kind, node), count in now.items():
            metrics.step_failures.labels(kind=kind, node=node).set(count)
        self._failing = set(now)

    def roles(self, desired: Desired) -> None:
        """The gauges of the desired state in force, set at each publish: node_role (its nodes; a node that left it
        leaves the gauge) and deployment_info (its deployments; one renamed or removed leaves every
        per-deployment gauge, metrics.set_deployments)."""
        now: set[tuple[str, str]] = {(node.name, node.role) for node in desired.nodes}
        for name, role in self._roles - now:
            metrics.node_role.remove(name, role)
        for name, role in now:
            metrics.node_role.labels(node=name, role=role).set(1)
        self._roles = now
        metrics.set_deployments([{"deployment": view.deployment.name, "model": view.model.id,
                                  "served_name": view.served_name, "endpoint": endpoint(view)}
                                 for view in desired.views()])
        metrics.memory_margin.set(desired.policy.memory_margin)
        self._desired = desired
        self._judge_memory()

    def memory(self, fields: Mapping[str, Any], now: float) -> None:
        """A rank's node once its deployment served (await-health's `serving.memory`: node, deployment, MemTotal,
        MemAvailable, the container's memory.current, the running containers, the weights' size), judged against
        the budget of the desired state in force (`core.budget.overshoot`) into /status (`memory`) and the
        overshoot gauges. The reading replaces the rank's last one; it stays until the next start of the rank or
        until its deployment leaves the node. Called from a step's thread."""
        with self._memory_lock:
            self._readings[(str(fields["node"]), str(fields["deployment"]))] = (dict(fields), now)
        self._judge_memory()

    def verified(self, fields: Mapping[str, Any]) -> None:
        """A deployment's serving.verify as await-health's `serving.verify` reported it (deployment, the head's
        container it checked, the verify it asked, ok, the message): it replaces the deployment's last one and is
        judged at each publish against what runs then (`conditions.verify_results`). Called from a step's thread."""
        with self._memory_lock:
            self._verifies[str(fields["deployment"])] = dict(fields)

    def transport(self, fields: Mapping[str, Any]) -> None:
        """A rank's network as await-health's `serving.transport` reported it (node, deployment, the container it
        read, the networks its log names): it replaces the rank's last one and is judged at each publish against
        what runs then (`conditions.transport_results`). Called from a step's thread."""
        with self._memory_lock:
            self._transports[(str(fields["node"]), str(fields["deployment"]))] = dict(fields)

    def transport_results(self, desired: Desired, observed: Observed | None) -> list[conditions.RankTransport]:
        """Each rank of a deployment across nodes of `desired`, judged by its last report against `observed`."""
        with self._memory_lock:
            reports = dict(self._transports)
        return conditions.transport_results(desired, observed, reports)

    def verify_results(self, desired: Desired, observed: Observed | None) -> list[conditions.Verified]:
        """Each declared serving.verify of `desired`, judged by its last report against `observed`."""
        with self._memory_lock:
            reports = dict(self._verifies)
        return conditions.verify_results(desired, observed, reports)

    def answers_wrong(self, desired: Desired, observed: Observed | None) -> bool:
        """A deployment of `desired` failed its serving.verify for what runs now: the generation is not converged,
        whatever its plan says (the controller then records no convergence and no `served`)."""
        return any(v.ok is False for v in self.verify_results(desired, observed))

    @staticmethod
    def _verify_gauge(checked: list[conditions.Verified]) -> None:
        """reconciler_serving_verified: 1 or 0 for a deployment whose check counts for what runs now; no series
        for the others (none declared, not checked)."""
        metrics.set_verified({v.deployment: v.ok for v in checked if v.ok is not None})

    def memory_view(self) -> list[dict[str, Any]]:
        with self._memory_lock:
            return list(self._memory_view)

    def _judge_memory(self) -> None:
        """Every reading judged by the desired state in force; a reading of a deployment no longer on its node (or
        in the file) is dropped, and its series with it."""
        desired = self._desired
        if desired is None:
            return
        with self._memory_lock:
            view: list[dict[str, Any]] = []
            for (node, deployment), (f, when) in sorted(self._readings.items()):
                spans = deployment in desired.deployment_names and node in {
                    n.name for n in desired.view(deployment).serving_nodes}
                if not spans:
                    del self._readings[(node, deployment)]
                    for gauge in (metrics.memory_overshoot, metrics.serving_memory_current):
                        _forget(gauge, node, deployment)
                    continue
                current = f.get("current") if isinstance(f.get("current"), int) else None
                if current is None:
                    _forget(metrics.serving_memory_current, node, deployment)
                else:
                    metrics.serving_memory_current.labels(node=node, deployment=deployment).set(current)
                total, available = f.get("total"), f.get("available")
                if not isinstance(total, int) or not isinstance(available, int):
                    _forget(metrics.memory_overshoot, node, deployment)
                    view.append({"node": node, "deployment": deployment, "memoryCurrent": current,
                                 "overshoot": None, "time": when, "words": f"{node}: /proc/meminfo unread"})
                    continue
                weights = f.get("weights")
                found = overshoot(desired, node, deployment, total, available, set(f.get("running") or ()),
                                  {deployment: weights if isinstance(weights, int) else None}, current)
                metrics.memory_overshoot.labels(node=node, deployment=deployment).set(found.bytes)
                view.append({**found.as_dict(), "time": when})
            self._memory_view = view
            self.status["memory"] = view

    @staticmethod
    def observation(desired: Desired, observed: Observed, durations: dict[str, float]) -> None:
        """The per-node gauges of one observation (reachability, link, memory, weights, serving)."""
        for name, seconds in durations.items():
            metrics.observe_duration.labels(node=name).observe(seconds)
        for name, obs in observed.nodes.items():
            _node_gauges(desired, name, obs)
        expected, synced = _weights_bytes(desired, observed)
        for node_name, total in expected.items():
            metrics.weights_bytes.labels(node=node_name, state="expected").set(total)
            metrics.weights_bytes.labels(node=node_name, state="synced").set(synced[node_name])
        for view in desired.views():
            StatusPublisher._serving(view, observed.view(view.deployment.name))

    @staticmethod
    def _serving(view: Desired, observed: Observed) -> None:
        """One deployment's serving gauges, under its `deployment` label (a name no longer in force is removed by
        `roles`, set_deployments)."""
        head = observed.nodes.get(view.api_node.name)
        want = view.served_name
        serving = head.serving if head else None
        deployment = view.deployment.name
        metrics.serving_healthy.labels(deployment).set(1 if serving and serving.working(want) else 0)
        metrics.serving_busy.labels(deployment).set(1 if serving and serving.busy else 0)
        metrics.serving_health_timeout.labels(deployment).set(view.serving.health_timeout)
        container = head.container(view.serving.container_name) if head else None
        started = started_timestamp(container.started_at) if container is not None and container.running else None
        metrics.serving_started.labels(deployment).set(started or 0)


def _rollback(snap: conditions.Snapshot) -> dict[str, object] | None:
    """/status's `rollback`: the change held and what serves in its place, or None."""
    held = snap.held_change
    return None if held is None else {"generation": held.generation, "to": held.to, "why": held.why,
                                      "since": held.since}


def _drift_counts(snap: conditions.Snapshot) -> dict[tuple[str, str], int]:
    """The drift that counts (actionable or blocking) per (node, kind)."""
    counts: dict[tuple[str, str], int] = {}
    for d in snap.plan.drift if snap.plan else []:
        if d.actionable or d.blocking:
            counts[(d.node, d.kind)] = counts.get((d.node, d.kind), 0) + 1
    return counts


def _node_gauges(desired: Desired, name: str, obs: NodeObservation) -> None:
    """One node's gauges: reachable, its fabric link and ports (a twin down halves the link and stops nothing),
    its available memory."""
    metrics.node_reachable.labels(node=name).set(1 if obs.reachable else 0)
    if obs.links():
        ports = ports_seen(desired.node(name), obs)
        metrics.fabric_link_up.labels(node=name).set(1 if carries(*ports[0]) else 0)
        for port, link in ports:
            metrics.fabric_port_up.labels(node=name, interface=port.interface).set(1 if carries(port, link) else 0)
    if obs.memory is not None:
        metrics.memory_available.labels(node=name).set(obs.memory.available_bytes)


def _weights_bytes(desired: Desired, observed: Observed) -> tuple[dict[str, int], dict[str, int]]:
    """Per node, the model bytes it should hold (expected) and holds of them (synced): the weights of every
    deployment it serves, summed; a node missing (an older observation) shows nothing."""
    expected: dict[str, int] = {}
    synced: dict[str, int] = {}
    for view in desired.views():
        seen = observed.view(view.deployment.name).nodes
        source = seen[view.source_node].weights if view.source_node in seen else None
        if source is None or not source.present:
            continue
        for node in view.serving_nodes:
            mine = seen[node.name].weights if node.name in seen else None
            expected[node.name] = expected.get(node.name, 0) + source.total_bytes
            synced[node.name] = synced.get(node.name, 0) + (
                min(mine.total_bytes, source.total_bytes) if mine and mine.present else 0)
    return expected, synced


def _forget(gauge: Any, node: str, deployment: str) -> None:
    """Remove one (node, deployment) series, if the gauge has it."""
    try:
        gauge.remove(node, deployment)
    except KeyError:
        pass


def endpoint(desired: Desired) -> str:
    """The OpenAI base URL the head serves the deployment of `desired` at, as `reconciler_deployment_info` names it:
    on the head's SSH address when serving.host is 0.0.0.0 (the API answers other machines there), on 127.0.0.1
    when vLLM binds loopback, the default (then only the head itself can ask, and a URL naming the head's address
    would be one no client can use)."""
    host = desired.api_node.ssh.host if desired.serving.host == "0.0.0.0" else "127.0.0.1"
    return f"http://{f'[{host}]' if ':' in host else host}:{desired.serving.port}/v1"
