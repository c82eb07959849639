"""The node-to-node hop over the fabric: how a source node reaches a target's sshd on its fabric address.

Bulk bytes (the serving image, and the weights with `policy.weights.transport: ssh`; by default the weights go to
a one-time rsync daemon instead, `reconciler.edge.steps.rsyncd`) go source -> target directly over the 200 Gb/s link,
never through the reconciler's own SSH connections: those run over the 10G management port (and the worker's through the
head), and every byte would cross the daemon's process twice. Strict host keys on this hop too: the target's
key, already verified by the reconciler, is written to a known_hosts file on the source under the target's
fabric address, with StrictHostKeyChecking=yes.
"""

from __future__ import annotations

import paramiko

from reconciler.edge.ssh import KEEPALIVE, KEEPALIVE_MISSES
from reconciler.edge.steps import StepContext, StepFailed

# One file per target: copies to several workers run in parallel and must not overwrite each other's key.
FABRIC_KNOWN_HOSTS = "~/.ssh/spark-reconciler_fabric_known_hosts_{node}"


def _host_key_line(ctx: StepContext, target: str) -> str:
    """The target's verified host key, re-keyed to its fabric address for the source node's ssh."""
    node = ctx.desired.node(target)
    keys = paramiko.HostKeys(node.ssh.known_hosts)
    name = node.ssh.host if node.ssh.port == 22 else f"[{node.ssh.host}]:{node.ssh.port}"
    entry = keys.lookup(name)
    if not entry:
        raise StepFailed(f"no host key for {name} in {node.ssh.known_hosts}")
    fabric = str(node.fabric.address.ip)
    fabric_name = fabric if node.ssh.port == 22 else f"[{fabric}]:{node.ssh.port}"
    return "".join(f"{fabric_name} {kind} {key.get_base64()}\n" for kind, key in entry.items())


def trust_target_on_source(ctx: StepContext, source: str, target: str) -> None:
    """Write the target's verified host key, under its fabric address, to its known_hosts file on the source."""
    ctx.sessions[source].run(["sh", "-c", 'umask 077 && mkdir -p "$HOME/.ssh" && cat > "$HOME/.ssh/$0"',
                              FABRIC_KNOWN_HOSTS.format(node=target).removeprefix("~/.ssh/")],
                             stdin=_host_key_line(ctx, target).encode(), timeout=ctx.command_timeout)


# Only what this hop says counts: no config file (`-F /dev/null`: neither the source's ~/.ssh/config, where a
# `Host` block could add a ProxyCommand, a LocalCommand or another host name, nor /etc/ssh/ssh_config, ignored
# once a file is given; ssh(1) -F), no host key beyond the verified one written for this target (the global
# known_hosts files, /etc/ssh/ssh_known_hosts[2], would accept any key listed there), and no identity beyond
# the default files: with no IdentityFile, ssh still offers ~/.ssh/id_rsa, id_ecdsa, id_ecdsa_sk, id_ed25519,
# id_ed25519_sk (readconf.c `fill_default_options`), which is the node key the README authorizes; IdentitiesOnly
# keeps an agent's other keys out (ssh_config(5): "either the default files, or those explicitly configured").
ISOLATION = ("-F", "/dev/null", "-o", "GlobalKnownHostsFile=/dev/null", "-o", "IdentitiesOnly=yes")


def ssh_options(ctx: StepContext, target: str) -> list[str]:
    """`ssh` and its options for the hop to `target` (no configuration but these, batch, strict keys, keepalive:
    a dead link ends it)."""
    t = ctx.desired.node(target)
    return ["ssh", *ISOLATION, "-p", str(t.ssh.port), "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=yes",
            "-o", f"UserKnownHostsFile={FABRIC_KNOWN_HOSTS.format(node=target)}",
            "-o", f"ConnectTimeout={int(t.ssh.connect_timeout)}", "-o", f"ServerAliveInterval={KEEPALIVE}",
            "-o", f"ServerAliveCountMax={KEEPALIVE_MISSES}", "-o", "Compression=no", "-c", "aes128-gcm@openssh.com"]


def address(ctx: StepContext, target: str) -> str:
    """`user@fabric-ip` of the target."""
    t = ctx.desired.node(target)
    return f"{t.ssh.user}@{t.fabric.address.ip}"
