"""Remove what retention planned (core/retention.py): older model trees and images this cluster copied to a node.

Removal is the one thing the reconciler does that cannot be undone, so each step checks again on the node, right
before it acts, what the plan was told: the item is still in the node's copy ledger as this cluster's, a tree is
still exactly what the copy left (`Weights.digest` of a fresh listing: a file a person added or changed since keeps
the whole tree), and an image goes through `docker image rm` without `--force`, which the engine itself refuses for
an image a container uses or one tagged more than once (moby: "conflict: unable to delete ... (must be forced)").
What is kept is reported, never forced; every removal is written to the ledger.
"""

from __future__ import annotations

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


def _removed(ctx: StepContext, node: str, kind: str, key: str) -> None:
    if (why := ledger.record(ctx.sessions[node], node, "removed", kind, key, ctx.owner.label,
                             timeout=ctx.command_timeout)) is not None:
        raise StepFailed(f"{key} on {node} is removed, but the ledger could not say so ({why})")


def prune_weights(ctx: StepContext, step: Step) -> None:
    node, kept = step.node, []
    records = _records(ctx, node, "weights")
    for root in step.remove or ():
        record = records.get(root)
        if record is None:
            kept.append(f"{root}: no longer in the copy ledger as this cluster's")
            continue
        if root in (ctx.desired.weights_root(node), ctx.desired.model.path_on(node)):
            kept.append(f"{root}: the current model's")  # the file changed since the plan
            continue
        section = read_sections(ctx.sessions[node], [manifest_script(root)], ctx.command_timeout).get("weights")
        if section is not None and section.rc == 2:  # the script's word for "no such directory"
            _removed(ctx, node, "weights", root)
            continue
        tree = read_listing(root, section).weights
        if not tree.present or tree.truncated or tree.unsafe_count or tree.digest() != record.detail:
            kept.append(f"{root}: unreadable, or changed since this cluster copied it (files added, removed or "
                        "resized, links that leave it); remove it yourself if it is not needed")
            continue
        ctx.progress("retention.remove", {"node": node, "weights": root, "bytes": tree.total_bytes})
        # rm removes links, never what they lead to; --one-file-system stays off other mounts below the tree
        ctx.sessions[node].run(["rm", "-rf", "--one-file-system", "--", root], timeout=ctx.command_timeout)
        _removed(ctx, node, "weights", root)
    if kept:
        raise StepBlocked(f"retention kept on {node}: " + "; ".join(kept))


def prune_images(ctx: StepContext, step: Step) -> None:
    node, kept = step.node, []
    records = _records(ctx, node, "image")
    for content in step.remove or ():
        record = records.get(content)
        if record is None:
            kept.append(f"{content[:19]}: no longer in the copy ledger as this cluster's")
            continue
        result = ctx.sessions[node].run(["docker", "image", "rm", record.detail], timeout=ctx.command_timeout,
                                        check=False)
        if result.ok or "no such image" in result.stderr.lower():
            ctx.progress("retention.remove", {"node": node, "image": record.detail})
            _removed(ctx, node, "image", content)
        else:
            kept.append(f"{record.detail[:19]}: docker refused ({result.stderr.strip()[-200:]})")
    if kept:
        raise StepBlocked(f"retention kept on {node}: " + "; ".join(kept))
