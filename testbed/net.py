"""Network namespaces and links: the nodes' management network and the fabric (RoCE stand-in) link.

Topology (contract in docs/testbed.md ("The contract")):

* root ``sb-mgmt0`` 10.231.0.1/24 <-veth-> head ``enP7s7`` 10.231.0.2/24 — where the reconciler runs from;
* head ``enP7s8`` 10.231.1.1/24 and each worker's ``enP7s7`` 10.231.1.(10+i)/24 on bridge ``br-mgmt`` in the
  ``sb-switch`` namespace — the worker is reachable only through the head (the head is the SSH jump host);
* ``enp1s0f1np1`` in every node: for 2 nodes a direct veth pair (like the QSFP cable between two Sparks, so
  the head loses carrier when the worker's port goes down); for more, each node on bridge ``br-fabric-f``;
* ``enP2p1s0f1np1``, the port's twin (a Spark's QSFP port is two netdevs), the same way (``br-fabric-t``), in
  its own subnet 10.232.1.0/24.

No namespace has a default route: nothing in the testbed can send a packet outside it. In the root namespace
the testbed supernets are routed ``unreachable`` so a connect to a worker address fails at once instead of
leaking out of the machine's default route.
"""
from __future__ import annotations

import json
import subprocess
import time
from typing import Any

from .layout import (
    FABRIC_IFACE,
    FABRIC_MTU,
    FABRIC_TWIN_IFACE,
    INNER_IFACE,
    MGMT_IFACE,
    ROOT_MGMT_ADDR,
    ROOT_MGMT_IFACE,
    SWITCH_NS,
    TESTBED_SUPERNETS,
    Layout,
    Node,
)
from .proc import ok, run


def ip(*args: str, ns: str | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:
    cmd = ["ip"] + (["-n", ns] if ns else []) + list(args)
    return run(cmd, check=check)


def netns_exists(name: str) -> bool:
    return ok(["ip", "netns", "exec", name, "true"]) if name in list_netns() else False


def list_netns() -> list[str]:
    out = run(["ip", "-j", "netns", "list"], check=False).stdout.strip()
    return [e["name"] for e in json.loads(out)] if out else []


def link_exists(dev: str, ns: str | None = None) -> bool:
    return ok(["ip"] + (["-n", ns] if ns else []) + ["link", "show", "dev", dev])


def links(ns: str) -> list[dict[str, Any]]:
    """`ip -j addr show`: one object per link, as iproute2 prints it."""
    found: list[dict[str, Any]] = json.loads(run(["ip", "-n", ns, "-j", "addr", "show"]).stdout)
    return found


def link(ns: str, dev: str) -> dict[str, Any]:
    found: list[dict[str, Any]] = json.loads(run(["ip", "-n", ns, "-j", "addr", "show", "dev", dev]).stdout)
    return found[0]


def _veth(a: str, a_ns: str | None, b: str, b_ns: str) -> None:
    cmd = ["link", "add", a] + (["netns", a_ns] if a_ns else []) + ["type", "veth", "peer", "name", b,
                                                                      "netns", b_ns]
    ip(*cmd)


def setup(lay: Layout) -> None:
    """Create namespaces and links (idempotent: an existing namespace set is left as it is)."""
    names = [SWITCH_NS] + [n.netns for n in lay.nodes]
    if all(n in list_netns() for n in names) and link_exists(ROOT_MGMT_IFACE):
        return
    teardown(lay)  # half-made leftovers: start clean
    for name in names:
        ip("netns", "add", name)
        ip("link", "set", "dev", "lo", "up", ns=name)
    head = lay.head
    # root <-> head
    _veth(ROOT_MGMT_IFACE, None, MGMT_IFACE, head.netns)
    ip("addr", "add", ROOT_MGMT_ADDR, "dev", ROOT_MGMT_IFACE)
    ip("link", "set", "dev", ROOT_MGMT_IFACE, "up")
    ip("addr", "add", head.mgmt_addrs[0], "dev", MGMT_IFACE, ns=head.netns)
    ip("link", "set", "dev", MGMT_IFACE, "up", ns=head.netns)
    for net in TESTBED_SUPERNETS:
        ip("route", "replace", "unreachable", net)
    # inner management: bridge in the switch namespace
    ip("link", "add", "br-mgmt", "type", "bridge", ns=SWITCH_NS)
    ip("link", "set", "dev", "br-mgmt", "up", ns=SWITCH_NS)
    for n in lay.nodes:
        dev = INNER_IFACE if n.index == 0 else MGMT_IFACE
        port = f"m-{n.name}"[:15]
        _veth(dev, n.netns, port, SWITCH_NS)
        ip("link", "set", "dev", port, "master", "br-mgmt", "up", ns=SWITCH_NS)
        ip("addr", "add", n.mgmt_addrs[-1], "dev", dev, ns=n.netns)
        ip("link", "set", "dev", dev, "up", ns=n.netns)
    # fabric: the port and its twin, each its own cable (or bridge)
    for dev, tag in ((FABRIC_IFACE, "f"), (FABRIC_TWIN_IFACE, "t")):
        if len(lay.nodes) == 2:
            _veth(dev, head.netns, dev, lay.workers[0].netns)
            continue
        bridge = f"br-fabric-{tag}"
        ip("link", "add", bridge, "mtu", str(FABRIC_MTU), "type", "bridge", ns=SWITCH_NS)
        ip("link", "set", "dev", bridge, "up", ns=SWITCH_NS)
        for n in lay.nodes:
            port = f"{tag}-{n.name}"[:15]
            _veth(dev, n.netns, port, SWITCH_NS)
            ip("link", "set", "dev", port, "mtu", str(FABRIC_MTU), "master", bridge, "up", ns=SWITCH_NS)


def teardown(lay: Layout | None = None) -> None:
    """Delete every sb-* namespace (their veths go with them) and the root-namespace pieces."""
    for name in list_netns():
        if name.startswith("sb-"):
            ip("netns", "del", name, check=False)
    if link_exists(ROOT_MGMT_IFACE):
        ip("link", "del", "dev", ROOT_MGMT_IFACE, check=False)
    for net in TESTBED_SUPERNETS:
        ip("route", "del", "unreachable", net, check=False)


# ---- fabric state (scenarios and faults) ---------------------------------------------------------------------

def _fabric_ports(node: Node) -> tuple[tuple[str, str], ...]:
    return ((FABRIC_IFACE, node.fabric_addr), (FABRIC_TWIN_IFACE, node.twin_addr))


def fabric_configure(node: Node, twin_only: bool = False) -> None:
    """As the reconciler would leave it: both ports (or the twin only) up, mtu 9000, the node's addresses."""
    ns = node.netns
    for dev, addr in _fabric_ports(node)[1 if twin_only else 0:]:
        ip("link", "set", "dev", dev, "mtu", str(FABRIC_MTU), ns=ns)
        ip("addr", "replace", addr, "dev", dev, ns=ns)
        ip("link", "set", "dev", dev, "up", ns=ns)


def fabric_unconfigure(node: Node) -> None:
    """As the seed's worker: both ports down, mtu 1500, no address."""
    ns = node.netns
    for dev, _ in _fabric_ports(node):
        ip("link", "set", "dev", dev, "down", ns=ns)
        ip("addr", "flush", "dev", dev, ns=ns)
        ip("link", "set", "dev", dev, "mtu", "1500", ns=ns)


def set_link(node: Node, up: bool, dev: str = FABRIC_IFACE) -> None:
    ip("link", "set", "dev", dev, "up" if up else "down", ns=node.netns)


def flap(node: Node, count: int, interval: float, dev: str = FABRIC_IFACE) -> None:
    for i in range(count):
        set_link(node, False, dev)
        time.sleep(interval)   # the flap period itself is the point here, not a wait for a condition
        set_link(node, True, dev)
        if i + 1 < count:
            time.sleep(interval)


def set_mtu(node: Node, mtu: int, dev: str = FABRIC_IFACE) -> None:
    ip("link", "set", "dev", dev, "mtu", str(mtu), ns=node.netns)


def mgmt_port(node: Node) -> tuple[str | None, str]:
    """(namespace, device) whose state cuts the node's management path: the cable, not the node's NIC."""
    if node.index == 0:
        return None, ROOT_MGMT_IFACE
    return SWITCH_NS, f"m-{node.name}"[:15]


def set_mgmt(node: Node, up: bool) -> None:
    ns, dev = mgmt_port(node)
    ip("link", "set", "dev", dev, "up" if up else "down", ns=ns)
