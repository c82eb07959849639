"""The actuators: one module per family (containers, link, staging, images, weights, serving).

Each step is a plain function `run(ctx, step)`: it re-checks its precondition on the node (the world may have
moved since the observation), acts through `ssh` only, and verifies its own effect by re-reading what it
touched; it raises StepFailed (or a transient RemoteError, which the executor retries) when it could not. Steps
know nothing of the loop: the executor in `reconciler.edge.execute` orders, times and retries them.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from reconciler.core.observed import Observed
from reconciler.core.ownership import Owner, owner
from reconciler.core.planning import Step
from reconciler.core.spec import Desired
from reconciler.edge.ssh import Sessions


class StepFailed(Exception):
    """A step ran and did not reach its goal; the message is what an operator needs to act."""

    transient = False


class StepBlocked(StepFailed):
    """A precondition does not hold (memory short, a foreign container holds the name): nothing was changed."""


class StepDeferred(StepBlocked):
    """A precondition the world is about to meet by itself has not been met yet within the step's wait (GB10
    returns a stopped generation's memory with a lag): nothing was changed, the next reconcile tries again, and it
    is no failure, so it never counts toward backoff and holds."""


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
    def owner(self) -> Owner:
        """This cluster as the plan judged it: the owner of the observation the plan was made from (the head's
        cluster id, read by that probe), so a step and the plan agree on whose a container or a copy is."""
        return owner(self.desired, self.observed)

    @property
    def command_timeout(self) -> float:
        return self.remaining(self.desired.policy.timeouts.command)


def wait_for(check: Callable[[], Any], *, timeout: float, interval: float = 0.2, what: str,
             cancel: threading.Event | None = None) -> Any:
    """Poll `check` until it returns something truthy or the deadline passes (then StepFailed naming `what`)."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise StepFailed(f"timed out after {timeout:g}s waiting for {what}")
        if cancel is not None and cancel.wait(interval):
            raise StepFailed(f"cancelled while waiting for {what}")
        if cancel is None:
            time.sleep(interval)


def note_copy(ctx: StepContext, node: str, *entries: tuple[str, str, str, str]) -> None:
    """Write copies (or a serving start's uses) to the node's copy ledger in one exec, which retention reads.
    Entries are (action, kind, key, detail). Lines that cannot be written are reported, never a failure of the
    copy they record: unrecorded, a copy is only kept longer (retention never removes what the ledger does not
    name)."""
    from reconciler.edge import ledger

    if (why := ledger.record(ctx.sessions[node], node, ctx.owner.label, list(entries),
                             timeout=ctx.command_timeout)) is not None:
        ctx.progress("ledger.unwritten", {"node": node, "entries": [e[:3] for e in entries], "error": why})


def runner(kind: str) -> Callable[[StepContext, Step], None]:
    """The function that performs a step kind (imported lazily: each family is its own module)."""
    from reconciler.edge.steps import containers, images, link, retention, serving, staging, weights

    table: dict[str, Callable[[StepContext, Step], None]] = {
        "stop-container": containers.stop_container,
        "stop-serving": containers.stop_serving,
        "link": link.converge_link,
        "prune-weights": retention.prune_weights,
        "prune-images": retention.prune_images,
        "download": staging.download,
        "pull-image": staging.pull_image,
        "image": images.copy_image,
        "weights": weights.sync_weights,
        "start-serving": serving.start_serving,
        "launch-model": serving.launch_model,
        "await-health": serving.await_health,
    }
    return table[kind]
