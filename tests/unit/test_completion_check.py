"""Serving is judged by one real completion, not only /health.

The answers below are recorded from the real vLLM 0.32.0 CPU build serving the testbed's tiny Llama
(testbed/realvllm), through the same curl command line the probe sends; the hung case is what that deployment
did with the worker's fabric link down (/health 200, the completion never answered: curl's exit 28).
"""

from __future__ import annotations

import json

import pytest

from reconciler.drift import diff
from reconciler.loader import load_file
from reconciler.observe import COMPLETION_DEADLINE, Section, completion_argv, parse_completion
from reconciler.observed import Observed, Serving
from reconciler.spec import Desired

REAL_ANSWER = (
    '{"id":"cmpl-aa28977b610327c4","object":"text_completion","created":1796277722,"model":"tiny","choices":'
    '[{"index":0,"text":"ow\\ufffd\\ufffd{Spar","logprobs":null,"finish_reason":"length","stop_reason":null,'
    '"token_ids":null,"prompt_logprobs":null,"prompt_token_ids":null,"routed_experts":null}],"service_tier":null,'
    '"system_fingerprint":"vllm-0.32.0-40fa749c","usage":{"prompt_tokens":1,"total_tokens":6,"completion_tokens":'
    '5,"prompt_tokens_details":null,"completion_tokens_details":null},"kv_transfer_params":null,'
    '"ec_transfer_params":null,"metrics":null}')
NOT_FOUND = ('{"error":{"message":"The model `tiny-moe` does not exist.","type":"NotFoundError","param":"model",'
             '"code":404}}')


@pytest.mark.parametrize(("body", "rc", "expected"), [
    (f"{REAL_ANSWER}\n200\n", 0, None),
    ("\n000\n", 28, f"no answer within {COMPLETION_DEADLINE}s"),
    ("\n000\n", 7, "HTTP 000 (curl exit 7)"),
    (f"{NOT_FOUND}\n404\n", 0, "HTTP 404 (curl exit 0)"),
    ("<html>proxy error</html>\n200\n", 0, "the answer is not JSON"),
    ('{"choices": []}\n200\n', 0, "the answer has no choices"),
    ('["choices"]\n200\n', 0, "the answer is not JSON"),
    ("", 0, "HTTP none (curl exit 0)"),
])
def test_parse_completion_names_what_failed(body, rc, expected):
    assert parse_completion(Section(body, rc)) == expected


def test_completion_request_is_one_token_of_the_served_name(cluster_yaml):
    desired = Desired.model_validate(load_file(cluster_yaml).data)
    argv = completion_argv(desired)
    body = json.loads(argv[argv.index("-d") + 1])
    assert body["model"] == (desired.serving.served_model_name or desired.model.id)
    assert body["max_tokens"] == 1
    assert argv[-1] == f"http://127.0.0.1:{desired.serving.port}/v1/completions"
    assert argv[argv.index("-m") + 1] == str(COMPLETION_DEADLINE)


def _with_head_serving(desired: Desired, serving: Serving, seed_snapshot) -> Observed:
    seed = Observed.model_validate(json.loads(seed_snapshot.read_text()))
    head = desired.head.name
    nodes = dict(seed.nodes)
    nodes[head] = nodes[head].model_copy(update={"serving": serving})
    return seed.model_copy(update={"nodes": nodes})


def test_health_200_without_a_completion_is_drift(cluster_yaml, seed_snapshot):
    desired = Desired.model_validate(load_file(cluster_yaml).data)
    name = desired.serving.served_model_name or desired.model.id
    hung = Serving(reachable=True, healthy=True, models=[name],
                   completion_error=f"no answer within {COMPLETION_DEADLINE}s")
    drift = [d for d in diff(desired, _with_head_serving(desired, hung, seed_snapshot)) if d.kind == "health"]
    assert len(drift) == 1
    assert drift[0].observed == f"/health 200 but a completion failed: no answer within {COMPLETION_DEADLINE}s"
    answering = hung.model_copy(update={"completion_error": None})
    assert not [d for d in diff(desired, _with_head_serving(desired, answering, seed_snapshot))
                if d.kind == "health"]
