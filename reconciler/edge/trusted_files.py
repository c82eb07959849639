"""The local files the reconciler trusts: only their owner (root or the reconciler's own user) may change them.

Whoever can write the desired-state file is root on every node (it says what runs there, trust section and all);
whoever can write an identity file or a known_hosts file can impersonate the reconciler or a node. So, as sshd's
StrictModes does for authorized_keys, each such file and every directory above it must be owned by root or by the
user the reconciler runs as, and writable by nobody else. A world-writable directory with the sticky bit that
root owns (/tmp) is accepted: nobody else can rename or remove the entries in it that are not theirs.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from pathlib import Path

from reconciler.core.spec import Desired

_OTHERS_WRITE = stat.S_IWGRP | stat.S_IWOTH


def trusted_paths(desired: Desired, desired_path: str | Path) -> list[Path]:
    """The desired-state file, and every node's identity file and known_hosts file (deduplicated, in order)."""
    out = [Path(desired_path)]
    for node in desired.nodes:
        out += [Path(node.ssh.known_hosts), *([Path(node.ssh.identity_file)] if node.ssh.identity_file else [])]
    return list(dict.fromkeys(p.absolute() for p in out))


def _problem(path: Path, st: os.stat_result, uid: int, what: str) -> str | None:
    if st.st_uid not in (0, uid):
        return f"{path}: {what} is owned by uid {st.st_uid}, not root or the reconciler's user (uid {uid})"
    if st.st_mode & _OTHERS_WRITE:
        sticky_root_dir = stat.S_ISDIR(st.st_mode) and st.st_mode & stat.S_ISVTX and st.st_uid == 0
        if not sticky_root_dir:
            return (f"{path}: {what} is writable by {'others' if st.st_mode & stat.S_IWOTH else 'its group'} "
                    f"(mode {stat.S_IMODE(st.st_mode):04o}); chmod go-w")
    return None


def problems(paths: list[Path], uid: int | None = None,
             lstat: Callable[[Path], os.stat_result] = os.stat) -> list[str]:
    """Why each path (or a directory above it) can be changed by someone other than root and `uid`. A missing
    file is not reported here: loading it says so."""
    uid = os.geteuid() if uid is None else uid
    out: list[str] = []
    for path in paths:
        try:
            st = lstat(path)
        except OSError:
            continue
        if (p := _problem(path, st, uid, "the file")) is not None:
            out.append(p)
        for parent in path.parents:
            try:
                pst = lstat(parent)
            except OSError:
                continue
            if (p := _problem(parent, pst, uid, f"a directory above {path.name}")) is not None:
                out.append(p)
                break
    return list(dict.fromkeys(out))
