"""What one reconcile tells: its status published (`status.StatusPublisher`, from one `conditions.Snapshot`), its
end counted, timed and logged in one line, and each node's trouble said once when it starts, changes or ends.

Published whatever the reconcile found before it ended (`Cycle`), a crash included: the status then says Degraded
with the error, never the last Converged.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from reconciler.core import spec
from reconciler.core.kinds import STEP_KINDS
from reconciler.core.observed import NodeObservation, Observed
from reconciler.core.planning import Plan, Step
from reconciler.loop import conditions, metrics
from reconciler.loop.enforcement import Enforcement
from reconciler.loop.status import StatusPublisher


@dataclass
class Cycle:
    """What one reconcile found so far: published whatever happens next (a crash included)."""

    desired: spec.Desired | None
    observed: Observed | None = None
    current: Plan | None = None
    error: str | None = None
    started: int = 0


class Publishing:
    """The Controller's voice: `publisher` (shared with the steps' reports), its wall clock, its log."""

    def __init__(self, publisher: StatusPublisher, wall: Callable[[], float], logger: Any) -> None:
        self.publisher = publisher
        self.clock = wall
        self.log = logger
        self._troubles: dict[str, tuple[str, str]] = {}  # node -> what was wrong at the last look (said once)

    def publish(self, cycle: Cycle, failures: list[str], force: Enforcement, in_flight: list[Step]) -> str:
        """The status as `force` stands after `cycle`, in /status, the metrics and systemd's line; its phase."""
        desired, backoff, store = force.desired, force.backoff, force.store
        held = backoff.held() if backoff else {}
        self.publisher.holds(held)
        self.publisher.failures(backoff.failures() if backoff else {})
        if desired is not None:
            self.publisher.roles(desired)
        metrics.set_in_flight([step.kind for step in in_flight], STEP_KINDS)
        snap = conditions.Snapshot(
            generation=store.generation, observed_generation=store.observed_generation,
            file_error=force.file_error, observed=cycle.observed, plan=cycle.current,
            step_failures=failures + ([cycle.error] if cycle.error else []), held=held,
            paused=bool(desired and desired.policy.paused), mode=desired.policy.mode if desired else "enforce",
            in_flight=[s.id for s in in_flight], held_change=force.held)
        self.publisher.publish(snap, [n.name for n in desired.nodes] if desired else [], cycle.error, self.clock(),
                               state_error=store.unsaved)
        return str(self.publisher.status["phase"])

    def said(self, cycle: Cycle, failures: list[str], trigger: list[str], phase: str, *, generation: int,
             reconcile: int, in_flight: int, seconds: float) -> None:
        """The reconcile's end: counted, timed, one log line."""
        result = ("error" if cycle.error or failures or cycle.desired is None
                  else "success" if cycle.started else "noop")
        current = cycle.current
        metrics.reconciles.labels(result=result).inc()
        metrics.reconcile_duration.observe(seconds)
        self.log.info("reconcile.end", generation=generation, reconcile=reconcile, phase=phase,
                      trigger=trigger, result=result, steps_started=cycle.started,
                      in_flight=in_flight, seconds=round(seconds, 3),
                      drift=sum(1 for d in current.drift if d.actionable or d.blocking) if current else None,
                      blocked=[f"{b.node}: {b.reason}" for b in current.blocked] if current and current.blocked
                      else None, error=cycle.error)

    def troubles(self, observed: Observed) -> None:
        """A node's trouble once, when it starts or changes: unreachable, its output unreadable, docker not
        answering at warning; a host key refused or an authentication failure at error (not transient: someone must
        look); its end at info. One line per change, not one every reconcile."""
        for name, obs in observed.nodes.items():
            found = trouble(obs)
            if found == self._troubles.get(name):
                continue
            if found is None:
                self.log.info("node.recovered", node=name, was=self._troubles.pop(name)[1])
                continue
            kind, why = found
            fatal = why.startswith(("HostKeyRejected", "authentication failed"))
            (self.log.error if fatal else self.log.warning)(f"node.{kind}", node=name, error=why)
            self._troubles[name] = found


def trouble(obs: NodeObservation) -> tuple[str, str] | None:
    """What is wrong with a node as one observation saw it (the event name's end, and why), or None."""
    if not obs.reachable:
        return "unreachable", obs.error or "unreachable"
    if obs.probe_error:
        return "probe_failed", obs.probe_error
    if not obs.docker_reachable:
        return "docker_unreachable", obs.docker_error or "docker does not answer"
    return None
