"""prune-weights and prune-images: what retention planned, removed only after the node confirms it again.

The node is the recorded testbed's worker1 (tests/unit/fixtures/probe-4-nodes.json): its containers (the serving
container mounts the whole hub), its manifest listing of the current tree, renamed to an older model's tree the
ledger says this cluster copied.
"""

from __future__ import annotations

import hashlib
import json
import shlex
from typing import Any

from reconciler.core.observed import Weights
from reconciler.core.planning import Step
from reconciler.edge.facts.base import Section
from reconciler.edge.manifest import read_listing
from reconciler.edge.ssh import Result
from reconciler.edge.steps.retention import _REMOVE_TREE
from tests.unit.recorded import CLUSTER_ID, RAW, load, observe, sections_of
from tests.unit.step_cases import Case, Raw

W1 = "worker1"
HUB = "/srv/spark-testbed/worker1/models/hub"  # the current model's hub (its `path`), which no removal may touch
# where a former file put its model: a hub beside the current one (below the parent of the node's `model.path`,
# where retention may act: core.retention.out_of_reach)
OLD_HUB = "/srv/spark-testbed/worker1/models/old-hub"
CURRENT, OLD = f"{HUB}/models--testorg--tiny-moe", f"{OLD_HUB}/models--testorg--old-moe"
_RECORDED = sections_of(RAW["outputs"][W1])
#: the manifest of the older tree: the recorded listing of the current one, under the older one's name
LISTING = Raw(_RECORDED["weights"].body.replace(CURRENT, OLD))
DIGEST = read_listing(OLD, Section(LISTING.body, 0)).weights.digest()
IMAGE_CONTENT, IMAGE_ID = f"sha256:{1:064x}", f"sha256:{2:064x}"


def ledger(*lines: str) -> Raw:
    """The node's copy ledger (`ledger.ledger_script`'s section)."""
    return Raw("".join(line + "\n" for line in lines))


COPIED = f"copied\t{W1}\tweights\t{OLD}\t1796000000\t{CLUSTER_ID}\t{DIGEST}"
COPIED_IMAGE = f"copied\t{W1}\timage\t{IMAGE_CONTENT}\t1796000000\t{CLUSTER_ID}\t{IMAGE_ID}"


def containers(**mounts: Any) -> Raw:
    """worker1's recorded containers (the docker API's list: the serving container mounts the current hub and the
    compile caches, the co-tenant vllm_embeddings nothing), with a container's `Mounts` replaced."""
    listed = json.loads(_RECORDED["containers"].body[4:])
    for c in listed:
        if (name := c["Names"][0].lstrip("/")) in mounts:
            c["Mounts"] = mounts[name]
    return Raw("API " + json.dumps(listed))


NOW = containers()
SOURCES = ["/home/spark/.cache/flashinfer", "/home/spark/.cache/vllm", "/home/spark/.tilelang", "/home/spark/.triton",
           HUB]


def realpath(*lines: str) -> Raw:
    return Raw("\n".join(lines))


def weights(*remove: str) -> Step:
    return Step("prune-weights", W1, "retention", (), remove=remove)


def images(*remove: str) -> Step:
    return Step("prune-images", W1, "retention", (), remove=remove)


def _recorded(**kw: Any) -> dict[str, Any]:
    return {"desired": load, "observed": lambda: observe(load()), **kw}


READ = [f"read {W1} containers", f"read {W1} realpath", f"read {W1} copies"]
REMOVE = f"run {W1} sh -c {shlex.quote(_REMOVE_TREE)} sh {OLD_HUB} models--testorg--old-moe"
LEDGER_WRITE = f"run {W1} sh -s"
CANONICAL = realpath(OLD, CURRENT, HUB, *SOURCES)

CASES = [
    Case("prune-weights: an older tree this cluster copied, unchanged and unmounted: removed, then `removed`",
         weights(OLD), [*READ, f"read {W1} tree {OLD}", REMOVE, "report retention.remove", LEDGER_WRITE],
         facts={f"{W1} containers": [NOW], f"{W1} realpath": [CANONICAL], f"{W1} copies": [ledger(COPIED)],
                f"{W1} tree {OLD}": [LISTING]}, **_recorded()),
    Case("prune-weights: a tree the ledger does not name is never touched", weights(OLD), READ,
         facts={f"{W1} containers": [NOW], f"{W1} realpath": [CANONICAL], f"{W1} copies": [ledger()]},
         **_recorded()),
    Case("prune-weights: a tree another cluster copied is not ours to remove", weights(OLD), READ,
         facts={f"{W1} containers": [NOW], f"{W1} realpath": [CANONICAL],
                f"{W1} copies": [ledger(COPIED.replace(CLUSTER_ID, "10.9.9.9:22"))]}, **_recorded()),
    Case("prune-weights: removed or released since the plan: left alone", weights(OLD), READ,
         facts={f"{W1} containers": [NOW], f"{W1} realpath": [CANONICAL],
                f"{W1} copies": [ledger(COPIED, f"released\t{W1}\tweights\t{OLD}\t1796000100\t{CLUSTER_ID}\t-")]},
         **_recorded()),
    Case("prune-weights: a co-tenant that mounts the tree's hub keeps it: released and said", weights(OLD),
         [*READ, "report retention.kept", LEDGER_WRITE],
         facts={f"{W1} containers": [containers(vllm_embeddings=[{"Type": "bind", "Source": OLD_HUB,
                                                                  "Destination": "/models"}])],
                f"{W1} realpath": [realpath(OLD, CURRENT, HUB, *SOURCES, OLD_HUB)],
                f"{W1} copies": [ledger(COPIED)]}, **_recorded()),
    Case("prune-weights: a mount under another name (a link to the tree's hub) is the same directory",
         weights(OLD), [*READ, "report retention.kept", LEDGER_WRITE],
         facts={f"{W1} containers": [containers(vllm_embeddings=[{"Type": "bind", "Source": "/data/alias",
                                                                  "Destination": "/models"}])],
                f"{W1} realpath": [realpath(OLD, CURRENT, HUB, OLD_HUB, *SOURCES)],
                f"{W1} copies": [ledger(COPIED)]}, **_recorded()),
    Case("prune-weights: the current model's tree, reached through a link, is never removed",
         weights(f"{OLD_HUB}/models--testorg--tiny-moe"), [*READ, "report retention.kept", LEDGER_WRITE],
         facts={f"{W1} containers": [NOW], f"{W1} realpath": [realpath(CURRENT, CURRENT, HUB, *SOURCES)],
                f"{W1} copies": [ledger(COPIED.replace(OLD, f"{OLD_HUB}/models--testorg--tiny-moe"))]},
         **_recorded()),
    Case("prune-weights: a container whose mounts could not be read keeps every tree", weights(OLD),
         [*READ, "report retention.kept", LEDGER_WRITE],
         facts={f"{W1} containers": [containers(vllm_embeddings="?")],
                f"{W1} realpath": [CANONICAL], f"{W1} copies": [ledger(COPIED)]}, **_recorded()),
    Case("prune-weights: a tree changed since the copy is kept and released", weights(OLD),
         [*READ, f"read {W1} tree {OLD}", "report retention.kept", LEDGER_WRITE],
         facts={f"{W1} containers": [NOW], f"{W1} realpath": [CANONICAL],
                f"{W1} copies": [ledger(COPIED.replace(DIGEST, "0" * 64))], f"{W1} tree {OLD}": [LISTING]},
         **_recorded()),
    *[Case(f"prune-weights: a ledger line naming {planted} is never acted on: not listed, released (issue 53, E)",
           weights(planted), [*READ, "report retention.kept", LEDGER_WRITE],
           facts={f"{W1} containers": [NOW], f"{W1} realpath": [realpath(planted, CURRENT, HUB, *SOURCES)],
                  f"{W1} copies": [ledger(COPIED.replace(OLD, planted))], f"{W1} tree {planted}": [LISTING]},
           **_recorded())
      for planted in ("/etc", "/home/spark", "/srv/spark-testbed/worker1/old/hub/models--testorg--old-moe")],
    Case("prune-weights: a tree gone already counts as removed", weights(OLD),
         [*READ, f"read {W1} tree {OLD}", LEDGER_WRITE],
         facts={f"{W1} containers": [NOW], f"{W1} realpath": [CANONICAL], f"{W1} copies": [ledger(COPIED)],
                f"{W1} tree {OLD}": [Raw("", 2)]}, **_recorded()),
    Case("prune-weights: a link on the way: never removed through it, released", weights(OLD),
         [*READ, f"read {W1} tree {OLD}", REMOVE, "report retention.kept", LEDGER_WRITE],
         facts={f"{W1} containers": [NOW], f"{W1} realpath": [CANONICAL], f"{W1} copies": [ledger(COPIED)],
                f"{W1} tree {OLD}": [LISTING]}, results={REMOVE[4:]: [Result("", "", 3)]}, **_recorded()),
    Case("prune-weights: rm failing otherwise fails the step (nothing written)", weights(OLD),
         [*READ, f"read {W1} tree {OLD}", REMOVE],
         facts={f"{W1} containers": [NOW], f"{W1} realpath": [CANONICAL], f"{W1} copies": [ledger(COPIED)],
                f"{W1} tree {OLD}": [LISTING]},
         results={REMOVE[4:]: [Result("", "rm: cannot remove 'x': Read-only file system", 1)]},
         raises=r"removing .*old-moe on worker1 failed \(exit 1\): rm: cannot remove 'x': Read-only file system",
         **_recorded()),
    Case("prune-weights: a removal the ledger cannot record fails the step", weights(OLD),
         [*READ, f"read {W1} tree {OLD}", REMOVE, "report retention.remove", LEDGER_WRITE],
         facts={f"{W1} containers": [NOW], f"{W1} realpath": [CANONICAL], f"{W1} copies": [ledger(COPIED)],
                f"{W1} tree {OLD}": [LISTING]},
         results={LEDGER_WRITE[4:]: [Result("", "sh: cannot create: Permission denied", 1)]},
         raises=r"old-moe on worker1: the ledger could not say `removed` \(exit 1: sh: cannot create: Permission",
         **_recorded()),
    Case("prune-weights: the containers unreadable: nothing removed", weights(OLD), [f"read {W1} containers"],
         facts={f"{W1} containers": [Raw("Cannot connect to the Docker daemon at unix:///var/run/docker.sock", 1)]},
         raises="worker1: the containers could not be read: Cannot connect to the Docker daemon", **_recorded()),
    Case("prune-weights: realpath answering short: nothing removed", weights(OLD), READ[:2],
         facts={f"{W1} containers": [NOW], f"{W1} realpath": [realpath(OLD, CURRENT)]},
         raises="`realpath` answered 2 lines for 8 paths", **_recorded()),
    Case("prune-images: an image this cluster copied: `docker image rm` without --force, then `removed`",
         images(IMAGE_CONTENT), [f"read {W1} copies", f"run {W1} docker image rm {IMAGE_ID}",
                                 "report retention.remove", LEDGER_WRITE],
         facts={f"{W1} copies": [ledger(COPIED_IMAGE)]}, **_recorded()),
    Case("prune-images: an image the ledger does not name is never touched", images(IMAGE_CONTENT),
         [f"read {W1} copies"], facts={f"{W1} copies": [ledger(COPIED)]}, **_recorded()),
    Case("prune-images: docker refuses (a container uses it): released and said", images(IMAGE_CONTENT),
         [f"read {W1} copies", f"run {W1} docker image rm {IMAGE_ID}", "report retention.kept", LEDGER_WRITE],
         facts={f"{W1} copies": [ledger(COPIED_IMAGE)]},
         results={f"{W1} docker image rm {IMAGE_ID}": [Result(
             "", "Error response from daemon: conflict: unable to delete 000000000002 (must be forced) - image is "
                 "being used by stopped container 263676105be8", 1)]}, **_recorded()),
    Case("prune-images: gone already counts as removed", images(IMAGE_CONTENT),
         [f"read {W1} copies", f"run {W1} docker image rm {IMAGE_ID}", "report retention.remove", LEDGER_WRITE],
         facts={f"{W1} copies": [ledger(COPIED_IMAGE)]},
         results={f"{W1} docker image rm {IMAGE_ID}": [Result("", f"Error: No such image: {IMAGE_ID}", 1)]},
         **_recorded()),
]


# -- the survivors of issue 34's mutation run (docs/mutation-survivors-edge.md): a key the ledger no longer names
# before one it does, the current tree guarded with no container mounting it, rm's exit 2, the tree's listing
# partial or failed (parsed answers: the listing's own parser is test_manifest*'s), a long stderr.

GONE = f"{OLD_HUB}/models--testorg--gone-moe"  # planned, but released or removed since: not in the ledger
THROUGH_LINK = f"{OLD_HUB}/models--testorg--tiny-moe"  # the current model's tree, reached through a link
SIBLING = f"{HUB}/models--testorg--old-moe"  # an older tree inside the current model's hub (its `path`)
TREE = read_listing(OLD, Section(LISTING.body, 0)).weights
#: The listing when `find` failed (an unreadable directory): nothing listed, whose digest is the empty tree's.
UNLISTED = Weights(root=OLD, present=False)
EMPTY_DIGEST = hashlib.sha256(b"").hexdigest()

CASES += [
    Case("prune-weights: a key the ledger no longer names is skipped, the next one still removed", weights(GONE, OLD),
         [*READ, f"read {W1} tree {OLD}", REMOVE, "report retention.remove", LEDGER_WRITE],
         facts={f"{W1} containers": [NOW], f"{W1} realpath": [realpath(GONE, OLD, CURRENT, HUB, *SOURCES)],
                f"{W1} copies": [ledger(COPIED)], f"{W1} tree {OLD}": [LISTING]}, **_recorded()),
    Case("prune-weights: the current model's tree with no container mounting it: still never removed",
         weights(THROUGH_LINK), [*READ, "report retention.kept", LEDGER_WRITE],
         facts={f"{W1} containers": [containers(vllm_serving=[])], f"{W1} realpath": [realpath(CURRENT, CURRENT, HUB)],
                f"{W1} copies": [ledger(COPIED.replace(OLD, THROUGH_LINK))],
                f"{W1} tree {THROUGH_LINK}": [LISTING]}, **_recorded()),
    Case("prune-weights: a tree inside the current model's hub (not the model's own tree) is never removed",
         weights(SIBLING), [*READ, "report retention.kept", LEDGER_WRITE],
         facts={f"{W1} containers": [containers(vllm_serving=[])], f"{W1} realpath": [realpath(SIBLING, CURRENT, HUB)],
                f"{W1} copies": [ledger(COPIED.replace(OLD, SIBLING))]}, **_recorded()),
    Case("prune-weights: the parent gone (rm's exit 2) took the tree with it: removed", weights(OLD),
         [*READ, f"read {W1} tree {OLD}", REMOVE, "report retention.remove", LEDGER_WRITE],
         facts={f"{W1} containers": [NOW], f"{W1} realpath": [CANONICAL], f"{W1} copies": [ledger(COPIED)],
                f"{W1} tree {OLD}": [LISTING]}, results={REMOVE[4:]: [Result("", "", 2)]}, **_recorded()),
    Case("prune-weights: rm failing with a long stderr: only its last 200 characters", weights(OLD),
         [*READ, f"read {W1} tree {OLD}", REMOVE],
         facts={f"{W1} containers": [NOW], f"{W1} realpath": [CANONICAL], f"{W1} copies": [ledger(COPIED)],
                f"{W1} tree {OLD}": [LISTING]}, results={REMOVE[4:]: [Result("", "x" + "y" * 200, 1)]},
         raises=r"failed \(exit 1\): y{200}$", **_recorded()),
    Case("prune-weights: a listing cut short (truncated) is not the tree the copy left: kept, though its digest "
         "matches", weights(OLD), [*READ, f"read {W1} tree {OLD}", "report retention.kept", LEDGER_WRITE],
         facts={f"{W1} containers": [NOW], f"{W1} realpath": [CANONICAL], f"{W1} copies": [ledger(COPIED)],
                f"{W1} tree {OLD}": [TREE.model_copy(update={"truncated": "more than 100000 entries"})]},
         **_recorded()),
    Case("prune-weights: a tree that could not be listed is kept, though its (empty) digest matches", weights(OLD),
         [*READ, f"read {W1} tree {OLD}", "report retention.kept", LEDGER_WRITE],
         facts={f"{W1} containers": [NOW], f"{W1} realpath": [CANONICAL],
                f"{W1} copies": [ledger(COPIED.replace(DIGEST, EMPTY_DIGEST))], f"{W1} tree {OLD}": [UNLISTED]},
         **_recorded()),
]


# -- round 2 (issue 34, item 7): the ledger's own failure, like rm's, names only the tail of a long stderr.

CASES += [
    Case("prune-weights: a ledger write failing with a long stderr: only its last 200 characters", weights(OLD),
         [*READ, f"read {W1} tree {OLD}", REMOVE, "report retention.remove", LEDGER_WRITE],
         facts={f"{W1} containers": [NOW], f"{W1} realpath": [CANONICAL], f"{W1} copies": [ledger(COPIED)],
                f"{W1} tree {OLD}": [LISTING]},
         results={LEDGER_WRITE[4:]: [Result("", "x" + "y" * 200, 1)]},
         raises=r"the ledger could not say `removed` \(exit 1: y{200}\)$", **_recorded()),
]
