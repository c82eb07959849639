"""A running but unhealthy vLLM is restarted in order after a grace; a cold start is waited for.

The oracle is written here from the issue, not from the plan: a deployment that served and then failed its health
check (the most common wedge on a real cluster: an NCCL hang, a stuck rank) is restarted once the failure has
lasted `serving.unhealthy_grace`; before that, nothing is touched; a container that has never served is a cold
start and gets `await-health` (its long allowance). The health history comes from `HealthWatch`, fed a sequence
of observations with a fake clock.
"""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from reconciler.core.loader import load_file
from reconciler.core.observed import NodeObservation, Observed, ServingApi
from reconciler.core.planning import plan, unhealthy_grace
from reconciler.core.spec import Desired
from reconciler.loop.health_watch import HealthWatch, _age
from tests.unit.conftest import converged_in_simulator

GRACE = 300.0


@pytest.fixture
def desired(cluster_yaml) -> Desired:
    data = load_file(cluster_yaml).data
    data["serving"]["unhealthy_grace"] = f"{int(GRACE)}s"
    return Desired.model_validate(data)


@pytest.fixture
def deployed(desired, seed_snapshot) -> Observed:
    """The seed converged by the simulator: serving runs with the right spec and answers."""
    return converged_in_simulator(desired, seed_snapshot)


def _head_serving(desired: Desired, observed: Observed, serving: ServingApi, container_id: str | None = None
                  ) -> Observed:
    head = desired.head.name
    node = observed.node(head)
    update: dict = {"serving": serving}
    if container_id is not None:
        update["containers"] = [c.model_copy(update={"id": container_id})
                                if c.name == desired.serving.container_name else c for c in node.containers]
    return observed.model_copy(update={"nodes": {**observed.nodes, head: node.model_copy(update=update)}})


def healthy(desired):
    return ServingApi(reachable=True, healthy=True, models=[desired.serving.served_model_name or desired.model.id])


WEDGED = ServingApi(reachable=True, healthy=True, models=["x"], completion_error="timed out after 5 s (curl exit 28)")


def _restarts_in_order(desired, result) -> bool:
    """The oracle of an ordered restart: every serving node's container stopped, then started, then health."""
    serving = {n.name for n in desired.serving_nodes}
    kinds = [(s.kind, s.node) for s in result.steps]
    return ({n for k, n in kinds if k == "stop-serving"} == serving
            and {n for k, n in kinds if k == "start-serving"} == serving
            and any(k == "await-health" for k, _ in kinds))


def test_served_then_wedged_is_left_alone_within_the_grace_and_restarted_after(desired, deployed):
    watch = HealthWatch()
    seen = watch.annotate(desired, _head_serving(desired, deployed, healthy(desired)), now=1000.0)
    assert not plan(desired, seen).changes

    within = watch.annotate(desired, _head_serving(desired, deployed, WEDGED), now=1010.0)
    assert watch.annotate(desired, _head_serving(desired, deployed, WEDGED), now=1010.0 + GRACE - 1).node(
        desired.head.name).serving.unhealthy_for == pytest.approx(GRACE - 1)
    early = plan(desired, watch.annotate(desired, _head_serving(desired, deployed, WEDGED), now=1010 + GRACE - 1))
    assert early.steps == [], "within the grace nothing is stopped"
    assert any("restarted in order after 300s" in b.reason for b in early.blocked)
    assert plan(desired, within).steps == []

    late = plan(desired, watch.annotate(desired, _head_serving(desired, deployed, WEDGED), now=1010.0 + GRACE))
    assert _restarts_in_order(desired, late), [s.id for s in late.steps]
    assert "failed its health check for 300s" in late.steps[0].reason


def test_a_cold_start_that_never_served_waits_for_health_instead(desired, deployed):
    watch = HealthWatch()
    for t in (0.0, 100.0, 10 * GRACE):
        result = plan(desired, watch.annotate(desired, _head_serving(desired, deployed, ServingApi()), now=t))
        assert [s.kind for s in result.steps] == ["await-health"], t


def test_the_grace_is_the_files_until_a_restart_has_failed_to_hold(desired, deployed):
    """No health history (a fresh daemon, or the head's API never answered) is no failed restart: the grace is
    serving.unhealthy_grace itself, and it doubles per restart that did not hold."""
    unseen = _head_serving(desired, deployed, None)
    assert unhealthy_grace(desired, unseen) == GRACE
    twice = _head_serving(desired, deployed, WEDGED.model_copy(update={"health_restarts": 2}))
    assert unhealthy_grace(desired, twice) == 4 * GRACE


def test_no_wait_for_health_while_a_serving_node_cannot_be_reached(desired, deployed):
    """Waiting for /health needs every rank: with a worker unreachable the plan says so instead of starting an
    await-health step that can only time out (the mutant of record "await-health while a serving node is
    unreachable"; the property test finds this case only by chance)."""
    worker = desired.serving_nodes[1].name
    cold = _head_serving(desired, deployed, ServingApi())
    unseen = cold.model_copy(update={"nodes": {**cold.nodes, worker: NodeObservation(
        name=worker, reachable=False, error="connection timed out")}})
    result = plan(desired, HealthWatch().annotate(desired, unseen, now=0.0))
    assert not [s.id for s in result.steps if s.kind == "await-health"]
    assert any(worker in b.reason and "cannot be reached" in b.reason for b in result.blocked), result.blocked


def test_a_container_older_than_the_cold_start_allowance_counts_as_having_served(desired, deployed):
    """After a daemon restart the watch has no history: a wedged vLLM that has run for longer than
    health_timeout is not granted another hour of await-health."""
    head = desired.head.name
    node = deployed.node(head)
    old = [c.model_copy(update={"started_at": "2026-11-30T08:00:00.123456789Z"})
           if c.name == desired.serving.container_name else c for c in node.containers]
    observed = deployed.model_copy(update={"nodes": {**deployed.nodes, head: node.model_copy(
        update={"containers": old, "serving": WEDGED})}})
    now = datetime(2026, 11, 30, 10, 0, tzinfo=UTC).timestamp()  # 2 h after the start, 1 h past health_timeout
    watch = HealthWatch(wall=lambda: now)  # the wall clock gives the age at first sight; durations then run on `now`
    first = watch.annotate(desired, observed, now=now)
    assert first.node(head).serving.served_before
    assert plan(desired, first).steps == []
    assert _restarts_in_order(desired, plan(desired, watch.annotate(desired, observed, now=now + GRACE)))


def test_each_restart_that_does_not_hold_doubles_the_grace(desired, deployed):
    watch, t = HealthWatch(), 0.0
    for restarts, cid in enumerate(("c1", "c2", "c3")):
        grace = GRACE * 2**restarts
        watch.annotate(desired, _head_serving(desired, deployed, healthy(desired), cid), now=t)
        watch.annotate(desired, _head_serving(desired, deployed, WEDGED, cid), now=t + 1)
        before = plan(desired, watch.annotate(desired, _head_serving(desired, deployed, WEDGED, cid), now=t + grace))
        assert before.steps == [], (restarts, "still within the doubled grace")
        after = watch.annotate(desired, _head_serving(desired, deployed, WEDGED, cid), now=t + 1 + grace)
        assert after.node(desired.head.name).serving.health_restarts == restarts
        assert _restarts_in_order(desired, plan(desired, after)), restarts
        t += 2 * grace


def test_serving_well_for_sixteen_graces_forgets_the_restarts(desired, deployed):
    watch = HealthWatch()
    watch.annotate(desired, _head_serving(desired, deployed, healthy(desired), "c1"), now=0)
    watch.annotate(desired, _head_serving(desired, deployed, WEDGED, "c1"), now=1)
    watch.annotate(desired, _head_serving(desired, deployed, healthy(desired), "c2"), now=2 * GRACE)
    assert watch.restarts == 1
    watch.annotate(desired, _head_serving(desired, deployed, healthy(desired), "c2"), now=2 * GRACE + 16 * GRACE)
    assert watch.restarts == 0


def test_a_serving_container_that_is_gone_resets_the_failure_clock(desired, deployed):
    watch = HealthWatch()
    watch.annotate(desired, _head_serving(desired, deployed, healthy(desired)), now=0)
    watch.annotate(desired, _head_serving(desired, deployed, WEDGED), now=1)
    head = desired.head.name
    gone = deployed.model_copy(update={"nodes": {**deployed.nodes, head: deployed.node(head).model_copy(
        update={"containers": [], "serving": ServingApi()})}})
    watch.annotate(desired, gone, now=2)
    assert watch.unhealthy_since is None


@pytest.mark.parametrize(("text", "age"), [
    ("2026-12-03T10:00:00Z", 60.0),
    ("2026-12-03T10:00:00.5Z", 59.5),
    ("2026-12-03T10:00:00.123456789Z", 59.876544),
    ("2026-12-03T10:00:00+00:00", 60.0),
    ("0001-01-01T00:00:00Z", 0.0),
    ("", 0.0),
    (None, 0.0),
    ("yesterday", 0.0),
])
def test_docker_start_times_are_read_with_nanoseconds_and_garbage_is_no_age(text, age):
    assert _age(text, datetime(2026, 12, 3, 10, 1, tzinfo=UTC).timestamp()) == pytest.approx(age, abs=1e-5)


def test_the_docker_api_path_gives_the_age_too():
    """The probe's default path, the Docker API's /containers/json, has no State.StartedAt; its `Created` (unix
    seconds) is the serving container's start (`docker run`, `--restart no`, never started again in place). Read
    from what the probe really printed on the recorded cluster: a daemon started two hours later takes a frozen
    vLLM for a wedge, not a cold start (issue 30, finding 2)."""
    import json

    from tests.unit.recorded import RAW, load, observe

    recorded = load()
    body = next(line for line in RAW["outputs"]["head"].splitlines() if line.startswith("API ["))
    created = next(c["Created"] for c in json.loads(body[4:]) if "/vllm_serving" in c["Names"])
    state = observe(recorded)
    container = state.node("head").container("vllm_serving")
    assert container is not None and container.started_at is not None
    assert _age(container.started_at, created + 7200) == 7200
    frozen = state.model_copy(update={"nodes": {**state.nodes, "head": state.node("head").model_copy(
        update={"serving": WEDGED})}})
    late = created + recorded.serving.health_timeout + 1
    watch = HealthWatch(wall=lambda: late)
    assert watch.annotate(recorded, frozen, now=late).node("head").serving.served_before
    after = watch.annotate(recorded, frozen, now=late + recorded.serving.unhealthy_grace)
    assert _restarts_in_order(recorded, plan(recorded, after))


# -- busy is not wedged (issue 30, finding 1) ----------------------------------------------------------------------

def _queued(desired, tokens: float) -> ServingApi:
    """The probe's completion waited out its deadline behind full slots; vLLM's counters as /metrics gave them."""
    from reconciler.core.observed import EngineLoad

    name = desired.serving.served_model_name or desired.model.id
    return ServingApi(reachable=True, healthy=True, models=[name], completion_error="no answer within 5s",
                      engine=EngineLoad(running=4, waiting=3, tokens=tokens))


def test_a_busy_engine_is_never_restarted_however_long_the_load_lasts(desired, deployed):
    """Every slot taken for ten graces: the tokens grow at every probe, so it is busy, not unhealthy: no health
    drift, no restart, and the status says so."""
    watch, t = HealthWatch(), 1000.0
    watch.annotate(desired, _head_serving(desired, deployed, _queued(desired, 100)), now=t)  # the baseline
    for i in range(1, 11):
        seen = watch.annotate(desired, _head_serving(desired, deployed, _queued(desired, 100 + 500 * i)),
                              now=t + i * GRACE)
        api = seen.node(desired.head.name).serving
        assert api.busy and api.unhealthy_for is None and api.working(api.models[0]), i
        result = plan(desired, seen)
        assert not [d for d in result.drift if d.kind == "health"] and result.steps == [], i


def test_an_engine_whose_counters_stand_still_is_a_wedge_from_the_first_failed_check(desired, deployed):
    """The baseline is read after the probe's own completion: a freeze shows at once (health drift, so the status
    leaves Converged), and after the grace the pair is restarted in order."""
    watch, t = HealthWatch(), 1000.0
    answered = healthy(desired).model_copy(update={"engine": _queued(desired, 700).engine})
    watch.annotate(desired, _head_serving(desired, deployed, answered), now=t)
    first = watch.annotate(desired, _head_serving(desired, deployed, _queued(desired, 700)), now=t + 3)
    assert not first.node(desired.head.name).serving.busy
    assert [d.kind for d in plan(desired, first).drift] == ["health"]
    later = watch.annotate(desired, _head_serving(desired, deployed, _queued(desired, 700)), now=t + 3 + GRACE)
    assert _restarts_in_order(desired, plan(desired, later))


def test_a_busy_engine_that_freezes_is_restarted_a_grace_after_the_first_probe_without_progress(desired, deployed):
    watch, t = HealthWatch(), 1000.0
    for i, tokens in enumerate((100, 200, 300)):
        watch.annotate(desired, _head_serving(desired, deployed, _queued(desired, tokens)), now=t + i)
    stuck = _head_serving(desired, deployed, _queued(desired, 300))
    assert not watch.annotate(desired, stuck, now=t + 3).node(desired.head.name).serving.busy
    assert not plan(desired, watch.annotate(desired, stuck, now=t + 3 + GRACE - 1)).steps
    assert _restarts_in_order(desired, plan(desired, watch.annotate(desired, stuck, now=t + 3 + GRACE + 1)))
