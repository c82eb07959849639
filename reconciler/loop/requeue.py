"""When to reconcile again without any trigger, and why: the controller's requeue (controller-runtime's
Result.RequeueAfter). Pure: the clock's reading and everything due are passed in.
"""

from __future__ import annotations

from dataclasses import dataclass

from reconciler.core import spec
from reconciler.core.observed import Observed
from reconciler.core.planning import unhealthy_grace
from reconciler.edge.lease import RENEW_AFTER
from reconciler.loop.backoff import Backoff

#: While serving that served fails its health check (within the grace), reconcile again after at most this long.
UNHEALTHY_RECHECK = 5.0

#: A docker event can arrive before the container list shows what it announces: dockerd logs "die" and only then
#: cleans up and writes the container's new state to the view `/containers/json` reads (moby daemon/monitor.go,
#: ProcessEvent: LogContainerEventWithAttributes "die", daemon.Cleanup, CheckpointTo(containersReplica);
#: daemon/list.go lists from containersReplica.Snapshot()). A crashed rank then looked alive to the reconcile its
#: own event triggered, and nothing else woke the loop before UNHEALTHY_RECHECK (4 of 10 kills took 5.3 s to
#: plan in the benchmark). So a reconcile that a docker event triggered looks once more this long after.
EVENT_SETTLE = 0.5


@dataclass(frozen=True)
class Due:
    """What one reconcile knows of what comes due: after a docker event (`settle`), while holding the lease,
    the backoffs, the desired state in force and what was observed."""

    now: float
    settle: bool = False
    holding_lease: bool = False
    backoff: Backoff | None = None
    desired: spec.Desired | None = None
    observed: Observed | None = None


def _lease_renewal(due: Due) -> list[tuple[float, str]]:
    """A long resync must not let the lease lapse while our operations run."""
    if due.holding_lease and due.desired is not None and due.desired.policy.resync_interval > RENEW_AFTER:
        return [(RENEW_AFTER, "lease-renewal")]
    return []


def _backoff_end(due: Due) -> list[tuple[float, str]]:
    if due.backoff is None or (when := due.backoff.next_due(due.now)) is None:
        return []
    step = min((r.next_try, sid) for sid, r in due.backoff.records.items() if r.next_try > due.now)[1]
    return [(when - due.now, f"backoff-ended:{step}")]


def _health_rechecks(due: Due) -> list[tuple[float, str]]:
    """A failing API sends no event, and the event that made it fail (a rank's container dying) may arrive before
    the state shows it: while serving that served fails, look again often, like a readiness probe."""
    if due.desired is None or due.observed is None:
        return []
    found = []
    for view in due.desired.views():
        seen = due.observed.view(view.deployment.name)
        health = seen.node(view.api_node.name).serving
        if health is not None and health.served_before and health.unhealthy_for is not None:
            found.append((min(UNHEALTHY_RECHECK, unhealthy_grace(view, seen) - health.unhealthy_for),
                          "health-recheck"))
    return found


def requeue_after(due: Due) -> tuple[float, str] | None:
    """The next moment something is due without any trigger, and what: a backoff's end, a health grace's end, the
    lease's renewal, and after a docker event the second look that sees what the event announced; None: nothing
    before the next resync."""
    found = [(EVENT_SETTLE, "event-settle")] if due.settle else []
    found += _lease_renewal(due) + _backoff_end(due) + _health_rechecks(due)
    if not found:
        return None
    seconds, why = min(found)
    return max(0.0, seconds), why
