"""serving.verify (issue 52, item 8): healthy meant one token came back, which garbage passes (NGC's SM121 notes on
CUTLASS FP4: "produces garbage output silently"; eugr#363: garbled output after long contexts). A deployment may
declare a question with a checkable answer (NVIDIA's playbook: 12*17 -> 204), asked greedily at the end of every
`await-health`; a wrong answer fails the start: not Ready, ServingVerified False, reconciler_serving_verified 0,
and under policy.on_failed_change rollback a failed change.

The step's transcripts are cases of tests/unit/step_cases/serving.py; here: the field and its rules, the request
the head's shell really sends (a stub curl), the status's judgment, and the controller with the fakes of
test_controller_loop, the verify's own report and failure made by the real step over recorded answers.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest

from reconciler.core.loader import load_file
from reconciler.core.observed import Observed
from reconciler.core.spec import Desired, InvalidDesiredState, load, loads
from reconciler.core.vllm import launch_specs
from reconciler.edge.execute import Outcome, StepResult
from reconciler.edge.facts.base import Section, sealed, split_sections
from reconciler.edge.facts.verify import VERIFY_DEADLINE, VerifyAnswer, parse_verify, verify_argv, verify_fact
from reconciler.edge.steps.actions import Given, Report, StepFailed, advance
from reconciler.edge.steps.serving import verify_answer
from reconciler.loop import conditions, history
from reconciler.loop.conditions import Snapshot, Verified, verify_results
from reconciler.loop.history import FAILED, SERVED
from reconciler.loop.metrics import REGISTRY
from reconciler.loop.reasons import Reason
from tests.unit.conftest import REPO, converged_in_simulator
from tests.unit.loop.test_controller_loop import Script, _condition, _controller
from tests.unit.step_cases.serving import GARBAGE, RIGHT
from tests.unit.step_driver import Driver

SAMPLE = (REPO / "desired-state" / "cluster.yaml").read_text()
ANCHOR = "  health_timeout: 1h"  # the sample's last serving line
PLAYBOOK = "  verify: {prompt: '12*17=', expect: '\\b204\\b'}\n"  # NVIDIA/dgx-spark-playbooks nvidia/vllm/README.md


def _sample(verify: str = PLAYBOOK, extra_args: str | None = None) -> str:
    text = SAMPLE.replace(ANCHOR, verify + ANCHOR, 1)
    if extra_args is not None:
        text = text.replace('extra_args: ["--load-format", "fastsafetensors"]', f"extra_args: {extra_args}", 1)
    return text


def _problems(text: str) -> str:
    with pytest.raises(InvalidDesiredState) as caught:
        loads(text, "c.yaml")
    return str(caught.value)


# ---------------------------------------------------------------------------------------------- the field


def test_absent_is_off_and_the_playbook_check_reads_with_its_defaults():
    assert loads(SAMPLE, "c.yaml").serving.verify is None
    verify = loads(_sample(), "c.yaml").serving.verify
    assert verify is not None
    assert (verify.prompt, verify.expect, verify.max_tokens, verify.endpoint) == ("12*17=", r"\b204\b", 8,
                                                                                   "completions")
    assert verify.matches(" 204") and verify.matches("12*17=204.") and not verify.matches(" 2040")
    assert not verify.matches("ow\ufffd\ufffd{Spar")


@pytest.mark.parametrize(("verify", "said"), [
    ("  verify: {prompt: '12*17=', expect: '(204'}\n",
     "c.yaml:83:38: serving.verify.expect: '(204' is not a regular expression: missing ), unterminated subpattern "
     "at position 0"),
    ("  verify: {prompt: '12*17=', expect: '.*'}\n",
     "c.yaml:83:38: serving.verify.expect: '.*' matches an empty answer, so it checks nothing"),
    ("  verify: {prompt: '12*17=', expect: 204}\n",
     "c.yaml:83:38: serving.verify.expect: must be a string; quote the value (204 was read as int)"),
    ("  verify: {prompt: '12*17=', expect: '204', max_tokens: 65}\n",
     "c.yaml:83:57: serving.verify.max_tokens: must be less than or equal to 64"),
    ("  verify: {prompt: \"12*17=\\e\", expect: '204'}\n",
     "c.yaml:83:20: serving.verify.prompt: contains control characters (only newlines and tabs are allowed in a "
     "prompt)"),
    ("  verify: {prompt: '12*17=', expect: '204', endpoint: responses}\n",
     "c.yaml:83:55: serving.verify.endpoint: must be 'completions' or 'chat'"),
    ("  verify: {expect: '204'}\n", "c.yaml:83:3: serving.verify.prompt: required field is missing"),
])
def test_a_verify_that_cannot_check_is_refused_at_its_line_and_column(verify, said):
    assert said in _problems(_sample(verify))


def test_a_pooling_model_generates_no_text_to_check_so_its_verify_is_refused():
    said = _problems(_sample(extra_args='["--runner", "pooling"]'))
    assert "c.yaml:83:11: serving.verify: a pooling model (--runner pooling in serving.extra_args: embeddings, a " \
           "reranker) generates no text to check: remove serving.verify" in said
    assert loads(SAMPLE.replace('extra_args: ["--load-format", "fastsafetensors"]',
                                'extra_args: ["--runner", "pooling"]'), "c.yaml").serving.verify is None


def test_an_edit_of_the_verify_restarts_nothing():
    """Not part of the launch: the spec hash and the launch's field labels are the same with or without it."""
    before, after = loads(SAMPLE, "c.yaml"), loads(_sample(), "c.yaml")
    assert [(s.spec_hash, s.inputs) for s in launch_specs(before)] == [(s.spec_hash, s.inputs)
                                                                       for s in launch_specs(after)]
    assert before.fingerprint() != after.fingerprint(), "but it is a new generation of the file"


# ---------------------------------------------------------------------------------------------- the request


def _desired(port: int = 8000, endpoint: str = "completions", key: str | None = "sk-test-0123456789") -> Desired:
    data = load_file(REPO / "desired-state" / "cluster.yaml").data
    data["serving"]["port"] = port
    data["serving"]["verify"] = {"prompt": "12*17=", "expect": r"\b204\b", "endpoint": endpoint}
    if key is None:
        data["serving"]["secrets"] = {}
    desired = Desired.model_validate(data)
    return desired.with_secrets({"VLLM_API_KEY": key} if key else {})


@pytest.mark.parametrize(("endpoint", "path", "asks"), [
    ("completions", "/v1/completions", {"prompt": "12*17="}),
    ("chat", "/v1/chat/completions", {"messages": [{"role": "user", "content": "12*17="}]}),
])
def test_the_request_is_greedy_short_and_of_the_served_name(endpoint, path, asks):
    desired = _desired(endpoint=endpoint)
    argv = verify_argv(desired)
    body = json.loads(argv[argv.index("-d") + 1])
    assert body == {"model": "qwen3.5-122b", "max_tokens": 8, "temperature": 0, **asks}
    assert argv[-1] == f"http://127.0.0.1:8000{path}"
    assert argv[argv.index("-m") + 1] == str(VERIFY_DEADLINE)
    assert argv[:3] == ["curl", "-H", "@-"], "the key's header from stdin, as the completion's"
    assert not [a for a in argv if "sk-test" in a]


STUB_CURL = """#!/bin/sh
printf 'ARGV %s\\n' "$*" >> "$CALLS"
case "$*" in *"-H @-"*) echo "STDIN $(cat)" >> "$CALLS" ;; esac
printf '%s\\n200' "$ANSWER"
"""


@pytest.fixture
def root_port():
    """A port this test's own process listens on: the verify is sent only where root alone listens (serving
    containers run as root; the tests run as root, as CI does: docs/testing.md)."""
    with socket.create_server(("127.0.0.1", 0)) as held:
        yield held.getsockname()[1]


def _run_fact(desired: Desired, tmp_path: Path, answer: str) -> tuple[VerifyAnswer, list[str]]:
    """The fact's lines as the head's `sh -s` runs them (sealed, as `read_sections` sends them), a stub curl."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "curl").write_text(STUB_CURL)
    (bin_dir / "curl").chmod(0o755)
    calls = tmp_path / "calls"
    fact = verify_fact(desired)
    script = sealed(list(fact.lines))
    out = subprocess.run(["sh", "-s"], input=script.script, capture_output=True, text=True, timeout=30, check=True,
                         env={"PATH": f"{bin_dir}:{os.environ['PATH']}", "CALLS": str(calls), "ANSWER": answer})
    return fact.parse(split_sections(out.stdout, script.nonce)), calls.read_text().splitlines() if \
        calls.exists() else []


def test_the_key_reaches_the_api_on_stdin_never_in_an_argv(tmp_path, root_port):
    desired = _desired(port=root_port)
    seen, calls = _run_fact(desired, tmp_path, json.dumps({"choices": [{"index": 0, "text": " 204"}]}))
    assert seen == VerifyAnswer(" 204")
    argvs = [line for line in calls if line.startswith("ARGV ")]
    assert len(argvs) == 1 and "sk-test-0123456789" not in argvs[0]
    assert "STDIN Authorization: Bearer sk-test-0123456789" in calls
    assert '"temperature": 0' in argvs[0] and f"127.0.0.1:{root_port}/v1/completions" in argvs[0]


def test_without_a_key_no_header_is_read(tmp_path, root_port):
    seen, calls = _run_fact(_desired(port=root_port, key=None), tmp_path,
                            json.dumps({"choices": [{"index": 0, "text": " 204"}]}))
    assert seen.text == " 204" and not [line for line in calls if line.startswith("STDIN")]


def test_a_port_nobody_listens_on_is_not_asked(tmp_path):
    with socket.create_server(("127.0.0.1", 0)) as held:
        port = held.getsockname()[1]
    seen, calls = _run_fact(_desired(port=port), tmp_path, "{}")
    assert calls == [], "no listener owned by root alone: the key is not sent"
    assert seen == VerifyAnswer(None, "not asked: no process of root's listens on the serving port", answered=False)


REAL_ERROR = ('{"error":{"message":"The model `qwen` does not exist.","type":"NotFoundError","param":"model",'
              '"code":404}}')


@pytest.mark.parametrize(("body", "rc", "chat", "seen"), [
    ('{"choices": [{"index": 0, "text": " 204"}]}\n200', 0, False, VerifyAnswer(" 204")),
    ('{"choices": [{"index": 0, "message": {"content": "204"}}]}\n200', 0, True, VerifyAnswer("204")),
    ("\n000", 28, False, VerifyAnswer(None, f"no answer within {VERIFY_DEADLINE}s", answered=False)),
    ("\n000", 7, False, VerifyAnswer(None, "no answer (curl exit 7)", answered=False)),
    ("", 0, False, VerifyAnswer(None, "not asked: no process of root's listens on the serving port",
                                answered=False)),
    ("\n200", 0, False, VerifyAnswer(None, "the answer has no text: ")),
    (f"{REAL_ERROR}\n404", 0, False, VerifyAnswer(None, "HTTP 404: The model `qwen` does not exist.")),
    ('{"object": "error", "message": "max_tokens is too large", "code": 400}\n400', 0, False,
     VerifyAnswer(None, "HTTP 400: max_tokens is too large")),
    ("<html>\x1b[2Jbad gateway</html>\n502", 0, False,
     VerifyAnswer(None, "HTTP 502: <html>\\x1b[2Jbad gateway</html>")),
    ('{"choices": []}\n200', 0, False, VerifyAnswer(None, 'the answer has no text: {"choices": []}')),
    ("not json\n200", 0, False, VerifyAnswer(None, "the answer has no text: not json")),
    ('{"choices": [{"message": {"content": null}}]}\n200', 0, True,
     VerifyAnswer(None, 'the answer has no content (a reasoning model may think past max_tokens): {"choices": '
                        '[{"message": {"content": null}}]}')),
    ('{"choices": [{"text": "' + "x" * 500 + '"}]}\n200', 0, False, VerifyAnswer("x" * 500)),
])
def test_what_came_back_is_an_answer_a_problem_or_no_answer_yet(body, rc, chat, seen):
    assert parse_verify(Section(body, rc), Section("0 ", 0), chat) == seen


def test_a_quoted_problem_is_one_printable_line_of_at_most_200_characters():
    said = parse_verify(Section("é\n" * 400 + "502", 0), Section("0 ", 0), False).problem
    assert said.startswith("HTTP 502: é\\x0a") and len(said) == len("HTTP 502: ") + 200 and said.endswith("…")


# ---------------------------------------------------------------------------------------------- status


def _observed(desired: Desired, container_id: str | None = "c1") -> Observed:
    from reconciler.core.observed import Container, NodeObservation

    head = desired.head.name
    running = [Container(name="vllm_serving", id=container_id, image="img", state="running")] if container_id else []
    return Observed(nodes={head: NodeObservation(name=head, reachable=True, docker_reachable=True,
                                                 containers=running)})


def _report(desired: Desired, ok: bool, container: str = "c1", **over: object) -> dict[str, object]:
    assert desired.serving.verify is not None
    return {"node": desired.head.name, "deployment": "default", "container": container, "ok": ok,
            "verify": desired.serving.verify.model_dump(), "message": "said", **over}


def test_a_check_counts_for_the_container_it_checked_and_the_verify_it_asked():
    d = _desired()
    head = d.head.name
    assert verify_results(d, _observed(d), {}) == [
        Verified("default", head, None, "not checked: no start was checked since the reconciler started; checked "
                                        "at the next start")]
    assert verify_results(d, _observed(d), {"default": _report(d, False)}) == [Verified("default", head, False,
                                                                                         "said")]
    assert verify_results(d, _observed(d), {"default": _report(d, True)})[0].ok is True
    other = verify_results(d, _observed(d, "c2"), {"default": _report(d, False)})[0]
    assert other.ok is None and "vllm_serving on spark-1a32 is not the container last checked" in other.message
    gone = verify_results(d, _observed(d, None), {"default": _report(d, False)})[0]
    assert gone.ok is None
    edited = verify_results(d, _observed(d), {"default": _report(d, False, verify={"prompt": "2+2="})})[0]
    assert edited.ok is None and "serving.verify changed since the last check" in edited.message
    unseen = Observed(nodes={})
    assert verify_results(d, unseen, {"default": _report(d, False)})[0].ok is False, "a head not seen keeps it"
    assert verify_results(loads(SAMPLE, "c.yaml"), _observed(d), {"default": _report(d, False)}) == [], \
        "none declared: nothing to say"


def _snap(verified: list[Verified]) -> Snapshot:
    from reconciler.core.planning import Plan

    return Snapshot(generation=2, observed_generation=2, plan=Plan([], [], []), verified=verified)


def test_a_wrong_answer_is_not_ready_and_says_so_on_the_api_node():
    wrong = Verified("default", "spark-1a32", False, "serving.verify on spark-1a32: ... answered 'ow'")
    conds = conditions.conditions(_snap([wrong]), ["spark-1a32", "spark-5be3"], [], 0.0)
    ready = _condition({"conditions": conds}, "", "Ready")
    assert ready["status"] == "False" and ready["reason"] == "Degraded"
    assert "serving.verify failed: default" in ready["message"]
    verified = _condition({"conditions": conds}, "spark-1a32", "ServingVerified")
    assert (verified["status"], verified["reason"]) == ("False", "WrongAnswer") and "answered 'ow'" in \
        verified["message"]
    assert not [c for c in conds if c["node"] == "spark-5be3" and c["type"] == "ServingVerified"]
    assert conditions.phase_of(_snap([wrong])) == "Degraded"


@pytest.mark.parametrize(("ok", "status", "reason", "ready"), [
    (True, "True", "Answered", "True"), (None, "Unknown", "NotChecked", "True")])
def test_a_right_answer_or_none_yet_leaves_ready_to_the_plan(ok, status, reason, ready):
    check = Verified("default", "spark-1a32", ok, "m")
    conds = conditions.conditions(_snap([check]), ["spark-1a32"], [], 0.0)
    verified = _condition({"conditions": conds}, "spark-1a32", "ServingVerified")
    assert (verified["status"], verified["reason"]) == (status, reason)
    assert _condition({"conditions": conds}, "", "Ready")["status"] == ready
    assert conditions.phase_of(_snap([check])) == "Converged"


def test_no_verify_declared_is_no_condition():
    conds = conditions.conditions(_snap([]), ["spark-1a32"], [], 0.0)
    assert not [c for c in conds if c["type"] == "ServingVerified"]


# ---------------------------------------------------------------------------------------------- the controller


class VerifyingGate:
    """The fake executor of test_controller_loop's tests, with its await-health made of the real step's end: the
    verify (`steps.serving.verify_answer`) over one recorded answer, its report handed to the controller's progress
    as the executor hands it, its failure the step's. Every other step succeeds. `release` holds the batch."""

    def __init__(self, answer: dict[str, Section], container: str):
        self.answer, self.container = answer, container
        self.release = threading.Event()
        self.batches: list[list[str]] = []

    def __call__(self, plan_, ctx, on_event, skip=lambda step: None, cancel_of=None):
        self.batches.append([s.id for s in plan_.steps])
        for step in plan_.steps:
            on_event("step.start", {"step": step})
        assert self.release.wait(20), "the test never released the batch"
        results = [self._await_health(ctx, s) if s.kind == "await-health" else StepResult(s, "success", 0.1)
                   for s in plan_.steps]
        for r in results:
            on_event("step.end", {"result": r})
        return Outcome(results)

    def _await_health(self, ctx, step) -> StepResult:
        given = Given(ctx.desired, ctx.observed, ctx.generation)
        driver = Driver({f"{step.node} verify {ctx.desired.served_name}": [self.answer]})

        def do(action):
            if isinstance(action, Report):
                ctx.progress(action.event, dict(action.fields))
                return None
            return driver.do(action)
        try:
            advance(verify_answer(given, step.node, self.container), do)
        except StepFailed as exc:
            return StepResult(step, "failed", 0.1, str(exc))
        return StepResult(step, "success", 0.1)


OLD, NEW = "max_model_len: 32768", "max_model_len: 16384"


@pytest.fixture
def verifying_path(desired_path) -> Path:
    desired_path.write_text(desired_path.read_text().replace(ANCHOR, PLAYBOOK + ANCHOR, 1))
    return desired_path


def _edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text
    path.write_text(text.replace(old, new, 1))


def _converged_after_edit(path: Path, seed_snapshot: Path) -> Observed:
    """What the cluster looks like once generation 2 (max_model_len halved) runs: its containers, serving."""
    text = path.read_text()
    _edit(path, OLD, NEW)
    try:
        return converged_in_simulator(load(path, os.environ), seed_snapshot)
    finally:
        path.write_text(text)


def _head_container(observed: Observed, desired: Desired) -> str:
    container = observed.node(desired.head.name).container(desired.serving.container_name)
    assert container is not None and container.id
    return container.id


def _changed_and_started(path, tmp_path, observations, answer, container, policy=None, release=True):
    if policy:
        _edit(path, "policy:", f"policy:\n  on_failed_change: {policy}")
    gate = VerifyingGate(answer, container)
    c, _ = _controller(path, tmp_path, Script(*observations), gate)
    c.image.query = SimpleNamespace(get=lambda wanted: None)  # type: ignore[assignment]  # no image to ask here
    gate.release.set()
    assert c.reconcile({Reason("start")}).phase == "Converged"
    gate.release.clear()
    _edit(path, OLD, NEW)
    c.reconcile({Reason("file")})
    assert c.store.generation == 2 and any("await-health" in s for s in gate.batches[-1]), "the change starts"
    if release:
        gate.release.set()
        assert c.operations.join(20)
    return c, gate


def test_a_change_that_answers_garbage_is_a_failed_change_and_is_rolled_back(verifying_path, tmp_path, converged):
    desired = load(verifying_path, os.environ)
    c, _ = _changed_and_started(verifying_path, tmp_path, [converged], GARBAGE, _head_container(converged, desired))
    assert c.reconcile({Reason("operation")}).phase == "RolledBack"
    assert c.held is not None and (c.held.generation, c.held.to) == (2, 1)
    assert c.desired is not None and c.desired.serving.max_model_len == 32768, "generation 1 is enforced again"
    assert c.held.why == ("await-health/spark-1a32: serving.verify on spark-1a32: completions of '12*17=' (greedy, "
                          "at most 8 tokens) answered 'ow\ufffd\ufffd{Spar', which does not match '\\b204\\b'")
    kept = history.read(tmp_path / "state", verifying_path)
    assert [(e.generation, e.outcome) for e in kept.entries] == [(1, SERVED), (2, "rolled back to 1")]


def test_under_hold_a_wrong_answer_is_never_converged_nor_served(verifying_path, tmp_path, converged, seed_snapshot):
    """policy.on_failed_change hold: the generation stays in force, runs as declared (no drift, nothing planned),
    and still is not Ready, not converged and not recorded as served (a later rollback must not bring it back)."""
    after = _converged_after_edit(verifying_path, seed_snapshot)
    desired = load(verifying_path, os.environ)
    c, _ = _changed_and_started(verifying_path, tmp_path, [converged, converged, after], GARBAGE,
                                _head_container(after, desired), policy="hold")
    for trigger in ("operation", "resync"):
        result = c.reconcile({Reason(trigger)})
        assert c.held is None and c.store.generation == 2
        assert result.phase == "Degraded" and c.status["phase"] == "Degraded", trigger
        assert c.status["lastPlan"]["changes"] is False, "it runs as declared"
        ready = _condition(c.status, "", "Ready")
        assert ready["status"] == "False" and "serving.verify failed: default" in ready["message"]
        verified = _condition(c.status, "spark-1a32", "ServingVerified")
        assert (verified["status"], verified["reason"]) == ("False", "WrongAnswer")
        assert "answered 'ow\ufffd\ufffd{Spar', which does not match" in verified["message"]
        assert REGISTRY.get_sample_value("reconciler_serving_verified", {"deployment": "default"}) == 0
        assert REGISTRY.get_sample_value("reconciler_converged") == 0
        assert c.store.observed_generation == 1, "generation 2 was never reached"
        kept = history.read(tmp_path / "state", verifying_path)
        assert [(e.generation, e.outcome, bool(e.served)) for e in kept.entries] == [
            (1, SERVED, True), (2, FAILED, False)]


def test_a_change_that_answers_right_serves(verifying_path, tmp_path, converged, seed_snapshot):
    after = _converged_after_edit(verifying_path, seed_snapshot)
    desired = load(verifying_path, os.environ)
    c, _ = _changed_and_started(verifying_path, tmp_path, [converged, converged, after], RIGHT,
                                _head_container(after, desired))
    assert c.reconcile({Reason("operation")}).phase == "Converged" and c.held is None
    verified = _condition(c.status, "spark-1a32", "ServingVerified")
    assert (verified["status"], verified["reason"]) == ("True", "Answered") and "answered ' 204'" in \
        verified["message"]
    assert REGISTRY.get_sample_value("reconciler_serving_verified", {"deployment": "default"}) == 1
    assert _condition(c.status, "", "Ready")["status"] == "True"
    assert c.store.observed_generation == 2
    assert history.read(tmp_path / "state", verifying_path).entries[-1].served > 0


def test_a_start_still_checking_its_answer_is_not_served_yet(verifying_path, tmp_path, converged, seed_snapshot):
    """The API serves before await-health has asked its question: a reconcile meanwhile (a resync, an event) sees
    nothing to do, and must not record the generation as served, or its wrong answer would come too late to be a
    failed change."""
    after = _converged_after_edit(verifying_path, seed_snapshot)
    desired = load(verifying_path, os.environ)
    c, gate = _changed_and_started(verifying_path, tmp_path, [converged, converged, after], GARBAGE,
                                   _head_container(after, desired), release=False)
    c.reconcile({Reason("resync")})  # the new generation's containers run and serve; await-health is still in flight
    assert not history.read(tmp_path / "state", verifying_path).entries[-1].served
    gate.release.set()
    assert c.operations.join(20)
    c.reconcile({Reason("operation")})  # the generation brought back restarts: its phase says how that goes
    assert c.held is not None and (c.held.generation, c.held.to) == (2, 1)


def test_a_restart_of_a_generation_that_served_is_no_failed_change(verifying_path, tmp_path, converged,
                                                                  seed_snapshot):
    """A served generation whose restart (for health) answers wrong is repaired in place, not rolled back: it is
    not Ready and says why."""
    desired = load(verifying_path, os.environ)
    gate = VerifyingGate(GARBAGE, _head_container(converged, desired))
    c, _ = _controller(verifying_path, tmp_path, Script(converged), gate)
    c.image.query = SimpleNamespace(get=lambda wanted: None)  # type: ignore[assignment]
    assert c.reconcile({Reason("start")}).phase == "Converged"
    verified = _condition(c.status, "spark-1a32", "ServingVerified")
    assert verified["status"] == "Unknown" and "since the reconciler started" in verified["message"]
    assert REGISTRY.get_sample_value("reconciler_serving_verified", {"deployment": "default"}) is None
    c.reports("serving.verify", {**_report(desired, False, _head_container(converged, desired)),
                                   "message": "answered 'ow'"})  # as await-health's report of a restart
    c.results.start_failed = (1, "default", "await-health/spark-1a32: answered 'ow'")
    assert c.reconcile({Reason("operation")}).phase == "Degraded"
    assert c.held is None and c.store.generation == 1
    assert _condition(c.status, "", "Ready")["status"] == "False"
    assert REGISTRY.get_sample_value("reconciler_serving_verified", {"deployment": "default"}) == 0


# ---------------------------------------------------------------------------------------------- recipes


def test_the_generative_recipes_carry_the_playbook_check_and_the_pooling_ones_none():
    from tests.unit.core.test_recipes import RECIPES

    for name, recipe in RECIPES.items():
        verify = recipe.serving.get("verify")
        if "--runner" in recipe.serving.get("extra_args", []):
            assert verify is None, name
        else:
            assert verify == {"prompt": "12*17=", "expect": r"\b204\b"}, name


# ---------------------------------------------------------------------------------------------- the alert

RUNBOOK = "https://github.com/spark-reconciler/spark-reconciler/blob/main/docs/troubleshooting.md#"
WRONG_ANSWER = (
    "Deployment default did not answer its serving.verify question as expected after its last start (a wrong answer, "
    "an error answer or none), as the reconciler at 127.0.0.1:9464 asked it: /health is 200 and tokens come back, "
    "but they are not the answer (a kernel that computes garbage, a broken quantization or checkpoint, a wrong chat "
    "template). It is not Ready, and nothing restarts it by itself. `reconciler status` (condition ServingVerified) "
    "quotes the answer and the expected pattern.")
NOT_CONVERGED = (
    "The cluster managed by the reconciler at 127.0.0.2:9464 has not matched its desired state for more than 15 "
    "minutes with no step in flight and every node reachable: it is blocked, held, paused or observing only. Look at "
    "reconciler_phase and the drift by node and kind.")
JOB = 'job="spark-reconciler"'

#: promtool unit tests of ReconcilerServingWrongAnswer and of ReconcilerNotConverged's clause for it, in the form of
#: monitoring/alerts.test.yaml (whose every alert needs a firing and a quiet case there: these groups belong in it).
ALERT_TESTS = [
    {"name": "ReconcilerServingWrongAnswer: fires 2m after a wrong answer, not before; a right answer, no check or a "
             "rollback never fires",
     "interval": "1m",
     "input_series": [
         {"series": f'reconciler_serving_verified{{deployment="default",{JOB},instance="127.0.0.1:9464"}}',
          "values": "1 1 0 0 0 0 0 1 1"},
         # rolled back: ReconcilerRolledBack pages for it, the generation brought back is checked at its start
         {"series": f'reconciler_serving_verified{{deployment="default",{JOB},instance="127.0.0.2:9464"}}',
          "values": "0x8"},
         {"series": f'reconciler_rolled_back{{{JOB},instance="127.0.0.2:9464"}}', "values": "1x8"},
         # nothing checked (no series): never a page
         {"series": f'reconciler_rolled_back{{{JOB},instance="127.0.0.3:9464"}}', "values": "0x8"},
     ],
     "alert_rule_test": [
         {"eval_time": "3m", "alertname": "ReconcilerServingWrongAnswer", "exp_alerts": []},
         {"eval_time": "4m", "alertname": "ReconcilerServingWrongAnswer", "exp_alerts": [{
             "exp_labels": {"job": "spark-reconciler", "instance": "127.0.0.1:9464", "deployment": "default",
                            "severity": "critical"},
             "exp_annotations": {
                 "summary": "vLLM of deployment default answers wrong (cluster of the reconciler at 127.0.0.1:9464)",
                 "description": WRONG_ANSWER, "runbook_url": RUNBOOK + "reconcilerservingwronganswer"}}]},
         {"eval_time": "7m", "alertname": "ReconcilerServingWrongAnswer", "exp_alerts": []},
     ]},
    {"name": "ReconcilerNotConverged: not while a deployment answers wrong (ReconcilerServingWrongAnswer pages)",
     "interval": "1m",
     "input_series": [
         {"series": f'reconciler_converged{{{JOB},instance="127.0.0.1:9464"}}', "values": "0x20"},
         {"series": f'reconciler_serving_verified{{deployment="default",{JOB},instance="127.0.0.1:9464"}}',
          "values": "0x20"},
         {"series": f'reconciler_converged{{{JOB},instance="127.0.0.2:9464"}}', "values": "0x20"},
         {"series": f'reconciler_serving_verified{{deployment="default",{JOB},instance="127.0.0.2:9464"}}',
          "values": "1x20"},
     ],
     "alert_rule_test": [
         {"eval_time": "16m", "alertname": "ReconcilerNotConverged", "exp_alerts": [{
             "exp_labels": {"job": "spark-reconciler", "instance": "127.0.0.2:9464", "severity": "warning"},
             "exp_annotations": {
                 "summary": "spark-reconciler on 127.0.0.2:9464 has not converged for 15 minutes",
                 "description": NOT_CONVERGED, "runbook_url": RUNBOOK + "reconcilernotconverged"}}]},
     ]},
]


def test_the_wrong_answer_alert_fires_after_its_for_and_pages_once(tmp_path):
    import shutil

    import yaml

    from tests.unit.repo.test_monitoring import ALERTS, run_promtool

    shutil.copy(ALERTS, tmp_path / "alerts.yaml")
    (tmp_path / "verify.test.yaml").write_text(yaml.safe_dump(
        {"rule_files": ["alerts.yaml"], "evaluation_interval": "1m", "tests": ALERT_TESTS}, sort_keys=False))
    result = run_promtool("test", "rules", "verify.test.yaml", cwd=tmp_path)
    assert result.returncode == 0 and "SUCCESS" in result.stdout, result.stdout + result.stderr


def test_the_wrong_answer_alert_reads_the_exported_gauge():
    from reconciler.loop import metrics

    assert metrics.serving_verified._labelnames == ("deployment",)
    metrics.set_verified({"a": True, "b": False})
    assert REGISTRY.get_sample_value("reconciler_serving_verified", {"deployment": "b"}) == 0
    metrics.set_verified({"a": True})
    assert REGISTRY.get_sample_value("reconciler_serving_verified", {"deployment": "b"}) is None, "no stale 0"
    metrics.set_verified({})


def test_apply_never_calls_a_failed_start_converged():
    """A fresh observation may show the cluster as declared right after await-health failed on the verify's answer,
    which no probe asks again: `apply` says the failed start and exits 1 (seen on the testbed: it said
    "Converged" with exit 0)."""
    from reconciler.core.planning import Step
    from reconciler.edge.execute import Outcome, StepResult
    from reconciler.loop.apply import _failed_start

    health = Step("await-health", "head", "wait")
    why = "serving.verify on head: completions of '12*17=' answered 'stand-in', which does not match '\\b204\\b'"
    assert _failed_start(Outcome([StepResult(health, "failed", 1.0, why + "\nmore")])) == (
        f"await-health/head failed: {why}")
    copy = Step("weights", "worker", "copy", source="head", path="/m")
    assert _failed_start(Outcome([StepResult(copy, "failed", 1.0, "rsync exited 23")])) is None, (
        "a failed copy shows in the next observation: its drift says it")
    assert _failed_start(Outcome([StepResult(health, "success", 1.0, None)])) is None
