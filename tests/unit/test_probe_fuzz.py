"""Every parser of node output, fed anything: it returns a model or raises ProbeError, nothing else.

A node's bytes are untrusted input (a hostile or broken node, a docker API answer that is not a list, a
/proc/meminfo without MemAvailable, names with tabs, newlines or invalid UTF-8): whatever they are, they may make
that node ProbeFailed, never crash the reconcile of the others. The strategies mix plain garbage with
almost-right output (the sections the probe prints, JSON of any shape where a list of containers is expected),
which is where a parser's unchecked assumption hides.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from reconciler.core.spec import load
from reconciler.core.vllm import parse_serve_help
from reconciler.edge import manifest, probes
from reconciler.edge.probes import ProbeError, Section
from tests.unit.examples import examples
from tests.unit.recorded import parsed

JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=20),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner,
                                                                                max_size=4),
                    max_leaves=20)
TEXT = st.text(max_size=300)
ODD = st.sampled_from(["", "\t", "\n", "\r\n", "\x00", "\ufffd", "MemTotal:", "MemAvailable: x kB", "@@rc",
                       "@@rc x", "E\ta\tf\tx\t1\t", "R\ta\t-1", "API ", "API [", "{", "[]", "API {}", "200",
                       "000", '{"data": [{}]}', '{"data": 5}', "node_1", "\x1b[31m"])
BODY = st.one_of(TEXT, ODD, JSON.map(json.dumps), JSON.map(lambda v: "API " + json.dumps(v)),
                 st.lists(st.one_of(ODD, TEXT), max_size=8).map("\n".join))
SECTIONS = st.one_of(st.none(), st.builds(Section, BODY, st.integers(-2, 300)))
PARSERS = {
    "containers": lambda s: probes.parse_containers(s),
    "link": lambda s: probes.parse_link("enp1s0f1np1", s, s),
    "meminfo": lambda s: probes.parse_memory(s),
    "weights": lambda s: manifest.parse_weights("/models", s),
    "serving": lambda s: probes.parse_serving(s, s, s, s),
    "completion": lambda s: probes.parse_completion(s),
    "image": lambda s: probes.parse_image(s),
}


def only_probe_errors(call) -> None:
    try:
        call()
    except ProbeError as exc:
        assert str(exc), "a ProbeError says why"


@pytest.mark.parametrize("name", sorted(PARSERS))
@settings(**examples(300), deadline=None, suppress_health_check=list(HealthCheck))
@given(section=SECTIONS)
def test_a_section_parser_raises_nothing_but_probe_error(name, section):
    only_probe_errors(lambda: PARSERS[name](section))


@pytest.fixture(scope="module")
def desired(cluster_yaml):
    return load(cluster_yaml)


SECTION_NAMES = ["containers", "image", "link", "rdma", "meminfo", "weights", "health", "models", "completion"]


@settings(**examples(300), deadline=None, suppress_health_check=list(HealthCheck))
@given(parts=st.lists(st.tuples(st.sampled_from(SECTION_NAMES), BODY, st.integers(-1, 300)), max_size=10),
       garbage=st.one_of(st.just(""), TEXT))
@example(parts=[("containers", 'API {"Id": 1}', 0)], garbage="")
@example(parts=[("containers", 'API [{"Names": 5, "Id": "x", "State": "running"}]', 0)], garbage="")
@example(parts=[("meminfo", "MemTotal: 1 kB", 0)], garbage="")
@example(parts=[("weights", "E\tname\twith\ttabs\tf\t1\t2\t", 0)], garbage="")
@example(parts=[("link", "[" * 50_000, 0)], garbage="")
def test_a_whole_probe_output_yields_an_observation_or_a_probe_error(desired, parts, garbage):
    output = garbage + "".join(f"\n@@{name}\n{body}\n@@rc {rc}\n" for name, body, rc in parts)
    for node in desired.nodes:
        only_probe_errors(lambda node=node: parsed(desired, node.name, output))


@settings(**examples(200), deadline=None, suppress_health_check=list(HealthCheck))
@given(text=st.one_of(TEXT, st.lists(st.one_of(ODD, TEXT, st.just("  --flag X")), max_size=10).map("\n".join)))
def test_the_serve_help_parser_never_raises(text):
    assert isinstance(parse_serve_help(text), list)


def test_the_probe_error_names_the_section():
    with pytest.raises(ProbeError, match=r"^meminfo: KeyError: 'MemAvailable'"):
        probes.parse_memory(Section("MemTotal:       1024 kB", 0))
    with pytest.raises(ProbeError, match=r"^containers: "):
        probes.parse_containers(Section('API {"not": "a list"}', 0))
