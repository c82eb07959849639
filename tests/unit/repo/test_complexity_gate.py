"""The complexity gate of `make lint` (tests/complexity.py, issue 54) flags what ruff's C901 lets through: a
function is judged by its branches and by the operands of its boolean chains, one by one, methods and closures
included; 15 passes, 16 does not. The expected figures follow McCabe's rule as radon states it (one, plus one per
`if`/`elif`/loop/`except`/comprehension `if`, plus one per extra operand of an `and`/`or`), counted here by hand."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.complexity import LIMIT, main, offenders


def _ifs(name: str, n: int, indent: str = "") -> str:
    """A function of complexity n + 1: n `if`s in a row."""
    body = "".join(f"{indent}    if x == {i}:\n{indent}        return {i}\n" for i in range(n))
    return f"{indent}def {name}(x):\n{body}{indent}    return -1\n"


def test_the_limit_is_on_the_line_between_15_and_16(tmp_path: Path) -> None:
    first = _ifs("fifteen", LIMIT - 1)
    (tmp_path / "m.py").write_text(first + _ifs("sixteen", LIMIT))
    second_line = first.count("\n") + 1
    assert offenders([tmp_path]) == [f"{tmp_path / 'm.py'}:{second_line} sixteen ({LIMIT + 1})"]


def test_a_chain_of_ands_counts_each_operand_where_c901_sees_one_branch(tmp_path: Path) -> None:
    chain = " and ".join(f"x[{i}]" for i in range(LIMIT))  # LIMIT - 1 operators: 1 + 1 + (LIMIT - 1) = LIMIT + 1
    (tmp_path / "m.py").write_text(f"def hidden(x):\n    if {chain}:\n        return 1\n    return 0\n")
    assert offenders([tmp_path]) == [f"{tmp_path / 'm.py'}:1 hidden ({LIMIT + 1})"]


def test_methods_and_closures_are_judged_one_by_one(tmp_path: Path) -> None:
    (tmp_path / "m.py").write_text("class C:\n" + _ifs("method", LIMIT, "    ") + "\n\ndef outer():\n"
                                   + _ifs("inner", LIMIT, "    ") + "    return inner\n")
    found = offenders([tmp_path])
    assert [line.rsplit(" ", 2)[1:] for line in found] == [["C.method", f"({LIMIT + 1})"],
                                                          ["outer.inner", f"({LIMIT + 1})"]]


def test_the_gate_fails_the_run_only_when_something_is_above(tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "ok.py").write_text(_ifs("fine", LIMIT - 1))
    assert main([str(tmp_path)]) == 0
    (tmp_path / "bad.py").write_text(_ifs("over", LIMIT))
    assert main([str(tmp_path)]) == 1 and "over" in capsys.readouterr().out


def test_the_package_itself_passes() -> None:
    assert offenders([Path(__file__).resolve().parents[3] / "reconciler"]) == []
