"""What the daemon keeps across restarts in its state dir: generations, and when the cluster last converged (so
Grafana's "since last converged" is right right after a restart, not 1970)."""

from __future__ import annotations

from reconciler.controller import Controller
from reconciler.holds import Holds
from reconciler.metrics import REGISTRY
from reconciler.spec import Retries

LAST_CONVERGED = "reconciler_last_converged_timestamp_seconds"


def test_last_converged_survives_a_restart(tmp_path):
    desired, state = tmp_path / "cluster.yaml", tmp_path / "state"
    desired.write_text("not read by this test\n")
    state.mkdir()
    first = Controller(desired, state)
    first.generation, first.observed_generation, first.last_converged = 4, 3, 1_700_000_000.5
    first._save_generations()

    second = Controller(desired, state)
    assert (second.generation, second.observed_generation) == (4, 3)
    assert second.last_converged == 1_700_000_000.5
    assert REGISTRY.get_sample_value(LAST_CONVERGED) == 1_700_000_000.5


def test_a_state_file_from_before_has_no_time_and_no_metric_is_invented(tmp_path):
    desired, state = tmp_path / "cluster.yaml", tmp_path / "state"
    desired.write_text("x\n")
    state.mkdir()
    old = Controller(desired, state)
    old._state_file().write_text('{"hash": null, "generation": 2, "observedGeneration": 2}')
    again = Controller(desired, state)
    assert (again.generation, again.last_converged) == (2, 0.0)


def _hold_gauge(node: str) -> float | None:
    return REGISTRY.get_sample_value("reconciler_step_hold", {"kind": "await-health", "node": node})


def test_the_step_hold_gauge_returns_to_0_when_the_hold_ends(tmp_path):
    """A success drops the step's record; the gauge once stayed at 1 until the daemon restarted."""
    desired = tmp_path / "cluster.yaml"
    desired.write_text("x\n")
    controller = Controller(desired, tmp_path / "state")
    controller.holds = Holds(Retries(hold_after=2))
    for _ in range(2):
        controller.holds.failed("await-health/gb-head", "unhealthy", 0.0)
    controller.holds.failed("await-health/gb-worker", "unhealthy", 0.0)  # failing, not held yet
    assert set(controller._publish_holds()) == {"await-health/gb-head"}
    assert (_hold_gauge("gb-head"), _hold_gauge("gb-worker")) == (1.0, None)

    controller.holds.succeeded("await-health/gb-head")
    assert controller._publish_holds() == {}
    assert _hold_gauge("gb-head") == 0.0
