"""NCCL on RoCE, or a loud failure (issue 52, item 7): a start on a fabric with RDMA devices holds NCCL to its IB
transport (NCCL_NET=IB: no silent fall back to NET/Socket), on the RoCE v2 IPv4 GID the port's sysfs table says
(NCCL_IB_GID_INDEX, read at every start: the index moves when the table is rebuilt), with NCCL's INIT and NET
logging on for the transport it chose. What serving.env says stays; the declared hash does not move.

The GID table is what mlx5 builds for a port with one IPv4 address (the kernel's `gid_attrs/types/N` strings,
drivers/infiniband/core/cache.c `gid_type_str`: "IB/RoCE v1", "RoCE v2"; `gids/N` printed with `%pI6`): 0 and 1
the link-local GID as v1 and v2, 2 and 3 the IPv4-mapped one, as `show_gids` lists it on ConnectX ports.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from reconciler.core.fabric import RdmaAtStart, ipv4_gid, rdma_at_start
from reconciler.core.vllm import at_start, launch_specs
from reconciler.edge.facts.base import sealed, split_sections
from reconciler.edge.facts.links import link_script, parse_link
from tests.unit.loop.test_fabric_twin import DEV0, RDMA
from tests.unit.recorded import load, observe

LINK_LOCAL = "fe80:0000:0000:0000:5e25:73ff:fe4d:1a2b"
TABLE = {0: ("IB/RoCE v1", LINK_LOCAL), 1: ("RoCE v2", LINK_LOCAL),
         2: ("IB/RoCE v1", ipv4_gid("10.232.0.11")), 3: ("RoCE v2", ipv4_gid("10.232.0.11"))}


def _sysfs(root: Path, device: str, table: dict[int, tuple[str, str]], unused: int = 4) -> None:
    """A port's sysfs as the kernel lays it out; `unused` entries past the table read EINVAL (here: unreadable)."""
    port = root / device / "ports" / "1"
    (port / "gid_attrs" / "types").mkdir(parents=True)
    (port / "gids").mkdir()
    (port / "state").write_text("4: ACTIVE\n")
    (port / "phys_state").write_text("5: LinkUp\n")
    for i, (kind, gid) in table.items():
        (port / "gid_attrs" / "types" / str(i)).write_text(kind + "\n")
        (port / "gids" / str(i)).write_text(gid + "\n")
    for i in range(len(table), len(table) + unused):
        (port / "gid_attrs" / "types" / str(i)).mkdir()  # reading it fails, as EINVAL does on a real port
        (port / "gids" / str(i)).write_text("0000:0000:0000:0000:0000:0000:0000:0000\n")


def _read_port(tmp_path: Path, table: dict[int, tuple[str, str]]):
    """The probe's own lines for worker1's first port, run by sh against a sysfs tree laid out like the kernel's."""
    _sysfs(tmp_path, DEV0, table)
    desired = load(*RDMA)
    lines = [line.replace("/sys/class/infiniband", str(tmp_path)) for line in link_script(desired.node("worker1"))]
    script = sealed(lines[2:4])  # the first port's rdma section
    out = subprocess.run(["sh", "-s"], input=script.script, capture_output=True, text=True, timeout=30,
                         check=True).stdout
    rdma = split_sections(out, script.nonce)["rdma"]
    link = parse_link("enp1s0f1np1", _ip_addr(), rdma)
    assert link.rdma is not None
    return link.rdma


def _ip_addr():
    from reconciler.edge.facts.base import Section
    return Section('[{"ifname": "enp1s0f1np1", "flags": ["UP", "LOWER_UP"], "mtu": 9000, "operstate": "UP", '
                   '"addr_info": [{"family": "inet", "local": "10.232.0.11", "prefixlen": 24}]}]', 0)


def test_the_probe_reads_the_roce_v2_gids_from_sysfs(tmp_path):
    rdma = _read_port(tmp_path, TABLE)
    assert rdma.active and rdma.roce_v2_gids == {1: LINK_LOCAL, 3: ipv4_gid("10.232.0.11")}


def _started(table: dict[int, tuple[str, str]] | None, tmp_path: Path, *edits: tuple[str, str]):
    desired = load(*RDMA, *edits)
    seen = observe(desired)
    if table is not None:
        rdma = _read_port(tmp_path, table)
        worker = seen.node("worker1")
        first = worker.fabric
        assert first is not None
        seen = seen.model_copy(update={"nodes": {**seen.nodes, "worker1": worker.model_copy(update={
            "fabric": first.model_copy(update={"rdma": rdma, "addresses": ["10.232.0.11/24"], "operstate": "up",
                                               "admin_up": True, "carrier": True})})}})
    declared = next(s for s in launch_specs(desired) if s.node == "worker1")
    at = rdma_at_start(desired.node("worker1"), seen.node("worker1"))
    return declared, at, at_start(declared, at)


def test_a_start_holds_nccl_to_roce_on_the_ipv4_v2_gid(tmp_path):
    declared, at, started = _started(TABLE, tmp_path)
    assert at.gid_index == 3
    env = started.started_env()
    assert (env["NCCL_NET"], env["NCCL_IB_GID_INDEX"], env["NCCL_DEBUG"]) == ("IB", "3", "INFO")
    assert "NCCL_DEBUG_SUBSYS" in env and "NET" in env["NCCL_DEBUG_SUBSYS"].split(",")
    assert started.spec_hash == declared.spec_hash, "set at the start: a running generation restarts for none"


def test_a_table_rebuilt_with_the_ipv4_entry_elsewhere_moves_the_index(tmp_path):
    other, ours = ipv4_gid("10.232.0.99"), ipv4_gid("10.232.0.11")
    moved = {0: TABLE[0], 1: TABLE[1], 2: ("IB/RoCE v1", other), 3: ("RoCE v2", other),
             4: ("IB/RoCE v1", ours), 5: ("RoCE v2", ours)}
    _, at, started = _started(moved, tmp_path)
    assert at.gid_index == 5 and started.started_env()["NCCL_IB_GID_INDEX"] == "5"


def test_no_v2_entry_for_the_address_sets_no_index_and_still_no_socket_fallback(tmp_path):
    _, at, started = _started({0: TABLE[0], 1: TABLE[1]}, tmp_path)
    assert at.gid_index is None
    env = started.started_env()
    assert "NCCL_IB_GID_INDEX" not in env and env["NCCL_NET"] == "IB"


@pytest.mark.parametrize("name", ["NCCL_NET", "NCCL_DEBUG", "NCCL_IB_GID_INDEX"])
def test_what_serving_env_says_stays(tmp_path, name):
    _, _, started = _started(TABLE, tmp_path, ("  served_model_name: tiny-moe\n",
                                               f"  served_model_name: tiny-moe\n  env: {{{name}: keep}}\n"))
    assert started.started_env()[name] == "keep"


def test_a_fabric_without_rdma_devices_gets_nothing_of_it():
    desired = load()
    declared = next(s for s in launch_specs(desired) if s.node == "worker1")
    started = at_start(declared, RdmaAtStart([], None))
    assert started == declared and "NCCL_NET" not in started.started_env()

