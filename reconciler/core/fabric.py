"""Which declared fabric ports carry traffic now: the one judgement the drift, the start's NCCL_IB_HCA and the
metrics share.

A Spark's QSFP port shows up as two netdevs on two PCIe x4 links (the first, `fabric.interface`, and its
`twin`), each with its RDMA device. The first carries the rendezvous (VLLM_HOST_IP, MASTER_ADDR, the socket
interfaces), so without it nothing starts. The twin only adds bandwidth: NCCL opens an HCA's port only when it is
ACTIVE (`ncclIbInit` in NCCL's src/transport/net_ib.cc skips ports whose state is not IBV_PORT_ACTIVE) and serves
on the other half, so a twin without carrier, or with its RDMA port DOWN, degrades the fabric; it does not stop a
start (docs/troubleshooting.md, "ReconcilerFabricPortDegraded").

The twins are also two paths to one node: the link step changes one port's MTU over a session to the other's
address when the node's own session arrives on the port it changes (`other_port`, `reaches`; docs/troubleshooting.md,
"MTU reset to 1500 after a firmware reboot")."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

from reconciler.core.observed import Link, NodeObservation
from reconciler.core.spec import FabricPort, Node


def carries(want: FabricPort, link: Link | None) -> bool:
    """The port is there, up with carrier, and its RDMA port (when declared and seen) is ACTIVE."""
    return (link is not None and link.up
            and not (want.rdma_device and link.rdma is not None and not link.rdma.active))


def ports_seen(node: Node, obs: NodeObservation) -> list[tuple[FabricPort, Link | None]]:
    """Each declared port with what the probe saw of it, the first port first."""
    return list(zip(node.fabric.ports(), (obs.fabric, obs.fabric_twin), strict=False))


def twin_only_down(node: Node, obs: NodeObservation) -> bool:
    """The twin is declared and does not carry while the first port does: a degraded fabric, not a stopped one."""
    seen = ports_seen(node, obs)
    return len(seen) == 2 and carries(*seen[0]) and not carries(*seen[1])


def carrying_rdma_devices(node: Node, obs: NodeObservation) -> list[str]:
    """The RDMA devices of the ports that carry now, in declared order: what NCCL_IB_HCA lists at a start."""
    return [port.rdma_device for port, link in ports_seen(node, obs) if port.rdma_device and carries(port, link)]


@dataclass(frozen=True)
class RdmaAtStart:
    """What a start tells NCCL of the node's fabric as it is then (`core.vllm.at_start`): the RDMA devices whose
    ports carry, and the RoCE v2 IPv4 GID index of the first of them (None: not read, or none matches)."""

    devices: list[str]
    gid_index: int | None


def rdma_at_start(node: Node, obs: NodeObservation) -> RdmaAtStart:
    """The carrying devices and the GID index NCCL must use on them: the RoCE v2 entry whose GID is the IPv4-mapped
    form of the port's declared address (`::ffff:a.b.c.d`). NCCL's default index is 0 (RoCE v1, link-local on a
    ConnectX), and the index of the v2 IPv4 entry moves when the GID table is rebuilt (a firmware update, an
    address added): read at every start, never assumed (sparkrun detects it the same way, from show_gids)."""
    devices = carrying_rdma_devices(node, obs)
    for port, link in ports_seen(node, obs):
        if port.rdma_device in devices and link is not None and link.rdma is not None:
            want = ipv4_gid(str(port.address.ip))
            index = next((i for i, gid in sorted(link.rdma.roce_v2_gids.items()) if gid == want), None)
            return RdmaAtStart(devices, index)
    return RdmaAtStart(devices, None)


def ipv4_gid(address: str) -> str:
    """`192.168.200.13` as the kernel prints its IPv4-mapped GID (`%pI6`): 0000:...:ffff:c0a8:c80d."""
    return ipaddress.IPv6Address(f"::ffff:{address}").exploded


def other_port(node: Node, index: int) -> tuple[int, FabricPort] | None:
    """The node's other declared port and its index: the twin for the first port, the first for the twin; None
    when the node declares no twin."""
    ports = node.fabric.ports()
    if len(ports) < 2:
        return None
    other = 1 - index
    return other, ports[other]


def reaches(want: FabricPort, link: Link | None) -> bool:
    """A session can arrive over this port: it passes traffic (`Link.up`) and holds its declared address. Its RDMA
    port's state does not matter to TCP."""
    return link is not None and link.up and str(want.address) in link.addresses
