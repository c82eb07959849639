"""What the steps report while they run (from their threads), routed: bytes and a cold start's stage into the
operation in flight (which /status and the progress metrics read), the weight sync counter, a serving's memory,
answer check and NCCL transport into the status publisher, then one log line at the report's level.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from reconciler.loop import metrics
from reconciler.loop.operations import Operations
from reconciler.loop.status import StatusPublisher

#: Step reports that say something went wrong: logged at warning, not info.
TROUBLE_EVENTS = frozenset({"ledger.unwritten", "serving.sync-skipped", "serving.drop-caches-refused",
                            "weights.refused", "weights.drop-behind-ended", "retention.kept"})


def progress_level(event: str) -> str:
    """The log level of a step's report: a progress tick is debug, trouble is warning, the rest info."""
    if event.endswith(".progress"):
        return "debug"
    return "warning" if event in TROUBLE_EVENTS else "info"


class StepReports:
    """The steps' report function (`StepContext.progress`), shared by every batch."""

    def __init__(self, operations: Operations, publisher: StatusPublisher, clock: Callable[[], float],
                 logger: Any) -> None:
        self.operations = operations
        self.publisher = publisher
        self.clock = clock
        self.log = logger
        self.synced = metrics.WeightsSynced()

    def __call__(self, event: str, fields: dict[str, Any]) -> None:
        self._route(event, fields)
        levels = {"debug": self.log.debug, "info": self.log.info, "warning": self.log.warning}
        levels[progress_level(event)](event, **{k: v for k, v in fields.items() if k != "step"})

    def _route(self, event: str, fields: dict[str, Any]) -> None:
        node = fields.get("node", "")
        match event:
            case "weights.progress":
                self.synced.reported(node, fields["bytes_done"])
                self.operations.progress("weights", node, fields["bytes_done"], fields.get("bytes_total"))
            case "weights.start":
                self.synced.started(node)
                self.operations.progress("weights", node, 0, fields.get("bytes_total"))
            case "image.start" | "image.progress":
                self.operations.progress("image", node, fields["bytes_done"], fields.get("bytes_total"))
            case "download.start" | "download.progress":
                self.operations.progress("download", node, fields.get("bytes_done", 0), fields["bytes_total"])
            case "serving.stage" | "serving.progress":
                self.operations.stage("await-health", node, fields["stage"], fields["percent"], fields["line"])
            case "serving.memory":  # a rank's node once it served: its overshoot, into /status and metrics
                self.publisher.memory(fields, self.clock())
            case "serving.verify":  # a start's check of its answer: ServingVerified, reconciler_serving_verified
                self.publisher.verified(fields)
            case "serving.transport":  # the network a rank's NCCL chose: NcclTransport, the fallback gauge
                self.publisher.transport(fields)
