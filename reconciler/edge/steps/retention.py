"""Remove what retention planned (core/retention.py): older model trees and images this cluster copied to a node.

Removal is the one thing the reconciler does that cannot be undone, so each step checks again on the node, right
before it acts, what the plan was told: the item is still in the node's copy ledger as this cluster's, a tree is
still exactly what the copy left (`Weights.digest` of a fresh listing: a file a person added or changed since keeps
the whole tree), and an image goes through `docker image rm` without `--force`, which the engine itself refuses for
an image a container uses or one tagged more than once (moby: "conflict: unable to delete ... (must be forced)").
What is kept is reported, never forced; every removal is written to the ledger.
"""

from __future__ import annotations

from collections.abc import Callable

from reconciler.core.observed import CopyRecord
from reconciler.core.planning import Step
from reconciler.edge import ledger
from reconciler.edge.manifest import manifest_script, read_listing
from reconciler.edge.probes import read_sections
from reconciler.edge.steps import StepBlocked, StepContext, StepFailed


def _records(ctx: StepContext, node: str, kind: str) -> dict[str, CopyRecord]:
    """The ledger as it is now (not as the plan saw it): this cluster's records of `kind`."""
    section = read_sections(ctx.sessions[node], ledger.ledger_script(), ctx.command_timeout).get("copies")
    records = ledger.parse_copies(section, node) or []
    return {r.key: r for r in records if r.kind == kind and r.by in ctx.owner.names}


def _prune(ctx: StepContext, step: Step, kind: str, remove: Callable[[CopyRecord], str | None]) -> None:
    """Each item of the step that the ledger still names as this cluster's goes through `remove` (None: gone,
    written to the ledger; else why it is kept). Whatever is kept is said together at the end (StepBlocked):
    the rest is removed all the same."""
    node, kept = step.node, []
    records = _records(ctx, node, kind)
    for key in step.remove or ():
        record = records.get(key)
        why = "no longer in the copy ledger as this cluster's" if record is None else remove(record)
        if why is not None:
            kept.append(f"{key}: {why}")
        elif (unwritten := ledger.record(ctx.sessions[node], node, "removed", kind, key, ctx.owner.label,
                                         timeout=ctx.command_timeout)) is not None:
            raise StepFailed(f"{key} on {node} is removed, but the ledger could not say so ({unwritten})")
    if kept:
        raise StepBlocked(f"retention kept on {node}: " + "; ".join(kept))


def prune_weights(ctx: StepContext, step: Step) -> None:
    node = step.node

    def remove(record: CopyRecord) -> str | None:
        root = record.key
        if root in (ctx.desired.weights_root(node), ctx.desired.model.path_on(node)):
            return "the current model's"  # the file changed since the plan
        section = read_sections(ctx.sessions[node], [manifest_script(root)], ctx.command_timeout).get("weights")
        if section is not None and section.rc == 2:  # the script's word for "no such directory"
            return None
        tree = read_listing(root, section).weights
        if not tree.present or tree.truncated or tree.unsafe_count or tree.digest() != record.detail:
            return ("unreadable, or changed since this cluster copied it (files added, removed or resized, links "
                    "that leave it); remove it yourself if it is not needed")
        ctx.progress("retention.remove", {"node": node, "weights": root, "bytes": tree.total_bytes})
        # rm removes links, never what they lead to; --one-file-system stays off other mounts below the tree
        ctx.sessions[node].run(["rm", "-rf", "--one-file-system", "--", root], timeout=ctx.command_timeout)
        return None

    _prune(ctx, step, "weights", remove)


def prune_images(ctx: StepContext, step: Step) -> None:
    node = step.node

    def remove(record: CopyRecord) -> str | None:
        result = ctx.sessions[node].run(["docker", "image", "rm", record.detail], timeout=ctx.command_timeout,
                                        check=False)
        if not result.ok and "no such image" not in result.stderr.lower():
            return f"docker refused to remove {record.detail[:19]} ({result.stderr.strip()[-200:]})"
        ctx.progress("retention.remove", {"node": node, "image": record.detail})
        return None

    _prune(ctx, step, "image", remove)
