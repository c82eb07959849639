"""serving.verify: one greedy request through the head's API and its answer (`verify_fact`)."""

from __future__ import annotations

import json
from dataclasses import dataclass

from reconciler.core.spec import Desired
from reconciler.core.text import printable
from reconciler.edge.facts.base import Fact, Section, node_json, node_output
from reconciler.edge.facts.ports import parse_port_holder, port_owner_script
from reconciler.edge.facts.serving import api_argv, auth_header
from reconciler.edge.ssh import quote, quote_word

VERIFY_DEADLINE = 30  # seconds for the verify's answer: a few tokens, after the first request of a fresh engine


def verify_argv(desired: Desired) -> list[str]:
    """serving.verify's one request (`curl`, body then the HTTP code on its own line), beside the completion's and
    sent the same way (`api_argv`: the API key's header from stdin): greedy (`temperature` 0, so the same weights
    give the same text), at most `max_tokens`, to /v1/completions with the prompt as it is or to
    /v1/chat/completions with the prompt as the user's message. The prompt is the file's, validated there; the
    body is JSON, quoted once."""
    verify = desired.serving.verify
    assert verify is not None, "a verify is asked only of a deployment that declares one"
    common = {"model": desired.served_name, "max_tokens": verify.max_tokens, "temperature": 0}
    if verify.endpoint == "chat":
        body, path = {**common, "messages": [{"role": "user", "content": verify.prompt}]}, "/v1/chat/completions"
    else:
        body, path = {**common, "prompt": verify.prompt}, "/v1/completions"
    url = f"http://127.0.0.1:{desired.serving.port}{path}"
    return api_argv(desired, "-s", "-m", str(VERIFY_DEADLINE), "-H", "Content-Type: application/json",
                    "-w", "\\n%{http_code}", "-d", json.dumps(body), url)


@dataclass(frozen=True)
class VerifyAnswer:
    """What serving.verify's request got: the answer's text (None when there is none), or why not (`problem`:
    printable, short); `answered`: the API gave an HTTP answer (a wrong one included), so asking again changes
    nothing; False while no answer came (curl's deadline, a refused connection): worth another try."""

    text: str | None
    problem: str = ""
    answered: bool = True


VERIFY_SHOWN = 200  # characters of an answer or an error a message quotes


def shown(text: str) -> str:
    """Node text as a message quotes it: one printable line, at most VERIFY_SHOWN characters."""
    text = printable(text)
    return text if len(text) <= VERIFY_SHOWN else text[:VERIFY_SHOWN - 1] + "…"


def _error_of(body: str) -> str:
    """The message of an error answer (vLLM's `{"error": {"message": ...}}`, an older `{"message": ...}`, a
    proxy's `{"detail": ...}`), else the body itself."""
    try:
        doc = node_json(body)
    except ValueError:
        return body
    error = doc.get("error", doc) if isinstance(doc, dict) else None
    if isinstance(error, dict):
        said = error.get("message") or error.get("detail")
        return said if isinstance(said, str) else body
    return error if isinstance(error, str) else body


def _answer_text(body: str, chat: bool) -> str | None:
    """The first choice's text (`text` of a completion, `message.content` of a chat completion); None when the
    answer has none (not JSON, no choice, a null content)."""
    try:
        choices = node_json(body).get("choices")
        choice = choices[0] if isinstance(choices, list) and choices else {}
        text = choice.get("message", {}).get("content") if chat else choice.get("text")
    except (ValueError, AttributeError):
        return None
    return text if isinstance(text, str) else None


@node_output("verify")
def parse_verify(sec: Section | None, port_owner: Section | None, chat: bool) -> VerifyAnswer:
    """serving.verify's section (`verify_fact`). Node bytes never raise: whatever came back is an answer, a problem,
    or no answer yet."""
    holder = parse_port_holder(port_owner)
    if holder is not None:
        return VerifyAnswer(None, f"uid {holder} (not root, so not vLLM) listens on the serving port: not asked")
    if sec is None:
        return VerifyAnswer(None, "not asked", answered=False)
    body, _, code = sec.body.strip().rpartition("\n")
    if not code.strip():  # curl always writes the code (000 without an answer): it did not run
        return VerifyAnswer(None, "not asked: no process of root's listens on the serving port", answered=False)
    if sec.rc == 28:
        return VerifyAnswer(None, f"no answer within {VERIFY_DEADLINE}s", answered=False)
    if sec.rc != 0 or not code.strip().isdigit() or code.strip() == "000":
        return VerifyAnswer(None, f"no answer (curl exit {sec.rc})", answered=False)
    if code.strip() != "200":
        return VerifyAnswer(None, f"HTTP {code.strip()}: {shown(_error_of(body).strip())}")
    text = _answer_text(body, chat)
    if text is None:
        what = "content (a reasoning model may think past max_tokens)" if chat else "text"
        return VerifyAnswer(None, f"the answer has no {what}: {shown(body.strip())}")
    return VerifyAnswer(text)


def verify_fact(desired: Desired) -> Fact[VerifyAnswer]:
    """serving.verify's one request to the head's API (`verify_argv`), asked only when root alone listens on the
    serving port (`port_owner_script`, as the health check asks): the API key travels in the script (stdin of
    `sh -s`) and into curl by a builtin's pipe, never in an argv."""
    verify = desired.serving.verify
    assert verify is not None, "a verify is asked only of a deployment that declares one"
    header = auth_header(desired)
    auth = f"printf %s {quote_word(header.decode())} | " if header else ""
    lines = (*port_owner_script(desired.serving.port, desired.serving.host), "sec verify",
             f"rc=0; if [ \"$owners\" = \"0 \" ]; then {auth}{quote(verify_argv(desired))}; rc=$?; fi; echo; rc $rc")
    chat = verify.endpoint == "chat"
    return Fact(f"verify {desired.served_name}", lines,
                lambda sections: parse_verify(sections.get("verify"), sections.get("port_owner"), chat))
