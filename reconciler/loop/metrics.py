"""Every metric the daemon exports, defined in this one place (names and labels are a contract with the alert
rules in monitoring/ and the Grafana dashboard; tests/unit/repo/test_monitoring.py checks they agree).

Conventions: base units (`_seconds`, `_bytes`), counters end in `_total`, `_info` style gauges (always 1) for the
build and for each deployment, and low-cardinality labels only (node, kind, step kind, result, condition type,
deployment): never container ids or text.

Every series about one deployment carries its name as the label `deployment` (PER_DEPLOYMENT, and
`reconciler_deployment_info` with its model and endpoint): a file of several deployments is a series each, and
dashboards and alerts join on it (`on (job, instance, deployment)`); the single form's is `deployment="default"`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from importlib.metadata import PackageNotFoundError, version

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from reconciler.core.vllm_log import STAGES

REGISTRY = CollectorRegistry(auto_describe=True)

PHASES = ("Converged", "Converging", "Degraded", "Blocked", "Paused", "Invalid", "RolledBack")
_DURATION_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 900, 3600)

drift = Gauge("reconciler_drift", "Drifted resources by node and kind (0 when in sync).", ["node", "kind"],
              registry=REGISTRY)
converged = Gauge("reconciler_converged", "1 when the last observation matched the desired state.",
                  registry=REGISTRY)
phase = Gauge("reconciler_phase", "1 for the current phase, 0 for the others.", ["phase"], registry=REGISTRY)
condition = Gauge("reconciler_condition", "Conditions (node=\"\" for cluster-level), 1 for the current status.",
                  ["node", "type", "status"], registry=REGISTRY)
reconcile_duration = Histogram("reconciler_reconcile_duration_seconds", "Duration of a whole reconcile.",
                               buckets=_DURATION_BUCKETS, registry=REGISTRY)
reconciles = Counter("reconciler_reconciles_total", "Reconciles by result (success, noop, error).", ["result"],
                     registry=REGISTRY)
steps = Counter("reconciler_steps_total", "Steps run by kind and result.", ["kind", "result"], registry=REGISTRY)
step_duration = Histogram("reconciler_step_duration_seconds", "Duration of steps by kind.", ["kind"],
                          buckets=_DURATION_BUCKETS, registry=REGISTRY)
step_hold = Gauge("reconciler_step_hold", "1 while a step that keeps failing is held (not retried until its "
                  "backoff expires or the desired state changes).", ["kind", "node"], registry=REGISTRY)
node_reachable = Gauge("reconciler_node_reachable", "1 when the node answered the last probe over SSH.", ["node"],
                       registry=REGISTRY)
observe_duration = Histogram("reconciler_observe_duration_seconds", "Duration of the batched probe of one node.",
                             ["node"], buckets=_DURATION_BUCKETS, registry=REGISTRY)
desired_state_valid = Gauge("reconciler_desired_state_valid", "1 when the desired-state file on disk is valid.",
                            registry=REGISTRY)
desired_state_generation = Gauge("reconciler_desired_state_generation",
                                 "Generation of the last valid desired state (bumped on each valid change).",
                                 registry=REGISTRY)
rolled_back = Gauge("reconciler_rolled_back", "1 while a change that never served is held and the last generation "
                    "that served is enforced in its place (policy.on_failed_change: rollback).", registry=REGISTRY)
rolled_back_to = Gauge("reconciler_rolled_back_to_generation", "The generation a rollback brought back (0: none).",
                       registry=REGISTRY)
rollbacks = Counter("reconciler_rollbacks_total", "Failed changes rolled back to the last generation that served.",
                    registry=REGISTRY)
observed_generation = Gauge("reconciler_observed_generation", "Generation the cluster last converged to.",
                            registry=REGISTRY)
last_converged = Gauge("reconciler_last_converged_timestamp_seconds", "Unix time of the last converged "
                       "observation.", registry=REGISTRY)
last_reconcile = Gauge("reconciler_last_reconcile_timestamp_seconds", "Unix time the last reconcile ended "
                       "(crashed or not): it moves every cycle while the loop lives.", registry=REGISTRY)
operations = Gauge("reconciler_operations_in_flight", "Steps running beside the loop, by step kind.", ["kind"],
                   registry=REGISTRY)
fabric_link_up = Gauge("reconciler_fabric_link_up", "1 when the node's first fabric port carries (up, carrier, RDMA "
                       "port ACTIVE): the one the rendezvous and NCCL need.", ["node"], registry=REGISTRY)
fabric_port_up = Gauge("reconciler_fabric_port_up", "1 when this declared fabric port carries; a twin at 0 halves the "
                       "link and stops nothing.", ["node", "interface"], registry=REGISTRY)
memory_available = Gauge("reconciler_memory_available_bytes", "MemAvailable of the node (unified memory).",
                         ["node"], registry=REGISTRY)
memory_overshoot = Gauge("reconciler_memory_overshoot_bytes", "Read once the deployment's rank on the node served: "
                         "what the node held (MemTotal - MemAvailable) beyond what the budget reserved for the "
                         "holders running there (each rank's pool and policy.memory_overhead_per_instance, the "
                         "co-tenants' co_tenants.memory); below 0 the reservations were not all used. Above "
                         "policy.memory_margin (reconciler_memory_margin_bytes) the node is past its whole budget.",
                         ["node", "deployment"], registry=REGISTRY)
serving_memory_current = Gauge("reconciler_serving_memory_current_bytes", "The rank container's cgroup "
                               "memory.current once it served (docker's memory_stats.usage): its host side; on a "
                               "GB10 the CUDA allocations are charged to no cgroup.", ["node", "deployment"],
                               registry=REGISTRY)
memory_margin = Gauge("reconciler_memory_margin_bytes", "policy.memory_margin of the desired state in force: what "
                      "an overshoot may take before the node is past its budget.", registry=REGISTRY)
weights_bytes = Gauge("reconciler_weights_bytes", "Model bytes on the node (synced) and on the source (expected).",
                      ["node", "state"], registry=REGISTRY)
weights_sync_bytes = Counter("reconciler_weights_sync_bytes_total", "Bytes copied to the node by weight syncs.",
                             ["node"], registry=REGISTRY)
serving_healthy = Gauge("reconciler_serving_healthy", "1 when /health is 200, the model is listed and a "
                        "completion answers, or the engine is busy (its tokens grow while the completion queues).",
                        ["deployment"], registry=REGISTRY)
serving_busy = Gauge("reconciler_serving_busy", "1 while the head's engine is busy: every slot taken, the probe's "
                     "completion queued, tokens still coming (vLLM's own counters); never a reason to restart.",
                     ["deployment"], registry=REGISTRY)
serving_health_timeout = Gauge("reconciler_serving_health_timeout_seconds", "serving.health_timeout of the desired "
                               "state in force: how long a cold start may take (the alerts judge a start by it).",
                               ["deployment"], registry=REGISTRY)
serving_started = Gauge("reconciler_serving_started_timestamp_seconds", "Unix time the head's serving container "
                        "started (docker's StartedAt); 0 while none runs.", ["deployment"], registry=REGISTRY)
serving_verified = Gauge("reconciler_serving_verified", "serving.verify's last check of what runs now: 1 when the "
                         "deployment's answer matched serving.verify.expect after its start, 0 when it answered "
                         "wrong, with an error or not at all; no series while not checked (none declared, no start "
                         "checked since the daemon started, the verify edited since).", ["deployment"],
                         registry=REGISTRY)
nccl_socket_fallback = Gauge("reconciler_nccl_socket_fallback", "Read once a deployment across nodes served: 1 when "
                             "the rank's NCCL chose its Socket network although the node's fabric declares RDMA "
                             "devices (the tensors cross over TCP, about a quarter of the speed), 0 when it chose IB "
                             "or another network; no series while not known (no `NCCL INFO Using network` line in "
                             "the rank's log, a new container not read yet).", ["node", "deployment"],
                             registry=REGISTRY)
INFO_LABELS = ("deployment", "model", "served_name", "endpoint")
deployment_info = Gauge("reconciler_deployment_info", "Always 1, one series per deployment in force: its model id, "
                        "served name and the OpenAI base URL the head serves it at, to join on (`* on (job, instance, "
                        "deployment) group_left(model, endpoint) reconciler_deployment_info`).",
                        INFO_LABELS, registry=REGISTRY)
step_failures = Gauge("reconciler_step_failures", "Consecutive failures of a step since it last succeeded or the "
                      "desired state changed (0 again then): a failed cold start is no longer one within its "
                      "allowance.", ["kind", "node"], registry=REGISTRY)
node_role = Gauge("reconciler_node_role", "Always 1, one series per node of the desired state in force; role is "
                  "head or worker (an unreachable head pages once, not once per node behind it).",
                  ["node", "role"], registry=REGISTRY)
events = Counter("reconciler_events_total", "Triggers received (docker and link events per node, file changes, "
                 "resyncs, signals).", ["node", "source"], registry=REGISTRY)
build_info = Gauge("reconciler_build_info", "Always 1; the version label says which build runs.", ["version"],
                   registry=REGISTRY)

#: The gauges with one series per deployment (label `deployment`): a deployment no longer in force leaves them all.
#: (reconciler_serving_verified has a series only while a check counts: the status publisher sets and removes it.)
PER_DEPLOYMENT: tuple[Gauge, ...] = (serving_healthy, serving_busy, serving_health_timeout, serving_started)


class OperationProgress(Collector):
    """How far the operations in flight are, read from them at each scrape (the view /status shows), so a stalled
    copy's rate falls while it stalls and an operation's series leave with it: nothing to reset, nothing stale.

    - `reconciler_operation_progress_ratio{kind,node}`: 0..1 done, from bytes of a known total (image copy, weight
      sync, download) or from the percent vLLM's current line shows during a cold start (`await-health`: shards
      loaded, CUDA graphs captured; a stage with no number has no series);
    - `reconciler_operation_bytes_per_second{kind,node}`: since the bytes started moving;
    - `reconciler_serving_start_stage{node,stage}`: 1 for the stage a cold start is in, 0 for the others
      (reconciler.core.vllm_log.STAGES), while `await-health` runs on that node.

    No operation in flight (or none that says how far it is): no series, never a 0 that reads as "stuck"."""

    def __init__(self) -> None:
        self._view: Callable[[], Iterable[Mapping[str, object]]] = tuple

    def follow(self, view: Callable[[], Iterable[Mapping[str, object]]]) -> None:
        """Read the operations from `view` (Operations.view) from now on."""
        self._view = view

    def describe(self) -> Iterable[Metric]:
        return self._families()

    def collect(self) -> Iterable[Metric]:
        ratio, rate, stage = families = self._families()
        for op in self._view():
            kind, node = str(op["kind"]), str(op["node"])
            if (done := progress_ratio(op)) is not None:
                ratio.add_metric([kind, node], done)
            if isinstance(speed := op.get("bytesPerSecond"), int):
                rate.add_metric([kind, node], speed)
            if kind == "await-health" and op.get("stage") in STAGES:
                for name in STAGES:
                    stage.add_metric([node, name], 1 if name == op["stage"] else 0)
        return families

    @staticmethod
    def _families() -> list[GaugeMetricFamily]:
        return [
            GaugeMetricFamily("reconciler_operation_progress_ratio", "Fraction done (0..1) of an operation in "
                              "flight: bytes of the total, or the percent of a cold start's current line.",
                              labels=["kind", "node"]),
            GaugeMetricFamily("reconciler_operation_bytes_per_second", "Bytes per second an operation in flight "
                              "moves (image copy, weight sync, download), since its bytes started moving.",
                              labels=["kind", "node"]),
            GaugeMetricFamily("reconciler_serving_start_stage", "1 for the stage the cold start on the node is in "
                              "(waiting, loading-weights, compiling, cuda-graphs, api-starting, serving), 0 for "
                              "the others; only while it is awaited.", labels=["node", "stage"]),
        ]


def progress_ratio(op: Mapping[str, object]) -> float | None:
    """0..1 done of one operation (Operation.as_dict): bytes of a known total, else the percent of its line."""
    done, total, percent = op.get("bytesDone"), op.get("bytesTotal"), op.get("percent")
    if isinstance(done, int) and isinstance(total, int) and total > 0:
        return min(1.0, done / total)
    if isinstance(percent, int):
        return min(100, max(0, percent)) / 100
    return None


operation_progress = OperationProgress()
REGISTRY.register(operation_progress)

try:
    VERSION = version("spark-reconciler")
except PackageNotFoundError:  # pragma: no cover - running from a source tree without install
    VERSION = "0+unknown"
build_info.labels(version=VERSION).set(1)
desired_state_valid.set(0)
converged.set(0)
for _p in PHASES:
    phase.labels(phase=_p).set(0)


def set_phase(current: str) -> None:
    for p in PHASES:
        phase.labels(phase=p).set(1 if p == current else 0)


def set_conditions(conditions: Sequence[Mapping[str, object]]) -> None:
    """Export conditions as one series per (node, type, status) with 1 on the current status."""
    for c in conditions:
        for status in ("True", "False", "Unknown"):
            condition.labels(node=c.get("node", ""), type=c["type"], status=status).set(
                1 if c["status"] == status else 0)


def set_drift(counts: dict[tuple[str, str], int], nodes: list[str], kinds: tuple[str, ...]) -> None:
    """Every (node, kind) gets a value, 0 included, so alerts see a series go back to 0 instead of vanishing."""
    for node in nodes:
        for kind in kinds:
            drift.labels(node=node, kind=kind).set(counts.get((node, kind), 0))


def set_deployments(deployments: Sequence[Mapping[str, str]]) -> None:
    """`reconciler_deployment_info`: one series per deployment in force (each mapping holds the four INFO_LABELS),
    and every other series gone, from it and from the PER_DEPLOYMENT gauges: a deployment renamed or removed by a
    file edit, or a model changed under the same name, would otherwise stay exported with its last value, and an
    alert would keep judging a deployment that no longer exists (node_role and the step gauges avoid it the same
    way). The series are found through collect(), the view a scrape gets, so none is missed that an observation
    made after the last call set."""
    wanted = {tuple(d[label] for label in INFO_LABELS) for d in deployments}
    names = {d["deployment"] for d in deployments}
    for labels in _series(deployment_info):
        if (values := tuple(labels[label] for label in INFO_LABELS)) not in wanted:
            deployment_info.remove(*values)
    for values in wanted:
        deployment_info.labels(*values).set(1)
    for gauge in PER_DEPLOYMENT:
        for labels in _series(gauge):
            if labels["deployment"] not in names:
                gauge.remove(labels["deployment"])


def set_verified(checked: Mapping[str, bool]) -> None:
    """reconciler_serving_verified: 1 or 0 for each deployment whose serving.verify counts for what runs now, and
    no series for any other (found through collect(), as set_deployments finds them): a check that no longer
    counts (another container, an edited verify, a deployment gone) must not keep a stale 0 paging."""
    for labels in _series(serving_verified):
        if labels["deployment"] not in checked:
            serving_verified.remove(labels["deployment"])
    for deployment, ok in checked.items():
        serving_verified.labels(deployment).set(1 if ok else 0)


def set_socket_fallback(judged: Mapping[tuple[str, str], bool]) -> None:
    """reconciler_nccl_socket_fallback: 1 or 0 for each (node, deployment) whose rank's network is known for what
    runs now, and no series for any other (a reading of an earlier container must not keep paging)."""
    for labels in _series(nccl_socket_fallback):
        if (labels["node"], labels["deployment"]) not in judged:
            nccl_socket_fallback.remove(labels["node"], labels["deployment"])
    for (node, deployment), fallback in judged.items():
        nccl_socket_fallback.labels(node=node, deployment=deployment).set(1 if fallback else 0)


def _series(gauge: Gauge) -> list[dict[str, str]]:
    return [sample.labels for family in gauge.collect() for sample in family.samples]


class WeightsSynced:
    """`reconciler_weights_sync_bytes_total` from the weight syncs' progress reports: each report carries the bytes
    done so far by the sync on its node, the counter takes the increase (a sync that starts again starts at 0)."""

    def __init__(self) -> None:
        self.done: dict[str, int] = {}  # node -> bytes reported by the weight sync in flight

    def started(self, node: str) -> None:
        self.done[node] = 0

    def reported(self, node: str, done: int) -> None:
        if done > self.done.get(node, 0):
            weights_sync_bytes.labels(node=node).inc(done - self.done.get(node, 0))
        self.done[node] = done


def step_ended(kind: str, result: str, seconds: float) -> None:
    """A step's end: counted by kind and result, timed unless it was skipped (it never ran)."""
    steps.labels(kind=kind, result=result).inc()
    if result != "skipped":
        step_duration.labels(kind=kind).observe(seconds)


def set_in_flight(in_flight: Iterable[str], kinds: Iterable[str]) -> None:
    """reconciler_operations_in_flight: the steps beside the loop per kind, every kind set (0 when none runs)."""
    counts: dict[str, int] = {}
    for kind in in_flight:
        counts[kind] = counts.get(kind, 0) + 1
    for kind in kinds:
        operations.labels(kind=kind).set(counts.get(kind, 0))
