"""Every step case of tests/unit/step_cases/: recorded facts in, the exact commands out (or the refusal), run
through the test driver (tests/unit/step_driver.py) with no node, no thread and no clock."""

from __future__ import annotations

import re

import pytest

from reconciler.edge.steps import plan_of
from reconciler.edge.steps.actions import Given
from tests.unit.step_cases import Case, all_cases
from tests.unit.step_driver import Driver, root_runs

CASES = all_cases()


@pytest.mark.parametrize("case", CASES, ids=str)
def test_step_case(case: Case) -> None:
    given = Given(case.desired(), case.observed(), case.generation)
    driver = Driver(case.facts, case.results)
    error = driver.drive(plan_of(case.step.kind)(given, case.step))
    assert driver.transcript == list(case.commands)
    assert {key: driver.timeouts[key] for key in case.timeouts} == dict(case.timeouts), "a command's deadline"
    if case.raises is None:
        assert error is None, f"the step ended with {error!r}"
    else:
        assert error is not None, "the step did not refuse"
        kinds = [kind.__name__ for kind in type(error).__mro__]  # "StepFailed" also names its StepTimedOut
        assert case.error in kinds and re.search(case.raises, str(error)), repr(error)


def test_every_step_kind_has_cases() -> None:
    """A step kind without a case is a step whose commands nobody pinned."""
    from reconciler.core.kinds import STEP_KINDS

    assert sorted(set(STEP_KINDS) - {case.step.kind for case in CASES}) == []


def test_every_command_a_step_sends_as_root_is_one_of_the_nodes_exact_sudoers_lines() -> None:
    """What `reconciler sudoers` writes (`sudo_commands`, exact argv, no patterns) is everything a step may run as
    root: each `run NODE sudo ARGV` of every case is one of them, for the case's own file."""
    from reconciler.edge.ssh import sudo_commands

    seen = 0
    for case in CASES:
        desired, runs = root_runs(case)
        for node, argv in runs:
            seen += 1
            assert argv in sudo_commands(desired, desired.node(node)), (case.name, node, argv)
    assert seen, "the link and serving steps run commands as root"
