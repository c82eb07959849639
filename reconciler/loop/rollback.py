"""What a failed change leads to: a pure decision over the history and the failure (no I/O, no clock).

A generation of the file that fails before it ever served (a start of one of its deployments failed, or the image
refused it) is a failed change. With `policy.on_failed_change: rollback` the last generation that served is
brought back, when the failing deployment is one the change touched (a failure of what the change left as it was is
not the change's: it is retried as before); a first generation that stopped co-tenants is held and what ran before
it comes back (generation 0, core/restore); otherwise the failure is recorded and said. The controller carries the
decision out (`Enforcement.failed_change`); tests/unit/loop/test_rollback.py judges it from data.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from reconciler.core import spec
from reconciler.loop.history import History

Action = Literal["none", "roll-back", "as-found", "failed"]


@dataclass(frozen=True)
class Decision:
    """`roll-back`: enforce `brought` (generation `to`) in the place of the failed one; `as-found`: hold it and
    restore what ran before it; `failed`: record it, `why_not` says why nothing is brought back; `none`: not a failed
    change (it served, or the failure is not the change's)."""

    action: Action
    to: int = 0
    brought: spec.Desired | None = None
    why_not: str = ""


NOTHING = Decision("none")


def touches(new: spec.Desired, old: spec.Desired, deployment: str) -> bool:
    """Whether the change from `old` to `new` touched what `deployment` starts: it is new, or its model, serving,
    the nodes or the trust differ."""
    if deployment not in old.deployment_names:
        return True
    a, b = new.view(deployment), old.view(deployment)
    return (a.deployment, a.nodes, a.trust) != (b.deployment, b.nodes, b.trust)


def decide(history: History, generation: int, desired: spec.Desired, deployment: str | None,
           bring_back: Callable[[int], spec.Desired | None]) -> Decision:
    """The decision for `generation` (the file's, in force as `desired`) whose `deployment` failed (None: the
    whole, e.g. the image refused it). `bring_back(to)`: generation `to` as the file would be today, or None when it
    cannot be taken; asked only when the policy rolls back and there is a generation that served."""
    entry = history.entry(generation)
    if entry is None or entry.served:
        return NOTHING  # it served: a later failure is a wedge or a crash, repaired in place, not a failed change
    policy = desired.policy.on_failed_change
    back = history.last_served(generation)
    brought = bring_back(back.generation) if back is not None and policy == "rollback" else None
    if brought is not None and deployment is not None and not touches(desired, brought, deployment):
        return NOTHING  # not the change's failure: what failed is as it was in the generation that served
    if back is None and policy == "rollback" and entry.stopped:
        return Decision("as-found")
    if brought is None or back is None:
        why_not = ("policy.on_failed_change is hold" if policy == "hold" else
                   "no earlier generation to bring back" if back is None else
                   f"generation {back.generation} cannot be taken")
        return Decision("failed", why_not=why_not)
    return Decision("roll-back", to=back.generation, brought=brought)


def first_line(text: str, limit: int = 300) -> str:
    """A failure as the history keeps it: its first line (a start's message carries the container's log tail)."""
    line = text.strip().splitlines()[0] if text.strip() else ""
    return line if len(line) <= limit else line[:limit - 1] + "…"
