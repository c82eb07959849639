"""Staging on the internet node: what the copies start from. `download` fetches the weights from the Hugging Face
Hub with the Hub's own CLI (`hf download`) on the model's source; `pull-image` pulls the serving image on the
first image source. Only on a node the file says has internet; both run while what runs keeps serving (the plan
holds every stop until they are done, planning/_hold_or_order_stops).

Why the Hub's CLI and not our own HTTP client: it is what a Spark owner runs by hand, it resumes an interrupted
download, writes the cache layout vLLM reads (models--ORG--NAME/{blobs,refs,snapshots}; huggingface_hub's
file_download.py), and honours HF_ENDPOINT (a mirror) and HF_TOKEN (a gated model) as the owner configured them.

The disk preflight: before a byte is fetched, the Hub says how large the revision is (`GET
/api/models/ID/revision/REV?blobs=true`, what `HfApi.model_info(files_metadata=True)` asks; each sibling's
`size`), and the download goes ahead only when the observation's free bytes at the model path hold what is
missing, and any copy the plan makes to the same filesystem (an image copy to this node: on DGX OS both go to the
one NVMe), plus the margin (core/drift.shortfall, the plan's own judgement). The token, when the file scopes
`HF_TOKEN` to `internet`, travels on stdin only: in the size read's script for curl (`facts.weights.hub_size_fact`), one
line read by the shell for `hf`."""

from __future__ import annotations

import re

from reconciler.core.budget import gib
from reconciler.core.drift import DISK_MARGIN, Shortfall, disk_needs, shortfall, source_problem
from reconciler.core.planning import Step
from reconciler.edge.facts.weights import hub_size_fact
from reconciler.edge.manifest import listing_fact, weights_store
from reconciler.edge.ssh import CommandFailed
from reconciler.edge.steps.actions import Actions, Given, Report, Run, StepBlocked, StepFailed, read
from reconciler.edge.steps.drop_behind import end_bound, start_bound

#: The one secret the download may carry, and only when the file scopes it to `internet` (docs/security.md).
TOKEN = "HF_TOKEN"

# `hf download` in the background, its tree's size printed every 2 s for the step's progress. The token is the
# first line of stdin (empty: none); ~/.local/bin is where `pipx install huggingface_hub` puts `hf`. Progress
# bars off: stderr keeps only what went wrong. Supervised: the channel's close stops it (and `timeout` signals
# the whole process group, the background `hf` included).
_FETCH = ('IFS= read -r HF_TOKEN; if [ -n "$HF_TOKEN" ]; then export HF_TOKEN; else unset HF_TOKEN; fi; '
          'PATH="$PATH:$HOME/.local/bin"; export HF_HUB_DISABLE_PROGRESS_BARS=1 HF_HUB_DISABLE_TELEMETRY=1 '
          'HF_HUB_DISABLE_UPDATE_CHECK=1; '
          'command -v hf >/dev/null 2>&1 || { echo "hf: command not found" >&2; exit 127; }; '
          'd=$1; shift; mkdir -p -- "$d" || exit 1; hf download "$@" >/dev/null & pid=$!; '
          'while kill -0 "$pid" 2>/dev/null; do echo "bytes $(du -sb -- "$d" 2>/dev/null | cut -f1)"; sleep 2; done; '
          'wait "$pid"')
_BYTES = re.compile(r"^bytes (\d+)$", re.M)

#: What `hf` needs on the node, said where it is missing.
HF_FIX = ("install the Hub's CLI for the SSH user there: `pipx install huggingface_hub` (or `python3 -m pip "
          "install --user huggingface_hub`); `reconciler doctor` checks it")


def _beside(lack: Shortfall) -> str:
    """What else writes to the filesystem a staging step is short on (`drift.disk_needs`), said; empty if none."""
    others = " and ".join(f"the {where} copy's {gib(size)}" for where, size in lack.others)
    return f"; with {others} on the same filesystem, {lack.on}" if others else ""


def _token(given: Given) -> str | None:
    """HF_TOKEN's value only when the file scopes it to `internet`: the scope that says which nodes may hold it
    (docs/security.md, "Secrets"); a token scoped otherwise is not the download's to use."""
    desired = given.desired
    return desired.secret(TOKEN) if desired.serving.secrets.get(TOKEN) == "internet" else None


def download_argv(given: Given, step: Step) -> tuple[str, ...]:
    """The source's command: `hf download ID --revision REV` into the declared cache (`--cache-dir`, hf-cache
    layout) or directory (`--local-dir`, plain), its tree's bytes reported as it grows."""
    model = given.desired.model
    assert step.path is not None, "the plan sets the path of a download"
    into = ("--cache-dir", step.path) if model.layout == "hf-cache" else ("--local-dir", step.path)
    root = given.desired.weights_root(step.node)
    return ("sh", "-c", _FETCH, "sh", root, model.id, "--revision", model.revision, *into)


class Grown:
    """The largest tree size the download's `bytes N` lines reported: the progress only grows."""

    def __init__(self) -> None:
        self.done = 0

    def feed(self, chunk: bytes) -> bool:
        sizes = [int(m) for m in _BYTES.findall(chunk.decode(errors="replace"))]
        if not sizes or max(sizes) <= self.done:
            return False
        self.done = max(sizes)
        return True


def _download_trees(root: str) -> tuple[str, ...]:
    """What `hf download` writes into: the model's tree, and beside an hf-cache tree the hub's shared blob store,
    where huggingface_hub puts Xet files (`manifest.weights_store`)."""
    store = weights_store(root)
    return (root,) if store is None else (root, store)


def download(given: Given, step: Step) -> Actions:
    """Fetch the declared revision on the source, behind the disk preflight and between page-cache bounds on what
    it writes (a 119 GB download beside a serving generation would otherwise fill a GB10's one memory pool with
    cache: `drop_behind`); then list the tree and judge it as
    the plan does (`source_problem`): `hf download` exiting 0 beside a tree that still reads incomplete (a
    leftover partial of another download) fails the step naming it, rather than downloading again every cycle.
    The next observation lists the tree and plans the copies from it."""
    node, model, desired = step.node, given.desired.model, given.desired
    token = _token(given)
    size = yield from read(node, hub_size_fact(model.id, model.revision, token, desired.policy.timeouts.command))
    if size.bytes is None and size.exit:
        raise StepFailed(f"the Hub did not say how large {model.id} at {model.revision} is, asked from {node} "
                         f"(curl exit {size.exit}: {size.problem}); a gated model needs {TOKEN} in serving.secrets "
                         "scoped `internet`; nothing was downloaded")
    if size.bytes is None:
        raise StepFailed(f"the Hub's answer for {model.id} at {model.revision}: {size.problem}; nothing was "
                         "downloaded")
    total = size.bytes
    obs = given.observed.node(node)
    have = obs.weights.total_bytes if obs.weights is not None else 0
    need = max(0, total - have)
    lack = shortfall(obs, "weights", {**disk_needs(desired, given.observed, node), "weights": need})
    if lack is not None:
        raise StepBlocked(f"{model.id} at {model.revision} needs {gib(lack.needed)} free on "
                          f"{step.path} on {node} (the Hub lists {gib(total)}; the margin is {gib(DISK_MARGIN)}"
                          f"{_beside(lack)}), only {gib(lack.free)} is: free room there; nothing was downloaded")
    grown = Grown()

    def seen(chunk: bytes) -> Report | None:
        if not grown.feed(chunk):
            return None
        return Report("download.progress", {"node": node, "bytes_done": grown.done, "bytes_total": total})

    yield Report("download.start", {"node": node, "model": model.id, "revision": model.revision,
                                    "bytes_total": total})
    bounds = []
    for tree in _download_trees(desired.weights_root(node)):
        bounds.append((yield from start_bound(given, node, tree, "the download")))
    try:
        yield Run(node, download_argv(given, step), stdin=f"{token or ''}\n".encode(),
                  timeout=desired.policy.timeouts.weights_sync, long=True, on_output=seen)
    except CommandFailed as exc:
        why = HF_FIX if exc.exit_code == 127 else exc.stderr.strip()[-600:]
        raise StepFailed(f"`hf download {model.id} --revision {model.revision}` on {node} failed (exit "
                         f"{exc.exit_code}) after {grown.done} bytes: {why}") from None
    for bound in reversed(bounds):
        yield from end_bound(bound)
    after = yield from read(node, listing_fact(desired.weights_root(node)))
    if (problem := source_problem(desired, after.weights)) is not None:
        raise StepFailed(f"`hf download {model.id} --revision {model.revision}` on {node} finished, yet the tree "
                         f"is {problem}: a leftover of another download (another revision's, or one still "
                         "running); once no `hf download` runs there, remove what is named, and the next "
                         "reconcile judges the tree again")
    yield Report("download.done", {"node": node, "bytes": grown.done, "bytes_total": total})


_LAYER_DONE = re.compile(r"^([0-9a-f]{12}): (?:Pull complete|Already exists)\s*$", re.M)
_LAYER = re.compile(r"^([0-9a-f]{12}): ", re.M)


class Layers:
    """The layers `docker pull` printed, and those landed (pulled, or already there)."""

    def __init__(self) -> None:
        self.seen: set[str] = set()
        self.done: set[str] = set()

    def feed(self, chunk: bytes) -> bool:
        """True when a layer landed."""
        text = chunk.decode(errors="replace")
        self.seen.update(_LAYER.findall(text))
        landed = set(_LAYER_DONE.findall(text)) - self.done
        self.done.update(landed)
        return bool(landed)


def pull_image(given: Given, step: Step) -> Actions:
    """`docker pull IMAGE` on the image source, with the user's registry logins (the CLI reads ~/.docker); the
    layers reported as they land. The next observation sees the image and plans the copies from it. Its disk
    preflight is a floor only (the margin free in docker's data root, plus a weights copy the plan makes to the
    same filesystem, `drift.shortfall`): the image's size is not known before the pull without a registry client
    of our own (`docker manifest` is not in Debian's or Ubuntu's docker.io), and a pull that meets a full disk
    fails without harm to what runs."""
    node, ref = step.node, step.image
    assert ref is not None, "the plan names the image of a pull"
    obs = given.observed.node(node)
    lack = shortfall(obs, "image", {**disk_needs(given.desired, given.observed, node), "image": 0})
    if lack is not None:
        raise StepBlocked(f"only {gib(lack.free)} free in docker's data root on {node}: the pull of {ref} would "
                          f"fill it; free at least {gib(lack.needed)} plus the image there{_beside(lack)}; nothing "
                          "was pulled")
    layers = Layers()

    def seen(chunk: bytes) -> Report | None:
        if not layers.feed(chunk):
            return None
        return Report("pull.progress", {"node": node, "image": ref, "layers_done": len(layers.done),
                                        "layers_seen": len(layers.seen)})

    try:
        yield Run(node, ("docker", "pull", ref), timeout=given.desired.policy.timeouts.image_sync, long=True,
                  on_output=seen)
    except CommandFailed as exc:
        raise StepFailed(f"`docker pull {ref}` on {node} failed (exit {exc.exit_code}) after {len(layers.done)} "
                         f"layers: {exc.stderr.strip()[-600:]} (a private registry needs `docker login` as the SSH "
                         "user there)") from None
    yield Report("pull.done", {"node": node, "image": ref, "layers": len(layers.done)})
