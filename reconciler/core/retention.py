"""What a node keeps of what this cluster copied to it (`policy.retention`). Pure: no I/O, no clock.

A 1 TB Spark fills after a few model changes of ~119 GB (issue 29, finding 5). With `prune: true` each node keeps
the current model and image and the `previous` most recently used others (the ones a rollback needs), and the
plan removes the rest — but only what the node's copy ledger says this cluster copied there (`CopyRecord`), never
the weights source, never what a person or another tool put there. What any container on the node uses is kept
whatever its age:
- an image that a container (running or not) was made from: docker itself refuses to remove it, and so does the
  plan, so no step fails on it;
- a weights tree that a container bind-mounts: the mount is the tree or lies in it, or the container mounts a
  directory holding the tree (a whole hub) and does not name another tree as the one it serves (LABEL_WEIGHTS on
  this cluster's own containers). A container whose mounts were not read keeps every tree on its node.
The step re-checks on the node (the tree is still what was copied, byte for byte in size, `Weights.digest`) before
it removes anything.
"""

from __future__ import annotations

from dataclasses import dataclass

from reconciler.core.observed import LABEL_WEIGHTS, Container, CopyRecord, NodeObservation, Observed
from reconciler.core.spec import Desired


@dataclass(frozen=True)
class Removal:
    """What one node gives up: the weights trees (their roots) and the images (their content ids)."""

    node: str
    weights: tuple[str, ...] = ()
    images: tuple[str, ...] = ()


def _inside(path: str, root: str) -> bool:
    """`path` is `root` or lies below it (paths as the file and the ledger spell them: absolute, no `..`)."""
    path, root = path.rstrip("/") or "/", root.rstrip("/") or "/"
    return path == root or path.startswith(root if root == "/" else root + "/")


def _mounts_tree(container: Container, root: str) -> bool:
    if container.mounts is None:
        return True  # not read: keep everything rather than guess
    for source in container.mounts:
        if _inside(source, root):
            return True
        if _inside(root, source):  # a hub holding the tree: kept unless the container names another tree
            named = container.labels.get(LABEL_WEIGHTS)
            if not named or _inside(root, named) or _inside(named, root):
                return True
    return False


def _is_current_image(desired: Desired, obs: NodeObservation, record: CopyRecord, reference: str | None) -> bool:
    """The file's image as the node holds it (by content or by its id there), or the reference content the plan
    makes current."""
    local = obs.images.get(desired.serving.image)
    return record.key == reference or (local is not None and local.content == record.key) or \
        (local is not None and local.id == record.detail)


def _newest_first(records: list[CopyRecord]) -> list[CopyRecord]:
    return sorted(records, key=lambda r: (-r.used_at, -r.copied_at, r.key))


def removals(desired: Desired, observed: Observed, ours: frozenset[str], reference: str | None) -> list[Removal]:
    """Per node, what retention removes now: this cluster's copies (`ours`: the instance labels that are this
    cluster's) beyond the current ones and the `previous` newest others, minus what a container uses.
    `reference`: the image content the plan makes current (the image holder's)."""
    policy = desired.policy.retention
    if not policy.prune:
        return []
    out = []
    for node in desired.nodes:
        obs = observed.node(node.name)
        if obs.copies is None or not obs.reachable or obs.probe_error is not None or not obs.docker_reachable:
            continue
        mine = _newest_first([r for r in obs.copies if r.by in ours])
        current = desired.weights_root(node.name)
        trees = [r for r in mine if r.kind == "weights" and not _inside(r.key, current) and not _inside(current, r.key)]
        images = [r for r in mine if r.kind == "image" and not _is_current_image(desired, obs, r, reference)]
        made_from = {c.image_id for c in obs.containers if c.image_id}
        old_trees = [r.key for r in trees[policy.previous:] if not any(_mounts_tree(c, r.key) for c in obs.containers)]
        old_images = [r.key for r in images[policy.previous:] if r.detail not in made_from]
        if old_trees or old_images:
            out.append(Removal(node.name, tuple(sorted(old_trees)), tuple(sorted(old_images))))
    return out
