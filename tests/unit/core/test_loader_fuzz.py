"""Issue 7: the loader under fuzzing. Any text or bytes given to spec.loads ends as a valid model or as
InvalidDesiredState with placed messages (`FILE:LINE:COLUMN: ...`): never another exception, never more work than
the loader's caps allow (the `build_meter` fixture stops any document that goes past them). Issue 53 keeps it as the
fuzzing of the desired-state file, one of the parsers of file input."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from reconciler.core import spec
from tests.unit.examples import examples

pytestmark = pytest.mark.usefixtures("build_meter")
SETTINGS = {"deadline": None, "suppress_health_check": [HealthCheck.too_slow, HealthCheck.function_scoped_fixture]}

GOOD = (Path(__file__).resolve().parents[3] / "desired-state" / "testbed.yaml").read_bytes()
YAMLISH = st.lists(st.sampled_from(list("abc:-[]{}&*!|>'\"#%@`,?\n\t ") + ["nodes", "model", "serving", "policy",
                                                                           "<<", "&a", "*a", "!!python/object"]),
                   max_size=120).map("".join)


def check(data: str | bytes) -> None:
    try:
        result = spec.loads(data, "fuzz.yaml")
    except spec.InvalidDesiredState as exc:
        lines = exc.lines()
        assert lines and all(re.match(r"fuzz\.yaml:[0-9]+:[0-9]+: ", line) for line in lines), lines
    else:
        assert isinstance(result, spec.Desired)


@settings(**examples(300), **SETTINGS)
@given(st.one_of(st.text(max_size=500), YAMLISH))
@example("a: &a [x, x]\nb: &b [*a, *a, *a, *a, *a, *a, *a, *a]\nc: [*b, *b, *b, *b, *b, *b, *b, *b, *b, *b]\n")
@example("\ufeffnodes: []\n")
@example("--- {}\n--- {}\n")
@example("nodes: !!python/object/apply:os.system ['id']\n")
@example("!0\t:")
def test_any_text(text):
    check(text)


@settings(**examples(300), **SETTINGS)
@given(st.binary(max_size=500))
@example(b"\xff\xfe\x00n\x00o")
@example(b"nodes: \xc3\x28\n")
def test_any_bytes(data):
    check(data)


@settings(**examples(200), **SETTINGS)
@given(pos=st.integers(0, len(GOOD) - 1), junk=st.binary(min_size=1, max_size=8), cut=st.booleans())
def test_mutations_of_the_real_file(pos, junk, cut):
    check(GOOD[:pos] + (b"" if cut else junk + GOOD[pos:]))


def test_oversize_is_refused():
    check(GOOD + b"#" + b"x" * (100 << 20))
