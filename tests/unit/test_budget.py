"""Unified memory as one budget per node (issue 35): the deployments on a node, the co-tenants' reservations and
the margin must fit in its total, or nothing starts there and nothing stops for a start.

The oracle is the arithmetic written out here by hand from the recorded cluster's numbers (four nodes of 8 GiB,
gmu 0.05, a 1 GiB margin), never `core.budget` asked twice.
"""

from __future__ import annotations

import pytest

from reconciler.core import spec
from reconciler.core.budget import budgets, node_budget
from reconciler.core.planning import plan
from tests.unit.recorded import load, observe

GIB = 2**30
TOTAL = 8 * GIB  # every recorded node
NODES = ("head", "worker1", "worker2", "worker3")


@pytest.fixture(scope="module")
def seen():
    return observe(load())


def _reserving(held: str) -> spec.Desired:
    return load(("  protected: {}", f"  protected: {{}}\n  memory: {held}"))


def test_the_recorded_cluster_fits_and_each_budget_adds_up_by_hand(seen):
    d = load()
    got = {b.node: b for b in budgets(d, seen)}
    assert set(got) == set(NODES)
    for b in got.values():
        assert b.total == TOTAL and b.needed == int(0.05 * TOTAL) + GIB and not b.over
        assert b.words() == ("default (gpu_memory_utilization 0.05 x 8.0 GiB) 0.4 GiB + policy.memory_margin "
                             "1.0 GiB = 1.4 GiB of 8.0 GiB")
    assert not [x for x in plan(d, seen).drift if x.resource.startswith("budget/")]


def test_a_reservation_counts_on_its_node_and_star_on_every_node(seen):
    d = _reserving('{"*": {vllm_embeddings: 2GiB}, head: {reranker: 3GiB}}')
    got = {b.node: b.needed for b in budgets(d, seen)}
    base = int(0.05 * TOTAL) + GIB
    assert got == {"head": base + 5 * GIB, "worker1": base + 2 * GIB, "worker2": base + 2 * GIB,
                   "worker3": base + 2 * GIB}


def test_a_node_override_replaces_the_star_reservation_of_the_same_container(seen):
    d = _reserving('{"*": {vllm_embeddings: 2GiB}, head: {vllm_embeddings: 1GiB}}')
    assert node_budget(d, seen, "head").needed == int(0.05 * TOTAL) + GIB + GIB


def test_an_over_committed_node_blocks_its_start_and_every_stop_with_the_numbers(seen):
    """The head's co-tenants reserve 6.7 GiB: with the deployment's 0.4 GiB and the 1 GiB margin the head needs
    8.1 GiB of 8.0. The worker3 rank is gone, so a restart is wanted, and the seed's unallowed co-tenant would be
    stopped for it: the plan stops nothing and starts nothing, and says why in bytes."""
    from tests.unit.recorded import changed
    d = _reserving("{head: {reranker: 5GiB, vllm_embeddings: 1.7GiB}}")
    observed = changed(seen, "worker3", containers=[c for c in seen.node("worker3").containers
                                                    if c.name != "vllm_serving"])
    result = plan(d, observed)
    [over] = [x for x in result.drift if x.resource.startswith("budget/")]
    assert over.node == "head" and over.kind == "memory" and over.blocking and not over.actionable
    assert over.observed.startswith("over-committed: default (gpu_memory_utilization 0.05 x 8.0 GiB) 0.4 GiB + "
                                    "co-tenant reranker 5.0 GiB + co-tenant vllm_embeddings 1.7 GiB + "
                                    "policy.memory_margin 1.0 GiB = 8.1 GiB of 8.0 GiB")
    assert not [s for s in result.steps if s.kind in ("stop-serving", "start-serving", "stop-container")]
    assert [b.reason.split(":")[0] for b in result.blocked] == ["serving restart waits for memory on head"]


def test_two_deployments_on_a_node_add_up(seen):
    """A second deployment on the head alone: the head's budget holds both pools, the workers' only the first."""
    text = load().model_dump(mode="json")
    big = {"name": "big", "model": text.pop("model"), "serving": text.pop("serving")}
    small = {"name": "small", "model": big["model"], "serving": {
        **big["serving"], "container_name": "vllm_small", "port": 8001, "nodes": ["head"],
        "tensor_parallel_size": 1, "gpu_memory_utilization": 0.5}}
    d = spec.Desired.model_validate({**text, "deployments": [big, small]})
    got = {b.node: b for b in budgets(d, seen)}
    assert got["head"].needed == int(0.05 * TOTAL) + int(0.5 * TOTAL) + GIB, "the margin once, not per deployment"
    assert [h for h, _ in got["head"].terms] == ["big (gpu_memory_utilization 0.05 x 8.0 GiB)",
                                                  "small (gpu_memory_utilization 0.5 x 8.0 GiB)",
                                                  "policy.memory_margin"]
    assert got["worker1"].needed == int(0.05 * TOTAL) + GIB


def test_a_node_without_a_memory_reading_has_no_budget(seen):
    from tests.unit.recorded import changed
    assert node_budget(load(), changed(seen, "worker2", memory=None), "worker2") is None


def test_a_reservation_for_a_container_the_file_does_not_allow_is_refused(problems, edit):
    found = problems(edit(("  unlisted: stop", "  unlisted: stop\n  memory: {head-a: {grafana: 1GiB}}")))
    assert len(found) == 1 and "co_tenants.memory.head-a.grafana: grafana is not allowed on head-a" in found[0], found
