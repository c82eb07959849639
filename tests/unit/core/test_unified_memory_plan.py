"""A serving change on unified memory (GB10): the running vLLM's memory is "used" in MemAvailable.

The first serving change after a deploy used to deadlock: the plan waited for memory on both nodes that only
the stop of our own old container would free, and never stopped it. These tests build the deployed state the
way a GB10 shows it: the running serving containers hold gmu x MemTotal, so MemAvailable is what is left.
"""

from __future__ import annotations

import json

import pytest

from reconciler.core.loader import load_file
from reconciler.core.observed import Memory, Observed
from reconciler.core.planning import plan
from reconciler.core.simulate import apply_plan
from reconciler.core.spec import Desired

GIB = 2**30
TOTAL = 119 * GIB  # what a GB10 reports as MemTotal (~119.7 GiB)


def _desired(cluster_yaml, **serving) -> Desired:
    data = load_file(cluster_yaml).data
    data["serving"].update(serving)
    return Desired.model_validate(data)


def _deployed(desired: Desired, seed: Observed) -> Observed:
    """Converge the seed in the simulator, then account memory as a GB10 does: each running serving container
    holds gpu_memory_utilization x MemTotal (the KV cache and weights live in the same memory as everything)."""
    after = seed
    for _ in range(3):
        after = apply_plan(desired, after, plan(desired, after))
    held = int(desired.serving.gpu_memory_utilization * TOTAL)
    nodes = {}
    for name, obs in after.nodes.items():
        own = obs.container(desired.serving.container_name)
        assert own is not None and own.running, f"{name}: the simulated deploy left no serving container"
        nodes[name] = obs.model_copy(update={"memory": Memory(total_bytes=TOTAL,
                                                              available_bytes=TOTAL - held - 4 * GIB)})
    return after.model_copy(update={"nodes": nodes})


@pytest.fixture
def seed(seed_snapshot) -> Observed:
    return Observed.model_validate(json.loads(seed_snapshot.read_text()))


def test_serving_change_stops_our_own_serving_first_instead_of_waiting_for_memory(cluster_yaml, seed):
    deployed = _deployed(_desired(cluster_yaml), seed)
    changed = _desired(cluster_yaml, max_model_len=4096)
    result = plan(changed, deployed)
    assert result.blocked == []
    assert not [d for d in result.drift if d.kind == "memory"]
    kinds = [(s.kind, s.node) for s in result.steps]
    stops = [i for i, (k, _) in enumerate(kinds) if k == "stop-serving"]
    starts = [i for i, (k, _) in enumerate(kinds) if k == "start-serving"]
    assert {kinds[i][1] for i in stops} == set(deployed.nodes)
    assert starts and max(stops) < min(starts)
    by_id = {s.id: s for s in result.steps}
    for i in starts:  # every start waits for every stop, so the preflight reads memory after the stops
        assert {result.steps[j].id for j in stops} <= set(by_id[result.steps[i].id].after)


def test_memory_nothing_of_ours_frees_still_blocks_the_start(cluster_yaml, seed):
    """The other side of the same rule: with no running serving of ours, low memory is someone else's and a
    start would fail; the plan says so instead of stopping and starting into an out-of-memory."""
    desired = _desired(cluster_yaml)
    deployed = _deployed(desired, seed)
    name = desired.serving.container_name
    nodes = {n: o.model_copy(update={"containers": [c.model_copy(update={"state": "exited"})
                                                    if c.name == name else c for c in o.containers]})
             for n, o in deployed.nodes.items()}
    crashed = deployed.model_copy(update={"nodes": nodes})
    result = plan(desired, crashed)
    assert {d.node for d in result.drift if d.kind == "memory"} == set(nodes)
    assert not [s for s in result.steps if s.kind == "start-serving"]
    assert any("memory" in b.reason for b in result.blocked)
