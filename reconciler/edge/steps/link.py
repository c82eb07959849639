"""The fabric link: every declared port (the first and its twin) up, MTU, address; verified by state and by a
don't-fragment ping of MTU-28 bytes to the peer's port in the same subnet.

The ping is what catches the MTU mismatch after a firmware reboot (one end back at 1500): `ip link` looks fine on
both sides while full-size frames are silently dropped.

The MTU of a port is never changed over a session that arrives on that port (a path without jumbo frames would
cut the node off). On the seed's topology the worker is reached over its first port, so that port's repair goes
over a session to the node's other declared port (its twin; the first port for the twin), the host key checked
under the node's own known_hosts entry as on every path; without such a path only when the peer's end of the link
already runs the target MTU (`_set_mtu`).
"""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

from reconciler.core import fabric
from reconciler.core.observed import Link
from reconciler.core.planning import Step
from reconciler.core.spec import FabricPort, Node
from reconciler.edge.facts.links import SESSION_ADDRESS, links_fact
from reconciler.edge.ssh import RemoteError, via
from reconciler.edge.steps.actions import Action, Actions, Given, Read, Report, Run, StepFailed, read, wait

IP = "/usr/sbin/ip"
UP_WITHIN = 30.0  # seconds for a port to come up with carrier (and its RDMA port to become ACTIVE) after the change
PING_WITHIN = 20.0  # seconds of don't-fragment pings before the MTU is blamed


def link_ips(link: Link) -> set[str]:
    return {a.split("/", 1)[0] for a in link.addresses}


def _rdma_active(link: Link) -> bool:
    """The port can vanish while we wait (a driver reload): then it is not active, and the wait goes on."""
    return link.rdma is not None and link.rdma.active


def _peer_node(given: Given, node: str) -> Node | None:
    """The other end of the node's link: the head for a worker, the first other serving node for the head (the
    first other node of the file when none serves); None for a node alone."""
    d = given.desired
    if d.node(node).role == "worker":
        return d.head
    others = [n for n in d.serving_nodes if n.name != node] or [n for n in d.nodes if n.name != node]
    return others[0] if others else None


def _peer(given: Given, node: str, index: int) -> str | None:
    """Whom to ping over port `index`: that port of the peer (`_peer_node`); None when it does not declare it."""
    peer = _peer_node(given, node)
    ports = peer.fabric.ports() if peer is not None else []
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
    links = yield ports
    link = _port(links, index)
    if not link.exists:
        raise StepFailed(f"interface {want.interface} does not exist on {node}")
    if link.mtu != mtu:
        yield from _set_mtu(given, node, index, want, mtu, links)
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


def _set_mtu(given: Given, node: str, index: int, want: FabricPort, mtu: int,
             links: tuple[Link, Link | None]) -> Actions:
    """`ip link set dev IF mtu MTU`, never over a session that arrives on IF: a path without jumbo frames (a
    switch) would cut that session, and the node, off. When the node's session arrives on IF, the change goes

    1. over the node's other declared port (`_other_path`): a session to the same node at that port's address,
       its host key checked under the node's own known_hosts entry (`Session.over`), the same exact sudo line;
    2. else over the node's own session, when the peer's end of this link runs `mtu` already, read now
       (`_peer_end`): both ends then run it, so the link carries it; and the session survives the change, since
       TCP fixes each side's largest segment at the connection's start by the other's SYN (RFC 9293, 3.7.1): the
       node keeps receiving segments sized for its old 1500, and what it sends may grow to the peer's MSS, which
       the peer's `mtu` takes;
    3. else not at all: refused, saying what would make it possible."""
    argv = (IP, "link", "set", "dev", want.interface, "mtu", str(mtu))
    arrives = yield from read(node, SESSION_ADDRESS)
    if arrives not in link_ips(_port(links, index)):  # None (sshd set no $SSH_CONNECTION): nothing to match
        yield Run(node, argv, sudo=True)
        return
    address, no_path = yield from _other_path(given, node, index, links)
    if address is not None:
        yield Report("link.mtu-over-other-port", {"node": node, "interface": want.interface, "mtu": mtu,
                                                  "session": arrives, "over": address})
        yield Run(via(node, address), argv, sudo=True)
        return
    at_target, peer = yield from _peer_end(given, node, index, mtu)
    if at_target:
        yield Report("link.mtu-peer-at-target", {"node": node, "interface": want.interface, "mtu": mtu,
                                                 "session": arrives, "no_other_path": no_path})
        yield Run(node, argv, sudo=True)
        return
    raise StepFailed(f"not changing the MTU of {want.interface} on {node} to {mtu}: the reconciler's SSH session "
                     f"arrives on it ({arrives}), {no_path}, and {peer}; a path without jumbo frames would cut the "
                     "node off. Declare the node's twin (`fabric.twin`) and bring it up, set the MTU with netplan on "
                     "the node, or reach it over its management port")


def _other_path(given: Given, node: str, index: int,
                links: tuple[Link, Link | None]) -> Generator[Action, Any, tuple[str | None, str]]:
    """The address of the node's other declared port once a session there (`ssh.via`) answered and arrives on
    that port; else None and why not. A refused host key or login is raised, never taken for "no path": as with
    `ssh.fallback_hosts`, the node's one known_hosts entry vouches for it on every address, and a key that does
    not match it is a stop."""
    other = fabric.other_port(given.desired.node(node), index)
    if other is None:
        return None, "it declares no twin to be reached over"
    at, port = other
    address = str(port.address.ip)
    if not fabric.reaches(port, links[at]):
        return None, f"its other port {port.interface} is not up with {port.address}"
    try:
        arrives = yield from read(via(node, address), SESSION_ADDRESS)
    except RemoteError as exc:
        if not exc.transient:
            raise
        return None, f"no session answered over its other port {port.interface} ({exc.message})"
    if arrives not in link_ips(_port(links, at)):
        return None, f"the session to {address} arrives on {arrives or 'an unknown address'}, not on {port.interface}"
    return address, ""


def _peer_end(given: Given, node: str, index: int, mtu: int) -> Generator[Action, Any, tuple[bool, str]]:
    """Whether the peer's end of the link over port `index` (`_peer_node`), read now, passes traffic at `mtu`;
    and what it is, as the refusal says it."""
    peer = _peer_node(given, node)
    if peer is None:
        return False, "it has no peer whose end could vouch for the MTU"
    ports = peer.fabric.ports()
    if index >= len(ports):
        return False, f"its peer {peer.name} declares no such port"
    end = f"the peer's end ({ports[index].interface} on {peer.name})"
    try:
        link = _port((yield from read(peer.name, links_fact(peer))), index)
    except RemoteError as exc:
        return False, f"{end} could not be read ({exc.message})"
    if not link.up:
        return False, f"{end} is not up"
    return link.mtu == mtu, f"{end} runs MTU {link.mtu}, not {mtu}"
