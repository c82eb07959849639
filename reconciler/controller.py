"""The daemon loop: wait for a trigger, reconcile once (observe, plan, execute, verify), publish status. It only
schedules; what to do comes from the pure core and how from the edge.

- One reconcile at a time; triggers during one coalesce into exactly one more (triggers.Requests).
- Last good desired state: an invalid file never stops the loop nor triggers steps; the previous valid
  generation keeps being enforced and DesiredStateInvalid says exactly what is wrong, with line and column.
- Generations: a new valid content bumps the generation (persisted in the state dir, so restarts keep it);
  observedGeneration is the generation the cluster last converged to.
- Holds and backoff across reconciles live in `holds`; an unreachable node only blocks steps that need it.
"""

from __future__ import annotations

import faulthandler
import fcntl
import hashlib
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

from reconciler import conditions, log, metrics, spec, systemd
from reconciler.drift import DRIFT_KINDS
from reconciler.execute import execute
from reconciler.holds import Holds, vetoes
from reconciler.observe import observe
from reconciler.plan import Plan
from reconciler.plan import plan as make_plan
from reconciler.remote import Sessions
from reconciler.server import serve
from reconciler.steps import StepContext
from reconciler.triggers import Requests, stream_events, watch_file

# From SIGTERM to the process's end, whatever a thread is stuck in (docs/reliability.md). systemd's TimeoutStopSec
# (systemd/spark-reconciler.service) is well above it, so a stop never ends in SIGKILL.
SHUTDOWN_DEADLINE = 10.0
# What the orderly part of the shutdown (streams, listener, sessions) may take once the loop is out.
CLOSE_DEADLINE = 3.0


class AlreadyRunning(Exception):
    pass


def lock(state_dir: Path, path: Path):
    """flock on a file named after the desired-state path: a second daemon on the same file is refused."""
    state_dir.mkdir(parents=True, exist_ok=True)
    key = hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:16]
    handle = open(state_dir / f"reconciler-{key}.lock", "a+")  # noqa: SIM115 - held for the process lifetime
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        other = handle.read().strip() or "another process"
        raise AlreadyRunning(f"another reconciler (pid {other}) already runs for {path} "
                             f"(lock {handle.name}); stop it first") from None
    handle.seek(0)
    handle.truncate()
    handle.write(str(os.getpid()))
    handle.flush()
    return handle


class Controller:
    def __init__(self, path: Path, state_dir: Path, listen: str | None = None, events: bool = True):
        self.path = Path(path)
        self.state_dir = Path(state_dir)
        self.listen_override = listen
        self.use_events = events
        self.requests = Requests()
        self.stop = threading.Event()
        self.cancel = threading.Event()
        self.stopped = threading.Event()
        self._held_published: set[tuple[str, str]] = set()  # (kind, node) shown as held on the step_hold gauge
        self.log = log.get().bind(file=str(self.path))
        self.desired: spec.Desired | None = None
        self.content_hash: str | None = None
        self.file_error: str | None = None
        self.generation, self.observed_generation = self._load_generations()
        self.holds: Holds | None = None
        self.sessions: Sessions | None = None
        self.streams: dict[str, threading.Event] = {}
        self.status: dict = {"phase": "Converging", "conditions": [], "generation": self.generation,
                             "observedGeneration": self.observed_generation, "lastPlan": None, "lastError": None}
        self.heartbeat = time.monotonic()
        self.busy_until = 0.0
        self.ready_sent = False
        self.reconciles = 0
        self.synced: dict[str, int] = {}  # node -> bytes reported by the weight sync in flight

    # -- generations ------------------------------------------------------------------------------------------

    def _state_file(self) -> Path:
        key = hashlib.sha256(str(self.path.resolve()).encode()).hexdigest()[:16]
        return self.state_dir / f"state-{key}.json"

    def _load_generations(self) -> tuple[int, int]:
        """Also restores when the cluster last converged: a restart must not make Grafana's "since last
        converged" read as 1970 until the first converged reconcile."""
        self.last_converged = 0.0
        try:
            data = json.loads(self._state_file().read_text())
            self._stored_hash = data.get("hash")
            self.last_converged = float(data.get("lastConverged") or 0.0)
            return int(data.get("generation", 0)), int(data.get("observedGeneration", 0))
        except (OSError, ValueError, TypeError):
            self._stored_hash = None
            return 0, 0
        finally:
            if self.last_converged > 0:
                metrics.last_converged.set(self.last_converged)

    def _save_generations(self) -> None:
        tmp = self._state_file().with_suffix(".tmp")
        tmp.write_text(json.dumps({"hash": self.content_hash, "generation": self.generation,
                                   "observedGeneration": self.observed_generation,
                                   "lastConverged": self.last_converged}))
        tmp.replace(self._state_file())

    # -- the desired state ------------------------------------------------------------------------------------

    def reload(self) -> bool:
        """Re-read the file; True when a new valid generation was taken. Invalid: keep the last good one."""
        try:
            desired = spec.load(self.path)
        except spec.InvalidDesiredState as exc:
            self.file_error = "\n".join(exc.lines())
            metrics.desired_state_valid.set(0)
            self.log.warning("desired_state.invalid", errors=exc.lines(), keeping_generation=self.generation)
            return False
        self.file_error = None
        metrics.desired_state_valid.set(1)
        digest = hashlib.sha256(desired.model_dump_json().encode()).hexdigest()
        if digest == self.content_hash:
            return False
        if self.content_hash is not None or digest != self._stored_hash or self.generation == 0:
            self.generation += 1
        self.content_hash, self.desired = digest, desired
        metrics.desired_state_generation.set(self.generation)
        self.holds = Holds(desired.policy.retries)  # a new generation: try everything again now
        if self.sessions is None:
            self.sessions = Sessions(desired)
        else:
            self.sessions.update(desired)
        self._save_generations()
        self.log.info("desired_state.loaded", generation=self.generation, mode=desired.policy.mode,
                      paused=desired.policy.paused)
        if self.use_events:
            self._restart_streams()
        return True

    def _restart_streams(self) -> None:
        for stop in self.streams.values():
            stop.set()
        self.streams = {}
        assert self.desired is not None and self.sessions is not None
        for node in self.desired.nodes:
            stop = threading.Event()
            self.streams[node.name] = stop
            stream_events(self.sessions[node.name], node.fabric.interface, self.requests, stop)

    # -- one reconcile ----------------------------------------------------------------------------------------

    def reconcile(self, reasons: set[str]) -> None:
        start = time.monotonic()
        self.reconciles += 1
        if "file" in reasons or "sighup" in reasons or self.desired is None:
            self.reload()
        desired = self.desired
        if desired is None:
            self._publish(None, None, [], {})
            metrics.reconciles.labels(result="error").inc()
            return
        assert self.sessions is not None and self.holds is not None
        logger = self.log.bind(generation=self.generation, reconcile=self.reconciles)
        observed = self._observe(desired)
        if self.cancel.is_set():
            return  # shutting down: what a cancelled probe saw is not news worth publishing
        if not self.ready_sent:
            self.ready_sent = True
            systemd.ready(f"observed {len(observed.nodes)} nodes")
        current = make_plan(desired, observed)
        failures: list[str] = []
        ran = 0
        if current.steps and current.mode == "enforce":
            logger.info("reconcile.plan", reasons=sorted(reasons), steps=[s.id for s in current.steps],
                        drift=len(current.drift))
            ran, failures = self._execute(desired, observed, current)
            if self.cancel.is_set():
                return
            observed = self._observe(desired)  # verify: the next decision starts from what is really there
            current = make_plan(desired, observed)
            if ran and current.steps and not self.cancel.is_set():
                self.requests.request("progress")  # the world moved; look again right away
        held = self._publish_holds()
        if not current.changes:
            self.observed_generation = self.generation
            self.last_converged = time.time()
            metrics.last_converged.set(self.last_converged)
            self._save_generations()
        self._publish(observed, current, failures, held)
        result = "error" if failures else ("success" if ran else "noop")
        metrics.reconciles.labels(result=result).inc()
        metrics.reconcile_duration.observe(time.monotonic() - start)
        logger.info("reconcile.end", phase=self.status["phase"], result=result, steps_run=ran,
                    seconds=round(time.monotonic() - start, 3), drift=sum(
                        1 for d in current.drift if d.actionable or d.blocking))

    def _execute(self, desired: spec.Desired, observed, current: Plan) -> tuple[int, list[str]]:
        """Run the plan's steps (those not held or backing off); record each outcome in the holds. Returns the
        number of steps that succeeded and the failures, one line each."""
        assert self.sessions is not None and self.holds is not None
        ctx = StepContext(desired=desired, sessions=self.sessions, observed=observed,
                          generation=self.generation, progress=self._progress, cancel=self.cancel)
        self.busy_until = time.monotonic() + max(
            [desired.policy.timeouts.weights_sync, desired.serving.health_timeout])
        waiting = vetoes(current, self.holds, time.time())
        outcome = execute(current, ctx, on_event=self._on_step, skip=lambda s: waiting.get(s.id))
        self.busy_until = 0.0
        ran, failures = 0, []
        for r in outcome.results:
            if r.result == "success":
                self.holds.succeeded(r.step.id)
                ran += 1
            elif r.result in ("failed", "blocked"):
                self.holds.failed(r.step.id, r.message, time.time())
                failures.append(f"{r.step.id}: {r.message}")
        return ran, failures

    def _publish_holds(self) -> dict[str, str]:
        """The held steps, also as the step_hold gauge: 1 while held, back to 0 once no longer held — also when
        the hold ended by a success or a new generation, which drop the step's record (the gauge once stayed 1
        until the daemon restarted, and ReconcilerStepHeld kept firing)."""
        assert self.holds is not None
        held = self.holds.held()
        now = {(sid.split("/")[0], sid.split("/")[1]) for sid in held}
        for kind, node in self._held_published - now:
            metrics.step_hold.labels(kind=kind, node=node).set(0)
        for kind, node in now:
            metrics.step_hold.labels(kind=kind, node=node).set(1)
        self._held_published = now
        return held

    def _observe(self, desired: spec.Desired):
        assert self.sessions is not None, "a valid desired state opens the sessions"
        observed, durations = observe(desired, self.sessions, timeout=desired.policy.timeouts.command,
                                      cancel=self.cancel)
        for name, seconds in durations.items():
            metrics.observe_duration.labels(node=name).observe(seconds)
        for name, obs in observed.nodes.items():
            metrics.node_reachable.labels(node=name).set(1 if obs.reachable else 0)
            if obs.fabric is not None:
                metrics.fabric_link_up.labels(node=name).set(1 if obs.fabric.admin_up and obs.fabric.carrier else 0)
            if obs.memory is not None:
                metrics.memory_available.labels(node=name).set(obs.memory.available_bytes)
        source = observed.node(desired.source_node).weights
        if source is not None and source.present:
            for node in desired.serving_nodes:
                metrics.weights_bytes.labels(node=node.name, state="expected").set(source.total_bytes)
                mine = observed.node(node.name).weights
                metrics.weights_bytes.labels(node=node.name, state="synced").set(
                    min(mine.total_bytes, source.total_bytes) if mine and mine.present else 0)
        head = observed.node(desired.head.name).serving
        want = desired.serving.served_model_name or desired.model.id
        metrics.serving_healthy.set(1 if head and head.serves(want) else 0)
        return observed

    def _progress(self, event: str, fields: dict) -> None:
        self.heartbeat = time.monotonic()
        if event == "weights.progress":
            node, done = fields["node"], fields["bytes_done"]
            if done > self.synced.get(node, 0):
                metrics.weights_sync_bytes.labels(node=node).inc(done - self.synced.get(node, 0))
            self.synced[node] = done
        elif event == "weights.start":
            self.synced[fields["node"]] = 0
        level = self.log.debug if event.endswith(".progress") else self.log.info
        level(event, **{k: v for k, v in fields.items() if k != "step"})

    def _on_step(self, event: str, fields: dict) -> None:
        self.heartbeat = time.monotonic()
        if event == "step.end":
            r = fields["result"]
            metrics.steps.labels(kind=r.step.kind, result=r.result).inc()
            if r.result != "skipped":
                metrics.step_duration.labels(kind=r.step.kind).observe(r.seconds)

    # -- status -----------------------------------------------------------------------------------------------

    def _publish(self, observed, current: Plan | None, failures: list[str], held: dict[str, str]) -> None:
        desired = self.desired
        snap = conditions.Snapshot(
            generation=self.generation, observed_generation=self.observed_generation, file_error=self.file_error,
            observed=observed, plan=current, step_failures=failures, held=held,
            paused=bool(desired and desired.policy.paused), mode=desired.policy.mode if desired else "enforce")
        nodes = [n.name for n in desired.nodes] if desired else []
        conds = conditions.conditions(snap, nodes, self.status.get("conditions", []), time.time())
        phase = conditions.phase_of(snap)
        drift = current.drift if current else []
        self.status = {
            "phase": phase, "generation": self.generation, "observedGeneration": self.observed_generation,
            "file": str(self.path), "conditions": conds,
            "drift": [d.as_dict() for d in drift],
            "lastPlan": current.as_dict() if current else None,
            "lastError": failures[-1] if failures else (self.file_error or None),
            "held": held, "time": time.time(),
        }
        metrics.set_phase(phase)
        metrics.set_conditions(conds)
        counts: dict[tuple[str, str], int] = {}
        for d in drift:
            if d.actionable or d.blocking:
                counts[(d.node, d.kind)] = counts.get((d.node, d.kind), 0) + 1
        metrics.set_drift(counts, nodes, DRIFT_KINDS)
        metrics.converged.set(1 if current is not None and not current.changes else 0)
        metrics.observed_generation.set(self.observed_generation)
        systemd.status(f"{phase}; generation {self.generation}, {sum(counts.values())} drifted")

    # -- the loop ---------------------------------------------------------------------------------------------

    def install_signals(self) -> None:
        """A handler runs on the main thread between two bytecodes, possibly while that very thread holds a lock:
        the log writer's (structlog's PrintLogger), a metric's. Taking such a lock again deadlocks the process for
        good (the cause of a SIGTERM that never ended the daemon). So the handlers only set events and wake the
        loop (Requests' lock is re-entrant); the loop logs and counts."""
        def term(_sig, _frame) -> None:
            self.stop.set()
            self.cancel.set()
            self.requests.request("signal")

        def hup(_sig, _frame) -> None:
            self.requests.request("sighup")

        signal.signal(signal.SIGTERM, term)
        signal.signal(signal.SIGINT, term)
        signal.signal(signal.SIGHUP, hup)

    def _watchdog(self) -> None:
        interval = systemd.watchdog_interval()
        if interval is None:
            return
        while not self.stop.wait(interval):
            # Ping only while the loop shows signs of life: a loop wedged past every deadline gets restarted.
            fresh = time.monotonic() - self.heartbeat < 4 * interval
            if fresh or time.monotonic() < self.busy_until:
                systemd.watchdog()

    def _exit_by_deadline(self) -> None:
        """Once asked to stop, end the process within SHUTDOWN_DEADLINE even if a thread is stuck (an SSH channel
        that never answers, a lock never released): idempotent steps make any stop point safe, and systemd must
        not have to SIGKILL. Writes straight to fd 2, taking no Python lock that a stuck thread may hold, and
        dumps every thread's stack first, so the log says where it was stuck."""
        self.stop.wait()
        if self.stopped.wait(SHUTDOWN_DEADLINE):
            return
        os.write(2, f"daemon.shutdown_forced: not stopped {SHUTDOWN_DEADLINE:g}s after SIGTERM; "
                    "thread stacks follow\n".encode())
        faulthandler.dump_traceback(file=sys.stderr.fileno(), all_threads=True)
        os._exit(0)

    def _shutdown(self, server, deadline: float = CLOSE_DEADLINE) -> None:
        """Close streams, the listener and the sessions, but never let a half-dead SSH transport hold the exit
        past the deadline: everything left is a daemon thread and dies with the process."""
        for stop in self.streams.values():
            stop.set()

        def close() -> None:
            server.shutdown()
            server.server_close()
            if self.sessions:
                self.sessions.close()

        closer = threading.Thread(target=close, name="shutdown", daemon=True)
        closer.start()
        closer.join(deadline)
        if closer.is_alive():
            self.log.warning("daemon.shutdown_timeout", seconds=deadline)

    def run(self) -> int:
        handle = lock(self.state_dir, self.path)
        try:
            self.reload()
            desired = self.desired
            listen = self.listen_override or (desired.policy.listen if desired else "127.0.0.1:9464")
            server = serve(listen, lambda: self.status)
            self.log.info("daemon.start", listen=listen, generation=self.generation, pid=os.getpid())
            watch_file(self.path, self.requests, self.stop)
            threading.Thread(target=self._watchdog, name="watchdog", daemon=True).start()
            threading.Thread(target=self._exit_by_deadline, name="exit-deadline", daemon=True).start()
            self.requests.request("start")
            next_resync = time.monotonic()
            while not self.stop.is_set():
                self.heartbeat = time.monotonic()
                resync = self.desired.policy.resync_interval if self.desired else 30.0
                due = [next_resync]
                held_until = self.holds.next_due() if self.holds else None
                if held_until:
                    due.append(time.monotonic() + max(0.0, held_until - time.time()))
                reasons = self.requests.wait(timeout=max(0.0, min(due) - time.monotonic()))
                if self.stop.is_set():
                    break
                if "sighup" in reasons:
                    metrics.events.labels(node="", source="signal").inc()
                if not reasons:
                    reasons = {"resync"}
                    metrics.events.labels(node="", source="resync").inc()
                try:
                    self.reconcile(reasons)
                except Exception as exc:
                    self.log.exception("reconcile.crashed", error=str(exc))
                    metrics.reconciles.labels(result="error").inc()
                next_resync = time.monotonic() + resync
            self.log.info("daemon.stopping", reason="signal")
            systemd.stopping()
            self._shutdown(server)
            self.log.info("daemon.stopped")
            return 0
        finally:
            self.stopped.set()
            handle.close()
