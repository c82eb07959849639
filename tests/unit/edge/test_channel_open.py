"""How `Session._open` spends its deadline: a refused channel (sshd frees a MaxSessions slot a moment after a close)
is retried briefly, but a node that does not answer at all is given the one deadline, never one per retry. The
second rule failed in CI: a cut management cable leaves the transport looking alive, each open waited the whole
timeout and was retried 3 times, and the probe thread outlived the daemon's shutdown. A fake clock stands in for
time; the fake transport behaves as paramiko's `open_session` does (`Timeout opening channel.` after `timeout`)."""

from __future__ import annotations

import pytest
from paramiko import ChannelException, SSHException

from reconciler.edge.ssh import ChannelRefused, Session
from reconciler.edge.ssh import session as ssh_session


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


class _Channel:
    def __init__(self) -> None:
        self.commands: list[str] = []

    def exec_command(self, command: str) -> None:
        self.commands.append(command)


class _Transport:
    """Answers each open with the next outcome: "silent" waits the whole timeout (a cut cable), "refused" is
    sshd's MaxSessions refusal, "open" a channel."""

    def __init__(self, clock: _Clock, outcomes: list[str]) -> None:
        self.clock, self.outcomes, self.timeouts = clock, outcomes, []

    def open_session(self, timeout: float):
        self.timeouts.append(timeout)
        outcome = self.outcomes.pop(0)
        if outcome == "silent":
            self.clock.now += timeout
            raise SSHException("Timeout opening channel.")
        if outcome == "refused":
            raise ChannelException(1, "Administratively prohibited")
        return _Channel()


@pytest.fixture
def clock(monkeypatch) -> _Clock:
    fake = _Clock()
    monkeypatch.setattr(ssh_session, "time", fake)
    return fake


def _session(monkeypatch, transport: _Transport) -> Session:
    session = Session("worker", None)  # type: ignore[arg-type]
    monkeypatch.setattr(session, "transport", lambda: transport)
    monkeypatch.setattr(session, "_alive", lambda: True)  # a cut cable: the transport has not noticed yet
    return session


def test_a_node_that_does_not_answer_costs_one_deadline_not_one_per_retry(monkeypatch, clock):
    transport = _Transport(clock, ["silent"] * (ssh_session.REFUSAL_RETRIES + 1))
    with pytest.raises(ChannelRefused, match="Timeout opening channel"):
        _session(monkeypatch, transport)._open("true", timeout=10)
    assert transport.timeouts == [10]
    assert clock.now == 10


def test_a_refusal_that_clears_is_retried_and_the_command_runs(monkeypatch, clock):
    transport = _Transport(clock, ["refused", "refused", "open"])
    channel = _session(monkeypatch, transport)._open("echo hi", timeout=10)
    assert channel.commands == ["echo hi"]
    assert len(transport.timeouts) == 3
    assert clock.now == 2 * ssh_session.REFUSAL_GAP
    assert all(t <= 10 for t in transport.timeouts)


def test_a_refusal_that_lasts_fails_this_command_after_the_retries(monkeypatch, clock):
    transport = _Transport(clock, ["refused"] * (ssh_session.REFUSAL_RETRIES + 1))
    with pytest.raises(ChannelRefused, match="refused a channel"):
        _session(monkeypatch, transport)._open("true", timeout=10)
    assert len(transport.timeouts) == ssh_session.REFUSAL_RETRIES + 1


def test_retries_stop_where_the_deadline_leaves_no_room_for_another(monkeypatch, clock):
    transport = _Transport(clock, ["refused", "silent", "open"])
    with pytest.raises(ChannelRefused):
        _session(monkeypatch, transport)._open("true", timeout=1)
    assert transport.timeouts == [1, 1 - ssh_session.REFUSAL_GAP]
    assert clock.now == 1
