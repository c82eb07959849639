"""Issue 16, finding 9: text from the nodes reaches the operator's terminal and `discover`'s YAML only as printable,
literal text: no escape sequence, no rich markup, no line break that would start a line of live YAML."""

from __future__ import annotations

import ipaddress
import re
import unicodedata
from types import SimpleNamespace

import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from reconciler.cli.plan_text import observed_text, plan_text
from reconciler.cli.status_view import status_text
from reconciler.core import spec
from reconciler.core.observed import Container, NodeObservation, Observed
from reconciler.core.planning import plan
from reconciler.core.text import printable
from reconciler.edge import discover as disc
from reconciler.loop.apply import _echo
from tests.unit.examples import examples
from tests.unit.strategies import desired_dict

#: rich markup, an OSC title change ended by BEL, a screen clear, a YAML injection, a bidi override, a comment
HOSTILE = "boom [/rank0] \x1b]0;pwned\x07 \x1b[2J\nmode: enforce\n\u202e #x\u2028y: 1"


def shown(c: str) -> bool:
    """The oracle, from Unicode's categories rather than str.isprintable: no Other (control, format, surrogate,
    private use, unassigned), no Separator but the ASCII space."""
    category = unicodedata.category(c)
    return c == " " or category[0] not in "CZ"


def assert_terminal_safe(text: str) -> None:
    for line in text.split("\n"):
        bad = [c for c in line if not shown(c)]
        assert not bad, f"{bad!r} in {line!r}"


# ----------------------------------------------------------------------------------------------- the one rule

@settings(**examples(500))
@given(st.text(st.characters(exclude_categories=())))
def test_printable_leaves_one_line_of_shown_characters_and_changes_only_what_it_must(text):
    out = printable(text)
    assert all(shown(c) for c in out)
    assert len(out.splitlines()) <= 1 and "\n" not in out
    assert (out == text) == all(shown(c) for c in text)
    assert printable(out) == out


def test_printable_escapes_visibly():
    assert printable("\x1b[31mred\x07") == "\\x1b[31mred\\x07"
    assert printable("a\tb\nc\x7f\x85") == "a\\x09b\\x0ac\\x7f\\x85"
    assert printable("\u202eevil\u2066\u2028") == "\\u202eevil\\u2066\\u2028"
    assert printable("\U000e0001\ud800") == "\\U000e0001\\ud800"
    assert printable("Grüße [/rank0] C:\\x") == "Grüße [/rank0] C:\\x"


# ----------------------------------------------------------------------------------------------- the terminal

def test_status_shows_a_hostile_message_literally():
    doc = {"phase": "Degraded\x1b[2J", "generation": 3, "observedGeneration": 2, "lastError": HOSTILE,
           "conditions": [{"node": "head", "type": "Serving", "status": "False", "reason": "Crashed[b]",
                           "message": HOSTILE}],
           "operations": [{"step": "stop-container/head/[/x]\x1b[2J", "state": "running", "seconds": 3,
                           "deadlineIn": 10}]}
    out = status_text(doc, 80, 0)
    assert_terminal_safe(out)
    assert "[/rank0]" in out and "Crashed[b]" in out and "\\x1b]0;pwned\\x07" in out and "[/x]\\x1b[2J" in out


def hostile_observation() -> Observed:
    return Observed(nodes={
        "head": NodeObservation(name="head", reachable=True, docker_reachable=True,
                                containers=[Container(name=HOSTILE, id="c1", image=HOSTILE, state="running")]),
        "worker1": NodeObservation(name="worker1", reachable=False, error=HOSTILE)})


def test_plan_and_observed_text_show_node_text_on_its_own_lines():
    observed = hostile_observation()
    current = plan(spec.Desired.model_validate(desired_dict()), observed)
    for text in (plan_text(current), observed_text(observed)):
        assert_terminal_safe(text)
        assert "\\x1b]0;pwned\\x07" in text
        assert not any(line.startswith("mode:") or line.startswith("y: 1") for line in text.splitlines())


def test_apply_echoes_steps_printably(capsys):
    step = SimpleNamespace(id=f"stop-container/head/{HOSTILE}")
    _echo("step.start", {"step": step})
    _echo("step.end", {"result": SimpleNamespace(step=step, result="failed", seconds=1.0, message=HOSTILE)})
    captured = capsys.readouterr()
    assert_terminal_safe(captured.out + captured.err)
    assert len(captured.out.splitlines()) == 1 and len(captured.err.splitlines()) == 1


# ----------------------------------------------------------------------------------------------- discover's YAML

def hostile_facts(host: str, hostname: str) -> disc.NodeFacts:
    address = ipaddress.IPv4Interface("192.168.100.10/24" if host.endswith("2") else "192.168.100.11/24")
    return disc.NodeFacts(
        host=host, hostname=hostname,
        ifaces=[disc.Iface(name="enp1s0f1np1", up=True, mtu=9000, ipv4=(address,)),
                disc.Iface(name=f"np1{HOSTILE}", up=True, mtu=9000, ipv4=(ipaddress.IPv4Interface("10.9.0.1/24"),))],
        rdma=[disc.RdmaLink("rocep1s0f1", "enp1s0f1np1", True), disc.RdmaLink(f"rdma{HOSTILE}", f"np1{HOSTILE}", True)],
        rdma_source="ibdev2netdev",
        containers=[disc.RunningContainer(name=HOSTILE, image=f"img{HOSTILE}"),
                    disc.RunningContainer(name=f"vllm_node{HOSTILE}", image="x", args=("--port", "8000"))],
        images=[(f"vllm{HOSTILE}", 10**10)], nvidia_runtime=True, mem_total=128 * 2**30, mem_available=100 * 2**30,
        hf_home=f"/h{HOSTILE}", model_roots=[f"/srv/{HOSTILE}/hub", "/home/spark/.cache/huggingface/hub"],
        models=[disc.ModelDir("hf-cache", "/home/spark/.cache/huggingface/hub", f"org/m{HOSTILE}", 10**7, HOSTILE)],
        errors=[f"docker: {HOSTILE}"])


def walk(node: object):
    if isinstance(node, dict):
        for key, value in node.items():
            yield key
            yield from walk(value)
    elif isinstance(node, list):
        for value in node:
            yield from walk(value)
    else:
        yield node


def test_discover_writes_node_text_only_as_quoted_values_and_one_line_comments():
    text = disc.render([hostile_facts("10.0.0.2", f"spark{HOSTILE}"), hostile_facts("10.0.0.3", HOSTILE)],
                       user="spark", known_hosts="/etc/spark-reconciler/known_hosts", identity=None, jump=True)
    assert_terminal_safe(text)
    live = [line for line in text.splitlines() if line.lstrip().startswith(("mode:", "y:"))]
    assert len(live) == 1 and re.fullmatch(r"  mode: enforce +# .*", live[0]), "only policy.mode"
    doc = yaml.safe_load(text)
    assert set(doc) == {"nodes", "model", "serving", "co_tenants", "policy"}
    assert doc["policy"]["mode"] == "enforce"
    assert all(shown(c) for item in walk(doc) if isinstance(item, str) for c in item)
    # node text kept, whole (a `#` inside a value is quoted, not a comment), shown printably
    assert doc["serving"]["image"] == printable(f"vllm{HOSTILE}")
    assert printable(HOSTILE) in doc["co_tenants"]["allowed"][doc["nodes"][0]["name"]]
    assert doc["model"]["id"] == printable(f"org/m{HOSTILE}")


def test_a_container_name_with_a_line_break_does_not_set_a_key():
    """The old renderer wrote running containers' names raw into a comment: this name flipped `internet`."""
    injected = disc.RunningContainer("embed\n    internet: true", "img")
    fabric = [disc.Iface("enp1s0f1np1", True, 9000, (ipaddress.IPv4Interface(f"10.9.0.{i}/24"),)) for i in (1, 2)]
    facts = [disc.NodeFacts(host=f"10.0.0.{i}", hostname=f"n{i}", containers=[injected], ifaces=[fabric[i - 1]])
             for i in (1, 2)]
    doc = yaml.safe_load(disc.render(facts, user="spark", known_hosts="/etc/k", identity=None, jump=True))
    assert [n["internet"] for n in doc["nodes"]] == [False, False]
