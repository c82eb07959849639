"""The fabric link: every declared port (the first and its twin) up, MTU, address; verified by state and by a
don't-fragment ping of MTU-28 bytes to the peer's port in the same subnet.

The ping is what catches the MTU mismatch after a firmware reboot (one end back at 1500): `ip link` looks fine on
both sides while full-size frames are silently dropped.
"""

from __future__ import annotations

from reconciler.core.observed import Link
from reconciler.core.planning import Step
from reconciler.core.spec import FabricPort
from reconciler.edge.probes import SESSION_ADDRESS, links_fact
from reconciler.edge.steps.actions import Actions, Given, Read, Run, StepFailed, read, wait

IP = "/usr/sbin/ip"
UP_WITHIN = 30.0  # seconds for a port to come up with carrier (and its RDMA port to become ACTIVE) after the change
PING_WITHIN = 20.0  # seconds of don't-fragment pings before the MTU is blamed


def link_ips(link: Link) -> set[str]:
    return {a.split("/", 1)[0] for a in link.addresses}


def _rdma_active(link: Link) -> bool:
    """The port can vanish while we wait (a driver reload): then it is not active, and the wait goes on."""
    return link.rdma is not None and link.rdma.active


def _peer(given: Given, node: str, index: int) -> str | None:
    """Whom to ping over port `index`: that port of the head for a worker, of the first other serving node for
    the head; None when the peer does not declare that port."""
    d = given.desired
    if d.node(node).role == "worker":
        peer = d.head
    else:
        others = [n for n in d.serving_nodes if n.name != node] or [n for n in d.nodes if n.name != node]
        if not others:
            return None
        peer = others[0]
    ports = peer.fabric.ports()
    return str(ports[index].address.ip) if index < len(ports) else None


def converge_link(given: Given, step: Step) -> Actions:
    fabric = given.desired.node(step.node).fabric
    for index, port in enumerate(fabric.ports()):
        yield from _converge_port(given, step.node, index, port, fabric.mtu)


def _port(links: tuple[Link, Link | None], index: int) -> Link:
    """Port `index` in `Fabric.ports()` order (the twin is None when the node does not declare it)."""
    port = links[index]
    assert port is not None, "a declared port is always read"
    return port


def _converge_port(given: Given, node: str, index: int, want: FabricPort, mtu: int) -> Actions:
    ports = Read(node, links_fact(given.desired.node(node)))  # read now, then again until the change shows
    link = _port((yield ports), index)
    if not link.exists:
        raise StepFailed(f"interface {want.interface} does not exist on {node}")
    if link.mtu != mtu:
        # The self-cut guard: a session that arrives on this port would be cut off by a switch without jumbo frames.
        if (arrives := (yield from read(node, SESSION_ADDRESS))) in link_ips(link):
            raise StepFailed(f"not changing the MTU of {want.interface} on {node} to {mtu}: the reconciler's SSH "
                             f"session arrives on it ({arrives}), and a switch without jumbo frames would cut the "
                             "node off. Set it with netplan, or reach the node over its management port")
        yield Run(node, (IP, "link", "set", "dev", want.interface, "mtu", str(mtu)), sudo=True)
    if not link.admin_up:
        yield Run(node, (IP, "link", "set", "dev", want.interface, "up"), sudo=True)
    if str(want.address) not in link.addresses:
        yield Run(node, (IP, "addr", "add", str(want.address), "dev", want.interface), sudo=True)
    seen = yield from wait(ports, lambda links: _port(links, index).up, timeout=UP_WITHIN,
                           what=f"{want.interface} on {node} to come up with carrier")
    link = _port(seen, index)
    if link.mtu != mtu or str(want.address) not in link.addresses:
        raise StepFailed(f"{want.interface} on {node}: mtu {link.mtu}, addresses {link.addresses} after the change")
    if want.rdma_device and link.rdma is not None:
        yield from wait(ports, lambda links: _rdma_active(_port(links, index)), timeout=UP_WITHIN,
                        what=f"RDMA port {want.rdma_device} on {node} to become ACTIVE")
    peer = _peer(given, node, index)
    if peer is None:
        return
    ping = Run(node, ("ping", "-c", "1", "-W", "1", "-M", "do", "-s", str(mtu - 28), "-I", want.interface, peer),
               check=False)
    try:
        yield from wait(ping, lambda result: bool(result.ok), timeout=PING_WITHIN,
                        interval=0.5, what=f"a don't-fragment ping of {mtu - 28} bytes from {node} to {peer} over "
                                           f"{want.interface}")
    except StepFailed as exc:
        raise StepFailed(f"{exc}: check the MTU on both ends (a firmware reboot can reset one to 1500)") from None
