"""Unified memory per node: each node has its own memory budget, and its /proc/meminfo says so.

A GB10 has one pool of memory for the CPU and the GPU: what vLLM holds for weights and KV cache shows up as used
in MemAvailable, next to the co-tenants and everything else on that machine. On one machine running two nodes,
every node saw the host's /proc/meminfo and nothing the node ran counted against it. Now:

* **a memory cgroup per node** (`spark-testbed-NODE`, cgroup v1's memory controller) with the node's budget as its
  limit. dockerd's `--cgroup-parent` puts every container of the node below it, and the node's sshd (so every SSH
  session, so every probe) is moved into it: the cgroup's usage is what the node's processes and containers
  really hold, and the limit is real (a node that overshoots meets the OOM killer, as a GB10 does).
* **lxcfs** (Debian's package; it is what LXC and Kubernetes use for exactly this) serves a `proc/meminfo`
  computed from the cgroup of the process that reads it: MemTotal = the budget, MemAvailable = budget - usage
  (+ reclaimable cache). It is bind-mounted over /proc/meminfo in each sshd's mount namespace, so the
  reconciler's probe (`grep MemTotal /proc/meminfo` over SSH) reads the node's own numbers. A kept-current file
  was the alternative: it would lag, and a reader could see it half-written; lxcfs answers each read fresh.

* **a CPU-accounting cgroup per node** (`spark-testbed-ssh-NODE`, cgroup v1's cpuacct, where the controller
  exists) holding the node's sshd and the `exec` commands: what every SSH session on the node spent, both ends of a
  transfer included, read by `cpu_seconds` (bench/: CPU seconds per GB copied). Its name differs from the memory
  cgroup's on purpose: the containers dockerd puts below `spark-testbed-NODE` are not what a transfer costs.

Docker's cgroupfs driver puts a relative `--cgroup-parent` below dockerd's own cgroup, so the node cgroups live
below the memory cgroup of the process that started the testbed (in a sandbox that is not the root); the paths
are recorded in STATE/memory.json at `up`.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
from pathlib import Path

from .layout import Layout, Node, state_dir
from .proc import TestbedError, alive, load_pids, spawn, stop_recorded, wait_for
from .storage import is_mount

DEFAULT_NODE_MEMORY = 8 << 30
V1_MEMORY = Path("/sys/fs/cgroup/memory")
V1_CPUACCT = Path("/sys/fs/cgroup/cpuacct")
LXCFS_PID = "lxcfs"


def _record() -> Path:
    return state_dir() / "memory.json"


def _view_dir() -> Path:
    return state_dir() / "lxcfs"


def _own_cgroup(controller: str = "memory") -> str:
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if controller in controllers.split(","):
            return path
    raise TestbedError(f"per-node {controller} needs cgroup v1's {controller} controller (/proc/self/cgroup names "
                       "none)")


def cgroup_dir(node: Node, controller: str = "memory") -> Path | None:
    """The node's memory (or cpuacct) cgroup, or None when the testbed was brought up without it."""
    try:
        paths = json.loads(_record().read_text())
    except (OSError, ValueError):
        return None
    key = node.name if controller == "memory" else f"{controller}/{node.name}"
    return Path(paths[key]) if key in paths else None


def cpu_seconds(node: Node) -> float | None:
    """CPU seconds spent so far by the node's SSH sessions and `exec` commands (all of them, the exited included),
    or None without per-node CPU accounting."""
    d = cgroup_dir(node, "cpuacct")
    return int((d / "cpuacct.usage").read_text()) / 1e9 if d else None


def budget(node: Node) -> int | None:
    d = cgroup_dir(node)
    return int((d / "memory.limit_in_bytes").read_text()) if d else None


def setup(lay: Layout, node_memory: int) -> bool:
    """Create each node's cgroup with its budget, start the meminfo view, record the paths. True when the view
    is new: a running sshd's mount namespace still holds the old one, so it must be restarted to see it."""
    if not V1_MEMORY.is_dir():
        raise TestbedError(f"per-node memory needs cgroup v1's memory controller at {V1_MEMORY}")
    base = V1_MEMORY / _own_cgroup().lstrip("/")
    paths = {}
    for n in lay.nodes:
        d = base / f"spark-testbed-{n.name}"
        d.mkdir(exist_ok=True)
        set_budget(d, node_memory)
        paths[n.name] = str(d)
    if V1_CPUACCT.is_dir():
        cpu_base = V1_CPUACCT / _own_cgroup("cpuacct").lstrip("/")
        for n in lay.nodes:
            (cpu_base / f"spark-testbed-ssh-{n.name}").mkdir(exist_ok=True)
            paths[f"cpuacct/{n.name}"] = str(cpu_base / f"spark-testbed-ssh-{n.name}")
    _record().write_text(json.dumps(paths, indent=1))
    return _start_view()


def set_budget(d: Path, nbytes: int) -> None:
    try:
        (d / "memory.limit_in_bytes").write_text(str(nbytes))
    except OSError as e:  # EBUSY: the node already holds more than that
        raise TestbedError(f"cannot set {d.name}'s memory to {nbytes} bytes: {e.strerror} "
                           f"(it holds {(d / 'memory.usage_in_bytes').read_text().strip()} bytes)") from None


def _start_view() -> bool:
    e = load_pids().get(LXCFS_PID)
    view = _view_dir()
    if e and alive(e["pid"], e.get("starttime")) and (view / "proc" / "meminfo").exists():
        return False
    _unmount(view)  # a killed lxcfs leaves its mount behind, and every stat of it fails (ENOTCONN)
    view.mkdir(parents=True, exist_ok=True)
    spawn(LXCFS_PID, ["lxcfs", "--foreground", str(view)], log=state_dir() / "lxcfs.log")
    wait_for(lambda: (view / "proc" / "meminfo").exists(), timeout=20, what="lxcfs's proc/meminfo")
    return True


def join(node: Node, pid: int) -> None:
    """Move a process (and so everything it starts later) into the node's memory and CPU-accounting cgroups."""
    for controller in ("memory", "cpuacct"):
        d = cgroup_dir(node, controller)
        if d is not None:
            (d / "cgroup.procs").write_text(str(pid))


def attach_sshd(node: Node, pid: int) -> None:
    """The node's sshd into its cgroup, and the node's meminfo over /proc/meminfo in its mount namespace."""
    if cgroup_dir(node) is None:
        return
    join(node, pid)
    meminfo = _view_dir() / "proc" / "meminfo"
    res = subprocess.run(["nsenter", "-t", str(pid), "--mount", "--", "mount", "--bind", str(meminfo),
                          "/proc/meminfo"], capture_output=True, text=True, timeout=20, check=False)
    if res.returncode != 0:
        raise TestbedError(f"binding the node meminfo into {node.name}'s sshd failed: {res.stderr.strip()}")


def teardown(lay: Layout) -> None:
    """Stop lxcfs, unmount its view, remove the node cgroups (their processes are gone by now)."""
    stop_recorded(LXCFS_PID, timeout=10)
    _unmount(_view_dir())
    for d in [cgroup_dir(n, c) for n in lay.nodes for c in ("memory", "cpuacct")]:
        if d is None:
            continue
        for sub in sorted(d.glob("**/"), key=lambda p: len(str(p)), reverse=True):
            try:  # a cgroup stays busy for a moment after its last process exits
                wait_for(functools.partial(_rmdir, sub), timeout=5, what=f"removal of {sub}")
            except TestbedError:
                pass  # left for the next `up` to reuse; `leftovers` does not count cgroups
    _record().unlink(missing_ok=True)


def _unmount(view: Path) -> None:
    """Detach the view by the mount table, never by stat: the mount of a dead lxcfs answers ENOTCONN to that."""
    if is_mount(view):
        subprocess.run(["umount", "-l", str(view)], capture_output=True, timeout=20, check=False)


def _rmdir(path: Path) -> bool:
    try:
        os.rmdir(path)
    except FileNotFoundError:
        return True
    except OSError:
        return False
    return True


def start_device_memory(node: Node) -> None:
    """The node's "free device memory" answer (testbed/device_memory.py) on its loopback, once per `up` (kept
    when it still runs). Nothing without per-node memory."""
    import sys

    from .device_memory import DEVICE_MEMORY_PORT

    d = cgroup_dir(node)
    name = f"{node.name}/device-memory"
    e = load_pids().get(name)
    if d is None or (e and alive(e["pid"], e.get("starttime"))):
        return
    root = Path(__file__).resolve().parents[1]
    # nsenter --net, not `ip netns exec`: that one remounts /sys, and the node's cgroup is read from there
    spawn(name, ["nsenter", f"--net=/run/netns/{node.netns}", "--", sys.executable, "-m", "testbed.device_memory",
                 str(d), str(DEVICE_MEMORY_PORT)], log=state_dir() / f"device-memory-{node.name}.log",
          env={**os.environ, "PYTHONPATH": str(root)})
    url = f"http://127.0.0.1:{DEVICE_MEMORY_PORT}/"
    wait_for(lambda: subprocess.run(["ip", "netns", "exec", node.netns, "curl", "-sf", "-m", "2", url],
                                    capture_output=True, timeout=10, check=False).returncode == 0,
             timeout=20, what=f"{node.name}'s device memory answer")
