"""What the serving image itself accepts: its own `vllm serve --help=all` and whether it has Ray, asked once per
image id from a throw-away container on the node that holds it.

`serving.extra_args` is judged by the image, not by a list in this code: vLLM's flags change between releases, and
an NGC build is not a PyPI one. The question imports torch (seconds to minutes), so the daemon asks beside its loop
(`loop.operations.FlagsQuery`) and the one-shot commands ask through `flags_once`.

`plan` and `observe` run this question too, so it runs confined (issue 53, H): by the image id the probe saw (what
is judged is the image that would serve, whatever the tag names by then), with no network, a read-only root and a
`/tmp` tmpfs (`HOME=/tmp`: the imports' caches land there), no capability, no new privileges, bounded pids and
memory, as `nobody` (65534:65534) unless the image cannot be read by that user (then as the image's own user,
everything else the same), and under a deadline on the node that removes the container, not only its client.
"""

from __future__ import annotations

import re
import secrets
import time

from reconciler.core.drift import image_holder
from reconciler.core.observed import LABEL_QUERY, Observed, ServeFlags
from reconciler.core.spec import Desired
from reconciler.core.text import printable
from reconciler.core.vllm import parse_serve_help
from reconciler.edge.ssh import ENDED_BY_TIMEOUT, RemoteError, Sessions, quote_word

FLAGS_DEADLINE = 180.0  # `vllm serve --help=all` imports torch: ~12 s on 2 CPU cores, more on a busy node
#: Of FLAGS_DEADLINE, what is kept for removing a question container that outlived its deadline: `timeout` ends
#: the `docker run` client (SIGTERM, which docker passes on, then SIGKILL after 5 s, which it does not), and
#: `docker rm -f` ends the container itself, which a client's end does not (an image whose PID 1 ignores SIGTERM).
REMOVAL_ALLOWANCE = 20
#: The question container's bounds (`query_argv`): vLLM 0.32.0's CPU build answered `--help=all` at a 538 MB peak
#: RSS with 3 threads and 3 children (measured as uid 65534, 2026-12-07; a CUDA build maps more libraries): a wide
#: margin, still short of the node's memory and pid table for a hostile image.
QUERY_MEMORY = "4g"
QUERY_PIDS = 512
QUERY_TMPFS = "/tmp:rw,noexec,nosuid,nodev,size=512m"
QUERY_USER = "65534:65534"  # nobody:nogroup on Ubuntu, NGC's base; a uid with no name is fine with HOME set
_IMAGE_ID = re.compile(r"sha256:[0-9a-f]{64}")
#: What an image says that cannot answer as `nobody`: files it may not read (a root-only site-packages), or no
#: `nobody` in its /etc/passwd (torch's import names its cache dir after the user). Asked again as its own user.
_DENIED = ("Permission denied", "PermissionError", "EACCES", "getpwuid")


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


def query_argv(image_id: str, name: str, user: str | None = QUERY_USER) -> list[str]:
    """The question container, by image id: what the probe saw is what answers. Confined as the module says;
    `user` None: the image's own user (for an image `nobody` cannot read)."""
    return ["docker", "run", "--rm", "--name", name, "--label", f"{LABEL_QUERY}=serve-flags",
            "--network", "none", "--read-only", "--tmpfs", QUERY_TMPFS, "--env", "HOME=/tmp",
            "--cap-drop", "ALL", "--security-opt", "no-new-privileges",
            "--pids-limit", str(QUERY_PIDS), "--memory", QUERY_MEMORY, "--memory-swap", QUERY_MEMORY,
            *(["--user", user] if user is not None else []),
            "--entrypoint", "sh", image_id, "-c", _ASK_IMAGE]


def bounded_query(argv: list[str], name: str, seconds: int) -> list[str]:
    """`argv` ended on the node after `seconds` and its container removed then: `timeout` ends the client alone,
    and a container whose PID 1 ignores the SIGTERM docker passes on would live on (`docker run --rm` removes it
    only once it exits). The exit status is the client's, 124 or 137 when the deadline ended it."""
    return ["sh", "-c", f"timeout -k 5 {seconds} \"$@\"; r=$?; if [ $r -eq 124 ] || [ $r -eq 137 ]; then "
                        f"timeout 10 docker rm -f {quote_word(name)} >/dev/null 2>&1; fi; exit $r",
            "sh", *argv]


def ask_serve_flags(desired: Desired, sessions: Sessions, holder: str, image_id: str) -> ServeFlags:
    """What the serving image's own `vllm serve` accepts (its `--help=all`) and whether it has Ray, from a
    throw-away confined container (`query_argv`) on `holder`. Image ids name one content: callers ask once per id.
    As `nobody` first; once more as the image's own user when `nobody` was refused reading it."""
    if not _IMAGE_ID.fullmatch(image_id):
        return ServeFlags(image_id=image_id, error=printable(f"not an image id: {image_id[:80]!r} (the node's "
                                                             f"engine named {desired.serving.image} so)"))
    answer = _ask(sessions, holder, image_id, QUERY_USER)
    if answer.flags or answer.error is None or not any(word in answer.error for word in _DENIED):
        return answer
    return _ask(sessions, holder, image_id, None)


def _ask(sessions: Sessions, holder: str, image_id: str, user: str | None) -> ServeFlags:
    name = f"spark-reconciler-query-{secrets.token_hex(8)}"
    inner = int(FLAGS_DEADLINE) - REMOVAL_ALLOWANCE
    argv = bounded_query(query_argv(image_id, name, user), name, inner)
    has_ray = None
    start = time.monotonic()
    try:
        res = sessions[holder].run(argv, timeout=FLAGS_DEADLINE, check=False)
        flags = parse_serve_help(res.stdout)
        ray_line = next((line for line in res.stdout.splitlines() if line.startswith("@@ray ")), "")
        has_ray = {"@@ray yes": True, "@@ray no": False}.get(ray_line.strip())
        version = next((line[len("@@version "):].strip()[:64] for line in res.stdout.splitlines()
                        if line.startswith("@@version ")), "") or None
        env = _image_env(res.stdout)
        said = res.stderr.strip()[-300:]
        said = f": {said}" if said else ""
        error = None if flags else (
            f"no answer within {inner}s (the question container was removed){said}"
            if res.exit_code in ENDED_BY_TIMEOUT and time.monotonic() - start >= inner - 1
            else f"exit {res.exit_code}, no flags listed{said}")
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
