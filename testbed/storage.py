"""Per-node model filesystems: /srv/spark-testbed/NODE/models, each a loop-mounted ext4 image.

A real filesystem per node makes "disk full" real (``fill-disk`` fills that filesystem, not the machine's) and
gives ``df`` on each node its own numbers. The images are sparse files under /var/lib/spark-testbed/NODE and
are made anew by every ``up`` (mkfs of a sparse file takes well under a second); ``down`` unmounts and deletes
them.

/srv/spark-testbed is bind-mounted onto itself and made *shared* before any sshd starts: each sshd runs in a
mount namespace of its own (``ip netns exec`` makes one, to show the node's /sys), and only a shared mount
propagates later mounts/unmounts into it.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

from .layout import DATA_ROOT, SRV_ROOT, SSH_USER, Node, state_dir
from .proc import TestbedError, ok, run


def mounts() -> list[str]:
    """Mount points (root namespace) under the testbed's directories, deepest first."""
    roots = (str(SRV_ROOT), str(state_dir()), str(DATA_ROOT))
    out = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        mp = line.split()[4].replace("\\040", " ")
        if any(mp == r or mp.startswith(r + "/") for r in roots):
            out.append(mp)
    return sorted(set(out), key=len, reverse=True)


def is_mount(p: Path) -> bool:
    return str(p) in mounts()


def setup_shared_root() -> None:
    SRV_ROOT.mkdir(parents=True, exist_ok=True)
    if not is_mount(SRV_ROOT):
        run(["mount", "--bind", str(SRV_ROOT), str(SRV_ROOT)])
    run(["mount", "--make-shared", str(SRV_ROOT)])


def setup_node(node: Node, size: int) -> None:
    """Create and mount the node's model filesystem (idempotent: an existing mount is kept)."""
    mp = node.model_root
    mp.mkdir(parents=True, exist_ok=True)
    if is_mount(mp):
        return
    node.data.mkdir(parents=True, exist_ok=True)
    img = node.data / "models.img"
    img.unlink(missing_ok=True)
    with open(img, "wb") as f:
        f.truncate(size)
    # -m 0: no root-reserved blocks, so fill-disk really reaches 100% for the spark user too
    run(["mkfs.ext4", "-q", "-F", "-m", "0", "-L", f"models-{node.name}"[:16],
         "-E", "lazy_itable_init=1,lazy_journal_init=1", str(img)])
    run(["mount", "-o", "loop,noatime", str(img), str(mp)])
    shutil.chown(mp, SSH_USER, SSH_USER)
    if (mp / "lost+found").exists():
        shutil.rmtree(mp / "lost+found", ignore_errors=True)


def wipe(node: Node) -> None:
    """Empty the node's model root (keeps the filesystem)."""
    for child in node.model_root.iterdir():
        if child.is_dir() and not child.is_symlink():
            shutil.rmtree(child)
        else:
            child.unlink()


def free_bytes(node: Node) -> int:
    st = os.statvfs(node.model_root)
    return st.f_bavail * st.f_frsize


def teardown() -> None:
    """Unmount everything under the testbed's directories (deepest first), then delete what ``up`` made."""
    for mp in mounts():
        if not ok(["umount", mp]):
            run(["umount", "-l", mp], check=False)
    left = mounts()
    if left:
        raise TestbedError(f"could not unmount: {left}")
    if SRV_ROOT.exists():
        shutil.rmtree(SRV_ROOT)
    if DATA_ROOT.exists():
        for img in DATA_ROOT.glob("*/models.img"):
            img.unlink()
