"""One actuator per cluster: a lease in a file on the head, taken by every command that acts.

The daemon's own flock is keyed on the desired-state path, so a copy of the file (or `reconciler apply` next to a
running daemon, or `verify --repair`) used to be a second actuator on the same nodes. The lease lives where the
cluster is, on the head, in the SSH user's `~/.spark-reconciler/lease` (mode 0700 dir): holder, expiry (the head's
clock), and who it is for people. It is read and written under `flock` on the head, so two actors racing for
it cannot both win.

The holder is named by what it is: a daemon by machine and desired-state path (so the daemon systemd restarts
takes its own lease back at once); a one-shot command also by its pid. A holder that dies leaves the lease to
expire: TTL is 10 minutes, longer than a wedged daemon lives (watchdog 2 min after its heartbeat goes stale at
4 min, then a 10 s shutdown), so its operations are gone before anyone else may act.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from reconciler.core.spec import Desired
from reconciler.edge.ssh import RemoteError, Sessions, quote

TTL = 600
RENEW_AFTER = 60.0  # seconds since the last renewal; the daemon renews when it is about to act or while it acts

_SCRIPT = r"""
set -u
op=$1 me=$2 ttl=$3 info=$4
d="$HOME/.spark-reconciler"
umask 077
mkdir -p "$d" || exit 70
exec 9>>"$d/lease.lock" || exit 70
flock -w 5 9 || { echo busy; exit 0; }
now=$(date +%s)
holder='' until=0 who=''
if [ -f "$d/lease" ]; then { read -r holder; read -r until; read -r who; } < "$d/lease"; fi
case $until in ''|*[!0-9]*) until=0 ;; esac
if [ -n "$holder" ] && [ "$holder" != "$me" ] && [ "$until" -gt "$now" ]; then
  printf 'held\t%s\t%s\n' "$((until - now))" "$who"; exit 0
fi
if [ "$op" = release ]; then rm -f "$d/lease"; echo released; exit 0; fi
printf '%s\n%s\n%s\n' "$me" "$((now + ttl))" "$info" > "$d/lease.tmp" && mv -f "$d/lease.tmp" "$d/lease" || exit 70
printf 'ok\t%s\n' "$ttl"
"""


class LeaseHeld(Exception):
    """Another actor holds the cluster (or the head could not say): nothing may act."""


@dataclass(frozen=True)
class Holder:
    token: str  # compared on the head
    info: str  # shown to whoever finds the lease taken

    @classmethod
    def of(cls, kind: str, desired_path: str | Path) -> Holder:
        host, pid, path = socket.gethostname(), os.getpid(), os.path.abspath(desired_path)
        token = f"{kind}:{host}:{path}" + ("" if kind == "daemon" else f":{pid}")
        info = "".join(c if c.isprintable() else "?" for c in f"{kind} pid {pid} on {host} for {path}")
        return cls(token, info)


def parse(stdout: str) -> str | None:
    """None when the lease is ours now; otherwise why not, in words. Odd output is a refusal, never a crash."""
    line = stdout.strip().splitlines()[-1] if stdout.strip() else ""
    fields = line.split("\t")
    if fields[0] in ("ok", "released"):
        return None
    if fields[0] == "held" and len(fields) == 3 and fields[1].isdigit():
        return f"the cluster is held by {fields[2] or 'another reconciler'} for {fields[1]} s more"
    if fields[0] == "busy":
        return "the lease on the head is being changed by another actor right now"
    return f"the head answered the lease script with {line[:200]!r}"


class Lease:
    def __init__(self, desired: Desired, sessions: Sessions, holder: Holder, ttl: int = TTL):
        self.desired, self.sessions, self.holder, self.ttl = desired, sessions, holder, ttl
        self.renewed_at = float("-inf")  # monotonic

    def _run(self, op: str) -> str | None:
        args = quote([op, self.holder.token, str(self.ttl), self.holder.info])
        try:
            result = self.sessions[self.desired.head.name].run_script(
                f"set -- {args}\n{_SCRIPT}", timeout=self.desired.policy.timeouts.command)
        except RemoteError as exc:
            return f"the lease on the head could not be read: {exc}"
        if result.exit_code != 0:
            return f"the lease script failed on the head (exit {result.exit_code}): {result.stderr.strip()[-200:]}"
        return parse(result.stdout)

    def acquire(self) -> None:
        """Take or renew the lease; LeaseHeld says who holds it otherwise."""
        if (why := self._run("acquire")) is not None:
            raise LeaseHeld(why)
        self.renewed_at = time.monotonic()

    def renew_if_due(self) -> str | None:
        """For the daemon, before it acts and while it acts: None when the lease is ours."""
        if time.monotonic() - self.renewed_at < RENEW_AFTER:
            return None
        try:
            self.acquire()
        except LeaseHeld as exc:
            self.renewed_at = float("-inf")
            return str(exc)
        return None

    @property
    def holding(self) -> bool:
        return self.renewed_at != float("-inf")

    def release(self) -> None:
        self.renewed_at = float("-inf")
        with contextlib.suppress(Exception):  # best effort: an unreleased lease expires by itself
            self._run("release")


@contextlib.contextmanager
def held(desired: Desired, sessions: Sessions, holder: Holder) -> Iterator[Lease]:
    """The lease for a one-shot command (apply, verify --repair): taken before anything acts (LeaseHeld
    otherwise), renewed beside the command while it runs, released at the end."""
    lease = Lease(desired, sessions, holder)
    lease.acquire()
    stop = threading.Event()

    def keep() -> None:
        while not stop.wait(RENEW_AFTER):
            with contextlib.suppress(LeaseHeld):
                lease.acquire()

    keeper = threading.Thread(target=keep, name="lease", daemon=True)
    keeper.start()
    try:
        yield lease
    finally:
        stop.set()
        keeper.join(5)
        lease.release()
