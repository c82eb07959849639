"""The reconciler with fakes: observations are scripted, the executor is a gate the test opens, no SSH.

What the loop promises and these tests hold it to: a reconcile never waits for a step (a weight sync in flight,
the next reconcile still repairs a co-tenant on the same node and publishes the sync's progress); a reconcile
that raises still publishes, and says Degraded, never the last Converged; a node whose probe output did not parse
is that node's condition while the other nodes are reconciled; a failed step backs off instead of being relaunched
by the trigger its own end fires.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading

import pytest

from reconciler.cli.status_view import status_text
from reconciler.core.observed import Container, NodeObservation, Observed
from reconciler.core.planning import plan
from reconciler.core.simulate import apply_plan
from reconciler.core.spec import load
from reconciler.loop.metrics import REGISTRY
from reconciler.loop.operations import Operations
from reconciler.loop.reasons import Reason
from reconciler.loop.triggers import ReconcileRequests
from tests.unit.controllers import make_controller

HEAD, WORKER = "spark-1a32", "spark-5be3"


class Gate:
    """A fake executor: each batch blocks until released (or until each of its steps is cancelled); steps fail
    when their kind is in `failing`. Like the real one, it asks `skip` before it starts a step, and each step
    has its own cancel event (`cancel_of`, else the batch's)."""

    def __init__(self, failing: tuple[str, ...] = ()):
        self.release = threading.Event()
        self.batches: list[list[str]] = []
        self.contexts: list = []  # each batch's StepContext: its cancel is what a shutdown sets
        self.cancels: dict[str, threading.Event] = {}  # step id -> its own cancel event
        self.failing = failing

    def cancelled(self, step_id: str) -> bool:
        return self.cancels[step_id].is_set()

    def __call__(self, plan_, ctx, on_event, skip=lambda step: None, cancel_of=None):
        from reconciler.edge.execute import Outcome, StepResult

        self.batches.append([s.id for s in plan_.steps])
        self.contexts.append(ctx)
        own = {s.id: cancel_of(s) if cancel_of else ctx.cancel for s in plan_.steps}
        self.cancels.update(own)
        for step in plan_.steps:
            assert skip(step) is None, "a step vetoed before it started: not what these tests do"
            on_event("step.start", {"step": step})
        for _ in range(2000):  # bounded by polls, not the clock: 20 s unloaded, never forever
            if self.release.wait(0.01) or all(e.is_set() for e in own.values()):
                break
        else:
            raise AssertionError("the test never released the batch")
        results = [StepResult(s, "cancelled" if own[s.id].is_set() else
                              "failed" if s.kind in self.failing else "success", 0.1, "rsync exited 23")
                   for s in plan_.steps]
        for r in results:
            on_event("step.end", {"result": r})
        return Outcome(results)


class FakeSessions:
    """No SSH: only the head's lease companion is answered (always granted, and held until the end; tests/unit/
    test_lease.py runs the real one)."""

    def __init__(self, desired):
        pass

    def __getitem__(self, node):
        return self

    @contextlib.contextmanager
    def companion(self, argv, *, timeout, stdin, open_timeout):
        yield GrantedLease()

    def update(self, desired):
        pass

    def close(self):
        pass


class GrantedLease:
    """The companion that took the lock: says `ok`, then runs (nothing more to read) until ended."""

    def __init__(self):
        self.said = False

    def line(self, timeout):
        from reconciler.edge.ssh import CommandTimeout

        if not self.said:
            self.said = True
            return "ok"
        raise CommandTimeout("head", "still holding")

    def end(self, timeout):
        from reconciler.edge.ssh import Result

        return Result("", "", 0)


class Script:
    """observe_fn: returns the observations in turn (the last one forever); an exception instance is raised."""

    def __init__(self, *observations):
        self.queue = list(observations)

    def __call__(self, desired, sessions, timeout, cancel, ask_flags):
        item = self.queue.pop(0) if len(self.queue) > 1 else self.queue[0]
        if isinstance(item, Exception):
            raise item
        return item, dict.fromkeys(item.nodes, 0.01)


@pytest.fixture
def converged(desired_path, seed_snapshot) -> Observed:
    desired = load(desired_path, os.environ)  # the values the controller takes (conftest._sample_secrets)
    after = Observed.model_validate(json.loads(seed_snapshot.read_text()))
    for _ in range(3):
        after = apply_plan(desired, after, plan(desired, after))
    assert not plan(desired, after).changes
    return after


def _with(observed: Observed, node: str, **update) -> Observed:
    return observed.model_copy(update={"nodes": {**observed.nodes, node: observed.node(node).model_copy(
        update=update)}})


def _controller(desired_path, tmp_path, script, gate):
    requests = ReconcileRequests()
    ops = Operations(on_end=lambda: requests.request(Reason("operation")), run=gate)
    c = make_controller(desired_path, tmp_path / "state", requests, threading.Event(), events=False,
                   observe_fn=script, sessions_factory=FakeSessions, operations=ops)
    return c, requests


def _condition(status, node, type_):
    return next(c for c in status["conditions"] if c["node"] == node and c["type"] == type_)


def test_a_weight_sync_in_flight_does_not_stop_the_next_reconcile_from_repairing_a_co_tenant(
        desired_path, tmp_path, converged):
    no_weights = _with(converged, WORKER, weights=None)
    intruder = Container(name="intruder", id="i1", image="busybox", state="running")
    with_intruder = _with(no_weights, WORKER, containers=[*no_weights.node(WORKER).containers, intruder])
    gate = Gate()
    c, requests = _controller(desired_path, tmp_path, Script(no_weights, with_intruder), gate)
    try:
        c.reconcile({Reason("start")})
        assert gate.batches == [[f"weights/{WORKER}"]]
        c.operations.progress("weights", WORKER, 64 * 2**20, 128 * 2**20)

        second = c.reconcile({Reason("docker")})  # returns although the sync is still in flight
        assert gate.batches[-1] == [f"stop-container/{WORKER}/intruder"], "the repair runs beside the sync"
        assert second.phase == "Converging"
        status = c.status
        ops = {o["step"]: o for o in status["operations"]}
        assert ops[f"weights/{WORKER}"]["bytesDone"] == 64 * 2**20, "progress is in /status during the sync"
        progressing = _condition(status, "", "Progressing")
        assert progressing["status"] == "True" and progressing["reason"] == "StepsRunning"
        assert f"weights/{WORKER}" in progressing["message"]
        assert REGISTRY.get_sample_value("reconciler_operations_in_flight", {"kind": "weights"}) == 1
        shown = status_text(status, 200, status["time"])
        assert f"weights/{WORKER}" in shown and "64.0 MiB of 128.0 MiB (50%)" in shown, "`reconciler status` too"

        c.reconcile({Reason("resync")})
        assert len(gate.batches) == 2, "nothing is launched twice while in flight"
    finally:
        gate.release.set()
        assert c.operations.join(20)
    assert Reason("operation") in requests.wait(timeout=0), "an operation's end is a trigger"


def test_a_reconcile_that_raises_publishes_degraded_and_never_the_last_converged(desired_path, tmp_path, converged):
    c, _ = _controller(desired_path, tmp_path, Script(converged, ValueError("meminfo without MemAvailable")),
                       Gate())
    assert c.reconcile({Reason("start")}).phase == "Converged"
    assert REGISTRY.get_sample_value("reconciler_converged") == 1
    before = REGISTRY.get_sample_value("reconciler_last_reconcile_timestamp_seconds")
    converged_at = c.status["lastConverged"]
    assert converged_at > 0  # `reconciler status`: "converged 3m ago"

    result = c.reconcile({Reason("resync")})
    assert result.phase == "Degraded"
    assert c.status["phase"] == "Degraded"
    assert "reconcile crashed: ValueError: meminfo without MemAvailable" in c.status["lastError"]
    assert REGISTRY.get_sample_value("reconciler_converged") == 0
    assert _condition(c.status, "", "Ready")["status"] == "False"
    assert REGISTRY.get_sample_value("reconciler_last_reconcile_timestamp_seconds") >= before
    assert c.status["lastConverged"] == converged_at, "a crashed reconcile is no convergence"


def test_a_node_whose_probe_output_does_not_parse_is_that_nodes_condition_only(desired_path, tmp_path, converged):
    hostile = _with(converged, HEAD, probe_error="meminfo: KeyError: 'MemAvailable'", containers=[], fabric=None,
                    memory=None, weights=None, serving=None, docker_reachable=False)
    worker = hostile.node(WORKER)
    hostile = _with(hostile, WORKER, containers=[*worker.containers,
                                                 Container(name="intruder", id="i1", image="b", state="running")])
    gate = Gate()
    c, _ = _controller(desired_path, tmp_path, Script(hostile), gate)
    try:
        c.reconcile({Reason("start")})
        assert gate.batches == [[f"stop-container/{WORKER}/intruder"]], "the other node is reconciled"
        probed = _condition(c.status, HEAD, "Probed")
        assert (probed["status"], probed["reason"]) == ("False", "ProbeFailed")
        assert "MemAvailable" in probed["message"]
        assert _condition(c.status, WORKER, "Probed")["status"] == "True"
        assert _condition(c.status, HEAD, "DockerReachable")["status"] == "Unknown"
        assert c.status["phase"] == "Blocked"
    finally:
        gate.release.set()
        assert c.operations.join(20)


def test_a_failed_step_backs_off_instead_of_being_relaunched_by_its_own_end(desired_path, tmp_path, converged):
    no_weights = _with(converged, WORKER, weights=None)
    gate = Gate(failing=("weights",))
    gate.release.set()
    c, requests = _controller(desired_path, tmp_path, Script(no_weights), gate)
    c.reconcile({Reason("start")})
    assert c.operations.join(20)
    assert Reason("operation") in requests.wait(timeout=5)
    after = c.reconcile({Reason("operation")})
    assert gate.batches == [[f"weights/{WORKER}"]], "backing off: not relaunched at once"
    assert "rsync exited 23" in c.status["lastError"]
    assert after.requeue_after is not None and 0 < after.requeue_after <= 30, "looked at again when the backoff ends"


def test_a_probe_that_cannot_be_answered_without_a_valid_file_is_honest(tmp_path):
    path = tmp_path / "cluster.yaml"
    path.write_text("nodes: [\n")
    c, _ = _controller(path, tmp_path, Script(Observed(nodes={})), Gate())
    result = c.reconcile({Reason("start")})
    assert result.phase == "Invalid"
    assert _condition(c.status, "", "DesiredStateValid")["status"] == "False"


def test_probe_failed_node_observation_round_trips_as_a_snapshot():
    obs = NodeObservation(name="n", reachable=True, probe_error="containers: TypeError: ...")
    assert NodeObservation.model_validate_json(obs.model_dump_json()) == obs


def test_a_backoff_that_has_ended_asks_for_no_requeue(desired_path, tmp_path, converged):
    """An ended backoff is due no more: counting it made the daemon reconcile ~13 times a second (seen on the
    testbed while a cold start was awaited after a failed one)."""
    c, _ = _controller(desired_path, tmp_path, Script(converged), Gate())
    c.reconcile({Reason("start")})
    assert c.backoff is not None
    c.backoff.failed("await-health/spark-1a32", "exited", now=0.0)  # its backoff ended long ago
    assert c.backoff.next_due(now=1e9) is None
    assert c._requeue_after(converged) is None
    c.backoff.failed("weights/spark-5be3", "rsync exited 23", now=2e9)  # one still running (in the future)
    assert c.backoff.next_due(now=1e9) is not None
    seconds, why = c._requeue_after(converged)
    assert seconds > 0 and why == "backoff-ended:weights/spark-5be3", "the retry says which step it is for"


def test_serving_that_fails_within_its_grace_is_looked_at_again_soon(desired_path, tmp_path, converged):
    """No event says "the API stopped answering": the loop must not wait for the grace's end or the resync to
    notice that the failure became a crash (seen on the testbed: a rank killed, the plan saw the head failing
    first and waited 300 s, the container's exit arriving in between unnoticed)."""
    from reconciler.core.observed import ServingApi
    from reconciler.loop.requeue import UNHEALTHY_RECHECK

    served = ServingApi(reachable=True, healthy=True, models=["x"], completion_error="curl exit 28",
                     unhealthy_for=1.0, served_before=True)
    head = converged.node(HEAD)
    failing = _with(converged, HEAD, serving=served)
    c, _ = _controller(desired_path, tmp_path, Script(failing), Gate())
    c.reconcile({Reason("start")})
    assert c._requeue_after(failing) == (UNHEALTHY_RECHECK, "health-recheck")
    assert c._requeue_after(converged) is None and head.serving is not None


def test_a_docker_event_is_looked_at_again_once_its_state_can_show(desired_path, tmp_path, converged):
    """dockerd announces a container's death before `/containers/json` shows it (moby daemon/monitor.go): the
    reconcile the event triggered sees the rank still running. It must look again shortly, not at the next
    health recheck or resync; the second look, triggered by nothing new, asks for no third."""
    from reconciler.loop.requeue import EVENT_SETTLE

    c, _ = _controller(desired_path, tmp_path, Script(converged), Gate())
    c.reconcile({Reason("start")})
    settled = c.reconcile({Reason("docker", "spark-5be3")})
    assert (settled.requeue_after, settled.requeue_reason) == (EVENT_SETTLE, "event-settle")
    assert c.reconcile({Reason("docker", "spark-5be3"), Reason("link", "spark-1a32")}).requeue_after == EVENT_SETTLE
    assert c.reconcile({Reason("requeue")}).requeue_after is None
    assert c.reconcile({Reason("link", "spark-5be3")}).requeue_after is None, "ip monitor reports what the kernel did"


def test_a_long_resync_still_renews_the_lease_every_minute(desired_path, tmp_path, converged):
    """resync_interval: 1h with nothing else happening: the daemon still looks at its lease every minute (a lease
    lost is seen, and taken back before anything starts, within a minute)."""
    from reconciler.edge.lease import RENEW_AFTER

    desired_path.write_text(desired_path.read_text().replace("resync_interval: 30s", "resync_interval: 1h"))
    c, _ = _controller(desired_path, tmp_path, Script(converged), lambda *a, **k: None)
    result = c.reconcile({Reason("start")})
    assert c.manager.lease is not None and c.manager.lease.holding
    assert result.requeue_after == RENEW_AFTER


def test_a_nodes_trouble_is_a_warning_once_and_a_refused_host_key_an_error(desired_path, tmp_path, converged):
    """Issue 33, item 5: an unreachable node was not in the log at all (only in /status); at every reconcile it
    would drown the rest. Said once when it starts or changes, at warning (an error when someone must act: a host
    key refused), and its end at info."""
    from structlog.testing import capture_logs

    from reconciler.loop.reports import progress_level

    down = _with(converged, WORKER, reachable=False, error="cannot reach spark@10.0.0.2:22: timed out")
    refused = _with(converged, WORKER, reachable=False, error="HostKeyRejected: host key for 10.0.0.2 CHANGED")
    with capture_logs() as logs:
        c, _ = _controller(desired_path, tmp_path, Script(down, down, refused, converged), lambda *a, **k: None)
        for _ in range(4):
            c.reconcile({Reason("resync")})
    said = [(e["log_level"], e["event"], e.get("error", "")[:15]) for e in logs if e["event"].startswith("node.")]
    assert said == [("warning", "node.unreachable", "cannot reach sp"), ("error", "node.unreachable",
                                                                          "HostKeyRejected"),
                    ("info", "node.recovered", "")]
    assert [progress_level(e) for e in ("weights.progress", "weights.start", "ledger.unwritten")] == [
        "debug", "info", "warning"], "a step's report of trouble is a warning too"
