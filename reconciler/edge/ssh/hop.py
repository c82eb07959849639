"""The node-to-node hop's ssh: the options a source node's `ssh` gets to reach a target on its fabric address, and
the target's verified host key re-keyed to that address. The image copy (`edge/steps/hop.py`) and `doctor` (which
tries the hop read-only) build it here, so the hop doctor checks is the hop the copy runs."""

from __future__ import annotations

import paramiko

from reconciler.core.spec import Desired
from reconciler.edge.ssh.session import KEEPALIVE, KEEPALIVE_MISSES

# Only what this hop says counts: no config file (`-F /dev/null`: neither the source's ~/.ssh/config, where a
# `Host` block could add a ProxyCommand, a LocalCommand or another host name, nor /etc/ssh/ssh_config, ignored
# once a file is given; ssh(1) -F), no host key beyond the verified one written for this target (the global
# known_hosts files, /etc/ssh/ssh_known_hosts[2], would accept any key listed there), and no identity beyond
# the default files: with no IdentityFile, ssh still offers ~/.ssh/id_rsa, id_ecdsa, id_ecdsa_sk, id_ed25519,
# id_ed25519_sk (readconf.c `fill_default_options`), which is the node key the README authorizes; IdentitiesOnly
# keeps an agent's other keys out (ssh_config(5): "either the default files, or those explicitly configured").
ISOLATION = ("-F", "/dev/null", "-o", "GlobalKnownHostsFile=/dev/null", "-o", "IdentitiesOnly=yes")


def hop_options(desired: Desired, target: str, known_hosts: str) -> list[str]:
    """`ssh` and its options for the hop to `target` (no configuration but these, batch, strict keys against
    `known_hosts` on the source, keepalive: a dead link ends it)."""
    t = desired.node(target)
    return ["ssh", *ISOLATION, "-p", str(t.ssh.port), "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=yes",
            "-o", f"UserKnownHostsFile={known_hosts}",
            "-o", f"ConnectTimeout={int(t.ssh.connect_timeout)}", "-o", f"ServerAliveInterval={KEEPALIVE}",
            "-o", f"ServerAliveCountMax={KEEPALIVE_MISSES}", "-o", "Compression=no", "-c", "aes128-gcm@openssh.com"]


def hop_address(desired: Desired, target: str) -> str:
    """`user@fabric-ip` of the target."""
    t = desired.node(target)
    return f"{t.ssh.user}@{t.fabric.address.ip}"


def fabric_host_keys(desired: Desired, target: str) -> str | None:
    """The target's verified host key lines (the reconciler's known_hosts), re-keyed to its fabric address for
    the source node's ssh; None when that known_hosts has no key for the target (or cannot be read)."""
    node = desired.node(target)
    try:
        keys = paramiko.HostKeys(node.ssh.known_hosts)
    except OSError:
        return None
    name = node.ssh.host if node.ssh.port == 22 else f"[{node.ssh.host}]:{node.ssh.port}"
    entry = keys.lookup(name)
    if not entry:
        return None
    fabric = str(node.fabric.address.ip)
    fabric_name = fabric if node.ssh.port == 22 else f"[{fabric}]:{node.ssh.port}"
    return "".join(f"{fabric_name} {kind} {key.get_base64()}\n" for kind, key in entry.items())
