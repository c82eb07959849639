"""The command line a node receives: the one place that quotes, bounds and elevates a remote command.

Every command is an argv of already-validated values, quoted here with `shlex.quote`, so a value reaches the node as
exactly one argument. Every command is bounded on the node by coreutils `timeout` (a command the head gave up on
does not live on there). Root is used only through `sudo -n` for the node's exact commands (`sudo_commands`), which
is what `reconciler sudoers FILE` prints; anything else is refused before it leaves the head.
"""

from __future__ import annotations

import shlex
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType

from reconciler.core.kinds import StepKind
from reconciler.core.spec import Desired, Node

#: What the node gets on top of a command's deadline to exit after `timeout` sent TERM, before KILL.
KILL_AFTER = 2
#: The exit codes of a command `timeout` ended: 124 (TERM), 137 (KILL after KILL_AFTER).
ENDED_BY_TIMEOUT = (124, 137)


def _link_commands(desired: Desired, node: Node) -> list[tuple[str, ...]]:
    """The link step's: each declared port (the first and its twin) up, at the file's MTU, with its address."""
    return [argv for p in node.fabric.ports()
            for argv in (("/usr/sbin/ip", "link", "set", "dev", p.interface, "up"),
                         ("/usr/sbin/ip", "link", "set", "dev", p.interface, "mtu", str(node.fabric.mtu)),
                         ("/usr/sbin/ip", "addr", "add", str(p.address), "dev", p.interface))]


def _start_commands(desired: Desired, node: Node) -> list[tuple[str, ...]]:
    """A serving start's: the page cache dropped before its memory preflight, with policy.drop_caches."""
    return [("/usr/sbin/sysctl", "-w", "vm.drop_caches=3")] if desired.policy.drop_caches else []


#: The step kinds that run commands as root, each with its exact argv on a node; every other kind runs none
#: (tests/unit/core/test_step_kinds.py: the kinds whose step cases send `sudo` are exactly these).
ROOT_COMMANDS: Mapping[StepKind, Callable[[Desired, Node], list[tuple[str, ...]]]] = MappingProxyType({
    "link": _link_commands,
    "start-serving": _start_commands,
})


def sudo_commands(desired: Desired, node: Node) -> list[tuple[str, ...]]:
    """Every command this node may be sent as root, exactly (argv, no patterns): the one source of both
    `reconciler sudoers FILE` and the check each `sudo` command passes before it leaves the head. A wildcard
    line (`ip link set dev *`) would let whoever holds the key take down the management port or route traffic."""
    return [argv for commands in ROOT_COMMANDS.values() for argv in commands(desired, node)]


def bounded(argv: Sequence[str], seconds: float) -> list[str]:
    """argv under coreutils `timeout` on the node: a command the head gave up on does not live on there (closing
    an SSH channel does not stop a process that never writes: a curl to a hung dockerd, a wedged `docker`).
    `timeout` runs it in its own process group and signals the whole group."""
    return ["timeout", "-k", str(KILL_AFTER), str(max(1, int(seconds + 0.999))), *argv]


def sudo_allowed(argv: Sequence[str], allowed: Sequence[tuple[str, ...]]) -> bool:
    """True when argv is exactly one of the node's allowed commands (sudo_commands)."""
    return tuple(str(a) for a in argv) in allowed


def quote(argv: Sequence[str]) -> str:
    """The one quoting function: argv -> a POSIX shell command line where each element stays one word."""
    return " ".join(shlex.quote(str(a)) for a in argv)


def quote_word(value: str) -> str:
    """One value as one shell word (a path, a pattern, a URL inside a script line): `quote` of a one-word argv."""
    return quote([value])


def sudoers_snippet(desired: Desired) -> str:
    """The exact sudoers lines each node needs, for this desired state: per interface and value, nothing wider."""
    out = ["# /etc/sudoers.d/spark-reconciler — install with: visudo -f /etc/sudoers.d/spark-reconciler",
           "# Exactly the commands spark-reconciler runs as root on each node (reconciler.edge.ssh.sudo_commands);",
           "# the reconciler refuses to send any other. Regenerate after changing a fabric section.", ""]
    for node in desired.nodes:
        out.append(f"# on {node.name}")
        out.append(sudoers_line(desired, node))
    return "\n".join(out) + "\n"


def sudoers_line(desired: Desired, node: Node) -> str:
    """The one sudoers line `node` needs (`sudoers_snippet` prints it; `doctor` names it as the fix)."""
    return f"{node.ssh.user} ALL=(root) NOPASSWD: " + ", ".join(" ".join(c) for c in sudo_commands(desired, node))


def sudo_argv(argv: Sequence[str], allowed: Sequence[tuple[str, ...]]) -> list[str]:
    """`sudo -n ARGV` for an allowed command; anything else raises before it is sent."""
    if not sudo_allowed(argv, allowed):
        raise PermissionError(f"refusing to run {shlex.join(argv)!r} with sudo: not one of the node's exact "
                              "commands (reconciler sudoers FILE)")
    return ["sudo", "-n", *argv]
