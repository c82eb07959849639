"""The page-cache bound of a weights copy (`reconciler/edge/steps/drop_behind_helper.py`), run here for real
against the kernel's page cache, read back with util-linux's `fincore` (mincore(2) of each file): what the copy
left cached leaves, what lies outside the tree stays, and nothing in the tree can stop it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from reconciler.edge.steps import drop_behind_helper

HELPER = str(Path(drop_behind_helper.__file__))
MIB = 1 << 20


def resident(path: Path) -> int:
    """Bytes of `path` in the page cache now."""
    out = subprocess.run(["fincore", "--bytes", "--noheadings", "--output", "RES", str(path)], check=True,
                         capture_output=True, text=True).stdout
    return int(out.split()[0])


def cached_file(path: Path, size: int = 8 * MIB) -> Path:
    """A file written, made durable and read back: all of it in the page cache, as a copy leaves it."""
    with path.open("wb") as f:
        f.write(os.urandom(size))
        f.flush()
        os.fsync(f.fileno())
    path.read_bytes()
    assert resident(path) == size, "the test's premise: the file is cached"
    return path


def start(root: Path, lifetime: int = 60) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, HELPER, str(root), str(lifetime)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None
    assert proc.stdout.readline() == b"ready\n"
    return proc


def test_the_tree_leaves_the_cache_and_what_its_links_point_to_stays(tmp_path):
    tree, outside = tmp_path / "tree", tmp_path / "outside"
    (tree / "blobs").mkdir(parents=True)
    outside.mkdir()
    shard = cached_file(tree / "blobs" / "shard")
    elsewhere = cached_file(outside / "token")
    (tree / "link").symlink_to(elsewhere)
    os.mkfifo(tree / "fifo")  # opened without O_NONBLOCK, it would hang the pass
    proc = start(tree)
    try:
        assert resident(shard) == 0, "the first pass, before `ready`, dropped the tree's file"
        assert resident(elsewhere) == 8 * MIB, "a link is never followed out of the tree"
        late = cached_file(tree / ".rsync-partial-shard")  # written while it runs, as rsync writes
    finally:
        out, err = proc.communicate(timeout=30)  # the lifeline closes: one last pass, then exit
    assert proc.returncode == 0, err
    assert out.startswith(b"passes "), out
    assert resident(late) == 0, "the last pass drops what the copy wrote last"
    assert resident(elsewhere) == 8 * MIB


def test_it_ends_at_its_lifetime_without_a_closed_lifeline(tmp_path):
    proc = start(tmp_path, lifetime=1)
    assert proc.stdout is not None
    assert proc.stdout.readline().startswith(b"passes "), "it ended by itself"
    assert proc.wait(timeout=30) == 0
    assert proc.stdin is not None
    proc.stdin.close()


def test_bad_arguments_are_refused_with_usage(tmp_path):
    done = subprocess.run([sys.executable, HELPER, str(tmp_path), "soon"], capture_output=True,
                          stdin=subprocess.DEVNULL, timeout=30, check=False)
    assert done.returncode == 2
    assert b"usage: ROOT LIFETIME" in done.stderr
