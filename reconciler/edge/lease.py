"""One actuator per cluster: a lock on the head, held by a companion process for as long as its holder lives.

The daemon's own flock is keyed on the desired-state path, so a copy of the file (or `reconciler apply` next to a
running daemon, or `verify --repair`) used to be a second actuator on the same nodes. The lease lives where the
cluster is, on the head, in the SSH user's `~/.spark-reconciler` (mode 0700).

Why a lock held by a process, and no expiry: the first lease was a file with a holder and an expiry by the head's
clock (`date +%s`), renewed every minute. A clock step of more than its TTL (700 s forward was enough) made a live
daemon's lease look expired, and `apply` took it beside the daemon; and its holder was named by machine and file,
so two daemons on one host with the same file path (two state dirs) were both "the holder". Now whoever acts runs
one companion on the head (`Session.companion`): it takes `flock` on `lease.lock`, says `ok`, and then only waits
for its stdin to end. The kernel's lock is held exactly as long as that process lives, and that process lives as
long as its holder's channel: when the holder releases, ends, is killed, or its connection is closed, sshd closes
the companion's stdin, the companion ends, and the kernel drops the lock. No clock decides anything (`flock -w`
and `timeout` count elapsed time, which a step of the wall clock does not move), and a lock belongs to one
process's channel, so no two processes can both hold it whatever they are named. A daemon that systemd restarts
takes the lease back at once: its predecessor's connection closed when that process died.

A holder whose connection goes without a word (a laptop running `apply` that lost its network, a partition) would
leave a companion waiting for stdin until sshd's TCP keepalive, after 2 hours. So the companion writes a line every
minute: a holder's host that answers again resets the connection it no longer has at the next line, and one that
never answers makes sshd's TCP give up after its retransmissions (~15 minutes with Linux's defaults); either ends
the session and the companion. Meanwhile the lock stays taken: nobody else acts (the daemon itself included, if it
was the holder and reconnected), which is the safe side of not knowing.

The file `lease` beside the lock says who holds it (the holder's token and, for people, its pid, host and file);
it is read only to name the holder to whoever is refused.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from reconciler.core.spec import Desired
from reconciler.core.text import printable
from reconciler.edge.ssh import CommandTimeout, Companion, RemoteError, Result, Sessions

#: The daemon looks at its lease at least this often while it holds it (Controller._requeue_after): a lease lost
#: (its companion ended) is noticed within a minute, and taken again before anything else starts.
RENEW_AFTER = 60.0
#: How long the companion may live on the node (`timeout`): the daemon's life. At its end the lease is taken again.
FOR_LIFE = 365 * 86400
#: How long a second actor waits for the lock: enough for a predecessor's companion to end after its connection
#: closed (milliseconds), short enough not to hold a reconcile while another actor holds the cluster.
WAIT = 1

_SCRIPT = r"""
set -u
token=$1 info=$2
d="$HOME/.spark-reconciler"
umask 077
mkdir -p "$d" || exit 70
exec 9>>"$d/lease.lock" || exit 70
flock -w WAIT 9; rc=$?
if [ $rc -eq 1 ]; then  # flock's answer for "another process holds it"
  who=$(sed -n 2p "$d/lease" 2>/dev/null | head -c 300)
  printf 'held\t%s\n' "$who"; exit 0
fi
[ $rc -eq 0 ] || exit 70
printf '%s\n%s\n' "$token" "$info" > "$d/lease.tmp" && mv -f "$d/lease.tmp" "$d/lease" || exit 70
echo ok
# Held while stdin lasts; only this shell keeps fd 9 (9>&-), so whatever ends it frees the lock. A line a minute
# gives sshd something to send, so it notices a holder that vanished without closing its connection.
while timeout 60 cat >/dev/null 9>&-; [ $? -eq 124 ]; do echo . || break; done
rm -f "$d/lease"
""".replace("WAIT", str(WAIT))


class LeaseHeld(Exception):
    """Another actor holds the cluster (or the head could not say): nothing may act."""


class LeaseUnreachable(LeaseHeld):
    """The head could not be reached to take the lease: nobody may be holding it, so "stop the daemon or wait" is
    the wrong advice (and exit 5, unreachable, not 4, held)."""


@dataclass(frozen=True)
class Holder:
    token: str  # this process: written beside the lock, never compared (the lock is the process's own)
    info: str  # shown to whoever finds the lease taken

    @classmethod
    def of(cls, kind: str, desired_path: str | Path) -> Holder:
        host, pid, path = socket.gethostname(), os.getpid(), os.path.abspath(desired_path)
        info = "".join(c if c.isprintable() else "?" for c in f"{kind} pid {pid} on {host} for {path}")
        return cls(f"{kind}:{host}:{pid}:{path}", info)


def parse(line: str | None) -> str | None:
    """The companion's first line: None when the lease is ours now; otherwise why not, in words. Odd output is a
    refusal, never a crash."""
    fields = (line or "").strip().split("\t", 1)
    if fields == ["ok"]:
        return None
    if fields[0] == "held":
        who = printable(fields[1][:300]) if len(fields) == 2 and fields[1].strip() else "another reconciler"
        return f"the cluster is held by {who}"
    return f"the head answered the lease script with {printable((line or '')[:200])!r}"


class Lease:
    """The lease as one holder sees it: taken (a companion on the head holds the lock for us) or not.

    `sessions` reaches the head. The daemon gives it a pool of its own (Controller): the companion keeps its channel
    for the daemon's life, which is then not one of the channels the probes and steps share."""

    def __init__(self, desired: Desired, sessions: Sessions, holder: Holder):
        self.desired, self.sessions, self.holder = desired, sessions, holder
        self._held: tuple[contextlib.ExitStack, Companion] | None = None

    @property
    def holding(self) -> bool:
        """As of the last look (acquire, renew_if_due)."""
        return self._held is not None

    def acquire(self) -> None:
        """Take the lease, or keep it when our companion still holds it; LeaseHeld says who holds it otherwise."""
        if self._held is not None and self._alive(self._held[1]):
            return
        self._drop()
        timeout = self.desired.policy.timeouts.command
        stack = contextlib.ExitStack()
        try:
            companion = stack.enter_context(self.sessions[self.desired.head.name].companion(
                ["sh", "-c", _SCRIPT, "lease", self.holder.token, self.holder.info], timeout=FOR_LIFE, stdin=b"",
                open_timeout=timeout))
            answer = companion.line(timeout)
            why = parse(answer) if answer is not None else _ended(companion.end(timeout))
        except RemoteError as exc:
            _close(stack)
            raise LeaseUnreachable(f"the head could not be reached to take the cluster's lease: {exc}") from None
        if why is not None:
            _close(stack)
            raise LeaseHeld(why)
        self._held = (stack, companion)

    def renew_if_due(self) -> str | None:
        """For the daemon, before it acts: None when the lease is ours. Looking costs no round trip (our companion
        has not ended); a lease lost is taken again at once if it can be."""
        try:
            self.acquire()
        except LeaseHeld as exc:
            return str(exc)
        return None

    def release(self) -> None:
        """Give the lease back: the companion's stdin closes, and we wait for it to end, so the lock is free when
        this returns (the next actor need not wait)."""
        held, self._held = self._held, None
        if held is not None:
            with contextlib.suppress(RemoteError):
                held[1].end(self.desired.policy.timeouts.command)
            _close(held[0])

    def _drop(self) -> None:
        held, self._held = self._held, None
        if held is not None:
            _close(held[0])

    @staticmethod
    def _alive(companion: Companion) -> bool:
        """Our companion still runs (its minute lines are read and dropped): the lock is still ours."""
        try:
            while companion.line(0) is not None:
                pass
        except CommandTimeout:
            return True  # nothing more to read, and it has not ended
        except RemoteError:
            pass
        return False


def _ended(result: Result) -> str:
    return (f"the lease script on the head ended without an answer (exit {result.exit_code}): "
            f"{printable(result.stderr.strip()[-200:])}")


def _close(stack: contextlib.ExitStack) -> None:
    """Close the companion's channel; best effort (a channel already gone needs nothing)."""
    with contextlib.suppress(Exception):
        stack.close()


@contextlib.contextmanager
def held(desired: Desired, sessions: Sessions, holder: Holder) -> Iterator[Lease]:
    """The lease for a one-shot command (apply, verify --repair): taken before anything acts (LeaseHeld
    otherwise), held by its companion while the command runs, released at the end (or when the process dies)."""
    lease = Lease(desired, sessions, holder)
    lease.acquire()
    try:
        yield lease
    finally:
        lease.release()
