"""Fault injection: each fault changes what the node really shows (links, processes, files, disk).

Every function takes the layout and a node name and returns a short description of what it did. The CLI
``python -m testbed fault KIND --node NODE ...`` maps one-to-one onto :data:`FAULTS`. ``reset`` (or the matching
``*-up``/``*-start``/``*-restore``/``free-disk`` fault) undoes them.
"""
from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Callable
from pathlib import Path

from . import dockerd, gpu, net, scenarios, sshd, storage
from .layout import FABRIC_IFACE, MODELS, SERVED_MODEL, SSH_USER, SUDOERS, Layout
from .proc import TestbedError


def link_down(lay: Layout, node: str, dev: str = FABRIC_IFACE) -> str:
    net.set_link(lay.node(node), False, dev)
    return f"{node}: {dev} down"


def link_up(lay: Layout, node: str, dev: str = FABRIC_IFACE) -> str:
    net.set_link(lay.node(node), True, dev)
    return f"{node}: {dev} up"


def link_flap(lay: Layout, node: str, count: int = 3, interval: float = 0.5, dev: str = FABRIC_IFACE) -> str:
    net.flap(lay.node(node), count, interval, dev)
    return f"{node}: {dev} flapped {count}x every {interval}s"


def mtu(lay: Layout, node: str, value: int = 1500, dev: str = FABRIC_IFACE) -> str:
    net.set_mtu(lay.node(node), value, dev)
    return f"{node}: {dev} mtu {value}"


def kill_container(lay: Layout, node: str, name: str) -> str:
    """A crash: SIGKILL the container's main process (``docker kill`` would count as an operator's stop and
    disable the restart policy; a crash does not)."""
    pid = int(dockerd.docker(lay.node(node), "inspect", "--format", "{{.State.Pid}}", name).stdout.strip())
    if pid <= 0:
        raise TestbedError(f"{node}: container {name} is not running")
    os.kill(pid, signal.SIGKILL)
    return f"{node}: killed container {name} (pid {pid})"


def stop_container(lay: Layout, node: str, name: str) -> str:
    dockerd.docker(lay.node(node), "stop", "-t", "5", name)
    return f"{node}: stopped container {name}"


def rogue_container(lay: Layout, node: str, name: str = "rogue", port: int = 8099) -> str:
    """An unlisted container (the reconciler's ``unlisted: stop`` policy should stop it)."""
    n = lay.node(node)
    if dockerd.image_id(n, scenarios.COTENANT_IMAGE) is None:
        dockerd.copy_image(lay.head, n, scenarios.COTENANT_IMAGE)
    dockerd.docker(n, "run", "-d", "--name", name, "--network", "host", scenarios.COTENANT_IMAGE,
                   "cotenant", "--port", str(port), "--hold-mb", "8", "--label", name)
    return f"{node}: started rogue container {name} on :{port}"


def sshd_stop(lay: Layout, node: str) -> str:
    sshd.stop(lay.node(node))
    return f"{node}: sshd stopped"


def sshd_start(lay: Layout, node: str) -> str:
    sshd.start(lay.node(node))
    return f"{node}: sshd started"


def dockerd_stop(lay: Layout, node: str) -> str:
    dockerd.stop(lay.node(node))
    return f"{node}: dockerd stopped (its containers with it)"


def dockerd_start(lay: Layout, node: str) -> str:
    dockerd.start(lay.node(node))
    return f"{node}: dockerd started"


def mgmt_cut(lay: Layout, node: str) -> str:
    net.set_mgmt(lay.node(node), False)
    return f"{node}: management path cut"


def mgmt_restore(lay: Layout, node: str) -> str:
    net.set_mgmt(lay.node(node), True)
    return f"{node}: management path restored"


def fill_disk(lay: Layout, node: str, leave: int = 0) -> str:
    """Fill the node's model filesystem, leaving about *leave* bytes; the file is root's, so spark cannot
    free it (like a disk filled by someone else)."""
    n = lay.node(node)
    f = n.model_root / scenarios.FILL_FILE
    f.unlink(missing_ok=True)
    want = storage.free_bytes(n) - leave
    fd = os.open(f, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        if want > 0:
            try:
                os.posix_fallocate(fd, 0, want)
            except OSError:   # the extent tree needs blocks too: allocate most, then write to the end
                os.posix_fallocate(fd, 0, max(want - (16 << 20), 0))
                os.lseek(fd, 0, os.SEEK_END)
                for bs in (1 << 20, 4096):
                    buf = bytes(bs)
                    while storage.free_bytes(n) > leave:
                        try:
                            os.write(fd, buf)
                        except OSError:
                            break
        os.fsync(fd)
    finally:
        os.close(fd)
    return f"{node}: model disk filled ({storage.free_bytes(n)} bytes left)"


def free_disk(lay: Layout, node: str) -> str:
    (lay.node(node).model_root / scenarios.FILL_FILE).unlink(missing_ok=True)
    return f"{node}: model disk freed"


def _shard(lay: Layout, node: str, model: str, layout: str, index: int) -> Path:
    from . import weights
    d = weights.model_dir(lay.node(node).model_root, model, MODELS[model], layout)
    shards = sorted(d.glob("*.safetensors"))
    if not shards:
        raise TestbedError(f"{node}: no shards of {model} ({layout}) under {d}")
    return shards[index % len(shards)].resolve()   # hf-cache: the blob behind the snapshot symlink


def corrupt_shard(lay: Layout, node: str, mode: str = "flip", model: str = SERVED_MODEL,
                  layout: str = "hf-cache", index: int = 0) -> str:
    """truncate: cut the shard in half (the stand-in refuses to load it); flip: invert one byte in the middle
    of the tensor data (header still valid: only a checksum notices); header: break the JSON header."""
    p = _shard(lay, node, model, layout, index)
    size = p.stat().st_size
    if mode == "truncate":
        os.truncate(p, size // 2)
    elif mode in ("flip", "header"):
        with open(p, "r+b") as f:
            hlen = int.from_bytes(f.read(8), "little")
            off = 8 + 2 if mode == "header" else 8 + hlen + (size - 8 - hlen) // 2
            f.seek(off)
            b = f.read(1)
            f.seek(off)
            f.write(bytes([b[0] ^ 0xFF]))
    else:
        raise ValueError("mode must be truncate, flip or header")
    return f"{node}: {mode} {p}"


def delete_shard(lay: Layout, node: str, model: str = SERVED_MODEL, layout: str = "hf-cache",
                 index: int = 0) -> str:
    p = _shard(lay, node, model, layout, index)
    p.unlink()
    return f"{node}: deleted {p}"


def crash_serving(lay: Layout, node: str, clear: bool = False) -> str:
    """The serving stand-in exits at start-up while a `.standin-crash` marker is visible from its model dir:
    the marker goes into every directory a desired state may mount (MODELROOT, MODELROOT/hub, each plain model)."""
    root = lay.node(node).model_root
    dirs = [root, root / "hub", *sorted(p for p in (root / "plain").glob("*") if p.is_dir())]
    markers = [d / scenarios.CRASH_MARKER for d in dirs if d.is_dir()]
    for marker in markers:
        if clear:
            marker.unlink(missing_ok=True)
        else:
            marker.touch()
    if clear:
        return f"{node}: serving crash markers removed"
    return f"{node}: serving will crash at start ({', '.join(map(str, markers))})"


#: What a broken (or hostile) node answers for /proc/meminfo: a value that is not a number, an escape sequence and
#: a byte that is not UTF-8 (the probe reads this file over SSH like any other).
HOSTILE_MEMINFO = b"MemTotal:       8388608 kB\nMemAvailable:   lots kB\n\x1b[31m\xff\tOdd:\n"


def _sshd_pid(lay: Layout, node: str) -> int:
    found = sshd.pid(lay.node(node))
    if found is None:
        raise TestbedError(f"{node}: sshd is not running")
    return found


def hostile_probe(lay: Layout, node: str) -> str:
    """The node's /proc/meminfo, as every SSH session on it reads it, becomes garbage: bound over it in the
    node's sshd mount namespace (on top of the node's own lxcfs view, which `probe-restore` uncovers again)."""
    n = lay.node(node)
    bad = n.state / "hostile-meminfo"
    bad.write_bytes(HOSTILE_MEMINFO)
    bad.chmod(0o444)
    pid = _sshd_pid(lay, node)
    if str(bad) in Path(f"/proc/{pid}/mountinfo").read_text():
        return f"{node}: /proc/meminfo is already hostile"
    subprocess.run(["nsenter", "-t", str(pid), "--mount", "--", "mount", "--bind", str(bad), "/proc/meminfo"],
                   check=True, capture_output=True, timeout=20)
    return f"{node}: /proc/meminfo now answers garbage to the probe"


def probe_restore(lay: Layout, node: str) -> str:
    n = lay.node(node)
    bad = n.state / "hostile-meminfo"
    try:
        pid = _sshd_pid(lay, node)
    except TestbedError:
        return f"{node}: sshd not running, nothing to restore"
    while str(bad) in Path(f"/proc/{pid}/mountinfo").read_text():
        subprocess.run(["nsenter", "-t", str(pid), "--mount", "--", "umount", "/proc/meminfo"], check=True,
                       capture_output=True, timeout=20)
    _restore_session_faults(lay, node)
    return f"{node}: /proc/meminfo is the node's own again"


def _restore_session_faults(lay: Layout, node: str) -> None:
    """Undo the faults doctor's tests put in the node's SSH sessions (`hide-binary`, `sudo-rule`, `docker-group`,
    `clock-skew`), so `reset` leaves none behind whatever a test did."""
    for hidden in lay.node(node).state.glob("hidden-*"):
        hide_binary(lay, node, hidden.name.removeprefix("hidden-"), clear=True)
    sudo_rule(lay, node, clear=True)
    docker_group(lay, node, clear=True)
    clock_skew(lay, node, clear=True)


def gpu_fault(lay: Layout, node: str, state: str = "mismatch", driver: str = gpu.DRIVER) -> str:
    """The node's GPU stack as after a driver update without a reboot (`mismatch`), with no driver loaded
    (`no-driver`), hung (`hung`), or back (`ok`; another `driver` makes the nodes' drivers differ)."""
    return gpu.set_state(lay.node(node), state, driver)


def _bind_in_sessions(lay: Layout, node: str, source: Path, target: str, clear: bool) -> bool:
    """Bind `source` over `target` in the node's sshd mount namespace (what every SSH session there sees; the
    machine's own file is untouched), or take every such bind off again (`clear`). False: nothing to do."""
    pid = _sshd_pid(lay, node)

    def bound() -> bool:  # by mount point (mountinfo's 5th field): the source's path there is its filesystem's
        return any(line.split(" ")[4] == target for line in Path(f"/proc/{pid}/mountinfo").read_text().splitlines())
    if clear:
        changed = False
        while bound():
            subprocess.run(["nsenter", "-t", str(pid), "--mount", "--", "umount", target], check=True,
                           capture_output=True, timeout=20)
            changed = True
        return changed
    if bound():
        return False
    subprocess.run(["nsenter", "-t", str(pid), "--mount", "--", "mount", "--bind", str(source), target],
                   check=True, capture_output=True, timeout=20)
    return True


def hide_binary(lay: Layout, node: str, name: str = "rsync", clear: bool = False) -> str:
    """The binary `name` is not installed, as the node's SSH sessions see it: an empty, non-executable file bound
    over it (`command -v` skips it); `--clear` puts it back. The machine's own file is untouched."""
    import shutil
    path = shutil.which(name, path=sshd.NODE_PATH)
    if path is None:
        raise TestbedError(f"{name} is not installed on this machine")
    empty = lay.node(node).state / f"hidden-{name}"
    empty.write_bytes(b"")
    empty.chmod(0o644)
    changed = _bind_in_sessions(lay, node, empty, path, clear)
    return f"{node}: {name} {'back' if clear else 'hidden'} ({path}){'' if changed else ', already'}"


#: What a node's sudoers holds after `sudo-rule`: only the drop_caches rule, none of the link step's.
NARROW_SUDOERS = f"{SSH_USER} ALL=(root) NOPASSWD: /usr/sbin/sysctl -w vm.drop_caches=3\n"


def sudo_rule(lay: Layout, node: str, clear: bool = False) -> str:
    """The node's sudoers loses the link step's rules (`ip link set`, `ip addr add`): a narrower file bound over
    the testbed's in the node's SSH sessions; `--clear` gives them back."""
    narrow = lay.node(node).state / "sudoers-narrow"
    narrow.write_text(NARROW_SUDOERS)
    os.chown(narrow, 0, 0)
    narrow.chmod(0o440)
    changed = _bind_in_sessions(lay, node, narrow, str(SUDOERS), clear)
    return f"{node}: sudo rules for ip {'back' if clear else 'removed'}{'' if changed else ' already'}"


def docker_group(lay: Layout, node: str, clear: bool = False) -> str:
    """`spark` out of the `docker` group in the node's SSH sessions (a new login reads /etc/group there); the
    engine's socket is root:docker 0660, so docker then answers `permission denied`. `--clear` puts it back."""
    import grp
    group = grp.getgrnam("docker")
    lines = []
    for line in Path("/etc/group").read_text().splitlines():
        name, _, rest = line.partition(":")
        if name == "docker":
            members = ",".join(m for m in group.gr_mem if m != SSH_USER)
            line = f"docker:x:{group.gr_gid}:{members}"
        lines.append(line)
    narrow = lay.node(node).state / "group-without-docker"
    narrow.write_text("\n".join(lines) + "\n")
    narrow.chmod(0o644)
    changed = _bind_in_sessions(lay, node, narrow, "/etc/group", clear)
    return f"{node}: {SSH_USER} {'back in' if clear else 'out of'} the docker group{'' if changed else ' already'}"


def clock_skew(lay: Layout, node: str, value: int = 90, clear: bool = False) -> str:
    """The node's `date`, as its SSH sessions find it on the PATH, answers `value` seconds off: a shadow first on
    the PATH (the GPU stand-ins' directory), not the kernel's clock, which all nodes share. `--clear` removes it."""
    shadow = gpu.bin_dir(lay.node(node)) / "date"
    if clear:
        shadow.unlink(missing_ok=True)
        return f"{node}: date is the machine's again"
    real = "/usr/bin/date" if Path("/usr/bin/date").exists() else "/bin/date"
    shadow.write_text(f'#!/bin/sh\n# testbed clock-skew: {value:+d} s\n'
                      f'exec {real} -d "@$(( $({real} +%s) + ({value}) ))" "$@"\n')
    shadow.chmod(0o755)
    return f"{node}: date answers {value:+d} s off"


FAULTS: dict[str, Callable[..., str]] = {
    "link-down": link_down, "link-up": link_up, "link-flap": link_flap, "mtu": mtu,
    "kill-container": kill_container, "stop-container": stop_container, "rogue-container": rogue_container,
    "sshd-stop": sshd_stop, "sshd-start": sshd_start, "dockerd-stop": dockerd_stop,
    "dockerd-start": dockerd_start, "mgmt-cut": mgmt_cut, "mgmt-restore": mgmt_restore,
    "fill-disk": fill_disk, "free-disk": free_disk, "corrupt-shard": corrupt_shard,
    "delete-shard": delete_shard, "crash-serving": crash_serving, "hostile-probe": hostile_probe,
    "probe-restore": probe_restore, "gpu": gpu_fault, "hide-binary": hide_binary, "sudo-rule": sudo_rule,
    "docker-group": docker_group, "clock-skew": clock_skew,
}
