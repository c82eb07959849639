"""Both halves of a ConnectX-7 port: declared, observed, repaired, and used by NCCL (eugr docs/NETWORKING.md:
"to get full bandwidth in NCCL RDMA mode, we need to utilize both RoCE twins"; NCCL's docs: `=` for exact names)."""

from __future__ import annotations

import json

import pytest

from reconciler.core.drift import diff
from reconciler.core.loader import load_file
from reconciler.core.observed import Observed
from reconciler.core.planning import plan
from reconciler.core.simulate import apply_plan
from reconciler.core.spec import Desired
from reconciler.core.vllm import launch_specs
from reconciler.edge.facts.links import link_script, parse_links
from tests.unit.recorded import sections_of

TWIN = "enP2p1s0f1np1"


def _data(cluster_yaml) -> dict:
    return load_file(cluster_yaml).data


@pytest.mark.parametrize(("change", "message"), [
    (lambda t, n: t.update(address="192.168.200.42/24"), "the twins need different subnets"),
    (lambda t, n: t.update(interface=n["fabric"]["interface"]), "is the fabric's first interface already"),
    (lambda t, n: t.update(address="192.168.77.13/24"), "is not in the twins' subnet"),
    (lambda t, n: t.update(address="192.168.201.12/24"), "is used by"),
])
def test_a_twin_needs_its_own_netdev_and_subnet(cluster_yaml, change, message):
    data = _data(cluster_yaml)
    worker = data["nodes"][1]
    change(worker["fabric"]["twin"], worker)
    with pytest.raises(ValueError, match=message):
        Desired.model_validate(data)


def test_nccl_uses_both_rdma_devices_by_exact_name(cluster_yaml):
    data = _data(cluster_yaml)
    assert {s.env["NCCL_IB_HCA"] for s in launch_specs(Desired.model_validate(data))} == {"=rocep1s0f1,roceP2p1s0f1"}
    for node in data["nodes"]:
        node["fabric"].pop("twin")
    assert {s.env["NCCL_IB_HCA"] for s in launch_specs(Desired.model_validate(data))} == {"rocep1s0f1"}, \
        "one device renders as before: no restart of a running deployment on upgrade"


def test_the_probe_reads_both_ports(cluster_yaml):
    desired = Desired.model_validate(_data(cluster_yaml))
    node = desired.head
    script = "\n".join(link_script(node))
    assert "dev enp1s0f1np1" in script and f"dev {TWIN}" in script and "roceP2p1s0f1/ports/1" in script
    link = [{"flags": ["BROADCAST", "UP", "LOWER_UP"], "mtu": 9000, "operstate": "UP",
             "addr_info": [{"family": "inet", "local": "192.168.201.12", "prefixlen": 24}]}]
    out = (f"@@link\n{json.dumps([dict(link[0], addr_info=[])])}\n@@rc 0\n@@rdma\n@@rc 2\n"
           f"@@link-twin\n{json.dumps(link)}\n@@rc 0\n@@rdma-twin\n4: ACTIVE\n5: LinkUp\n@@rc 0\n")
    first, twin = parse_links(node, sections_of(out))
    assert first.name == "enp1s0f1np1" and first.addresses == []
    assert twin is not None and twin.name == TWIN and twin.addresses == ["192.168.201.12/24"] and twin.rdma.active


def test_seed_twin_down_is_repaired_with_the_first_port(cluster_yaml, seed_snapshot):
    desired = Desired.model_validate(_data(cluster_yaml))
    observed = Observed.model_validate(json.loads(seed_snapshot.read_text()))
    worker = desired.nodes[1].name
    twin_drift = {d.resource for d in diff(desired, observed) if d.node == worker and TWIN in d.resource}
    assert {f"link/{TWIN}", f"link/{TWIN}/mtu", f"link/{TWIN}/address"} <= twin_drift
    assert [s.kind for s in plan(desired, observed).steps if s.node == worker].count("link") == 1
    for _ in range(3):
        observed = apply_plan(desired, observed, plan(desired, observed))
    twin = observed.node(worker).fabric_twin
    assert twin is not None and twin.admin_up and twin.mtu == 9000 and "192.168.201.13/24" in twin.addresses


def test_a_twin_back_at_mtu_1500_is_drift_on_its_own(cluster_yaml, seed_snapshot):
    desired = Desired.model_validate(_data(cluster_yaml))
    observed = Observed.model_validate(json.loads(seed_snapshot.read_text()))
    for _ in range(3):
        observed = apply_plan(desired, observed, plan(desired, observed))
    head = desired.head.name
    obs = observed.node(head)
    assert obs.fabric_twin is not None
    reset = obs.model_copy(update={"fabric_twin": obs.fabric_twin.model_copy(update={"mtu": 1500})})
    observed = observed.model_copy(update={"nodes": {**observed.nodes, head: reset}})
    drift = [d for d in diff(desired, observed) if d.kind == "link"]
    assert [(d.node, d.resource, d.expected, d.observed) for d in drift] == [(head, f"link/{TWIN}/mtu", "9000",
                                                                              "1500")]


def test_sudoers_lines_cover_the_twin_exactly(cluster_yaml):
    from reconciler.edge.ssh import sudo_allowed, sudo_commands, sudoers_snippet

    desired = Desired.model_validate(_data(cluster_yaml))
    text = sudoers_snippet(desired)
    for node in desired.nodes:
        twin = node.fabric.twin
        assert twin is not None
        for line in (f"/usr/sbin/ip link set dev {twin.interface} up",
                     f"/usr/sbin/ip link set dev {twin.interface} mtu {node.fabric.mtu}",
                     f"/usr/sbin/ip addr add {twin.address} dev {twin.interface}"):
            assert line in text
            assert sudo_allowed(line.split(), sudo_commands(desired, node)), line


def test_a_twin_on_some_nodes_only_is_refused(cluster_yaml):
    """NCCL would pair the head's twin device (subnet B) with the worker's only one (subnet A): no route."""
    data = _data(cluster_yaml)
    data["nodes"][1]["fabric"].pop("twin")
    with pytest.raises(ValueError, match="on every node or on none"):
        Desired.model_validate(data)


@pytest.mark.parametrize(("rdma", "message"), [(None, "on both twins or on neither"),
                                               ("rocep1s0f1", "is the first port's RDMA device already")])
def test_a_twin_has_its_own_rdma_device_when_the_port_has_one(cluster_yaml, rdma, message):
    data = _data(cluster_yaml)
    data["nodes"][0]["fabric"]["twin"]["rdma_device"] = rdma
    with pytest.raises(ValueError, match=message):
        Desired.model_validate(data)
