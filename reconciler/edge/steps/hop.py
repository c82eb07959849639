"""The node-to-node hop over the fabric: how a source node reaches a target's sshd on its fabric address.

Bulk bytes (the serving image, and the weights with `policy.weights.transport: ssh`; by default the weights go to
a one-time rsync daemon instead, `reconciler.edge.steps.rsyncd`) go source -> target directly over the 200 Gb/s link,
never through the reconciler's own SSH connections: those run over the 10G management port (and the worker's through the
head), and every byte would cross the daemon's process twice. Strict host keys on this hop too: the target's
key, already verified by the reconciler, is written to a known_hosts file on the source under the target's
fabric address, with StrictHostKeyChecking=yes.
"""

from __future__ import annotations

from reconciler.core.spec import Desired
from reconciler.edge.ssh import fabric_host_keys, hop_address, hop_options
from reconciler.edge.steps.actions import Actions, Run, StepFailed

# One file per target: copies to several workers run in parallel and must not overwrite each other's key.
FABRIC_KNOWN_HOSTS = "~/.ssh/spark-reconciler_fabric_known_hosts_{node}"


def _host_key_line(desired: Desired, target: str) -> str:
    """The target's verified host key, re-keyed to its fabric address for the source node's ssh. Read from the
    reconciler's own known_hosts (the file its sessions verify the target against), not from a node: the one
    local read a step makes, and a file the unit tests write."""
    lines = fabric_host_keys(desired, target)
    if lines is None:
        node = desired.node(target)
        name = node.ssh.host if node.ssh.port == 22 else f"[{node.ssh.host}]:{node.ssh.port}"
        raise StepFailed(f"no host key for {name} in {node.ssh.known_hosts}")
    return lines


def trust_target_on_source(desired: Desired, source: str, target: str) -> Actions:
    """Write the target's verified host key, under its fabric address, to its known_hosts file on the source."""
    yield Run(source, ("sh", "-c", 'umask 077 && mkdir -p "$HOME/.ssh" && cat > "$HOME/.ssh/$0"',
                       FABRIC_KNOWN_HOSTS.format(node=target).removeprefix("~/.ssh/")),
              stdin=_host_key_line(desired, target).encode())


def ssh_options(desired: Desired, target: str) -> list[str]:
    """`ssh` and its options for the hop to `target` (`ssh.hop_options`: no configuration but these, batch, strict
    keys against the target's own known_hosts file, keepalive: a dead link ends it)."""
    return hop_options(desired, target, FABRIC_KNOWN_HOSTS.format(node=target))


def address(desired: Desired, target: str) -> str:
    """`user@fabric-ip` of the target."""
    return hop_address(desired, target)
