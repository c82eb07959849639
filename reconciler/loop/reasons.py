"""Why a reconcile runs: a typed `Reason` (controller-runtime's reconcile.Request), never a string to parse.

Every trigger (the file, a node's event stream, an operation's end, a signal, the resync timer, the controller's
requeue, a verify request or its end) hands `ReconcileRequests` one of these. The controller reads `kind` and
`node`; its log line shows `str(reason)`, the same text the triggers were named by before they were typed
(`docker:NODE`, `requeue:backoff-ended:STEP`), so the journal reads as it did.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

#: What asked for a reconcile. `docker`, `link`, `events-lost` and `verify-ended` name a node; `requeue` says why
#: the controller asked to look again (`detail`: backoff-ended:STEP, health-recheck, lease-renewal, event-settle).
ReasonKind = Literal["start", "file", "sighup", "signal", "resync", "requeue", "operation", "flags",
                     "verify-request", "verify-ended", "docker", "link", "events-lost"]


@dataclass(frozen=True, order=True)
class Reason:
    kind: ReasonKind
    node: str = ""
    detail: str = ""

    def __str__(self) -> str:
        return ":".join(part for part in (self.kind, self.node, self.detail) if part)


def said(reasons: set[Reason]) -> list[str]:
    """The reasons as the log line `trigger` shows them: sorted text."""
    return sorted(str(r) for r in reasons)
