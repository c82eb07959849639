"""Generation 0: what ran before the reconciler, brought back when a first generation fails.

A rollback brings back the newest generation that served (loop/history). A first generation has none, yet on the
seed's head the owner's GLM, embeddings and reranker served before the reconciler stopped them to make room; if
that first start fails for a reason no preflight could see (an NCCL error, a kernel bug, an OOM during the
profile run), the head would serve nothing until a person noticed. So a generation records the co-tenants it
stopped (their node, name and container id), and "what ran before" is those containers, started again as they
were: Argo Rollouts' abort to the stable ReplicaSet, where the stable set is the owner's own containers.

The plan, pure like every plan: stop every serving container of ours that exists (the failed generation's ranks,
with the wedged grace: it never served, there is nothing to drain), then `docker start` each recorded co-tenant
on its node after that node's stops. A co-tenant is started only when the container the node shows under its
name is the very one the reconciler stopped (same id: never one recreated or replaced since, never one removed
meanwhile), is not running, and is not managed by a reconciler. Nothing else: no copy, no link change, no
download; the failed generation's staging stays where it is for the next attempt.
"""

from __future__ import annotations

from dataclasses import dataclass

from reconciler.core.drift import Drift
from reconciler.core.observed import Observed
from reconciler.core.ownership import owner
from reconciler.core.planning import WEDGED_STOP_GRACE, Blocker, Plan, Step
from reconciler.core.spec import Desired


@dataclass(frozen=True)
class StoppedCoTenant:
    """A container the reconciler stopped to make room, as it was when stopped (the id: the container itself, not
    whatever later bears its name)."""

    node: str
    name: str
    id: str


#: What status and `reconciler history` say a generation-0 rollback brought back.
AS_FOUND = "the co-tenants as found"


def restore_plan(desired: Desired, observed: Observed, stopped: tuple[StoppedCoTenant, ...],
                 generation: int) -> Plan:
    """The plan that takes the node back to before `generation` (which failed, and stopped `stopped`)."""
    ours = owner(desired, observed)
    drift: list[Drift] = []
    steps: list[Step] = []
    blocked: list[Blocker] = []
    stops: dict[str, list[str]] = {}
    for node, name in sorted(desired.serving_containers):
        seen = observed.node(node)
        container = seen.container(name) if seen.usable else None
        if container is None or not container.owned_by(ours) or not container.running:
            continue
        step = Step("stop-serving", node, f"generation {generation} failed before it served: back to what ran "
                    "before it", container=name, grace=WEDGED_STOP_GRACE)
        drift.append(Drift(node, "serving", f"container/{name}", f"stopped (generation {generation} failed)",
                           f"{container.state}", container=name))
        steps.append(step)
        stops.setdefault(node, []).append(step.id)
    for tenant in stopped:
        seen = observed.node(tenant.node)
        if not seen.usable:
            blocked.append(Blocker(tenant.node, f"{tenant.name} waits to be started again: {tenant.node} does not "
                                                "answer"))
            continue
        container = seen.container(tenant.name)
        if container is None or container.id != tenant.id or container.managed or container.running:
            continue  # gone, replaced since, or running again: nothing of ours to bring back
        drift.append(Drift(tenant.node, "co-tenant", f"container/{tenant.name}",
                           f"running, as before generation {generation}",
                           f"{container.state} (stopped by generation {generation})", container=tenant.name))
        steps.append(Step("start-container", tenant.node, f"{tenant.name} ran before generation {generation}, "
                          "which stopped it and then failed", tuple(stops.get(tenant.node, ())),
                          container=tenant.name, container_id=tenant.id))
    mode = "paused" if desired.policy.paused else desired.policy.mode
    return Plan(drift, steps, blocked, mode)
