"""A running but unhealthy vLLM is restarted in order after a grace; a cold start is waited for.

The oracle is written here from the issue, not from the plan: a deployment that served and then failed its health
check (the most common wedge on a real cluster: an NCCL hang, a stuck rank) is restarted once the failure has
lasted `serving.unhealthy_grace`; before that, nothing is touched; a container that has never served is a cold
start and gets `await-health` (its long allowance). The health history comes from `HealthWatch`, fed a sequence
of observations with a fake clock.
"""

from __future__ import annotations

import os
import time
from datetime import UTC, datetime

import pytest

from reconciler.core.loader import load_file
from reconciler.core.observed import EngineLoad, NodeObservation, Observed, ServingApi
from reconciler.core.planning import plan, unhealthy_grace
from reconciler.core.spec import Desired
from reconciler.loop.health_watch import HealthWatch, _age, started_timestamp
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


def healthy(desired, tokens: float | None = None) -> ServingApi:
    engine = EngineLoad(running=1, waiting=0, tokens=tokens) if tokens is not None else None
    return ServingApi(reachable=True, healthy=True, models=[desired.served_name], engine=engine)


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


def _prefilling(desired, kv: float | None) -> ServingApi:
    """One long prompt in chunked prefill, nothing else decoding: vLLM counts its prompt tokens only when the
    prefill completes (0.20.1 `v1/metrics/stats.py`), so the tokens stand still while its KV blocks grow."""
    from reconciler.core.observed import EngineLoad

    name = desired.serving.served_model_name or desired.model.id
    return ServingApi(reachable=True, healthy=True, models=[name], completion_error="no answer within 5s",
                      engine=EngineLoad(running=1, waiting=1, tokens=5000, kv_usage=kv))


def test_a_chunked_prefill_longer_than_the_grace_is_busy_while_its_kv_cache_grows(desired, deployed):
    """Issue 52, item 10: a 200k-token prompt prefilling for ten graces, no token counted meanwhile: the KV cache
    usage moves at every probe, so it is busy, never restarted; once it stands still too, it is a wedge."""
    watch, t = HealthWatch(), 1000.0
    watch.annotate(desired, _head_serving(desired, deployed, _prefilling(desired, 0.01)), now=t)
    for i in range(1, 11):
        seen = watch.annotate(desired, _head_serving(desired, deployed, _prefilling(desired, 0.01 + 0.05 * i)),
                              now=t + i * GRACE)
        api = seen.node(desired.head.name).serving
        assert api.busy and api.unhealthy_for is None, i
        assert not plan(desired, seen).steps, i
    stuck = _head_serving(desired, deployed, _prefilling(desired, 0.51))
    watch.annotate(desired, stuck, now=t + 11 * GRACE)
    assert _restarts_in_order(desired, plan(desired, watch.annotate(desired, stuck, now=t + 12 * GRACE + 1)))


def test_an_image_without_the_kv_gauge_is_judged_on_its_tokens_alone(desired, deployed):
    watch, t = HealthWatch(), 1000.0
    watch.annotate(desired, _head_serving(desired, deployed, _prefilling(desired, None)), now=t)
    seen = watch.annotate(desired, _head_serving(desired, deployed, _prefilling(desired, None)), now=t + 3)
    assert not seen.node(desired.head.name).serving.busy


# ------------------------------------------------------------------------ the watch itself (issue 34, mutation)

def _head(desired: Desired, observed: Observed, serving: ServingApi | None, cid: str = "c1",
          started_at: str | None = None) -> Observed:
    """The head with its serving container `cid` (started at `started_at`) and its API as `serving` says."""
    node = observed.node(desired.head.name)
    containers = [c.model_copy(update={"id": cid, "started_at": started_at})
                  if c.name == desired.serving.container_name else c for c in node.containers]
    head = node.model_copy(update={"serving": serving, "containers": containers})
    return observed.model_copy(update={"nodes": {**observed.nodes, desired.head.name: head}})


def _api(seen: Observed, desired: Desired) -> ServingApi:
    api = seen.node(desired.head.name).serving
    assert api is not None
    return api




def failing(desired) -> ServingApi:
    return ServingApi(reachable=True, healthy=True, models=[desired.served_name], completion_error="timed out")


START = "2026-12-06T09:00:00.000000000Z"
T0 = datetime(2026, 12, 6, 9, 0, tzinfo=UTC).timestamp()


def test_an_observation_without_the_head_or_without_its_api_is_left_as_it_is(desired, deployed):
    """A snapshot without the head, or a head whose API was not read: nothing serves that the watch could judge."""
    watch = HealthWatch(wall=lambda: T0)
    headless = deployed.model_copy(update={"nodes": {n: o for n, o in deployed.nodes.items()
                                                     if n != desired.head.name}})
    assert watch.annotate(desired, headless, now=10.0) is headless
    unread = _head(desired, deployed, None, started_at=START)
    assert watch.annotate(desired, unread, now=10.0) is unread


def test_a_container_exactly_as_old_as_the_cold_start_allowance_is_still_starting(desired, deployed):
    """The module's rule: a container *older* than health_timeout counts as having served. One second later it
    does."""
    watch = HealthWatch(wall=lambda: T0 + 3600.0)
    at = watch.annotate(desired, _head(desired, deployed, failing(desired), started_at=START), now=50.0)
    assert _api(at, desired).served_before is False
    later = watch.annotate(desired, _head(desired, deployed, failing(desired), started_at=START), now=51.0)
    assert _api(later, desired).served_before is True


def test_a_new_container_s_age_is_its_own_not_its_predecessor_s(desired, deployed):
    """An old container replaced by a fresh one: the fresh one is a cold start (await-health), not a wedge."""
    wall = [T0 + 7200.0]
    watch = HealthWatch(wall=lambda: wall[0])
    old = watch.annotate(desired, _head(desired, deployed, failing(desired), "c1", START), now=100.0)
    assert _api(old, desired).served_before is True
    wall[0] += 60.0
    fresh = watch.annotate(desired, _head(desired, deployed, failing(desired), "c2", "2026-12-06T11:00:30Z"),
                           now=160.0)
    assert _api(fresh, desired).served_before is False


def test_replacing_a_container_that_never_served_or_never_failed_is_no_restart_for_health(desired, deployed):
    """health_restarts counts restarts for health that did not hold (the grace's backoff): a cold start given up
    (its container replaced before it served) and a healthy container replaced by an edit are neither."""
    watch = HealthWatch(wall=lambda: T0 + 60.0)
    watch.annotate(desired, _head(desired, deployed, failing(desired), "cold", START), now=0.0)
    after_cold = watch.annotate(desired, _head(desired, deployed, healthy(desired), "c2", START), now=10.0)
    assert _api(after_cold, desired).health_restarts == 0
    after_edit = watch.annotate(desired, _head(desired, deployed, healthy(desired), "c3", START), now=20.0)
    assert _api(after_edit, desired).health_restarts == 0


def test_the_restart_count_is_forgotten_sixteen_graces_after_serving_again_on_any_monotonic_clock(desired,
                                                                                                  deployed):
    """The monotonic clock's reading is arbitrary (seconds since boot): a restart that did not hold is forgotten
    after 16 graces of serving well, not sooner because the clock reads high."""
    t, watch = 1_000_000.0, HealthWatch(wall=lambda: T0)
    watch.annotate(desired, _head(desired, deployed, healthy(desired), "c1", START), now=t)
    watch.annotate(desired, _head(desired, deployed, failing(desired), "c1", START), now=t + 1)
    back = watch.annotate(desired, _head(desired, deployed, healthy(desired), "c2", START), now=t + 2)
    assert _api(back, desired).health_restarts == 1
    almost = watch.annotate(desired, _head(desired, deployed, healthy(desired), "c2", START),
                            now=t + 2 + 16 * GRACE - 1)
    assert _api(almost, desired).health_restarts == 1
    forgotten = watch.annotate(desired, _head(desired, deployed, healthy(desired), "c2", START),
                               now=t + 2 + 16 * GRACE)
    assert _api(forgotten, desired).health_restarts == 0


def test_an_engine_that_answers_is_not_busy_while_its_tokens_grow(desired, deployed):
    """Busy is a completion that did not answer while the tokens grew (docs/troubleshooting.md, "A busy cluster
    taken for a wedged one"); an engine answering under load is serving, and says so."""
    watch = HealthWatch(wall=lambda: T0)
    watch.annotate(desired, _head(desired, deployed, healthy(desired, 100), started_at=START), now=0.0)
    seen = watch.annotate(desired, _head(desired, deployed, healthy(desired, 900), started_at=START), now=5.0)
    assert _api(seen, desired).busy is False


def test_a_start_time_ahead_of_the_wall_clock_is_no_age():
    """Clock skew between the head and the reconciler host: a container that seems to start in the future is age
    0, not negative, not a second."""
    assert _age("2026-12-06T09:00:10Z", T0) == 0.0
    assert _age(START, T0 + 0.25) == 0.25


@pytest.fixture
def away_from_utc():
    """The reconciler host's timezone set west and then east of UTC (docker's StartedAt is UTC all the same)."""
    before = os.environ.get("TZ")

    def use(zone: str) -> None:
        os.environ["TZ"] = zone
        time.tzset()

    yield use
    if before is None:
        os.environ.pop("TZ", None)
    else:
        os.environ["TZ"] = before
    time.tzset()


@pytest.mark.parametrize("zone", ["America/New_York", "Asia/Tokyo", "UTC"])
def test_docker_s_started_at_is_utc_whatever_the_host_s_timezone(away_from_utc, zone):
    """docker writes State.StartedAt in UTC with nanoseconds. Reading it dropped the `Z` with the fraction's
    surplus digits, so off UTC a fresh container was hours old (a cold start judged a wedge) or hours young."""
    away_from_utc(zone)
    assert started_timestamp("2026-12-06T09:00:00.123456789Z") == T0 + 0.123456
    assert started_timestamp("2026-12-06T18:00:00.5+09:00") == T0 + 0.5
    assert started_timestamp("2026-12-06T09:00:00Z") == T0

