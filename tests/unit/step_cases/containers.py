"""stop-container (a co-tenant the file does not allow) and stop-serving (our own serving container)."""

from __future__ import annotations

from reconciler.core.observed import LABEL_INSTANCE, LABEL_MANAGED
from reconciler.core.planning import Step
from reconciler.core.spec import Desired
from reconciler.edge.ssh import Result
from tests.unit.step_cases import HEAD, WORKER, Case, inspected, no_such, sample
from tests.unit.step_driver import Raw

INSTANCE = "10.1.230.180:22"  # the sample head's ssh host:port: this cluster's label while it has no cluster id
OURS = {LABEL_MANAGED: "true", LABEL_INSTANCE: INSTANCE}
SERVING = "vllm_serving"


def _protecting(node: str, name: str) -> Desired:
    """The sample with `name` protected on `node` (co_tenants.protected)."""
    desired = sample()
    co_tenants = desired.co_tenants.model_copy(update={"protected": {node: [name]}})
    return desired.model_copy(update={"co_tenants": co_tenants})


def _co_tenant(name: str, node: str = HEAD) -> Step:
    return Step("stop-container", node, "not allowed", (), container=name)


def _serving(name: str = SERVING, node: str = HEAD, grace: int | None = None) -> Step:
    return Step("stop-serving", node, "restart", (), container=name, grace=grace)


def _stopped_and_removed(grace: int, node: str = HEAD) -> list[str]:
    return [f"read {node} container {SERVING}", f"run {node} docker stop -t {grace} {SERVING}",
            f"wait {node} container {SERVING}", f"run {node} docker rm {SERVING}", f"wait {node} container {SERVING}"]


GONE_AFTER_STOP = [inspected(SERVING, labels=OURS), inspected(SERVING, "exited", labels=OURS), no_such(SERVING)]


STOP_NODE = [f"read {HEAD} container vllm_node", f"run {HEAD} docker stop -t 30 vllm_node",
             f"wait {HEAD} container vllm_node", "report co-tenant.stopped"]

#: The id `inspected` gives every container: the one the failed generation stopped.
STOPPED_ID = "c0ffee" * 10 + "0123"


def _restore(after: tuple[str, ...] = (), container_id: str = STOPPED_ID) -> Step:
    return Step("start-container", HEAD, "ran before generation 1", after, container="vllm_node",
                container_id=container_id)


def _meminfo(available_gib: float) -> Raw:
    return Raw(f"MemTotal:       127535224 kB\nMemAvailable:   {int(available_gib * (1 << 20))} kB")


RESTARTED = [f"run {HEAD} docker start {STOPPED_ID}", f"wait {HEAD} container vllm_node", "report co-tenant.restored"]

CASES = [
    # start-container: generation 0's restore (core/restore), only the very container that was stopped
    Case("restore: the co-tenant the failed generation stopped is started by its id", _restore(),
         [f"read {HEAD} container vllm_node", *RESTARTED],
         facts={f"{HEAD} container vllm_node": [inspected("vllm_node", "exited"), inspected("vllm_node")]}),
    Case("restore: after the node's failed rank stopped, it waits for memory to stop rising first",
         _restore(after=(f"stop-serving/{HEAD}/{SERVING}",)),
         [f"read {HEAD} container vllm_node", f"wait {HEAD} meminfo", *RESTARTED],
         facts={f"{HEAD} container vllm_node": [inspected("vllm_node", "exited"), inspected("vllm_node")],
                f"{HEAD} meminfo": [_meminfo(20), _meminfo(60), _meminfo(95), _meminfo(95.5)]}),
    Case("restore: removed meanwhile: said, nothing run", _restore(),
         [f"read {HEAD} container vllm_node", "report co-tenant.not-restored"],
         facts={f"{HEAD} container vllm_node": [no_such("vllm_node")]}),
    Case("restore: another container under its name now: never started", _restore(container_id="ab" * 32),
         [f"read {HEAD} container vllm_node", "report co-tenant.not-restored"],
         facts={f"{HEAD} container vllm_node": [inspected("vllm_node", "exited")]}),
    Case("restore: running again already: nothing run", _restore(),
         [f"read {HEAD} container vllm_node", "report co-tenant.not-restored"],
         facts={f"{HEAD} container vllm_node": [inspected("vllm_node")]}),
    Case("restore: a managed container is never started as a co-tenant", _restore(),
         [f"read {HEAD} container vllm_node"], raises="managed by a reconciler; never started as a co-tenant",
         facts={f"{HEAD} container vllm_node": [inspected("vllm_node", "exited", labels=OURS)]}),
    Case("co-tenant: a running unlisted container is stopped, never removed", _co_tenant("vllm_node"), STOP_NODE,
         facts={f"{HEAD} container vllm_node": [inspected("vllm_node"), inspected("vllm_node", "exited")]},
         timeouts={f"{HEAD} docker stop -t 30 vllm_node": 60}),  # the grace, and 30 s for docker to say so
    Case("co-tenant: the file protects it now: nothing read, nothing run", _co_tenant("vllm_node"), [],
         desired=lambda: _protecting(HEAD, "vllm_node")),
    Case("co-tenant: protected on another node only: stopped here", _co_tenant("vllm_node"), STOP_NODE,
         facts={f"{HEAD} container vllm_node": [inspected("vllm_node"), inspected("vllm_node", "exited")]},
         desired=lambda: _protecting(WORKER, "vllm_node")),
    Case("co-tenant: stopped once docker says so, also when it is gone by then", _co_tenant("vllm_node"), STOP_NODE,
         facts={f"{HEAD} container vllm_node": [inspected("vllm_node"), no_such("vllm_node")]}),
    Case("co-tenant: the file allows it now: nothing read, nothing run", _co_tenant("reranker"), []),
    Case("co-tenant: allowed on the worker, the step for the worker does nothing",
         _co_tenant("vllm_embeddings", WORKER), []),
    Case("co-tenant: already stopped: read, nothing run", _co_tenant("vllm_node"), [f"read {HEAD} container vllm_node"],
         facts={f"{HEAD} container vllm_node": [inspected("vllm_node", "exited")]}),
    Case("co-tenant: gone: read, nothing run", _co_tenant("vllm_node"), [f"read {HEAD} container vllm_node"],
         facts={f"{HEAD} container vllm_node": [no_such("vllm_node")]}),
    Case("co-tenant: a container the reconciler manages is never stopped as a co-tenant", _co_tenant("vllm_node"),
         [f"read {HEAD} container vllm_node"],
         facts={f"{HEAD} container vllm_node": [inspected("vllm_node", labels=OURS)]},
         raises="vllm_node on spark-1a32 is managed by the reconciler; co-tenant stop refused"),
    Case("co-tenant: a stop that never shows fails the step", _co_tenant("vllm_node"), STOP_NODE[:3],
         facts={f"{HEAD} container vllm_node": [inspected("vllm_node")]},
         raises="timed out after 15s waiting for vllm_node to stop on spark-1a32"),
    Case("co-tenant: docker stop failing fails the step", _co_tenant("vllm_node"), STOP_NODE[:2],
         facts={f"{HEAD} container vllm_node": [inspected("vllm_node")]},
         results={f"{HEAD} docker stop -t 30 vllm_node": [Result("", "Error response from daemon: boom", 1)]},
         raises="boom", error="CommandFailed"),
    Case("co-tenant: docker's inspect failing otherwise is no licence to stop", _co_tenant("vllm_node"),
         [f"read {HEAD} container vllm_node"],
         facts={f"{HEAD} container vllm_node": [inspected("vllm_node").__class__("Cannot connect to the Docker "
                                                                                   "daemon", 1)]},
         raises="docker inspect failed: Cannot connect to the Docker daemon"),
    Case("serving: ours under the serving name: stopped, removed, seen gone", _serving(),
         [f"read {HEAD} container {SERVING}", f"run {HEAD} docker stop -t 30 {SERVING}",
          f"wait {HEAD} container {SERVING}", f"run {HEAD} docker rm {SERVING}", f"wait {HEAD} container {SERVING}"],
         facts={f"{HEAD} container {SERVING}": [inspected(SERVING, labels=OURS),
                                                inspected(SERVING, "exited", labels=OURS), no_such(SERVING)]}),
    Case("serving: a wedged generation (the plan's grace, 1 s): stopped with it, not the policy's 30 s",
         _serving(grace=1), _stopped_and_removed(1), facts={f"{HEAD} container {SERVING}": GONE_AFTER_STOP},
         timeouts={f"{HEAD} docker stop -t 1 {SERVING}": 31}),
    Case("serving: the plan's grace never lengthens the policy's", _serving(grace=600), _stopped_and_removed(30),
         facts={f"{HEAD} container {SERVING}": GONE_AFTER_STOP}),
    Case("serving: ours already stopped: removed only", _serving(),
         [f"read {HEAD} container {SERVING}", f"run {HEAD} docker rm {SERVING}", f"wait {HEAD} container {SERVING}"],
         facts={f"{HEAD} container {SERVING}": [inspected(SERVING, "exited", labels=OURS), no_such(SERVING)]}),
    Case("serving: ours under a former name: stopped and left for the operator", _serving("vllm_old"),
         [f"read {HEAD} container vllm_old", f"run {HEAD} docker stop -t 30 vllm_old",
          f"wait {HEAD} container vllm_old"],
         facts={f"{HEAD} container vllm_old": [inspected("vllm_old", labels=OURS),
                                               inspected("vllm_old", "exited", labels=OURS)]}),
    Case("serving: made before the instance label existed: still ours", _serving(),
         [f"read {HEAD} container {SERVING}", f"run {HEAD} docker stop -t 30 {SERVING}",
          f"wait {HEAD} container {SERVING}", f"run {HEAD} docker rm {SERVING}", f"wait {HEAD} container {SERVING}"],
         facts={f"{HEAD} container {SERVING}": [inspected(SERVING, labels={LABEL_MANAGED: "true"}),
                                                inspected(SERVING, "exited"), no_such(SERVING)]}),
    Case("serving: gone already: nothing to do", _serving(), [f"read {HEAD} container {SERVING}"],
         facts={f"{HEAD} container {SERVING}": [no_such(SERVING)]}),
    Case("serving: not created by the reconciler: refused", _serving(), [f"read {HEAD} container {SERVING}"],
         facts={f"{HEAD} container {SERVING}": [inspected(SERVING)]},
         raises="vllm_serving on spark-1a32 was not created by the reconciler; it is never stopped or removed"),
    Case("serving: another cluster's: refused, with the line that would adopt it", _serving(),
         [f"read {HEAD} container {SERVING}"],
         facts={f"{HEAD} container {SERVING}": [inspected(SERVING, labels={LABEL_MANAGED: "true",
                                                                           LABEL_INSTANCE: "10.9.9.9:22"})]},
         raises=r"is not this cluster's \(instance 10.9.9.9:22, this one is .*\); never stopped or removed"),
    Case("serving: the rm's removal never shows: fails", _serving(),
         [f"read {HEAD} container {SERVING}", f"run {HEAD} docker rm {SERVING}", f"wait {HEAD} container {SERVING}"],
         facts={f"{HEAD} container {SERVING}": [inspected(SERVING, "exited", labels=OURS)]},
         raises="timed out after 30s waiting for vllm_serving to be removed on spark-1a32"),
]
