"""One persistent SSH session per node: connecting with the host-key policy, channels under deadlines, and the
pool of sessions for a desired state.

The session is paramiko's, used directly. fabric was the first choice, but everything it adds is what this module
must do differently: its client trusts unknown host keys by default (replaced), its gateway opens the jump channel
with paramiko's hour-long default (replaced), and its `run` has no cancel, no output cap, no channel budget and no
deadline on the node. What was left of it was a wrapper around a paramiko client built here, so the wrapper went
(docs/architecture.md, "SSH").

Nodes with a jump host are reached through that node's session (a direct-tcpip channel, like `ssh -J`). Host keys
are checked strictly against the known_hosts file the desired state names: an unknown or changed key is refused with
a clear error, never accepted. A channel's output is read by one loop (`_ChannelOutput`), for a whole command and
for a companion's lines alike.

Every wait on a node has a deadline, and a peer that stops answering is found and dropped (issue 31: a channel
accepted but never answered held every node's reconcile, and the watchdog's restart wedged again). paramiko 5.1
leaves three waits without one, read in its source: `Channel.exec_command` waits for the answer to its "exec"
request on `Channel._wait_for_event`, an `Event.wait()` with no timeout (paramiko#2599, #319); `Transport.
global_request(wait=True)` polls while the transport is active, with no timeout either (#989); and
`Transport.set_keepalive` sends `keepalive@lag.net` with want-reply false, which the peer ignores, and counts
nothing (no ServerAliveCountMax: #918, #2463), so it never finds a peer dead. `open_session`/`open_channel` take a
timeout (an hour by default), reads here poll under their deadline, and a channel's `settimeout` bounds each wait
for the peer's window in `send`. So: the open gets the command's deadline, the exec request gets what remains of it
(`_Expiry` closes the channel, which wakes paramiko's wait), stdin gets it too (`_send_by`), and `_keep_alive` asks
the peer for an answer as OpenSSH's ServerAliveInterval does and closes the connection when none comes.
"""

from __future__ import annotations

import contextlib
import select
import shlex
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import paramiko
from paramiko.ssh_exception import AuthenticationException, BadHostKeyException, SSHException

from reconciler.core.spec import Desired, Node, Ssh
from reconciler.edge.ssh.commands import ENDED_BY_TIMEOUT, KILL_AFTER, bounded, quote, sudo_argv, sudo_commands
from reconciler.edge.ssh.errors import (
    AuthFailed,
    Cancelled,
    ChannelRefused,
    CommandFailed,
    CommandTimeout,
    HostKeyRejected,
    OutputTooLarge,
    RemoteError,
    Unreachable,
)

#: SSH keepalive every KEEPALIVE seconds, one that asks for an answer (`_keep_alive`); a peer that answers none
#: within KEEPALIVE * KEEPALIVE_MISSES is dead and its connection closed (the same numbers go to the ssh of rsync's
#: hop as ServerAliveInterval/ServerAliveCountMax).
KEEPALIVE = 15
KEEPALIVE_MISSES = 3
#: Channels open at once per node, below OpenSSH's default MaxSessions (10): an eleventh waits for a free one
#: instead of being refused by sshd (which paramiko reports as a ChannelException).
MAX_CHANNELS = 9
REFUSAL_RETRIES = 3  # see Session._open
REFUSAL_GAP = 0.25  # seconds between those retries
#: Output kept from one command: a probe of a huge or hostile node must not eat the daemon's memory. Streaming
#: callers (rsync progress) keep the tail.
MAX_OUTPUT = 32 * 2**20
# Lines of a whole (not streamed) output. Parsing costs per line, not per byte: each is a Python str (~50 bytes
# before its text) in `splitlines` and the section lists, so 32 MiB of bare newlines, under MAX_OUTPUT, made the
# daemon peak at 628 MiB, above its unit's MemoryMax=512M (issue 31). The largest honest output, a model tree's
# manifest at its cap (`manifest.MAX_ENTRIES`) beside the blob store's, is ~200,000 lines.
MAX_LINES = 1_000_000
_SSH_ERRORS = (SSHException, OSError, EOFError)
#: What OpenSSH's ServerAliveInterval sends. sshd refuses it (an unknown global request), and a refusal is an answer.
KEEPALIVE_REQUEST = "keepalive@openssh.com"


def answer_deadline(timeout: float) -> float:
    """How long the head waits for the answer to a command bounded on the node at `timeout` (`bounded`): the node's
    deadline, its kill grace, and a second for the answer to travel."""
    return timeout + KILL_AFTER + 1


def node_deadline(desired: Desired, node: Node, timeout: float) -> float:
    """Seconds a caller waits for one node's whole answer to a script bounded at `timeout` (the probe, doctor): the
    wait for the answer (`answer_deadline`) and the longest (re)connection the node's session allows itself. Every
    wait inside the session has a deadline already; this one keeps the other nodes' answers from depending on all
    of them holding."""
    return answer_deadline(timeout) + _connection_deadline(desired, node)


def _connection_deadline(desired: Desired, node: Node) -> float:
    """`connect_timeout` for the path to each of the node's addresses and for the banner, the key exchange and the
    login (`Session._connect` gives each that much), plus, through a jump host, that host's own connection."""
    ssh = node.ssh
    own = ssh.connect_timeout * (1 + len(ssh.fallback_hosts) + 3)
    return own + (_connection_deadline(desired, desired.node(ssh.jump)) if ssh.jump else 0.0)


@dataclass(frozen=True)
class Result:
    stdout: str
    stderr: str
    exit_code: int

    @property
    def ok(self) -> bool:
        return self.exit_code == 0


class Session:
    """A persistent SSH session to one node (through its jump host's session when it has one). It needs the node's
    name (every error names it) and its `ssh` settings, nothing else of the node: discover opens sessions to hosts
    that are not in any desired state yet."""

    def __init__(self, name: str, ssh: Ssh, gateway: Session | None = None, sudo: Sequence[tuple[str, ...]] = (),
                 address: str | None = None):
        self.name = name
        self.ssh = ssh
        self.gateway = gateway
        self.sudo = tuple(sudo)  # the exact commands this node may be sent as root (sudo_commands)
        #: The one address the path goes to instead of `host` and its fallbacks (`over`); None: the node's own path.
        self.address = address
        self._over: dict[str, Session] = {}
        self._client: paramiko.SSHClient | None = None
        self._lock = threading.Lock()
        self._channels = threading.BoundedSemaphore(MAX_CHANNELS)
        self._dropped: str | None = None  # why the keepalive closed the connection, for the errors that follow
        #: The SSH keepalive's interval and the answers missed in a row that close the connection (`_keep_alive`).
        self.keepalive = (KEEPALIVE, KEEPALIVE_MISSES)
        self._bulk: Session | None = None

    def bulk(self) -> Session:
        """A second connection to the same node for long transfers (the weights' rsync streams, each holding a
        channel for hours), with a channel budget of its own: a sync of 2 x `parallel_streams` runs once took
        every channel of the node's one connection, and the probe and the lease renewals starved, or the rsync
        daemon's accept window ended every stream (issue 31). Made on first use, closed with this one."""
        with self._lock:
            if self._bulk is None:
                self._bulk = Session(self.name, self.ssh, self.gateway, self.sudo, self.address)
            return self._bulk

    def over(self, address: str) -> Session:
        """A second connection to the same node whose path goes to `address` only (another of its addresses: the
        link step changes a fabric port's MTU over the node's other port, never over a session that arrives on
        the port it changes). Nothing else differs: the handshake still names `host`, so the host key is checked
        under the node's own known_hosts entry (no new trust), the user, key and exact sudo commands are the
        node's. Made on first use, closed with this one."""
        with self._lock:
            session = self._over.get(address)
            if session is None:
                session = self._over[address] = Session(self.name, self.ssh, self.gateway, self.sudo, address)
            session.sudo = self.sudo  # the node's commands as they are now (Sessions.update)
            return session

    # -- connection -------------------------------------------------------------------------------------------

    def _connect(self) -> paramiko.SSHClient:
        """A connected client: the TCP path first (a node that is not there is Unreachable, retried), then the
        host-key policy. paramiko's default would reject unknown keys too, but only RejectPolicy says so outright:
        the product never trusts on first use."""
        ssh = self.ssh
        sock = self._path()
        client = paramiko.SSHClient()
        try:
            client.load_host_keys(ssh.known_hosts)
        except OSError as exc:
            sock.close()
            raise HostKeyRejected(self.name,
                                  f"cannot read known_hosts {ssh.known_hosts}: {exc.strerror}") from None
        client.set_missing_host_key_policy(paramiko.RejectPolicy())
        client.connect(ssh.host, port=ssh.port, username=ssh.user, sock=sock, key_filename=ssh.identity_file,
                       allow_agent=ssh.identity_file is None, look_for_keys=ssh.identity_file is None,
                       timeout=ssh.connect_timeout, banner_timeout=ssh.connect_timeout,
                       auth_timeout=ssh.connect_timeout)
        return client

    def _path(self) -> socket.socket | paramiko.Channel:
        """The byte path to the node: to `host`, else to each of `fallback_hosts` in turn (the worker reached over
        its fabric while one half of the port is down); to `address` alone for a session `over` another address.
        The SSH handshake that follows names `host` whatever the path, so its known_hosts entry vouches for the
        node on every address (OpenSSH's HostKeyAlias)."""
        ssh = self.ssh
        if self.address is not None:
            return self._open_path(self.address)
        if not ssh.fallback_hosts:
            return self._open_path(ssh.host)
        failed = []
        for host in (ssh.host, *ssh.fallback_hosts):
            try:
                return self._open_path(host)
            except Unreachable as exc:
                failed.append(exc.message)
            except (TimeoutError, OSError) as exc:
                failed.append(f"{host}:{ssh.port}: {exc}")
        raise Unreachable(self.name, "no address answered: " + "; ".join(failed))

    def _open_path(self, host: str) -> socket.socket | paramiko.Channel:
        ssh = self.ssh
        return (_tcp(host, ssh.port, ssh.connect_timeout) if self.gateway is None
                else self._through_gateway(host, ssh.port, ssh.connect_timeout))

    def _through_gateway(self, host: str, port: int, timeout: float) -> paramiko.Channel:
        """A direct-tcpip channel through the jump host's session (`ssh -J`), opened under the connect timeout
        (paramiko's default for a channel open waits up to an hour)."""
        assert self.gateway is not None
        try:
            return self.gateway.transport().open_channel("direct-tcpip", (host, port), ("", 0), timeout=timeout)
        except RemoteError as exc:
            raise Unreachable(self.name, f"jump host {exc}") from None
        except _SSH_ERRORS as exc:
            raise Unreachable(self.name, f"jump host {self.gateway.name} could not open a channel to "
                                              f"{host}:{port}: {exc}") from None

    def transport(self) -> paramiko.Transport:
        """The open connection's transport, (re)connecting when needed. Errors become typed RemoteErrors."""
        with self._lock:
            if (transport := self._live_transport()) is not None:
                return transport
            self._close_locked()
            client = self._client = self._connect_typed()
            self._dropped = None
            transport = client.get_transport()
            assert transport is not None
            threading.Thread(target=self._keep_alive, args=(client, transport), name=f"keepalive-{self.name}",
                             daemon=True).start()
            return transport

    def _keep_alive(self, client: paramiko.SSHClient, transport: paramiko.Transport) -> None:
        """Ask the peer for an answer every `interval` seconds while the connection lives; close it when none came
        within `misses` intervals. A sshd that hangs while its kernel still acknowledges every segment is found
        dead by nothing else: not by TCP keepalive, not by TCP_USER_TIMEOUT, not by paramiko's `set_keepalive`
        (want-reply false). Closing the transport ends every channel on it: their waiters read the session lost
        and the node Unreachable, and the next command connects afresh."""
        interval, misses = self.keepalive
        patience = interval * misses

        def drop() -> None:  # the reason first: the waiters the close wakes read it
            if self._client is client:
                self._dropped = f"the node answered no keepalive within {patience:g}s"
            _close_quietly(client)

        while True:
            transport.join(interval)  # returns at once when the connection ends
            if not transport.is_active():
                return  # closed by the session, or lost: nothing left to watch
            if not _answers(transport, patience, drop):
                drop()
                return

    def _lost_because(self, exc: BaseException) -> str:
        """What to say of a lost session: the keepalive's finding when it closed the connection, which the
        paramiko error that follows ("Channel closed.") does not tell."""
        return self._dropped or str(exc)

    def _connect_typed(self) -> paramiko.SSHClient:
        name, ssh = self.name, self.ssh
        at = f" (reached at {self.address})" if self.address else ""
        where = (f"{ssh.user}@{self.address or ssh.host}:{ssh.port}" + (f" as {ssh.host}" if self.address else "")
                 + (f" via {self.gateway.name}" if self.gateway else ""))
        try:
            return self._connect()
        except BadHostKeyException as exc:
            raise HostKeyRejected(name, f"host key for {ssh.host}{at} CHANGED (got {exc.key.get_name()} "
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

    def _live_transport(self) -> paramiko.Transport | None:
        client = self._client
        transport = client.get_transport() if client is not None else None
        return transport if transport is not None and transport.is_active() else None

    def _close_locked(self) -> None:
        if self._client is not None:
            _close_quietly(self._client)
            self._client = None

    def close(self) -> None:
        """Close the session (and its bulk and `over` siblings); never waits long behind a (re)connect that holds
        the lock."""
        for sibling in [self._bulk, *self._over.values()]:
            if sibling is not None:
                sibling.close()
        if self._lock.acquire(timeout=1.0):
            try:
                self._close_locked()
            finally:
                self._lock.release()
        elif self._client is not None:
            _close_quietly(self._client)

    # -- commands ---------------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def channel(self, command: str, timeout: float) -> Iterator[paramiko.Channel]:
        """One exec channel, closed on exit. At most MAX_CHANNELS are open per node (a further one waits for a
        free one); waiting for a free one and opening it share the one `timeout`. A channel sshd refuses fails
        this command only, not the connection."""
        deadline = time.monotonic() + timeout
        if not self._channels.acquire(timeout=timeout):
            raise ChannelRefused(self.name, f"no free channel within {timeout:g}s "
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
        """An exec channel running `command`: the channel opened and the exec request answered, both within the
        one `timeout`."""
        deadline = time.monotonic() + timeout
        channel = self._open_session(command, deadline)
        self._exec(channel, command, deadline)
        return channel

    def _open_session(self, command: str, deadline: float) -> paramiko.Channel:
        """Open a session channel before `deadline`. sshd frees a session's MaxSessions slot a moment after the
        channel's close, so a channel opened right after another closed can be refused although fewer than
        MAX_CHANNELS are open: a refusal is retried briefly (REFUSAL_RETRIES, REFUSAL_GAP apart), but only inside
        the one deadline: a node that does not answer at all (a cut cable, whose transport still looks alive)
        must not hold the caller for several timeouts."""
        for attempt in range(REFUSAL_RETRIES + 1):
            transport = self.transport()
            try:
                return transport.open_session(timeout=max(deadline - time.monotonic(), 0.1))
            except _SSH_ERRORS as exc:
                # A refusal (sshd's MaxSessions) is a ChannelException only for the thread that reads it first:
                # paramiko keeps one saved exception per transport, so concurrent openers see a bare
                # SSHException("Unable to open channel."). What tells a refusal from a lost connection is whether
                # the transport still lives (measured against the testbed's sshd, tests/e2e/test_remote_deadlines).
                if not (isinstance(exc, paramiko.ChannelException) or self._alive()):
                    self.close()
                    raise Unreachable(self.name, f"session lost: {self._lost_because(exc)}") from None
                if attempt == REFUSAL_RETRIES or deadline - time.monotonic() < REFUSAL_GAP:
                    raise ChannelRefused(self.name, f"sshd refused a channel ({exc}): `{command[:80]}`") from None
                time.sleep(REFUSAL_GAP)
        raise AssertionError("unreachable")

    def _exec(self, channel: paramiko.Channel, command: str, deadline: float) -> None:
        """Send the exec request and wait for its answer until `deadline`. paramiko waits for that answer with no
        timeout (`Channel._wait_for_event`), so a peer that accepts the channel and never answers would hold this
        thread forever: past the deadline the channel is closed, which wakes that wait. Only the channel: whether
        the whole connection is dead is the keepalive's to say (sibling channels may live on a slow one)."""
        budget = deadline - time.monotonic()
        expiry = _Expiry(budget, lambda: channel.close())
        try:
            with expiry:
                channel.exec_command(command)
        except _SSH_ERRORS as exc:
            channel.close()
            if not expiry.expired:
                if not self._alive():
                    self.close()
                    raise Unreachable(self.name, f"session lost: {self._lost_because(exc)}") from None
                raise ChannelRefused(self.name, f"sshd refused to run `{command[:80]}`: {exc}") from None
        if expiry.expired:
            raise Unreachable(self.name, f"the node accepted a channel but answered no exec request within "
                                         f"{budget:.3g}s: `{command[:80]}`")

    def _close_if_dead(self) -> None:
        """After a channel error: drop the connection only when it is really gone (sibling channels, e.g. the
        other rsync streams, live on a healthy one)."""
        if not self._alive():
            self.close()

    def stream_lines(self, command: str, stop: threading.Event, idle: float = 1.0) -> Iterator[str]:
        """Yield stdout lines of a long-running command (an event stream) until `stop` is set or the channel
        ends; a dropped session raises Unreachable so the caller can reconnect with backoff."""
        with self.channel(command, timeout=10) as channel:
            yield from self._lines(channel, stop, idle)
        if not stop.is_set():
            raise Unreachable(self.name, "event stream ended")

    def _lines(self, channel: paramiko.Channel, stop: threading.Event, idle: float) -> Iterator[str]:
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
        except _SSH_ERRORS as exc:
            self._close_if_dead()
            raise Unreachable(self.name, f"event stream lost: {exc}") from None

    def _alive(self) -> bool:
        return self._live_transport() is not None

    def run(self, argv: Sequence[str], *, timeout: float, sudo: bool = False, stdin: bytes | None = None,
            check: bool = True, on_output: Callable[[bytes], None] | None = None,
            cancel: threading.Event | None = None, supervised: bool = False) -> Result:
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
        result = self.run_command(command, timeout=answer_deadline(timeout), stdin=stdin, on_output=on_output,
                                  cancel=cancel, keep_stdin=supervised)
        if result.exit_code in ENDED_BY_TIMEOUT and time.monotonic() - start >= timeout - 0.5:
            raise CommandTimeout(self.name, f"`{shlex.join(argv)[:200]}` did not finish within {timeout:g}s "
                                                 "(ended on the node)")
        if check and not result.ok:
            raise CommandFailed(self.name, argv, result.exit_code, result.stdout, result.stderr)
        return result

    @contextlib.contextmanager
    def companion(self, argv: Sequence[str], *, timeout: float, stdin: bytes,
                  open_timeout: float) -> Iterator[Companion]:
        """A command that serves the caller's work on another node (the fabric rsync daemon): it gets `stdin`,
        then its stdin stays open as its lifeline, and leaving the block closes it (and the channel), which is
        its signal to end. Bounded on the node at `timeout`, like `run`."""
        deadline = time.monotonic() + open_timeout
        with self.channel(quote(bounded(argv, timeout)), open_timeout) as channel:
            output = _ChannelOutput(self, channel, argv[0])
            output.send(stdin, close=False, deadline=deadline, when="starting")
            yield Companion(output, argv[0])

    def run_script(self, script: str, *, timeout: float, cancel: threading.Event | None = None) -> Result:
        """Feed a POSIX sh script on stdin: one round trip, no temp files, nothing left on the node; bounded on
        the node like `run`."""
        return self.run_command(quote(bounded(["sh", "-s"], timeout)), timeout=answer_deadline(timeout),
                                stdin=script.encode(), cancel=cancel)

    def run_command(self, command: str, *, timeout: float, stdin: bytes | None = None,
                    on_output: Callable[[bytes], None] | None = None, cancel: threading.Event | None = None,
                    keep_stdin: bool = False) -> Result:
        deadline = time.monotonic() + timeout
        with self.channel(command, timeout) as channel:
            output = _ChannelOutput(self, channel, command, on_output=on_output)
            output.send(stdin, close=not keep_stdin, deadline=deadline)
            while output.read(deadline, cancel=cancel,
                              timeout_message=f"`{command[:200]}` did not finish within {timeout:g}s"):
                pass
            return output.result()


class _ChannelOutput:
    """One exec channel's stdout and stderr, read as they arrive under a deadline: the one read loop, for a whole
    command (`Session.run_command`) and for a companion's lines. Output over MAX_OUTPUT is an error, or, for a
    streamed command, keeps its tail; a lost session becomes Unreachable (the connection is dropped only when it
    is really gone: sibling channels, e.g. the other rsync streams, may live on a healthy one)."""

    def __init__(self, session: Session, channel: paramiko.Channel, label: str,
                 on_output: Callable[[bytes], None] | None = None):
        self._session, self._channel, self._label, self._on_output = session, channel, label, on_output
        self.out, self.err = bytearray(), bytearray()
        self._lines = 0  # newlines kept in a whole output (MAX_LINES)

    def send(self, data: bytes | None, *, close: bool, deadline: float, when: str = "during") -> None:
        """Write the command's stdin (and close it unless the command keeps it as a lifeline) before `deadline`."""
        with self._lost_as_unreachable(when):
            try:
                if data is not None:
                    _send_by(self._channel, data, deadline)
                if close:
                    self._channel.shutdown_write()
            except TimeoutError:
                raise CommandTimeout(self._session.name, f"`{self._label[:80]}` took not all of its input by its "
                                                         "deadline (the node opened no window for it)") from None

    def close_stdin(self) -> None:
        """The command's signal to end (a companion's lifeline); a channel already gone needs none."""
        with contextlib.suppress(*_SSH_ERRORS):
            self._channel.shutdown_write()

    def read(self, deadline: float, *, timeout_message: str, cancel: threading.Event | None = None) -> bool:
        """Read until some stdout arrived (True) or the command ended with all its output in (False);
        CommandTimeout (`timeout_message`) at the deadline, Cancelled once `cancel` is set."""
        channel = self._channel
        with self._lost_as_unreachable("during"):
            while True:
                if cancel is not None and cancel.is_set():
                    raise Cancelled(self._session.name, f"`{self._label[:80]}` cancelled")
                if channel.recv_ready():
                    chunk = channel.recv(1 << 16)
                    if self._on_output is not None:
                        self._on_output(chunk)
                    self._keep(self.out, chunk, streaming=self._on_output is not None)
                    return True
                if channel.recv_stderr_ready():
                    self._keep(self.err, channel.recv_stderr(1 << 16), streaming=True)
                    continue
                if channel.exit_status_ready() and channel.eof_received:
                    return False
                if channel.closed:
                    if not self._session._alive():  # its connection ended (lost, or the keepalive's verdict)
                        raise EOFError("the connection closed")
                    return False
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise CommandTimeout(self._session.name, timeout_message)
                select.select([channel], [], [], min(remaining, 1.0))

    def result(self) -> Result:
        """The exit code (-1: still running) and everything kept."""
        code = self._channel.recv_exit_status() if self._channel.exit_status_ready() else -1
        return Result(self.out.decode(errors="replace"), self.err.decode(errors="replace"), code)

    @contextlib.contextmanager
    def _lost_as_unreachable(self, when: str) -> Iterator[None]:
        try:
            yield
        except _SSH_ERRORS as exc:
            self._session._close_if_dead()
            raise Unreachable(self._session.name, f"session lost {when} `{self._label[:80]}`: "
                                                  f"{self._session._lost_because(exc)}") from None

    def _keep(self, buffer: bytearray, chunk: bytes, *, streaming: bool) -> None:
        """Append up to MAX_OUTPUT (and MAX_LINES): a streamed output keeps its tail, anything else over either cap
        is an error."""
        buffer += chunk
        if not streaming:
            self._lines += chunk.count(b"\n")
            if self._lines > MAX_LINES:
                raise OutputTooLarge(self._session.name, f"`{self._label[:80]}` wrote more than {MAX_LINES} lines")
        if len(buffer) > MAX_OUTPUT:
            if not streaming:
                raise OutputTooLarge(self._session.name,
                                     f"`{self._label[:80]}` wrote more than {MAX_OUTPUT} bytes")
            del buffer[: len(buffer) - MAX_OUTPUT]


class Companion:
    """The running command of `Session.companion`: its stdout read line by line, then its end."""

    def __init__(self, output: _ChannelOutput, name: str):
        self._output, self._name = output, name

    def line(self, timeout: float) -> str | None:
        """The next line of its stdout, or None when it ended without one; CommandTimeout after `timeout`."""
        deadline, out = time.monotonic() + timeout, self._output.out
        while b"\n" not in out:
            if not self._read(deadline) and b"\n" not in out:
                return None
        line, _, rest = bytes(out).partition(b"\n")
        out[:] = rest
        return line.decode(errors="replace")

    def finish(self, timeout: float) -> Result:
        """Wait up to `timeout` for it to end by itself, then close its stdin (its signal to end) and wait as long
        again: its exit code (-1: still running) and what it wrote since the last `line`."""
        deadline = time.monotonic() + timeout
        try:
            while self._read(deadline):
                pass
        except CommandTimeout:
            return self.end(timeout)
        return self._output.result()

    def end(self, timeout: float) -> Result:
        """Close its stdin (its signal to end) at once, then wait up to `timeout` for it to end."""
        self._output.close_stdin()
        deadline = time.monotonic() + timeout
        with contextlib.suppress(CommandTimeout):
            while self._read(deadline):
                pass
        return self._output.result()

    def _read(self, deadline: float) -> bool:
        return self._output.read(deadline, timeout_message=f"`{self._name}` said nothing within the deadline")


class _Expiry:
    """A deadline for a paramiko wait that has none of its own: when the block has not been left within `seconds`,
    `end` runs (closing what the wait is on: the channel, the transport), which wakes it. `expired`, read once the
    block is left, says whether `end` ran; a lock decides it, so a wait that returned as time ran out is reported
    expired (what it waited on is closed) rather than answered."""

    def __init__(self, seconds: float, end: Callable[[], None]):
        self.expired = False
        self._end, self._lock, self._left = end, threading.Lock(), False
        self._timer = threading.Timer(max(seconds, 0.0), self._expire)
        self._timer.daemon = True

    def __enter__(self) -> _Expiry:
        self._timer.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._timer.cancel()
        with self._lock:
            self._left = True

    def _expire(self) -> None:
        with self._lock:
            if self._left:
                return
            self.expired = True
        with contextlib.suppress(Exception):  # closing a dead channel or transport may fail; it is closed
            self._end()


def _send_by(channel: paramiko.Channel, data: bytes, deadline: float) -> None:
    """`Channel.sendall` under one deadline for the whole (TimeoutError past it). paramiko waits for the peer's
    window with no timeout unless the channel has one (`Channel._wait_for_send_window`), and with one that timeout
    is per wait: a peer that opened no window, or a byte of it at a time, would hold `sendall` without end."""
    offset = 0
    while offset < len(data):
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError
        channel.settimeout(remaining)
        offset += channel.send(data[offset:offset + (1 << 16)])


def _answers(transport: paramiko.Transport, patience: float, drop: Callable[[], None]) -> bool:
    """Whether the peer answered one keepalive within `patience` (any answer: a refusal is one).
    `global_request(wait=True)` waits while the transport is active with no timeout of its own: at `patience`
    `drop` closes the connection, which ends that wait."""
    expiry = _Expiry(patience, drop)
    try:
        with expiry:
            transport.global_request(KEEPALIVE_REQUEST, wait=True)
    except _SSH_ERRORS:
        return False
    return not expiry.expired and transport.is_active()


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


def _close_quietly(client: paramiko.SSHClient) -> None:
    """Closing a dead connection may fail in many ways; none of them matters to someone who is leaving it."""
    with contextlib.suppress(Exception):
        client.close()


#: Between a node's name and one of its fabric addresses in the name `via` makes (a node's name never holds it:
#: `NodeName`).
VIA = "@"


def via(node: str, address: str) -> str:
    """The name under which `Sessions` gives `node` over `address`, one of its declared fabric ports' addresses
    (`Session.over`): what a step names as the node of an action that must not travel over the node's own session
    (the link step's MTU change of the port that session arrives on)."""
    return f"{node}{VIA}{address}"


class Sessions:
    """The pool: one Session per node of the desired state, jump hosts wired to their gateway's session."""

    def __init__(self, desired: Desired):
        self._sessions: dict[str, Session] = {}
        self._addresses: dict[str, frozenset[str]] = {}
        self.update(desired)

    def update(self, desired: Desired) -> None:
        """Keep sessions whose SSH settings did not change; rebuild the others (level-triggered config)."""
        old = self._sessions
        self._sessions = {}
        self._addresses = {n.name: frozenset(str(p.address.ip) for p in n.fabric.ports()) for n in desired.nodes}
        for node in self._in_jump_order(desired):
            gateway = self._sessions.get(node.ssh.jump) if node.ssh.jump else None
            kept, sudo = old.get(node.name), tuple(sudo_commands(desired, node))
            if kept and kept.ssh == node.ssh and kept.gateway is gateway:
                kept.sudo = sudo  # policy.drop_caches may have changed
                self._sessions[node.name] = kept
            else:
                self._sessions[node.name] = Session(node.name, node.ssh, gateway, sudo)
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
        """A node's session by its name; by `via(node, address)`, the same node over that address, which must be
        one its fabric declares (`Session.over`): no other address is ever dialled under the node's host key."""
        node, sep, address = name.partition(VIA)
        if not sep:
            return self._sessions[node]
        if address not in self._addresses.get(node, ()):
            raise KeyError(f"{address!r} is not a fabric address of {node!r}")
        return self._sessions[node].over(address)

    def close(self) -> None:
        for session in self._sessions.values():
            session.close()
