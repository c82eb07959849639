"""Run a plan: steps in dependency order, independent ones in parallel, each under its deadline, transient
errors retried with exponential backoff and jitter (tenacity), everything else reported as the step's failure.

A failed step fails the steps that come after it and nothing else: a stuck weight sync to one node does not keep
a co-tenant on another node running. The executor keeps no state between runs; the controller decides what a
failure means over time (holds, backoff across reconciles).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any

from tenacity import Retrying, retry_if_exception, stop_after_attempt, wait_exponential_jitter

from reconciler.core.kinds import KINDS
from reconciler.core.planning import Plan, Step
from reconciler.edge import log
from reconciler.edge.ssh import RemoteError
from reconciler.edge.steps import StepBlocked, StepContext, StepDeferred, StepFailed, runner


@dataclass(frozen=True)
class StepResult:
    step: Step
    result: str  # "success", "failed", "blocked", "deferred" (StepDeferred: not counted), "skipped", "cancelled"
    seconds: float
    message: str = ""
    attempts: int = 0


@dataclass
class Outcome:
    results: list[StepResult] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(r.result == "success" for r in self.results)


def step_timeout(ctx: StepContext, step: Step) -> float:
    """Long steps (weight sync, image copy, a cold start) have their own deadlines, not the short step timeout: a
    copy or a fetch the `policy.timeouts` field its kind names (`StepKindInfo.long_timeout`)."""
    t = ctx.desired.policy.timeouts
    if (long := KINDS[step.kind].long_timeout) is not None:
        return float(getattr(t, long))
    if step.kind == "await-health":
        return ctx.given_for(step).desired.serving.health_timeout
    return t.step


def _transient(exc: BaseException) -> bool:
    """A node's passing trouble (a dropped connection, a refused channel, a timeout): worth another attempt."""
    return isinstance(exc, RemoteError | StepFailed) and exc.transient


def _interruptible(ctx: StepContext) -> Callable[[float], None]:
    """Backoff between attempts that a shutdown ends at once (tenacity's default sleep would hold it)."""
    def sleep(seconds: float) -> None:
        ctx.cancel.wait(seconds)
    return sleep


def run_step(ctx: StepContext, step: Step, on_event: Callable[[str, dict[str, Any]], None],
             cancel: threading.Event | None = None) -> StepResult:
    """One step under its own deadline, transient errors retried. `cancel`: this step's own (a new generation
    that makes it wrong ends it and nothing else); by default the batch's (`ctx.cancel`)."""
    logger = log.get().bind(step=step.id, node=step.node, kind=step.kind, generation=ctx.generation)
    retries = ctx.desired.policy.retries
    start = time.monotonic()
    attempts = 0
    ctx = dataclasses.replace(ctx, cancel=cancel if cancel is not None else ctx.cancel)
    step_ctx = dataclasses.replace(ctx, deadline=start + step_timeout(ctx, step))
    on_event("step.start", {"step": step})
    logger.info("step.start", reason=step.reason, params=step.params)  # what it acts on, and how (a stop's grace)
    try:
        for attempt in Retrying(retry=retry_if_exception(_transient), stop=stop_after_attempt(retries.attempts),
                                wait=wait_exponential_jitter(initial=retries.backoff_initial,
                                                             max=min(retries.backoff_max, 30)),
                                reraise=True, sleep=_interruptible(ctx)):
            with attempt:
                attempts += 1
                if ctx.cancel.is_set():
                    raise InterruptedError("shutting down")
                runner(step.kind)(step_ctx, step)
        outcome = StepResult(step, "success", time.monotonic() - start, attempts=attempts)
    except InterruptedError as exc:
        outcome = StepResult(step, "cancelled", time.monotonic() - start, str(exc), attempts)
    except StepBlocked as exc:
        result = "deferred" if isinstance(exc, StepDeferred) else "blocked"
        outcome = StepResult(step, result, time.monotonic() - start, str(exc), attempts)
    except (RemoteError, Exception) as exc:  # noqa: BLE001 - every failure becomes the step's result
        message = str(exc) if isinstance(exc, RemoteError) or str(exc) else repr(exc)
        outcome = StepResult(step, "cancelled" if ctx.cancel.is_set() else "failed", time.monotonic() - start,
                             message, attempts)
    level = logger.info if outcome.result == "success" else logger.warning
    level("step.end", result=outcome.result, seconds=round(outcome.seconds, 3), attempts=attempts,
          message=outcome.message or None)
    on_event("step.end", {"result": outcome})
    return outcome


def execute(plan: Plan, ctx: StepContext, on_event: Callable[[str, dict[str, Any]], None] = lambda e, f: None,
            max_parallel: int = 4, skip: Callable[[Step], str | None] = lambda s: None,
            cancel_of: Callable[[Step], threading.Event] | None = None) -> Outcome:
    """Run the plan's steps; `skip(step)` may veto a step (a hold) with a reason, failing its dependants;
    `cancel_of(step)` is the step's own cancel event (default: the batch's, `ctx.cancel`, which also stops the
    batch from starting anything more)."""
    outcome = Outcome()
    finished: dict[str, StepResult] = {}
    pending = list(plan.steps)
    running: dict[Future[StepResult], Step] = {}

    def end(result: StepResult) -> None:
        finished[result.step.id] = result
        outcome.results.append(result)

    with ThreadPoolExecutor(max_workers=max_parallel) as pool:
        while pending or running:
            for step in list(pending):  # in plan order: a skip here makes the steps after it ready in this pass
                if any(dep not in finished for dep in step.after):
                    continue
                pending.remove(step)
                if (why := _why_skipped(step, finished, skip, ctx)) is not None:
                    end(result := StepResult(step, "skipped", 0.0, why))
                    on_event("step.end", {"result": result})
                    continue
                running[pool.submit(run_step, ctx, step, on_event, cancel_of(step) if cancel_of else None)] = step
            if not running:
                for step in pending:  # unreachable dependencies: cannot happen for a valid plan, never hang
                    end(StepResult(step, "skipped", 0.0, "dependency not in the plan"))
                pending = []
                continue
            done, _ = wait(list(running), return_when=FIRST_COMPLETED)
            for future in done:
                running.pop(future)
                end(future.result())
    return outcome


def _why_skipped(step: Step, finished: dict[str, StepResult], skip: Callable[[Step], str | None],
                 ctx: StepContext) -> str | None:
    """Why a ready step does not run: a step it comes after did not succeed, `skip` vetoes it (asked of every ready
    step: a veto is the executor's last word before it starts), or the batch is shutting down."""
    failed = [d for d in step.after if finished[d].result != "success"]
    reason = skip(step)
    if not (failed or reason or ctx.cancel.is_set()):
        return None
    return reason or ("shutting down" if ctx.cancel.is_set() else f"after {', '.join(failed)}")
