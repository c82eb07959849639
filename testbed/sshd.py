"""One sshd per node, plus the ``spark`` user, its sudo rights and the client key / known_hosts.

Each sshd runs in the node's network namespace (``ip netns exec``, so ``/sys/class/net`` shows the node's own
links) and its own UTS namespace (hostname ``spark-NODE``), listens on every address of the node (management and fabric)
and sets ``DOCKER_HOST`` to the node's own dockerd (the head also ``HF_ENDPOINT`` and the `hf` CLI on its PATH:
`node_env`). The head's sshd allows TCP forwarding: it is the jump host for the workers, exactly as on the real
pair of Sparks.

The login shell is ``/bin/sh`` (dash) with no rc files and ``UsePAM no``: every ``ssh node cmd`` the reconciler
runs pays only for the key exchange, not for a login environment (docs/testbed.md has the measurement).
"""
from __future__ import annotations

import grp
import pwd
import subprocess
from pathlib import Path

from . import memory
from .layout import SSH_USER, SUDOERS, Layout, Node, state_dir
from .proc import TestbedError, alive, load_pids, record_pid, run, stop_recorded, wait_for

SUDO_RULES = ("/usr/sbin/ip link set dev *", "/usr/sbin/ip addr add *", "/usr/sbin/sysctl -w vm.drop_caches=3")
NODE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


HF_BIN = "/opt/spark-testbed/hf/bin"   # the pinned `hf` CLI (testbed/install-deps.sh); on the head's PATH only


def node_path(node: Node) -> str:
    """The PATH of the node's SSH sessions: its GPU stand-ins (testbed/gpu.py) first, as /usr/bin on a Spark; on the
    head (the node with internet) also the `hf` CLI, which a worker does not have."""
    from .gpu import bin_dir
    return f"{bin_dir(node)}:{NODE_PATH}" + (f":{HF_BIN}" if node.index == 0 else "")


def node_env(node: Node) -> dict[str, str]:
    """What the node's sshd sets in every session (SetEnv), and `exec` too. The head's "internet" is the Hub
    stand-in on its loopback (testbed/hub.py): HF_ENDPOINT points there, and the CLI's own calls elsewhere
    (telemetry, PyPI's update check: huggingface_hub constants.py HF_HUB_DISABLE_TELEMETRY,
    HF_HUB_DISABLE_UPDATE_CHECK) are off."""
    env = {"DOCKER_HOST": node.docker_host, "PATH": node_path(node)}
    if node.index == 0:
        from .hub import HF_ENDPOINT
        env.update({"HF_ENDPOINT": HF_ENDPOINT, "HF_HUB_DISABLE_TELEMETRY": "1", "HF_HUB_DISABLE_UPDATE_CHECK": "1"})
    return env


def identity_file() -> Path:
    return state_dir() / "id_ed25519"


def known_hosts_file() -> Path:
    return state_dir() / "known_hosts"


def ensure_user() -> None:
    """Create ``spark`` (kept after ``down``: harmless, and re-creating it on every ``up`` buys nothing)."""
    try:
        pwd.getpwnam(SSH_USER)
    except KeyError:
        run(["useradd", "--create-home", "--home-dir", f"/home/{SSH_USER}", "--shell", "/bin/sh",
             "--groups", "docker", SSH_USER])
    if SSH_USER not in grp.getgrnam("docker").gr_mem:
        run(["usermod", "-aG", "docker", SSH_USER])
    # '!' (locked) would make sshd refuse the key login with UsePAM=no; '*' = no password, not locked.
    run(["usermod", "-p", "*", SSH_USER])
    home = Path(f"/home/{SSH_USER}")
    for rc in (".bashrc", ".profile", ".bash_logout"):   # a clean start-up: nothing to source
        (home / rc).unlink(missing_ok=True)


def ensure_sudoers() -> None:
    text = (f"# spark-testbed: exactly the root commands the reconciler needs on a node\n"
            f"{SSH_USER} ALL=(root) NOPASSWD: " + ", ".join(SUDO_RULES) + "\n")
    if SUDOERS.exists() and SUDOERS.read_text() == text:
        return
    tmp = SUDOERS.with_name(".spark-testbed.tmp")
    tmp.write_text(text)
    tmp.chmod(0o440)
    try:
        run(["visudo", "-c", "-q", "-f", str(tmp)])
        tmp.replace(SUDOERS)
    finally:
        tmp.unlink(missing_ok=True)


def ensure_client_key() -> None:
    key = identity_file()
    if not key.exists():
        run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "spark-testbed", "-f", str(key)])
    key.with_suffix(".pub").chmod(0o644)


def node_key() -> Path:
    """The `spark` user's own key, authorized on every node: node-to-node SSH, as the NVIDIA playbooks set up
    between Sparks. The weight sync pushes from the source node to the target's fabric address with it."""
    return Path(f"/home/{SSH_USER}/.ssh/id_ed25519")


def ensure_node_key() -> None:
    key = node_key()
    if key.exists():
        return
    key.parent.mkdir(mode=0o700, exist_ok=True)
    run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "spark-node-to-node", "-f", str(key)])
    run(["chown", "-R", f"{SSH_USER}:{SSH_USER}", str(key.parent)])


def _host_key(node: Node) -> Path:
    key = node.state / "ssh_host_ed25519_key"
    if not key.exists():
        run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", f"spark-{node.name}", "-f", str(key)])
    return key


def write_config(node: Node) -> Path:
    key = _host_key(node)
    # All addresses of the node's namespace, like sshd on a real Spark: the management address(es) and the
    # fabric address (the node-to-node weight sync uses it), including one added after sshd started.
    listen = "ListenAddress 0.0.0.0:22\n"
    conf = node.state / "sshd_config"
    conf.write_text(f"""# spark-testbed sshd for node {node.name} (netns {node.netns})
{listen}HostKey {key}
PidFile {node.state / 'sshd.pid'}
AuthorizedKeysFile {identity_file().with_suffix('.pub')} {node_key().with_suffix('.pub')} .ssh/authorized_keys
AllowUsers {SSH_USER}
PermitRootLogin no
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
UseDNS no
AllowTcpForwarding yes
X11Forwarding no
PrintMotd no
PrintLastLog no
MaxStartups 100:30:200
MaxSessions 10
SetEnv {' '.join(f'{k}={v}' for k, v in node_env(node).items())}
Subsystem sftp internal-sftp
""")
    return conf


def write_known_hosts(lay: Layout) -> None:
    lines = []
    for n in lay.nodes:
        typ, b64 = (n.state / "ssh_host_ed25519_key.pub").read_text().split()[:2]
        # a worker also under its fabric addresses: the `seed-fabric` scenario reaches it there, as on Sparks
        names = [n.ssh_host] + ([n.fabric_ip, n.twin_addr.split("/")[0]] if n.index else [])
        lines += [f"{name} {typ} {b64}\n" for name in names]
    known_hosts_file().write_text("".join(lines))


def write_netns_etc(lay: Layout) -> None:
    """/etc/netns/sb-NODE/{hosts,resolv.conf}: ``ip netns exec`` bind-mounts them over /etc for the node.

    Each node resolves its own hostname and its peers' (``spark-NODE``) from a file, and has no DNS server:
    nothing in a node may send a packet outside the testbed, and a lookup must fail at once, not time out.
    """
    hosts = "127.0.0.1 localhost\n" + "".join(f"{n.ssh_host} spark-{n.name}\n" for n in lay.nodes)
    for n in lay.nodes:
        d = Path("/etc/netns") / n.netns
        d.mkdir(parents=True, exist_ok=True)
        (d / "hosts").write_text(hosts)
        (d / "resolv.conf").write_text("# spark-testbed: no DNS inside the testbed\n"
                                       "nameserver 127.0.0.1\noptions timeout:1 attempts:1\n")


def remove_netns_etc() -> None:
    base = Path("/etc/netns")
    if base.is_dir():
        for d in base.glob("sb-*"):
            for f in d.iterdir():
                f.unlink()
            d.rmdir()
        if not any(base.iterdir()):
            base.rmdir()


def _pid_name(node: Node) -> str:
    return f"{node.name}/sshd"


def pid(node: Node) -> int | None:
    """The node's sshd pid, while it runs (its mount namespace is the one every SSH session on the node sees)."""
    e = load_pids().get(_pid_name(node))
    return int(e["pid"]) if e and alive(e["pid"], e.get("starttime")) else None


def running(node: Node) -> bool:
    e = load_pids().get(_pid_name(node))
    return bool(e and alive(e["pid"], e.get("starttime")))


def start(node: Node, timeout: float = 20) -> None:
    if running(node):
        return
    Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)   # privilege-separation dir sshd insists on
    conf = write_config(node)
    pidfile = node.state / "sshd.pid"
    pidfile.unlink(missing_ok=True)
    log = node.state / "sshd.log"
    cmd = ["ip", "netns", "exec", node.netns, "unshare", "--uts", "--", "sh", "-c",
           f'hostname spark-{node.name} && exec /usr/sbin/sshd -D -e -f "$0"', str(conf)]
    with open(log, "ab") as f:
        p = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=f, stderr=subprocess.STDOUT,
                             start_new_session=True)
    # ip, unshare and sh all exec: the pid we started *is* sshd once the pidfile says so (= listening).
    def ready() -> bool:
        if p.poll() is not None:
            raise TestbedError(f"sshd on {node.name} exited {p.returncode}: {log.read_text()[-1500:]}")
        return pidfile.exists() and pidfile.read_text().strip() == str(p.pid)
    wait_for(ready, timeout=timeout, what=f"sshd on {node.name}")
    record_pid(_pid_name(node), p.pid)
    memory.attach_sshd(node, p.pid)


def stop(node: Node) -> None:
    stop_recorded(_pid_name(node))
    (node.state / "sshd.pid").unlink(missing_ok=True)
