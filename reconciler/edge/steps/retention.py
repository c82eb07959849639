"""Remove what retention planned (core/retention.py): older model trees and images this cluster copied to a node.

Removal is the one thing the reconciler does that cannot be undone, so each step checks again on the node, right
before it acts, what the plan was told: the item is still in the node's copy ledger as this cluster's; a tree is
still exactly what the copy left (`Weights.digest` of a fresh listing: a file a person added or changed since keeps
the whole tree); no container mounts it now, and it neither holds nor lies in the current model, judged on the
node's canonical paths (`realpath`: a symlinked parent or a `/./` is the same directory); an image goes through
`docker image rm` without `--force`, which the engine itself refuses for an image a container uses or one tagged
more than once (moby: "conflict: unable to delete ... (must be forced)").

What is kept is *released*: a `released` line in the ledger, so retention never proposes it again, and a
`retention.kept` event saying why and what to do. The step itself succeeds: a tree a person changed must not hold
the next model's copy to this node, which waits for this step.
"""

from __future__ import annotations

from collections.abc import Callable

from reconciler.core.observed import Container, CopyRecord
from reconciler.core.planning import Step
from reconciler.core.retention import mounts_tree, overlaps
from reconciler.edge import ledger
from reconciler.edge.manifest import manifest_script, read_listing
from reconciler.edge.probes import containers_script, parse_containers, read_sections
from reconciler.edge.ssh import RemoteError
from reconciler.edge.steps import StepContext, StepFailed


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
        ctx.progress("retention.remove", {"node": node, "weights": root, "bytes": tree.total_bytes})
        # rm removes links, never what they lead to; --one-file-system stays off other mounts below the tree
        ctx.sessions[node].run(["rm", "-rf", "--one-file-system", "--", root], timeout=ctx.command_timeout)
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
