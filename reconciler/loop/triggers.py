"""Things that ask for a reconcile: the desired-state file, the resync timer (in the controller), and push events
from the nodes (a `docker events` stream and `ip monitor link` per node over a long-lived SSH channel).

A trigger carries no data (level-triggered): it only *requests* a reconcile, naming why (`reasons.Reason`, typed:
its kind and node, never a string to parse). Requests coalesce: however many arrive while a reconcile runs,
exactly one more follows it.
"""

from __future__ import annotations

import threading
from pathlib import Path

import watchfiles

from reconciler.edge import log
from reconciler.edge.ssh import RemoteError, Session, quote
from reconciler.loop import metrics
from reconciler.loop.reasons import Reason

FILE_CHANGED = Reason("file")


class ReconcileRequests:
    """At most one pending request; the reasons of coalesced requests are kept for the log."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._reasons: set[Reason] = set()

    def request(self, reason: Reason) -> None:
        with self._cond:
            self._reasons.add(reason)
            self._cond.notify_all()

    def wait(self, timeout: float | None) -> set[Reason]:
        """The pending reasons (emptied), or an empty set when the timeout passed first."""
        with self._cond:
            self._cond.wait_for(lambda: bool(self._reasons), timeout=timeout)
            reasons, self._reasons = self._reasons, set()
            return reasons


def watch_file(path: Path, requests: ReconcileRequests, stop: threading.Event) -> threading.Thread:
    """Watch the file's directory, so saves by rename (vim, most editors), by truncate-and-write and by a new
    inode are all seen; a short debounce folds the burst of events one save makes."""
    target = path.resolve()

    def interesting(_change: watchfiles.Change, changed: str) -> bool:
        return Path(changed).resolve() == target or Path(changed).name == target.name

    def loop() -> None:
        for _ in watchfiles.watch(target.parent, watch_filter=interesting, debounce=80, step=20,
                                  stop_event=stop, rust_timeout=500, yield_on_timeout=False,
                                  raise_interrupt=False):
            metrics.events.labels(node="", source="file").inc()
            requests.request(FILE_CHANGED)

    thread = threading.Thread(target=loop, name="watch-file", daemon=True)
    thread.start()
    return thread


_DOCKER_EVENTS = ["docker", "events", "--filter", "type=container", *[
    arg for e in ("die", "stop", "start", "destroy", "oom", "kill") for arg in ("--filter", f"event={e}")],
    "--format", "docker {{.Status}} {{.Actor.Attributes.name}}"]
_DOCKER_EVENTS_SH = quote(_DOCKER_EVENTS)


def event_command(interface: str) -> str:
    """Both streams in one channel. When the channel closes, stdin hits EOF and the whole group is killed, so
    nothing keeps running on the node after the daemon is gone. When either stream ends (`docker events` exits
    with its dockerd), the group is killed too: the channel closes and the caller reconnects, instead of keeping
    a channel whose docker half is gone for good after a dockerd restart."""
    streams = [_DOCKER_EVENTS_SH]
    if interface:
        streams.append("ip -o monitor link | while read -r line; do printf 'link %s\\n' \"$line\"; done")
    return "".join(f"({s}; kill 0) & " for s in streams) + "cat >/dev/null; kill 0"


def stream_events(session: Session, interface: str, requests: ReconcileRequests,
                  stop: threading.Event) -> threading.Thread:
    node = session.name
    logger = log.get().bind(node=node)

    def loop() -> None:
        delay, said = 1.0, None
        while not stop.is_set():
            try:
                for line in session.stream_lines(event_command(interface), stop):
                    source = line.split(" ", 1)[0]
                    if source not in ("docker", "link"):
                        continue
                    metrics.events.labels(node=node, source=source).inc()
                    requests.request(Reason("docker" if source == "docker" else "link", node))
                    delay, said = 1.0, None
            except RemoteError as exc:
                # An SSH failure: at warning (`journalctl -p warning` shows it), once; the same failure again at each
                # retry at debug (the node's own trouble is said once too, by the controller: node.unreachable).
                level = logger.debug if exc.message == said else logger.warning
                level("events.reconnect", error=exc.message, retry_in=delay)
                said = exc.message
                # A stream that ends is news in itself (its dockerd stopped, the node went away): look now.
                requests.request(Reason("events-lost", node))
            if stop.wait(delay):
                return
            delay = min(delay * 2, 30.0)

    thread = threading.Thread(target=loop, name=f"events-{node}", daemon=True)
    thread.start()
    return thread
