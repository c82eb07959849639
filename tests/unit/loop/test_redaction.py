"""Secrets never reach a log line, a traceback or /status (issue 16, finding 5).

Each leak is checked on what really goes out: the line a configured structlog logger writes (JSON or console), the
text the standard library's logging and the uncaught-exception printers write, the status document the publisher
stores. The oracle is always `secret not in output`, independent of the patterns that do the redacting.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import sys
import threading
from collections.abc import Iterator

import pytest
import structlog
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from reconciler.edge import log
from tests.unit.examples import examples

SHORT = "Xy7abc"  # a short value: redacted by the name it stands behind, not by registration
HF = "hf_" + "aB3dE5gH7jK9mN1pQ3rS5tU7vW9xY1zZ2c"  # the Hugging Face token format: hf_ and 30+ letters and digits

# Every form a secret takes on a command line, in a header, in a JSON or Python dict printed into a message.
FORMS = [
    f"vllm serve m --api-key={SHORT} --port 8000",
    f"vllm serve m --api-key {SHORT} --port 8000",
    f"vllm serve m --api_key {SHORT}",
    f"huggingface-cli download m --hf-token={SHORT}",
    f"huggingface-cli download m --hf-token {SHORT}",
    f"curl -H 'Authorization: Bearer {SHORT}' http://127.0.0.1:8000/v1/models",
    f"authorization: bearer {SHORT}",
    f"401 for Bearer {SHORT}",
    f'env: {{"HF_TOKEN": "{SHORT}", "VLLM_PORT": "8000"}}',
    f"env: {{'hf_token': '{SHORT}'}}",
    f'{{"Hf_Token": "{SHORT}"}}',
    f'{{"vllm_api_key":"{SHORT}"}}',
    f"docker run -e hf_token={SHORT} vllm",
    f"docker run -e VLLM_API_KEY={SHORT} vllm",
    f"X-Api-Key: {SHORT}",
    f"pulled {HF} with revision main",
    f"cached as x{HF}",
]
SECRETS = [SHORT, HF]


@contextlib.contextmanager
def no_registered_secrets() -> Iterator[None]:
    saved = getattr(log, "_secrets", ())
    log._secrets = ()
    try:
        yield
    finally:
        log._secrets = saved


class Captured:
    """What the test wrote to stderr so far. capsys, because log.configure binds its logger to the sys.stderr of
    the moment, and pytest sets sys.stderr anew when the test's call begins (a fixture's replacement is gone)."""

    def __init__(self, capsys: pytest.CaptureFixture[str]) -> None:
        self.capsys, self.text = capsys, ""

    def getvalue(self) -> str:
        self.text += self.capsys.readouterr().err
        return self.text


@pytest.fixture
def stderr(capsys) -> Iterator[Captured]:
    """stderr captured, and everything log.configure changes put back afterwards."""
    out = Captured(capsys)
    saved_config = structlog.get_config()
    factory = logging.getLogRecordFactory()
    hooks = sys.excepthook, threading.excepthook
    with no_registered_secrets():
        yield out
    structlog.configure(**saved_config)
    logging.setLogRecordFactory(factory)
    sys.excepthook, threading.excepthook = hooks


def json_lines(out: Captured | io.StringIO) -> list[dict]:
    return [json.loads(line) for line in out.getvalue().splitlines()]


def assert_no_secret(text: str, *secrets: str) -> None:
    for secret in secrets or tuple(SECRETS):
        assert secret not in text, f"{secret!r} leaked:\n{text}"


# -- the forms, in a log line -----------------------------------------------------------------------------------

@pytest.mark.parametrize("form", FORMS)
def test_a_secret_in_a_log_line_is_redacted(stderr, form):
    log.configure(json_lines=True)
    log.get().info(form)
    log.get().warning("step.failed", stderr=form)
    assert_no_secret(stderr.getvalue())
    event, failed = json_lines(stderr)
    assert "***" in event["event"] and "***" in failed["stderr"]


@pytest.mark.parametrize("form", FORMS[:4])
def test_a_secret_in_a_console_log_line_is_redacted(stderr, form):
    log.configure(json_lines=False)
    log.get().info("step.failed", stderr=form)
    assert_no_secret(stderr.getvalue())
    assert "***" in stderr.getvalue()


def test_a_field_named_like_a_secret_is_redacted_whatever_its_case(stderr):
    log.configure(json_lines=True)
    names = ("HF_TOKEN", "Vllm_Api_Key", "apiKey", "client_secret", "Authorization", "ssh_passphrase", "private_key")
    log.get().info("env", **dict.fromkeys(names, SHORT), has_token=True, api_key=None)
    assert_no_secret(stderr.getvalue())
    (line,) = json_lines(stderr)
    assert {line[k] for k in names} == {"***"}
    assert (line["has_token"], line["api_key"]) == (True, None)  # they only say whether there is one


def test_a_secret_nested_in_a_structure_is_redacted(stderr):
    log.configure(json_lines=True)
    log.get().info("launch", spec={
        "serving": {"env": {"HF_TOKEN": SHORT, "VLLM_PORT": "8000"}},
        "argv": ["vllm", "serve", "m", "--api-key", SHORT, "--port", "8000"],
        "notes": ("ok", [{"stderr": f"curl: Authorization: Bearer {SHORT}"}]),
        "pulled": HF,
    })
    assert_no_secret(stderr.getvalue())
    (line,) = json_lines(stderr)
    spec = line["spec"]
    assert spec["serving"]["env"] == {"HF_TOKEN": "***", "VLLM_PORT": "8000"}  # the rest left as it was
    assert spec["argv"] == ["vllm", "serve", "m", "--api-key", "***", "--port", "8000"]


def test_an_object_logged_as_is_is_redacted_as_the_renderer_would_print_it(stderr):
    """The JSON renderer prints repr() of what it cannot serialize: an exception's repr holds its message."""
    log.configure(json_lines=True)
    log.get().warning("step.failed", error=RuntimeError(f"ssh: docker run -e HF_TOKEN={SHORT}"))
    assert_no_secret(stderr.getvalue())
    assert "RuntimeError" in json_lines(stderr)[0]["error"]


# -- tracebacks ---------------------------------------------------------------------------------------------------

def _crash(token: str) -> None:
    # a local, which a traceback showing locals (the console renderer's rich one) would print
    header = f"Authorization: Bearer {token}"  # noqa: F841
    raise RuntimeError(f"docker run -e HF_TOKEN={token} --api-key {token} failed")


@pytest.mark.parametrize("json_lines_", [True, False], ids=["json", "console"])
def test_a_traceback_of_log_exception_is_redacted(stderr, json_lines_):
    log.configure(json_lines=json_lines_)
    try:
        _crash(SHORT)
    except RuntimeError:
        log.get().exception("reconcile.crashed")
    out = stderr.getvalue()
    assert "Traceback" in out and "RuntimeError" in out
    assert_no_secret(out)


def test_a_traceback_passed_as_exc_info_is_redacted(stderr):
    log.configure(json_lines=True)
    try:
        _crash(SHORT)
    except RuntimeError as exc:
        log.get().error("reconcile.crashed", exc_info=exc)
    (line,) = json_lines(stderr)
    assert "Traceback" in line["exception"]
    assert_no_secret(stderr.getvalue())


def test_a_traceback_through_the_standard_librarys_logging_is_redacted(stderr, caplog):
    """paramiko and fabric log through `logging`, tracebacks included: any handler, any formatter."""
    log.configure(json_lines=True)
    try:
        _crash(SHORT)
    except RuntimeError:
        logging.getLogger("paramiko.transport").error("auth failed: %s", f"Bearer {SHORT}", exc_info=True)
    assert "Traceback" in caplog.text and "auth failed: Bearer ***" in caplog.text
    assert_no_secret(caplog.text)


def test_an_uncaught_exception_in_a_thread_is_printed_redacted(stderr, monkeypatch):
    monkeypatch.setattr(threading, "excepthook", threading.__excepthook__)  # the daemon's: the default
    log.configure(json_lines=True)
    thread = threading.Thread(target=_crash, args=(SHORT,), name="batch")
    thread.start()
    thread.join()
    out = stderr.getvalue()
    assert "Exception in thread batch" in out and "RuntimeError" in out
    assert_no_secret(out)


def test_an_uncaught_exception_in_the_main_thread_is_printed_redacted(stderr, monkeypatch):
    monkeypatch.setattr(sys, "excepthook", sys.__excepthook__)
    log.configure(json_lines=True)
    try:
        _crash(SHORT)
    except RuntimeError:
        sys.excepthook(*sys.exc_info())
    assert "RuntimeError" in stderr.getvalue()
    assert_no_secret(stderr.getvalue())


# -- registered values ----------------------------------------------------------------------------------------

REGISTERED = "c0rrect-h0rse-battery-staple"


def test_a_registered_value_is_redacted_wherever_it_stands(stderr):
    log.configure(json_lines=True)
    assert log.register_secret(REGISTERED + "\n")  # as read from a file: the newline is not part of it
    log.get().info(f"joined the ray cluster with {REGISTERED}", extra={"deep": [(f"x{REGISTERED}y",)]})
    try:
        raise ValueError(f"bad reply: {REGISTERED}")
    except ValueError:
        log.get().exception("probe.failed")
    assert_no_secret(stderr.getvalue(), REGISTERED)
    first, _ = json_lines(stderr)
    assert first["extra"] == {"deep": [["x***y"]]}


def test_a_short_value_is_not_registered(stderr):
    """A value of under 8 characters is also an ordinary word or number: redacting all of it would garble every
    line. It stays redacted where it stands behind its name."""
    log.configure(json_lines=True)
    assert not log.register_secret("spark")
    assert not log.register_secret("  admin1  ")
    log.get().info("ssh spark@head-a as admin1", HF_TOKEN="admin1")
    (line,) = json_lines(stderr)
    assert line["event"] == "ssh spark@head-a as admin1" and line["HF_TOKEN"] == "***"


# -- the status document ----------------------------------------------------------------------------------------

def test_the_status_document_is_redacted(tmp_path):
    from reconciler.core.drift import Drift
    from reconciler.core.planning import Blocker, Plan, Step
    from reconciler.loop.conditions import Snapshot
    from reconciler.loop.status import StatusPublisher

    with no_registered_secrets():
        log.register_secret(REGISTERED)
        plan = Plan(
            drift=[Drift("head-a", "serving", "serving/head-a", "vllm serve m",
                         f"vllm serve m --api-key {SHORT} --hf-token={SHORT}")],
            steps=[Step("stop-serving", "head-a", f"argv differs: HF_TOKEN={SHORT}",
                        container="vllm")],
            blocked=[Blocker("head-a", f"registry said 401 to Authorization: Bearer {SHORT}")])
        snap = Snapshot(generation=2, observed_generation=1, plan=plan,
                        file_error=f'serving.env: {{"HF_TOKEN": "{SHORT}"}} is not a string',
                        step_failures=[f"image/head-a: docker login -p {REGISTERED} failed"],
                        held={"image/head-a": f"pull with {HF} refused"})
        publisher = StatusPublisher(tmp_path / "cluster.yaml")
        publisher.publish(snap, ["head-a"], error=None, now=1.0)
        served = json.dumps(publisher.status)
        assert_no_secret(served, SHORT, HF, REGISTERED)
        assert publisher.status["lastPlan"]["steps"][0]["params"] == {"container": "vllm"}
        assert publisher.status["phase"] and publisher.status["lastError"] == "image/head-a: docker login -p *** failed"


# -- what must survive --------------------------------------------------------------------------------------------

ORDINARY = [
    "tokens per second",
    "max_tokens=16",
    "--max-num-batched-tokens 8192",
    "--max-num-batched-tokens=8192 --tokenizer Qwen/Qwen3 --tokenizer-mode auto",
    '{"model": "m", "prompt": "ping", "max_tokens": 1, "temperature": 0}',
    "--api-key is set by the reconciler; use serving.env VLLM_API_KEY (a flag would put the key on every command "
    "line and in `ps`)",
    "a bearer of bad news",
    "ssh spark@10.0.0.1:22 -o ConnectTimeout=5",
    "http://127.0.0.1:8000/v1/completions at 2024-05-01T12:30:00Z",
    "PWD=/home/spark HOME=/home/spark",
    "serving.secrets.VLLM_API_KEY: VLLM_API_KEY is not set in the reconciler's environment",
]


@pytest.mark.parametrize("text", ORDINARY)
def test_ordinary_text_is_not_redacted(text):
    with no_registered_secrets():
        assert log.redact_text(text) == text


def test_ordinary_fields_in_a_log_line_are_not_redacted(stderr):
    """max_tokens is no token: only a name's whole word (token, secret, api key, ...) makes a secret."""
    log.configure(json_lines=True)
    log.get().info("tokens per second", max_tokens=16, max_num_batched_tokens=8192, tokenizer="Qwen/Qwen3",
                   argv=["vllm", "serve", "--max-num-batched-tokens", "8192"])
    (line,) = json_lines(stderr)
    assert (line["event"], line["max_tokens"], line["max_num_batched_tokens"], line["tokenizer"], line["argv"]) == (
        "tokens per second", 16, 8192, "Qwen/Qwen3", ["vllm", "serve", "--max-num-batched-tokens", "8192"])


WORDS = st.sampled_from(["tokens", "per", "second", "max_tokens", "--max-num-batched-tokens", "8192", "16",
                         "tokenizer", "--tokenizer", "node", "head-a", "--port", "Converged", "Qwen/Qwen3", "is",
                         "--served-model-name", "model", "generation"])


@given(st.lists(st.tuples(WORDS, st.sampled_from([" ", "=", ": ", "\n"])), max_size=12))
def test_property_text_of_ordinary_words_survives(parts):
    text = "".join(w + sep for w, sep in parts)
    with no_registered_secrets():
        assert log.redact_text(text) == text


# -- the property: a registered value never survives --------------------------------------------------------------

SECRET_CHARS = st.characters(categories=("L", "N", "P", "S"))  # printable, no whitespace: '*', quotes, '=' too


@settings(suppress_health_check=[HealthCheck.too_slow])
@given(secret=st.text(SECRET_CHARS, min_size=8, max_size=40),
       before=st.text(max_size=60), after=st.text(max_size=60), again=st.booleans())
def test_property_a_registered_value_embedded_anywhere_is_redacted(secret, before, after, again):
    text = before + secret + after + (secret if again else "")
    with no_registered_secrets():
        assert log.register_secret(secret)
        assert secret not in log.redact_text(text)
        redacted = log.redact({"k": [text, (text,)], text: 1})
        assert secret not in redacted["k"][0] and secret not in redacted["k"][1][0]
        assert all(secret not in key for key in redacted)


@settings(suppress_health_check=[HealthCheck.too_slow], **examples(50))
@given(secret=st.text(SECRET_CHARS, min_size=8, max_size=40), before=st.text(max_size=40),
       after=st.text(max_size=40))
def test_property_a_registered_value_never_reaches_a_log_line(secret, before, after):
    out = io.StringIO()
    saved = sys.stderr, structlog.get_config(), logging.getLogRecordFactory(), sys.excepthook, threading.excepthook
    sys.stderr = out
    try:
        with no_registered_secrets():
            log.configure(json_lines=True)
            assert log.register_secret(secret)
            log.get().info(before + secret + after, detail=[after + secret])
            (line,) = json_lines(out)  # the JSON escapes some characters: look at the values it carries
            assert secret not in line["event"] and secret not in line["detail"][0]
    finally:
        sys.stderr = saved[0]
        structlog.configure(**saved[1])
        logging.setLogRecordFactory(saved[2])
        sys.excepthook, threading.excepthook = saved[3], saved[4]
