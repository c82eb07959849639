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
missing plus the margin every copy keeps (core/drift.DISK_MARGIN). The token, when the file scopes `HF_TOKEN` to
`internet`, travels on stdin only: a header line for curl (`-H @-`), one line read by the shell for `hf`."""

from __future__ import annotations

import json
import re
import urllib.parse

from reconciler.core.drift import DISK_MARGIN, gib
from reconciler.core.planning import Step
from reconciler.edge.ssh import CommandFailed
from reconciler.edge.steps import StepBlocked, StepContext, StepFailed

#: The one secret the download may carry, and only when the file scopes it to `internet` (docs/security.md).
TOKEN = "HF_TOKEN"

# The Hub's size of a revision. `-H @-`: the headers (the token's, when there is one) from stdin, never argv.
_SIZE = ('curl -fsS --max-time "$1" -H @- "${HF_ENDPOINT:-https://huggingface.co}/api/models/$2/revision/$3'
         '?blobs=true"')

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


def _token(ctx: StepContext) -> str | None:
    """HF_TOKEN's value only when the file scopes it to `internet`: the scope that says which nodes may hold it
    (docs/security.md, "Secrets"); a token scoped otherwise is not the download's to use."""
    return ctx.desired.secret(TOKEN) if ctx.desired.serving.secrets.get(TOKEN) == "internet" else None


def _headers(token: str | None) -> bytes:
    return (f"Authorization: Bearer {token}\n" if token else "Accept: application/json\n").encode()


def hub_size(payload: str) -> int:
    """Total bytes of a revision from the Hub's model-info answer (`siblings[].size`). A sibling without a size
    (an answer without `blobs=true`) makes the size unknown: ValueError, and nothing is downloaded."""
    doc = json.loads(payload)
    siblings = doc.get("siblings") if isinstance(doc, dict) else None
    if not isinstance(siblings, list) or not siblings:
        raise ValueError("the Hub's answer lists no files")
    sizes = [s.get("size") if isinstance(s, dict) else None for s in siblings]
    if not all(isinstance(n, int) and n >= 0 for n in sizes):
        raise ValueError("the Hub's answer gives no size for some files")
    return sum(sizes)  # type: ignore[arg-type]


def download_argv(ctx: StepContext, step: Step, timeout: float) -> list[str]:
    """The source's command: `hf download ID --revision REV` into the declared cache (`--cache-dir`, hf-cache
    layout) or directory (`--local-dir`, plain), its tree's bytes reported as it grows."""
    model = ctx.desired.model
    assert step.path is not None, "the plan sets the path of a download"
    into = ["--cache-dir", step.path] if model.layout == "hf-cache" else ["--local-dir", step.path]
    root = ctx.desired.weights_root(step.node)
    return ["sh", "-c", _FETCH, "sh", root, model.id, "--revision", model.revision, *into]


def download(ctx: StepContext, step: Step) -> None:
    """Fetch the declared revision on the source, behind the disk preflight; the next observation lists the tree
    and plans the copies from it."""
    node, model = step.node, ctx.desired.model
    session = ctx.sessions[node]
    token = _token(ctx)
    asked = session.run(["sh", "-c", _SIZE, "sh", str(int(ctx.command_timeout)), model.id,
                         urllib.parse.quote(model.revision, safe="")],
                        stdin=_headers(token), timeout=ctx.command_timeout, check=False)
    if not asked.ok:
        raise StepFailed(f"the Hub did not say how large {model.id} at {model.revision} is, asked from {node} "
                         f"(curl exit {asked.exit_code}: {asked.stderr.strip()[-300:]}); a gated model needs "
                         f"{TOKEN} in serving.secrets scoped `internet`; nothing was downloaded")
    try:
        total = hub_size(asked.stdout)
    except ValueError as exc:
        raise StepFailed(f"the Hub's answer for {model.id} at {model.revision}: {exc}; nothing was "
                         "downloaded") from None
    obs = ctx.observed.node(node)
    have = obs.weights.total_bytes if obs.weights is not None else 0
    free = (obs.disk_free or {}).get("weights")
    need = max(0, total - have)
    if free is not None and free < need + DISK_MARGIN:
        raise StepBlocked(f"{model.id} at {model.revision} needs {gib(need + DISK_MARGIN)} free on "
                          f"{step.path} on {node} (the Hub lists {gib(total)}; the margin is {gib(DISK_MARGIN)}), "
                          f"only {gib(free)} is: free room there; nothing was downloaded")
    grown = [0]

    def seen(chunk: bytes) -> None:
        sizes = [int(m) for m in _BYTES.findall(chunk.decode(errors="replace"))]
        if sizes and max(sizes) > grown[0]:
            grown[0] = max(sizes)
            ctx.progress("download.progress", {"node": node, "bytes_done": grown[0], "bytes_total": total})

    ctx.progress("download.start", {"node": node, "model": model.id, "revision": model.revision,
                                    "bytes_total": total})
    timeout = ctx.remaining(ctx.desired.policy.timeouts.weights_sync)
    try:
        session.run(download_argv(ctx, step, timeout), stdin=f"{token or ''}\n".encode(), timeout=timeout,
                    on_output=seen, cancel=ctx.cancel, supervised=True)
    except CommandFailed as exc:
        why = HF_FIX if exc.exit_code == 127 else exc.stderr.strip()[-600:]
        raise StepFailed(f"`hf download {model.id} --revision {model.revision}` on {node} failed (exit "
                         f"{exc.exit_code}) after {grown[0]} bytes: {why}") from None
    ctx.progress("download.done", {"node": node, "bytes": grown[0], "bytes_total": total})


_LAYER_DONE = re.compile(r"^([0-9a-f]{12}): (?:Pull complete|Already exists)\s*$", re.M)
_LAYER = re.compile(r"^([0-9a-f]{12}): ", re.M)


def pull_image(ctx: StepContext, step: Step) -> None:
    """`docker pull IMAGE` on the image source, with the user's registry logins (the CLI reads ~/.docker); the
    layers reported as they land. The next observation sees the image and plans the copies from it. Its disk
    preflight is a floor only (the margin free in docker's data root): the image's size is not known before the
    pull without a registry client of our own (`docker manifest` is not in Debian's or Ubuntu's docker.io), and a
    pull that meets a full disk fails without harm to what runs."""
    node, ref = step.node, step.image
    assert ref is not None, "the plan names the image of a pull"
    free = (ctx.observed.node(node).disk_free or {}).get("image")
    if free is not None and free < DISK_MARGIN:
        raise StepBlocked(f"only {gib(free)} free in docker's data root on {node}: the pull of {ref} would fill "
                          f"it; free at least {gib(DISK_MARGIN)} plus the image there; nothing was pulled")
    layers: set[str] = set()
    done: set[str] = set()

    def seen(chunk: bytes) -> None:
        text = chunk.decode(errors="replace")
        layers.update(_LAYER.findall(text))
        landed = set(_LAYER_DONE.findall(text)) - done
        if landed:
            done.update(landed)
            ctx.progress("pull.progress", {"node": node, "image": ref, "layers_done": len(done),
                                           "layers_seen": len(layers)})

    timeout = ctx.remaining(ctx.desired.policy.timeouts.image_sync)
    try:
        ctx.sessions[node].run(["docker", "pull", ref], timeout=timeout, on_output=seen, cancel=ctx.cancel,
                               supervised=True)
    except CommandFailed as exc:
        raise StepFailed(f"`docker pull {ref}` on {node} failed (exit {exc.exit_code}) after {len(done)} layers: "
                         f"{exc.stderr.strip()[-600:]} (a private registry needs `docker login` as the SSH user "
                         "there)") from None
    ctx.progress("pull.done", {"node": node, "image": ref, "layers": len(done)})
