"""Issue 31, item 3: a channel accepted but never answered must not wedge the reconciler.

The exploit, for real: a paramiko server on 127.0.0.1 that accepts the session channel and then sits in
`check_channel_exec_request` (paramiko serves a connection's requests on one thread, as sshd does, so nothing else
on that connection is answered either). paramiko's `Channel.exec_command` waits for that answer with no timeout, and
`observe()` waited for every node: one such node stopped every node's reconcile. Now the exec request has the
command's deadline, a keepalive that expects an answer drops the silent connection, and each node is observed under
its own deadline (reconciler/edge/ssh/session.py, reconciler/edge/observe.py).

The hang is a `threading.Event` the teardown releases; every wait here has a deadline (`_finished`), and no test
sleeps to synchronise or measures the wall clock.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import paramiko
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from reconciler.core.observed import NodeObservation
from reconciler.core.spec import Desired, Ssh
from reconciler.edge import observe as observe_module
from reconciler.edge.observe import observe
from reconciler.edge.ssh import Result, Session, Sessions, Unreachable
from tests.unit.recorded import RAW, load

HUNG = "worker1"  # the login (and node) whose exec requests the server never answers
#: How long a test waits for a call that must end by its own, much shorter, deadline: a bound for the test, so
#: a regression fails it instead of hanging the suite.
PATIENCE = 30.0


def _finished(call: Callable[[], object]) -> object:
    """`call`'s result (or the exception it raised) from a thread of its own, waited for at most PATIENCE."""
    box: list[object] = []

    def run() -> None:
        try:
            box.append(call())
        except Exception as exc:  # noqa: BLE001 - the test judges what was raised
            box.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(PATIENCE)
    assert box, f"still waiting after {PATIENCE:g}s: a wait without a deadline"
    return box[0]


def _key(path: Path) -> paramiko.Ed25519Key:
    path.write_bytes(Ed25519PrivateKey.generate().private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH, serialization.NoEncryption()))
    path.chmod(0o600)
    return paramiko.Ed25519Key(filename=str(path))


class _Sshd(paramiko.ServerInterface):
    """A paramiko server on 127.0.0.1. A login in `hang` gets its channel opened and its exec request never
    answered until `release` (the exploit); any other login gets `answers[login]` as the stdout of any command,
    exit 0, once the command's stdin has ended (the client sends it only after the exec's answer, so the answer
    always goes first). Counts the keepalives that ask for an answer."""

    def __init__(self, host_key: paramiko.PKey, client_key: paramiko.PKey, answers: dict[str, bytes],
                 hang: set[str]):
        self.host_key, self.client_key, self.answers, self.hang = host_key, client_key, answers, hang
        self.release, self.hung = threading.Event(), threading.Event()
        self.keepalives = 0
        self.three_keepalives = threading.Event()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._transports: list[paramiko.Transport] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return  # closed by `close`
            transport = paramiko.Transport(sock)
            transport.add_server_key(self.host_key)
            self._transports.append(transport)
            transport.start_server(threading.Event(), server=self)

    def close(self) -> None:
        self.release.set()
        self._listener.close()
        for transport in self._transports:
            transport.close()

    # -- paramiko.ServerInterface -----------------------------------------------------------------------------

    def get_allowed_auths(self, username: str) -> str:
        return "publickey"

    def check_auth_publickey(self, username: str, key: paramiko.PKey) -> int:
        return paramiko.AUTH_SUCCESSFUL if key == self.client_key else paramiko.AUTH_FAILED

    def check_channel_request(self, kind: str, chanid: int) -> int:
        return paramiko.OPEN_SUCCEEDED if kind == "session" else paramiko.OPEN_FAILED_ADMINISTRATIVELY_PROHIBITED

    def check_global_request(self, kind: str, msg: paramiko.Message) -> bool:
        if kind == "keepalive@openssh.com":  # what OpenSSH's ServerAliveInterval sends, asking for an answer
            self.keepalives += 1
            if self.keepalives >= 3:
                self.three_keepalives.set()
        return False  # as sshd: an unknown global request is refused, and the refusal is the answer

    def check_channel_exec_request(self, channel: paramiko.Channel, command: bytes) -> bool:
        login = channel.get_transport().get_username()
        if login in self.hang:
            self.hung.set()
            self.release.wait()  # accepted, never answered: this connection's one thread sits here
            return False
        threading.Thread(target=_answer, args=(channel, self.answers[login]), daemon=True).start()
        return True


def _answer(channel: paramiko.Channel, stdout: bytes) -> None:
    while channel.recv(1 << 16):  # the command's stdin, to its end
        pass
    channel.sendall(stdout)
    channel.send_exit_status(0)
    channel.close()


@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> tuple[paramiko.PKey, paramiko.PKey, Path]:
    where = tmp_path_factory.mktemp("keys")
    return _key(where / "host"), _key(where / "id_ed25519"), where / "id_ed25519"


@pytest.fixture
def sshd(keys, tmp_path) -> Iterator[_Sshd]:
    host_key, client_key, _ = keys
    server = _Sshd(host_key, client_key, {n: RAW["outputs"][n].encode() for n in RAW["outputs"]}, {HUNG})
    (tmp_path / "known_hosts").write_text(f"[127.0.0.1]:{server.port} {host_key.get_name()} "
                                          f"{host_key.get_base64()}\n")
    yield server
    server.close()


def _ssh(sshd: _Sshd, keys, tmp_path: Path, login: str) -> Ssh:
    return Ssh(host="127.0.0.1", port=sshd.port, user=login, known_hosts=str(tmp_path / "known_hosts"),
               identity_file=str(keys[2]), connect_timeout="5s")


@pytest.fixture
def session(sshd, keys, tmp_path) -> Callable[[str], Session]:
    """session(login): a Session to the loopback server under that login, closed at the end."""
    made: list[Session] = []

    def make(login: str) -> Session:
        made.append(Session(login, _ssh(sshd, keys, tmp_path, login)))
        return made[-1]

    yield make
    for s in made:
        s.close()


#: Keepalives every 0.1 s, a peer silent for 1 s dead (the daemon's are 15 s x 3).
FAST_KEEPALIVE = (0.1, 10)


def _two_nodes(sshd: _Sshd, keys, tmp_path: Path) -> Desired:
    """The recorded cluster's head and one worker (HUNG), each reached on the loopback server under its name."""
    desired = load()
    nodes = [n.model_copy(update={"ssh": _ssh(sshd, keys, tmp_path, n.name)}) for n in desired.nodes
             if n.name in ("head", HUNG)]
    return desired.model_copy(update={"nodes": nodes})


# -- the session -------------------------------------------------------------------------------------------------

def test_an_exec_request_never_answered_fails_the_command_at_its_deadline(session, sshd):
    failed = _finished(lambda: session(HUNG).run_command("true", timeout=0.5))
    assert sshd.hung.is_set(), "the server took the exec request and sat on it"
    assert isinstance(failed, Unreachable), failed
    assert failed.message.startswith("the node accepted a channel but answered no exec request within"), failed


def test_a_peer_that_stops_answering_is_dropped_by_the_keepalive(session, sshd):
    """The command's own deadline is a minute: the keepalive, unanswered for its patience, ends it long before."""
    hung = session(HUNG)
    hung.keepalive = FAST_KEEPALIVE
    failed = _finished(lambda: hung.run_command("true", timeout=60))
    assert isinstance(failed, Unreachable), failed
    assert failed.message == "session lost: the node answered no keepalive within 1s"
    assert not hung._alive(), "the silent connection is closed; the next command connects afresh"


def test_a_peer_that_answers_its_keepalives_keeps_its_session(session, sshd):
    head = session("head")
    head.keepalive = FAST_KEEPALIVE
    assert head.run_command("true", timeout=10).ok
    transport = head.transport()
    assert sshd.three_keepalives.wait(PATIENCE), "keepalives that ask for an answer (keepalive@openssh.com)"
    assert head.transport() is transport, "three refusals are three answers: the connection stays"
    assert head.run_command("true", timeout=10).stdout == RAW["outputs"]["head"]


# -- observe ---------------------------------------------------------------------------------------------------

def test_observe_returns_the_answering_node_and_the_hung_one_unreachable(sshd, keys, tmp_path):
    desired = _two_nodes(sshd, keys, tmp_path)
    sessions = Sessions(desired)
    try:
        outcome = _finished(lambda: observe(desired, sessions, timeout=0.1, ask_flags=False))
    finally:
        sessions.close()
    assert not isinstance(outcome, BaseException), outcome
    observed, _ = outcome  # type: ignore[misc]
    assert _answered(observed.nodes["head"]), observed.nodes["head"]
    late = observed.nodes[HUNG]
    assert not late.reachable
    assert late.error.startswith("the node accepted a channel but answered no exec request within"), late.error


def _answered(seen: NodeObservation) -> bool:
    """The node's own answer was read (how it parsed is not the point here): not a late or lost node's placeholder."""
    return seen.reachable and seen.error is None


class _Stub:
    """A node's session whose probe answers the recording at once, or (`hang`) waits in a place no deadline of the
    session covers until the event is set: what observe's own per-node deadline is for."""

    def __init__(self, node: str, hang: threading.Event | None = None):
        self.node, self.hang, self.entered = node, hang, threading.Event()

    def run_script(self, script: str, *, timeout: float, cancel: threading.Event | None = None) -> Result:
        self.entered.set()
        if self.hang is not None:
            self.hang.wait()
            raise Unreachable(self.node, "released by the test's teardown")
        return Result(RAW["outputs"][self.node], "", 0)


@pytest.fixture
def release() -> Iterator[threading.Event]:
    event = threading.Event()
    yield event
    event.set()


def test_a_node_late_for_its_deadline_reads_unreachable_and_holds_no_other(monkeypatch, release):
    monkeypatch.setattr(observe_module, "node_deadline", lambda desired, node, timeout: 0.5)
    desired = load()
    sessions = {n.name: _Stub(n.name, release if n.name == HUNG else None) for n in desired.nodes}
    outcome = _finished(lambda: observe(desired, sessions, timeout=10, ask_flags=False))  # type: ignore[arg-type]
    assert not isinstance(outcome, BaseException), outcome
    observed, durations = outcome  # type: ignore[misc]
    assert all(_answered(observed.nodes[n.name]) for n in desired.nodes if n.name != HUNG), observed.nodes
    late = observed.nodes[HUNG]
    assert (late.reachable, late.error) == (False, "no observation within 0.5s (observe's deadline for this "
                                                   "node): read as unreachable for this cycle")
    assert set(durations) == {n.name for n in desired.nodes}


def test_cancel_ends_observe_while_a_node_hangs_where_cancel_is_not_heard(release):
    desired = load()
    sessions = {n.name: _Stub(n.name, release if n.name == HUNG else None) for n in desired.nodes}
    cancel = threading.Event()
    hung = sessions[HUNG]

    def cancelled_once_hung():
        assert hung.entered.wait(PATIENCE)
        cancel.set()

    threading.Thread(target=cancelled_once_hung, daemon=True).start()
    outcome = _finished(lambda: observe(desired, sessions, timeout=60, cancel=cancel,  # type: ignore[arg-type]
                                        ask_flags=False))
    assert not isinstance(outcome, BaseException), outcome
    observed, _ = outcome  # type: ignore[misc]
    assert (observed.nodes[HUNG].reachable, observed.nodes[HUNG].error) == (False, "observation cancelled")
