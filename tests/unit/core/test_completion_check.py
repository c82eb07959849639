"""Serving is judged by one real completion, not only /health.

The answers below are recorded from the real vLLM 0.32.0 CPU build serving the testbed's tiny Llama
(testbed/realvllm), through the same curl command line the probe sends; the hung case is what that deployment
did with the worker's fabric link down (/health 200, the completion never answered: curl's exit 28).
"""

from __future__ import annotations

import json
import socket

import pytest

from reconciler.core.drift import diff
from reconciler.core.loader import load_file
from reconciler.core.observed import EngineLoad, Observed, ServingApi
from reconciler.core.spec import Desired
from reconciler.edge.facts.base import Section, sealed
from reconciler.edge.facts.serving import COMPLETION_DEADLINE, completion_argv, parse_completion

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


def _with_head_serving(desired: Desired, serving: ServingApi, seed_snapshot) -> Observed:
    seed = Observed.model_validate(json.loads(seed_snapshot.read_text()))
    head = desired.head.name
    nodes = dict(seed.nodes)
    nodes[head] = nodes[head].model_copy(update={"serving": serving})
    return seed.model_copy(update={"nodes": nodes})


def test_health_200_without_a_completion_is_drift(cluster_yaml, seed_snapshot):
    desired = Desired.model_validate(load_file(cluster_yaml).data)
    name = desired.serving.served_model_name or desired.model.id
    hung = ServingApi(reachable=True, healthy=True, models=[name],
                   completion_error=f"no answer within {COMPLETION_DEADLINE}s")
    drift = [d for d in diff(desired, _with_head_serving(desired, hung, seed_snapshot)) if d.kind == "health"]
    assert len(drift) == 1
    assert drift[0].observed == f"/health 200 but a completion failed: no answer within {COMPLETION_DEADLINE}s"
    answering = hung.model_copy(update={"completion_error": None})
    assert not [d for d in diff(desired, _with_head_serving(desired, answering, seed_snapshot))
                if d.kind == "health"]


def _serving_part_of_the_probe(desired: Desired):
    from reconciler.edge.facts.serving import api_script

    return sealed(api_script(desired))


STUB_CURL = """#!/bin/sh
echo "$@" >> "$CALLS"
case "$*" in
  */health*) [ "$HEALTH" = 200 ] && printf 200 || { printf 000; exit 28; } ;;
  */v1/models*) printf '{"data": [{"id": "%s"}]}' "$SERVED" ;;
  */v1/completions*) printf '\\n000'; exit 28 ;;
  */metrics*) cat <<'END'
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 4.0
vllm:num_requests_waiting{engine="0",model_name="m"} 2.0
vllm:prompt_tokens_total{engine="0",model_name="m"} 120.0
vllm:prompt_tokens_created{engine="0",model_name="m"} 1.7e9
vllm:generation_tokens_total{engine="0",model_name="m"} 2400.0
vllm:request_success_total{engine="0",finished_reason="length",model_name="m"} 3.0
END
  ;;
esac
"""


@pytest.fixture
def root_port():
    """A port this test's own process listens on: the probe asks the API only where root alone listens (serving
    containers run as root; the tests run as root, as CI does: docs/testing.md)."""
    with socket.create_server(("127.0.0.1", 0)) as held:
        yield held.getsockname()[1]


@pytest.mark.parametrize("health", ["200", "000"])
def test_the_probe_asks_the_model_list_and_a_completion_only_of_a_healthy_api(cluster_yaml, tmp_path, health,
                                                                              root_port):
    """The shell the probe really runs, with a stand-in curl: a hung completion reports curl's own exit code (the
    probe once reported `echo`'s 0, so "no answer" read as an HTTP error); an API whose /health does not answer is
    not also asked for models and a completion (2 s + 5 s more per probe of a frozen API)."""
    import os
    import subprocess

    from reconciler.edge.facts.base import split_sections
    from reconciler.edge.facts.serving import parse_serving

    data = load_file(cluster_yaml).data
    data["serving"]["port"] = root_port
    desired = Desired.model_validate(data)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "curl").write_text(STUB_CURL)
    (bin_dir / "curl").chmod(0o755)
    calls = tmp_path / "calls"
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "CALLS": str(calls), "HEALTH": health,
           "SERVED": desired.serving.served_model_name or desired.model.id}
    script = _serving_part_of_the_probe(desired)
    out = subprocess.run(["sh", "-s"], input=script.script, capture_output=True, text=True,
                         env=env, timeout=30, check=True).stdout
    sections = split_sections(out, script.nonce)
    asked = [w for w in calls.read_text().split() if w.startswith("http://")]
    serving = parse_serving(sections.get("health"), sections.get("models"), None, sections.get("completion"),
                            sections.get("engine"))
    if health == "200":
        assert len(asked) == 4 and sections["completion"].rc == 28
        assert serving.completion_error == f"no answer within {COMPLETION_DEADLINE}s"
        assert serving.engine == EngineLoad(running=4, waiting=2, tokens=2520), "vLLM's counters, summed"
    else:
        assert len(asked) == 1, asked
        assert not serving.healthy and serving.completion_error is None and serving.engine is None


STUB_AUTH_CURL = """#!/bin/sh
echo "ARGV $*" >> "$CALLS"
case "$*" in *"-H @-"*) echo "STDIN $(cat)" >> "$CALLS" ;; esac
case "$*" in
  */health*) printf 200 ;;
  */v1/models*) printf '{"data": [{"id": "%s"}]}' "$SERVED" ;;
  */v1/completions*) printf '{"choices": [{"text": "x"}]}\\n200' ;;
esac
"""


def test_an_api_key_reaches_the_api_on_stdin_never_in_an_argv(cluster_yaml, tmp_path, root_port):
    """vLLM with VLLM_API_KEY answers 401 on every /v1 path without `Authorization: Bearer KEY` (/health stays
    open): serving looked unhealthy forever. The key goes to curl as `-H @-` on its stdin."""
    import os
    import subprocess

    from reconciler.edge.facts.base import split_sections
    from reconciler.edge.facts.serving import parse_serving

    data = load_file(cluster_yaml).data
    data["serving"]["port"] = root_port
    key = "sk-test-0123456789"
    data["serving"]["secrets"] = {"VLLM_API_KEY": "head"}
    desired = Desired.model_validate(data).with_secrets({"VLLM_API_KEY": key})
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "curl").write_text(STUB_AUTH_CURL)
    (bin_dir / "curl").chmod(0o755)
    calls = tmp_path / "calls"
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "CALLS": str(calls),
           "SERVED": desired.serving.served_model_name or desired.model.id}
    script = _serving_part_of_the_probe(desired)
    out = subprocess.run(["sh", "-s"], input=script.script, capture_output=True, text=True,
                         env=env, timeout=30, check=True).stdout
    lines = calls.read_text().splitlines()
    argvs = [line for line in lines if line.startswith("ARGV ")]
    assert not [a for a in argvs if key in a], "the key is in an argv"
    assert lines.count(f"STDIN Authorization: Bearer {key}") == 2, lines  # /v1/models and /v1/completions
    assert "-H @-" not in next(a for a in argvs if "/health" in a)
    sections = split_sections(out, script.nonce)
    serving = parse_serving(sections.get("health"), sections.get("models"), None, sections.get("completion"))
    assert serving.serves(desired.serving.served_model_name or desired.model.id)


def test_api_key_as_a_flag_is_refused(cluster_yaml):
    data = load_file(cluster_yaml).data
    data["serving"]["extra_args"] = ["--api-key", "sk-x"]
    with pytest.raises(ValueError, match="VLLM_API_KEY"):
        Desired.model_validate(data)


@pytest.mark.parametrize("flag", ["--api_key=sk-x", "--api_key"])
def test_api_key_with_underscores_is_refused_too(cluster_yaml, flag):
    """vLLM's parser reads --api_key as --api-key: the same key would reach the command line."""
    data = load_file(cluster_yaml).data
    data["serving"]["extra_args"] = [flag, "sk-x"] if "=" not in flag else [flag]
    with pytest.raises(ValueError, match="VLLM_API_KEY"):
        Desired.model_validate(data)


def test_odd_metrics_lines_are_skipped_never_the_heads_probe():
    """A page cut short by `curl -m` on a busy server, a timestamp after the value, NaN: the counters read are the
    ones that parse; a metric missing in the end is no answer, never a ProbeError of the whole head."""
    from reconciler.edge.facts.base import Section
    from reconciler.edge.facts.serving import parse_engine

    lines = ['vllm:num_requests_running{engine="0"} 2.0 1700000000000', "vllm:num_requests_waiting 1",
             'vllm:prompt_tokens_total{engine="0"} 10', 'vllm:generation_tokens_total{engine="0"} 90',
             'vllm:generation_tokens_total{engine="1"} NaN', "vllm:generation_tokens_total{model_na"]
    assert parse_engine(Section("\n".join(lines), 0)) == EngineLoad(running=2, waiting=1, tokens=100)
    assert parse_engine(Section("\n".join(lines[:2]), 0)) is None, "no token counters: not an answer"
    assert parse_engine(Section("", 1)) is None and parse_engine(Section("x", 2)) is None


def test_the_kv_cache_gauge_is_read_where_the_image_exports_it():
    """vLLM 0.20.1's loggers.py exports `vllm:kv_cache_usage_perc` per engine: summed like the counters, and the
    probe's own grep pattern keeps its line (what moves during a long chunked prefill, health_watch._busy)."""
    import re

    from reconciler.edge.facts.base import Section
    from reconciler.edge.facts.serving import _ENGINE_LINES, parse_engine

    lines = ['vllm:num_requests_running{engine="0",model_name="m"} 1.0', 'vllm:num_requests_waiting{engine="0"} 0',
             'vllm:prompt_tokens_total{engine="0"} 10', 'vllm:generation_tokens_total{engine="0"} 90',
             'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25', "vllm:kv_cache_usage_percent 9"]
    kept = [line for line in lines if re.match(_ENGINE_LINES, line)]
    assert kept == lines[:5], "a longer name is not the gauge"
    assert parse_engine(Section("\n".join(kept), 0)) == EngineLoad(running=1, waiting=0, tokens=100, kv_usage=0.25)
