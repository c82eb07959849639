"""The fabric on a node: its declared ports as they are (`links_fact`: `ip -j addr` and the RDMA port's state and
RoCE v2 GIDs), every interface and RDMA device for a node not declared yet (discover), and the address an SSH
session arrived on (`SESSION_ADDRESS`)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from reconciler.core.observed import (
    Link,
    RdmaPort,
)
from reconciler.core.spec import Node
from reconciler.edge.facts.base import Fact, Section, node_json, node_output
from reconciler.edge.ssh import quote_word

_TWIN = "-twin"  # section suffix of the fabric's twin port


def link_script(node: Node) -> list[str]:
    """Script lines reading each fabric port: `link`/`rdma` sections for the first, `link-twin`/`rdma-twin` for
    the twin (needs `sec`). The probe and the link step read the ports with these same lines."""
    lines = []
    for port, suffix in zip(node.fabric.ports(), ("", _TWIN), strict=False):
        lines += [f"sec link{suffix}", f"ip -j addr show dev {quote_word(port.interface)} 2>&1; rc $?",
                  f"sec rdma{suffix}"]
        if port.rdma_device:
            sysfs = f"/sys/class/infiniband/{port.rdma_device}/ports/1"
            # the RoCE v2 GIDs: `grep -l` names the types that say so (an unused entry's type is EINVAL, hence
            # 2>/dev/null), each printed `gid N VALUE` after the two state lines (NCCL_IB_GID_INDEX, at_start)
            gids = (f"(cd {quote_word(sysfs + '/gid_attrs/types')} 2>/dev/null && grep -lx 'RoCE v2' -- * "
                    "2>/dev/null | head -n 64 | while read -r i; do printf 'gid %s %s\\n' \"$i\" "
                    "\"$(cat ../../gids/\"$i\" 2>/dev/null)\"; done)")
            lines.append(f"if [ -d {quote_word(sysfs)} ]; then "
                         f"cat {quote_word(sysfs + '/state')} {quote_word(sysfs + '/phys_state')}; "
                         f"r=$?; {gids}; rc $r; else rc 2; fi")
        else:
            lines.append("rc 2")
    return lines


def _link(name: str, info: dict[str, Any], rdma: RdmaPort | None) -> Link:
    """One interface of `ip -j addr` as a Link: the one reading of iproute2's JSON (flags, mtu, IPv4)."""
    flags = info.get("flags", [])
    addresses = [f"{a['local']}/{a['prefixlen']}" for a in info.get("addr_info", []) if a.get("family") == "inet"]
    return Link(name=name, operstate=str(info.get("operstate", "UNKNOWN")).lower(), admin_up="UP" in flags,
                carrier="LOWER_UP" in flags, mtu=int(info.get("mtu", 0)), addresses=addresses, rdma=rdma)


@node_output("link")
def parse_link(name: str, link_sec: Section | None, rdma_sec: Section | None) -> Link:
    if link_sec is None or link_sec.rc != 0:
        return Link(name=name, exists=False)
    data = node_json(link_sec.body or "[]")
    if not data:
        return Link(name=name, exists=False)
    rdma = None
    if rdma_sec is not None and rdma_sec.rc == 0:
        lines = rdma_sec.body.split("\n")
        state, phys = (lines + ["", ""])[:2]
        rdma = RdmaPort(state=state.strip(), phys_state=phys.strip(), roce_v2_gids=_gids(lines[2:]))
    return _link(name, data[0], rdma)


_GID = re.compile(r"^gid (\d{1,4}) ((?:[0-9a-f]{4}:){7}[0-9a-f]{4})$")


def _gids(lines: list[str]) -> dict[int, str]:
    """The `gid N VALUE` lines of a port's RoCE v2 entries; any other line (a GID that did not read) is left out."""
    return {int(m.group(1)): m.group(2) for line in lines if (m := _GID.match(line.strip()))}


def parse_links(node: Node, sections: dict[str, Section]) -> tuple[Link, Link | None]:
    """The first port's link and the twin's (None when no twin is declared), from `link_script`'s sections."""
    first = parse_link(node.fabric.interface, sections.get("link"), sections.get("rdma"))
    twin = node.fabric.twin
    if twin is None:
        return first, None
    return first, parse_link(twin.interface, sections.get("link" + _TWIN), sections.get("rdma" + _TWIN))


def interfaces_script() -> list[str]:
    """The `addr` and `rdma_sysfs` sections, for a node whose fabric is not declared yet (discover): every
    interface's `ip -j addr` (`parse_interfaces`) and every RDMA device's port 1 with the netdevs it drives
    (`parse_rdma_devices`). `link_script` reads the declared ports only."""
    return [
        "sec addr",
        "ip -j addr 2>&1; rc $?",
        "sec rdma_sysfs",
        "for d in /sys/class/infiniband/*; do",
        "  [ -d \"$d\" ] || continue",
        "  printf 'dev %s\\n' \"${d##*/}\"",
        "  printf 'state %s\\n' \"$(cat \"$d/ports/1/state\" 2>/dev/null)\"",
        "  printf 'phys_state %s\\n' \"$(cat \"$d/ports/1/phys_state\" 2>/dev/null)\"",
        "  for n in \"$d\"/device/net/*; do [ -e \"$n\" ] && printf 'net %s\\n' \"${n##*/}\"; done",
        "done; rc 0",
    ]


@node_output("interfaces")
def parse_interfaces(sec: Section | None) -> list[Link]:
    """Every interface of `interfaces_script`'s `addr` section but the loopback, in the kernel's order, read as
    `parse_link` reads one (their RDMA ports are `parse_rdma_devices`')."""
    if sec is None or sec.rc != 0:
        return []
    return [_link(str(info["ifname"]), info, None) for info in node_json(sec.body or "[]")
            if "LOOPBACK" not in info.get("flags", [])]


@dataclass(frozen=True)
class RdmaDevice:
    """An RDMA device (`rocep1s0f1`), the netdevs it drives (`enp1s0f1np1`) and the state of its port 1."""

    name: str
    netdevs: tuple[str, ...]
    port: RdmaPort


@node_output("rdma devices")
def parse_rdma_devices(sec: Section | None) -> list[RdmaDevice]:
    """The `dev`/`state`/`phys_state`/`net` lines of `interfaces_script`'s `rdma_sysfs` section."""
    if sec is None or sec.rc != 0:
        return []
    devices: list[dict[str, Any]] = []
    for line in sec.body.splitlines():
        key, _, value = line.partition(" ")
        if key == "dev":
            devices.append({"name": value.strip(), "state": "", "phys_state": "", "netdevs": []})
        elif devices and key in ("state", "phys_state"):
            devices[-1][key] = value.strip()
        elif devices and key == "net":
            devices[-1]["netdevs"].append(value.strip())
    return [RdmaDevice(d["name"], tuple(d["netdevs"]), RdmaPort(state=d["state"], phys_state=d["phys_state"]))
            for d in devices]


@node_output("ssh_connection")
def parse_session_address(sec: Section | None) -> str | None:
    """The node's own address the SSH session arrived on: `$SSH_CONNECTION`'s third field (client address, client
    port, server address, server port); None when sshd did not set it as documented."""
    words = sec.body.split() if sec is not None else []
    return words[2] if len(words) == 4 else None


SESSION_ADDRESS: Fact[str | None] = Fact(
    "session-address", ("sec ssh_connection", 'printf "%s\\n" "${SSH_CONNECTION:-}"; rc 0'),
    lambda sections: parse_session_address(sections.get("ssh_connection")))


def links_fact(node: Node) -> Fact[tuple[Link, Link | None]]:
    """The node's declared fabric ports as they are now (`link_script`, `parse_links`)."""
    return Fact("links", tuple(link_script(node)), lambda sections: parse_links(node, sections))
