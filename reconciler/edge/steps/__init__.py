"""The actuators: one module per family (containers, link, staging, images, weights, serving).

Each step is data (`actions`): a generator from `Given` (the desired state, the observation its plan was made
from) and the `Step` to the exact commands it runs and the facts it re-reads first (the world may have moved since
the observation), which verifies its own effect by re-reading what it touched and raises StepFailed (or lets a
transient RemoteError through, which the executor retries) when it could not. `StepContext.perform` is the one
place its actions meet the nodes. Steps know nothing of the loop: the executor in `reconciler.edge.execute`
orders, times and retries them.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from reconciler.core.kinds import StepKind
from reconciler.core.observed import Observed
from reconciler.core.planning import Step
from reconciler.core.spec import Desired
from reconciler.edge.ssh import Sessions
from reconciler.edge.steps.actions import Actions, Given, Performer, Report, StepBlocked, StepDeferred, StepFailed

__all__ = ["StepBlocked", "StepContext", "StepDeferred", "StepFailed", "plan_of", "runner"]


ProgressFn = Callable[[str, dict[str, Any]], None]


@dataclass
class StepContext:
    desired: Desired
    sessions: Sessions
    observed: Observed
    generation: int = 0
    progress: ProgressFn = lambda event, fields: None
    cancel: threading.Event = field(default_factory=threading.Event)
    deadline: float = float("inf")

    def remaining(self, cap: float | None = None) -> float:
        """Seconds left for this step (never below one), optionally capped by a per-command timeout."""
        left = max(1.0, self.deadline - time.monotonic())
        return min(left, cap) if cap is not None else left

    @property
    def given(self) -> Given:
        """What the step's actions are computed from: no session, no clock."""
        return Given(self.desired, self.observed, self.generation)

    def given_for(self, step: Step) -> Given:
        """What `step` is computed from: a deployment's step of a file of several sees that deployment's views
        of the file and of the observation (`Desired.view`, `Observed.view`), as the plan that made it did."""
        if step.deployment is None:
            return self.given
        return Given(self.desired.view(step.deployment), self.observed.view(step.deployment), self.generation)

    def perform(self, actions: Actions) -> None:
        """Run a step's actions on the nodes (`actions.Performer`), under this step's deadline and cancel."""
        Performer(lambda node: self.sessions[node], self.desired.policy.timeouts.command, self.remaining,
                  self.cancel, self.progress).perform(actions)


def note(given: Given, node: str, *entries: tuple[str, str, str, str]) -> Actions:
    """Write copies (or a serving start's uses) to the node's copy ledger in one exec (`retention.write_ledger`,
    the one writer), which retention reads. Entries are (action, kind, key, detail). Lines that cannot be written
    are reported, never a failure of the copy they record: unrecorded, a copy is only kept longer (retention never
    removes what the ledger does not name)."""
    from reconciler.edge.steps.retention import write_ledger

    if (why := (yield from write_ledger(given, node, *entries))) is not None:
        yield Report("ledger.unwritten", {"node": node, "entries": [e[:3] for e in entries], "error": why})


def plan_of(kind: StepKind) -> Callable[[Given, Step], Actions]:
    """The step kind's body as data: (what it knows, the step) -> its actions (imported lazily: each family is
    its own module). One per kind: tests/unit/core/test_step_kinds.py."""
    from reconciler.edge.steps import containers, images, link, retention, serving, staging, weights

    plans: dict[StepKind, Callable[[Given, Step], Actions]] = {
        "stop-container": containers.stop_container,
        "start-container": containers.start_container,
        "stop-serving": containers.stop_serving,
        "link": link.converge_link,
        "prune-weights": retention.prune_weights,
        "prune-images": retention.prune_images,
        "start-serving": serving.start_serving,
        "launch-model": serving.launch_model,
        "await-health": serving.await_health,
        "download": staging.download,
        "pull-image": staging.pull_image,
        "image": images.copy_image,
        "weights": weights.sync_weights,
    }
    return plans[kind]


def runner(kind: StepKind) -> Callable[[StepContext, Step], None]:
    """The function that performs a step kind: its actions (`plan_of`) through `StepContext.perform`."""
    body = plan_of(kind)
    return lambda ctx, step: ctx.perform(body(ctx.given_for(step), step))
