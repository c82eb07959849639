"""Clocks and locks (issue 31, finding 10): a step of the wall clock is not time passing, and a lease is not a name.

- The lease: two daemons on one host with the same file path both held it (one token for both); a 700 s forward
  step of the head's clock let `apply` in beside the daemon (its lease "expired"). Run with the real companion and
  the real `flock` in a HOME standing in for the head (tests/unit/local_head.py), the step made by a `date` that
  answers 700 s ahead.
- The loop's durations: the controller is given a fake wall clock (`clock`, unix time for timestamps) and its
  module's `time.monotonic` is replaced by a fake monotonic clock; the test moves them apart. A backoff, a health
  grace and a cold start's allowance follow the monotonic clock only: a day back or 2 h forward changes nothing.
"""

from __future__ import annotations

import subprocess
import sys
import threading
from datetime import UTC, datetime
from types import SimpleNamespace

import pytest

from reconciler.core.observed import ServingApi
from reconciler.edge.lease import Holder, Lease, LeaseHeld
from reconciler.loop import controller as controller_module
from reconciler.loop.operations import Operations
from reconciler.loop.reasons import Reason
from reconciler.loop.triggers import ReconcileRequests
from tests.unit.controllers import make_controller
from tests.unit.local_head import LocalHead, hang_up
from tests.unit.loop.test_controller_loop import HEAD, WORKER, FakeSessions, Gate, Script, _with

DAY = 86400.0

# -- the lease ------------------------------------------------------------------------------------------------------


@pytest.fixture
def home(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    return home


@pytest.fixture
def heads(home):
    """The head as each actor finds it (several views of one HOME); every companion is ended afterwards."""
    made: list[LocalHead] = []

    def head(date_offset: int = 0) -> LocalHead:
        made.append(LocalHead(home, date_offset))
        return made[-1]

    yield head
    hang_up(*made)


@pytest.fixture
def desired(base_yaml):
    from reconciler.core import spec

    return spec.loads(base_yaml)


def test_two_daemons_on_one_host_with_the_same_file_do_not_both_hold_the_lease(desired, heads):
    """Two state dirs, one desired-state path, one host: the first version named both holders alike, and the
    head's script let the second "renew" the first one's lease."""
    path = "/etc/spark-reconciler/cluster.yaml"
    first = Lease(desired, heads(), Holder.of("daemon", path))
    second = Lease(desired, heads(), Holder.of("daemon", path))
    first.acquire()
    with pytest.raises(LeaseHeld, match="held by daemon pid"):
        second.acquire()
    assert first.renew_if_due() is None and first.holding


def test_the_holder_token_names_the_process():
    """Each process is its own holder, whatever file it runs for."""
    code = "from reconciler.edge.lease import Holder; print(Holder.of('daemon', '/etc/c.yaml').token)"
    tokens = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
              for _ in range(2)}
    assert len(tokens) == 2, tokens


@pytest.mark.parametrize("step", [700, 2 * 3600, -DAY])
def test_a_step_of_the_heads_clock_hands_the_lease_to_no_one(desired, heads, step):
    """The daemon holds the lease; then the head's clock is stepped (700 s forward let `apply` in before) and
    `apply` tries: refused, naming the daemon; and the daemon still holds it."""
    daemon = Lease(desired, heads(), Holder.of("daemon", "/etc/spark-reconciler/cluster.yaml"))
    daemon.acquire()
    stepped = heads(date_offset=int(step))
    with pytest.raises(LeaseHeld, match="held by daemon pid"):
        Lease(desired, stepped, Holder.of("apply", "/home/me/cluster.yaml")).acquire()
    daemon.sessions = stepped
    assert daemon.renew_if_due() is None and daemon.holding


# -- the loop's durations ------------------------------------------------------------------------------------------


class Clocks:
    """A wall clock and a monotonic one: `passes` moves both, `step` moves the wall clock only (NTP stepping it,
    an operator's `date -s`). Stands in for the controller module's `time`: `time()` is the wall clock."""

    def __init__(self) -> None:
        self.wall_now = datetime(2026, 12, 1, 12, 0, tzinfo=UTC).timestamp()
        self.mono_now = 5000.0

    def time(self) -> float:
        return self.wall_now

    def monotonic(self) -> float:
        return self.mono_now

    def passes(self, seconds: float) -> None:
        self.wall_now += seconds
        self.mono_now += seconds

    def step(self, seconds: float) -> None:
        self.wall_now += seconds


@pytest.fixture
def clocks(monkeypatch) -> Clocks:
    fake = Clocks()
    monkeypatch.setattr(controller_module, "time", fake)
    return fake


def _controller(desired_path, tmp_path, clocks, script, gate):
    requests = ReconcileRequests()
    ops = Operations(on_end=lambda: requests.request(Reason("operation")), clock=clocks.monotonic, run=gate)
    c = make_controller(desired_path, tmp_path / "state", requests, threading.Event(), events=False, observe_fn=script,
                   sessions_factory=FakeSessions, operations=ops, clock=clocks.time)
    c.image.query = SimpleNamespace(get=lambda wanted: None)  # no image to ask here: a restart is judged without it
    return c, requests


def _planned(c) -> list[str]:
    return [s["kind"] for s in c.status["lastPlan"]["steps"]]


def _serving(desired_path, observed, api: ServingApi, started_at: float | None = None):
    """The head's serving container as `api` says, started at `started_at` (unix time) when given."""
    from reconciler.core.spec import load

    name = load(desired_path).serving.container_name
    head = observed.node(HEAD)
    containers = [c.model_copy(update={"started_at": datetime.fromtimestamp(started_at, UTC).isoformat()})
                  if c.name == name and started_at is not None else c for c in head.containers]
    return _with(observed, HEAD, serving=api, containers=containers)


def _backed_off(desired_path, tmp_path, clocks, converged):
    """A weight sync that failed once: backing off (1 s x jitter) on the loop's clock."""
    gate = Gate(failing=("weights",))
    gate.release.set()
    c, requests = _controller(desired_path, tmp_path, clocks, Script(_with(converged, WORKER, weights=None)), gate)
    c.reconcile({Reason("start")})
    assert c.operations.join(20) and Reason("operation") in requests.wait(timeout=5)
    c.reconcile({Reason("operation")})  # the failure is recorded now
    assert gate.batches == [[f"weights/{WORKER}"]]
    return c, gate


def test_a_day_stepped_back_does_not_hold_a_step_for_a_day(desired_path, tmp_path, clocks, converged):
    c, gate = _backed_off(desired_path, tmp_path, clocks, converged)
    clocks.step(-DAY)
    clocks.passes(2.0)  # past the backoff (at most 1.2 s)
    c.reconcile({Reason("resync")})
    assert len(gate.batches) == 2, "the backoff ended on the loop's clock"


def test_a_day_stepped_forward_does_not_end_a_backoff(desired_path, tmp_path, clocks, converged):
    c, gate = _backed_off(desired_path, tmp_path, clocks, converged)
    clocks.step(DAY)
    clocks.passes(0.5)  # within the backoff (at least 0.8 s)
    c.reconcile({Reason("resync")})
    assert len(gate.batches) == 1, "still backing off"
    assert 0 < (c._requeue_after(None) or (0, ""))[0] <= 0.7, "and due when the backoff really ends"


def test_two_hours_stepped_forward_do_not_restart_a_model_in_its_cold_start(desired_path, tmp_path, clocks,
                                                                           converged):
    """A container 10 s old that has not served yet: its cold start (health_timeout, 1 h here) and its failure
    (unhealthy_grace) are measured on the loop's clock; the step made it 2 h old and 2 h failing."""
    cold = _serving(desired_path, converged, ServingApi(), started_at=clocks.wall_now - 10)
    gate = Gate()
    c, _ = _controller(desired_path, tmp_path, clocks, Script(cold), gate)
    try:
        c.reconcile({Reason("start")})
        assert _planned(c) == ["await-health"]
        clocks.step(2 * 3600)
        clocks.passes(10)
        c.reconcile({Reason("resync")})
        assert "stop-serving" not in _planned(c), "restarted in the middle of its cold start"
        assert _planned(c) == ["await-health"]
    finally:
        gate.release.set()
        assert c.operations.join(20)


def test_a_day_stepped_back_does_not_delay_a_wedged_restart(desired_path, tmp_path, clocks, converged):
    """It served, then failed; the clock went back a day while it failed: restarted after the grace all the same."""
    from reconciler.core.spec import load

    grace = load(desired_path).serving.unhealthy_grace
    name = load(desired_path).served_name
    served = _serving(desired_path, converged, ServingApi(reachable=True, healthy=True, models=[name]))
    wedged = _serving(desired_path, converged, ServingApi(reachable=True, healthy=True, models=[name],
                                                          completion_error="timed out after 5 s (curl exit 28)"))
    gate = Gate()
    c, _ = _controller(desired_path, tmp_path, clocks, Script(served, wedged), gate)
    try:
        c.reconcile({Reason("start")})
        clocks.passes(1)
        c.reconcile({Reason("resync")})  # failing since now
        assert "stop-serving" not in _planned(c)
        clocks.step(-DAY)
        clocks.passes(grace + 1)
        c.reconcile({Reason("resync")})
        assert "stop-serving" in _planned(c), "the grace ended on the loop's clock"
    finally:
        gate.release.set()
        assert c.operations.join(20)
