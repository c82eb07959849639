"""The fabric link: up, MTU, address; verified by state and by a don't-fragment ping of MTU-28 bytes to a peer.

The ping is what catches the MTU mismatch after a firmware reboot (one end back at 1500): `ip link` looks fine on
both sides while full-size frames are silently dropped.
"""

from __future__ import annotations

from reconciler.observe import parse_link, split_sections
from reconciler.observed import Link
from reconciler.plan import Step
from reconciler.remote import quote
from reconciler.steps import StepContext, StepFailed, wait_for

IP = "/usr/sbin/ip"


def read_link(ctx: StepContext, node: str) -> Link:
    n = ctx.desired.node(node)
    iface, dev = n.fabric.interface, n.fabric.rdma_device
    script = f"echo @@link; ip -j addr show dev {quote([iface])}; echo \"@@rc $?\"\necho @@rdma\n"
    if dev:
        port = f"/sys/class/infiniband/{dev}/ports/1"
        script += (f"if [ -d {quote([port])} ]; then cat {quote([port + '/state', port + '/phys_state'])}; "
                   "echo \"@@rc $?\"; else echo '@@rc 2'; fi\n")
    else:
        script += "echo '@@rc 2'\n"
    out = ctx.sessions[node].run_script(script, timeout=ctx.command_timeout).stdout
    sections = split_sections(out)
    return parse_link(iface, sections.get("link"), sections.get("rdma"))


def _rdma_active(link: Link) -> bool:
    """The port can vanish while we wait (a driver reload): then it is not active, and the wait goes on."""
    return link.rdma is not None and link.rdma.active


def _peer(ctx: StepContext, node: str) -> str | None:
    """Whom to ping: the head for a worker, the first other serving node for the head."""
    d = ctx.desired
    if d.node(node).role == "worker":
        return str(d.head.fabric.address.ip)
    others = [n for n in d.serving_nodes if n.name != node] or [n for n in d.nodes if n.name != node]
    return str(others[0].fabric.address.ip) if others else None


def converge_link(ctx: StepContext, step: Step) -> None:
    node = step.node
    want = ctx.desired.node(node).fabric
    session = ctx.sessions[node]
    link = read_link(ctx, node)
    if not link.exists:
        raise StepFailed(f"interface {want.interface} does not exist on {node}")
    if link.mtu != want.mtu:
        session.run([IP, "link", "set", "dev", want.interface, "mtu", str(want.mtu)], sudo=True,
                    timeout=ctx.command_timeout)
    if not link.admin_up:
        session.run([IP, "link", "set", "dev", want.interface, "up"], sudo=True, timeout=ctx.command_timeout)
    if str(want.address) not in link.addresses:
        session.run([IP, "addr", "add", str(want.address), "dev", want.interface], sudo=True,
                    timeout=ctx.command_timeout)
    link = wait_for(lambda: (lambda seen: seen if seen.admin_up and seen.carrier else None)(read_link(ctx, node)),
                    timeout=ctx.remaining(30), what=f"{want.interface} on {node} to come up with carrier",
                    cancel=ctx.cancel)
    if link.mtu != want.mtu or str(want.address) not in link.addresses:
        raise StepFailed(f"{want.interface} on {node}: mtu {link.mtu}, addresses {link.addresses} after the change")
    if want.rdma_device and link.rdma is not None:
        wait_for(lambda: _rdma_active(read_link(ctx, node)), timeout=ctx.remaining(30),
                 what=f"RDMA port {want.rdma_device} on {node} to become ACTIVE", cancel=ctx.cancel)
    peer = _peer(ctx, node)
    if peer is None:
        return
    argv = ["ping", "-c", "1", "-W", "1", "-M", "do", "-s", str(want.mtu - 28), "-I", want.interface, peer]
    try:
        wait_for(lambda: session.run(argv, timeout=ctx.command_timeout, check=False).ok,
                 timeout=ctx.remaining(20), interval=0.5, cancel=ctx.cancel,
                 what=f"a don't-fragment ping of {want.mtu - 28} bytes from {node} to {peer} over {want.interface}")
    except StepFailed as exc:
        raise StepFailed(f"{exc}: check the MTU on both ends (a firmware reboot can reset one to 1500)") from None
