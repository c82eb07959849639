"""What finished steps leave behind for the loop: their outcome in the holds (`backoff.Backoff`), the co-tenants
they stopped in the history (for the restore of what ran before a first generation), and a start of the file's
generation that ran and failed (a failed change's sign, `Enforcement.failed_start`).

The steps report from their own threads; only the loop's thread writes the holds and the history, so what they
stop is handed over here (`progress_of`) and written when the results are drained (`record`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, Literal, cast, get_args

from reconciler.core import spec
from reconciler.core.kinds import START_KINDS
from reconciler.core.planning import Step
from reconciler.core.restore import StoppedCoTenant
from reconciler.edge.execute import StepResult
from reconciler.loop import metrics
from reconciler.loop.backoff import Backoff
from reconciler.loop.history import HistoryStore

#: What a finished step's result says (edge/execute.py's StepResult.result); `record` reads it in one match.
StepOutcome = Literal["success", "failed", "blocked", "deferred", "skipped", "cancelled"]
OUTCOMES: frozenset[str] = frozenset(get_args(StepOutcome))


def outcome_of(result: StepResult) -> StepOutcome:
    """The result's outcome, typed; one the loop does not know is a bug of the executor, not a state to guess."""
    if result.result not in OUTCOMES:
        raise ValueError(f"{result.step.id}: unknown step outcome {result.result!r}")
    return cast(StepOutcome, result.result)


class StepResults:
    """`history`: where stopped co-tenants go; `reports`: every report, after (`reports.StepReports`)."""

    def __init__(self, history: HistoryStore, reports: Callable[[str, dict[str, Any]], None],
                 monotonic: Callable[[], float]) -> None:
        self.history = history
        self.reports = reports
        self.monotonic = monotonic
        self.launched: dict[str, int] = {}  # step id -> the file's generation it was started for
        #: A start failed (`record`): the file's generation it was started for, its deployment, why.
        self.start_failed: tuple[int, str | None, str] | None = None
        self._stopped: list[tuple[int, StoppedCoTenant]] = []  # from the step threads, for `record`
        self._stopped_lock = threading.Lock()

    def launching(self, steps: list[Step], generation: int) -> None:
        """`steps` start for the file's `generation` (a rollback's are not the file's: not told)."""
        self.launched.update({s.id: generation for s in steps})

    def failed_start(self) -> tuple[int, str | None, str] | None:
        """The start that failed since the last look, taken (None: none)."""
        failed, self.start_failed = self.start_failed, None
        return failed

    def record(self, results: list[StepResult], backoff: Backoff | None, desired: spec.Desired | None) -> list[str]:
        """Finished steps into the holds and the co-tenants they stopped into the history (only the loop writes
        them); returns the failures, one line each."""
        with self._stopped_lock:
            stopped, self._stopped = self._stopped, []
        for generation, tenant in stopped:
            self.history.stopped(generation, tenant)
        failures = []
        for r in results:
            if backoff is None:
                break
            match outcome_of(r):
                case "success":
                    backoff.succeeded(r.step.id)
                case "failed" | "blocked":
                    backoff.failed(r.step.id, r.message, self.monotonic())
                    failures.append(f"{r.step.id}: {r.message}")
                    if r.result == "failed":
                        self._start_ran_and_failed(r, desired)
                case "deferred":  # said, never counted: the next reconcile tries again
                    failures.append(f"{r.step.id}: {r.message}")
                case "skipped" | "cancelled":  # nothing to record: it never ran, or was stopped on purpose
                    pass
            self.launched.pop(r.step.id, None)
        return failures

    def _start_ran_and_failed(self, r: StepResult, desired: spec.Desired | None) -> None:
        """Only a start that ran and failed is a failed change's sign: one that is blocked (a container not ours in
        the way, memory short with nothing stopped) is the node's condition, not the change's."""
        if r.step.kind in START_KINDS and r.step.id in self.launched:
            whose = r.step.deployment or (desired.deployment_names[0] if desired else None)
            self.start_failed = (self.launched[r.step.id], whose, f"{r.step.id}: {r.message}")

    def progress_of(self, generation: int | None) -> Callable[[str, dict[str, Any]], None]:
        """The steps' report function for a batch launched for `generation` (None: a rollback's): a co-tenant they
        stop is remembered for that generation (for `Enforcement.restored`), handed to the loop's thread, which
        alone writes the history; every report then goes to `reports`."""
        def progress(event: str, fields: dict[str, Any]) -> None:
            if event == "co-tenant.stopped" and generation is not None:
                with self._stopped_lock:
                    self._stopped.append((generation, StoppedCoTenant(fields["node"], fields["container"],
                                                                      fields["id"])))
            self.reports(event, fields)
        return progress


def step_ended(event: str, fields: dict[str, Any]) -> None:
    """Each step's end into the metrics (the operations' event hook)."""
    if event == "step.end":
        r = fields["result"]
        metrics.step_ended(r.step.kind, r.result, r.seconds)
