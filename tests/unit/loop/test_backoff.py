"""The per-step backoff (reconciler/loop/backoff.py) against its own contract, stated here from the module's docstring
and docs/operations.md, not from the code: a failed step waits initial x 2^(failures-1), capped at backoff_max,
+-20 % jitter; from `hold_after` consecutive failures on it is held (one try per backoff_max); success forgets
it; one serving step that waits makes the whole ordered restart wait (no restart storm)."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from reconciler.core.planning import Plan, Step
from reconciler.core.spec import Retries
from reconciler.loop.backoff import Backoff, vetoes
from tests.unit.examples import examples

RETRIES = Retries(backoff_initial="2s", backoff_max="60s", hold_after=4)


def expected_wait(failures: int) -> float:
    """The contract's nominal wait after `failures` consecutive failures (before jitter)."""
    if failures >= RETRIES.hold_after:
        return RETRIES.backoff_max
    return min(RETRIES.backoff_max, RETRIES.backoff_initial * 2 ** (failures - 1))


@given(st.integers(min_value=1, max_value=12), st.integers(min_value=0, max_value=2**32))
def test_a_failed_step_waits_its_backoff_within_the_jitter(failures, seed):
    holds = Backoff(RETRIES, rng=random.Random(seed))
    for _ in range(failures):
        holds.failed("link/n1", "ip: permission denied", now=1000.0)
    wait = holds.records["link/n1"].next_try - 1000.0
    assert 0.8 * expected_wait(failures) <= wait <= 1.2 * expected_wait(failures)
    assert holds.is_held("link/n1") == (failures >= RETRIES.hold_after)
    assert ("link/n1" in holds.held()) == (failures >= RETRIES.hold_after)


def test_the_reason_says_held_or_backing_off_and_the_last_error_and_ends_with_the_wait():
    holds = Backoff(RETRIES, rng=random.Random(1))
    holds.failed("weights/n2", "rsync: connection reset", now=0.0)
    reason = holds.wait_reason("weights/n2", now=0.1)
    assert reason is not None and reason.startswith("backing off after 1 failure(s)")
    assert reason.endswith("last error: rsync: connection reset")
    due = holds.records["weights/n2"].next_try
    assert holds.wait_reason("weights/n2", now=due) is None, "the step may run once its wait is over"
    for _ in range(3):
        holds.failed("weights/n2", "rsync: connection reset", now=0.0)
    assert holds.wait_reason("weights/n2", now=0.1).startswith("held after 4 failure(s)")


def test_success_forgets_the_step_and_its_count():
    holds = Backoff(RETRIES, rng=random.Random(2))
    for _ in range(5):
        holds.failed("image/n2", "docker load: no space left", now=0.0)
    holds.succeeded("image/n2")
    assert holds.wait_reason("image/n2", now=0.0) is None and not holds.held()
    holds.failed("image/n2", "again", now=0.0)
    assert holds.records["image/n2"].failures == 1


def test_next_due_is_the_earliest_wait_still_running():
    holds = Backoff(RETRIES, rng=random.Random(3))
    holds.failed("a/n1", "x", now=0.0)
    holds.failed("b/n1", "x", now=100.0)
    a, b = holds.records["a/n1"].next_try, holds.records["b/n1"].next_try
    assert holds.next_due(now=0.0) == pytest.approx(min(a, b))
    assert holds.next_due(now=a) == pytest.approx(b), "an ended wait is due no more"
    assert holds.next_due(now=b) is None


def _plan(*ids: str) -> Plan:
    parts = [i.split("/") for i in ids]
    return Plan([], [Step(kind, node, "why", container=rest[0] if rest else None)  # type: ignore[arg-type]
                     for kind, node, *rest in parts], [])


@given(st.sampled_from(["stop-serving/h", "start-serving/w", "launch-model/h", "await-health/h"]))
@settings(**examples(50))
def test_one_waiting_serving_step_holds_back_the_whole_ordered_restart(waiting):
    plan = _plan("stop-container/h/x", "stop-serving/h", "stop-serving/w", "start-serving/w", "start-serving/h",
                 "launch-model/h", "await-health/h")
    holds = Backoff(RETRIES, rng=random.Random(4))
    holds.failed(waiting, "vllm exited", now=0.0)
    out = vetoes(plan, holds, now=0.5)
    serving = {s.id for s in plan.steps if s.kind != "stop-container"}
    assert set(out) == serving, "the other steps run; every serving step waits"
    assert all(waiting in reason for sid, reason in out.items() if sid != waiting)


def test_a_waiting_step_outside_the_chain_holds_back_only_itself():
    plan = _plan("link/w", "weights/w", "stop-serving/w")
    holds = Backoff(RETRIES, rng=random.Random(5))
    holds.failed("link/w", "ip: no such device", now=0.0)
    assert set(vetoes(plan, holds, now=0.5)) == {"link/w"}
