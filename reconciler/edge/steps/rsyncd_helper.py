"""Runs ON THE TARGET NODE (python3, standard library only): a one-time rsync daemon on the fabric address.

Sent as `python3 -c SOURCE BIND PEER STREAMS ROOT LIFETIME` over the reconciler's SSH session to the target; the
first line of its stdin is the one-time secret, and after that its stdin is the lifeline: when the reconciler
closes the channel (done, cancelled, or the head died and sshd noticed) every daemon it started is ended.

Why this shape (docs/research/weights-transport.md, from rsync's source):
- `rsync --daemon` whose stdin is a socket serves that one connection and exits (inetd mode), so each accepted
  connection gets its own daemon and nothing listens once STREAMS daemons ended well;
- only authenticated connections hold a stream's slot (issue 53, finding L): a connection from the peer's address
  that never authenticates (anyone on the source can open one: a silent first connection there once held the only
  slot until the real stream's rsync gave up, exit 30 after 48 s) is pending until its daemon asks for the secret,
  which rsync does only once the client answered its challenge; a pending one is dropped (its daemon killed) after
  PREAUTH seconds, and at most STREAMS + EXTRA_PENDING are pending at once, so a few silent ones delay no stream
  and more delay one by PREAUTH at most;
- the listener binds the fabric address only, on a port the kernel picks, and accepts only the peer's fabric
  address (rsync's `hosts allow` checks it again);
- the secret never touches a disk: each daemon reads it from a FIFO of its own (`--dparam=secretsfile=...`), which
  this helper writes once that daemon opens it; rsync 3.5 opens its config and secrets files by walking the path
  without following links, so `/proc/self/fd/N` of a memfd is refused (measured on the testbed's rsync 3.5.0). The
  config (no secret in it) and the FIFOs live in a 0700 directory that is removed at the end;
- confined whatever the daemon's rsync version (issue 31): no link ever crosses the daemon. rsync's own
  confinement of a daemon without a chroot (a chroot needs root, or a user namespace, which Ubuntu 24.04's AppArmor
  default denies capabilities in) is path sanitising, and through 3.4.1 its receiver followed a link planted by an
  earlier stream (`a -> .`, then `a/a/esc -> ../..` passes the depth check, then `-K` or `-R --no-implied-dirs`
  writes `esc/.ssh/authorized_keys` two levels above the module: measured with upstream 3.4.1; Debian's
  3.2.7-1+deb12u6 and 3.5.0 refuse the write but keep the escaping link). So the config refuses every option that
  makes or follows a link or writes outside a plain file's own temp-and-rename (`REFUSED`), munges any link that
  might still arrive (`/rsyncd-munged/` must not exist: checked), and the links of a Hugging Face tree are made by
  the reconciler itself from the verified manifest (`links_helper`). Needs rsync >= 3.1.0 (`--dparam`).

It prints `port N` once listening, `daemon EXIT` for each daemon that ended, and exits 0 when STREAMS daemons
ended with 0; 2 on bad arguments, 3 when the lifeline closed or LIFETIME passed first, 5 when this node's rsync
cannot be confined (too old, or `/rsyncd-munged` exists). A stranger at the door, and a connection from the peer
that did not authenticate within PREAUTH seconds, are refused and counted on stderr.
"""

from __future__ import annotations

import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

MODULE = "models"
USER = "fabric"
GRACE = 2.0  # seconds between SIGTERM and SIGKILL at teardown
ACCEPT_WINDOW = 60.0  # seconds the listener waits for all its connections
PREAUTH = 10.0  # seconds a connection has to authenticate (its daemon to ask for the secret) before it is dropped
EXTRA_PENDING = 2  # connections pending authentication beyond STREAMS before the listener waits for one to end
POLL = 0.2  # seconds between looks at the lifeline, the deadline and the daemons, when nothing wakes it sooner
LOG_TAIL = 4000  # bytes of the daemons' log shown when one failed
MIN_VERSION = (3, 1, 0)  # `--dparam` (the secret's FIFO), `munge symlinks`, `refuse options` by long name
MUNGED = "/rsyncd-munged"  # where a munged link would point: it must not exist, or munged links could be followed
# What a client may not ask of the daemon: deleting; making, keeping or following links (`links`, `keep-dirlinks`,
# `no-implied-dirs`, `hard-links`); device and special files; writing into an existing file (`inplace`, `append`);
# directories it names beside the module (`backup-dir`, `temp-dir`, `*-dest`); owners. Each was a route out of the
# module on some version, or is a capability the weights never need. Our own client sends none of them.
REFUSED = ("delete remove-source-files links keep-dirlinks no-implied-dirs hard-links devices specials copy-devices "
           "inplace append backup backup-dir temp-dir link-dest copy-dest compare-dest owner group")


def config(root: str, peer: str, log_path: str) -> str:
    """The daemons' config: the secrets file is each daemon's own FIFO, given by `--dparam`."""
    return "\n".join([
        "use chroot = no", "munge symlinks = yes", "reverse lookup = no", "numeric ids = no",
        # as whoever started it (the SSH user; rsync's default for a root daemon is to become `nobody`)
        *([f"uid = {os.getuid()}", f"gid = {os.getgid()}"] if os.getuid() == 0 else []),
        f"log file = {log_path}", "transfer logging = no",
        f"[{MODULE}]", f"path = {root}", "read only = no", "write only = yes", "list = no",
        f"hosts allow = {peer}", f"auth users = {USER}", "strict modes = yes",
        "timeout = 60", f"refuse options = {REFUSED}", ""])


def unconfinable() -> str | None:
    """Why this node's rsync daemon cannot be confined as `config` says, or None."""
    try:
        first = subprocess.run(["rsync", "--version"], capture_output=True, text=True, timeout=30,
                               check=False).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        return f"rsync --version failed: {exc}"
    words = first.split()
    found = words[words.index("version") + 1] if "version" in words[:-1] else ""
    parts = tuple(int(p) for p in found.split(".")[:3] if p.isdigit())
    if len(parts) < 2 or parts < MIN_VERSION:
        return (f"rsync {found or '(unknown version)'} is older than "
                f"{'.'.join(map(str, MIN_VERSION))}: use policy.weights.transport: ssh, or update rsync")
    if os.path.lexists(MUNGED):
        return f"{MUNGED} exists: a munged link could be followed through it; remove it, or use transport: ssh"
    return None


def hand_secret(fifo: str, line: bytes, asked: threading.Event | None = None) -> None:
    """Give the secret to the one daemon that opens `fifo` (the open waits for it), then close: it reads one line.
    The daemon opens it once its client answered the challenge (rsync's `auth_server` reads the answer, then the
    secrets file): `asked` is set then, and the connection holds a stream's slot from that moment (`serve`)."""
    try:
        fd = os.open(fifo, os.O_WRONLY)
        if asked is not None:
            asked.set()
        try:
            os.write(fd, line)
        finally:
            os.close(fd)
    except OSError:
        pass  # the daemon went away before it asked: its client fails the authentication


def main(argv: list[str]) -> int:
    try:
        bind, peer, streams, root, lifetime = argv[0], argv[1], int(argv[2]), argv[3], float(argv[4])
        socket.inet_aton(bind), socket.inet_aton(peer)
    except (IndexError, ValueError, OSError) as exc:
        print(f"usage: BIND PEER STREAMS ROOT LIFETIME ({exc})", file=sys.stderr)
        return 2
    refused = unconfinable()
    if refused:
        print(refused, file=sys.stderr)
        return 5
    secret = sys.stdin.buffer.readline(1024).strip()
    if not secret:
        print("no secret on stdin", file=sys.stderr)
        return 2
    line = USER.encode() + b":" + secret + b"\n"
    rundir = tempfile.mkdtemp(prefix="spark-reconciler-rsyncd-", dir=os.environ.get("XDG_RUNTIME_DIR") or None)
    log_path = os.path.join(rundir, "rsyncd.log")
    config_path = os.path.join(rundir, "rsyncd.conf")
    with open(config_path, "w") as f:
        f.write(config(root, peer, log_path))
    end = time.monotonic() + lifetime
    accept_end = time.monotonic() + min(lifetime, ACCEPT_WINDOW)
    children: list[subprocess.Popen[bytes]] = []
    stopping: list[str] = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append("SIGTERM"))
    signal.signal(signal.SIGHUP, lambda *_: stopping.append("SIGHUP"))
    woken = child_exits()
    # room in the queue for every connection that may be pending, and as many more: one that does not fit waits
    # for the kernel's retransmission (1 s, then 3 s) however soon a place frees up
    listener = socket.create_server((bind, 0), backlog=2 * (streams + EXTRA_PENDING))
    print(f"port {listener.getsockname()[1]}", flush=True)
    stdin = sys.stdin.fileno()
    status = None
    try:
        status = serve(listener, stdin, peer, streams, rundir, config_path, line, children, stopping, end,
                       accept_end, woken)
        return status
    finally:
        listener.close()
        end_all(children)
        if status and os.path.exists(log_path):
            with open(log_path, "rb") as f:
                sys.stderr.write(f.read()[-LOG_TAIL:].decode(errors="replace"))
        shutil.rmtree(rundir, ignore_errors=True)


def child_exits() -> int:
    """A descriptor that becomes readable when a daemon exits (SIGCHLD through `signal.set_wakeup_fd`), so the
    serve loop reaps it at once: the step waits for every daemon's `daemon 0` (`rsyncd.confirm`) before its
    `sync -f`, and a poll alone left up to POLL on every copy's path (measured ~0.13 s of a 2.7 s copy)."""
    r, w = os.pipe()
    for fd in (r, w):
        os.set_blocking(fd, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler (not SIG_DFL, which ignores): the wakeup fd fires
    signal.set_wakeup_fd(w, warn_on_full_buffer=False)
    return r


def serve(listener: socket.socket, stdin: int, peer: str, streams: int, rundir: str, config_path: str, line: bytes,
          children: list[subprocess.Popen[bytes]], stopping: list[str], end: float, accept_end: float,
          woken: int | None = None) -> int:
    """Serve connections from `peer`, one daemon each, until `streams` daemons ended well. Returns the exit status.

    Neither a stranger nor a failed daemon ends the step (issue 31): a connection from any other address (a local
    user on the target, the management LAN through Linux's weak host model) is closed and counted, and a daemon
    that ends badly (a wrong secret: whoever on the source connected first) frees its slot for the next
    connection. Only a connection whose daemon asked for the secret holds a slot (issue 53, finding L): one that
    stays silent, or stops before answering the challenge, is pending, and dropped after PREAUTH seconds
    (`drop_unauthenticated`). A real stream that fails makes its own client fail, which ends the step from the
    other side."""
    good = strangers = 0
    pending: dict[subprocess.Popen[bytes], tuple[float, threading.Event, str]] = {}
    while good < streams:
        if stopping:
            print(f"stopped by {stopping[0]}", file=sys.stderr)
            return 3
        now = time.monotonic()
        strangers = drop_unauthenticated(pending, now, peer, strangers)
        live = [c for c in children if c.returncode is None]
        asking = sum(1 for c in live if c in pending and not pending[c][1].is_set())
        late = time_up(now, end, accept_end, good + len(live) < streams)
        if late is not None:
            print(late, file=sys.stderr)
            return 3
        # while every slot has an authenticated daemon, or too many are pending, a connection waits in the backlog
        accepting = good + len(live) - asking < streams and asking < streams + EXTRA_PENDING
        ready = wait_ready(stdin, listener if accepting else None, woken)
        if stdin in ready and not os.read(stdin, 4096):
            good += reap(children)
            if good >= streams:
                break
            print("lifeline closed", file=sys.stderr)
            return 3
        if listener in ready:
            strangers = accept(listener, peer, strangers, children, pending, rundir, config_path, line)
        good += reap(children)
    return 0


def time_up(now: float, end: float, accept_end: float, short: bool) -> str | None:
    """Why serving stops now: the lifetime is over, or (`short` of streams) the time to connect them is; else None."""
    if now > end:
        return "lifetime over"
    if short and now > accept_end:
        return "not all streams connected in time"
    return None


def wait_ready(stdin: int, listener: socket.socket | None, woken: int | None) -> list[int | socket.socket]:
    """Wait up to POLL for the lifeline, the listener (None: not accepting now) or a daemon's exit (`woken`,
    drained here: whatever exited is reaped by the caller); returns what is ready."""
    watched: list[int | socket.socket] = [stdin] if listener is None else [stdin, listener]
    if woken is not None:
        watched.append(woken)
    ready, _, _ = select.select(watched, [], [], POLL)
    if woken is not None and woken in ready:
        try:
            os.read(woken, 4096)
        except BlockingIOError:
            pass
    return ready


def accept(listener: socket.socket, peer: str, strangers: int, children: list[subprocess.Popen[bytes]],
           pending: dict[subprocess.Popen[bytes], tuple[float, threading.Event, str]], rundir: str,
           config_path: str, line: bytes) -> int:
    """Take one connection: from `peer`, a daemon of its own (pending until it asks for the secret); from any
    other address, closed and counted. Returns the new count of refused connections."""
    conn, (addr, _port) = listener.accept()
    if addr != peer:
        conn.close()
        strangers += 1
        print(f"refused a connection from {addr} ({strangers} refused)", file=sys.stderr, flush=True)
        return strangers
    asked = threading.Event()
    children.append(start_daemon(conn, rundir, config_path, line, len(children), asked))
    pending[children[-1]] = (time.monotonic(), asked, os.path.join(rundir, f"secret-{len(children) - 1}"))
    return strangers


def drop_unauthenticated(pending: dict[subprocess.Popen[bytes], tuple[float, threading.Event, str]], now: float,
                         peer: str, refused: int) -> int:
    """End each daemon whose client did not answer its challenge within PREAUTH seconds (killed with its session;
    the thread that waits to hand it the secret let go), each refused and counted; returns the new count."""
    for child, (since, asked, fifo) in list(pending.items()):
        if child.returncode is not None or asked.is_set():
            del pending[child]
            continue
        if now - since <= PREAUTH:
            continue
        del pending[child]
        try:
            os.killpg(child.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        child.wait()  # not a stream: no `daemon EXIT` line for it
        try:  # the secret's writer waits for a reader: one that reads nothing lets it go
            os.close(os.open(fifo, os.O_RDONLY | os.O_NONBLOCK))
        except OSError:
            pass
        refused += 1
        print(f"refused a connection from {peer} (it did not authenticate within {PREAUTH:g} s; {refused} refused)",
              file=sys.stderr, flush=True)
    return refused


def start_daemon(conn: socket.socket, rundir: str, config_path: str, line: bytes,
                 index: int, asked: threading.Event | None = None) -> subprocess.Popen[bytes]:
    """An `rsync --daemon` serving `conn`, its secret handed through a FIFO of its own (`asked` set when it asks)."""
    fifo = os.path.join(rundir, f"secret-{index}")
    os.mkfifo(fifo, 0o600)
    threading.Thread(target=hand_secret, args=(fifo, line, asked), daemon=True).start()
    child = subprocess.Popen(["rsync", "--daemon", f"--config={config_path}", f"--dparam=secretsfile={fifo}"],
                             stdin=conn.fileno(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             start_new_session=True)
    conn.close()
    return child


def reap(children: list[subprocess.Popen[bytes]]) -> int:
    """The daemons that ended well since the last look; each that ended is reported as `daemon EXIT`."""
    good = 0
    for child in children:
        if child.returncode is None and child.poll() is not None:
            good += child.returncode == 0
            print(f"daemon {child.returncode}", flush=True)
    return good


def end_all(children: list[subprocess.Popen[bytes]]) -> None:
    """SIGTERM each daemon's whole session (rsync's receiver forks a generator), SIGKILL after GRACE."""
    live = [c for c in children if c.poll() is None]
    for child in live:
        try:
            os.killpg(child.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + GRACE
    for child in live:
        try:
            child.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for child in children:
        try:
            os.killpg(child.pid, signal.SIGKILL)  # also whatever of the session outlived its leader
        except ProcessLookupError:
            pass
        child.wait()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
