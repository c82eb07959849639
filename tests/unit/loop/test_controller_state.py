"""What the daemon keeps across restarts in its state dir: generations, and when the cluster last converged (so
Grafana's "since last converged" is right right after a restart, not 1970); and the step_hold gauge's life."""

from __future__ import annotations

import threading

from reconciler.core.spec import Retries
from reconciler.loop.backoff import Backoff
from reconciler.loop.generations import GenerationStore
from reconciler.loop.metrics import REGISTRY
from reconciler.loop.status import StatusPublisher
from reconciler.loop.triggers import ReconcileRequests
from tests.unit.controllers import make_controller

LAST_CONVERGED = "reconciler_last_converged_timestamp_seconds"


def test_last_converged_survives_a_restart(tmp_path):
    desired, state = tmp_path / "cluster.yaml", tmp_path / "state"
    desired.write_text("not read by this test\n")
    state.mkdir()
    first = GenerationStore(state, desired)
    first.generation, first.observed_generation = 4, 3
    first.converged(1_700_000_000.5)

    second = make_controller(desired, state, ReconcileRequests(), threading.Event())
    assert (second.store.generation, second.store.observed_generation) == (4, 4)
    assert second.store.last_converged == 1_700_000_000.5
    assert REGISTRY.get_sample_value(LAST_CONVERGED) == 1_700_000_000.5


def test_a_state_file_from_before_has_no_time_and_no_metric_is_invented(tmp_path):
    desired, state = tmp_path / "cluster.yaml", tmp_path / "state"
    desired.write_text("x\n")
    state.mkdir()
    GenerationStore(state, desired).file.write_text('{"hash": null, "generation": 2, "observedGeneration": 2}')
    again = GenerationStore(state, desired)
    assert (again.generation, again.last_converged) == (2, 0.0)


def test_generations_bump_on_new_content_only_and_survive_a_restart(tmp_path):
    desired, state = tmp_path / "cluster.yaml", tmp_path / "state"
    state.mkdir()
    store = GenerationStore(state, desired)
    assert store.take("a") and store.generation == 1
    assert not store.take("a") and store.generation == 1
    assert store.take("b") and store.generation == 2
    restarted = GenerationStore(state, desired)
    assert restarted.take("b") and restarted.generation == 2, "the same content keeps its number after a restart"
    assert restarted.take("c") and restarted.generation == 3


def test_a_corrupt_state_file_starts_from_zero(tmp_path):
    desired, state = tmp_path / "cluster.yaml", tmp_path / "state"
    state.mkdir()
    GenerationStore(state, desired).file.write_text('["not", "an", "object"]')
    store = GenerationStore(state, desired)
    assert (store.generation, store.observed_generation, store.last_converged) == (0, 0, 0.0)
    assert store.take("a") and store.generation == 1


def _hold_gauge(node: str) -> float | None:
    return REGISTRY.get_sample_value("reconciler_step_hold", {"kind": "await-health", "node": node})


def test_the_step_hold_gauge_returns_to_0_when_the_hold_ends(tmp_path):
    """A success drops the step's record; the gauge once stayed at 1 until the daemon restarted."""
    publisher = StatusPublisher(tmp_path / "cluster.yaml")
    holds = Backoff(Retries(hold_after=2))
    for _ in range(2):
        holds.failed("await-health/gb-head", "unhealthy", 0.0)
    holds.failed("await-health/gb-worker", "unhealthy", 0.0)  # failing, not held yet
    publisher.holds(holds.held())
    assert set(holds.held()) == {"await-health/gb-head"}
    assert (_hold_gauge("gb-head"), _hold_gauge("gb-worker")) == (1.0, None)

    holds.succeeded("await-health/gb-head")
    publisher.holds(holds.held())
    assert _hold_gauge("gb-head") == 0.0
