"""One row per step kind (issue 54): `core.kinds.KINDS` covers every kind, and each table that must stay in its own
layer (the step's body, its root commands, its stale rule, its promised effect) covers every kind too, so a new
kind missed from one of them fails here, not as a KeyError at run time (docs/architecture.md, "Where a change
goes")."""

from __future__ import annotations

from typing import get_args

import pytest

from reconciler.core.kinds import (
    ENGINE_STARTS,
    FETCHES,
    KINDS,
    NODE_STEPS,
    SERVING_CHAIN,
    STAGING,
    START_KINDS,
    STEP_KINDS,
    StaleRule,
    StepKind,
)
from reconciler.core.simulate import EFFECTS
from reconciler.core.spec import Timeouts
from reconciler.edge.ssh.commands import ROOT_COMMANDS, sudo_commands
from reconciler.edge.steps import plan_of
from reconciler.loop.operations import STALE_RULES
from tests.unit.step_cases import all_cases
from tests.unit.step_driver import root_runs


def test_the_table_has_one_row_per_step_kind() -> None:
    assert set(KINDS) == set(get_args(StepKind)) == set(STEP_KINDS)


@pytest.mark.parametrize("kind", STEP_KINDS)
def test_every_step_kind_has_a_body(kind: StepKind) -> None:
    assert callable(plan_of(kind))


def test_every_step_kind_has_a_promised_effect() -> None:
    assert set(EFFECTS) == set(STEP_KINDS)


def test_every_stale_rule_has_its_judgement() -> None:
    assert set(STALE_RULES) == set(get_args(StaleRule)) >= {KINDS[kind].stale for kind in STEP_KINDS}


def test_a_long_deadline_is_a_field_of_the_timeouts() -> None:
    fields = set(Timeouts.model_fields)
    assert {info.long_timeout for info in KINDS.values() if info.long_timeout} <= fields


def test_the_kinds_that_run_commands_as_root_are_exactly_those_with_root_commands() -> None:
    """`ROOT_COMMANDS` (what `reconciler sudoers` writes, by kind) names exactly the kinds whose step cases send
    `sudo`, and each such command is one of its own kind's (not merely the node's)."""
    sending: set[str] = set()
    for case in all_cases():
        desired, runs = root_runs(case)
        for node, argv in runs:
            sending.add(case.step.kind)
            assert argv in ROOT_COMMANDS[case.step.kind](desired, desired.node(node)), (case.name, node, argv)
    assert sending == set(ROOT_COMMANDS)


def test_sudo_commands_are_every_kinds_root_commands_in_order() -> None:
    from tests.unit.step_cases import sample

    desired = sample()
    for node in desired.nodes:
        assert sudo_commands(desired, node) == [a for f in ROOT_COMMANDS.values() for a in f(desired, node)]


def test_the_derived_sets_are_the_tables_they_replace() -> None:
    """The sets other modules read are the rows' columns; their members are what the old tables held."""
    assert {"stop-container", "start-container", "link"} == NODE_STEPS
    assert {"download", "pull-image", "image", "weights"} == STAGING
    assert {"download", "pull-image"} == FETCHES and FETCHES <= STAGING
    assert {"stop-serving", "start-serving", "launch-model", "await-health"} == SERVING_CHAIN
    assert ENGINE_STARTS == {"start-serving", "launch-model"} <= START_KINDS
    assert START_KINDS == {"start-serving", "launch-model", "await-health"} <= SERVING_CHAIN
    assert {kind: info.long_timeout for kind, info in KINDS.items() if info.long_timeout} == {
        "weights": "weights_sync", "download": "weights_sync", "image": "image_sync", "pull-image": "image_sync"}
    assert {kind: info.sign for kind, info in KINDS.items()} == {
        "stop-container": "-", "start-container": "+", "stop-serving": "-", "link": "~", "prune-weights": "-",
        "prune-images": "-", "download": "+", "pull-image": "+", "image": "+", "weights": "+",
        "start-serving": "+", "launch-model": "+", "await-health": "?"}
