"""A twin port down, as the seed has it (issue 30, finding 7): the worker's second half of the QSFP port without
carrier and its RDMA port `1: DOWN`, while the first half carries. NCCL opens only ACTIVE ports (NCCL's
src/transport/net_ib.cc) and serves on the first, so this degrades the fabric and stops nothing: a needed
restart goes on, with NCCL_IB_HCA listing the port that carries. The first port down still blocks. Every
expectation is written by hand from that rule, on the recorded 4-node cluster (tests/unit/recorded.py)."""

from __future__ import annotations

import pytest

from reconciler.core.drift import Drift, diff
from reconciler.core.fabric import RdmaAtStart
from reconciler.core.observed import LABEL_SPEC_HASH, RdmaPort
from reconciler.core.planning import plan
from reconciler.core.vllm import at_start, launch_specs
from reconciler.loop import metrics
from reconciler.loop.conditions import Snapshot, conditions
from reconciler.loop.status import StatusPublisher
from tests.unit.recorded import changed, hashes, load, observe, serving_with

IF0, IF1 = "enp1s0f1np1", "enP2p1s0f1np1"
DEV0, DEV1 = "rocep1s0f1", "roceP2p1s0f1"
RDMA = (("address: 10.232.0.11/24\n", f"address: 10.232.0.11/24\n      rdma_device: {DEV0}\n"),
        ("address: 10.232.1.11/24\n", f"address: 10.232.1.11/24\n        rdma_device: {DEV1}\n"))
ACTIVE, DOWN = RdmaPort(state="4: ACTIVE", phys_state="5: LinkUp"), RdmaPort(state="1: DOWN", phys_state="3: Disabled")
TWIN_DOWN = [Drift("worker1", "link", f"link/{IF1}/carrier", "carrier", "no carrier (peer port down or cable)",
                   actionable=False),
             Drift("worker1", "rdma", f"rdma/{DEV1}", "4: ACTIVE", "1: DOWN (3: Disabled)", actionable=False)]


def cluster(*edits):
    """worker1 declares both RDMA devices and runs that spec; both its ports carry."""
    desired = load(*RDMA, *edits)
    seen = observe(desired)
    c = seen.node("worker1").container("vllm_serving")
    assert c is not None
    seen = changed(seen, "worker1", containers=serving_with(seen, "worker1", labels={
        **c.labels, LABEL_SPEC_HASH: hashes(load(*RDMA))["worker1"]}))
    node = seen.node("worker1")
    assert node.fabric is not None and node.fabric_twin is not None
    return desired, changed(seen, "worker1", fabric=node.fabric.model_copy(update={"rdma": ACTIVE}),
                            fabric_twin=node.fabric_twin.model_copy(update={"rdma": ACTIVE}))


def ports(seen, first=None, twin=None):
    """worker1's ports changed as the probe would see them."""
    node = seen.node("worker1")
    assert node.fabric is not None and node.fabric_twin is not None
    return changed(seen, "worker1", fabric=node.fabric.model_copy(update=first or {}),
                   fabric_twin=node.fabric_twin.model_copy(update=twin or {}))


def test_a_twin_down_while_the_first_port_carries_is_said_and_blocks_nothing():
    desired, seen = cluster()
    assert diff(desired, seen) == []
    assert diff(desired, ports(seen, twin={"carrier": False, "rdma": DOWN})) == TWIN_DOWN


def test_a_needed_restart_goes_on_over_the_first_port():
    """The seed's case, which planned nothing before: "serving restart waits for rdma"."""
    desired, seen = cluster(("max_model_len: 4096", "max_model_len: 8192"))
    result = plan(desired, ports(seen, twin={"carrier": False, "rdma": DOWN}))
    assert result.blocked == []
    assert sorted(s.id for s in result.steps if s.kind == "start-serving") == [
        "start-serving/head", "start-serving/worker1", "start-serving/worker2", "start-serving/worker3"]


def test_the_first_port_down_still_blocks_the_restart():
    desired, seen = cluster(("max_model_len: 4096", "max_model_len: 8192"))
    result = plan(desired, ports(seen, first={"rdma": DOWN}, twin={"rdma": DOWN}))
    assert [s for s in result.steps if s.kind == "start-serving"] == []
    assert [b.reason for b in result.blocked] == [
        f"serving restart waits for rdma on worker1: rdma/{DEV0}: expected 4: ACTIVE, observed 1: DOWN (3: Disabled)",
        f"serving restart waits for rdma on worker1: rdma/{DEV1}: expected 4: ACTIVE, observed 1: DOWN (3: Disabled)"]


@pytest.mark.parametrize(("carrying", "hca"), [([DEV0], DEV0), ([DEV1], DEV1), ([DEV0, DEV1], f"={DEV0},{DEV1}"),
                                               ([], f"={DEV0},{DEV1}")])
def test_a_start_lists_the_ports_that_carry_and_keeps_the_declared_hash(carrying, hca):
    desired = load(*RDMA)
    declared = next(s for s in launch_specs(desired) if s.node == "worker1")
    assert declared.env["NCCL_IB_HCA"] == f"={DEV0},{DEV1}"
    started = at_start(declared, RdmaAtStart(carrying, None))
    assert f"NCCL_IB_HCA={hca}\n" in started.env_file_text()
    assert started.spec_hash == declared.spec_hash, "a twin coming back restarts nothing"
    argv = started.run_argv(1)
    assert argv[argv.index(f"NCCL_IB_HCA={hca}") - 1] == "-e"


def test_status_says_the_fabric_is_degraded_and_the_metrics_say_which_port():
    desired, seen = cluster()
    degraded = ports(seen, twin={"carrier": False, "rdma": DOWN})
    snap = Snapshot(generation=1, observed_generation=1, observed=degraded, plan=plan(desired, degraded))
    fabric = next(c for c in conditions(snap, [n.name for n in desired.nodes], [], now=0.0)
                  if (c["node"], c["type"]) == ("worker1", "FabricLinkUp"))
    assert (fabric["status"], fabric["reason"]) == ("False", "PortDegraded")
    assert fabric["message"].startswith(f"link/{IF1}/carrier: expected carrier, observed no carrier")
    StatusPublisher.observation(desired, degraded, {})
    value = metrics.REGISTRY.get_sample_value
    assert value("reconciler_fabric_link_up", {"node": "worker1"}) == 1
    assert value("reconciler_fabric_port_up", {"node": "worker1", "interface": IF0}) == 1
    assert value("reconciler_fabric_port_up", {"node": "worker1", "interface": IF1}) == 0
