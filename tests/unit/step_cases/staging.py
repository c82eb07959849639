"""download (`hf download` on the internet node, behind the Hub's size and the disk preflight) and pull-image
(`docker pull` on the image source, behind a floor of free room). The token's way (stdin only) is pinned by
tests/unit/core/test_staging_plan.py, which reads what the driver fed each command."""

from __future__ import annotations

import json
import shlex
from collections.abc import Callable

from reconciler.core.drift import DISK_MARGIN
from reconciler.core.observed import Image, NodeObservation, Observed, WeightFile, Weights
from reconciler.core.planning import Step
from reconciler.core.spec import Desired
from reconciler.edge.manifest import Listing
from reconciler.edge.ssh import Result
from reconciler.edge.steps.actions import Given
from reconciler.edge.steps.staging import _FETCH, download_argv
from tests.unit.recorded import load
from tests.unit.step_cases import HEAD, WORKER, Case, reachable, sample
from tests.unit.step_driver import Raw

MODEL, REVISION = "Qwen/Qwen3.5-122B-A10B-FP8", "main"  # the sample's model
HUB_PATH = "/home/spark/.cache/huggingface/hub"
SIZE = f"{HEAD} hub-size {MODEL}@{REVISION}"
GIB = 1 << 30
#: The Hub's answer with `blobs=true` (trimmed to two files; the real one lists every sibling with its size).
ANSWER = Raw(json.dumps({"id": MODEL, "sha": "3" * 40, "siblings": [
    {"rfilename": "config.json", "size": 4_211, "blobId": "a" * 40},
    {"rfilename": "model-00001-of-00001.safetensors", "size": 100 * GIB, "blobId": "b" * 40,
     "lfs": {"sha256": "c" * 64, "size": 100 * GIB}}]}))
TOTAL = 4_211 + 100 * GIB
IMAGE = "nvcr.io/nvidia/vllm:26.05-py3"


def _observed(free: int | None = None, have: int = 0) -> Observed:
    """The internet node with `free` bytes at the model path (None: not measured) and a partial tree of `have`."""
    weights = Weights(root=f"{HUB_PATH}/models--Qwen--Qwen3.5-122B-A10B-FP8", present=bool(have),
                      files=[WeightFile(path="blobs/b", size=have, mtime=1.0)] if have else [])
    head = NodeObservation(name=HEAD, reachable=True, weights=weights,
                           disk_free=None if free is None else {"weights": free, "image": free})
    return Observed(nodes={HEAD: head, WORKER: NodeObservation(name=WORKER, reachable=True)})


def _listed(*paths: str, root: str = f"{HUB_PATH}/models--Qwen--Qwen3.5-122B-A10B-FP8") -> Listing:
    """The tree as the step re-reads it after `hf download` (`listing_fact`), parsed."""
    return Listing(Weights(root=root, present=True, files=[WeightFile(path=p, size=1) for p in paths
                                                           if not p.endswith(".incomplete")],
                           partials=[p for p in paths if p.endswith(".incomplete")]), {})


#: What a finished download leaves: the ref and the snapshot's files (whole: no partial, no gap in a series).
WHOLE = _listed("refs/main", f"snapshots/{'3' * 40}/config.json",
                f"snapshots/{'3' * 40}/model-00001-of-00001.safetensors")
LISTED = f"{HEAD} weights"
DOWNLOAD = Step("download", HEAD, "absent", (), path=HUB_PATH)


def bounds(node: str, root: str) -> tuple[list[str], list[str], dict[str, list[Result]]]:
    """The page-cache bounds a download runs between (`drop_behind`): on the model's tree and, beside an hf-cache
    tree, the hub's shared blob store. Their start lines, their stop lines and their `ready` answers."""
    trees = [root, f"{root.rsplit('/', 1)[0]}/blobs"] if "/models--" in root else [root]
    keys = [f"{node} " + shlex.join(["python3", "-c", "<drop_behind_helper.py>", t, "43200"]) for t in trees]
    return ([f"start {k}" for k in keys], [f"stop end {k}" for k in reversed(keys)],
            {f"start {k}": [Result("ready\n", "", 0)] for k in keys})


BOUND_STARTS, BOUND_STOPS, BOUND_READY = bounds(HEAD, f"{HUB_PATH}/models--Qwen--Qwen3.5-122B-A10B-FP8")
FETCH = f"{HEAD} " + shlex.join(download_argv(Given(sample(), _observed()), DOWNLOAD))
PULL = Step("pull-image", HEAD, "absent", (), image=IMAGE)


def _download(name: str, commands: list[str], *, free: int | None = 200 * GIB, have: int = 0,
              answer: Raw = ANSWER, fetched: Result | None = None, raises: str | None = None,
              error: str = "StepFailed", after: Listing = WHOLE) -> Case:
    return Case(name, DOWNLOAD, commands, facts={SIZE: [answer], LISTED: [after]},
                results={**BOUND_READY, **({FETCH: [fetched]} if fetched is not None else {})}, raises=raises,
                error=error,
                observed=lambda: _observed(free, have))


def _pull(name: str, commands: list[str], *, free: int | None = 200 * GIB, pulled: Result | None = None,
          raises: str | None = None, error: str = "StepFailed") -> Case:
    return Case(name, PULL, commands, results={f"{HEAD} docker pull {IMAGE}": [pulled]} if pulled else {},
                raises=raises, error=error, observed=lambda: _observed(free))


FETCHED = [f"read {SIZE}", "report download.start", *BOUND_STARTS, f"run {FETCH}", *BOUND_STOPS, f"read {LISTED}",
           "report download.done"]
RAN = FETCHED[:5]  # up to the fetch, which fails

CASES = [
    _download("the revision fits: fetched with the Hub's CLI", FETCHED),
    _download("the disk was not measured: fetched", FETCHED, free=None),
    _download("what is there already counts: a resumed download needs only the rest", FETCHED,
              free=TOTAL - 50 * GIB + DISK_MARGIN, have=50 * GIB),
    _download("the disk cannot hold it with the margin: nothing fetched", [f"read {SIZE}"],
              free=TOTAL + DISK_MARGIN - 1,
              raises=r"needs 101\.0 GiB free on /home/spark/.cache/huggingface/hub on spark-1a32 .*only 101\.0 GiB "
                     "is: free room there; nothing was downloaded", error="StepBlocked"),
    _download("the Hub does not answer (a gated model without the token): nothing fetched", [f"read {SIZE}"],
              answer=Raw("curl: (22) The requested URL returned error: 401", 22),
              raises=r"the Hub did not say how large .* \(curl exit 22: curl: \(22\) The requested URL returned "
                     "error: 401\\); a gated model needs HF_TOKEN in serving.secrets scoped `internet`"),
    _download("the Hub gives no size for some file: nothing fetched", [f"read {SIZE}"],
              answer=Raw(json.dumps({"siblings": [{"rfilename": "config.json"}]})),
              raises="the Hub's answer for .* gives no size for some files; nothing was downloaded"),
    _download("the Hub's answer is not JSON: nothing fetched", [f"read {SIZE}"], answer=Raw("<html>"),
              raises="the Hub's answer for Qwen/Qwen3.5-122B-A10B-FP8 at main: .*nothing was downloaded"),
    _download("no `hf` on the node: says how to install it", RAN, fetched=Result("", "hf: not found", 127),
              raises="failed \\(exit 127\\) after 0 bytes: install the Hub's CLI .*pipx install huggingface_hub"),
    _download("`hf download` exits 0 beside a leftover partial of another download: the step names it, once",
              FETCHED[:-1], after=_listed("refs/main", f"blobs/{'e' * 40}.2ed6410c.incomplete",
                                         f"snapshots/{'3' * 40}/config.json"),
              raises=r"finished, yet the tree is incomplete in .*blobs/e{40}\.2ed6410c\.incomplete still "
                     "downloading .*remove what is named"),
    _download("`hf download` exits 0 yet a shard of the series is absent: the step names it", FETCHED[:-1],
              after=_listed("refs/main", f"snapshots/{'3' * 40}/model-00002-of-00002.safetensors"),
              raises="model-00001-of-00002.safetensors missing from a sharded checkpoint"),
    _download("the fetch fails: its stderr", RAN, fetched=Result("", "RepositoryNotFoundError: 404", 1),
              raises="`hf download Qwen/Qwen3.5-122B-A10B-FP8 --revision main` on spark-1a32 failed \\(exit 1\\) "
                     "after 0 bytes: RepositoryNotFoundError: 404"),
    _pull("the pull: docker pull with the user's logins", [f"run {HEAD} docker pull {IMAGE}", "report pull.done"]),
    _pull("docker's data root below the margin: nothing pulled", [], free=DISK_MARGIN - 1, error="StepBlocked",
          raises="free in docker's data root on spark-1a32: the pull of .* would fill it"),
    _pull("the pull fails: its stderr and the login hint", [f"run {HEAD} docker pull {IMAGE}"],
          pulled=Result("", "unauthorized: authentication required", 1),
          raises="`docker pull .*` on spark-1a32 failed \\(exit 1\\) after 0 layers: unauthorized: authentication "
                 "required \\(a private registry needs `docker login`"),
]


# -- the survivors of issue 34's mutation run (docs/mutation-survivors-edge.md): a node never listed (no weights
# observed), a tree already whole, the exact margin, the plain layout and a per-node path, a long stderr.

def _unlisted(free: int) -> Observed:
    """The internet node with `free` bytes at the model path and no weights observation at all (never listed)."""
    head = NodeObservation(name=HEAD, reachable=True, disk_free={"weights": free, "image": free})
    return Observed(nodes={HEAD: head, WORKER: NodeObservation(name=WORKER, reachable=True)})


def _plain() -> Desired:
    """The sample with the plain layout: the model is the directory itself."""
    desired = sample()
    return desired.with_deployment(model=desired.model.model_copy(update={"layout": "plain"}))


def _fetch(node: str, root: str, model: str, revision: str, into: tuple[str, str]) -> str:
    """`hf download` as the transcript shows it, written out here (the script itself is test_staging_plan.py's)."""
    return f"run {node} " + shlex.join(("sh", "-c", _FETCH, "sh", root, model, "--revision", revision, *into))


def _fetched_by(name: str, desired: Callable[[], Desired], node: str, path: str, fetch: str) -> Case:
    size = f"{node} hub-size {desired().model.id}@{desired().model.revision}"
    root, rev = desired().weights_root(node), desired().model.revision
    starts, stops, ready = bounds(node, root)
    return Case(name, Step("download", node, "absent", (), path=path),
                [f"read {size}", "report download.start", *starts, fetch, *stops, f"read {node} weights",
                 "report download.done"], results=ready,
                facts={size: [ANSWER], f"{node} weights": [_listed(
                    f"refs/{rev}", f"snapshots/{rev if len(rev) == 40 else '3' * 40}/config.json", root=root)]},
                desired=desired, observed=lambda: reachable(node))


TESTBED_HUB = "/srv/spark-testbed/head/models/hub"  # the recorded testbed's head: a path per node

CASES += [
    Case("a node never listed has nothing yet: the whole revision and the margin must fit", DOWNLOAD,
         [f"read {SIZE}"], facts={SIZE: [ANSWER]}, observed=lambda: _unlisted(TOTAL + DISK_MARGIN - 1),
         raises="needs 101.0 GiB free", error="StepBlocked"),
    Case("a node never listed with room for all of it: fetched", DOWNLOAD, FETCHED,
         facts={SIZE: [ANSWER], LISTED: [WHOLE]}, results=BOUND_READY,
         observed=lambda: _unlisted(TOTAL + DISK_MARGIN)),
    _download("a tree already as large as the revision needs only the margin", FETCHED, free=DISK_MARGIN,
              have=TOTAL + GIB),
    _fetched_by("the plain layout: into --local-dir, the model's directory itself", _plain, HEAD, HUB_PATH,
                _fetch(HEAD, HUB_PATH, MODEL, REVISION, ("--local-dir", HUB_PATH))),
    _fetched_by("a path per node: the tree's size is measured at this node's own root", load, "head", TESTBED_HUB,
                _fetch("head", f"{TESTBED_HUB}/models--testorg--tiny-moe", "testorg/tiny-moe", "1" * 40,
                       ("--cache-dir", TESTBED_HUB))),
    _download("the fetch fails with a long stderr: only its last 600 characters", RAN,
              fetched=Result("", "x" + "y" * 600, 1), raises="after 0 bytes: y{600}$"),
    _pull("exactly the margin free in docker's data root: pulled", [f"run {HEAD} docker pull {IMAGE}",
                                                                   "report pull.done"], free=DISK_MARGIN),
    _pull("the pull fails with a long stderr: only its last 600 characters", [f"run {HEAD} docker pull {IMAGE}"],
          pulled=Result("", "x" + "y" * 600, 1), raises=r"layers: y{600} \(a private registry"),
]


# -- issue 52, item 10: a staging step counts the copy the plan makes to the same filesystem (`drift.shortfall`);
# on DGX OS the model path and docker's data root are both on the one NVMe's `/`.

NVME = "/dev/nvme0n1p2"


def _one_filesystem(free: int, *, worker: NodeObservation, fs: str = NVME) -> Observed:
    """The head with `free` bytes read for both rows, the model path on `fs` and docker's data root on the one
    NVMe; the worker as given."""
    head = NodeObservation(name=HEAD, reachable=True, disk_free={"weights": free, "image": free},
                           disk_fs={"weights": fs, "image": NVME})
    return Observed(nodes={HEAD: head, WORKER: worker})


def _weights_on_the_worker() -> Desired:
    """The sample with the weights' source on the worker: the head, which pulls the image, gets a weights copy."""
    desired = sample()
    return desired.with_deployment(model=desired.model.model_copy(update={"source": WORKER}))


def _image_on_the_worker() -> Desired:
    """The sample with the worker the first image source: the head, which downloads, gets an image copy."""
    desired = sample()
    return desired.with_deployment(serving=desired.serving.model_copy(update={"image_sources": [WORKER, HEAD]}))


_TREE = Weights(root=f"{HUB_PATH}/models--Qwen--Qwen3.5-122B-A10B-FP8", present=True,
                files=[WeightFile(path="blobs/b", size=50 * GIB, mtime=1.0)])
_HELD = NodeObservation(name=WORKER, reachable=True, docker_reachable=True, images={IMAGE: Image(
    id="sha256:" + "a" * 64, content="sha256:" + "c" * 64, size=20 * GIB)})

CASES += [
    Case("the pull's floor beside a weights copy to the same filesystem: nothing pulled", PULL, [],
         raises=f"only 10.0 GiB free in docker's data root on {HEAD}: the pull of .* would fill it; free at least "
                f"51.0 GiB plus the image there; with the weights copy's 50.0 GiB on the same filesystem, {NVME}; "
                "nothing was pulled", error="StepBlocked", desired=_weights_on_the_worker,
         observed=lambda: _one_filesystem(10 * GIB, worker=NodeObservation(name=WORKER, reachable=True,
                                                                            weights=_TREE))),
    Case("the same room on two filesystems: pulled", PULL, [f"run {HEAD} docker pull {IMAGE}", "report pull.done"],
         desired=_weights_on_the_worker,
         observed=lambda: _one_filesystem(10 * GIB, worker=NodeObservation(name=WORKER, reachable=True,
                                                                            weights=_TREE), fs="/dev/nvme1n1p1")),
    Case("the download beside an image copy to the same filesystem: nothing fetched", DOWNLOAD, [f"read {SIZE}"],
         facts={SIZE: [ANSWER]}, desired=_image_on_the_worker,
         observed=lambda: _one_filesystem(110 * GIB, worker=_HELD),
         raises=r"needs 121\.0 GiB free on /home/spark/.cache/huggingface/hub on spark-1a32 \(the Hub lists "
                r"100\.0 GiB; the margin is 1\.0 GiB; with the image copy's 20\.0 GiB on the same filesystem, "
                f"{NVME}\\), only 110\\.0 GiB is: free room there; nothing was downloaded", error="StepBlocked"),
]
