"""Issue 52, item 9: the MTU repaired over the twin.

The sample's worker is reached over its own first fabric port (`ssh.host: 192.168.200.13`); a firmware reboot
resets that port to 1500 while SSH goes on (TCP negotiated the MSS), and the link step used to refuse the repair
every reconcile, since it never changes the MTU of the port its session arrives on. Now the change goes over a
session to the node's other declared port (`ssh.via`, `Session.over`): the step's side is pinned by the cases of
tests/unit/step_cases/link.py (`OVER_OTHER_PORT` here, the rest in test_step_cases.py) and by the failures below;
the session's side (one address, the host key checked under the node's own entry) by a loopback paramiko server.
"""

from __future__ import annotations

import re
import shlex
import socket
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import paramiko
import pytest

from reconciler.core.planning import Step
from reconciler.core.spec import Ssh
from reconciler.edge.ssh import (
    AuthFailed,
    HostKeyRejected,
    RemoteError,
    Sessions,
    Unreachable,
    sudo_commands,
    via,
)
from reconciler.edge.ssh import session as ssh_session
from reconciler.edge.ssh.session import VIA, Session
from reconciler.edge.steps import plan_of
from reconciler.edge.steps.actions import Given, Read
from tests.unit.edge.test_hung_channel import _finished, _key, _Sshd
from tests.unit.recorded import load, observe
from tests.unit.step_cases import Case
from tests.unit.step_cases.link import (
    ARRIVES_ON_IT,
    AT_1500,
    HEAD_AT_9000,
    OVER_OTHER_PORT,
    OVER_TWIN,
    SET_MTU,
    TWIN_DOWN,
    UP,
    UP_TWIN,
    W1,
    _port,
    ports,
)
from tests.unit.step_driver import Driver

# -- the step ---------------------------------------------------------------------------------------------------

FIRST_AT_1500_TWIN_DOWN = ports(_port("link", mtu=1500), TWIN_DOWN)


@pytest.mark.parametrize("case", OVER_OTHER_PORT, ids=str)
def test_step_case_over_the_other_port(case: Case) -> None:
    """As test_step_cases.py runs every case; and each `run NODE@ADDRESS sudo ARGV` is one of that node's exact
    sudoers lines: the session over the other port sends what the node's own would, nothing wider."""
    desired = case.desired()
    driver = Driver(case.facts, case.results)
    error = driver.drive(plan_of(case.step.kind)(Given(desired, case.observed(), case.generation), case.step))
    assert driver.transcript == list(case.commands)
    assert error is None, f"the step ended with {error!r}"
    routed = [line.split(" ", 3) for line in driver.transcript if line.startswith("run ") and VIA in line]
    assert routed, "the change runs over the other port"
    for _, name, sudo, argv in routed:
        node = name.partition(VIA)[0]
        assert sudo == "sudo" and tuple(shlex.split(argv)) in sudo_commands(desired, desired.node(node))


@dataclass
class _Unanswered(Driver):
    """A driver whose reads of `fails` ("NODE KEY") raise the given error into the step, as the executor raises
    a node's RemoteError where the step yielded."""

    fails: Mapping[str, RemoteError] = field(default_factory=dict)

    def read(self, action: Read) -> object:
        if (error := self.fails.get(f"{action.node} {action.fact.key}")) is not None:
            raise error
        return super().read(action)


def _drive(facts: Mapping[str, list[object]],
           fails: Mapping[str, RemoteError]) -> tuple[list[str], BaseException | None]:
    """worker1's link step, its first port at 1500 and its session arriving on it, over `facts` and `fails`."""
    desired = load()
    driver = _Unanswered({f"{W1} session-address": [ARRIVES_ON_IT], **facts}, fails=fails)
    error = driver.drive(plan_of("link")(Given(desired, observe(desired)), Step("link", W1, "test", ())))
    return driver.transcript, error


def test_no_session_over_the_twin_leaves_it_to_the_peers_end():
    """The twin's session does not answer (its sshd, a firewall): a transient error is "no path", and the peer's end
    at the target MTU lets the change go over the session itself."""
    transcript, error = _drive({f"{W1} links": [AT_1500, ports()], "head links": [HEAD_AT_9000]},
                               {f"{OVER_TWIN} session-address": Unreachable(W1, "cannot reach spark@10.232.1.11")})
    assert error is None, error
    assert transcript == [f"read {W1} links", f"read {W1} session-address", f"read {OVER_TWIN} session-address",
                          "read head links", "report link.mtu-peer-at-target", SET_MTU, *UP[1:], *UP_TWIN]


@pytest.mark.parametrize("refused", [HostKeyRejected(W1, "host key for 10.232.0.11 (reached at 10.232.1.11) "
                                                         "CHANGED"),
                                     AuthFailed(W1, "authentication failed for spark@10.232.1.11:22")])
def test_a_refused_key_or_login_over_the_twin_is_a_stop_not_no_path(refused):
    """As with `ssh.fallback_hosts`: a key that does not match the node's one entry, or a refused login, is never
    taken for "no path" and worked around: the step ends with it, nothing changed."""
    transcript, error = _drive({f"{W1} links": [AT_1500], "head links": [HEAD_AT_9000]},
                               {f"{OVER_TWIN} session-address": refused})
    assert error is refused
    assert transcript == [f"read {W1} links", f"read {W1} session-address", f"read {OVER_TWIN} session-address"]


def test_a_peer_that_does_not_answer_vouches_for_nothing():
    transcript, error = _drive({f"{W1} links": [FIRST_AT_1500_TWIN_DOWN]},
                               {"head links": Unreachable("head", "session lost")})
    assert transcript == [f"read {W1} links", f"read {W1} session-address", "read head links"]
    assert error is not None and re.search(r"its other port enP2p1s0f1np1 is not up with 10.232.1.11/24, and the "
                                           r"peer's end \(enp1s0f1np1 on head\) could not be read \(session lost\)",
                                           str(error)), error


# -- the pool: `via` names a node over one of its declared fabric addresses --------------------------------------


@pytest.fixture
def sessions() -> Iterator[Sessions]:
    pool = Sessions(load())
    yield pool
    pool.close()


def test_via_gives_the_same_node_over_that_address_with_its_own_settings(sessions):
    own, over = sessions[W1], sessions[via(W1, "10.232.1.11")]
    assert over is not own and over is sessions[via(W1, "10.232.1.11")], "one session per address, kept"
    assert (over.name, over.ssh, over.gateway, over.sudo) == (own.name, own.ssh, own.gateway, own.sudo)
    assert over.address == "10.232.1.11" and own.address is None
    assert sessions[via(W1, "10.232.0.11")].address == "10.232.0.11", "the first port's address: the other way"


@pytest.mark.parametrize("address", ["10.232.1.10", "10.231.1.11", "127.0.0.1", ""])
def test_via_refuses_an_address_the_node_does_not_declare(sessions, address):
    """The head's address, the management address, anything else: never dialled under the node's host key."""
    with pytest.raises(KeyError, match="is not a fabric address of 'worker1'"):
        sessions[via(W1, address)]


def test_the_session_over_another_address_closes_with_the_nodes(sessions, monkeypatch):
    own, over = sessions[W1], sessions[via(W1, "10.232.1.11")]
    closed: list[Session] = []
    monkeypatch.setattr(over, "close", lambda: closed.append(over))
    own.close()
    assert closed == [over]


def test_the_path_goes_to_that_address_only(monkeypatch):
    """No `host`, no fallback: a session over the twin that does not answer is Unreachable, not the node's own
    path taken again (which arrives on the port being changed)."""
    tried: list[str] = []

    def tcp(host: str, port: int, timeout: float) -> socket.socket:
        tried.append(host)
        raise ConnectionRefusedError(111, "Connection refused")

    monkeypatch.setattr(ssh_session, "_tcp", tcp)
    s = Session(W1, Ssh(host="10.232.0.11", known_hosts="/kh", fallback_hosts=["10.232.1.11"])).over("10.232.1.11")
    with pytest.raises(Unreachable, match=r"cannot reach spark@10.232.1.11:22 as 10.232.0.11"):
        s.transport()
    assert tried == ["10.232.1.11"]


# -- the host key: checked under the node's own entry, whatever the address --------------------------------------


@pytest.fixture
def loopback(tmp_path) -> Iterator[tuple[_Sshd, paramiko.PKey, Path]]:
    host_key, client_key = _key(tmp_path / "host"), _key(tmp_path / "id_ed25519")
    server = _Sshd(host_key, client_key, {"spark": b"10.232.1.10 40022 10.232.1.11 22\n"}, set())
    yield server, host_key, tmp_path / "id_ed25519"
    server.close()


def _over_loopback(server: _Sshd, identity: Path, known: Path) -> Session:
    """The worker declared at `host` 10.232.0.11 (never dialled here) and reached over 127.0.0.1, where the
    loopback server stands in for its twin."""
    ssh = Ssh(host="10.232.0.11", port=server.port, known_hosts=str(known), identity_file=str(identity),
              connect_timeout="5s")
    return Session(W1, ssh).over("127.0.0.1")


def test_the_key_is_checked_under_the_nodes_entry_and_no_other(loopback, tmp_path):
    """known_hosts names the node under `host` only: the session over another address is accepted by that entry
    (no entry of its own is needed, none is added)."""
    server, host_key, identity = loopback
    known = tmp_path / "known_hosts"
    known.write_text(f"[10.232.0.11]:{server.port} {host_key.get_name()} {host_key.get_base64()}\n")
    s = _over_loopback(server, identity, known)
    try:
        result = _finished(lambda: s.run_command("true", timeout=10))
    finally:
        s.close()
    assert not isinstance(result, BaseException), result
    assert known.read_text().count("\n") == 1, "nothing learnt"


def test_a_key_listed_only_under_the_address_dialled_is_refused(loopback, tmp_path):
    """Another key under `host` (the node's), the server's own key only under the address dialled: refused as
    CHANGED, never trusted because the address it answered at lists it."""
    server, host_key, identity = loopback
    other = _key(tmp_path / "other")
    known = tmp_path / "known_hosts"
    known.write_text(f"[10.232.0.11]:{server.port} {other.get_name()} {other.get_base64()}\n"
                     f"[127.0.0.1]:{server.port} {host_key.get_name()} {host_key.get_base64()}\n")
    s = _over_loopback(server, identity, known)
    try:
        failed = _finished(lambda: s.run_command("true", timeout=10))
    finally:
        s.close()
    assert isinstance(failed, HostKeyRejected), failed
    assert "host key for 10.232.0.11 (reached at 127.0.0.1) CHANGED" in failed.message
