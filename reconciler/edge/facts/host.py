"""The node itself: its machine name (`MACHINE`, which the serving image's platform must fit) and, on the head,
the cluster's id (`identity_fact`, made there once)."""

from __future__ import annotations

import re

from reconciler.core.observed import (
    MAX_KNOWN_AS,
    ClusterIdentity,
)
from reconciler.edge.facts.base import Fact, Section, node_output
from reconciler.edge.ssh import quote_word


def machine_script() -> list[str]:
    """The `machine` section: `uname -m`, which the serving image's platform must fit (`parse_machine`)."""
    return ["sec machine", "uname -m; rc $?"]


_MACHINE = re.compile(r"[A-Za-z0-9_.-]{1,32}")


@node_output("machine")
def parse_machine(sec: Section | None) -> str | None:
    """The node's machine name; None when uname did not answer. Anything but one plain word is odd output."""
    if sec is None or sec.rc != 0:
        return None
    word = sec.body.strip()
    if not _MACHINE.fullmatch(word):
        raise ValueError(f"not a machine name: {word[:40]!r}")
    return word


#: Bytes of the cluster-id file the probe prints: an id and MAX_KNOWN_AS names of at most 300 bytes fit; a file
#: that does not is odd output (the parser sees the cut).
IDENTITY_MAX_BYTES = 1 << 15


def identity_script(instance: str) -> list[str]:
    """The `identity` section, on the head only: the cluster's id in `~/.spark-reconciler/cluster-id`, made here
    when the file is absent or empty (`parse_identity`).

    This is the reconciler's own bookkeeping beside the lease (`edge.lease`, same 0700 directory, umask 077),
    never cluster state or user data: it changes nothing a container, a model or a co-tenant sees, so even
    `reconciler observe` may make it. It belongs to the head machine, not to an address, so every tool that
    reaches the head (the daemon, `reconciler apply` from a laptop, under any address the head answers on) finds
    the same id. Made once: the id (/proc/sys/kernel/random/uuid) and `instance`, the head's `host:port` its
    containers were labelled with until now (adopted as `known_as`), go to a temp file in the directory, which
    `ln` links to the name; `ln` fails when another probe made it first, and that one's file is what is printed.
    An empty file (no probe writes one) is removed first. `instance` comes from the spec (validated) and is
    quoted here."""
    return ["sec identity",
            f"(i={quote_word(instance)}; d=\"$HOME/.spark-reconciler\"; f=\"$d/cluster-id\"; umask 077; "
            "mkdir -p -- \"$d\" || exit 70; "
            "if [ ! -s \"$f\" ]; then "
            "[ -e \"$f\" ] && rm -f -- \"$f\"; "
            "u=$(cat /proc/sys/kernel/random/uuid) && [ -n \"$u\" ] || exit 71; "
            "t=\"$d/.cluster-id.$$\"; printf '%s\\n%s\\n' \"$u\" \"$i\" > \"$t\" || { rm -f -- \"$t\"; exit 72; }; "
            "ln -- \"$t\" \"$f\" 2>/dev/null; rm -f -- \"$t\"; fi; "
            f"head -c {IDENTITY_MAX_BYTES + 1} -- \"$f\") 2>&1; rc $?"]


@node_output("identity")
def parse_identity(sec: Section | None) -> ClusterIdentity | None:
    """The head's cluster id and former names (None: not asked, a node other than the head). A head that could
    not make or read the file, or a file that is not one id line then `host:port` lines, is odd output: the head's
    ProbeError, never a guess at whose its containers are. Blank lines (a hand edit) are skipped."""
    if sec is None:
        return None
    if sec.rc != 0:
        raise ValueError(f"~/.spark-reconciler/cluster-id could not be made or read on the head (exit {sec.rc}): "
                         f"{sec.body.strip()[-200:] or 'no output'}")
    if len(sec.body.encode()) > IDENTITY_MAX_BYTES:
        raise ValueError(f"~/.spark-reconciler/cluster-id is longer than {IDENTITY_MAX_BYTES} bytes")
    lines = [line.strip() for line in sec.body.splitlines() if line.strip()]
    if not lines:
        raise ValueError("~/.spark-reconciler/cluster-id is empty")
    if len(lines) > 1 + MAX_KNOWN_AS:
        raise ValueError(f"~/.spark-reconciler/cluster-id has {len(lines) - 1} former names, more than "
                         f"{MAX_KNOWN_AS}")
    return ClusterIdentity(id=lines[0], known_as=list(dict.fromkeys(lines[1:])))


#: The node's machine name (`uname -m`), None when uname did not answer.
MACHINE: Fact[str | None] = Fact("machine", tuple(machine_script()),
                                 lambda sections: parse_machine(sections.get("machine")))


def identity_fact(instance: str) -> Fact[ClusterIdentity | None]:
    """The head's cluster id and former names (`identity_script`, `parse_identity`), made on the first read."""
    return Fact("identity", tuple(identity_script(instance)),
                lambda sections: parse_identity(sections.get("identity")))
