"""The reconciler: `reconcile(reasons) -> Result`. Observe, plan, start what may start beside the loop, publish.

It never waits for a step: admitted steps run as operations (`reconciler.loop.operations`), and their end is a trigger.
So every reconcile is as short as one observation, and status and metrics are fresh every cycle, progress
included. What it keeps between reconciles, each in its own small piece:

- the desired state in force: an invalid file never stops the loop nor triggers steps; the last valid generation
  keeps being enforced and DesiredStateInvalid says what is wrong, with line and column;
- generations (`generations.GenerationStore`), holds and backoff per step (`backoff.Backoff`), the health history of the
  head's serving (`health_watch`), the operations in flight, the image's flag list (`operations.FlagsQuery`);
- nothing of the lifecycle: the SSH sessions, the lease, the event streams and the metrics' view of the operations
  are the manager's (`reconciler.loop.manager`), which it receives. A new generation cancels only the operations it
  makes wrong (`operations.stale`, `verify.verify_stale`), then the manager adopts it.

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
from typing import Any

from reconciler.core import planning, spec
from reconciler.core.observed import NodeObservation, Observed, ServeFlags
from reconciler.core.planning import STEP_KINDS, Blocker, Plan, Step, unhealthy_grace
from reconciler.core.restore import AS_FOUND, StoppedCoTenant, restore_plan
from reconciler.edge import log, trusted_files
from reconciler.edge.execute import StepResult
from reconciler.edge.image_flags import ask_serve_flags
from reconciler.edge.lease import RENEW_AFTER
from reconciler.edge.observe import observe, with_flags
from reconciler.edge.ssh import Sessions
from reconciler.edge.steps import StepContext
from reconciler.edge.trusted_files import Secrets
from reconciler.edge.verify import NodeResult, targets, verify_node
from reconciler.loop import conditions, metrics
from reconciler.loop.backoff import Backoff, vetoes
from reconciler.loop.generations import GenerationStore, observe_only
from reconciler.loop.health_watch import HealthWatches
from reconciler.loop.history import HistoryStore, Hold
from reconciler.loop.manager import Manager, SessionsFactory
from reconciler.loop.operations import FlagsQuery, Operations, admit, stale, verify_conflict, verify_waits
from reconciler.loop.status import StatusPublisher
from reconciler.loop.triggers import ReconcileRequests
from reconciler.loop.verify import Busy, Verifier, verify_stale

ObserveFn = Callable[..., tuple[Observed, dict[str, float]]]
VerifyFn = Callable[[spec.Desired, Sessions, str, bool, threading.Event], NodeResult]

#: While serving that served fails its health check (within the grace), reconcile again after at most this long.
UNHEALTHY_RECHECK = 5.0

#: A docker event can arrive before the container list shows what it announces: dockerd logs "die" and only then
#: cleans up and writes the container's new state to the view `/containers/json` reads (moby daemon/monitor.go,
#: ProcessEvent: LogContainerEventWithAttributes "die", daemon.Cleanup, CheckpointTo(containersReplica);
#: daemon/list.go lists from containersReplica.Snapshot()). A crashed rank then looked alive to the reconcile its
#: own event triggered, and nothing else woke the loop before UNHEALTHY_RECHECK (4 of 10 kills took 5.3 s to
#: plan in the benchmark). So a reconcile that a docker event triggered looks once more this long after.
EVENT_SETTLE = 0.5


@dataclass(frozen=True)
class Result:
    """What one reconcile tells the loop: when to look again at the latest (None: at the next resync), and why
    (`requeue_reason`: what the reconcile it triggers says triggered it)."""

    requeue_after: float | None = None
    phase: str = ""
    requeue_reason: str = ""


class Controller:
    """`manager`: the daemon's (its sessions, lease, streams); a controller made without one (tests, `events` and
    `sessions_factory` then shape it) makes its own."""

    def __init__(self, path: Path, state_dir: Path, requests: ReconcileRequests, cancel: threading.Event,
                 events: bool = True, observe_fn: ObserveFn = observe, sessions_factory: SessionsFactory = Sessions,
                 operations: Operations | None = None, clock: Callable[[], float] | None = None,
                 monotonic: Callable[[], float] | None = None, verify_fn: VerifyFn = verify_node,
                 secrets: Callable[[], Secrets] | None = None, manager: Manager | None = None) -> None:
        self.path = Path(path)
        #: Where serving.secrets' values come from, asked at every load (`run --env-file`: the file over this
        #: process's environment, so a rotated key is an edit and a reload); by default the environment alone.
        self.secrets = secrets or (lambda: Secrets(os.environ, spec.ENVIRONMENT))
        self.manager = manager or Manager(self.path, requests, events=events, sessions_factory=sessions_factory)
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
        self.operations = operations or Operations(on_end=lambda: requests.request("operation"),
                                                   clock=self.monotonic)
        self.manager.follow(self.operations.view)
        self.health = HealthWatches(wall=self.clock)
        self._asking: dict[str, spec.Desired] = {}  # image id -> the deployment whose image it is (_ask_flags)
        self.flags = FlagsQuery(self._ask_flags, on_answer=lambda: requests.request("flags"))
        # `reconciler verify` asks through the listener (verify_request); the verify runs beside the loop
        self.verifier = Verifier(on_end=lambda node: requests.request(f"verify-ended:{node}"), clock=self.clock,
                                 monotonic=self.monotonic)
        self._verify_fn = verify_fn
        self._troubles: dict[str, tuple[str, str]] = {}  # node -> what was wrong at the last look (said once)
        self._wanted: list[Step] = []  # the steps this reconcile would start, a verify aside: none starts beside
        self._observe_fn = observe_fn
        self.desired: spec.Desired | None = None
        self.file_error: str | None = None
        self.backoff: Backoff | None = None
        self.reconciles = 0
        self.synced: dict[str, int] = {}  # node -> bytes reported by the weight sync in flight
        #: A start failed (_record): the file's generation it was started for, its deployment, why.
        self._start_failed: tuple[int, str | None, str] | None = None
        self._stopped: list[tuple[int, StoppedCoTenant]] = []  # from the step threads, for _record
        self._stopped_lock = threading.Lock()
        self._failures_said: set[tuple[int, str]] = set()  # (generation, what) said once: not every reconcile
        self.image_answer: ServeFlags | None = None  # what the serving image said of itself (FlagsQuery)

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
            self.read_only = None
            self.history.keep = desired.policy.history
            hold = self.history.taken(self.store.generation, digest, desired.source, self.clock())
            if self.store.observed_generation == self.store.generation:  # it converged before this daemon
                self.history.served(self.store.generation, self.store.last_converged or self.clock())
            if self.held is not None and hold is None:
                self.log.info("rollback.ended", generation=self.store.generation, was=self.held.to)
            self.held = None
            if hold is not None and hold.to == 0:  # back to what ran before it: the same file, restored
                self._enforce(desired, held=hold)
                self.log.warning("rollback.kept", generation=hold.generation, to=AS_FOUND, error=hold.why)
                return True
            if hold is not None and (back := self._brought_back(hold.generation, hold.to)) is not None:
                self._enforce(back, held=hold)  # a restart keeps the rollback: the failed change is not tried again
                self.log.warning("rollback.kept", generation=hold.generation, to=hold.to, error=hold.why)
                return True
            if hold is not None:  # what it brought back can no longer be taken: the file's generation is tried
                self.history.release()
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
            if (generation, "impossible") not in self._failures_said:
                self._failures_said.add((generation, "impossible"))
                self.log.error("rollback.impossible", generation=generation, to=to, errors=problems)
            return None
        for value in desired.secret_values():
            log.register_secret(value)
        return desired

    def _failed_change(self, why: str, deployment: str | None) -> None:
        """The file's generation failed before it ever served (a start of `deployment`'s failed, or the image
        refused it): with policy.on_failed_change rollback, bring back the last generation that served, when the
        failing deployment is one the change touched (a failure of what the change left as it was is not the
        change's: it is retried as before), and hold this one until the file changes. Said once either way."""
        desired, generation = self.desired, self.store.generation
        if (desired is None or self.held is not None or self.read_only is not None
                or desired.policy.mode != "enforce" or desired.policy.paused):
            return
        entry = self.history.history.entry(generation)
        if entry is None or entry.served:
            return  # it served: a later failure is a wedge or a crash, repaired in place, not a failed change
        why = _first_line(log.redact_text(why))  # kept on disk and shown by `reconciler history`
        back = self.history.history.last_served(generation)
        brought = None
        if back is not None and desired.policy.on_failed_change == "rollback":
            brought = self._brought_back(generation, back.generation)
        if brought is not None and deployment is not None and not _touches(desired, brought, deployment):
            return  # not the change's failure: what failed is as it was in the generation that served
        if back is None and desired.policy.on_failed_change == "rollback" and entry.stopped:
            self._abort_to_as_found(generation, why)
            return
        if brought is None or back is None:
            self.history.failed(generation, why)
            if (generation, "failed") not in self._failures_said:
                self._failures_said.add((generation, "failed"))
                self.log.warning("change.failed", generation=generation, error=why,
                                 rollback=("policy.on_failed_change is hold" if desired.policy.on_failed_change
                                           == "hold" else "no earlier generation to bring back"
                                           if back is None else f"generation {back.generation} cannot be taken"))
            return
        hold = self.history.rolled_back(generation, back.generation, why, self.clock())
        self._enforce(brought, held=hold)
        metrics.rollbacks.inc()
        self.log.warning("change.rolled_back", generation=generation, to=back.generation, error=why)

    def _abort_to_as_found(self, generation: int, why: str) -> None:
        """A first generation failed after it stopped co-tenants: hold it and bring back what ran before it
        (generation 0, core/restore): its ranks stopped, the co-tenants it stopped started again."""
        assert self.desired is not None
        hold = self.history.rolled_back(generation, 0, why, self.clock())
        self._enforce(self.desired, held=hold)
        metrics.rollbacks.inc()
        self.log.warning("change.rolled_back", generation=generation, to=AS_FOUND, error=why)

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

    def reconcile(self, reasons: set[str]) -> Result:
        """One reconcile; `reasons`: what triggered it (the triggers coalesced into it), said in its log line:
        start, file (the desired-state file changed), sighup, docker:NODE and link:NODE (a node's event),
        events-lost:NODE, resync, operation (a step ended), flags (the image's answer), verify-request,
        verify-ended:NODE, requeue:WHY (backoff-ended:STEP, health-recheck, lease-renewal, event-settle)."""
        start = time.monotonic()
        self.reconciles += 1
        trigger = sorted(reasons)
        failures = self._record(self.operations.drain())
        self._reread(reasons, trigger)
        failed, self._start_failed = self._start_failed, None
        if failed is not None and failed[0] == self.store.generation:  # an edit since: that one is tried instead
            self._failed_change(failed[2], failed[1])
        desired = self.desired
        observed: Observed | None = None
        current: Plan | None = None
        error: str | None = None
        started = 0
        try:
            if desired is not None:
                observed = self._observe(desired)
                if self.cancel.is_set():
                    return Result()  # shutting down: what a cancelled probe saw is not news worth publishing
                self._say_troubles(observed)
                current = self._restored(desired, observed, planning.plan(desired, observed))
                if current.refused and self.held is None and current.mode == "enforce":
                    self._failed_change("the image refuses the start: " + "; ".join(current.refused), None)
                    if self.desired is not desired:  # rolled back: plan what was brought back
                        desired = self.desired
                        assert desired is not None
                        observed = self._observe(desired)
                        current = planning.plan(desired, observed)
                current, started = self._start(desired, observed, current, trigger)
                self._verify_next(desired, current)
                if (not current.changes and self.read_only is None and self.held is None
                        and not any(s.kind in START_KINDS for s in self.operations.busy())  # its verify may fail
                        and not self.publisher.answers_wrong(desired, observed)):  # serving.verify: not served
                    self.store.converged(self.clock())  # observing only, or rolled back: not the file's to reach
                    if current.mode == "enforce":  # what a rollback may bring back: a generation that serves
                        self.history.served(self.store.generation, self.clock())
                    metrics.last_converged.set(self.store.last_converged)
        except Exception as exc:  # a bug must not freeze the status at its last value
            error = f"reconcile crashed: {type(exc).__name__}: {exc}"
            self.log.exception("reconcile.crashed", error=str(exc), trigger=trigger)
        result = "error" if error or failures or desired is None else ("success" if started else "noop")
        phase = self._publish(observed, current, failures, error)
        metrics.reconciles.labels(result=result).inc()
        metrics.reconcile_duration.observe(time.monotonic() - start)
        self.log.info("reconcile.end", generation=self.store.generation, reconcile=self.reconciles, phase=phase,
                      trigger=trigger, result=result, steps_started=started, in_flight=len(self.operations.busy()),
                      seconds=round(time.monotonic() - start, 3),
                      drift=sum(1 for d in current.drift if d.actionable or d.blocking) if current else None,
                      blocked=[f"{b.node}: {b.reason}" for b in current.blocked] if current and current.blocked
                      else None, error=error)
        requeue = self._requeue_after(observed, settle=any(r.startswith("docker:") for r in reasons))
        return Result(None, phase) if requeue is None else Result(requeue[0], phase, requeue[1])

    def _reread(self, reasons: set[str], trigger: list[str]) -> None:
        """Read the file again when it changed or SIGHUP asked (said either way: a SIGHUP that finds the file as it
        was is news too), and every reconcile while there is no valid one or its generation could not be
        recorded."""
        if {"file", "sighup"} & reasons:
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
        busy, source = self.operations.busy(), desired.source_node
        waits = {node: verify_waits(node, source, busy) or next(
            (f"{s.id} starts first" for s in self._wanted if verify_conflict(s, node, source)), None)
            for node in request.todo}
        node = next((n for n, why in waits.items() if why is None), None)
        if node is None:
            self.verifier.wait("; ".join(f"{n}: {why}" for n, why in waits.items()))
            return
        sessions, repair, verify = self.sessions, request.repair, self._verify_fn
        assert sessions is not None, "a valid desired state opens the sessions"
        if self.verifier.start(node, lambda cancel: verify(desired, sessions, node, repair, cancel)):
            self.log.info("verify.start", request=request.id, node=node, repair=repair)

    def verify_request(self, doc: dict[str, object]) -> tuple[int, dict[str, object]]:
        """`POST /verify`, authenticated by the listener (server._verify), on one of its threads: take a verify of
        this daemon's desired state (202 and the request's id), or say why not (reconciler/edge/daemon_client.py
        reads the reasons)."""
        file, repair, only = doc.get("file"), doc.get("repair"), doc.get("node")
        if not isinstance(file, str) or not isinstance(repair, bool) or not (only is None or isinstance(only, str)):
            return 400, {"error": "a verify request names file (a path), repair (true or false) and node (a name "
                                  "or null)"}
        pid = os.getpid()
        if os.path.realpath(file) != os.path.realpath(self.path):
            return 409, {"reason": "other-file", "pid": pid,
                         "error": f"the cluster is held by the daemon pid {pid}, which keeps {self.path}, not {file}"}
        desired = self.desired
        if desired is None:
            return 409, {"reason": "no-desired-state", "error": "the daemon has no valid desired state in force"}
        if len(desired.deployments) > 1:
            return 409, {"reason": "several-deployments", "error": "a verify compares one model's copies with its "
                         "source: a file of several deployments is not verified yet"}
        if repair and (desired.policy.mode != "enforce" or desired.policy.paused):
            return 409, {"reason": "not-enforcing", "error": "the daemon does not enforce (policy.mode "
                         f"{desired.policy.mode}, paused {str(desired.policy.paused).lower()}): a repair is not its"}
        nodes = targets(desired, only)
        if only is not None and not nodes:
            return 400, {"error": f"{only} is not a node to verify: the serving nodes but the source "
                                  f"({desired.source_node}) are: {', '.join(targets(desired)) or 'none'}"}
        try:
            request, joined = self.verifier.ask(repair, only, nodes)
        except Busy as exc:
            return 409, {"reason": "busy", "error": str(exc)}
        self.log.info("verify.requested", request=request.id, repair=repair, node=only, joined=joined)
        self.requests.request("verify-request")
        return 202, {"id": request.id, "joined": joined, "targets": nodes, "pid": pid}

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
            if r.result == "success":
                self.backoff.succeeded(r.step.id)
            elif r.result in ("failed", "blocked"):
                self.backoff.failed(r.step.id, r.message, self.monotonic())
                failures.append(f"{r.step.id}: {r.message}")
                # Only a start that ran and failed: one that is blocked (a container not ours in the way, memory
                # short with nothing stopped) is the node's condition, not the change's.
                if r.result == "failed" and r.step.kind in START_KINDS and r.step.id in self._launched:
                    whose = r.step.deployment or (self.desired.deployment_names[0] if self.desired else None)
                    self._start_failed = (self._launched[r.step.id], whose, f"{r.step.id}: {r.message}")
            elif r.result == "deferred":  # said, never counted: the next reconcile tries again
                failures.append(f"{r.step.id}: {r.message}")
            self._launched.pop(r.step.id, None)
        return failures

    def _requeue_after(self, observed: Observed | None, settle: bool = False) -> tuple[float, str] | None:
        """The next moment something is due without any trigger, and what: a backoff's end, a health grace's end,
        the lease's renewal (a long resync must not let it lapse while our operations run), and after a docker
        event the second look that sees what the event announced (`settle`, EVENT_SETTLE)."""
        due = [(EVENT_SETTLE, "event-settle")] if settle else []
        now = self.monotonic()
        lease = self.manager.lease
        if (lease is not None and lease.holding and self.desired is not None
                and self.desired.policy.resync_interval > RENEW_AFTER):
            due.append((RENEW_AFTER, "lease-renewal"))
        if self.backoff is not None and (when := self.backoff.next_due(now)) is not None:
            step = min((r.next_try, sid) for sid, r in self.backoff.records.items() if r.next_try > now)[1]
            due.append((when - now, f"backoff-ended:{step}"))
        for view in self.desired.views() if self.desired is not None and observed is not None else []:
            seen = observed.view(view.deployment.name) if observed is not None else None
            health = seen.node(view.api_node.name).serving if seen is not None else None
            if seen is not None and health is not None and health.served_before and health.unhealthy_for is not None:
                # A failing API sends no event, and the event that made it fail (a rank's container dying) may
                # arrive before the state shows it: while it fails, look again often, like a readiness probe.
                due.append((min(UNHEALTHY_RECHECK, unhealthy_grace(view, seen) - health.unhealthy_for),
                            "health-recheck"))
        if not due:
            return None
        seconds, why = min(due)
        return max(0.0, seconds), why

    def _progress_of(self, generation: int | None) -> Callable[[str, dict[str, Any]], None]:
        """The steps' report function for a batch launched for `generation` (None: a rollback's): a co-tenant they
        stop is remembered for that generation (for `_restored`), handed to the loop's thread, which alone writes
        the history."""
        def progress(event: str, fields: dict[str, Any]) -> None:
            if event == "co-tenant.stopped" and generation is not None:
                with self._stopped_lock:
                    self._stopped.append((generation, StoppedCoTenant(fields["node"], fields["container"],
                                                                      fields["id"])))
            self._progress(event, fields)
        return progress

    def _progress(self, event: str, fields: dict[str, Any]) -> None:
        """Steps report here (from their threads): bytes, or a cold start's stage and line, into the operation
        (which /status and the progress metrics read: the manager has metrics.operation_progress follow these
        operations), the sync counter, then the log."""
        node = fields.get("node", "")
        if event == "weights.progress":
            done = fields["bytes_done"]
            if done > self.synced.get(node, 0):
                metrics.weights_sync_bytes.labels(node=node).inc(done - self.synced.get(node, 0))
            self.synced[node] = done
            self.operations.progress("weights", node, done, fields.get("bytes_total"))
        elif event == "weights.start":
            self.synced[node] = 0
            self.operations.progress("weights", node, 0, fields.get("bytes_total"))
        elif event in ("image.start", "image.progress"):
            self.operations.progress("image", node, fields["bytes_done"], fields.get("bytes_total"))
        elif event in ("download.start", "download.progress"):
            self.operations.progress("download", node, fields.get("bytes_done", 0), fields["bytes_total"])
        elif event in ("serving.stage", "serving.progress"):
            self.operations.stage("await-health", node, fields["stage"], fields["percent"], fields["line"])
        elif event == "serving.memory":  # a rank's node once it served: its overshoot, into /status and metrics
            self.publisher.memory(fields, self.clock())
        elif event == "serving.verify":  # a start's check of its answer: ServingVerified, reconciler_serving_verified
            self.publisher.verified(fields)
        elif event == "serving.transport":  # the network a rank's NCCL chose: NcclTransport, the fallback gauge
            self.publisher.transport(fields)
        levels = {"debug": self.log.debug, "info": self.log.info, "warning": self.log.warning}
        levels[progress_level(event)](event, **{k: v for k, v in fields.items() if k != "step"})

    def _on_step(self, event: str, fields: dict[str, Any]) -> None:
        if event == "step.end":
            r = fields["result"]
            metrics.steps.labels(kind=r.step.kind, result=r.result).inc()
            if r.result != "skipped":
                metrics.step_duration.labels(kind=r.step.kind).observe(r.seconds)

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
        kinds: dict[str, int] = {}
        for step in in_flight:
            kinds[step.kind] = kinds.get(step.kind, 0) + 1
        for kind in STEP_KINDS:
            metrics.operations.labels(kind=kind).set(kinds.get(kind, 0))
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


#: The steps whose failure is a start that failed: of the file's generation before it served, a failed change
#: (`Controller._failed_change`).
START_KINDS = frozenset({"start-serving", "launch-model", "await-health"})


def _first_line(text: str, limit: int = 300) -> str:
    """A failure as the history keeps it: its first line (a start's message carries the container's log tail)."""
    line = text.strip().splitlines()[0] if text.strip() else ""
    return line if len(line) <= limit else line[:limit - 1] + "…"


def _touches(new: spec.Desired, old: spec.Desired, deployment: str) -> bool:
    """Whether the change from `old` to `new` touched what `deployment` starts: it is new, or its model, serving,
    the nodes or the trust differ."""
    if deployment not in old.deployment_names:
        return True
    a, b = new.view(deployment), old.view(deployment)
    return (a.deployment, a.nodes, a.trust) != (b.deployment, b.nodes, b.trust)


#: Step reports (`_progress`) that say something went wrong: logged at warning, not info.
TROUBLE_EVENTS = frozenset({"ledger.unwritten", "serving.sync-skipped", "serving.drop-caches-refused",
                            "weights.refused", "weights.drop-behind-ended", "retention.kept"})


def progress_level(event: str) -> str:
    """The log level of a step's report: a progress tick is debug, trouble is warning, the rest info."""
    if event.endswith(".progress"):
        return "debug"
    return "warning" if event in TROUBLE_EVENTS else "info"
