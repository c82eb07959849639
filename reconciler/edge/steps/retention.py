"""Remove what retention planned (core/retention.py): older model trees and images this cluster copied to a node.

Removal is the one thing the reconciler does that cannot be undone, so each step checks again on the node, right
before it acts, what the plan was told: the item is still in the node's copy ledger as this cluster's; a tree lies
where this file keeps its models (`core.retention.out_of_reach`: a ledger line naming `/etc` or a home is never
acted on); it is still exactly what the copy left (`Weights.digest` of a fresh listing, every path's size and
mtime: a file a person added, resized or rewrote in place since keeps the whole tree); no container mounts it
now, and it neither holds nor lies in the current model, judged on the node's canonical paths (`realpath`: a
symlinked parent or a `/./` is the same directory); an image goes through `docker image rm` without `--force`,
which the engine itself refuses for an image a container uses or one tagged more than once (moby: "conflict:
unable to delete ... (must be forced)").

Nothing is ever removed through a link, anywhere on the path: the removal runs in the tree's parent directory only
once the node has confirmed that no component of the parent's path is a link (`IN_UNLINKED_DIR`), and never when
the tree itself has become a link. A link on the way (a home's `models` pointing at the home itself, a parent
swapped since the copy) keeps the tree, released and said.

What is kept is *released*: a `released` line in the ledger, so retention never proposes it again, and a
`retention.kept` event saying why and what to do. The step itself succeeds: a tree a person changed must not hold
the next model's copy to this node, which waits for this step.
"""

from __future__ import annotations

import posixpath
from collections.abc import Callable, Generator
from typing import Any

from reconciler.core.observed import CopyRecord
from reconciler.core.planning import Step
from reconciler.core.retention import mounts_tree, out_of_reach, overlaps
from reconciler.edge import ledger
from reconciler.edge.facts.containers import CONTAINERS
from reconciler.edge.facts.disk import canonical_fact
from reconciler.edge.manifest import tree_fact
from reconciler.edge.ssh import RemoteError
from reconciler.edge.steps.actions import Action, Actions, Given, Report, Run, StepFailed, read

LINK_ON_THE_WAY = 3  # the exit status of IN_UNLINKED_DIR (and of _REMOVE_TREE) for a link on the path
# `sh -c` words that enter the directory "$1" (absolute, normalized) only when no component of that path is a link,
# else exit LINK_ON_THE_WAY (2: no such directory). `cd -P` resolves every link on the way and `pwd -P` prints where
# it arrived: the two agree only when nothing was followed. The working directory then *is* that directory,
# whatever is renamed or relinked above it afterwards, so a removal relative to it stays inside it. The one check of
# "no link on the way" for whatever deletes files on a node.
IN_UNLINKED_DIR = f'cd -P -- "$1" 2>/dev/null || exit 2; [ "$(pwd -P)" = "$1" ] || exit {LINK_ON_THE_WAY}'

# Remove the tree "$2" of the directory "$1": not when "$1" is reached through a link, not when "$2" is one.
_REMOVE_TREE = (f'{IN_UNLINKED_DIR}; if [ -L "$2" ]; then exit {LINK_ON_THE_WAY}; fi; [ -e "$2" ] || exit 0; '
                'exec rm -rf --one-file-system -- "$2"')

Outcome = Generator[Action, Any, str | None]  # a removal's actions; returns None (gone) or why the item is kept


def remove_tree_argv(root: str) -> tuple[str, ...]:
    """The command that removes the directory `root`, links inside it removed, never followed, and other mounts
    below it left alone (`rm --one-file-system`); it exits LINK_ON_THE_WAY, and removes nothing, when `root` or a
    directory above it is a link, 2 when the parent is gone (and the tree with it), 0 when removed or already gone."""
    parent, name = posixpath.split(posixpath.normpath(root))
    return ("sh", "-c", _REMOVE_TREE, "sh", parent, name)


def write_ledger(given: Given, node: str, *entries: ledger.Entry) -> Generator[Action, Any, str | None]:
    """Append `entries` to the node's copy ledger in one exec (`ledger.append`) as this cluster; None when written,
    else why not (the caller decides whether that stops it)."""
    try:
        argv, script = ledger.append(node, given.owner.label, list(entries))
    except ValueError as exc:
        return str(exc)
    try:
        result = yield Run(node, argv, stdin=script, check=False)
    except RemoteError as exc:
        return str(exc)
    return None if result.exit_code == 0 else f"exit {result.exit_code}: {result.stderr.strip()[-200:]}"


def _write(given: Given, node: str, action: str, kind: str, key: str) -> Actions:
    if (why := (yield from write_ledger(given, node, (action, kind, key, "-")))) is not None:
        raise StepFailed(f"{key} on {node}: the ledger could not say `{action}` ({why})")


def _prune(given: Given, step: Step, kind: str, remove: Callable[[CopyRecord], Outcome]) -> Actions:
    """Each item the ledger still names as this cluster's goes through `remove` (None: gone; else why it is kept,
    and it is released). An item no longer in the ledger is left alone: someone else decided since the plan."""
    node = step.node
    records = {r.key: r for r in (yield from read(node, ledger.copies_fact(node))) or []
               if r.kind == kind and r.by == given.owner.label}
    for key in step.remove or ():
        record = records.get(key)
        if record is None:
            continue
        why = yield from remove(record)
        if why is None:
            yield from _write(given, node, "removed", kind, key)
        else:
            yield Report("retention.kept", {"node": node, kind: key, "why": why})
            yield from _write(given, node, "released", kind, key)


def prune_weights(given: Given, step: Step) -> Actions:
    """The containers and the canonical paths are read once for the step, right before its removals."""
    node, roots = step.node, list(step.remove or ())
    containers = yield from read(node, CONTAINERS)
    sources = sorted({m for c in containers for m in c.mounts or []})
    unread = [c.name for c in containers if c.mounts is None]
    current = [given.desired.weights_root(node), given.desired.model.path_on(node)]
    canon = yield from read(node, canonical_fact([*roots, *current, *sources]))
    n = len(roots)
    where, now, mounted = dict(zip(roots, canon[:n], strict=True)), canon[n:n + 2], canon[n + 2:]

    def remove(record: CopyRecord) -> Outcome:
        root = record.key
        here = where[root]
        if (why := out_of_reach(given.desired, node, root)) is not None:  # as written: removed only where no
            return why  # link is on the way (IN_UNLINKED_DIR), so the path judged is the path removed
        if unread:
            return f"the mounts of {', '.join(unread)} could not be read"
        if any(overlaps(here, c) for c in now):
            return "it is, holds or lies in the current model's directory"
        if any(mounts_tree(src, here) for src in mounted):
            return "a container on the node mounts it"
        tree = yield from read(node, tree_fact(root))
        if tree is None:
            return None
        if not tree.present or tree.truncated or tree.unsafe_count or tree.digest() != record.detail:
            return ("unreadable, or changed since this cluster copied it (files added, removed, resized or "
                    "rewritten, links that leave it): released, remove it yourself if it is not needed")
        removed = yield Run(node, remove_tree_argv(root), check=False)
        if removed.exit_code == LINK_ON_THE_WAY:
            return ("it, or a directory above it, is a link now: never removed through a link; released, remove "
                    "it yourself by its real path if it is not needed")
        if removed.exit_code not in (0, 2):  # 2: the parent is gone, and the tree with it
            raise StepFailed(f"removing {root} on {node} failed (exit {removed.exit_code}): "
                             f"{removed.stderr.strip()[-200:]}")
        yield Report("retention.remove", {"node": node, "weights": root, "bytes": tree.total_bytes})
        return None

    yield from _prune(given, step, "weights", remove)


def prune_images(given: Given, step: Step) -> Actions:
    node = step.node

    def remove(record: CopyRecord) -> Outcome:
        try:
            result = yield Run(node, ("docker", "image", "rm", record.detail), check=False)
        except RemoteError as exc:
            raise StepFailed(f"`docker image rm` on {node}: {exc}") from None
        if not result.ok and "no such image" not in result.stderr.lower():
            return f"docker refused to remove {record.detail[:19]} ({result.stderr.strip()[-200:]}): released"
        yield Report("retention.remove", {"node": node, "image": record.detail})
        return None

    yield from _prune(given, step, "image", remove)
