"""Every parser of node output, fed anything: it returns a model or raises ProbeError, nothing else.

Issue 53 keeps this the fuzzing of everything a node prints: the split into sections, each section's parser, the
weights listing (lines shaped as the manifest script's), the copy ledger (lines shaped as its own) and node JSON.

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
from reconciler.edge import ledger, manifest
from reconciler.edge.facts.base import ProbeError, Section, node_json, split_sections
from reconciler.edge.facts.containers import parse_containers
from reconciler.edge.facts.images import parse_image
from reconciler.edge.facts.links import parse_link
from reconciler.edge.facts.memory import parse_memory
from reconciler.edge.facts.serving import parse_completion, parse_serving
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
    "containers": lambda s: parse_containers(s),
    "link": lambda s: parse_link("enp1s0f1np1", s, s),
    "meminfo": lambda s: parse_memory(s),
    "weights": lambda s: manifest.parse_weights("/models", s),
    "serving": lambda s: parse_serving(s, s, s, s),
    "completion": lambda s: parse_completion(s),
    "image": lambda s: parse_image(s),
    "copies": lambda s: ledger.parse_copies(s, "worker1"),
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


SECTION_NAMES = ["containers", "image", "link", "rdma", "meminfo", "weights", "health", "models", "completion",
                 "copies"]


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


NAMES = st.sampled_from(["a", "a/b", "a/b/c", "l", "a/l", "blobs", "blobs/x", "..", ".", "", "a//b", "/", "é\x00"])
VALUES = st.lists(st.sampled_from(["a", "b", "c", "l", "..", ".", "", "blobs", "x", "/m", "/hub/blobs", "/etc"]),
                  max_size=6).map("/".join)
LISTING_LINE = st.one_of(
    st.tuples(st.sampled_from(["E", "S"]), NAMES, st.sampled_from(["f", "d", "l", "p", ""]),
              st.sampled_from(["1", "0", "-1", "x", "9" * 30]), st.sampled_from(["1.5", "nan", "inf", "x", "1e400"]),
              VALUES).map("\t".join),
    st.sampled_from(["C\ttree\t/m", "C\tstore\t/hub/blobs", "C\ttree\trelative", "C.", "F\t0", "F\t1", "F\tx",
                     "G\t0", "G\t", "B", "E", "E\ta\tl"]),
    TEXT)


@settings(**examples(300), deadline=None, suppress_health_check=list(HealthCheck))
@given(lines=st.lists(LISTING_LINE, max_size=30), rc=st.sampled_from([0, 0, 0, 1, 2]),
       root=st.sampled_from(["/m", "/hub/models--o--m"]))
@example(lines=["C\ttree\t/m", "C.", "E\tl\tl\t1\t1\tl", "F\t0"], rc=0, root="/m")
@example(lines=["C\ttree\t/m", "C.", *(f"E\tn{i}\tl\t1\t1\tn{i + 1}" for i in range(60)), "F\t0"], rc=0, root="/m")
def test_a_listing_of_any_lines_is_a_manifest_or_a_probe_error(lines, rc, root):
    try:
        listing = manifest.read_listing(root, Section("\n".join(lines), rc))
    except ProbeError as exc:
        assert str(exc).startswith("weights manifest: ")
        return
    w = listing.weights
    assert len(w.files) <= manifest.MAX_LINES and w.unsafe_count >= len(w.unsafe)
    assert all(f.size is None or f.size == listing.resolved[f.path][0] for f in w.files if f.link_target)


LEDGER_LINE = st.one_of(st.tuples(
    st.sampled_from(["copied", "served", "removed", "released", "started", "copied2", ""]),
    st.sampled_from(["worker1", "worker2", "worker1 ", ""]), st.sampled_from(["weights", "image", "x"]),
    st.sampled_from(["/m/a", "/m/../a", "sha256:" + "a" * 64, "", "/" + "x" * 5000, "relative"]),
    st.sampled_from(["1764000000", "x", "9" * 13, "²", "-1"]), st.sampled_from(["10.0.0.1:22", "", "a b"]),
    st.sampled_from(["a" * 64, "-", "sha256:" + "b" * 64, "x"])).map("\t".join), TEXT)


@settings(**examples(300), deadline=None, suppress_health_check=list(HealthCheck))
@given(lines=st.lists(LEDGER_LINE, max_size=12))
def test_a_ledger_of_any_lines_is_records_or_a_probe_error(lines):
    section = Section("\n".join(lines), 0)
    only_probe_errors(lambda: ledger.parse_copies(section, "worker1"))
    assert isinstance(ledger.started(section, "worker1", "10.0.0.1:22"), set)


MARKED = st.lists(st.one_of(TEXT, st.sampled_from(["\n", "\r", "\r\n", "\x85", "\u2028", "@@n ", "@@n rc ",
                                                    "@@n rc 0", "@@n rc x", "@@n weights", "@@x rc 0", " "])),
                  max_size=30).map("".join)


@settings(**examples(300), deadline=None, suppress_health_check=list(HealthCheck))
@given(output=MARKED)
@example(output="@@n a\nx\n@@n rc ٣\n")
def test_any_output_splits_into_sections_or_a_probe_error(output):
    try:
        sections = split_sections(output, "n")
    except ProbeError as exc:
        assert str(exc).startswith("probe output: ")
        return
    lines = output.splitlines()
    for name, section in sections.items():
        assert f"@@n {name}" in output and not section.body.startswith("\n") and not section.body.endswith("\n")
        assert all(line in lines for line in section.body.split("\n") if line), "a body is the output's own lines"


@settings(**examples(300), deadline=None, suppress_health_check=list(HealthCheck))
@given(text=st.one_of(TEXT, JSON.map(json.dumps), st.integers(1, 3000).map(lambda n: "[" * n + "]" * n)))
def test_node_json_is_a_value_or_a_value_error(text):
    try:
        node_json(text)
    except ValueError:
        pass


def test_the_probe_error_names_the_section():
    with pytest.raises(ProbeError, match=r"^meminfo: KeyError: 'MemAvailable'"):
        parse_memory(Section("MemTotal:       1024 kB", 0))
    with pytest.raises(ProbeError, match=r"^containers: "):
        parse_containers(Section('API {"not": "a list"}', 0))
