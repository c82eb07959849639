"""The daemon: lock, signals, listener, watchdog and the loop. It only schedules; what to do is the controller's.

- One reconcile at a time; triggers during one coalesce into exactly one more (triggers.ReconcileRequests).
  Triggers: the file, the nodes' event streams, an operation's end, SIGHUP, the resync timer, a verify request
  and a verify's end, and the controller's requeue (a backoff's or a health grace's end, the lease's renewal):
  each reconcile's log line says which (`trigger`, Controller.reconcile), so a SIGHUP is seen in the journal.
- The loop wakes at least every `tick` seconds even when idle, and every wake-up is its heartbeat: the systemd
  watchdog is fed only while that heartbeat is fresh, so a loop stuck anywhere (a reconcile that never returns)
  gets the daemon restarted. No step runs in the loop (they are operations beside it), so no allowance for long
  work is needed or given.
- Everything the process runs beside the loop is named in one list (`runnables.Runnables`, `Daemon.runnables`),
  started in its order and stopped in the reverse one: the SSH sessions and the lease, the listener, the image's
  flag queries, the operations (with the verify), the event streams, the file watch, the watchdog, the exit
  deadline.
- SIGTERM: the loop stops, then the list does: the event streams end, operations are cancelled (rsync keeps its
  partial data, a restart resumes) and awaited, the listener closes, the lease is given back if nothing of ours
  still runs, the sessions close; the process ends within SHUTDOWN_DEADLINE whatever a thread is stuck in.
"""

from __future__ import annotations

import contextlib
import faulthandler
import fcntl
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType

from reconciler.core import spec
from reconciler.edge import log
from reconciler.edge.trusted_files import Secrets
from reconciler.loop import metrics, systemd
from reconciler.loop.controller import Controller
from reconciler.loop.generations import path_key
from reconciler.loop.manager import Manager
from reconciler.loop.reasons import Reason, said
from reconciler.loop.runnables import Runnable, Runnables
from reconciler.loop.server import Listener, ListenMismatch, make_status_key, serve
from reconciler.loop.triggers import ReconcileRequests, watch_file

# From SIGTERM to the process's end, whatever a thread is stuck in (docs/reliability.md). systemd's TimeoutStopSec
# (systemd/spark-reconciler.service) is well above it, so a stop never ends in SIGKILL.
SHUTDOWN_DEADLINE = 10.0
# What the orderly part of the shutdown (operations, streams, listener, sessions) may take once the loop is out.
CLOSE_DEADLINE = 3.0
# The loop's longest sleep: its heartbeat for the watchdog (systemd's WatchdogSec is 2 min).
TICK = 5.0
# A heartbeat older than this stops the watchdog pings: one reconcile is one observation, bounded by the command
# timeout on both ends (default 60 s), so 4 minutes without a wake-up means the loop is stuck.
STALE_AFTER = 240.0

# What the daemon itself asks a reconcile for (built once: a signal handler only adds one to a set).
STARTED, SIGNALLED, SIGHUP, RESYNC = Reason("start"), Reason("signal"), Reason("sighup"), Reason("resync")


class AlreadyRunning(Exception):
    pass


def lock(state_dir: Path, path: Path) -> int | None:
    """flock on a file named after the desired-state path: a second daemon on the same file is refused. Returns
    the descriptor, held for the process's life.

    A state dir that cannot be written (a full disk, a read-only mount) must not keep the daemon from starting
    (issue 31, finding 9: writing the pid on a full disk ended it). flock needs only an open file, read-only if
    need be; the pid in it is for people, written when it can be. Where not even the file can be had, the daemon
    runs without this lock (None, logged by the caller): the cluster's lease on the head still lets one actor act,
    and with a state dir nothing can be recorded in, the daemon only observes (generations.observe_only)."""
    file = state_dir / f"reconciler-{path_key(path)}.lock"
    fd = None
    for make, flags in ((True, os.O_RDWR | os.O_CREAT), (False, os.O_RDONLY)):
        try:
            if make:
                state_dir.mkdir(parents=True, exist_ok=True)
            fd = os.open(file, flags | os.O_CLOEXEC, 0o600)
            break
        except OSError:
            continue
    if fd is None:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        other = os.pread(fd, 64, 0).decode(errors="replace").strip() or "another process"
        os.close(fd)
        raise AlreadyRunning(f"another reconciler (pid {other}) already runs for {path} "
                             f"(lock {file}); stop it first") from None
    with contextlib.suppress(OSError):
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
    return fd


def heartbeat_fresh(heartbeat: float, now: float, stale_after: float = STALE_AFTER) -> bool:
    return now - heartbeat < stale_after


class Daemon:
    """The process: it builds the manager (sessions, lease, event streams, metrics registration) and hands it to
    the controller, names what it runs (`runnables`), then only schedules reconciles. A test may hand it a
    controller (and that controller's manager)."""

    def __init__(self, path: Path, state_dir: Path, listen: str | None = None, events: bool = True,
                 controller: Controller | None = None, secrets: Callable[[], Secrets] | None = None,
                 manager: Manager | None = None) -> None:
        self.path = Path(path)
        self.state_dir = Path(state_dir)
        self.listen_override = listen
        self.requests = ReconcileRequests()
        self.stop = threading.Event()
        self.cancel = threading.Event()
        self.stopped = threading.Event()
        self.log = log.get().bind(file=str(self.path))
        if controller is None:
            manager = Manager(self.path, self.requests, events=events)
            controller = Controller(self.path, self.state_dir, self.requests, self.cancel, secrets=secrets,
                                    manager=manager)
        self.controller = controller
        self.manager = manager
        self.server: Listener | None = None
        self.heartbeat = time.monotonic()
        self.ready_sent = False

    def runnables(self) -> Runnables:
        """Everything the process runs beside the loop, in start order; stopped last first."""
        found = Runnables()
        if self.manager is not None:
            found.add(Runnable("sessions-and-lease", stop=self._close_manager))
        found.add(Runnable("listener", start=self._listen, stop=self._close_listener))
        for runnable in self.controller.runnables():
            found.add(runnable)
        if self.manager is not None:
            found.add(Runnable("event-streams", stop=self._stop_streams))
        found.add(Runnable("file-watch", start=self._watch_file))
        found.add(Runnable("watchdog", start=lambda: _thread("watchdog", self._watchdog)))
        found.add(Runnable("exit-deadline", start=lambda: _thread("exit-deadline", self._exit_by_deadline)))
        return found

    def install_signals(self) -> None:
        """A handler runs on the main thread between two bytecodes, possibly while that very thread holds a lock:
        the log writer's (structlog's PrintLogger), a metric's. Taking such a lock again deadlocks the process for
        good (the cause of a SIGTERM that never ended the daemon). So the handlers only set events and wake the
        loop (ReconcileRequests' lock is re-entrant); the loop logs and counts."""
        def term(_sig: int, _frame: FrameType | None) -> None:
            self.stop.set()
            self.cancel.set()
            self.requests.request(SIGNALLED)

        def hup(_sig: int, _frame: FrameType | None) -> None:
            self.requests.request(SIGHUP)

        signal.signal(signal.SIGTERM, term)
        signal.signal(signal.SIGINT, term)
        signal.signal(signal.SIGHUP, hup)
        # `kill -USR1 PID`: every thread's stack to stderr (the journal), written by faulthandler in C, taking no
        # Python lock: where a stuck loop waits, without py-spy on the head.
        faulthandler.register(signal.SIGUSR1, file=2, all_threads=True)

    def _watchdog(self) -> None:
        interval = systemd.watchdog_interval()
        if interval is None:
            return
        while not self.stop.wait(interval):
            if heartbeat_fresh(self.heartbeat, time.monotonic()):
                systemd.watchdog()

    def _exit_by_deadline(self) -> None:
        """Once asked to stop, end the process within SHUTDOWN_DEADLINE even if a thread is stuck (an SSH channel
        that never answers, a lock never released): idempotent steps make any stop point safe, and systemd must
        not have to SIGKILL. Writes straight to fd 2, taking no Python lock that a stuck thread may hold, and
        dumps every thread's stack first, so the log says where it was stuck."""
        self.stop.wait()
        if self.stopped.wait(SHUTDOWN_DEADLINE):
            return
        os.write(2, f"{log.line_prefix('error')}daemon.shutdown_forced: not stopped {SHUTDOWN_DEADLINE:g}s after "
                    "SIGTERM; thread stacks follow\n".encode())
        faulthandler.dump_traceback(file=sys.stderr.fileno(), all_threads=True)
        os._exit(0)

    def _shutdown(self, runnables: Runnables, deadline: float = CLOSE_DEADLINE) -> None:
        """Stop the list, last started first: the streams end, the cancelled operations end, the listener and the
        sessions close. Never let a half-dead SSH transport hold the exit past the deadline: everything left is a
        daemon thread and dies with the process."""
        closer = threading.Thread(target=lambda: runnables.stop(deadline), name="shutdown", daemon=True)
        closer.start()
        closer.join(deadline + 1)
        if closer.is_alive():
            self.log.warning("daemon.shutdown_timeout", seconds=deadline)

    def _watch_file(self) -> None:
        watch_file(self.path, self.requests, self.stop)  # its thread ends with the stop event

    def _listen(self) -> None:
        """Bind the listener (ListenMismatch: another address than the socket systemd passed) and say the start."""
        listen = self._listen_address()
        self.server = serve(listen, lambda: self.controller.status,
                            "--listen" if self.listen_override else "policy.listen",
                            make_status_key(self.state_dir), self.controller.verify_request)
        self.log.info("daemon.start", listen=listen, generation=self.controller.store.generation, pid=os.getpid())

    def _close_listener(self, _seconds: float, _ended: bool) -> bool:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
        return True

    def _stop_streams(self, _seconds: float, _ended: bool) -> bool:
        assert self.manager is not None
        self.manager.stop_streams()
        return True

    def _close_manager(self, _seconds: float, ended: bool) -> bool:
        """Last: the lease given back only when every operation ended (`ended`), the sessions closed."""
        assert self.manager is not None
        self.manager.close(ended)
        return True

    def _listen_address(self) -> str:
        try:
            desired = self.controller.desired or spec.load(self.path)
            return self.listen_override or desired.policy.listen
        except spec.InvalidDesiredState:
            return self.listen_override or "127.0.0.1:9464"

    def run(self) -> int:
        handle = lock(self.state_dir, self.path)
        if handle is None:
            self.log.warning("daemon.unlocked", state_dir=str(self.state_dir),
                             reason="the state dir cannot hold the lock file; the lease on the head still applies")
        try:
            self.controller.reload()
            runnables = self.runnables()
            try:
                runnables.start()
            except ListenMismatch as exc:
                self.log.error("daemon.listen", error=str(exc))
                return 2
            self._loop()
            self.log.info("daemon.stopping", reason="signal")
            systemd.stopping()
            self._shutdown(runnables)
            self.log.info("daemon.stopped")
            return 0
        finally:
            self.stopped.set()
            if handle is not None:
                os.close(handle)

    def _loop(self) -> None:
        self.requests.request(STARTED)
        next_resync = time.monotonic()
        requeue_at: float | None = None
        requeue_why = ""
        while not self.stop.is_set():
            self.heartbeat = now = time.monotonic()
            due = min(next_resync, requeue_at) if requeue_at is not None else next_resync
            reasons = self.requests.wait(timeout=min(TICK, max(0.0, due - now)))
            self.heartbeat = now = time.monotonic()
            if self.stop.is_set():
                break
            if not reasons:
                if now < due:
                    continue  # a tick: the heartbeat moved, nothing is due
                resync = now >= next_resync
                reasons = {RESYNC if resync else Reason("requeue", detail=requeue_why)}
                metrics.events.labels(node="", source="resync" if resync else "requeue").inc()
            if SIGHUP in reasons:
                metrics.events.labels(node="", source="signal").inc()
            try:
                result = self.controller.reconcile(reasons)
                requeue_at = None if result.requeue_after is None else time.monotonic() + result.requeue_after
                requeue_why = result.requeue_reason
            except Exception as exc:  # the loop outlives any one reconcile
                requeue_at = None  # an old requeue, due already, would repeat the crash back to back
                self.log.exception("reconcile.crashed", error=str(exc), trigger=said(reasons))
                metrics.reconciles.labels(result="error").inc()
            if not self.ready_sent and self.controller.desired is not None:
                self.ready_sent = True
                systemd.ready("first reconcile done")
            desired = self.controller.desired
            next_resync = time.monotonic() + (desired.policy.resync_interval if desired else 30.0)


def _thread(name: str, target: Callable[[], None]) -> None:
    """A daemon thread that ends by itself once the daemon stops (it waits on the stop event)."""
    threading.Thread(target=target, name=name, daemon=True).start()
