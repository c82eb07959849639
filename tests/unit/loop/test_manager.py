"""Issue 34: the manager owns the sessions, the lease and the event streams; a new generation restarts only the
event streams of the nodes whose connection (or watched fabric interface) changed.

It restarted every stream on every edit before (Controller._restart_streams), and a stream restarted loses the
events of its gap."""

from __future__ import annotations

import os
import threading

import pytest

from reconciler.core.spec import load
from reconciler.loop.controller import Controller
from reconciler.loop.manager import Manager, streams_to_restart
from reconciler.loop.operations import Operations
from reconciler.loop.reasons import Reason
from reconciler.loop.triggers import ReconcileRequests
from tests.unit.loop.test_cancel_on_edit import edited
from tests.unit.loop.test_controller_loop import HEAD, WORKER, FakeSessions, Gate, Script

#: (name, the edit of the sample file, (streams stopped, streams started))
CASES = [
    ("max_model_len", ("max_model_len: 32768", "max_model_len: 16384"), (set(), set())),
    ("the model", ("revision: main", "revision: 0123abc"), (set(), set())),
    ("the worker's ssh host", ("host: 192.168.200.13", "host: 192.168.200.14"), ({WORKER}, {WORKER})),
    ("the head's ssh host: the worker jumps through it", ("host: 10.1.230.180", "host: 10.1.230.181"),
     ({HEAD, WORKER}, {HEAD, WORKER})),
    ("the head's fabric interface", ("interface: enp1s0f1np1        # the outer", "interface: enp1s0f0np0  # x"),
     ({HEAD}, {HEAD})),
    ("the head's fabric address (not what the stream watches)",
     ("address: 192.168.200.12/24", "address: 192.168.200.22/24"), (set(), set())),
]


@pytest.mark.parametrize(("name", "edit", "expected"), CASES, ids=[c[0] for c in CASES])
def test_only_the_streams_of_nodes_whose_connection_changed_restart(desired_path, tmp_path, name, edit, expected):
    old, new = load(desired_path, os.environ), edited(desired_path, tmp_path, *edit)
    assert streams_to_restart(old, new) == expected, name


def test_the_first_generation_starts_every_stream(desired_path):
    assert streams_to_restart(None, load(desired_path, os.environ)) == (set(), {HEAD, WORKER})


class Streams:
    """stream_events as the manager calls it: which node, with which stop event."""

    def __init__(self):
        self.started: list[tuple[str, str, threading.Event]] = []

    def __call__(self, session, interface, requests, stop):
        self.started.append((session.name, interface, stop))


class NamedSessions(FakeSessions):
    """Each node's session, named (stream_events reads the session's name)."""

    def __init__(self, desired):
        self.name = ""

    def __getitem__(self, node):
        session = NamedSessions(None)
        session.name = node
        return session


def test_an_edit_that_changes_no_connection_restarts_no_event_stream(desired_path, tmp_path, converged,
                                                                     monkeypatch):
    streams = Streams()
    monkeypatch.setattr("reconciler.loop.manager.stream_events", streams)
    requests = ReconcileRequests()
    c = Controller(desired_path, tmp_path / "state", requests, threading.Event(), observe_fn=Script(converged),
                   operations=Operations(on_end=lambda: None, run=Gate()),
                   manager=Manager(desired_path, requests, events=True, sessions_factory=NamedSessions))
    c.reconcile({Reason("start")})
    assert sorted(n for n, _, _ in streams.started) == [HEAD, WORKER]
    desired_path.write_text(desired_path.read_text().replace("max_model_len: 32768", "max_model_len: 16384"))
    c.reconcile({Reason("file")})
    assert c.store.generation == 2
    assert len(streams.started) == 2, "a stream was restarted"
    assert not any(stop.is_set() for _, _, stop in streams.started), "a stream was stopped"
    desired_path.write_text(desired_path.read_text().replace("host: 192.168.200.13", "host: 192.168.200.14"))
    c.reconcile({Reason("file")})
    assert [n for n, _, _ in streams.started[2:]] == [WORKER]
    assert [n for n, _, stop in streams.started if stop.is_set()] == [WORKER], "the worker's old stream stopped"
    c.manager.stop_streams()
    assert all(stop.is_set() for _, _, stop in streams.started)


def test_the_manager_gives_the_lease_back_and_closes_the_sessions_at_the_end(desired_path):
    closed: list[str] = []

    class Closing(FakeSessions):
        def close(self):
            closed.append("sessions")

    manager = Manager(desired_path, ReconcileRequests(), events=False, sessions_factory=Closing)
    manager.adopt(load(desired_path, os.environ))
    assert manager.lease is not None and manager.lease.renew_if_due() is None and manager.lease.holding
    manager.close(ended=False)
    assert manager.lease.holding and closed == ["sessions"], "operations still run: the lease stays with them"
    manager.close(ended=True)
    assert not manager.lease.holding and closed == ["sessions", "sessions", "sessions"]
