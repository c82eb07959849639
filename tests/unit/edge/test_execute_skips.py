"""The executor's rule that a step whose `after` did not succeed never runs (edge/execute.py, `_why_skipped`):
it is skipped, saying which step it waited for, and so is everything after it, while independent steps run on.
A mutant that dropped the rule (only a veto or a shutdown skipped) survived every test before this one."""

from __future__ import annotations

import pytest

from reconciler.core.planning import Plan, Step
from reconciler.edge import execute as execute_module
from reconciler.edge.execute import StepResult, execute
from tests.unit.loop.test_operations import Ctx

WEIGHTS = Step("weights", "w", "sync")
STOP = Step("stop-serving", "h", "restart", (WEIGHTS.id,), container="vllm")
START = Step("start-serving", "h", "rank 0", (STOP.id,))
LINK = Step("link", "h", "down")


@pytest.fixture
def ran(monkeypatch) -> list[str]:
    """The steps the executor really ran; the weight sync fails, every other step succeeds."""
    started: list[str] = []

    def run_step(ctx, step, on_event, cancel=None):
        started.append(step.id)
        return StepResult(step, "failed" if step.kind == "weights" else "success", 0.1, "boom")

    monkeypatch.setattr(execute_module, "run_step", run_step)
    return started


def test_a_failed_step_skips_its_dependants_and_theirs(ran):
    outcome = execute(Plan([], [WEIGHTS, STOP, START, LINK], []), Ctx())
    results = {r.step.id: r for r in outcome.results}
    assert sorted(ran) == sorted([WEIGHTS.id, LINK.id]), "nothing after the failed sync ran"
    assert (results[STOP.id].result, results[STOP.id].message) == ("skipped", f"after {WEIGHTS.id}")
    assert (results[START.id].result, results[START.id].message) == ("skipped", f"after {STOP.id}")
    assert results[LINK.id].result == "success", "an independent step runs on"


def test_a_skipped_step_is_said_as_it_ends(ran):
    ended: list[tuple[str, str]] = []
    execute(Plan([], [WEIGHTS, STOP], []), Ctx(),
            on_event=lambda event, fields: ended.append((fields["result"].step.id, fields["result"].result))
            if event == "step.end" else None)
    assert (STOP.id, "skipped") in ended, "the loop counts it (reconciler_steps_total{result=skipped})"
