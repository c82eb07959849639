"""What the serving image itself accepts: its own `vllm serve --help=all` and whether it has Ray, asked once per
image id from a throw-away container on the node that holds it.

`serving.extra_args` is judged by the image, not by a list in this code: vLLM's flags change between releases, and
an NGC build is not a PyPI one. The question imports torch (seconds to minutes), so the daemon asks beside its loop
(`loop.operations.FlagsQuery`) and the one-shot commands ask through `flags_once`.
"""

from __future__ import annotations

from reconciler.core.drift import image_holder
from reconciler.core.observed import LABEL_QUERY, Observed, ServeFlags
from reconciler.core.spec import Desired
from reconciler.core.text import printable
from reconciler.core.vllm import parse_serve_help
from reconciler.edge.ssh import RemoteError, Sessions

FLAGS_DEADLINE = 180.0  # `vllm serve --help=all` imports torch: ~12 s on 2 CPU cores, more on a busy node


def flags_wanted(desired: Desired, observed: Observed) -> tuple[str, str] | None:
    """(node, image id) to ask what the serving image can do: the node holding the reference image; None when no
    node has it (the image's own drift blocks then). Every start is judged, the reconciler's own flags too
    (issue 29): NGC 25.09/25.10 lack the native multi-node flags."""
    holder = image_holder(desired, observed)
    if holder is None:
        return None
    return holder, observed.node(holder).images[desired.serving.image].id


# One throw-away container answers both questions: `sh` is in every vLLM image (NGC's and vLLM's own are Ubuntu).
# The version: the installed distribution's metadata (no torch import), else `vllm --version`.
# Its CUDA, from the image's own configuration (ENV, which a container inherits): what `core.cuda` judges against
# each node's driver.
_ASK_IMAGE = ('if command -v ray >/dev/null 2>&1; then echo "@@ray yes"; else echo "@@ray no"; fi; '
              'v=$(python3 -c "import importlib.metadata as m; print(m.version(\'vllm\'))" 2>/dev/null) || '
              'v=$(vllm --version 2>/dev/null | tail -n 1); echo "@@version $v"; '
              'printf "@@env CUDA_VERSION=%s\\n@@env CUDA_DRIVER_VERSION=%s\\n@@env NVIDIA_REQUIRE_CUDA=%s\\n" '
              '"${CUDA_VERSION:-}" "${CUDA_DRIVER_VERSION:-}" "${NVIDIA_REQUIRE_CUDA:-}"; '
              'exec vllm serve --help=all')
_ENV_CAP = 2000  # characters of one variable kept: NVIDIA_REQUIRE_CUDA lists every driver branch (~1.5 kB)


def _image_env(stdout: str) -> dict[str, str]:
    """The `@@env NAME=VALUE` lines, empty values left out, each value printable and capped."""
    out = {}
    for line in stdout.splitlines():
        if line.startswith("@@env ") and "=" in line:
            name, _, value = line[len("@@env "):].partition("=")
            if value.strip():
                out[name] = printable(value.strip())[:_ENV_CAP]
    return out


def ask_serve_flags(desired: Desired, sessions: Sessions, holder: str, image_id: str) -> ServeFlags:
    """What the serving image's own `vllm serve` accepts (its `--help=all`) and whether it has Ray, from a
    throw-away container (no network) on `holder`. Image ids name one content: callers ask once per id."""
    argv = ["docker", "run", "--rm", "--network", "none", "--label", f"{LABEL_QUERY}=serve-flags",
            "--entrypoint", "sh", desired.serving.image, "-c", _ASK_IMAGE]
    has_ray = None
    try:
        res = sessions[holder].run(argv, timeout=FLAGS_DEADLINE, check=False)
        flags = parse_serve_help(res.stdout)
        ray_line = next((line for line in res.stdout.splitlines() if line.startswith("@@ray ")), "")
        has_ray = {"@@ray yes": True, "@@ray no": False}.get(ray_line.strip())
        version = next((line[len("@@version "):].strip()[:64] for line in res.stdout.splitlines()
                        if line.startswith("@@version ")), "") or None
        env = _image_env(res.stdout)
        error = None if flags else f"exit {res.exit_code}, no flags listed: {res.stderr.strip()[-300:]}"
    except RemoteError as exc:
        flags, error, version, env = [], exc.message, None, {}
    return ServeFlags(image_id=image_id, flags=flags, has_ray=has_ray, version=version, error=error,
                      cuda_version=env.get("CUDA_VERSION"), cuda_driver_version=env.get("CUDA_DRIVER_VERSION"),
                      require_cuda=env.get("NVIDIA_REQUIRE_CUDA"))


_asked: dict[str, ServeFlags] = {}  # image id -> its flags: an id is a content hash, the same id knows the same


def flags_once(desired: Desired, sessions: Sessions, holder: str, image_id: str) -> ServeFlags:
    """`ask_serve_flags`, once per image id for the life of the process. An answer that could not be had is never
    kept: the next command asks again (it may have been a busy node's deadline)."""
    if image_id in _asked:
        return _asked[image_id]
    answer = ask_serve_flags(desired, sessions, holder, image_id)
    if answer.error is None:
        _asked[image_id] = answer
    return answer
