"""One containerd + dockerd per node, each in the node's network namespace.

Started with ``nsenter --net`` (not ``ip netns exec``, which remounts /sys and loses the cgroup mounts dockerd
needs). Every node has its own containerd (own root, state and socket: two dockerds never share containerd
state), its own dockerd socket/data root/exec root/pidfile, ``--iptables=false --bridge=none``: containers run
with ``--network host`` and so answer on the node's addresses.

Data roots live under /var/lib/spark-testbed/NODE and are KEPT across ``down``/``up``: images stay cached, which
makes a warm bring-up seconds instead of a rebuild. ``down`` still leaves no process, mount or socket behind.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

from . import gpu
from .layout import Node
from .proc import TestbedError, alive, load_pids, ok, run, spawn, stop_pid, stop_recorded, wait_for

DOCKER = shutil.which("docker", path="/usr/bin:/usr/sbin:/usr/local/bin") or "docker"


def docker(node: Node, *args: str, check: bool = True, timeout: float = 120,
           input: str | None = None) -> subprocess.CompletedProcess[str]:
    return run([DOCKER, "-H", node.docker_host, *args], check=check, timeout=timeout, input=input)


def _ctr_dir(node: Node) -> Path:
    return node.state / "containerd"


def _ctr_sock(node: Node) -> Path:
    return _ctr_dir(node) / "containerd.sock"


def _write_configs(node: Node) -> tuple[Path, Path]:
    node.data.mkdir(parents=True, exist_ok=True)
    ctr_conf = node.state / "containerd.toml"
    ctr_conf.write_text(f"""version = 2
root = "{node.data / 'containerd'}"
state = "{_ctr_dir(node)}"
disabled_plugins = ["io.containerd.grpc.v1.cri"]
[grpc]
  address = "{_ctr_sock(node)}"
[ttrpc]
  address = "{_ctr_sock(node)}.ttrpc"
""")
    daemon_json = node.state / "daemon.json"    # so /etc/docker/daemon.json (if any) is not read
    # The engine ID derives from this key; the default (/etc/docker/key.json) would give all nodes one ID.
    daemon_json.write_text(json.dumps({"deprecated-key-path": str(node.data / "key.json")}))
    return ctr_conf, daemon_json


def running(node: Node) -> bool:
    e = load_pids().get(f"{node.name}/dockerd")
    return bool(e and alive(e["pid"], e.get("starttime")))


def engine_id(node: Node) -> str | None:
    p = docker(node, "info", "--format", "{{.ID}}", check=False, timeout=10)
    return p.stdout.strip() if p.returncode == 0 and p.stdout.strip() else None


# Each node's engine gets its own IPC namespace and its own /dev/shm, as separate machines have. Without them a
# container run with `--ipc host` on the head and one on the worker shared the machine's /dev/shm: vLLM's
# in_the_same_node_as() (a shared-memory probe) then took the two ranks for one node and waited forever for a
# local shared-memory reader that was on the other "machine" (docs/testbed.md). unshare execs (no fork), so the
# recorded pid is containerd's; dockerd joins the same namespaces, and the shims containerd starts inherit them.
SHM_SIZE = "2g"
_OWN_SHM = ["unshare", "--mount", "--ipc", "--propagation", "slave", "--", "sh", "-c",
            f"mount -t tmpfs -o mode=1777,nosuid,nodev,size={SHM_SIZE} shm /dev/shm && exec \"$0\" \"$@\""]


def start(node: Node, timeout: float = 60) -> None:
    """Start containerd (if needed) then dockerd; return once ``docker info`` answers."""
    if running(node) and engine_id(node):
        return
    ctr_conf, daemon_json = _write_configs(node)
    netns = f"--net=/run/netns/{node.netns}"
    ctr = load_pids().get(f"{node.name}/containerd")
    if ctr and alive(ctr["pid"], ctr.get("starttime")):
        ctr_pid = ctr["pid"]
    else:
        _ctr_dir(node).mkdir(parents=True, exist_ok=True)
        ctr_pid = spawn(f"{node.name}/containerd", ["nsenter", netns, "--", *_OWN_SHM, "containerd", "--config",
                                                    str(ctr_conf)], log=node.state / "containerd.log")
        wait_for(lambda: _ctr_sock(node).is_socket(), timeout=timeout, what=f"containerd on {node.name}")
    (node.state / "dockerd.pid").unlink(missing_ok=True)
    ns = f"/proc/{ctr_pid}/ns"
    spawn(f"{node.name}/dockerd", ["nsenter", netns, f"--mount={ns}/mnt", f"--ipc={ns}/ipc", "--",
        "dockerd", "--config-file", str(daemon_json),
        "--host", node.docker_host, "--group", "docker",
        "--containerd", str(_ctr_sock(node)), "--containerd-namespace", "moby",
        "--data-root", str(node.data / "docker"), "--exec-root", str(node.state / "exec"),
        "--pidfile", str(node.state / "dockerd.pid"),
        "--iptables=false", "--ip6tables=false", "--ip-forward=false", "--ip-masq=false", "--bridge=none",
        "--userland-proxy=false", "--cgroup-parent", f"spark-testbed-{node.name}",
        "--storage-driver", "overlay2", "--log-level", "warn",
    ], log=node.state / "dockerd.log", env=_with_gpu_hook(node))

    def ready() -> str | None:
        if not running(node):
            raise TestbedError(f"dockerd on {node.name} died: "
                               f"{(node.state / 'dockerd.log').read_text()[-1500:]}")
        return engine_id(node)
    wait_for(ready, timeout=timeout, what=f"dockerd on {node.name}")


def _with_gpu_hook(node: Node) -> dict[str, str]:
    """dockerd's environment: the node's GPU stand-ins first on its PATH, where moby looks for
    nvidia-container-runtime-hook once, at start, to register its `nvidia` device driver (testbed/gpu.py)."""
    return {**os.environ, "PATH": f"{gpu.bin_dir(node)}:{os.environ.get('PATH', '/usr/sbin:/usr/bin:/sbin:/bin')}"}


def stop(node: Node, *, containerd: bool = False, timeout: float = 30) -> None:
    """Stop dockerd (it stops its containers); with *containerd*, also containerd and any shim left."""
    stop_recorded(f"{node.name}/dockerd", timeout=timeout)
    if containerd:
        stop_recorded(f"{node.name}/containerd", timeout=timeout)
        # shims outlive containerd by design; they left their pids in containerd's state dir
        for pidfile in _ctr_dir(node).glob("io.containerd.runtime.v2.task/*/*/shim.pid"):
            try:
                stop_pid(int(pidfile.read_text().strip()), timeout=5)
            except (ValueError, OSError):
                pass
        kill_cgroup(node)


def kill_cgroup(node: Node) -> None:
    """Kill whatever is still in the node's container cgroups (containers of a dockerd that was SIGKILLed)."""
    for tasks in Path("/sys/fs/cgroup/pids").glob(f"spark-testbed-{node.name}/*/cgroup.procs"):
        for line in tasks.read_text().split():
            stop_pid(int(line), timeout=5)
    for ctl in Path("/sys/fs/cgroup").iterdir():
        base = ctl / f"spark-testbed-{node.name}"
        if base.is_dir():
            for d in sorted(base.glob("**/"), key=lambda p: len(str(p)), reverse=True):
                try:
                    os.rmdir(d)
                except OSError:
                    pass


def image_id(node: Node, ref: str) -> str | None:
    p = docker(node, "image", "inspect", "--format", "{{.Id}}", ref, check=False, timeout=30)
    return p.stdout.strip() if p.returncode == 0 else None


def copy_image(src: Node, dst: Node, ref: str) -> None:
    """``docker save | docker load`` between two nodes' engines (skipped when already identical)."""
    want = image_id(src, ref)
    if want is None:
        raise TestbedError(f"image {ref} is not on {src.name}")
    if image_id(dst, ref) == want:
        return
    s = subprocess.Popen([DOCKER, "-H", src.docker_host, "save", ref], stdout=subprocess.PIPE)
    try:
        load = subprocess.run([DOCKER, "-H", dst.docker_host, "load", "-q"], stdin=s.stdout,
                              capture_output=True, text=True, timeout=600, check=False)
    finally:
        if s.stdout is not None:   # always: stdout=PIPE
            s.stdout.close()
        s.wait()
    if s.returncode != 0 or load.returncode != 0:
        raise TestbedError(f"docker save|load {ref} {src.name}->{dst.name} failed: {load.stderr.strip()}")


def containers(node: Node, all_: bool = True) -> list[dict[str, Any]]:
    p = docker(node, "ps", *(["-a"] if all_ else []), "--format", "{{json .}}")
    return [json.loads(line) for line in p.stdout.splitlines() if line.strip()]


def remove_all_containers(node: Node) -> None:
    ids = docker(node, "ps", "-aq").stdout.split()
    if ids:
        docker(node, "rm", "-f", "-v", *ids, timeout=120)


def reachable(node: Node) -> bool:
    return ok([DOCKER, "-H", node.docker_host, "version"], timeout=10)
