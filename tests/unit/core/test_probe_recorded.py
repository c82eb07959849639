"""The probe's parser on real outputs: `tests/unit/fixtures/probe-4-nodes.json` holds what `probe_script` printed
on each node of a converged 4-node testbed (2026-12-04; Debian 12 nodes: the Docker 20.10 Engine API on its
socket, iproute2's `ip -j`, GNU find; recorded over the daemon's own SSH sessions by `bench.sim.record`).

What the parse must find is stated from the testbed's contract (docs/testbed.md: addresses, MTU, the twin port,
the co-tenants) and from the core's own launch specs, not from the parser: and a converged cluster, parsed,
plans nothing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from reconciler.core import spec
from reconciler.core.drift import weights_difference
from reconciler.core.observed import Observed
from reconciler.core.ownership import owner
from reconciler.core.planning import plan
from reconciler.core.vllm import launch_specs
from tests.unit.recorded import parsed

FIXTURE = Path(__file__).parents[1] / "fixtures" / "probe-4-nodes.json"


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    raw = json.loads(FIXTURE.read_text())
    path = tmp_path_factory.mktemp("probe") / "testbed.yaml"
    path.write_text(raw["desired"])
    desired = spec.load(path)
    observed = Observed(nodes={n.name: parsed(desired, n.name, raw["outputs"][n.name]) for n in desired.nodes})
    return desired, observed


def test_every_node_is_read_as_the_testbed_contract_says(recorded):
    desired, observed = recorded
    hashes = {s.node: s.spec_hash for s in launch_specs(desired)}
    for i, node in enumerate(desired.nodes):
        obs = observed.node(node.name)
        assert obs.reachable and obs.docker_reachable and obs.probe_error is None, node.name
        assert (obs.fabric.exists, obs.fabric.admin_up, obs.fabric.carrier, obs.fabric.mtu) == (True, True, True, 9000)
        assert obs.fabric.addresses == [f"10.232.0.{10 + i}/24"]
        assert obs.fabric_twin is not None and obs.fabric_twin.addresses == [f"10.232.1.{10 + i}/24"]
        assert obs.fabric.rdma is None, "a veth has no RDMA device"
        serving = obs.container("vllm_serving")
        assert serving is not None and serving.state == "running"
        assert serving.labels["spark-reconciler.spec-hash"] == hashes[node.name]
        assert serving.labels["spark-reconciler.role"] == ("head" if i == 0 else "worker")
        assert serving.owned_by(owner(desired, observed))
        expected = {"vllm_serving", "vllm_embeddings"} | ({"reranker"} if i == 0 else set())
        assert {c.name for c in obs.containers} == expected
        assert obs.memory is not None and 0 < obs.memory.available_bytes <= obs.memory.total_bytes


def test_the_weights_listings_agree_and_the_image_is_one_content(recorded):
    desired, observed = recorded
    head = observed.node(desired.head.name)
    contents = {observed.node(n.name).images[desired.serving.image].content for n in desired.nodes}
    assert len(contents) == 1
    assert head.weights is not None and head.weights.present and head.weights.files
    for n in desired.nodes[1:]:
        assert weights_difference(head.weights, observed.node(n.name).weights) is None, n.name


def test_the_head_answers_health_and_serves_the_declared_name(recorded):
    desired, observed = recorded
    health = observed.node(desired.head.name).serving
    assert health is not None and health.healthy and health.models == [desired.serving.served_model_name]


def test_a_converged_cluster_parsed_from_real_output_plans_nothing(recorded):
    desired, observed = recorded
    result = plan(desired, observed)
    assert (result.steps, result.drift, result.blocked) == ([], [], [])
