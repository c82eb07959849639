"""Which listeners on a TCP port are in the way of ours (issue 53, MEDIUM B): the one rule for the head's health
checks (`edge.facts.ports.port_owner_script`) and for the ports a start needs (`core.planning._ports_taken`).

vLLM binds `serving.host:serving.port` (`127.0.0.1` or `0.0.0.0`, an IPv4 socket) and the health checks dial
`127.0.0.1:serving.port`. A listener is in the way when it would receive that connection or keep that bind from
succeeding: on Linux, an IPv4 listener on the same address or on `0.0.0.0`; with `host: 0.0.0.0`, an IPv4 listener
on any address; an IPv6 listener on `::` (dual-stack unless the socket set IPV6_V6ONLY, which /proc/net/tcp6 does
not show: counted) or on an IPv4-mapped address (`::ffff:127.0.0.1`) the same way as that IPv4 address. Any other
address is not: `::1`, `127.0.0.2` beside `127.0.0.1`, a LAN address beside `127.0.0.1`. Counting every LISTEN row on
the port let any local user bind `[::1]:8000` while vLLM served on `127.0.0.1:8000`: serving read as "held by uid
65534", and every restart was held.

Addresses are handled in two spellings: as /proc/net/tcp{,6} prints them (`proc_address`: hexadecimal, each
32-bit word in the host's byte order, little-endian on the Spark's aarch64 and on x86_64) and as text
(`127.0.0.1`, `::1`), which the observation keeps.
"""

from __future__ import annotations

import ipaddress
from typing import Final

#: serving.host, or `ANY` for a bind on every address of both families: torch's TCPStore (its libuv backend
#: binds `::`, else `0.0.0.0`) and Ray's GCS, for which any listener on the port is in the way.
ANY: Final = "::"

#: As /proc/net/tcp{,6} prints them (little-endian words).
LOOPBACK4_HEX: Final = "0100007F"  # 127.0.0.1
WILDCARD4_HEX: Final = "00000000"  # 0.0.0.0
WILDCARD6_HEX: Final = "0" * 32  # ::
MAPPED_HEX: Final = "0000000000000000FFFF0000"  # ::ffff:0:0/96, the IPv4-mapped prefix


def proc_address(hexa: str) -> str:
    """A local address as /proc/net/tcp (8 hex digits) or tcp6 (32) prints it, as text: `0100007F` is
    `127.0.0.1`, `00000000000000000000000001000000` is `::1`. ValueError for anything else."""
    if len(hexa) not in (8, 32):
        raise ValueError(f"not an address of /proc/net/tcp: {hexa[:40]!r}")
    raw = bytes.fromhex(hexa)
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    ip = ipaddress.ip_address(words)
    mapped = ip.ipv4_mapped if isinstance(ip, ipaddress.IPv6Address) else None
    return f"::ffff:{mapped}" if mapped is not None else str(ip)  # dotted on every Python (3.13 prints it so)


def takes(address: str, host: str) -> bool:
    """Whether a listener on `address` (text) receives the health checks' connection to `127.0.0.1:PORT` or keeps
    a bind of `host:PORT` from succeeding. `host`: serving.host (`127.0.0.1` or `0.0.0.0`), or `ANY`. An address
    that is not one (a snapshot edited by hand) is in the way: unknown counts, as every listener once did."""
    if host == ANY:
        return True
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return True
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.is_unspecified:
            return True  # `::`: dual-stack unless IPV6_V6ONLY, which the kernel's table does not say
        mapped = ip.ipv4_mapped
        if mapped is None:
            return False  # an IPv6 address: no IPv4 connection reaches it, no IPv4 bind meets it
        ip = mapped
    if host == "0.0.0.0":
        return True
    return ip in (ipaddress.IPv4Address(host), ipaddress.IPv4Address("0.0.0.0"))


def shown(address: str, port: int) -> str:
    """`127.0.0.2:8000`, `[::1]:8000`."""
    return f"[{address}]:{port}" if ":" in address else f"{address}:{port}"
