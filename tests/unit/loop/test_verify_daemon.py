"""Issue 33, item 4: the full weight verification as a low-priority operation of the daemon.

The controller with fakes (scripted observations, a gate for the steps, a scripted verify instead of the hashing):
a verify asked of the daemon waits while a sync to its node is in flight, yields to a serving restart that wants
to start (and runs again after it), shows in /status, is cancelled by a new generation, and the request is refused
when it is not this daemon's to take. The hashing itself is tests/e2e/test_verify.py's (the real testbed).
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from reconciler.core.exits import Exit
from reconciler.core.observed import ServeFlags
from reconciler.core.vllm import parse_serve_help
from reconciler.edge.daemon_client import exit_code
from reconciler.edge.image_flags import flags_wanted
from reconciler.edge.ssh import Cancelled
from reconciler.loop.operations import FlagsQuery, Operations, verify_conflict, verify_waits
from reconciler.loop.reasons import Reason
from reconciler.loop.triggers import ReconcileRequests
from tests.unit.controllers import make_controller
from tests.unit.loop.test_controller_loop import HEAD, WORKER, FakeSessions, Gate, Script, _with

FIXTURES = Path(__file__).parents[1] / "fixtures"

MATCH = {"node": WORKER, "outcome": "match", "message": f"{WORKER}: 4 files match {HEAD} (sha256)", "error": None}


class FakeVerify:
    """verify_fn: each call takes the next behaviour: a result to return, or "block" (wait until cancelled, then
    raise Cancelled as a cancelled hashing command does)."""

    def __init__(self, *behaviours):
        self.behaviours = list(behaviours)
        self.calls: list[tuple[str, bool]] = []
        self.running = threading.Event()

    def __call__(self, desired, sessions, node, repair, cancel):
        self.calls.append((node, repair))
        behaviour = self.behaviours.pop(0)
        if behaviour == "block":
            self.running.set()
            assert cancel.wait(20), "never cancelled"
            raise Cancelled(node, "`sha256sum` cancelled")
        return dict(behaviour, node=node)


def controller(desired_path, tmp_path, observations, gate, verify):
    requests = ReconcileRequests()
    ops = Operations(on_end=lambda: requests.request(Reason("operation")), run=gate)
    c = make_controller(desired_path, tmp_path / "state", requests, threading.Event(), events=False,
                   observe_fn=observations, sessions_factory=FakeSessions, operations=ops, verify_fn=verify)
    return c, requests


def ask(c, desired_path, repair=False, node=None):
    return c.verify_request({"file": str(desired_path), "repair": repair, "node": node})


def record(c) -> dict:
    return c.status["verifyRequests"][-1]


def end_of_verify(c, requests) -> set[Reason]:
    assert c.verifier.join(20)
    return requests.wait(timeout=5)


def flags_known(c, observed) -> None:
    """The serving image's flags as vLLM 0.32.0's `vllm serve --help=all` lists them: a restart may be planned."""
    known = parse_serve_help((FIXTURES / "vllm-0.32.0-cpu-serve-help-all.txt").read_text())
    answered = threading.Event()
    c.image.query = FlagsQuery(lambda holder, image_id: ServeFlags(image_id=image_id, flags=known),
                                   on_answer=answered.set)
    c.image.query.get(flags_wanted(c.desired, observed))
    assert answered.wait(5)


def without_serving(observed, node):
    return _with(observed, node, containers=[x for x in observed.node(node).containers if x.name != "vllm_serving"])


def test_a_verify_waits_while_a_sync_to_its_node_is_in_flight(desired_path, tmp_path, converged):
    gate, verify = Gate(), FakeVerify(MATCH)
    c, requests = controller(desired_path, tmp_path, Script(_with(converged, WORKER, weights=None), converged),
                             gate, verify)
    try:
        c.reconcile({Reason("start")})
        assert gate.batches == [[f"weights/{WORKER}"]]
        code, answer = ask(c, desired_path)
        assert code == 202 and answer["targets"] == [WORKER]
        assert Reason("verify-request") in requests.wait(timeout=0), "a verify request is a trigger"
        c.reconcile({Reason("verify-request")})
        assert verify.calls == [], "no hashing while the tree is being written"
        assert record(c)["state"] == "pending"
        assert record(c)["waiting"] == f"{WORKER}: weights/{WORKER} is in flight"
    finally:
        gate.release.set()
        assert c.operations.join(20)
    c.reconcile({Reason("operation")})
    assert verify.calls == [(WORKER, False)]
    assert Reason("verify-ended", WORKER) in end_of_verify(c, requests), "a verify's end is a trigger"
    done = record(c)
    assert done["state"] == "done" and [r["outcome"] for r in done["results"]] == ["match"]
    assert exit_code(done["results"]) == Exit.OK


def test_a_running_verify_yields_to_a_serving_restart_and_runs_again_after_it(desired_path, tmp_path, converged):
    gate, verify = Gate(), FakeVerify("block", MATCH)
    broken = without_serving(converged, WORKER)
    c, requests = controller(desired_path, tmp_path, Script(converged, converged, broken, broken, converged),
                             gate, verify)
    c.reconcile({Reason("start")})
    flags_known(c, converged)
    ask(c, desired_path)
    c.reconcile({Reason("verify-request")})
    assert verify.running.wait(5), "the verify started on a converged cluster"
    running = [o for o in c.status["operations"] if o["kind"] == "verify"]
    assert [(o["step"], o["state"]) for o in running] == [(f"verify/{WORKER}", "running")], "progress in /status"

    c.reconcile({Reason("docker", WORKER)})  # the serving container is gone: the restart must not wait for a hash
    assert gate.batches == [], "the restart waits only until the verify has stopped"
    assert Reason("verify-ended", WORKER) in end_of_verify(c, requests)
    waiting = record(c)
    assert waiting["state"] == "pending" and waiting["todo"] == [WORKER], "to be verified again, not dropped"
    assert f"stop-serving/{HEAD}/vllm_serving" in waiting["waiting"]  # "yielded to ..." or "... starts first"
    try:
        c.reconcile({Reason("verify-ended", WORKER)})
        assert gate.batches and all(s.split("/")[0] in ("stop-serving", "start-serving", "launch-model",
                                                        "await-health") for s in gate.batches[0])
        assert verify.calls == [(WORKER, False)], "not again while the serving chain is in flight"
        assert "is in flight" in record(c)["waiting"]
    finally:
        gate.release.set()
        assert c.operations.join(20)
    c.reconcile({Reason("operation")})
    assert verify.calls == [(WORKER, False), (WORKER, False)], "verified again once the restart ended"
    end_of_verify(c, requests)
    assert [r["outcome"] for r in record(c)["results"]] == ["match"]


def test_a_new_generation_that_changes_the_weights_cancels_the_verify_and_says_so(desired_path, tmp_path, converged):
    """Issue 34: only an edit of what the verify checks ends it; an edit of resync_interval (or max_model_len) is a
    new generation too, and the verify goes on."""
    verify = FakeVerify("block")
    c, requests = controller(desired_path, tmp_path, Script(converged), Gate(), verify)
    c.reconcile({Reason("start")})
    ask(c, desired_path, repair=True)
    c.reconcile({Reason("verify-request")})
    assert verify.running.wait(5) and verify.calls == [(WORKER, True)]
    desired_path.write_text(desired_path.read_text().replace("resync_interval: 30s", "resync_interval: 45s"))
    c.reconcile({Reason("file")})
    assert c.verifier.verifying() == WORKER and record(c)["state"] == "running", "another generation, same weights"
    desired_path.write_text(desired_path.read_text().replace("revision: main", "revision: 0123abc"))
    c.reconcile({Reason("file")})
    end_of_verify(c, requests)
    done = record(c)
    assert done["state"] == "done" and done["results"][0]["outcome"] == "cancelled"
    assert f"the weights to verify on {WORKER} changed in the new desired state" in done["results"][0]["message"]
    assert exit_code(done["results"]) == Exit.ERROR


def test_a_request_that_is_not_this_daemons_to_take_is_refused(desired_path, tmp_path, converged):
    c, _ = controller(desired_path, tmp_path, Script(converged), Gate(), FakeVerify("block"))
    c.reconcile({Reason("start")})
    copy = desired_path.with_name("copy.yaml")
    copy.write_text(desired_path.read_text())
    code, answer = ask(c, copy)
    assert (code, answer["reason"]) == (409, "other-file") and str(desired_path) in answer["error"]
    code, answer = ask(c, desired_path, node="spark-1a32")
    assert code == 400 and "the source" in answer["error"], "the source is compared with, never verified"
    assert ask(c, desired_path, node=WORKER)[0] == 202
    code, again = ask(c, desired_path, node=WORKER)
    assert code == 202 and again["joined"], "a second ask of the same joins the first"
    code, answer = ask(c, desired_path, repair=True)
    assert (code, answer["reason"]) == (409, "busy")
    assert len(c.status["verifyRequests"]) == 1


def test_a_repair_is_not_taken_by_a_daemon_that_does_not_enforce(desired_path, tmp_path, converged):
    desired_path.write_text(desired_path.read_text().replace("mode: enforce", "mode: observe"))
    c, _ = controller(desired_path, tmp_path, Script(converged), Gate(), FakeVerify(MATCH))
    c.reconcile({Reason("start")})
    code, answer = ask(c, desired_path, repair=True)
    assert (code, answer["reason"]) == (409, "not-enforcing"), "the command repairs by itself, under the lease"
    assert ask(c, desired_path)[0] == 202, "a verify without repair changes nothing: the daemon runs it"


@pytest.mark.parametrize(("outcomes", "code"), [
    ([], Exit.OK), (["match", "match"], Exit.OK), (["match", "differ"], Exit.CHANGES),
    (["differ", "unreachable"], Exit.UNREACHABLE), (["unreachable", "problem"], Exit.ERROR),
    (["match", "cancelled"], Exit.ERROR), (["error"], Exit.ERROR), (["what"], Exit.ERROR)])
def test_the_exit_code_of_a_verify(outcomes, code):
    assert exit_code([{"outcome": o} for o in outcomes]) == code


def test_what_a_verify_does_not_run_beside():
    from reconciler.core.planning import Step

    def step(kind, node):
        return Step(kind=kind, node=node, reason="test")

    assert verify_conflict(step("weights", "w"), "w", "h") and not verify_conflict(step("weights", "x"), "w", "h")
    assert verify_conflict(step("download", "h"), "w", "h"), "the source's tree is what the target is compared with"
    assert verify_conflict(step("start-serving", "h"), "w", "h") and verify_conflict(step("await-health", "w"),
                                                                                      "w", "h")
    assert not verify_conflict(step("stop-container", "w"), "w", "h") and not verify_conflict(step("link", "w"),
                                                                                             "w", "h")
    assert verify_waits("w", "h", [step("link", "w")]) is None
    assert verify_waits("w", "h", [step("link", "w"), step("weights", "w")]) == "weights/w is in flight"
