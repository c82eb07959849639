"""SSH to the nodes: the only module that talks SSH, and the only place that quotes remote commands.

One persistent fabric/paramiko session per node, reused across cycles and reopened when it drops; nodes with a
jump host are reached through that node's session (a direct-tcpip channel, like `ssh -J`). Host keys are checked
strictly against the known_hosts file the desired state names: an unknown or changed key is refused with a clear
error, never accepted. Every command is an argv of already-validated values, quoted here with `shlex.quote`, so a
value reaches the node as exactly one argument. Root is used only through `sudo -n` for the node's exact commands
(sudo_commands), which is what `reconciler sudoers FILE` prints; anything else is refused before it leaves the
head.
"""

from __future__ import annotations

import contextlib
import select
import shlex
import socket
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import fabric
import paramiko
from paramiko.ssh_exception import AuthenticationException, BadHostKeyException, SSHException

from reconciler.core.spec import Desired, Node


def sudo_commands(desired: Desired, node: Node) -> list[tuple[str, ...]]:
    """Every command this node may be sent as root, exactly (argv, no patterns): the one source of both
    `reconciler sudoers FILE` and the check each `sudo` command passes before it leaves the head. A wildcard
    line (`ip link set dev *`) would let whoever holds the key take down the management port or route traffic."""
    out: list[tuple[str, ...]] = [argv for p in node.fabric.ports()  # the port and its twin
                                  for argv in (("/usr/sbin/ip", "link", "set", "dev", p.interface, "up"),
                                               ("/usr/sbin/ip", "link", "set", "dev", p.interface, "mtu",
                                                str(node.fabric.mtu)),
                                               ("/usr/sbin/ip", "addr", "add", str(p.address), "dev", p.interface))]
    if desired.policy.drop_caches:
        out.append(("/usr/sbin/sysctl", "-w", "vm.drop_caches=3"))
    return out


#: SSH keepalive every KEEPALIVE seconds; a peer that answers none of KEEPALIVE_MISSES in a row is dead (the same
#: numbers go to the ssh of rsync's hop as ServerAliveInterval/ServerAliveCountMax).
KEEPALIVE = 15
KEEPALIVE_MISSES = 3
#: Channels open at once per node, below OpenSSH's default MaxSessions (10): an eleventh waits for a free one
#: instead of being refused by sshd (which paramiko reports as a ChannelException).
MAX_CHANNELS = 9
REFUSAL_RETRIES = 3  # see Session._open
REFUSAL_GAP = 0.25  # seconds between those retries
#: What the node gets on top of a command's deadline to exit after `timeout` sent TERM, before KILL.
KILL_AFTER = 2
#: Output kept from one command: a probe of a huge or hostile node must not eat the daemon's memory. Streaming
#: callers (rsync progress) keep the tail.
MAX_OUTPUT = 32 * 2**20


def bounded(argv: Sequence[str], seconds: float) -> list[str]:
    """argv under coreutils `timeout` on the node: a command the head gave up on does not live on there (closing
    an SSH channel does not stop a process that never writes: a curl to a hung dockerd, a wedged `docker`).
    `timeout` runs it in its own process group and signals the whole group."""
    return ["timeout", "-k", str(KILL_AFTER), str(max(1, int(seconds + 0.999))), *argv]


def sudo_allowed(argv: Sequence[str], allowed: Sequence[tuple[str, ...]]) -> bool:
    """True when argv is exactly one of the node's allowed commands (sudo_commands)."""
    return tuple(str(a) for a in argv) in allowed


class RemoteError(Exception):
    """Something went wrong talking to a node; `node` says which."""

    transient = False

    def __init__(self, node: str, message: str):
        super().__init__(f"{node}: {message}")
        self.node = node
        self.message = message


class Unreachable(RemoteError):
    transient = True


class AuthFailed(RemoteError):
    pass


class HostKeyRejected(RemoteError):
    """Unknown or changed host key: a possible man in the middle, never retried automatically."""

    def __init__(self, node: str, message: str):
        # the kind leads the message: it is what /status, the Reachable condition and the alert show
        super().__init__(node, f"HostKeyRejected: {message}")


class CommandTimeout(RemoteError):
    transient = True


class Cancelled(RemoteError):
    """The caller asked the command to stop (shutdown); the channel was closed."""


class ChannelRefused(RemoteError):
    """sshd refused one more channel (MaxSessions, a jump host's policy): that command fails, the others on the
    connection go on."""

    transient = True


class OutputTooLarge(RemoteError):
    pass


class CommandFailed(RemoteError):
    def __init__(self, node: str, argv: Sequence[str], exit_code: int, stdout: str, stderr: str):
        detail = (stderr.strip() or stdout.strip())[-2000:]
        super().__init__(node, f"`{shlex.join(argv)}` exited {exit_code}: {detail}")
        self.argv, self.exit_code, self.stdout, self.stderr = list(argv), exit_code, stdout, stderr


@dataclass(frozen=True)
class Result:
    stdout: str
    stderr: str
    exit_code: int

    @property
    def ok(self) -> bool:
        return self.exit_code == 0


def quote(argv: Sequence[str]) -> str:
    """The one quoting function: argv -> a POSIX shell command line where each element stays one word."""
    return " ".join(shlex.quote(str(a)) for a in argv)


def quote_word(value: str) -> str:
    """One value as one shell word (a path, a pattern, a URL inside a script line): `quote` of a one-word argv."""
    return quote([value])


def sudoers_snippet(desired: Desired) -> str:
    """The exact sudoers lines each node needs, for this desired state: per interface and value, nothing wider."""
    out = ["# /etc/sudoers.d/spark-reconciler — install with: visudo -f /etc/sudoers.d/spark-reconciler",
           "# Exactly the commands spark-reconciler runs as root on each node (reconciler.edge.ssh.sudo_commands);",
           "# the reconciler refuses to send any other. Regenerate after changing a fabric section.", ""]
    for node in desired.nodes:
        out.append(f"# on {node.name}")
        out.append(f"{node.ssh.user} ALL=(root) NOPASSWD: " + ", ".join(" ".join(c) for c in sudo_commands(desired,
                                                                                                       node)))
    return "\n".join(out) + "\n"


def sudo_argv(argv: Sequence[str], allowed: Sequence[tuple[str, ...]]) -> list[str]:
    """`sudo -n ARGV` for an allowed command; anything else raises before it is sent."""
    if not sudo_allowed(argv, allowed):
        raise PermissionError(f"refusing to run {shlex.join(argv)!r} with sudo: not one of the node's exact "
                              "commands (reconciler sudoers FILE)")
    return ["sudo", "-n", *argv]


class Session:
    """A persistent SSH session to one node (through its jump host's session when it has one)."""

    def __init__(self, node: Node, gateway: Session | None = None, sudo: Sequence[tuple[str, ...]] = ()):
        self.node = node
        self.gateway = gateway
        self.sudo = tuple(sudo)  # the exact commands this node may be sent as root (sudo_commands)
        self._conn: fabric.Connection | None = None
        self._lock = threading.Lock()
        self._channels = threading.BoundedSemaphore(MAX_CHANNELS)

    # -- connection -------------------------------------------------------------------------------------------

    def _new_connection(self) -> fabric.Connection:
        ssh = self.node.ssh
        config = fabric.Config(ssh_config=paramiko.SSHConfig(), overrides={"load_ssh_configs": False})
        kwargs: dict[str, object] = {"allow_agent": ssh.identity_file is None,
                                     "look_for_keys": ssh.identity_file is None,
                                     "banner_timeout": ssh.connect_timeout, "auth_timeout": ssh.connect_timeout}
        if ssh.identity_file:
            kwargs["key_filename"] = [ssh.identity_file]
        if self.gateway is None:
            kwargs["sock"] = _tcp(ssh.host, ssh.port, ssh.connect_timeout)
        else:
            kwargs["sock"] = self._through_gateway(ssh.host, ssh.port, ssh.connect_timeout)
        conn = fabric.Connection(ssh.host, user=ssh.user, port=ssh.port, config=config, connect_kwargs=kwargs,
                                 connect_timeout=max(1, int(ssh.connect_timeout)))
        # fabric's default policy would add unknown keys; the product never trusts on first use.
        conn.client = paramiko.SSHClient()
        try:
            conn.client.load_host_keys(ssh.known_hosts)
        except OSError as exc:
            raise HostKeyRejected(self.node.name,
                                  f"cannot read known_hosts {ssh.known_hosts}: {exc.strerror}") from None
        conn.client.set_missing_host_key_policy(paramiko.RejectPolicy())
        return conn

    def _through_gateway(self, host: str, port: int, timeout: float) -> paramiko.Channel:
        """A direct-tcpip channel through the jump host's session (`ssh -J`), opened under the connect timeout:
        fabric's own gateway support opens it with paramiko's default, which waits up to an hour."""
        assert self.gateway is not None
        try:
            transport = self.gateway.connection().transport
            return transport.open_channel("direct-tcpip", (host, port), ("", 0), timeout=timeout)
        except RemoteError as exc:
            raise Unreachable(self.node.name, f"jump host {exc}") from None
        except (SSHException, OSError, EOFError) as exc:
            raise Unreachable(self.node.name, f"jump host {self.gateway.node.name} could not open a channel to "
                                              f"{host}:{port}: {exc}") from None

    def connection(self) -> fabric.Connection:
        """The open connection, (re)connecting when needed. Errors become typed RemoteErrors."""
        with self._lock:
            if self._conn is not None and self._conn.is_connected and self._conn.transport.is_active():
                return self._conn
            self._close_locked()
            name, ssh = self.node.name, self.node.ssh
            where = f"{ssh.user}@{ssh.host}:{ssh.port}" + (f" via {self.gateway.node.name}" if self.gateway else "")
            try:
                conn = self._new_connection()
                conn.open()
            except BadHostKeyException as exc:
                raise HostKeyRejected(name, f"host key for {ssh.host} CHANGED (got {exc.key.get_name()} "
                                            f"{exc.key.get_base64()[:16]}..., known_hosts {ssh.known_hosts} has "
                                            f"another): refusing to connect; verify the node, then update "
                                            f"known_hosts") from None
            except AuthenticationException as exc:
                raise AuthFailed(name, f"authentication failed for {where}: {exc}") from None
            except SSHException as exc:
                if "not found in known_hosts" in str(exc):
                    raise HostKeyRejected(name, f"host {ssh.host} is not in {ssh.known_hosts}: refusing to trust "
                                                f"it on first use; add its key (docs/operations.md)") from None
                raise Unreachable(name, f"SSH to {where} failed: {exc}") from None
            except RemoteError:
                raise
            except (TimeoutError, OSError, EOFError) as exc:
                raise Unreachable(name, f"cannot reach {where}: {exc}") from None
            conn.transport.set_keepalive(KEEPALIVE)
            self._conn = conn
            return conn

    def _close_locked(self) -> None:
        if self._conn is not None:
            _close_quietly(self._conn)
            self._conn = None

    def close(self) -> None:
        """Close the session; never waits long behind a (re)connect that holds the lock."""
        if self._lock.acquire(timeout=1.0):
            try:
                self._close_locked()
            finally:
                self._lock.release()
        elif self._conn is not None:
            _close_quietly(self._conn)

    # -- commands ---------------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def channel(self, command: str, timeout: float) -> Iterator[paramiko.Channel]:
        """One exec channel, closed on exit. At most MAX_CHANNELS are open per node (a further one waits for a
        free one); waiting for a free one and opening it share the one `timeout`. A channel sshd refuses fails
        this command only, not the connection."""
        deadline = time.monotonic() + timeout
        if not self._channels.acquire(timeout=timeout):
            raise ChannelRefused(self.node.name, f"no free channel within {timeout:g}s "
                                                 f"({MAX_CHANNELS} in use): `{command[:80]}`")
        try:
            channel = self._open(command, max(deadline - time.monotonic(), 0.1))
            try:
                yield channel
            finally:
                channel.close()
        finally:
            self._channels.release()

    def _open(self, command: str, timeout: float) -> paramiko.Channel:
        """Open an exec channel within `timeout`. sshd frees a session's MaxSessions slot a moment after the
        channel's close, so a channel opened right after another closed can be refused although fewer than
        MAX_CHANNELS are open: a refusal is retried briefly (REFUSAL_RETRIES, REFUSAL_GAP apart), but only inside
        the one deadline: a node that does not answer at all (a cut cable, whose transport still looks alive)
        must not hold the caller for several timeouts."""
        deadline = time.monotonic() + timeout
        for attempt in range(REFUSAL_RETRIES + 1):
            transport = self.connection().transport
            try:
                channel = transport.open_session(timeout=max(deadline - time.monotonic(), 0.1))
                channel.exec_command(command)
                return channel
            except (SSHException, OSError, EOFError) as exc:
                # A refusal (sshd's MaxSessions) is a ChannelException only for the thread that reads it first:
                # paramiko keeps one saved exception per transport, so concurrent openers see a bare
                # SSHException("Unable to open channel."). What tells a refusal from a lost connection is whether
                # the transport still lives (measured against the testbed's sshd, tests/e2e/test_remote_deadlines).
                if not (isinstance(exc, paramiko.ChannelException) or self._alive()):
                    self.close()
                    raise Unreachable(self.node.name, f"session lost: {exc}") from None
                if attempt == REFUSAL_RETRIES or deadline - time.monotonic() < REFUSAL_GAP:
                    raise ChannelRefused(self.node.name, f"sshd refused a channel ({exc}): `{command[:80]}`") from None
                time.sleep(REFUSAL_GAP)
        raise AssertionError("unreachable")

    def _close_if_dead(self) -> None:
        """After a channel error: drop the connection only when it is really gone (sibling channels, e.g. the
        other rsync streams, live on a healthy one)."""
        if not self._alive():
            self.close()

    def stream_lines(self, command: str, stop, idle: float = 1.0):
        """Yield stdout lines of a long-running command (an event stream) until `stop` is set or the channel
        ends; a dropped session raises Unreachable so the caller can reconnect with backoff."""
        with self.channel(command, timeout=10) as channel:
            yield from self._lines(channel, stop, idle)
        if not stop.is_set():
            raise Unreachable(self.node.name, "event stream ended")

    def _lines(self, channel: paramiko.Channel, stop, idle: float):
        buffer = b""
        try:
            while not stop.is_set():
                if channel.recv_ready():
                    chunk = channel.recv(1 << 16)
                    if not chunk:
                        break
                    buffer += chunk
                    *lines, buffer = buffer.split(b"\n")
                    for line in lines:
                        yield line.decode(errors="replace")
                    continue
                if channel.exit_status_ready() or channel.closed or not self._alive():
                    break
                select.select([channel], [], [], idle)
        except (SSHException, OSError, EOFError) as exc:
            self._close_if_dead()
            raise Unreachable(self.node.name, f"event stream lost: {exc}") from None

    def _alive(self) -> bool:
        conn = self._conn
        return conn is not None and conn.transport is not None and conn.transport.is_active()

    def run(self, argv: Sequence[str], *, timeout: float, sudo: bool = False, stdin: bytes | None = None,
            check: bool = True, on_output=None, cancel=None, supervised: bool = False) -> Result:
        """Run one argv on the node; raise CommandFailed on a non-zero exit when `check`.

        `on_output(bytes)` sees stdout as it arrives (rsync progress); `cancel` (a threading.Event) closes the
        channel. Without a pty, closing the channel does not stop a remote process that rarely writes; with
        `supervised` (long commands: rsync) it is sent SIGTERM as soon as the channel closes, so it stops and
        cleans up (rsync then keeps its partial data for the resume). A supervised command's stdin is at most
        one line (`stdin`: rsync's `--password-file=-`).
        Every command is bounded on the node too (`bounded`): the node ends it at `timeout`, the head waits a
        little longer for that answer."""
        argv = sudo_argv(argv, self.sudo) if sudo else list(argv)
        command = quote(bounded(argv, timeout))
        if supervised:
            if stdin is not None and (stdin.count(b"\n") != 1 or not stdin.endswith(b"\n")):
                raise ValueError("a supervised command reads one line at most (the rest of its stdin is the watch "
                                 "on the channel)")
            # fd 3 keeps the channel's stdin: a background job's own stdin is /dev/null in a non-interactive sh.
            # The one line (a secret) is read by sh's builtin `read` and handed on by its builtin `printf`: in no
            # process's argv or environment, on no disk.
            feed = 'IFS= read -r line <&3; printf "%s\\n" "$line" | ' if stdin is not None else ""
            command = quote(["sh", "-c", f"exec 3<&0; {feed}{command} 3<&- & pid=$!; "
                                         "(cat <&3 >/dev/null 2>&1; kill -TERM $pid 2>/dev/null) >/dev/null 2>&1 & "
                                         "w=$!; exec 3<&-; wait $pid; rc=$?; kill $w 2>/dev/null; exit $rc"])
        start = time.monotonic()
        result = self.run_command(command, timeout=timeout + KILL_AFTER + 1, stdin=stdin, on_output=on_output,
                                  cancel=cancel, keep_stdin=supervised)
        if result.exit_code in (124, 137) and time.monotonic() - start >= timeout - 0.5:
            raise CommandTimeout(self.node.name, f"`{shlex.join(argv)[:200]}` did not finish within {timeout:g}s "
                                                 "(ended on the node)")
        if check and not result.ok:
            raise CommandFailed(self.node.name, argv, result.exit_code, result.stdout, result.stderr)
        return result

    @contextlib.contextmanager
    def companion(self, argv: Sequence[str], *, timeout: float, stdin: bytes,
                  open_timeout: float) -> Iterator[Companion]:
        """A command that serves the caller's work on another node (the fabric rsync daemon): it gets `stdin`,
        then its stdin stays open as its lifeline, and leaving the block closes it (and the channel), which is
        its signal to end. Bounded on the node at `timeout`, like `run`."""
        with self.channel(quote(bounded(argv, timeout)), open_timeout) as channel:
            try:
                channel.sendall(stdin)
            except (SSHException, OSError, EOFError) as exc:
                self._close_if_dead()
                raise Unreachable(self.node.name, f"session lost starting `{argv[0]}`: {exc}") from None
            yield Companion(self, channel, argv[0])

    def run_script(self, script: str, *, timeout: float, cancel: threading.Event | None = None) -> Result:
        """Feed a POSIX sh script on stdin: one round trip, no temp files, nothing left on the node; bounded on
        the node like `run`."""
        return self.run_command(quote(bounded(["sh", "-s"], timeout)), timeout=timeout + KILL_AFTER + 1,
                                stdin=script.encode(), cancel=cancel)

    def run_command(self, command: str, *, timeout: float, stdin: bytes | None = None, on_output=None,
                    cancel=None, keep_stdin: bool = False) -> Result:
        deadline = time.monotonic() + timeout
        out, err = bytearray(), bytearray()
        with self.channel(command, timeout) as channel:
            try:
                if stdin is not None:
                    channel.sendall(stdin)
                if not keep_stdin:
                    channel.shutdown_write()
                while True:
                    if cancel is not None and cancel.is_set():
                        raise Cancelled(self.node.name, f"`{command[:80]}` cancelled")
                    if channel.recv_ready():
                        chunk = channel.recv(1 << 16)
                        if on_output is not None:
                            on_output(chunk)
                        self._keep(out, chunk, command, streaming=on_output is not None)
                        continue
                    if channel.recv_stderr_ready():
                        self._keep(err, channel.recv_stderr(1 << 16), command, streaming=True)
                        continue
                    if (channel.exit_status_ready() and channel.eof_received) or channel.closed:
                        break
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        raise CommandTimeout(self.node.name, f"`{command[:200]}` did not finish within {timeout:g}s")
                    select.select([channel], [], [], min(remaining, 1.0))
                code = channel.recv_exit_status() if channel.exit_status_ready() else -1
            except (SSHException, OSError, EOFError) as exc:
                self._close_if_dead()
                raise Unreachable(self.node.name, f"session lost during `{command[:80]}`: {exc}") from None
        return Result(out.decode(errors="replace"), err.decode(errors="replace"), code)

    def _keep(self, buffer: bytearray, chunk: bytes, command: str, *, streaming: bool) -> None:
        """Append up to MAX_OUTPUT: a streamed output keeps its tail, anything else over the cap is an error."""
        buffer += chunk
        if len(buffer) > MAX_OUTPUT:
            if not streaming:
                raise OutputTooLarge(self.node.name, f"`{command[:80]}` wrote more than {MAX_OUTPUT} bytes")
            del buffer[: len(buffer) - MAX_OUTPUT]


class Companion:
    """The running command of `Session.companion`: its stdout read line by line, then its end."""

    def __init__(self, session: Session, channel: paramiko.Channel, name: str):
        self._session, self._channel, self._name = session, channel, name
        self._out, self._err = bytearray(), bytearray()

    def line(self, timeout: float) -> str | None:
        """The next line of its stdout, or None when it ended without one; CommandTimeout after `timeout`."""
        deadline = time.monotonic() + timeout
        while b"\n" not in self._out:
            if not self._read(deadline) and b"\n" not in self._out:
                return None
        line, _, rest = bytes(self._out).partition(b"\n")
        self._out[:] = rest
        return line.decode(errors="replace")

    def finish(self, timeout: float) -> Result:
        """Wait up to `timeout` for it to end by itself, then close its stdin (its signal to end) and wait as long
        again: its exit code (-1: still running) and what it wrote since the last `line`."""
        deadline = time.monotonic() + timeout
        try:
            while self._read(deadline):
                pass
        except CommandTimeout:
            with contextlib.suppress(SSHException, OSError, EOFError):
                self._channel.shutdown_write()
            deadline = time.monotonic() + timeout
            with contextlib.suppress(CommandTimeout):
                while self._read(deadline):
                    pass
        code = self._channel.recv_exit_status() if self._channel.exit_status_ready() else -1
        return Result(self._out.decode(errors="replace"), self._err.decode(errors="replace"), code)

    def _read(self, deadline: float) -> bool:
        """Read what arrived; False once the command ended and all its output is in."""
        node = self._session.node.name
        channel = self._channel
        try:
            while True:
                if channel.recv_ready():
                    self._session._keep(self._out, channel.recv(1 << 16), self._name, streaming=False)
                    return True
                if channel.recv_stderr_ready():
                    self._session._keep(self._err, channel.recv_stderr(1 << 16), self._name, streaming=True)
                    continue
                if (channel.exit_status_ready() and channel.eof_received) or channel.closed:
                    return False
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise CommandTimeout(node, f"`{self._name}` said nothing within the deadline")
                select.select([channel], [], [], min(remaining, 1.0))
        except (SSHException, OSError, EOFError) as exc:
            self._session._close_if_dead()
            raise Unreachable(node, f"session lost during `{self._name}`: {exc}") from None


def _tcp(host: str, port: int, timeout: float) -> socket.socket:
    """The TCP connection to a node's sshd. TCP_NODELAY: without it every exec on the open session costs ~40 ms
    of Nagle/delayed-ACK (measured on the testbed: 44 ms -> 2 ms per exec). TCP_USER_TIMEOUT and TCP keepalive:
    a peer that vanished (power, cable) fails the connection within about a minute, where the kernel's
    defaults would retransmit for ~15 minutes and keep every channel on it hanging."""
    sock = socket.create_connection((host, port), timeout=timeout)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, KEEPALIVE)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, KEEPALIVE)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, KEEPALIVE_MISSES)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, 1000 * KEEPALIVE * (KEEPALIVE_MISSES + 1))
    return sock


def _close_quietly(conn: fabric.Connection) -> None:
    """Closing a dead connection may fail in many ways; none of them matters to someone who is leaving it."""
    with contextlib.suppress(Exception):
        conn.close()


class Sessions:
    """The pool: one Session per node of the desired state, jump hosts wired to their gateway's session."""

    def __init__(self, desired: Desired):
        self._sessions: dict[str, Session] = {}
        self.update(desired)

    def update(self, desired: Desired) -> None:
        """Keep sessions whose SSH settings did not change; rebuild the others (level-triggered config)."""
        old = self._sessions
        self._sessions = {}
        for node in self._in_jump_order(desired):
            gateway = self._sessions.get(node.ssh.jump) if node.ssh.jump else None
            kept, sudo = old.get(node.name), tuple(sudo_commands(desired, node))
            if kept and kept.node == node and kept.gateway is gateway:
                kept.sudo = sudo  # policy.drop_caches may have changed
                self._sessions[node.name] = kept
            else:
                self._sessions[node.name] = Session(node, gateway, sudo)
        for name, session in old.items():
            if self._sessions.get(name) is not session:
                session.close()

    @staticmethod
    def _in_jump_order(desired: Desired) -> list[Node]:
        done: list[Node] = []
        pending = list(desired.nodes)
        while pending:
            ready = [n for n in pending if n.ssh.jump is None or n.ssh.jump in {d.name for d in done}]
            done += ready
            pending = [n for n in pending if n not in ready]
        return done

    def __getitem__(self, name: str) -> Session:
        return self._sessions[name]

    def close(self) -> None:
        for session in self._sessions.values():
            session.close()
