"""The full weight verification (sha256 of every file against the source's), by the daemon or by the command.

The weekly timer runs `reconciler verify --repair`; a repair deletes files on the nodes, so it needs the cluster's
lease, which the daemon holds while it enforces: beside a running daemon the timer could only exit 4. So the command
asks the running daemon (reconciler/edge/daemon_client.py, authenticated by the daemon's status key), and the daemon
schedules the verify here (its SSH work is `reconciler.edge.verify`), as a low-priority operation beside its loop,
under the lease it holds anyway:

- one node at a time (two targets hashed at once would both rewrite the source's hash cache), each only while no
  step that writes or loads the trees it hashes is in flight (`operations.verify_waits`: a sync to that node, a
  download on the source, the serving chain on either);
- it yields: a step that needs those trees and may start makes the running verify stop (`Verifier.yield_`) and
  waits only until it has (`operations.verify_conflict`, Controller._admit); the node is verified again once the
  step has ended. Serving and syncs never wait for a weekly check: a cold start held behind a hash of 100 GB would
  be an outage of its own, and a verify taken while a sync rewrites the tree says nothing;
- it shows in /status: a running verify among the operations (`verify/NODE`), each request with its state and
  per-node results in `verifyRequests`, which the command polls for its own;
- a new generation of the desired state that changes the weights it checks (`verify_stale`: the model, the source,
  a tree, a node no longer to verify), or the daemon's stop, cancels it (its results say so: exit 1).

Without a daemon the command verifies by itself, as before (`reconciler.edge.verify.verify_here`).
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

from reconciler.core.spec import Desired
from reconciler.edge.ssh import Cancelled
from reconciler.edge.verify import HASH_TIMEOUT, NodeResult, failed_result, targets
from reconciler.loop.operations import connection, model_on

#: Finished requests /status keeps (each command polls for its own; a second one asking the same joins the first).
KEEP = 5


def _weights(desired: Desired, node: str) -> tuple[object, ...]:
    """What a verify of `node` compares: the model, the source and the two trees, and how both are reached."""
    return *model_on(desired, node), connection(desired, node), connection(desired, desired.source_node)


def verify_stale(old: Desired, new: Desired, nodes: Collection[str], repair: bool) -> str | None:
    """Why the new desired state makes a verify of `nodes` (asked under the old one) wrong, or None: it goes on.
    Pure. Only the weights it checks matter: another model, revision, source or tree, a node no longer to verify,
    or one reached another way; an edit of `max_model_len` leaves a weekly verify running. A repair (it removes
    files) also ends when the new state no longer enforces: nothing may act for it."""
    if repair and (new.policy.mode != "enforce" or new.policy.paused):
        return "a repair ends: the desired state no longer enforces (policy.mode observe or policy.paused)"
    wanted = set(targets(new))
    if gone := sorted(n for n in nodes if n not in wanted):
        return f"{', '.join(gone)} no longer to verify in the new desired state"
    if changed := sorted(n for n in nodes if _weights(old, n) != _weights(new, n)):
        return f"the weights to verify on {', '.join(changed)} changed in the new desired state"
    return None


class Busy(Exception):
    """Another verify, asking something else, is not finished: one at a time."""


@dataclass
class Request:
    """One asked verify: its nodes still to do, the one running, why it waits, the results so far."""

    id: str
    repair: bool
    only: str | None
    requested: float  # unix time
    todo: list[str]
    results: list[NodeResult] = field(default_factory=list)
    running: str | None = None
    waiting: str | None = None
    finished: float | None = None  # unix time
    cancelled: str | None = None  # why it ends without verifying the rest (its running node still ending)

    @property
    def state(self) -> str:
        return "done" if self.finished is not None else ("running" if self.running else "pending")

    def as_dict(self) -> dict[str, object]:
        return {"id": self.id, "state": self.state, "repair": self.repair, "node": self.only,
                "requested": self.requested, "finished": self.finished, "running": self.running,
                "waiting": self.waiting, "todo": list(self.todo), "results": list(self.results)}


@dataclass
class _Run:
    request: Request
    node: str
    started: float  # monotonic
    cancel: threading.Event
    thread: threading.Thread
    yielded_to: str | None = None  # cancelled to make room: the node goes back to the request's todo


class Verifier:
    """The verify requests and the one verify running, thread-safe: the listener's threads ask, the loop starts and
    yields, the run's thread ends. `on_end(node)` is a trigger (the loop reconciles: a repair's removals are drift,
    and the next node may start)."""

    def __init__(self, on_end: Callable[[str], None], clock: Callable[[], float] = time.time,
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        self._lock = threading.Lock()
        self._requests: list[Request] = []  # oldest first; only the last can be unfinished
        self._run: _Run | None = None
        self._on_end = on_end
        self._clock = clock
        self._monotonic = monotonic

    def ask(self, repair: bool, only: str | None, nodes: list[str]) -> tuple[Request, bool]:
        """A request to verify `nodes`, and whether it joined the unfinished one asking the same (two timers, an
        operator beside the timer); Busy when the unfinished one asks something else."""
        with self._lock:
            current = self.pending_locked()
            if current is not None and current.cancelled is None:  # a cancelled one is no longer asking anything
                if (current.repair, current.only) != (repair, only):
                    raise Busy(f"verify request {current.id} (repair {str(current.repair).lower()}, node "
                               f"{current.only or 'all'}) is not finished: wait for it, then ask again")
                return current, True
            request = Request(secrets.token_hex(8), repair, only, self._clock(), list(nodes))
            if not nodes:
                request.finished = request.requested
            self._requests = [*self._requests[-KEEP:], request]
            return request, False

    def pending_locked(self) -> Request | None:
        last = self._requests[-1] if self._requests else None
        return last if last is not None and last.finished is None else None

    def pending(self) -> Request | None:
        """The unfinished request still to be worked on, if any (not one that is being cancelled)."""
        with self._lock:
            request = self.pending_locked()
            return request if request is not None and request.cancelled is None else None

    def nodes(self) -> list[str]:
        """The nodes the unfinished request still verifies: the one running and those to do (what a new generation
        is judged against, `verify_stale`)."""
        with self._lock:
            request = self.pending_locked()
            if request is None or request.cancelled:
                return []
            return [*([request.running] if request.running else []), *request.todo]

    def verifying(self) -> str | None:
        """The node a verify runs on now (also while it is yielding)."""
        with self._lock:
            return self._run.node if self._run is not None else None

    def wait(self, why: str) -> None:
        """Say why the unfinished request does not start now."""
        with self._lock:
            if (request := self.pending_locked()) is not None and request.running is None:
                request.waiting = why

    def start(self, node: str, work: Callable[[threading.Event], NodeResult]) -> bool:
        """Run `work(cancel)` for `node` of the unfinished request in a thread of its own; False when that request
        ended meanwhile (cancelled) or a verify runs already."""
        with self._lock:
            request = self.pending_locked()
            if request is None or request.cancelled or self._run is not None or node not in request.todo:
                return False
            request.todo.remove(node)
            request.running, request.waiting = node, None
            cancel = threading.Event()
            thread = threading.Thread(target=self._body, args=(node, work, cancel), name=f"verify-{node}",
                                      daemon=True)
            self._run = _Run(request, node, self._monotonic(), cancel, thread)
        thread.start()
        return True

    def _body(self, node: str, work: Callable[[threading.Event], NodeResult], cancel: threading.Event) -> None:
        result: NodeResult | None
        try:
            result = work(cancel)
        except Cancelled:
            result = None
        except Exception as exc:  # noqa: BLE001 - a bug must still end the request, saying what happened
            result = failed_result(node, "error", f"the verify crashed: {exc!r}")
        with self._lock:
            run, self._run = self._run, None
            assert run is not None
            request = run.request
            request.running = None
            if result is None and run.yielded_to and not request.cancelled:
                request.todo.insert(0, node)  # verified again once the step it made room for has ended
                request.waiting = f"yielded to {run.yielded_to}"
            else:
                request.results.append(result or failed_result(node, "cancelled", request.cancelled or "cancelled"))
                if not request.todo:
                    request.finished = self._clock()
        self._on_end(node)

    def yield_(self, to: str) -> bool:
        """Make the running verify stop for `to` (steps that need its trees); its node is verified again later.
        True when this asked it to (not already stopping)."""
        with self._lock:
            if self._run is None or self._run.cancel.is_set():
                return False
            self._run.yielded_to = to
            self._run.cancel.set()
            return True

    def cancel_all(self, why: str) -> None:
        """End the unfinished request: the running node's verify stops, the others are not verified (`why`)."""
        with self._lock:
            request = self.pending_locked()
            if request is None or request.cancelled:
                return
            request.cancelled = why
            request.results += [failed_result(node, "cancelled", why) for node in request.todo]
            request.todo = []
            if self._run is not None and self._run.request is request:
                self._run.cancel.set()
            else:
                request.finished = self._clock()

    def join(self, timeout: float) -> bool:
        """Wait for the running verify's thread to end (after a cancel); False when it still runs."""
        with self._lock:
            thread = self._run.thread if self._run is not None else None
        if thread is not None:
            thread.join(timeout)
            return not thread.is_alive()
        return True

    def view(self) -> list[dict[str, object]]:
        """The running verify as /status shows an operation (its deadline: the two hashing commands' bounds)."""
        with self._lock:
            run = self._run
            if run is None:
                return []
            seconds = self._monotonic() - run.started
            stopping = run.cancel.is_set()
            return [{"step": f"verify/{run.node}", "kind": "verify", "node": run.node,
                     "state": "stopping" if stopping else "running", "seconds": round(seconds, 1),
                     "deadlineIn": round(2 * HASH_TIMEOUT - seconds, 1), "bytesDone": 0, "bytesTotal": None,
                     "bytesPerSecond": None, "stage": "stopping" if stopping else "sha256", "percent": None,
                     "detail": f"request {run.request.id}" + (", repair" if run.request.repair else ""),
                     "request": run.request.id, "repair": run.request.repair}]

    def requests(self) -> list[dict[str, object]]:
        """The requests /status shows (`verifyRequests`), oldest first."""
        with self._lock:
            return [r.as_dict() for r in self._requests]
