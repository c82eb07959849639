"""The manager: what the controller works with and does not own (controller-runtime's manager). It keeps, across
generations of the desired state and across reconciles, the SSH sessions (the probes' and steps' pool, and the
lease's own connection to the head), the cluster's lease, the per-node event streams and the metrics' view of the
operations. The controller receives it and only reconciles: observe, plan, admit, publish.

A new generation changes these by as little as it must: a session is rebuilt only when its node's SSH settings
(or its jump host's) changed (`Sessions.update`), an event stream restarts only when its node's connection or
fabric interface changed (`stream_key`), and the lease is given back only when the head is another one.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

from reconciler.core.spec import Desired
from reconciler.edge import log
from reconciler.edge.lease import Holder, Lease
from reconciler.edge.ssh import Sessions
from reconciler.loop import metrics
from reconciler.loop.operations import connection
from reconciler.loop.triggers import ReconcileRequests, stream_events

SessionsFactory = Callable[[Desired], Sessions]


def stream_key(desired: Desired, name: str) -> tuple[object, ...]:
    """What a node's event stream depends on: how the node is reached and the fabric interface it watches. Equal
    across an edit: the stream runs on (its session is the one `Sessions.update` kept)."""
    return connection(desired, name), desired.node(name).fabric.interface


def streams_to_restart(old: Desired | None, new: Desired) -> tuple[set[str], set[str]]:
    """(to stop, to start): the streams of nodes gone or whose `stream_key` changed stop, those of nodes new or
    changed start. Pure."""
    before = {} if old is None else {n.name: stream_key(old, n.name) for n in old.nodes}
    after = {n.name: stream_key(new, n.name) for n in new.nodes}
    changed = {name for name, key in after.items() if before.get(name) != key}
    return {name for name in before if name not in after} | (changed & before.keys()), changed


class Manager:
    """The sessions, the lease, the event streams, the metrics registration. `adopt` takes a generation in;
    `close` ends what it holds, at the daemon's stop."""

    def __init__(self, path: Path, requests: ReconcileRequests, events: bool = True,
                 sessions_factory: SessionsFactory = Sessions) -> None:
        self.holder = Holder.of("daemon", path)
        self.requests = requests
        self.use_events = events
        self.sessions: Sessions | None = None
        self.lease_sessions: Sessions | None = None  # the lease's own connection to the head (edge/lease.py)
        self.lease: Lease | None = None
        self.streams: dict[str, threading.Event] = {}  # node -> its stream's stop
        self._desired: Desired | None = None
        self._factory = sessions_factory
        self.log = log.get().bind(file=str(path))

    @staticmethod
    def follow(view: Callable[[], Iterable[Mapping[str, object]]]) -> None:
        """The progress metrics read the operations from `view` (Operations.view) at each scrape."""
        metrics.operation_progress.follow(view)

    def adopt(self, desired: Desired) -> None:
        """A new generation in force: the sessions updated, the lease kept (or given back for another head), the
        event streams of the nodes whose connection changed restarted."""
        old, self._desired = self._desired, desired
        if self.sessions is None or self.lease_sessions is None:
            self.sessions, self.lease_sessions = self._factory(desired), self._factory(desired)
        else:
            self.sessions.update(desired)
            self.lease_sessions.update(desired)
        if self.lease is not None and self.lease.desired.instance != desired.instance:
            # Another head address: maybe another cluster now. The sessions were updated above, so the release
            # reaches the head at its new address. A renumbered head (the same machine under a new ssh.host, issue
            # 29 finding 7) is fine: the lease is the same file in the SSH user's ~/.spark-reconciler, our holder
            # token names this daemon's machine and file (not the head's address), so the release drops our own
            # lease and the next act takes it back at once (tests/unit/edge/test_lease.py); which containers are ours
            # is the head's cluster id, not the address (core.ownership), so nothing restarts. A really different
            # head gets a release that finds nothing of ours there; the old head's lease ended with its connection.
            self.lease.release()
            self.lease = None
        if self.lease is None:
            self.lease = Lease(desired, self.lease_sessions, self.holder)
        else:  # the same head: the lock our companion holds there stays ours across generations
            self.lease.desired = desired
        if self.use_events:
            self._restart_streams(old, desired)

    def _restart_streams(self, old: Desired | None, new: Desired) -> None:
        assert self.sessions is not None
        stop, start = streams_to_restart(old, new)
        for name in stop:
            self.streams.pop(name).set()
        for name in sorted(start):
            self.streams[name] = threading.Event()
            stream_events(self.sessions[name], new.node(name).fabric.interface, self.requests, self.streams[name])
        if stop or start:
            self.log.info("events.streams", stopped=sorted(stop) or None, started=sorted(start) or None)

    def stop_streams(self) -> None:
        for stop in self.streams.values():
            stop.set()
        self.streams = {}

    def close(self, ended: bool) -> None:
        """At the daemon's stop, once its operations were cancelled: `ended` when they all ended, so nothing of
        ours runs and another actor may act now (the lease is given back); otherwise the lease's connection stays
        and ends with the process, after its threads."""
        if ended and self.lease is not None:
            self.lease.release()
        if self.sessions is not None:
            self.sessions.close()
        if ended and self.lease_sessions is not None:
            self.lease_sessions.close()
