"""`serving.verify` on the testbed (issue 52, item 8): after the start, the fixed prompt goes to the head's real
OpenAI-shaped API (the vLLM stand-in, which answers every completion with `max_tokens` words `stand-in`). An
expectation the answer meets converges; one it does not fails the start, saying what came back and what was
expected (the daemon's rollback of such a change: tests/unit/loop/test_serving_verify.py)."""

from __future__ import annotations

import pytest
import yaml

from tests.e2e.test_converge import reconciler

pytestmark = pytest.mark.e2e


def _with_verify(tb, tmp_path, expect: str, name: str) -> str:
    data = yaml.safe_load(tb.desired_state.read_text())
    data["serving"]["verify"] = {"prompt": "12*17=", "expect": expect, "max_tokens": 3}
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data, sort_keys=False, explicit_end=True))
    return str(path)


def test_an_answer_that_meets_the_expectation_converges_and_one_that_does_not_fails_the_start(seed_testbed, tmp_path):
    tb = seed_testbed
    right = reconciler("apply", _with_verify(tb, tmp_path, r"^stand-in( stand-in)*$", "right.yaml"), "--yes",
                       timeout=900)
    assert right.returncode == 0, right.stdout + right.stderr
    assert "Converged" in right.stdout

    tb.reset("seed")
    wrong = reconciler("apply", _with_verify(tb, tmp_path, r"\b204\b", "wrong.yaml"), "--yes", timeout=900)
    out = wrong.stdout + wrong.stderr
    assert wrong.returncode == 1, out
    assert "await-health" in out and "stand-in stand-in stand-in" in out and "204" in out, out
