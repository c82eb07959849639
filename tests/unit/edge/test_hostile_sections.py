"""Issue 53, finding C: what a hostile node's structured lines may cost the daemon, under both of the command's caps
(`ssh.MAX_OUTPUT`, `ssh.MAX_LINES`). A node that runs no `head` sent a million `E` lines (14 MiB): the parse made a
million entries and files and peaked at 828 MiB (tracemalloc; 1,007 MiB RSS), above the unit's MemoryMax=512M; a
million link lines took 352 s of CPU, past the node's observation deadline. The same held for the ledger's lines
(no `tail`: 383 MiB) and any JSON section (28.6 MiB of `{},` as the containers: 724 MiB). Each section is read up
to what the node's own command lets through, or what an honest node can hold, before anything is built from it.

Memory is measured with tracemalloc (Python's own allocations: the peak while parsing), work by counting the
listing's path lookups (`manifest._Walk.place`): no wall clock. And the honest output parses as it did: the
recorded testbed's sections and listings are pinned, and the memoised resolution is checked against the plain
replay it replaced (`_replay`, the resolution as it was before, kept here as the oracle).
"""

from __future__ import annotations

import hashlib
import json
import tracemalloc
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from reconciler.core import spec
from reconciler.edge import ledger, manifest
from reconciler.edge.facts.base import MAX_JSON_VALUES, ProbeError, Section, node_json, split_sections
from reconciler.edge.facts.containers import MAX_CONTAINERS, parse_containers
from reconciler.edge.facts.memory import parse_memory
from testbed.recordings import reseal
from tests.unit.examples import examples

NONCE = "0123456789abcdef0123456789abcdef"
MEMORY_MAX = 512 * 2**20  # the shipped unit's MemoryMax=512M


def _output(body: str) -> str:
    """A sealed probe output of one `weights` section listing the tree /m."""
    return f"\n@@{NONCE} weights\nC\ttree\t/m\nC.\n{body}F\t0\n\n@@{NONCE} rc 0\n"


@pytest.fixture
def lookups(monkeypatch):
    """The listing's path lookups, counted; past `limit` the parse stops (AssertionError): the code from before this
    fix fails here at once instead of spending minutes."""
    count = {"n": 0, "limit": 10**12}
    place = manifest._Walk.place

    def counted(self, path):
        count["n"] += 1
        assert count["n"] <= count["limit"], f"more than {count['limit']} path lookups"
        return place(self, path)

    monkeypatch.setattr(manifest._Walk, "place", counted)
    return count


def test_a_million_entry_lines_parse_far_below_the_unit_s_memory():
    """One million `E` lines (a million distinct files, 15 MiB): read up to what `head -n` lets through, the rest
    never looked at; the listing is truncated, as an honest one past MAX_ENTRIES is."""
    output = _output("".join(f"E\t{i}\tf\t1\t1\t\n" for i in range(1_000_000)))
    tracemalloc.start()
    try:
        weights = manifest.parse_weights("/m", split_sections(output, NONCE)["weights"])
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 128 * 2**20 < MEMORY_MAX / 3, f"{peak / 2**20:.0f} MiB"  # 94 MiB measured; before: 828 MiB
    assert weights.truncated == f"more than {manifest.MAX_ENTRIES} entries"
    assert len(weights.files) <= manifest.MAX_LINES


def test_a_million_link_lines_of_a_chain_cost_a_few_lookups_each(lookups):
    """A chain n0 -> n1 -> ... of a million links: each link's value is resolved once and reused (before: every
    link walked up to 40 hops of the chain, 40 lookups and more each)."""
    output = _output("".join(f"E\tn{i}\tl\t1\t1\tn{i + 1}\n" for i in range(1_000_000)))
    lookups["limit"] = 8 * manifest.MAX_LINES
    weights = manifest.parse_weights("/m", split_sections(output, NONCE)["weights"])
    assert weights.truncated == f"more than {manifest.MAX_ENTRIES} entries"
    assert all(f.size is None for f in weights.files), "a chain past 40 hops, or cut by the cap, is broken"
    assert lookups["n"] <= 8 * manifest.MAX_LINES  # 687,464 measured (docs/reliability.md): 6.9 per link


@pytest.mark.parametrize("shape", ["cycle", "broom", "knots"])
def test_links_through_links_cost_a_few_lookups_each(lookups, shape):
    """20,000 links of other shapes: a cycle of them all; all through one 39-link chain to a file (each within the
    40 hops, so each gets the file's size); each through a pair of other links and back (`a/../b`)."""
    n = 20_000
    lines = {"cycle": [f"E\tn{i}\tl\t1\t1\tn{(i + 1) % n}\n" for i in range(n)],
             "broom": ([f"E\tc{i:02d}\tl\t1\t1\t{f'c{i + 1:02d}' if i < 38 else 'f'}\n" for i in range(39)]
                       + [f"E\tn{i}\tl\t1\t1\tc00\n" for i in range(n)]),
             "knots": [f"E\tn{i}\tl\t1\t1\tn{(i + 1) % n}/../n{(i + 2) % n}\n" for i in range(n)]}[shape]
    lookups["limit"] = 16 * len(lines)
    weights = manifest.parse_weights("/m", split_sections(_output("E\tf\tf\t7\t1\t\n" + "".join(lines)),
                                                          NONCE)["weights"])
    sizes = {f.size for f in weights.files if f.link_target is not None}
    assert sizes == ({7} if shape == "broom" else {None})
    assert weights.truncated is None and lookups["n"] <= 16 * len(lines)


def test_the_resolution_of_one_listing_is_bounded_in_steps(lookups):
    """Links of long values (`d/../d/../.../f`, 201 components each: no link, just length) cost per component: all
    of a listing's links look at MAX_STEPS components at most, then the listing is truncated and the links left
    resolve to nothing (a partial view is never synced from, never removed by retention)."""
    output = _output("E\td\td\t0\t1\t\nE\tf\tf\t7\t1\t\n"
                     + "".join(f"E\tn{i}\tl\t1\t1\t{'d/../' * 100}f\n" for i in range(40_000)))
    lookups["limit"] = manifest.MAX_STEPS + 40_000
    weights = manifest.parse_weights("/m", split_sections(output, NONCE)["weights"])
    assert weights.truncated == f"more than {manifest.MAX_STEPS} steps resolving its links"
    resolved = [f for f in weights.files if f.size is not None]
    assert resolved and len(resolved) < 40_000
    assert lookups["n"] <= manifest.MAX_STEPS + 40_000


def test_only_the_first_unsafe_links_are_spelled_out():
    """A link leading out is counted; only the first UNSAFE_SHOWN are written out as text: 50,000 links leading
    out with 500-byte values (25 MiB) made a string each, twice the value's length, before all but 10 were
    dropped."""
    section = Section("C\ttree\t/m\nC.\n" + "".join(f"E\tn{i}\tl\t1\t1\t/etc/{'x' * 500}{i}\n"
                                                    for i in range(50_000)) + "F\t0", 0)
    tracemalloc.start()
    try:
        weights = manifest.parse_weights("/m", section)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert weights.unsafe_count == 50_000 and len(weights.unsafe) == manifest.UNSAFE_SHOWN
    assert peak < 80 * 2**20, f"{peak / 2**20:.0f} MiB"  # 62 MiB measured; before: 117 MiB


def _peak(call):
    """What `call` returns, and the peak of Python's allocations while it ran."""
    tracemalloc.start()
    try:
        return call(), tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_the_ledger_is_read_as_far_as_tail_lets_through():
    """240,000 of the node's own `copied` lines (27 MiB; `tail -n 5000` on the node keeps the newest 5,000): only
    the newest MAX_LINES are split and read."""
    digest = "a" * 64
    body = "".join(f"copied\tworker\tweights\t/m/{i}\t1764000000\t10.0.0.1:22\t{digest}\n" for i in range(240_000))
    records, peak = _peak(lambda: ledger.parse_copies(Section(body, 0), "worker"))
    assert records is not None and len(records) == ledger.MAX_LINES
    assert {r.key for r in records} == {f"/m/{i}" for i in range(240_000 - ledger.MAX_LINES, 240_000)}
    assert peak < 32 * 2**20, f"{peak / 2**20:.0f} MiB"  # 8 MiB measured; before: 383 MiB


def test_a_json_section_of_a_million_values_is_refused_before_it_is_built():
    """28.6 MiB of `{},` as the docker API's list of containers: refused on a count of its characters."""
    body = "API [" + ",".join(["{}"] * 10_000_000) + "]"
    refused, peak = _peak(lambda: pytest.raises(ProbeError, parse_containers, Section(body, 0)))
    assert str(refused.value) == f"containers: ValueError: more than {MAX_JSON_VALUES} JSON values"
    assert peak < 2**20, f"{peak / 2**20:.1f} MiB"  # nothing built; before: 724 MiB


def test_at_the_json_bound_a_document_costs_far_less_than_the_unit_s_memory():
    """Just under MAX_JSON_VALUES, the costliest shape measured (objects of one distinct key each)."""
    count = MAX_JSON_VALUES // 3 - 1
    text = "[" + ",".join(f'{{"k{i}":0}}' for i in range(count)) + "]"
    found, peak = _peak(lambda: node_json(text))
    assert len(found) == count
    assert peak < 128 * 2**20, f"{peak / 2**20:.0f} MiB"  # 86 MiB measured


@pytest.mark.parametrize("form", ["api", "cli"])
def test_more_containers_than_a_node_holds_are_refused_before_a_model_is_made(form):
    """Minimal containers, each valid, under MAX_JSON_VALUES: each would cost a model of ~1.5 KB."""
    def body(n: int) -> str:
        if form == "api":
            return "API [" + ",".join(['{"Id":"a","State":"running","Names":["/x"]}'] * n) + "]"
        return "\n".join(['{"name":"/x","id":"a","image":"i","image_id":"j","state":"running"}'] * n)

    with pytest.raises(ProbeError, match=f"^containers: ValueError: more than {MAX_CONTAINERS} containers"):
        parse_containers(Section(body(MAX_CONTAINERS + 1), 0))
    assert len(parse_containers(Section(body(MAX_CONTAINERS), 0))[2]) == MAX_CONTAINERS


def test_per_line_parsers_keep_only_what_they_read():
    """`meminfo` with a million other keys (13 MiB): every line still a number, only MemTotal and MemAvailable
    kept (before: a dict of a million, 180 MiB)."""
    body = "\n".join(f"K{i}: 1 kB" for i in range(1_000_000)) + "\nMemTotal: 2 kB\nMemAvailable: 1 kB"
    memory, peak = _peak(lambda: parse_memory(Section(body, 0)))
    assert memory is not None and (memory.total_bytes, memory.available_bytes) == (2048, 1024)
    assert peak < 2**20, f"{peak / 2**20:.1f} MiB"


# -- honest output parses as it did ------------------------------------------------------------------------------

RECORDINGS = [Path(__file__).parents[1] / "fixtures" / "probe-4-nodes.json",
              Path(__file__).resolve().parents[3] / "bench" / "results" / "recordings" / "probe-4-nodes.json"]
#: `_digest` of each recording as the parsers before issue 53's change read it (commit cd44a13): every section
#: (body and code) of every node, and every node's weights listing.
PINNED = {"fixtures": "18a3aee5f15483d095f4a39dfab8a6e9", "recordings": "aca4e668e7c4225ffbdcca1ff6fd1114"}


def _digest(recording: Path) -> str:
    raw = json.loads(recording.read_text())
    desired = spec.loads(raw["desired"], "testbed.yaml")
    seen = []
    for node, output in sorted(raw["outputs"].items()):
        sections = split_sections(reseal(output, NONCE), NONCE)
        listing = manifest.read_listing(desired.weights_root(node), sections["weights"])
        w = listing.weights
        seen.append([{name: [s.body, s.rc] for name, s in sorted(sections.items())},
                     [[f.path, f.size, f.mtime, f.link_target] for f in w.files],
                     w.unsafe, w.unsafe_count, w.truncated, w.partials, sorted(listing.resolved.items())])
    return hashlib.sha256(json.dumps(seen).encode()).hexdigest()[:32]


@pytest.mark.parametrize("recording", RECORDINGS, ids=lambda p: p.parent.name)
def test_the_recorded_output_parses_as_it_did(recording):
    assert _digest(recording) == PINNED[recording.parent.name]


def _replay(walk, base: tuple[str, ...], value: str, hops: int = 0) -> tuple[str, tuple[str, ...], int]:
    """The resolution as it was before issue 53 (`_Walk.resolve`, recursive, no memory): the oracle."""
    parts = list(manifest._components(value))
    cur = base
    if value.startswith("/"):
        cur = ()
        for alias, canonical in walk.aliases.items():
            if tuple(parts[:len(alias)]) == alias:
                cur, parts = canonical, parts[len(alias):]
                break
    for i, name in enumerate(parts):
        if name == "..":
            cur = cur[:-1]
            continue
        nxt = cur + (name,)
        where, entry = walk.place(nxt)
        if where == "outside":
            return "outside", nxt + tuple(parts[i + 1:]), hops
        if entry is None:
            return "missing", nxt, hops
        if entry.kind == "l":
            if hops >= manifest._MAX_HOPS:
                return "loop", nxt, hops
            outcome, nxt, hops = _replay(walk, cur, entry.value, hops + 1)
            if outcome != "ok":
                return outcome, nxt, hops
            entry = walk.place(nxt)[1]
        cur = nxt
        if (i < len(parts) - 1 or value.endswith(("/", "/."))) and (entry is None or entry.kind != "d"):
            return "missing", cur, hops
    return "ok", cur, hops


@st.composite
def _graphs(draw):
    """A listing of up to 90 links among themselves, a file and a directory: chains near the 40-hop bound, loops,
    values through several links, absolute, climbing out."""
    n = draw(st.integers(1, 90))

    def target() -> str:
        k = draw(st.integers(0, n + 1))
        return f"n{k}" if k < n else ("f" if k == n else "d")

    lines = ["E\td\td\t0\t1\t", "E\td/f\tf\t7\t1\t", "E\tf\tf\t3\t1\t"]
    for i in range(n):
        form = draw(st.sampled_from(["one", "one", "one", "two", "in", "abs", "up", "out", "dir"]))
        value = {"one": lambda: target(), "two": lambda: f"{target()}/../{target()}", "in": lambda: f"{target()}/f",
                 "abs": lambda: f"/m/{target()}", "up": lambda: f"../m/{target()}", "out": lambda: "../etc/x",
                 "dir": lambda: f"{target()}/"}[form]()
        lines.append(f"E\tn{i}\tl\t1\t1\t{value}")
    return "C\ttree\t/m\nC.\n" + "\n".join(lines) + "\nF\t0"


def _chain(n: int, end: str) -> str:
    return "C\ttree\t/m\nC.\nE\tf\tf\t3\t1\t\nE\td\td\t0\t1\t\n" + "".join(
        f"E\tn{i:03d}\tl\t1\t1\t{f'n{i + 1:03d}' if i < n else end}\n" for i in range(n + 1)) + "F\t0"


@settings(**examples(300), deadline=None, suppress_health_check=list(HealthCheck))
@given(body=_graphs())
@example(body=_chain(39, "f"))  # 40 links to the file: the last hop allowed
@example(body=_chain(40, "f"))  # 41: a loop
@example(body=_chain(38, "n000"))  # a cycle of 39
@example(body=_chain(45, "d/f"))
def test_the_memoised_resolution_leads_where_the_replay_does(body):
    seen = manifest._lines(body)
    walk, root = manifest._walk("/m", seen)
    for path, entry in sorted(seen.tree.items()):
        if entry.kind == "l":
            base = root + manifest._components(path)[:-1]
            got, want = walk.resolve(base, entry.value), _replay(walk, base, entry.value)
            assert got[0] == want[0], (path, entry.value, got, want)
            if want[0] != "loop":  # where a loop was noticed is said differently, and used by nothing
                assert got == want, (path, entry.value)
