"""The probe's parsers and command lines where the second mutation run (issue 34, item 7) found the tests silent:
the completion's curl command line, the serving API's answer, one `ip -j addr` interface, the GPU stack, df's
number and a step's re-read of a fact.

Input is recorded node output (`fixtures/probe-4-nodes.json`, the converged 4-node testbed's head, and
`fixtures/nvidia-smi/`), a field changed where the case needs it. Expectations are written from the contract: the
OpenAI completions API and curl's `-w` (an HTTP code of `000` when nothing answered), vLLM's /health, /v1/models
and /metrics, iproute2's JSON, and the ServingApi / Link / GpuStack field descriptions in core/observed.py.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from reconciler.core.observed import EngineLoad, GpuStack, Link, ServingApi
from reconciler.edge.facts.base import ProbeError, Section
from reconciler.edge.facts.disk import avail_fact, parse_avail
from reconciler.edge.facts.gpu import parse_gpu_stack
from reconciler.edge.facts.links import parse_link
from reconciler.edge.facts.serving import auth_header, completion_argv, parse_serving
from reconciler.edge.ssh import CommandTimeout, Result
from tests.unit.recorded import RAW, load, sections_of

HEAD = sections_of(RAW["outputs"]["head"])
LINK = json.loads(HEAD["link"].body)[0]  # the head's fabric port, `ip -j addr show dev enp1s0f1np1`, recorded
NVIDIA_SMI = Path(__file__).parents[1] / "fixtures" / "nvidia-smi"
OS = Section("6.17.0-1014-nvidia\n", 0)
HOOK = Section("/usr/bin/nvidia-container-runtime-hook\n", 0)
# `ray status` as the testbed's Ray stand-in prints Ray's: two nodes alive.
RAY_STATUS = ("======== Autoscaler status: 2026-12-06 03:00:10.000000 ========\nNode status\n" + "-" * 63 +
              "\nActive:\n 1 node_6b0e4c\n 1 node_91d2aa\nPending:\n (no pending nodes)\nRecent failures:\n"
              " (no failures)\n")


# -- the completion's command line ------------------------------------------------------------------------------


def test_the_completion_is_one_curl_of_one_deterministic_token():
    """The exact argv: silent (`-s`, no progress meter in the body), the 5 s deadline, a JSON body (the OpenAI
    completions API's `model`/`prompt`/`max_tokens`/`temperature`), and curl's `-w` writing the HTTP code on a
    line of its own after the body, which `parse_completion` splits off. No API key: no header from stdin."""
    body = '{"model": "tiny-moe", "prompt": "ping", "max_tokens": 1, "temperature": 0}'
    assert completion_argv(load()) == [
        "curl", "-s", "-m", "5", "-H", "Content-Type: application/json", "-w", r"\n%{http_code}", "-d", body,
        "http://127.0.0.1:8000/v1/completions"]


def _with_key(value: str) -> object:
    desired = load()
    serving = desired.serving.model_copy(update={"secrets": {"VLLM_API_KEY": "head"}})
    return desired.with_deployment(serving=serving).with_secrets({"VLLM_API_KEY": value})


def test_the_authorization_header_exists_only_with_a_key():
    """vLLM guards /v1 with `Authorization: Bearer KEY` only when VLLM_API_KEY is set: without a key there is no
    header at all (never `Bearer None`), and with one the completion reads it from stdin (`-H @-`)."""
    assert auth_header(load()) is None
    keyed = _with_key("sk-test-1")
    assert auth_header(keyed) == b"Authorization: Bearer sk-test-1\n"
    assert completion_argv(keyed)[:4] == ["curl", "-H", "@-", "-s"]


# -- the serving API's answer -----------------------------------------------------------------------------------


def test_the_recorded_head_with_ray_status_counts_its_nodes():
    """The recorded head's API (health 200, tiny-moe served, one token answered, the engine's counters) and a
    `ray status` that succeeded: every field as the API said it, and the two active nodes."""
    api = parse_serving(HEAD["health"], HEAD["models"], Section(RAY_STATUS, 0), HEAD["completion"], HEAD["engine"])
    assert api == ServingApi(reachable=True, healthy=True, models=["tiny-moe"], ray_nodes=2, completion_error=None,
                             engine=EngineLoad(running=0, waiting=0, tokens=6))


def test_a_failed_ray_status_is_no_count():
    """`ray status` that failed (the container is not running) counts nothing: not known, not zero."""
    failed = Section("Error response from daemon: container 77329a is not running", 1)
    assert parse_serving(HEAD["health"], HEAD["models"], failed, HEAD["completion"]).ray_nodes is None


@pytest.mark.parametrize(("health", "label"), [
    (None, "not asked"),
    (Section("", 0), "the code emptied: someone else holds the port"),
    (Section("000", 7), "curl's `000`: nothing answered"),
])
def test_an_api_that_did_not_answer_is_unreachable(health, label):
    """No HTTP code at all, or curl's `000`, is no API reachable; nothing else was taken from it."""
    assert parse_serving(health, Section("", 0), None, Section("", 0), Section("", 1)) == ServingApi(), label


def test_an_unhealthy_api_is_reachable_but_not_asked_for_a_token_or_its_counters():
    """/health answering 503 is an API that answered (reachable) but not healthy. The completion and the engine
    are read only from a healthy API (ServingApi: `completion_error` None when not tried, `engine` read when
    /health answers 200), even if a models list and a /metrics page were on hand."""
    api = parse_serving(Section("503", 0), HEAD["models"], None, Section("\n000", 28), HEAD["engine"])
    assert api == ServingApi(reachable=True, healthy=False, models=["tiny-moe"], completion_error=None, engine=None)


def test_a_squatted_port_is_named_and_nothing_else_is_taken():
    """Another user's listener on the serving port (issue 31): something answers there (reachable), it is not
    our serving (not healthy), and its uid is named; none of its answers is read."""
    api = parse_serving(HEAD["health"], HEAD["models"], Section(RAY_STATUS, 0), HEAD["completion"], HEAD["engine"],
                        Section("0 1000 ", 0))
    assert api == ServingApi(reachable=True, healthy=False, port_holder=1000)
    assert api.reachable is True and api.healthy is False


# -- one interface of `ip -j addr` ------------------------------------------------------------------------------


def _link_without(*keys: str) -> Section:
    return Section(json.dumps([{k: v for k, v in LINK.items() if k not in keys}]), 0)


def test_the_recorded_port_reads_its_flags_mtu_and_ipv4():
    assert parse_link("enp1s0f1np1", HEAD["link"], None) == Link(
        name="enp1s0f1np1", operstate="up", admin_up=True, carrier=True, mtu=9000, addresses=["10.232.0.10/24"])


@pytest.mark.parametrize(("left_out", "expected"), [
    ("flags", {"admin_up": False, "carrier": False}),  # no flag said: neither UP nor LOWER_UP
    ("addr_info", {"addresses": []}),                 # no address said: none
    ("operstate", {"operstate": "unknown"}),          # RFC 2863's `unknown`: the driver did not say
    ("mtu", {"mtu": 0}),                              # Link's "not said"
])
def test_a_field_iproute2_left_out_reads_as_not_said(left_out, expected):
    """A field missing from the interface's JSON is Link's own default for it, never a crash or a made-up
    value; every other field is read as recorded."""
    recorded = Link(name="enp1s0f1np1", operstate="up", admin_up=True, carrier=True, mtu=9000,
                    addresses=["10.232.0.10/24"])
    assert parse_link("enp1s0f1np1", _link_without(left_out), None) == recorded.model_copy(update=expected)


# -- the GPU stack ----------------------------------------------------------------------------------------------


def test_the_hook_is_there_only_when_command_v_found_it():
    """`command -v nvidia-container-runtime-hook` exiting 1 (not on the PATH), or not asked: docker has no
    `--gpus` driver on that node."""
    gpu = Section((NVIDIA_SMI / "q-noheader.txt").read_text().rsplit("exit=", 1)[0], 0)
    assert parse_gpu_stack(gpu, Section("", 1), OS).hook is False
    assert parse_gpu_stack(gpu, None, OS).hook is False
    assert parse_gpu_stack(gpu, HOOK, OS).hook is True


@pytest.mark.parametrize("status", [0, 9])
def test_nvidia_smi_that_said_nothing_is_an_error_of_no_output(status):
    """No line at all (whatever the exit status) is no GPU read, and the error says there was no output."""
    stack = parse_gpu_stack(Section("  \n", status), HOOK, OS)
    assert stack == GpuStack(error="no output", status=status, hook=True, kernel="6.17.0-1014-nvidia")


def test_the_error_keeps_200_characters_of_the_first_line():
    line = "Failed to initialize NVML: Driver/library version mismatch " + "x" * 300
    stack = parse_gpu_stack(Section(line + "\nNVML library version: 580.159\n", 18), HOOK, OS)
    assert stack is not None and stack.error == line[:200] and len(stack.error) == 200 and stack.status == 18


# -- df's number, and a step's re-read of a fact ----------------------------------------------------------------


@pytest.mark.parametrize(("body", "avail"), [
    ("3858202624", 3858202624),                         # the number alone: the last word is df's number
    ("  Avail\n3858202624\n", 3858202624),
])
def test_dfs_number_is_its_last_word(body, avail):
    assert parse_avail(Section(body, 0)) == avail


class TimedShell:
    """This machine's `sh -s` as a node's session, recording the deadline each script was given."""

    name = "local"

    def __init__(self, exit_code: int | None = None):
        self.timeouts: list[object] = []
        self.exit_code = exit_code

    def run_script(self, script: str, timeout: float, cancel: object = None) -> Result:
        self.timeouts.append(timeout)
        p = subprocess.run(["sh", "-s"], input=script.encode(), capture_output=True, timeout=60, check=False)
        return Result(p.stdout.decode(), p.stderr.decode(), p.returncode if self.exit_code is None else self.exit_code)


def test_a_fact_is_read_within_the_deadline_the_step_gave(tmp_path):
    """The step's deadline reaches the session as given (a re-read must not wait forever on a wedged node),
    and a read the node ended by `timeout` names that deadline."""
    shell = TimedShell()
    assert avail_fact(str(tmp_path)).read(shell, 7.0) is not None
    assert shell.timeouts == [7.0]
    ended = TimedShell(exit_code=124)
    with pytest.raises(CommandTimeout, match="within 7s"):
        avail_fact(str(tmp_path)).read(ended, 7.0)
    assert ended.timeouts == [7.0]


def test_a_models_answer_whose_ids_are_not_names_is_the_head_s_probe_error_not_a_crash():
    """`/v1/models` is the head's bytes, untrusted: ids that are not strings (a hostile or broken server) failed the
    ServingApi model outside any guard and the ValidationError reached observe's caller (the loop). Now it is a
    ProbeError naming the section, which observe turns into the head's `probe_error` (a per-node condition)."""
    answer = Section('{"object": "list", "data": [{"id": {"not": "a name"}}]}', 0)
    with pytest.raises(ProbeError, match=r"^serving API: ValidationError"):
        parse_serving(Section("200", 0), answer, None)
