"""The git revision this copy of the reconciler was built from, for `reconciler --version`.

Three cases, one answer each:

- run from a checkout (the editable install of `make venv`, or `python -m` in the tree): git is asked now, so the
  answer follows every commit and says `-dirty` when tracked files differ from it;
- installed from a wheel (or an sdist) built from a checkout: setup.py wrote the revision at build time into
  `reconciler/_revision_build.py`, which exists only in built packages, never in the tree;
- built from a tree without `.git` (an unpacked tarball): "unknown".
"""

from __future__ import annotations

import importlib
import subprocess
from pathlib import Path

UNKNOWN = "unknown"


def from_git(tree: Path) -> str | None:
    """`git rev-parse --short=7 HEAD` of `tree`, with `-dirty` when a tracked file differs; None when `tree` has no
    `.git` (a directory, or a file in a worktree) or git cannot answer."""
    if not (tree / ".git").exists():
        return None
    try:
        head = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short=7", "HEAD"], capture_output=True,
                              text=True, timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(tree), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    if not head:
        return None
    return f"{head}-dirty" if dirty else head


def revision() -> str:
    """The checkout's revision now, else the one recorded at build time, else "unknown"."""
    live = from_git(Path(__file__).resolve().parents[1])
    if live:
        return live
    try:
        return str(importlib.import_module("reconciler._revision_build").REVISION or UNKNOWN)
    except (ImportError, AttributeError):  # not built, or built without it
        return UNKNOWN
