"""A save that dies half-way leaves a prefix of the file: no prefix may count as a desired state unless it means
exactly what the whole file means (issue 16, finding 4; docs/security.md "Half-written files").

The oracle is the whole file's own parse: every byte-prefix either is refused or parses to an equal `Desired`.
Before the end marker, 1,826 of the 5,545 byte-prefixes of the sample validated and 1,653 of them meant something
else than the whole file, some stopping co-tenants the whole file allows.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from reconciler.core import spec
from reconciler.edge import discover as disc
from tests.unit.edge.test_export import facts_from, json_fixture, spark_addr_json, text_fixture

REPO = Path(__file__).resolve().parents[3]


def _discovered() -> bytes:
    head = facts_from(spark_addr_json(), ibdev=text_fixture("ibdev2netdev-spark.txt"))
    head.models = [disc.ModelDir("hf-cache", "/home/spark/.cache/huggingface/hub", "Qwen/Qwen3-8B", 16_000_000,
                                 "a" * 40)]
    worker = facts_from(json_fixture("ip-addr-testbed-worker.json"), host="10.231.1.11")
    return disc.render([head, worker], user="spark", known_hosts="/etc/spark-reconciler/known_hosts",
                       identity=None, jump=True).encode()


def _samples() -> dict[str, bytes]:
    cluster = (REPO / "desired-state" / "cluster.yaml").read_bytes()
    return {
        "cluster.yaml": cluster,
        "cluster.yaml, observe mode": cluster.replace(b"mode: enforce", b"mode: observe", 1),
        "testbed.yaml": (REPO / "desired-state" / "testbed.yaml").read_bytes(),
        "discover output": _discovered(),
    }


def _parse(text: bytes) -> spec.Desired | None:
    try:
        return spec.loads(text, "X")
    except spec.InvalidDesiredState:
        return None


@pytest.mark.parametrize("name", list(_samples()))
def test_every_prefix_is_refused_or_means_the_whole_file(name):
    text = _samples()[name]
    whole = _parse(text)
    assert whole is not None, f"the sample {name} itself must be valid"
    meaning_something_else = [n for n in range(len(text)) if (p := _parse(text[:n])) is not None and p != whole]
    assert meaning_something_else == []


def test_a_prefix_is_told_why(problems, base_yaml):
    cut = base_yaml[: base_yaml.index("co_tenants:")]
    assert problems(cut) == ["X:30:1: the file does not end with the line `...` (YAML's document end marker, "
                             "required as the last line: a half-written save must never count as a desired state)"]


def test_the_marker_may_carry_a_comment_and_trailing_blank_lines(problems, base_yaml):
    assert problems(base_yaml.replace("...\n", "...   # end\n\n# notes after the end\n\n")) == []


def test_text_after_the_marker_is_refused(problems, base_yaml):
    assert problems(base_yaml + "policy: {mode: observe}\n") == [
        "X:39:1: invalid YAML: did not find expected <document start>"]
    assert any("only one YAML document" in line for line in problems(base_yaml + "---\npolicy: {}\n...\n"))
