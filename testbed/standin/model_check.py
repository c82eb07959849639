"""Resolve ``vllm serve MODEL`` to a directory and check its weights the way vLLM would fail on them. Stdlib only."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from typing import Any

from safetensors_check import ShardError, verify_shard

INDEX_NAME = "model.safetensors.index.json"
CRASH_MARKER = ".standin-crash"
_HEX40 = re.compile(r"^[0-9a-f]{40}$")


class ModelError(Exception):
    """Carries the traceback-ish lines vLLM would print before exiting 1."""

    def __init__(self, *lines: str):
        self.lines = list(lines)
        super().__init__(lines[-1] if lines else "")


def hub_cache_dir(download_dir: str | None = None) -> str:
    if download_dir:
        return download_dir
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    home = os.environ.get("HF_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "huggingface")
    return os.path.join(home, "hub")


def offline() -> bool:
    return any(os.environ.get(v, "").upper() in ("1", "ON", "YES", "TRUE")
               for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def resolve(model: str, revision: str | None = None, download_dir: str | None = None) -> str:
    """Directory holding config.json and the shards, or ModelError."""
    if os.path.isdir(model):
        return os.path.abspath(model)
    parts = model.split("/")
    if model.startswith(("/", "./", "../")) or len(parts) > 2 or not all(parts):
        raise ModelError(
            "huggingface_hub.errors.HFValidationError: Repo id must be in the form 'repo_name' or "
            f"'namespace/repo_name': '{model}'. Use `repo_type` argument if needed.",
            f"ValueError: Invalid repository ID or local directory specified: '{model}'.",
        )
    cache = hub_cache_dir(download_dir)
    repo = os.path.join(cache, "models--" + model.replace("/", "--"))
    rev = revision or "main"
    commit = None
    if _HEX40.match(rev) and os.path.isdir(os.path.join(repo, "snapshots", rev)):
        commit = rev
    else:
        ref = os.path.join(repo, "refs", rev)
        try:
            with open(ref) as f:
                commit = f.read().strip()
        except OSError:
            commit = None
    snap = os.path.join(repo, "snapshots", commit) if commit else None
    if snap and os.path.isdir(snap):
        return snap
    if offline():
        raise ModelError(
            "huggingface_hub.errors.LocalEntryNotFoundError: Cannot find an appropriate cached snapshot folder for "
            "the specified revision on the local disk and outgoing traffic has been disabled. To enable repo "
            "look-ups and downloads online, set 'HF_HUB_OFFLINE=0' as environment variable.",
            f"OSError: {model} does not appear to have a file named config.json (revision {rev}, cache {cache}).",
        )
    # never any network here: behave like a node without internet
    raise ModelError(
        "requests.exceptions.ConnectionError: (MaxRetryError(\"HTTPSConnectionPool(host='huggingface.co', port=443): "
        f"Max retries exceeded with url: /api/models/{model}/revision/{rev} (Caused by NameResolutionError("
        "\"Failed to resolve 'huggingface.co' ([Errno -3] Temporary failure in name resolution)\"))\"))",
        "huggingface_hub.errors.LocalEntryNotFoundError: An error happened while trying to locate the files on the "
        "Hub and we cannot find the requested files in the local cache. Please check your connection and try again "
        "or make sure your Internet connection is on.",
    )


def read_config(path: str, model: str) -> dict[str, Any]:
    cfg = os.path.join(path, "config.json")
    try:
        with open(cfg) as f:
            config: dict[str, Any] = json.load(f)
            return config
    except FileNotFoundError:
        raise ModelError(
            f"OSError: {model} does not appear to have a file named config.json. Checkout "
            f"'{path}/tree/None' for available files."
        ) from None
    except ValueError as e:
        raise ModelError(f"json.decoder.JSONDecodeError: {e}") from None


def shard_files(path: str) -> tuple[list[str], list[str]]:
    """(shards present to load, shards the index names that are absent)."""
    index = os.path.join(path, INDEX_NAME)
    present = sorted(n for n in os.listdir(path) if n.endswith(".safetensors"))
    if os.path.lexists(index):
        try:
            with open(index) as f:
                wanted = sorted(set(json.load(f)["weight_map"].values()))
        except (OSError, ValueError, KeyError) as e:
            raise ModelError(f"{type(e).__name__}: {e} (while reading {index})") from None
        missing = [w for w in wanted if not os.path.lexists(os.path.join(path, w))]
        return [w for w in wanted if os.path.lexists(os.path.join(path, w))], missing
    return present, []


def check_weights(path: str, progress: Callable[[int, int], None] | None = None) -> int:
    """Verify every shard; returns total bytes. Raises ModelError with vLLM-like lines."""
    files, missing = shard_files(path)
    if not files and not missing:
        raise ModelError(f"RuntimeError: Cannot find any model weights with `{path}`")
    total = 0
    for i, name in enumerate(files, 1):
        p = os.path.join(path, name)
        try:
            verify_shard(p)
        except FileNotFoundError:
            raise ModelError(
                f"FileNotFoundError: [Errno 2] No such file or directory: '{p}'"
                + (f" (dangling symlink to {os.readlink(p)})" if os.path.islink(p) else "")
            ) from None
        except ShardError as e:
            raise ModelError(f"  File \"{p}\"", e.vllm_line()) from None
        except OSError as e:
            raise ModelError(f"OSError: {e}") from None
        total += os.path.getsize(p)
        if progress:
            progress(i, len(files) + len(missing))
    if missing:
        raise ModelError(
            "ValueError: Following weights were not initialized from checkpoint: "
            + "{" + ", ".join(f"'{m}'" for m in missing) + "} (shards listed in the index but absent)"
        )
    return total


def crash_marker(path: str) -> str | None:
    """A `.standin-crash` file in the model dir or any ancestor (the mounted model root) makes the engine crash."""
    p = os.path.abspath(path)
    while True:
        m = os.path.join(p, CRASH_MARKER)
        if os.path.exists(m):
            return m
        parent = os.path.dirname(p)
        if parent == p:
            return None
        p = parent
