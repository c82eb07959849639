"""The reconciler: `reconcile(reasons) -> Result`. Observe, plan, admit (start what may start beside the loop),
publish; nothing else.

It never waits for a step: admitted steps run as operations (`reconciler.loop.operations`), and their end is a trigger.
So every reconcile is as short as one observation, and status and metrics are fresh every cycle, progress
included. What it keeps between reconciles, each in its own small piece:

- the desired state in force: an invalid file never stops the loop nor triggers steps; the last valid generation
  keeps being enforced and DesiredStateInvalid says what is wrong, with line and column;
- generations (`generations.GenerationStore`), holds and backoff per step (`backoff.Backoff`), the health history of the
  head's serving (`health_watch`), the operations in flight, the image's flag list (`operations.FlagsQuery`);
- nothing of the lifecycle: the SSH sessions, the lease, the event streams and the metrics' view of the operations
  are the manager's (`reconciler.loop.manager`), which it is given. A new generation cancels only the operations it
  makes wrong (`operations.stale`, `verify.verify_stale`), then the manager adopts it.

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
from typing import Any, Literal, cast, get_args

from reconciler.core import planning, spec
from reconciler.core.kinds import START_KINDS, STEP_KINDS
from reconciler.core.observed import NodeObservation, Observed, ServeFlags
from reconciler.core.planning import Blocker, Plan, Step
from reconciler.core.restore import AS_FOUND, StoppedCoTenant, restore_plan
from reconciler.edge import log, trusted_files
from reconciler.edge.execute import StepResult
from reconciler.edge.image_flags import ask_serve_flags
from reconciler.edge.observe import observe, with_flags
from reconciler.edge.ssh import Sessions
from reconciler.edge.steps import StepContext
from reconciler.edge.trusted_files import Secrets
from reconciler.edge.verify import NodeResult, verify_node
from reconciler.loop import conditions, metrics, rollback, verify_answers
from reconciler.loop.backoff import Backoff, vetoes
from reconciler.loop.generations import GenerationStore, observe_only
from reconciler.loop.health_watch import HealthWatches
from reconciler.loop.history import HistoryStore, Hold
from reconciler.loop.manager import Manager
from reconciler.loop.operations import FlagsQuery, Operations, admit, stale, verify_conflict, verify_waits
from reconciler.loop.reasons import Reason, said
from reconciler.loop.reports import StepReports
from reconciler.loop.requeue import Due, requeue_after
from reconciler.loop.runnables import Runnable
from reconciler.loop.status import StatusPublisher
from reconciler.loop.triggers import ReconcileRequests
from reconciler.loop.verify import Busy, Verifier, verify_stale

ObserveFn = Callable[..., tuple[Observed, dict[str, float]]]
VerifyFn = Callable[[spec.Desired, Sessions, str, bool, threading.Event], NodeResult]

#: What a finished step's result says (edge/execute.py's StepResult.result); `_record` reads it in one match.
StepOutcome = Literal["success", "failed", "blocked", "deferred", "skipped", "cancelled"]
OUTCOMES: frozenset[str] = frozenset(get_args(StepOutcome))


def outcome_of(result: StepResult) -> StepOutcome:
    """The result's outcome, typed; one the loop does not know is a bug of the executor, not a state to guess."""
    if result.result not in OUTCOMES:
        raise ValueError(f"{result.step.id}: unknown step outcome {result.result!r}")
    return cast(StepOutcome, result.result)


@dataclass(frozen=True)
class Result:
    """What one reconcile tells the loop: when to look again at the latest (None: at the next resync), and why
    (`requeue_reason`: what the reconcile it triggers says triggered it)."""

    requeue_after: float | None = None
    phase: str = ""
    requeue_reason: str = ""


@dataclass
class _Cycle:
    """What one reconcile found so far: published whatever happens next (a crash included)."""

    desired: spec.Desired | None
    observed: Observed | None = None
    current: Plan | None = None
    error: str | None = None
    started: int = 0


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
        self.read_only: str | None = None  # the fingerprint observed, not enforced, while no generation is recorded
        self.requests = requests
        self.cancel = cancel
        self.log = log.get().bind(file=str(self.path))
        self.store = GenerationStore(Path(state_dir), self.path)
        self.history = HistoryStore(Path(state_dir), self.path)
        self.held: Hold | None = None  # a failed change rolled back: the file's generation is not enforced
        self._launched: dict[str, int] = {}  # step id -> the file's generation it was started for
        if self.store.last_converged > 0:
            metrics.last_converged.set(self.store.last_converged)
        self.publisher = StatusPublisher(self.path)
        self.operations = operations or Operations(on_end=lambda: requests.request(Reason("operation")),
                                                   clock=self.monotonic)
        self.manager.follow(self.operations.view)
        self.health = HealthWatches(wall=self.clock)
        self._asking: dict[str, spec.Desired] = {}  # image id -> the deployment whose image it is (_ask_flags)
        self.flags = FlagsQuery(self._ask_flags, on_answer=lambda: requests.request(Reason("flags")))
        # `reconciler verify` asks through the listener (verify_request); the verify runs beside the loop
        self.verifier = Verifier(on_end=lambda node: requests.request(Reason("verify-ended", node)),
                                 clock=self.clock, monotonic=self.monotonic)
        self._verify_fn = verify_fn
        self._troubles: dict[str, tuple[str, str]] = {}  # node -> what was wrong at the last look (said once)
        self._wanted: list[Step] = []  # the steps this reconcile would start, a verify aside: none starts beside
        self._observe_fn = observe_fn
        self.desired: spec.Desired | None = None
        self.file_error: str | None = None
        self.backoff: Backoff | None = None
        self.reconciles = 0
        self.reports = StepReports(self.operations, self.publisher, self.clock, self.log)
        #: A start failed (_record): the file's generation it was started for, its deployment, why.
        self._start_failed: tuple[int, str | None, str] | None = None
        self._stopped: list[tuple[int, StoppedCoTenant]] = []  # from the step threads, for _record
        self._stopped_lock = threading.Lock()
        self._failures_said: set[tuple[int, str]] = set()  # (generation, what) said once: not every reconcile
        self.image_answer: ServeFlags | None = None  # what the serving image said of itself (FlagsQuery)

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
        flags = self.image_answer
        image = None if flags is None else {"id": flags.image_id, "vllm_version": flags.version,
                                            "pending": flags.pending, "error": flags.error}
        doc: dict[str, object] = log.redact({
            **self.publisher.status, "operations": self.operations.view() + self.verifier.view(), "image": image,
            "verifyRequests": self.verifier.requests(), "lastConverged": self.store.last_converged})
        return doc

    # -- the desired state ------------------------------------------------------------------------------------

    def _load(self) -> tuple[spec.Desired | None, list[str]]:
        """The file as `validate` judges it (trusted_files.load: the file, its secrets, the files it trusts); every
        secret value registered for redaction before anything can log it."""
        try:
            loaded, unsafe = trusted_files.load(self.path, self.secrets())
        except trusted_files.EnvironmentFileError as exc:
            return None, [str(exc)]
        for value in loaded.secret_values() if loaded is not None else []:
            log.register_secret(value)
        return loaded, unsafe

    def reload(self) -> bool:
        """Re-read the file; True when a new valid generation was taken. Invalid: keep the last good one."""
        loaded, unsafe = self._load()
        if loaded is None:  # a file others may change is as bad as an invalid one: keep the last good
            self.file_error = "\n".join(unsafe)
            metrics.desired_state_valid.set(0)
            self.log.warning("desired_state.invalid", errors=unsafe, keeping_generation=self.store.generation)
            return False
        desired, self.file_error = loaded, None
        metrics.desired_state_valid.set(1)
        digest = desired.fingerprint()
        if self.store.take(digest):
            if self._kept_rollback(desired, digest):
                return True
        elif self.store.pending is None or digest == self.read_only:
            return False  # the content in force, or the one observed already
        elif self.desired is not None and self.read_only is None:  # the recorded generation stays in force
            self.log.warning("desired_state.not_recorded", error=self.store.pending)
            return False  # and the edit is retried every reconcile
        else:  # nothing recorded is in force: observe what the file says, change nothing (generations.observe_only)
            desired, self.read_only = observe_only(desired), digest
            self.log.warning("state.read_only", error=self.store.pending)
        self._enforce(desired)
        self.log.info("desired_state.loaded", generation=self.store.generation, mode=desired.policy.mode,
                      paused=desired.policy.paused)
        return True

    def _kept_rollback(self, desired: spec.Desired, digest: str) -> bool:
        """A new generation was recorded: into the history. True when a rollback of it is kept (a restart keeps
        the rollback: the failed change is not tried again) and what it brought back is enforced already."""
        self.read_only = None
        self.history.keep = desired.policy.history
        hold = self.history.taken(self.store.generation, digest, desired.source, self.clock())
        if self.store.observed_generation == self.store.generation:  # it converged before this daemon
            self.history.served(self.store.generation, self.store.last_converged or self.clock())
        if self.held is not None and hold is None:
            self.log.info("rollback.ended", generation=self.store.generation, was=self.held.to)
        self.held = None
        if hold is None:
            return False
        if hold.to == 0:  # back to what ran before it: the same file, restored
            self._enforce(desired, held=hold)
            self.log.warning("rollback.kept", generation=hold.generation, to=AS_FOUND, error=hold.why)
            return True
        if (back := self._brought_back(hold.generation, hold.to)) is not None:
            self._enforce(back, held=hold)
            self.log.warning("rollback.kept", generation=hold.generation, to=hold.to, error=hold.why)
            return True
        self.history.release()  # what it brought back can no longer be taken: the file's generation is tried
        return False

    def _enforce(self, desired: spec.Desired, held: Hold | None = None) -> None:
        """Make `desired` the state in force: the file's generation, or (`held`) the one a rollback brought back
        while the file's is held. What the old one started and the new one makes wrong is cancelled."""
        if self.desired is not None:
            self._end_generation(self.desired, desired)
        self.desired, self.held = desired, held
        metrics.desired_state_generation.set(self.store.generation)
        metrics.rolled_back.set(1 if held else 0)
        metrics.rolled_back_to.set(held.to if held else 0)
        self.backoff = Backoff(desired.policy.retries)  # a new generation: try everything again now
        self.manager.adopt(desired)

    @property
    def enforced_generation(self) -> int:
        """The generation whose state the daemon enforces: the file's, or the one a rollback brought back."""
        return self.held.to if self.held is not None else self.store.generation

    def _brought_back(self, generation: int, to: int) -> spec.Desired | None:
        """Generation `to`, to be enforced in the place of `generation`, judged as the file would be today (its text
        kept in the history, and that copy's owner and mode); None, said once at error, when it is not kept or is
        no longer valid: the file's generation is enforced then."""
        text = self.history.text(to)
        kept = self.history.dir / f"{to}.yaml"
        desired, problems = (None, [f"generation {to} is not kept in {self.history.dir}"]) if text is None \
            else trusted_files.load_text(text, self.path, self.secrets(), kept)
        if desired is None:
            self._say_once(generation, "impossible", lambda: self.log.error(
                "rollback.impossible", generation=generation, to=to, errors=problems))
            return None
        for value in desired.secret_values():
            log.register_secret(value)
        return desired

    def _say_once(self, generation: int, what: str, say: Callable[[], object]) -> None:
        if (generation, what) not in self._failures_said:
            self._failures_said.add((generation, what))
            say()

    def _failed_change(self, why: str, deployment: str | None) -> None:
        """The file's generation failed before it ever served (a start of `deployment`'s failed, or the image
        refused it): carry out `rollback.decide` while the file's generation is enforced. Said once either way."""
        desired, generation = self.desired, self.store.generation
        if (desired is None or self.held is not None or self.read_only is not None
                or desired.policy.mode != "enforce" or desired.policy.paused):
            return
        decision = rollback.decide(self.history.history, generation, desired, deployment,
                                   lambda to: self._brought_back(generation, to))
        why = rollback.first_line(log.redact_text(why))  # kept on disk and shown by `reconciler history`
        match decision.action:
            case "as-found":  # a first generation that stopped co-tenants: what ran before it comes back
                self._roll_back(generation, 0, desired, why)
            case "roll-back":
                assert decision.brought is not None
                self._roll_back(generation, decision.to, decision.brought, why)
            case "failed":
                self.history.failed(generation, why)
                self._say_once(generation, "failed", lambda: self.log.warning(
                    "change.failed", generation=generation, error=why, rollback=decision.why_not))
            case "none":
                pass

    def _roll_back(self, generation: int, to: int, brought: spec.Desired, why: str) -> None:
        """Hold `generation` and enforce `brought` (generation `to`; 0: the file's own, restoring what ran before
        it, core/restore) in its place."""
        hold = self.history.rolled_back(generation, to, why, self.clock())
        self._enforce(brought, held=hold)
        metrics.rollbacks.inc()
        self.log.warning("change.rolled_back", generation=generation, to=to or AS_FOUND, error=why)

    def _restored(self, desired: spec.Desired, observed: Observed, current: Plan) -> Plan:
        """The plan in force: the file's (`current`), or while a first generation is held back to what ran before
        it, the restore plan of the co-tenants that generation stopped."""
        if self.held is None or self.held.to != 0:
            return current
        entry = self.history.history.entry(self.held.generation)
        return restore_plan(desired, observed, entry.stopped if entry is not None else (), self.held.generation)

    def _end_generation(self, old: spec.Desired, new: spec.Desired) -> None:
        """Steps of the old generation that the new one makes wrong (a 12 h sync of a model no longer wanted) must
        not hold it: cancelled, they end at their next check; all steps are idempotent and rsync resumes from its
        partial data. The others run on: an edit of max_model_len keeps the weight sync (`operations.stale`). A
        verify goes on unless the weights it checks changed (`verify.verify_stale`)."""
        def judge(step: Step) -> str | None:
            try:
                return stale(step, old, new)
            except Exception as exc:  # noqa: BLE001 - the generation is recorded already: it must be taken in
                return f"not judged ({type(exc).__name__}: {exc}): cancelled to be safe"

        for step, why in self.operations.cancel_stale(judge).items():
            self.log.info("operation.cancelled", step=step, reason=why)
        request = self.verifier.pending()
        if request is not None and (wrong := verify_stale(old, new, self.verifier.nodes(), request.repair)):
            self.log.info("verify.cancelled", request=request.id, reason=wrong)
            self.verifier.cancel_all(wrong)

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
        self._reread(reasons, trigger)
        self._judge_failed_start()
        cycle = _Cycle(self.desired)
        try:
            if cycle.desired is not None and not self._act(cycle.desired, cycle, trigger):
                return Result()  # shutting down: what a cancelled probe saw is not news worth publishing
        except Exception as exc:  # a bug must not freeze the status at its last value
            cycle.error = f"reconcile crashed: {type(exc).__name__}: {exc}"
            self.log.exception("reconcile.crashed", error=str(exc), trigger=trigger)
        phase = self._publish(cycle.observed, cycle.current, failures, cycle.error)
        self._said(cycle, failures, trigger, began, phase)
        requeue = self._requeue_after(cycle.observed, settle=any(r.kind == "docker" for r in reasons))
        return Result(None, phase) if requeue is None else Result(requeue[0], phase, requeue[1])

    def _act(self, desired: spec.Desired, cycle: _Cycle, trigger: list[str]) -> bool:
        """Observe, plan, admit; what it found kept in `cycle` as it goes. False when the daemon is stopping."""
        cycle.observed = observed = self._observe(desired)
        if self.cancel.is_set():
            return False
        self._say_troubles(observed)
        desired, observed, current = self._plan(cycle, desired, observed)
        cycle.current, cycle.started = self._start(desired, observed, current, trigger)
        self._verify_next(desired, cycle.current)
        self._converged(desired, observed, cycle.current)
        return True

    def _plan(self, cycle: _Cycle, desired: spec.Desired, observed: Observed) -> tuple[spec.Desired, Observed, Plan]:
        """The plan in force. A start the image refuses is a failed change: when that rolls it back, what was
        brought back is observed and planned instead."""
        cycle.current = current = self._restored(desired, observed, planning.plan(desired, observed))
        if current.refused and self.held is None and current.mode == "enforce":
            self._failed_change("the image refuses the start: " + "; ".join(current.refused), None)
            if self.desired is not desired and self.desired is not None:  # rolled back: plan what was brought back
                desired = cycle.desired = self.desired
                observed = cycle.observed = self._observe(desired)
                current = cycle.current = planning.plan(desired, observed)
        return desired, observed, current

    def _converged(self, desired: spec.Desired, observed: Observed, current: Plan) -> None:
        """Nothing to change, the file's generation enforced and no start whose answer is still to be checked:
        converged (and, enforcing, what a rollback may bring back: a generation that served)."""
        if (not current.changes and self.read_only is None and self.held is None
                and not any(s.kind in START_KINDS for s in self.operations.busy())  # its verify may fail
                and not self.publisher.answers_wrong(desired, observed)):  # serving.verify: not served
            self.store.converged(self.clock())  # observing only, or rolled back: not the file's to reach
            if current.mode == "enforce":
                self.history.served(self.store.generation, self.clock())
            metrics.last_converged.set(self.store.last_converged)

    def _judge_failed_start(self) -> None:
        """A start of the file's generation that failed since the last reconcile is a failed change; one of an
        earlier generation is not (an edit since: that one is tried instead)."""
        failed, self._start_failed = self._start_failed, None
        if failed is not None and failed[0] == self.store.generation:
            self._failed_change(failed[2], failed[1])

    def _said(self, cycle: _Cycle, failures: list[str], trigger: list[str], began: float, phase: str) -> None:
        """The reconcile's end: counted, timed, one log line."""
        result = ("error" if cycle.error or failures or cycle.desired is None
                  else "success" if cycle.started else "noop")
        current = cycle.current
        metrics.reconciles.labels(result=result).inc()
        metrics.reconcile_duration.observe(time.monotonic() - began)
        self.log.info("reconcile.end", generation=self.store.generation, reconcile=self.reconciles, phase=phase,
                      trigger=trigger, result=result, steps_started=cycle.started,
                      in_flight=len(self.operations.busy()), seconds=round(time.monotonic() - began, 3),
                      drift=sum(1 for d in current.drift if d.actionable or d.blocking) if current else None,
                      blocked=[f"{b.node}: {b.reason}" for b in current.blocked] if current and current.blocked
                      else None, error=cycle.error)

    def _due(self, observed: Observed | None, settle: bool = False) -> Due:
        lease = self.manager.lease
        return Due(now=self.monotonic(), settle=settle, holding_lease=lease is not None and lease.holding,
                   backoff=self.backoff, desired=self.desired, observed=observed)

    def _requeue_after(self, observed: Observed | None, settle: bool = False) -> tuple[float, str] | None:
        """When to look again without a trigger (`requeue.requeue_after`) as this controller stands."""
        return requeue_after(self._due(observed, settle))

    def _reread(self, reasons: set[Reason], trigger: list[str]) -> None:
        """Read the file again when it changed or SIGHUP asked (said either way: a SIGHUP that finds the file as it
        was is news too), and every reconcile while there is no valid one or its generation could not be
        recorded."""
        if any(r.kind in ("file", "sighup") for r in reasons):
            taken = self.reload()
            self.log.info("desired_state.reread", trigger=trigger, new_generation=taken,
                          generation=self.store.generation)
        elif self.desired is None or self.store.pending is not None:
            self.reload()

    def _say_troubles(self, observed: Observed) -> None:
        """A node's trouble once, when it starts or changes: unreachable, its output unreadable, docker not
        answering at warning; a host key refused or an authentication failure at error (not transient: someone must
        look); its end at info. One line per change, not one every reconcile."""
        for name, obs in observed.nodes.items():
            trouble = _trouble(obs)
            if trouble == self._troubles.get(name):
                continue
            if trouble is None:
                self.log.info("node.recovered", node=name, was=self._troubles.pop(name)[1])
                continue
            kind, why = trouble
            fatal = why.startswith(("HostKeyRejected", "authentication failed"))
            (self.log.error if fatal else self.log.warning)(f"node.{kind}", node=name, error=why)
            self._troubles[name] = trouble

    def _observe(self, desired: spec.Desired) -> Observed:
        assert self.sessions is not None, "a valid desired state opens the sessions"
        observed, durations = self._observe_fn(desired, self.sessions, timeout=desired.policy.timeouts.command,
                                               cancel=self.cancel, ask_flags=False)
        observed = self.health.annotate(desired, observed, self.monotonic())
        # every image id seen is asked beside the loop, a start planned or not: its answer is ready when one is
        observed = with_flags(desired, observed, self._flags_of, starting_only=False)
        self.image_answer = observed.view(desired.deployment_names[0]).serve_flags  # /status: the image's vLLM
        StatusPublisher.observation(desired, observed, durations)
        return observed

    def _flags_of(self, view: spec.Desired, wanted: tuple[str, str]) -> ServeFlags | None:
        """The answer at hand about `view`'s image (a pending one while `FlagsQuery` asks beside the loop)."""
        self._asking[wanted[1]] = view
        return self.flags.get(wanted)

    def _ask_flags(self, holder: str, image_id: str) -> ServeFlags:
        """Ask the image `image_id` on `holder`, run under the reference of the deployment that wants it."""
        assert self.desired is not None and self.sessions is not None
        return ask_serve_flags(self._asking.get(image_id, self.desired.views()[0]), self.sessions, holder, image_id)

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
                          generation=self.enforced_generation,
                          progress=self._progress_of(self.store.generation if self.held is None else None),
                          cancel=self.cancel)
        if self.held is None:
            self._launched.update({s.id: self.store.generation for s in runnable})
        self.operations.launch(runnable, ctx, on_event=self._on_step)
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

    # -- the verify asked of the daemon -----------------------------------------------------------------------

    def _verify_next(self, desired: spec.Desired, current: Plan) -> None:
        """Start the asked verify on its next node when nothing it conflicts with is in flight; a repair only while
        the daemon enforces and holds the lease (it deletes files)."""
        request = self.verifier.pending()
        if request is None or self.verifier.verifying() is not None:
            return
        lease = self.manager.lease
        if request.repair and not (current.mode == "enforce" and lease is not None and lease.holding):
            self.verifier.wait("a repair waits until the daemon enforces and holds the cluster's lease")
            return
        waits = self._verify_waits(request.todo, desired.source_node)
        node = next((n for n, why in waits.items() if why is None), None)
        if node is None:
            self.verifier.wait("; ".join(f"{n}: {why}" for n, why in waits.items()))
            return
        sessions, repair, verify = self.sessions, request.repair, self._verify_fn
        assert sessions is not None, "a valid desired state opens the sessions"
        if self.verifier.start(node, lambda cancel: verify(desired, sessions, node, repair, cancel)):
            self.log.info("verify.start", request=request.id, node=node, repair=repair)

    def _verify_waits(self, todo: list[str], source: str) -> dict[str, str | None]:
        """Per node still to verify, what it waits for (None: nothing): a step in flight or one about to start
        that it conflicts with."""
        busy = self.operations.busy()
        return {node: verify_waits(node, source, busy) or next(
            (f"{s.id} starts first" for s in self._wanted if verify_conflict(s, node, source)), None)
            for node in todo}

    def verify_request(self, doc: dict[str, object]) -> tuple[int, dict[str, object]]:
        """`POST /verify`, authenticated by the listener (server._verify), on one of its threads: take a verify of
        this daemon's desired state (202 and the request's id), or say why not (`verify_answers`)."""
        pid = os.getpid()
        asked = verify_answers.judge(doc, self.path, self.desired, pid)
        if not isinstance(asked, verify_answers.Asked):
            return asked
        try:
            request, joined = self.verifier.ask(asked.repair, asked.node, asked.targets)
        except Busy as exc:
            return verify_answers.busy(str(exc))
        self.log.info("verify.requested", request=request.id, repair=asked.repair, node=asked.node, joined=joined)
        self.requests.request(Reason("verify-request"))
        return verify_answers.accepted(request.id, joined, asked, pid)

    # -- what the steps say -----------------------------------------------------------------------------------

    def _record(self, results: list[StepResult]) -> list[str]:
        """Finished steps into the holds and the co-tenants they stopped into the history (only the loop writes
        them); returns the failures, one line each."""
        with self._stopped_lock:
            stopped, self._stopped = self._stopped, []
        for generation, tenant in stopped:
            self.history.stopped(generation, tenant)
        failures = []
        for r in results:
            if self.backoff is None:
                break
            match outcome_of(r):
                case "success":
                    self.backoff.succeeded(r.step.id)
                case "failed" | "blocked":
                    self.backoff.failed(r.step.id, r.message, self.monotonic())
                    failures.append(f"{r.step.id}: {r.message}")
                    if r.result == "failed":
                        self._start_ran_and_failed(r)
                case "deferred":  # said, never counted: the next reconcile tries again
                    failures.append(f"{r.step.id}: {r.message}")
                case "skipped" | "cancelled":  # nothing to record: it never ran, or was stopped on purpose
                    pass
            self._launched.pop(r.step.id, None)
        return failures

    def _start_ran_and_failed(self, r: StepResult) -> None:
        """Only a start that ran and failed is a failed change's sign: one that is blocked (a container not ours in
        the way, memory short with nothing stopped) is the node's condition, not the change's."""
        if r.step.kind in START_KINDS and r.step.id in self._launched:
            whose = r.step.deployment or (self.desired.deployment_names[0] if self.desired else None)
            self._start_failed = (self._launched[r.step.id], whose, f"{r.step.id}: {r.message}")

    def _progress_of(self, generation: int | None) -> Callable[[str, dict[str, Any]], None]:
        """The steps' report function for a batch launched for `generation` (None: a rollback's): a co-tenant they
        stop is remembered for that generation (for `_restored`), handed to the loop's thread, which alone writes
        the history; every report then goes to `reports.StepReports`."""
        def progress(event: str, fields: dict[str, Any]) -> None:
            if event == "co-tenant.stopped" and generation is not None:
                with self._stopped_lock:
                    self._stopped.append((generation, StoppedCoTenant(fields["node"], fields["container"],
                                                                      fields["id"])))
            self.reports(event, fields)
        return progress

    @staticmethod
    def _on_step(event: str, fields: dict[str, Any]) -> None:
        if event == "step.end":
            r = fields["result"]
            metrics.step_ended(r.step.kind, r.result, r.seconds)

    # -- status -----------------------------------------------------------------------------------------------

    def _publish(self, observed: Observed | None, current: Plan | None, failures: list[str],
                 error: str | None) -> str:
        desired = self.desired
        held = self.backoff.held() if self.backoff else {}
        self.publisher.holds(held)
        self.publisher.failures(self.backoff.failures() if self.backoff else {})
        if desired is not None:
            self.publisher.roles(desired)
        in_flight = self.operations.busy()
        metrics.set_in_flight([step.kind for step in in_flight], STEP_KINDS)
        snap = conditions.Snapshot(
            generation=self.store.generation, observed_generation=self.store.observed_generation,
            file_error=self.file_error, observed=observed, plan=current,
            step_failures=failures + ([error] if error else []), held=held,
            paused=bool(desired and desired.policy.paused), mode=desired.policy.mode if desired else "enforce",
            in_flight=[s.id for s in in_flight], held_change=self.held)
        self.publisher.publish(snap, [n.name for n in desired.nodes] if desired else [], error, self.clock(),
                               state_error=self.store.unsaved)
        return str(self.publisher.status["phase"])


def _trouble(obs: NodeObservation) -> tuple[str, str] | None:
    """What is wrong with a node as one observation saw it (the event name's end, and why), or None."""
    if not obs.reachable:
        return "unreachable", obs.error or "unreachable"
    if obs.probe_error:
        return "probe_failed", obs.probe_error
    if not obs.docker_reachable:
        return "docker_unreachable", obs.docker_error or "docker does not answer"
    return None
