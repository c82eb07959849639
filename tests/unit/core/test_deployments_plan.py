"""The plan of a file of several deployments (issue 35): each deployment planned on its view, its steps named by
it, the nodes' own steps once, our stale containers stopped once, the starts in order, largest first.

Facts: the recorded four-node cluster (tests/unit/fixtures/probe-4-nodes.json), serving `tiny-moe` at TP 4 and
converged, with a second deployment `small` declared on the head beside it. The oracle is the list of step ids
and their order written out by hand here, never the plan of each view asked again.
"""

from __future__ import annotations

import pytest

from reconciler.core import spec
from reconciler.core.drift import diff
from reconciler.core.observed import (
    LABEL_LAUNCH,
    LABEL_PORTS,
    LABEL_SPEC_HASH,
    Container,
    DeploymentFacts,
    Observed,
    ServingApi,
)
from reconciler.core.planning import Step, kind_and_node, plan
from reconciler.core.vllm import launch_label, launch_specs
from tests.unit.recorded import changed, load, observe, without


def _two(small_gmu: float = 0.1) -> spec.Desired:
    one = load()
    data = one.model_dump(mode="json")
    big = {"name": "big", "model": data.pop("model"), "serving": data.pop("serving")}
    small = {"name": "small", "model": big["model"], "serving": {
        **big["serving"], "container_name": "vllm_small", "port": 8003, "nodes": ["head"],
        "tensor_parallel_size": 1, "gpu_memory_utilization": small_gmu, "served_model_name": "small"}}
    return spec.Desired.model_validate({**data, "deployments": [big, small]})


@pytest.fixture(scope="module")
def seen() -> Observed:
    """The recorded cluster as a probe of the two-deployment file reads it: `big` converged and answering on
    :8000, nothing on :8001 for `small` yet."""
    obs = observe(load())
    head = obs.node("head")
    facts = {"big": DeploymentFacts(weights=head.weights, serving=head.serving, disk_free=head.disk_free),
             "small": DeploymentFacts(weights=head.weights, serving=ServingApi(), disk_free=head.disk_free)}
    return changed(obs, "head", deployments=facts)


def _small_running(d: spec.Desired, like: Container) -> Container:
    """small's rank as its start would have made it: `like`'s ownership labels, small's spec and launch."""
    [rank] = launch_specs(d.view("small"))
    labels = {**like.labels, LABEL_SPEC_HASH: rank.spec_hash, LABEL_PORTS: "8003",
              LABEL_LAUNCH: launch_label(rank.inputs) or ""}
    return like.model_copy(update={"name": "vllm_small", "id": "small-id", "labels": labels})


def ids(steps: list[Step]) -> list[str]:
    return [s.id for s in steps]


def test_a_view_of_the_observation_puts_each_deployments_facts_in_the_nodes_fields(seen):
    assert seen.view("big").node("head").serving == seen.node("head").serving
    assert seen.view("small").node("head").serving == ServingApi()
    assert seen.view("small").node("worker1") == seen.node("worker1"), "no facts of it there: left as it is"


def test_a_new_deployment_beside_a_converged_one_starts_alone_and_nothing_else_moves(seen):
    result = plan(_two(), seen)
    assert ids(result.steps) == ["start-serving/head/@small", "await-health/head/@small"]
    start, wait = result.steps
    assert start.deployment == "small" and start.rank == 0 and wait.after == (start.id,)
    assert not [d for d in result.drift if d.deployment == "big"], "big is converged: no drift of its own"
    assert {d.resource for d in result.drift if d.deployment == "small"} == {"container/vllm_small", "api/:8003"}
    assert result.downtime is None and not result.blocked
    assert kind_and_node(start.id) == ("start-serving", "head")
    assert start.as_dict()["deployment"] == "small" and "deployment" not in Step("link", "head", "x").as_dict()


def test_a_container_no_deployment_wants_is_stopped_once(seen):
    """`vllm_old` of ours on worker1 (a deployment removed from the file): one stop, the node's, untagged."""
    serving = seen.node("worker1").container("vllm_serving")
    assert serving is not None
    old = serving.model_copy(update={"name": "vllm_old"})
    observed = changed(seen, "worker1", containers=[*seen.node("worker1").containers, old])
    result = plan(_two(), observed)
    assert ids(result.steps)[0] == "stop-serving/worker1/vllm_old"
    assert ids(result.steps).count("stop-serving/worker1/vllm_old") == 1
    assert [d.deployment for d in diff(_two(), observed) if d.container == "vllm_old"] == [None]


def test_a_deployments_containers_are_never_the_others_stale_ones(seen):
    """Both running and converged: big's ranks are not stale for small's view, nor small's for big's."""
    head = seen.node("head")
    big = head.container("vllm_serving")
    assert big is not None
    small = _small_running(_two(), big)
    up = ServingApi(reachable=True, healthy=True, models=["small"])
    facts = {**head.deployments, "small": DeploymentFacts(weights=head.weights, serving=up, disk_free=head.disk_free)}
    observed = changed(seen, "head", containers=[*head.containers, small], deployments=facts)
    result = plan(_two(), observed)
    assert result.steps == [] and not [d for d in result.drift if d.kind == "serving"], result.drift


def test_starts_go_largest_first_each_after_the_health_of_those_before(seen):
    """Nothing of ours runs: `small` (0.1) starts before `big` (0.05 x 4 nodes, but 0.05 of each node), and
    every start of big waits for small's health on the head they share."""
    observed = seen
    for node in ("head", "worker1", "worker2", "worker3"):
        observed = changed(observed, node, containers=without(observed, node, "vllm_serving"))
    listening = [p for p in seen.node("head").listening or [] if p not in (8000, 29501)]  # gone with the ranks
    observed = changed(observed, "head", listening=listening)
    result = plan(_two(), observed)
    order = ids(result.steps)
    assert order[:2] == ["start-serving/head/@small", "await-health/head/@small"]
    big_starts = [s for s in result.steps if s.deployment == "big" and s.kind == "start-serving"]
    assert len(big_starts) == 4 and all("await-health/head/@small" in s.after for s in big_starts)
    assert order[-1] == "await-health/head/@big"


def test_an_unallowed_co_tenant_is_held_while_any_deployment_start_is_blocked(seen):
    """An unallowed container runs on the head; small's start is blocked (its port is held by another
    process): the co-tenant keeps running, and the plan says why, by deployment."""
    intruder = seen.node("head").container("reranker")
    assert intruder is not None
    rogue = intruder.model_copy(update={"name": "rogue"})
    head = seen.node("head")
    facts = {**head.deployments, "small": DeploymentFacts(
        weights=head.weights, serving=ServingApi(port_holder=1000), disk_free=head.disk_free)}
    observed = changed(seen, "head", containers=[*head.containers, rogue], deployments=facts)
    result = plan(_two(), observed)
    assert "stop-container/head/rogue" not in ids(result.steps)
    assert any(b.reason.startswith("small: ") for b in result.blocked), result.blocked


def test_an_edit_of_one_deployment_restarts_that_one_only(seen):
    """small runs; its max_model_len changes: small restarts, big's ranks are left alone."""
    d = _two()
    head = seen.node("head")
    big = head.container("vllm_serving")
    assert big is not None
    small = _small_running(d, big)
    up = ServingApi(reachable=True, healthy=True, models=["small"])
    facts = {**head.deployments, "small": DeploymentFacts(weights=head.weights, serving=up, disk_free=head.disk_free)}
    observed = changed(seen, "head", containers=[*head.containers, small], deployments=facts)
    data = d.model_dump(mode="json")
    data["deployments"][1]["serving"]["max_model_len"] = 2048
    edited = spec.Desired.model_validate(data)
    result = plan(edited, observed)
    assert ids(result.steps) == ["stop-serving/head/vllm_small/@small", "start-serving/head/@small",
                                 "await-health/head/@small"]
    assert result.downtime is not None and result.downtime.nodes == ("head",)


def _on_worker() -> spec.Desired:
    """`small` on worker1 alone: its rank 0 and API there (`Desired.api_node`)."""
    data = _two().model_dump(mode="json")
    data["deployments"][1]["serving"]["nodes"] = ["worker1"]
    return spec.Desired.model_validate(data)


def test_a_deployment_on_a_worker_alone_starts_there_and_is_asked_there(seen):
    """Its start, its wait for health and its health drift are on worker1; the probe asks its API there and
    nowhere else (no such port on the head)."""
    from reconciler.edge.observe import probe_script

    d = _on_worker()
    assert d.view("small").api_node.name == "worker1" and d.view("big").api_node.name == "head"
    worker = seen.node("worker1")
    facts = {"small": DeploymentFacts(weights=worker.weights, serving=ServingApi(), disk_free=worker.disk_free)}
    result = plan(d, changed(seen, "worker1", deployments=facts))
    assert ids(result.steps) == ["start-serving/worker1/@small", "await-health/worker1/@small"]
    assert {(x.node, x.resource) for x in result.drift if x.deployment == "small"} == {
        ("worker1", "container/vllm_small"), ("worker1", "api/:8003")}
    assert "127.0.0.1:8003/health" in probe_script(d, d.node("worker1")).script
    assert "127.0.0.1:8003/health" not in probe_script(d, d.node("head")).script
    [rank] = launch_specs(d.view("small"))
    assert rank.node == "worker1" and rank.env["MASTER_ADDR"] == str(d.node("worker1").fabric.address.ip)
