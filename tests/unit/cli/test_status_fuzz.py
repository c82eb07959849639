"""The status documents `reconciler status` reads, under fuzzing (issue 53): whatever JSON answers on the listener's
port (the daemon's own, proven, or anything when the status key cannot be read, `status_client.read_key`), the
command draws it or says it is not a status document (StatusError, exit 1), and what it draws `--json` writes back.
Never another exception: a field nested 995 deep (under json's own limit) once crashed the renderer and `--watch
--json` with a RecursionError.

The documents are the recorded ones (tests/unit/fixtures/status), each with a few of its values replaced by any
JSON, and any JSON at all.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from reconciler.cli.status_screen import MAX_DEPTH, render
from reconciler.edge.status_client import StatusError
from tests.unit.examples import examples

FIXTURES = Path(__file__).parents[1] / "fixtures" / "status"
RECORDED = [json.loads(p.read_text()) for p in sorted(FIXTURES.glob("*.json"))]
ANY = st.recursive(st.none() | st.booleans() | st.integers(-(2**70), 2**70)
                   | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=12),
                   lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=10), inner,
                                                                               max_size=3),
                   max_leaves=12)
DEEP: list = []  # a list nested 995 deep: about the deepest `json.loads` returns at the top of a stack
for _ in range(994):
    DEEP = [DEEP]
#: Where a document drawn holds DEEP (put in by `_deepened`: hypothesis prints the examples it draws, recursively).
DEEP_HERE = "<995 levels of lists>"


def _deepened(doc: object) -> object:
    """`doc` with DEEP wherever it holds DEEP_HERE."""
    if doc == DEEP_HERE:
        return DEEP
    stack = [doc]
    while stack:
        node = stack.pop()
        keys = list(node) if isinstance(node, dict) else range(len(node)) if isinstance(node, list) else []
        for key in keys:
            if node[key] == DEEP_HERE:
                node[key] = DEEP
            else:
                stack.append(node[key])
    return doc


def _places(doc: object, at: tuple = ()):
    """Every path to a value of `doc`."""
    yield at
    children = doc.items() if isinstance(doc, dict) else enumerate(doc) if isinstance(doc, list) else ()
    for key, value in children:
        yield from _places(value, (*at, key))


PLACES = [[p for p in _places(doc) if p] for doc in RECORDED]


@st.composite
def _mutated(draw) -> dict:
    which = draw(st.integers(0, len(RECORDED) - 1))
    doc = copy.deepcopy(RECORDED[which])
    for at in draw(st.lists(st.sampled_from(PLACES[which]), min_size=1, max_size=4)):
        parent = doc
        try:
            for key in at[:-1]:
                parent = parent[key]
            parent[at[-1]] = draw(st.one_of(ANY, st.just(DEEP_HERE)))
        except (KeyError, IndexError, TypeError):  # an earlier change took this place away
            pass
    return doc


def _said_or_drawn(doc: object, width: int, now: float) -> None:
    try:
        text = render("http://127.0.0.1:9464/status", doc, width, now)
    except StatusError as exc:
        assert exc.message and exc.code == 1
        return
    assert isinstance(text, str)
    json.dumps(doc), json.dumps(doc, indent=2)  # what `--json` and `--watch --json` write


@pytest.mark.parametrize("field", ["message", "reason", "type"])
def test_a_field_nested_past_the_bound_is_not_a_status_document(field):
    doc = copy.deepcopy(RECORDED[0])
    doc["conditions"][0][field] = DEEP
    with pytest.raises(StatusError, match=f"nested deeper than {MAX_DEPTH}"):
        render("u", doc, 80, 1.8e9)
    doc = copy.deepcopy(RECORDED[0])
    doc["unknown"] = DEEP  # nothing the renderer reads: still not written back
    with pytest.raises(StatusError, match=f"nested deeper than {MAX_DEPTH}"):
        render("u", doc, 80, 1.8e9)


def test_the_recorded_documents_are_within_the_bound():
    for doc in RECORDED:
        assert isinstance(render("u", doc, 80, 1.8e9), str)


@settings(**examples(300), deadline=None, suppress_health_check=list(HealthCheck))
@given(doc=st.one_of(_mutated(), _mutated(), ANY), width=st.sampled_from([1, 20, 80, 200]),
       now=st.one_of(st.just(1.8e9), st.floats(allow_nan=True, allow_infinity=True)))
@example(doc={**RECORDED[0], "unknown": DEEP_HERE}, width=80, now=1.8e9)
@example(doc={**RECORDED[0], "lastConverged": float("inf")}, width=80, now=1.8e9)
def test_any_document_is_drawn_or_said_not_to_be_one(doc, width, now):
    _said_or_drawn(_deepened(copy.deepcopy(doc)), width, now)
