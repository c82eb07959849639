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
The step re-checks on the node (the tree is still what was copied, in every path's size and mtime,
`Weights.digest`) before it removes anything.

A ledger line is a claim, not a fact: it may name any absolute path. Only a tree where this file puts its models
is retention's (`out_of_reach`): strictly below the parent of the node's `model.path` (a hub's other models, the
plain model directories beside the current one), and never a path the file itself could not name as a model
(`mount_refusal`: the system, a key directory, `/home/USER` or what holds one). A line naming `/etc` or a home is not
ranked, not planned and not removed, however well its digest matches (issue 53, finding E).
"""

from __future__ import annotations

import posixpath
from dataclasses import dataclass

from reconciler.core.observed import LABEL_WEIGHTS, Container, CopyRecord, NodeObservation, Observed, whose
from reconciler.core.ownership import Owner
from reconciler.core.spec import Desired, mount_refusal


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


def overlaps(a: str, b: str) -> bool:
    """One of the two directories is the other or lies in it."""
    return _inside(a, b) or _inside(b, a)


def out_of_reach(desired: Desired, node: str, root: str) -> str | None:
    """Why the tree `root` (a ledger line's key) is not retention's to remove on `node`, or None: it is. The one
    judgement for the plan (`removals`) and the step that removes (edge/steps/retention.py)."""
    home, root = posixpath.dirname(posixpath.normpath(desired.model.path_on(node))), posixpath.normpath(root)
    if root == home or not _inside(root, home):
        return f"it is not below {home}, where this file's models are"
    if (refusal := mount_refusal(root)) is not None:
        return f"{refusal}: never a model tree of this file"
    return None


def mounts_tree(source: str, root: str, serves: str | None = None) -> bool:
    """A bind mount of `source` reaches the tree at `root`: it is the tree or lies in it, or it holds the tree (a
    whole hub) and the container does not name another tree as the one it serves (`serves`)."""
    if _inside(source, root):
        return True
    return _inside(root, source) and (not serves or overlaps(root, serves))


def _mounts(container: Container, root: str, ours: frozenset[str]) -> bool:
    """Whether `container` may use the tree. Its mounts not read: it may. The tree it names as the one it serves
    (LABEL_WEIGHTS) counts only on this cluster's own containers: a label on anyone else's is a claim, not a fact."""
    if container.mounts is None:
        return True
    own = whose(container.labels, ours) == "ours"  # one from before the instance label claims nothing here
    serves = container.labels.get(LABEL_WEIGHTS) if own else None
    return any(mounts_tree(source, root, serves) for source in container.mounts)


def _is_current_image(desired: Desired, obs: NodeObservation, record: CopyRecord, reference: str | None) -> bool:
    """The file's image as the node holds it (by content or by its id there), or the reference content the plan
    makes current."""
    local = obs.images.get(desired.serving.image)
    return record.key == reference or (local is not None and local.content == record.key) or \
        (local is not None and local.id == record.detail)


def _newest_first(records: list[CopyRecord]) -> list[CopyRecord]:
    return sorted(records, key=lambda r: (-r.used_at, -r.copied_at, r.key))


def removals(desired: Desired, observed: Observed, owner: Owner, reference: str | None) -> list[Removal]:
    """Per node, what retention removes now: this cluster's copies (the ledger's records under its id,
    `owner.label`: never under a former address, which DHCP may give another cluster's head) beyond the current
    ones and the `previous` newest others, minus what a container uses. A tree out of reach (`out_of_reach`) is
    not one of them: it neither takes a `previous` place nor is removed.
    `reference`: the image content the plan makes current (the image holder's)."""
    policy = desired.policy.retention
    if not policy.prune:
        return []
    out = []
    for node in desired.nodes:
        obs = observed.node(node.name)
        if obs.copies is None or not obs.usable:
            continue
        mine = _newest_first([r for r in obs.copies if r.by == owner.label])
        old_trees = _old_trees(desired, node.name, obs, mine, owner)
        old_images = _old_images(desired, obs, mine, reference)
        if old_trees or old_images:
            out.append(Removal(node.name, tuple(sorted(old_trees)), tuple(sorted(old_images))))
    return out


def _old_trees(desired: Desired, node: str, obs: NodeObservation, mine: list[CopyRecord], owner: Owner) -> list[str]:
    """The weight trees of our copies (newest first) past the `previous` newest others, that no container
    mounts: never the file's own tree, nor one that overlaps it or is out of reach."""
    current = desired.weights_root(node)
    trees = [r for r in mine if r.kind == "weights" and not overlaps(r.key, current)
             and out_of_reach(desired, node, r.key) is None]
    return [r.key for r in trees[desired.policy.retention.previous:]
            if not any(_mounts(c, r.key, owner.names) for c in obs.containers)]


def _old_images(desired: Desired, obs: NodeObservation, mine: list[CopyRecord], reference: str | None) -> list[str]:
    """The images of our copies (newest first) past the `previous` newest others that are not current, that no
    container was made from."""
    images = [r for r in mine if r.kind == "image" and not _is_current_image(desired, obs, r, reference)]
    made_from = {c.image_id for c in obs.containers if c.image_id}
    return [r.key for r in images[desired.policy.retention.previous:] if r.detail not in made_from]
