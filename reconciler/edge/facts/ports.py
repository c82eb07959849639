"""The TCP ports of a node: what listens where (`LISTEN`, /proc/net/tcp{,6}) and who holds the serving port
(`port_owner_script`: only a port root alone holds is asked with the API key)."""

from __future__ import annotations

import ipaddress

from reconciler.core.listeners import MAPPED_HEX, WILDCARD4_HEX, WILDCARD6_HEX, proc_address
from reconciler.edge.facts.base import Fact, Section, node_output
from reconciler.edge.ssh import quote_word


def listen_script() -> list[str]:
    """The `listen` section: the LISTEN rows (state 0A) of /proc/net/tcp and tcp6, filtered on the node so a busy
    node's thousands of connections never fill the probe (`parse_listening`). /proc, not `ss`: nothing to
    install, and the same kernel table. tcp6 is absent where IPv6 is off."""
    return ["sec listen",
            "if [ -r /proc/net/tcp ]; then cat /proc/net/tcp /proc/net/tcp6 2>/dev/null | "
            "grep -E '^ *[0-9]+: [0-9A-Fa-f]+:[0-9A-Fa-f]{4} [0-9A-Fa-f]+:[0-9A-Fa-f]{4} 0A '; "
            "rc 0; else rc 2; fi"]


def listening_ports(text: str) -> set[int]:
    """The local ports of /proc/net/tcp{,6} LISTEN rows (`sl local rem st ...`, addresses `HEX:PORT` in hex)."""
    ports = set()
    for line in text.splitlines():
        cols = line.split()
        if not cols:
            continue
        if len(cols) < 4 or cols[3] != "0A":
            raise ValueError(f"not a LISTEN row of /proc/net/tcp: {line[:80]!r}")
        ports.add(int(cols[1].rpartition(":")[2], 16))
    return ports


@node_output("listen")
def parse_listening(sec: Section | None) -> list[int] | None:
    """The node's listening TCP ports, sorted; None when /proc/net/tcp could not be read."""
    if sec is None or sec.rc != 0:
        return None
    return sorted(listening_ports(sec.body))


def listen_addresses(text: str) -> dict[int, list[str]]:
    """The local addresses each port of /proc/net/tcp{,6} LISTEN rows is listened on at, as text
    (`core.listeners.proc_address`: `127.0.0.1`, `::1`), sorted. A row whose address does not read is left out:
    its port then has no address known, which `planning._ports_taken` counts as in the way."""
    found: dict[int, set[str]] = {}
    for line in text.splitlines():
        cols = line.split()
        if len(cols) < 4 or cols[3] != "0A":
            continue  # `listening_ports` names such a row
        address, _, port = cols[1].rpartition(":")
        try:
            found.setdefault(int(port, 16), set()).add(proc_address(address))
        except ValueError:
            continue
    return {port: sorted(addresses) for port, addresses in sorted(found.items())}


@node_output("listen")
def parse_listen_addresses(sec: Section | None) -> dict[int, list[str]] | None:
    """Where each listening port is listened on (`listen_addresses`); None when /proc/net/tcp could not be read."""
    if sec is None or sec.rc != 0:
        return None
    return listen_addresses(sec.body)


def _takes_awk(host: str) -> str:
    """`core.listeners.takes(address, host)` as an awk condition on `a`, the address as /proc/net/tcp{,6} prints
    it (tests/unit/core/test_port_neighbours.py holds the two to the same answers)."""
    if host == "0.0.0.0":  # every IPv4 address, `::`, every IPv4-mapped one
        return f'(length(a) == 8 || a == "{WILDCARD6_HEX}" || substr(a, 1, 24) == "{MAPPED_HEX}")'
    own = ipaddress.IPv4Address(host).packed[::-1].hex().upper()  # 127.0.0.1 -> 0100007F
    return " || ".join(["(" + f'a == "{own}"', f'a == "{WILDCARD4_HEX}"', f'a == "{WILDCARD6_HEX}"',
                        f'a == "{MAPPED_HEX}{own}"', f'a == "{MAPPED_HEX}{WILDCARD4_HEX}")'])


def port_owner_script(port: int, host: str = "127.0.0.1") -> list[str]:
    """The `port_owner` section: the uids owning a LISTEN socket on the serving port that is in the way
    (/proc/net/tcp{,6}, column 8; `core.listeners.takes`: it would receive the checks' connection to 127.0.0.1 or
    keep vLLM from binding `host`), as `$owners` ("0 " when only root does) on the first line; then every LISTEN
    row on the port, `+ UID ADDRESS` (in the way) or `- UID ADDRESS` (another address: `[::1]`, `127.0.0.2`).
    Serving containers run as root; a squatter does not (a local user who bound the port while vLLM was down,
    after a crash). Only when root alone is in the way is /health taken and the API asked, with its key: any other
    listener in the way gets nothing (`$code` is emptied) and is named (`port_holder`); one elsewhere is said
    (`port_neighbours`) and holds nothing (issue 53, B: `[::1]:8000` held serving while vLLM served).

    A `::` row of another uid beside root's IPv4 listener in the way is not counted: the kernel refuses a
    dual-stack `::` bind beside any IPv4 listener on the port (SO_REUSEPORT lets only one uid share it), so that
    socket is IPV6_V6ONLY and takes neither. Without root's, a `::` row counts: /proc does not say IPV6_V6ONLY."""
    takes = _takes_awk(host)
    program = (f'$4 == "0A" && $2 ~ /:{port:04X}$/ {{ a = substr($2, 1, index($2, ":") - 1); n++; at[n] = a; '
               f'uid[n] = $8; if (length(a) == 8 && $8 == 0 && {takes}) root4 = 1 }} '
               'END { for (i = 1; i <= n; i++) { a = at[i]; c = "-"; '
               f'if (({takes}) && !(a == "{WILDCARD6_HEX}" && uid[i] != 0 && root4)) c = "+"; '
               'print c, uid[i], a } }')
    return ["sec port_owner",
            f"rows=$(cat /proc/net/tcp /proc/net/tcp6 2>/dev/null | awk {quote_word(program)} | sort -u); "
            "owners=$(printf '%s\\n' \"$rows\" | awk '$1 == \"+\" {print $2}' | sort -un | tr '\\n' ' '); "
            "printf '%s\\n' \"$owners\" \"$rows\"; rc 0"]


@node_output("port_owner")
def parse_port_holder(sec: Section | None) -> int | None:
    """The first uid other than root in the way on the serving port (`port_owner_script`'s first line), or None."""
    if sec is None:
        return None
    others = [int(word) for word in sec.body.split("\n", 1)[0].split() if word != "0"]
    return others[0] if others else None


MAX_NEIGHBOURS = 8  # listeners elsewhere on the serving port named in `ServingApi.port_neighbours`


def parse_port_neighbours(sec: Section | None) -> list[str]:
    """The listeners on the serving port at another address (`port_owner_script`'s `-` rows), as `uid U on
    ADDRESS`, sorted, at most MAX_NEIGHBOURS. A row that does not read is left out: this is a warning, never a
    failed probe."""
    if sec is None:
        return []
    found = set()
    for line in sec.body.splitlines()[1:]:
        cols = line.split()
        if len(cols) != 3 or cols[0] != "-" or not (cols[1].isascii() and cols[1].isdigit()):
            continue
        try:
            found.add(f"uid {int(cols[1])} on {proc_address(cols[2])}")
        except ValueError:
            continue
    return sorted(found)[:MAX_NEIGHBOURS]


#: The node's listening ports, and where each is listened on; (None, None) when /proc/net/tcp could not be read.
LISTEN: Fact[tuple[list[int] | None, dict[int, list[str]] | None]] = Fact(
    "listen", tuple(listen_script()),
    lambda sections: (parse_listening(sections.get("listen")), parse_listen_addresses(sections.get("listen"))))
