"""The reconciler: `reconcile(reasons) -> Result`. Observe, plan, admit (start what may start beside the loop),
publish; nothing else.

It never waits for a step: admitted steps run as operations (`reconciler.loop.operations`), and their end is a trigger.
So every reconcile is as short as one observation, and status and metrics are fresh every cycle, progress
included. What it keeps between reconciles is its collaborators', each a small piece with one job:

- `enforcement.Enforcement`: the desired state in force (the file's generation, the last valid one while the file is
  invalid, or the one a rollback brought back), its numbers (`generations`) and history (`history`), the backoff;
- `step_results.StepResults` (the holds and the history from finished steps), `health_watch` (the head's serving),
  `serve_flags.ImageFlags` (the image's answer about itself), `verify_schedule.VerifySchedule` (the verify asked of
  the daemon), `publishing.Publishing` (the status, the metrics, the reconcile's log line);
- nothing of the lifecycle: the SSH sessions, the lease, the event streams and the metrics' view of the operations
  are the manager's (`reconciler.loop.manager`), which it is given. A new generation cancels only the operations it
  makes wrong (`enforcement.end_generation`), then the manager adopts it.

The decisions it acts on live beside it: a failed change's rollback (`rollback.decide`), when to look again
(`requeue.requeue_after`), the answers to a verify request (`verify_answers`), the steps' reports (`reports`).
A reconcile that raises still publishes: the status then says Degraded with the error, never the last Converged.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from reconciler.core import planning, spec
from reconciler.core.kinds import START_KINDS
from reconciler.core.observed import Observed
from reconciler.core.planning import Blocker, Plan, Step
from reconciler.edge import log
from reconciler.edge.execute import StepResult
from reconciler.edge.observe import observe
from reconciler.edge.ssh import Sessions
from reconciler.edge.steps import StepContext
from reconciler.edge.trusted_files import Secrets
from reconciler.edge.verify import verify_node
from reconciler.loop import metrics
from reconciler.loop.backoff import Backoff, vetoes
from reconciler.loop.enforcement import Enforcement, end_generation
from reconciler.loop.generations import GenerationStore
from reconciler.loop.health_watch import HealthWatches
from reconciler.loop.history import HistoryStore, Hold
from reconciler.loop.manager import Manager
from reconciler.loop.operations import Operations, admit, verify_conflict
from reconciler.loop.publishing import Cycle, Publishing
from reconciler.loop.reasons import Reason, said
from reconciler.loop.reports import StepReports
from reconciler.loop.requeue import Due, requeue_after
from reconciler.loop.runnables import Runnable
from reconciler.loop.serve_flags import ImageFlags
from reconciler.loop.status import StatusPublisher
from reconciler.loop.step_results import StepResults, step_ended
from reconciler.loop.triggers import ReconcileRequests
from reconciler.loop.verify import Verifier
from reconciler.loop.verify_schedule import VerifyFn, VerifySchedule

ObserveFn = Callable[..., tuple[Observed, dict[str, float]]]


@dataclass(frozen=True)
class Result:
    """What one reconcile tells the loop: when to look again at the latest (None: at the next resync), and why
    (`requeue_reason`: what the reconcile it triggers says triggered it)."""

    requeue_after: float | None = None
    phase: str = ""
    requeue_reason: str = ""


class Controller:
    """`manager`: the daemon's (its sessions, lease, streams), never made here; `operations`: the steps in flight
    (by default its own, whose end requests a reconcile); two clocks, never mixed (below)."""

    def __init__(self, path: Path, state_dir: Path, requests: ReconcileRequests, cancel: threading.Event, *,
                 manager: Manager, observe_fn: ObserveFn = observe, operations: Operations | None = None,
                 clock: Callable[[], float] | None = None, monotonic: Callable[[], float] | None = None,
                 verify_fn: VerifyFn = verify_node, secrets: Callable[[], Secrets] | None = None) -> None:
        self.path = Path(path)
        #: Where serving.secrets' values come from, asked at every load (`run --env-file`: the file over this
        #: process's environment, so a rotated key is an edit and a reload); by default the environment alone.
        self.secrets = secrets or (lambda: Secrets(os.environ, spec.ENVIRONMENT))
        self.manager = manager
        # Two clocks, never mixed: unix time only for timestamps people and Grafana read (lastConverged, /status),
        # the monotonic clock for every duration the daemon measures (backoff, health graces, operations), which a
        # step of the wall clock must not move (issue 31, finding 10). Tests pass fakes of both.
        self.clock = clock or time.time
        self.monotonic = monotonic or time.monotonic
        self.requests = requests
        self.cancel = cancel
        self.log = log.get().bind(file=str(self.path))
        self.store = GenerationStore(Path(state_dir), self.path)
        self.history = HistoryStore(Path(state_dir), self.path)
        if self.store.last_converged > 0:
            metrics.last_converged.set(self.store.last_converged)
        self.publisher = StatusPublisher(self.path)
        self.operations = operations or Operations(on_end=lambda: requests.request(Reason("operation")),
                                                   clock=self.monotonic)
        self.manager.follow(self.operations.view)
        self.health = HealthWatches(wall=self.clock)
        self.enforcement = Enforcement(
            self.path, self.store, self.history, lambda: self.secrets(), clock=self.clock, logger=self.log,
            ending=lambda old, new: end_generation(old, new, self.operations, self.verifier, self.log),
            adopt=self.manager.adopt)
        self.image = ImageFlags(lambda: requests.request(Reason("flags")), lambda: self.desired, lambda: self.sessions)
        # `reconciler verify` asks through the listener (verify_request); the verify runs beside the loop
        self.verifier = Verifier(on_end=lambda node: requests.request(Reason("verify-ended", node)),
                                 clock=self.clock, monotonic=self.monotonic)
        self.verify = VerifySchedule(self.verifier, verify_fn, requests, self.path, self.log)
        self.publishing = Publishing(self.publisher, self.clock, self.log)
        self._wanted: list[Step] = []  # the steps this reconcile would start, a verify aside: none starts beside
        self._observe_fn = observe_fn
        self.reconciles = 0
        self.reports = StepReports(self.operations, self.publisher, self.clock, self.log)
        self.results = StepResults(self.history, self.reports, self.monotonic)

    def runnables(self) -> list[Runnable]:
        """What the controller runs beside the loop, for the daemon's list: the image's flag queries (a daemon
        thread per question, nothing to stop) and the operations with the verify, cancelled and awaited at the
        stop."""
        return [Runnable("image-flags"), Runnable("operations", stop=self._stop_operations)]

    def _stop_operations(self, seconds: float, _ended: bool) -> bool:
        """Cancel the steps in flight and the verify, and wait up to `seconds` for them (a repair's removals too);
        True when they all ended."""
        self.operations.cancel_all()
        self.verifier.cancel_all("the daemon is stopping")
        end = time.monotonic() + seconds
        ended = self.operations.join(seconds)
        ended = self.verifier.join(max(0.0, end - time.monotonic())) and ended
        if not ended:
            self.log.warning("daemon.operations_still_running", seconds=round(seconds, 1))
        return ended

    @property
    def sessions(self) -> Sessions | None:
        """The manager's: the controller runs commands on them, never opens, rebuilds or closes them."""
        return self.manager.sessions

    @property
    def status(self) -> dict[str, object]:
        """/status: the last reconcile's status, with the operations (a verify among them) as they are right now,
        and the verify requests with their results (what `reconciler verify` waits for)."""
        doc: dict[str, object] = log.redact({
            **self.publisher.status, "operations": self.operations.view() + self.verifier.view(),
            "image": self.image.status(), "verifyRequests": self.verifier.requests(),
            "lastConverged": self.store.last_converged})
        return doc

    # -- what is in force (`enforcement`) ---------------------------------------------------------------------

    @property
    def desired(self) -> spec.Desired | None:
        """The desired state enforced (or observed only); None until a valid file was read."""
        return self.enforcement.desired

    @property
    def held(self) -> Hold | None:
        """A failed change rolled back: the file's generation is not enforced."""
        return self.enforcement.held

    @property
    def backoff(self) -> Backoff | None:
        """Backoff and holds per step, new with each generation in force."""
        return self.enforcement.backoff

    @property
    def file_error(self) -> str | None:
        """Why the file is not valid now (the last valid generation is still enforced), or None."""
        return self.enforcement.file_error

    def reload(self) -> bool:
        """Re-read the file; True when a new valid generation was taken (`Enforcement.reload`)."""
        return self.enforcement.reload()

    def verify_request(self, doc: dict[str, object]) -> tuple[int, dict[str, object]]:
        """`POST /verify`, on one of the listener's threads (`VerifySchedule.request`)."""
        return self.verify.request(doc, self.desired)

    # -- one reconcile ----------------------------------------------------------------------------------------

    def reconcile(self, reasons: set[Reason]) -> Result:
        """One reconcile; `reasons`: what triggered it (the triggers coalesced into it, `reasons.Reason`), said in
        its log line: start, file, sighup, docker:NODE, link:NODE, events-lost:NODE, resync, operation, flags,
        verify-request, verify-ended:NODE, requeue:WHY (backoff-ended:STEP, health-recheck, lease-renewal,
        event-settle)."""
        began = time.monotonic()
        self.reconciles += 1
        trigger = said(reasons)
        failures = self._record(self.operations.drain())
        self.enforcement.reread(reasons, trigger)
        self.enforcement.failed_start(self.results.failed_start())
        cycle = Cycle(self.desired)
        try:
            if cycle.desired is not None and not self._act(cycle.desired, cycle, trigger):
                return Result()  # shutting down: what a cancelled probe saw is not news worth publishing
        except Exception as exc:  # a bug must not freeze the status at its last value
            cycle.error = f"reconcile crashed: {type(exc).__name__}: {exc}"
            self.log.exception("reconcile.crashed", error=str(exc), trigger=trigger)
        phase = self.publishing.publish(cycle, failures, self.enforcement, self.operations.busy())
        self.publishing.said(cycle, failures, trigger, phase, generation=self.store.generation,
                             reconcile=self.reconciles, in_flight=len(self.operations.busy()),
                             seconds=time.monotonic() - began)
        requeue = self._requeue_after(cycle.observed, settle=any(r.kind == "docker" for r in reasons))
        return Result(None, phase) if requeue is None else Result(requeue[0], phase, requeue[1])

    def _act(self, desired: spec.Desired, cycle: Cycle, trigger: list[str]) -> bool:
        """Observe, plan, admit; what it found kept in `cycle` as it goes. False when the daemon is stopping."""
        cycle.observed = observed = self._observe(desired)
        if self.cancel.is_set():
            return False
        self.publishing.troubles(observed)
        desired, observed, current = self._plan(cycle, desired, observed)
        cycle.current, cycle.started = self._start(desired, observed, current, trigger)
        self.verify.next(desired, cycle.current, self.operations, self._wanted, self.sessions, self.manager.lease)
        self._converged(desired, observed, cycle.current)
        return True

    def _plan(self, cycle: Cycle, desired: spec.Desired, observed: Observed) -> tuple[spec.Desired, Observed, Plan]:
        """The plan in force. A start the image refuses is a failed change: when that rolls it back, what was
        brought back is observed and planned instead."""
        cycle.current = current = self.enforcement.restored(desired, observed, planning.plan(desired, observed))
        if current.refused and self.held is None and current.mode == "enforce":
            self.enforcement.failed_change("the image refuses the start: " + "; ".join(current.refused), None)
            if self.desired is not desired and self.desired is not None:  # rolled back: plan what was brought back
                desired = cycle.desired = self.desired
                observed = cycle.observed = self._observe(desired)
                current = cycle.current = planning.plan(desired, observed)
        return desired, observed, current

    def _converged(self, desired: spec.Desired, observed: Observed, current: Plan) -> None:
        """Nothing to change, the file's generation enforced and no start whose answer is still to be checked:
        converged (and, enforcing, what a rollback may bring back: a generation that served)."""
        if (not current.changes and self.enforcement.read_only is None and self.held is None
                and not any(s.kind in START_KINDS for s in self.operations.busy())  # its verify may fail
                and not self.publisher.answers_wrong(desired, observed)):  # serving.verify: not served
            self.store.converged(self.clock())  # observing only, or rolled back: not the file's to reach
            if current.mode == "enforce":
                self.history.served(self.store.generation, self.clock())
            metrics.last_converged.set(self.store.last_converged)

    def _requeue_after(self, observed: Observed | None, settle: bool = False) -> tuple[float, str] | None:
        """When to look again without a trigger (`requeue.requeue_after`) as this controller stands."""
        lease = self.manager.lease
        return requeue_after(Due(now=self.monotonic(), settle=settle, holding_lease=lease is not None and lease.holding,
                                 backoff=self.backoff, desired=self.desired, observed=observed))

    def _observe(self, desired: spec.Desired) -> Observed:
        assert self.sessions is not None, "a valid desired state opens the sessions"
        observed, durations = self._observe_fn(desired, self.sessions, timeout=desired.policy.timeouts.command,
                                               cancel=self.cancel, ask_flags=False)
        observed = self.health.annotate(desired, observed, self.monotonic())
        observed = self.image.annotate(desired, observed)  # every image id seen, asked beside the loop
        StatusPublisher.observation(desired, observed, durations)
        return observed

    def _start(self, desired: spec.Desired, observed: Observed, current: Plan, trigger: list[str]
               ) -> tuple[Plan, int]:
        """Launch the plan's steps that may start now (not held, not conflicting with one in flight). Returns the
        plan as published (a new one when the lease is held elsewhere: that blocker added) and how many started."""
        self._wanted = []
        lease = self.manager.lease
        if current.mode != "enforce":  # observing or paused: the cluster is free for `apply`
            if lease is not None and lease.holding and not self.operations.busy() and self.verifier.verifying() is None:
                lease.release()
            return current, 0
        assert self.sessions is not None and self.backoff is not None and lease is not None
        if (taken := lease.renew_if_due()) is not None:  # held while enforcing, renewed at most every minute
            blocked = [*current.blocked, Blocker(desired.head.name, f"nothing starts: {taken}")]
            return dataclasses.replace(current, blocked=blocked), 0
        runnable, waiting = self._admit(desired, current)
        if not runnable:
            return current, 0
        self.log.info("reconcile.plan", generation=self.store.generation, trigger=trigger,
                      steps=[s.id for s in runnable], waiting=waiting or None, drift=len(current.drift))
        ctx = StepContext(desired=desired, sessions=self.sessions, observed=observed,
                          generation=self.enforcement.enforced_generation,
                          progress=self.results.progress_of(self.store.generation if self.held is None else None),
                          cancel=self.cancel)
        if self.held is None:
            self.results.launching(runnable, self.store.generation)
        self.operations.launch(runnable, ctx, on_event=step_ended)
        return current, len(runnable)

    def _admit(self, desired: spec.Desired, current: Plan) -> tuple[list[Step], dict[str, str]]:
        """The plan's steps that may start now, and why the others wait. A step that needs the trees a verify is
        hashing makes that verify yield (it is low priority: reconciler.loop.verify) and waits until it has ended,
        which is a trigger."""
        assert self.backoff is not None
        busy, vetoed = self.operations.busy(), vetoes(current, self.backoff, self.monotonic())
        runnable, waiting = admit(current.steps, busy, vetoed)
        self._wanted = runnable
        node = self.verifier.verifying()
        yielding = {s.id: f"the verify of {node} stops first" for s in runnable
                    if node is not None and verify_conflict(s, node, desired.source_node)}
        if not yielding:
            return runnable, waiting
        if self.verifier.yield_(", ".join(sorted(yielding))):
            self.log.info("verify.yield", node=node, to=sorted(yielding))
        return admit(current.steps, busy, {**vetoed, **yielding})

    def _record(self, results: list[StepResult]) -> list[str]:
        """Finished steps into the holds and the history (`StepResults.record`); the failures, one line each."""
        return self.results.record(results, self.backoff, self.desired)
