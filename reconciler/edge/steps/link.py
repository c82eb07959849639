"""The fabric link: every declared port (the first and its twin) up, MTU, address; verified by state and by a
don't-fragment ping of MTU-28 bytes to the peer's port in the same subnet.

The ping is what catches the MTU mismatch after a firmware reboot (one end back at 1500): `ip link` looks fine on
both sides while full-size frames are silently dropped.
"""

from __future__ import annotations

from reconciler.core.observed import Link
from reconciler.core.planning import Step
from reconciler.core.spec import FabricPort
from reconciler.edge.probes import link_script, parse_links, read_sections
from reconciler.edge.steps import StepContext, StepFailed, wait_for

IP = "/usr/sbin/ip"


def read_links(ctx: StepContext, node: str) -> list[Link]:
    """The node's declared ports as they are now, in `Fabric.ports()` order."""
    n = ctx.desired.node(node)
    first, twin = parse_links(n, read_sections(ctx.sessions[node], link_script(n), ctx.command_timeout))
    return [first, *([twin] if twin else [])]


def session_address(ctx: StepContext, node: str) -> str | None:
    """The node's address our SSH session arrived on (`$SSH_CONNECTION`'s third field), None if unreadable."""
    out = ctx.sessions[node].run(["sh", "-c", 'printf "%s" "$SSH_CONNECTION"'], timeout=ctx.command_timeout,
                                 check=False).stdout.split()
    return out[2] if len(out) == 4 else None


def link_ips(link: Link) -> set[str]:
    return {a.split("/", 1)[0] for a in link.addresses}


def _rdma_active(link: Link) -> bool:
    """The port can vanish while we wait (a driver reload): then it is not active, and the wait goes on."""
    return link.rdma is not None and link.rdma.active


def _peer(ctx: StepContext, node: str, index: int) -> str | None:
    """Whom to ping over port `index`: that port of the head for a worker, of the first other serving node for
    the head; None when the peer does not declare that port."""
    d = ctx.desired
    if d.node(node).role == "worker":
        peer = d.head
    else:
        others = [n for n in d.serving_nodes if n.name != node] or [n for n in d.nodes if n.name != node]
        if not others:
            return None
        peer = others[0]
    ports = peer.fabric.ports()
    return str(ports[index].address.ip) if index < len(ports) else None


def converge_link(ctx: StepContext, step: Step) -> None:
    fabric = ctx.desired.node(step.node).fabric
    for index, port in enumerate(fabric.ports()):
        _converge_port(ctx, step.node, index, port, fabric.mtu)


def _converge_port(ctx: StepContext, node: str, index: int, want: FabricPort, mtu: int) -> None:
    session = ctx.sessions[node]

    def now() -> Link:
        return read_links(ctx, node)[index]

    link = now()
    if not link.exists:
        raise StepFailed(f"interface {want.interface} does not exist on {node}")
    if link.mtu != mtu and (arrives := session_address(ctx, node)) in link_ips(link):
        raise StepFailed(f"not changing the MTU of {want.interface} on {node} to {mtu}: the reconciler's SSH "
                         f"session arrives on it ({arrives}), and a switch without jumbo frames would cut the node "
                         "off. Set it with netplan, or reach the node over its management port")
    if link.mtu != mtu:
        session.run([IP, "link", "set", "dev", want.interface, "mtu", str(mtu)], sudo=True,
                    timeout=ctx.command_timeout)
    if not link.admin_up:
        session.run([IP, "link", "set", "dev", want.interface, "up"], sudo=True, timeout=ctx.command_timeout)
    if str(want.address) not in link.addresses:
        session.run([IP, "addr", "add", str(want.address), "dev", want.interface], sudo=True,
                    timeout=ctx.command_timeout)
    link = wait_for(lambda: (lambda seen: seen if seen.admin_up and seen.carrier else None)(now()),
                    timeout=ctx.remaining(30), what=f"{want.interface} on {node} to come up with carrier",
                    cancel=ctx.cancel)
    if link.mtu != mtu or str(want.address) not in link.addresses:
        raise StepFailed(f"{want.interface} on {node}: mtu {link.mtu}, addresses {link.addresses} after the change")
    if want.rdma_device and link.rdma is not None:
        wait_for(lambda: _rdma_active(now()), timeout=ctx.remaining(30),
                 what=f"RDMA port {want.rdma_device} on {node} to become ACTIVE", cancel=ctx.cancel)
    peer = _peer(ctx, node, index)
    if peer is None:
        return
    argv = ["ping", "-c", "1", "-W", "1", "-M", "do", "-s", str(mtu - 28), "-I", want.interface, peer]
    try:
        wait_for(lambda: session.run(argv, timeout=ctx.command_timeout, check=False).ok,
                 timeout=ctx.remaining(20), interval=0.5, cancel=ctx.cancel,
                 what=f"a don't-fragment ping of {mtu - 28} bytes from {node} to {peer} over {want.interface}")
    except StepFailed as exc:
        raise StepFailed(f"{exc}: check the MTU on both ends (a firmware reboot can reset one to 1500)") from None
