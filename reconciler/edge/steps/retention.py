"""Remove what retention planned (core/retention.py): older model trees and images this cluster copied to a node.

Removal is the one thing the reconciler does that cannot be undone, so each step checks again on the node, right
before it acts, what the plan was told: the item is still in the node's copy ledger as this cluster's; a tree is
still exactly what the copy left (`Weights.digest` of a fresh listing: a file a person added or changed since keeps
the whole tree); no container mounts it now, and it neither holds nor lies in the current model, judged on the
node's canonical paths (`realpath`: a symlinked parent or a `/./` is the same directory); an image goes through
`docker image rm` without `--force`, which the engine itself refuses for an image a container uses or one tagged
more than once (moby: "conflict: unable to delete ... (must be forced)").

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
from collections.abc import Callable

from reconciler.core.observed import Container, CopyRecord
from reconciler.core.planning import Step
from reconciler.core.retention import mounts_tree, overlaps
from reconciler.edge import ledger
from reconciler.edge.manifest import manifest_script, read_listing
from reconciler.edge.probes import containers_script, parse_containers, read_sections
from reconciler.edge.ssh import RemoteError
from reconciler.edge.steps import StepContext, StepFailed

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


def remove_tree(ctx: StepContext, node: str, root: str) -> bool:
    """Remove the directory `root` on `node`, links inside it removed, never followed, and other mounts below it
    left alone (`rm --one-file-system`); False, and nothing removed, when `root` or a directory above it is a
    link. A root already gone counts as removed."""
    parent, name = posixpath.split(posixpath.normpath(root))
    result = ctx.sessions[node].run(["sh", "-c", _REMOVE_TREE, "sh", parent, name], timeout=ctx.command_timeout,
                                    check=False)
    if result.exit_code == LINK_ON_THE_WAY:
        return False
    if result.exit_code not in (0, 2):  # 2: the parent is gone, and the tree with it
        raise StepFailed(f"removing {root} on {node} failed (exit {result.exit_code}): "
                         f"{result.stderr.strip()[-200:]}")
    return True


def _records(ctx: StepContext, node: str, kind: str) -> dict[str, CopyRecord]:
    """The ledger as it is now (not as the plan saw it): the records of `kind` this cluster wrote under its id."""
    section = read_sections(ctx.sessions[node], ledger.ledger_script(), ctx.command_timeout).get("copies")
    records = ledger.parse_copies(section, node) or []
    return {r.key: r for r in records if r.kind == kind and r.by == ctx.owner.label}


def _write(ctx: StepContext, node: str, action: str, kind: str, key: str) -> None:
    if (why := ledger.record(ctx.sessions[node], node, ctx.owner.label, [(action, kind, key, "-")],
                             timeout=ctx.command_timeout)) is not None:
        raise StepFailed(f"{key} on {node}: the ledger could not say `{action}` ({why})")


def _prune(ctx: StepContext, step: Step, kind: str, remove: Callable[[CopyRecord], str | None]) -> None:
    """Each item the ledger still names as this cluster's goes through `remove` (None: gone; else why it is kept,
    and it is released). An item no longer in the ledger is left alone: someone else decided since the plan."""
    node = step.node
    records = _records(ctx, node, kind)
    for key in step.remove or ():
        record = records.get(key)
        if record is None:
            continue
        why = remove(record)
        if why is None:
            _write(ctx, node, "removed", kind, key)
        else:
            ctx.progress("retention.kept", {"node": node, kind: key, "why": why})
            _write(ctx, node, "released", kind, key)


def node_containers(ctx: StepContext, node: str) -> list[Container]:
    """Every container on the node now, with its bind mounts (a container started since the plan counts)."""
    ok, error, containers = parse_containers(read_sections(ctx.sessions[node], containers_script(),
                                                           ctx.command_timeout).get("containers"))
    if not ok:
        raise StepFailed(f"the containers on {node} could not be read: {error}")
    return containers


def _canonical(ctx: StepContext, node: str, paths: list[str]) -> list[str]:
    """The node's own answer to where each path leads (`realpath -m`: symlinks, `.` and `..` resolved; a path
    that does not exist yet resolves as far as it does)."""
    result = ctx.sessions[node].run(["realpath", "-m", "--", *paths], timeout=ctx.command_timeout)
    out = result.stdout.splitlines()
    if len(out) != len(paths):
        raise StepFailed(f"`realpath` on {node} answered {len(out)} lines for {len(paths)} paths")
    return out


def prune_weights(ctx: StepContext, step: Step) -> None:
    """The containers and the canonical paths are read once for the step, right before its removals."""
    node, roots = step.node, list(step.remove or ())
    containers = node_containers(ctx, node)
    sources = sorted({m for c in containers for m in c.mounts or []})
    unread = [c.name for c in containers if c.mounts is None]
    current = [ctx.desired.weights_root(node), ctx.desired.model.path_on(node)]
    canon = _canonical(ctx, node, [*roots, *current, *sources])
    n = len(roots)
    where, now, mounted = dict(zip(roots, canon[:n], strict=True)), canon[n:n + 2], canon[n + 2:]

    def remove(record: CopyRecord) -> str | None:
        root = record.key
        here = where[root]
        if unread:
            return f"the mounts of {', '.join(unread)} could not be read"
        if any(overlaps(here, c) for c in now):
            return "it is, holds or lies in the current model's directory"
        if any(mounts_tree(src, here) for src in mounted):
            return "a container on the node mounts it"
        section = read_sections(ctx.sessions[node], [manifest_script(root)], ctx.command_timeout).get("weights")
        if section is not None and section.rc == 2:  # the script's word for "no such directory"
            return None
        tree = read_listing(root, section).weights
        if not tree.present or tree.truncated or tree.unsafe_count or tree.digest() != record.detail:
            return ("unreadable, or changed since this cluster copied it (files added, removed or resized, links "
                    "that leave it): released, remove it yourself if it is not needed")
        if not remove_tree(ctx, node, root):
            return ("it, or a directory above it, is a link now: never removed through a link; released, remove "
                    "it yourself by its real path if it is not needed")
        ctx.progress("retention.remove", {"node": node, "weights": root, "bytes": tree.total_bytes})
        return None

    _prune(ctx, step, "weights", remove)


def prune_images(ctx: StepContext, step: Step) -> None:
    node = step.node

    def remove(record: CopyRecord) -> str | None:
        try:
            result = ctx.sessions[node].run(["docker", "image", "rm", record.detail], timeout=ctx.command_timeout,
                                            check=False)
        except RemoteError as exc:
            raise StepFailed(f"`docker image rm` on {node}: {exc}") from None
        if not result.ok and "no such image" not in result.stderr.lower():
            return f"docker refused to remove {record.detail[:19]} ({result.stderr.strip()[-200:]}): released"
        ctx.progress("retention.remove", {"node": node, "image": record.detail})
        return None

    _prune(ctx, step, "image", remove)
