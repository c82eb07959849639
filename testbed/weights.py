"""Real (tiny) model checkpoints for the testbed.

``generate()`` writes valid safetensors shards, ``model.safetensors.index.json`` (a ``weight_map`` like real
sharded checkpoints), ``config.json`` and small tokenizer files, in one of two layouts
(see docs/testbed.md ("The contract")):

- ``plain``:    ROOT/plain/ORG--NAME/{model-00001-of-0000N.safetensors, ..., index, config.json, ...}
- ``hf-cache``: ROOT/hub/models--ORG--NAME/{blobs/<hash>, refs/main, snapshots/REV/<file> -> ../../blobs/<hash>}
  exactly like huggingface_hub: LFS files (the shards) are named by the sha256 of their content, ordinary git
  files (json, tokenizer) by their git blob sha1; refs/main holds REV (no newline); snapshot entries are relative
  symlinks.

Content is deterministic: a shard's bytes depend only on (model_id, shard index, shard count, shard_bytes), so
regenerating gives identical files and identical blob names. Data is written in 1 MiB chunks.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path

from testbed.standin.safetensors_check import DTYPE_SIZES, ShardError, verify_shard

__all__ = [
    "INDEX_NAME",
    "ShardError",
    "generate",
    "install_snapshot",
    "model_dir",
    "shard_names",
    "verify_model",
    "verify_shard",
]

INDEX_NAME = "model.safetensors.index.json"
HIDDEN = 256  # columns of every 2-D tensor; a BF16 row is 512 bytes
ROW_BYTES = HIDDEN * DTYPE_SIZES["BF16"]
CHUNK = 1 << 20
_MODEL_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")
_REVISION = re.compile(r"^[A-Za-z0-9._-]{1,64}$")


def _check_ids(model_id: str, revision: str) -> tuple[str, str]:
    if not _MODEL_ID.match(model_id):
        raise ValueError(f"model id must look like ORG/NAME: {model_id!r}")
    if not _REVISION.match(revision):
        raise ValueError(f"bad revision: {revision!r}")
    org, name = model_id.split("/")
    return org, name


def model_dir(root: Path, model_id: str, revision: str, layout: str) -> Path:
    """Where generate() puts (or put) the model: the plain dir, or the snapshot dir for hf-cache."""
    org, name = _check_ids(model_id, revision)
    root = Path(root)
    if layout == "plain":
        return root / "plain" / f"{org}--{name}"
    if layout == "hf-cache":
        return root / "hub" / f"models--{org}--{name}" / "snapshots" / revision
    raise ValueError(f"layout must be 'plain' or 'hf-cache', not {layout!r}")


def shard_names(shards: int) -> list[str]:
    return [f"model-{i:05d}-of-{shards:05d}.safetensors" for i in range(1, shards + 1)]


# ---------------------------------------------------------------- shard content


def _tensor_layout(k: int, shards: int, shard_bytes: int) -> list[tuple[str, list[int]]]:
    """(name, shape) of the BF16 tensors of shard k (0-based), sized to ~shard_bytes of payload."""
    names2d = []
    names1d = [f"model.layers.{k}.input_layernorm.weight"]
    if k == 0:
        names2d.append("model.embed_tokens.weight")
    names2d += [f"model.layers.{k}.self_attn.qkv_proj.weight", f"model.layers.{k}.mlp.down_proj.weight"]
    if k == shards - 1:
        names1d.append("model.norm.weight")
        names2d.append("lm_head.weight")
    rows = max(shard_bytes // ROW_BYTES - len(names1d), len(names2d))
    per, extra = divmod(rows, len(names2d))
    out = [(n, [HIDDEN]) for n in names1d]
    for i, n in enumerate(names2d):
        out.append((n, [per + (extra if i == len(names2d) - 1 else 0), HIDDEN]))
    return out


def _shard_header(k: int, shards: int, shard_bytes: int) -> tuple[bytes, int, list[str]]:
    tensors = sorted(_tensor_layout(k, shards, shard_bytes))
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    pos = 0
    for name, shape in tensors:
        n = DTYPE_SIZES["BF16"]
        for d in shape:
            n *= d
        header[name] = {"dtype": "BF16", "shape": shape, "data_offsets": [pos, pos + n]}
        pos += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the crate pads the header to 8 bytes
    return len(raw).to_bytes(8, "little") + raw, pos, [t[0] for t in tensors]


def _payload_chunks(model_id: str, k: int, nbytes: int) -> Iterator[bytes]:
    seed = int.from_bytes(hashlib.sha256(f"{model_id}\0{k}".encode()).digest()[:8], "little")
    block = random.Random(seed).randbytes(min(CHUNK, max(nbytes, 1)))
    left = nbytes
    while left > 0:
        piece = block if left >= len(block) else block[:left]
        yield piece
        left -= len(piece)


def _write_atomic(dest_dir: Path, chunks: Iterable[bytes], hash_name: str | None = None) -> tuple[Path, str]:
    """Write chunks to a temp file in dest_dir; return (temp path, hexdigest of hash_name or '')."""
    h = hashlib.new(hash_name) if hash_name else None
    fd, tmp = tempfile.mkstemp(dir=dest_dir, prefix=".tmp-")
    try:
        with os.fdopen(fd, "wb") as f:
            for c in chunks:
                f.write(c)
                if h:
                    h.update(c)
    except BaseException:
        os.unlink(tmp)
        raise
    os.chmod(tmp, 0o644)
    return Path(tmp), (h.hexdigest() if h else "")


def _json_file(obj: object) -> bytes:
    return (json.dumps(obj, indent=2, sort_keys=False) + "\n").encode()


def _small_files(model_id: str, shards: int, index: dict[str, object]) -> dict[str, bytes]:
    name = model_id.split("/")[1]
    moe = "moe" in name.lower()
    config = {
        "architectures": ["Qwen3MoeForCausalLM" if moe else "LlamaForCausalLM"],
        "model_type": "qwen3_moe" if moe else "llama",
        "hidden_size": HIDDEN,
        "intermediate_size": HIDDEN * 4,
        "num_hidden_layers": shards,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 32768,
        "vocab_size": 32000,
        "torch_dtype": "bfloat16",
        "rms_norm_eps": 1e-06,
        "tie_word_embeddings": False,
        "transformers_version": "4.51.0",
        "_name_or_path": model_id,
    }
    if moe:
        config.update({"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": HIDDEN})
    return {
        "config.json": _json_file(config),
        "generation_config.json": _json_file({"bos_token_id": 1, "eos_token_id": 2, "max_new_tokens": 256}),
        INDEX_NAME: _json_file(index),
        "tokenizer_config.json": _json_file(
            {"bos_token": "<s>", "eos_token": "</s>", "model_max_length": 32768, "tokenizer_class": "LlamaTokenizer"}
        ),
        "tokenizer.json": _json_file(
            {
                "version": "1.0",
                "model": {"type": "BPE", "vocab": {"<unk>": 0, "<s>": 1, "</s>": 2, "a": 3, "b": 4}, "merges": []},
                "added_tokens": [],
            }
        ),
        "special_tokens_map.json": _json_file({"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}),
        "README.md": f"# {model_id}\n\nSynthetic checkpoint generated by the spark-reconciler testbed.\n".encode(),
    }


def _git_blob_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _remove_stale(d: Path, keep: set[str]) -> None:
    for p in d.iterdir():
        if p.name not in keep and (p.name.endswith(".safetensors") or p.name.startswith(".tmp-")):
            if p.is_dir() and not p.is_symlink():
                continue
            p.unlink()


def _model_dirs(target: Path, layout: str) -> Path | None:
    """Create the model directory (and for hf-cache the repo's blobs/ and refs/); return blobs/ (None: plain)."""
    if layout == "plain":
        target.mkdir(parents=True, exist_ok=True)
        return None
    repo = target.parent.parent
    blobs = repo / "blobs"
    blobs.mkdir(parents=True, exist_ok=True)
    (repo / "refs").mkdir(exist_ok=True)
    target.mkdir(parents=True, exist_ok=True)
    return blobs


def _write_blob(blobs: Path, chunks: Iterable[bytes], lfs: bool) -> str:
    """Write a blob named as huggingface_hub names it (LFS: sha256 of the content; else: git blob sha1)."""
    if lfs:
        tmp, digest = _write_atomic(blobs, chunks, "sha256")
    else:
        data = b"".join(chunks)
        tmp, _ = _write_atomic(blobs, [data])
        digest = _git_blob_sha1(data)
    os.replace(tmp, blobs / digest)
    return digest


def _link(target: Path, fname: str, rel: str) -> None:
    """target/fname -> rel, replaced atomically (left alone when it already points there)."""
    link = target / fname
    if link.is_symlink() and os.readlink(link) == rel:
        return
    tmp_link = target / f".tmp-link-{fname}"
    if tmp_link.is_symlink() or tmp_link.exists():
        tmp_link.unlink()
    os.symlink(rel, tmp_link)
    os.replace(tmp_link, link)


def _place(target: Path, blobs: Path | None, fname: str, chunks: Iterable[bytes], lfs: bool) -> None:
    """Write one file of the model: in place (plain), or as a blob with a snapshot symlink to it (hf-cache)."""
    if blobs is None:
        tmp, _ = _write_atomic(target, chunks)
        os.replace(tmp, target / fname)
        return
    digest = _write_blob(blobs, chunks, lfs)
    _link(target, fname, os.path.relpath(blobs / digest, target))


def _write_shards(target: Path, blobs: Path | None, model_id: str, names: list[str],
                  shard_bytes: int) -> dict[str, object]:
    """Write the shards; return the index (total size and the weight_map of tensor -> shard)."""
    weight_map: dict[str, str] = {}
    total = 0
    for k, fname in enumerate(names):
        head, payload, tensor_names = _shard_header(k, len(names), shard_bytes)
        total += payload
        for t in tensor_names:
            weight_map[t] = fname
        _place(target, blobs, fname, [head, *_payload_chunks(model_id, k, payload)], lfs=True)
    return {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}


def _write_ref(target: Path, revision: str) -> None:
    ref = target.parent.parent / "refs" / "main"
    if not (ref.exists() and ref.read_text() == revision):
        tmp, _ = _write_atomic(ref.parent, [revision.encode()])
        os.replace(tmp, ref)


def _prune_blobs(target: Path, blobs: Path) -> None:
    """Drop blobs nothing in any snapshot points to any more (stale shards of an earlier generate)."""
    used = set()
    for snap in (target.parent).iterdir():
        for p in snap.iterdir():
            if p.is_symlink():
                used.add(os.path.basename(os.readlink(p)))
    for b in blobs.iterdir():
        if b.name not in used:
            b.unlink()


def generate(root: Path, model_id: str, revision: str, layout: str, shards: int, shard_bytes: int) -> Path:
    """Write a checkpoint of ``shards`` safetensors files of ~``shard_bytes`` tensor payload each (rounded to
    512-byte rows, at least a few KiB). Returns the model directory (the snapshot directory for hf-cache).
    Idempotent: calling it again rewrites identical bytes and removes stale shards."""
    if shards < 1:
        raise ValueError("shards must be >= 1")
    shard_bytes = int(shard_bytes)
    if shard_bytes < 0:
        raise ValueError("shard_bytes must be >= 0")
    root = Path(root)
    target = model_dir(root, model_id, revision, layout)
    names = shard_names(shards)
    blobs = _model_dirs(target, layout)
    index = _write_shards(target, blobs, model_id, names, shard_bytes)
    small = _small_files(model_id, shards, index)
    for fname, data in small.items():
        _place(target, blobs, fname, [data], lfs=False)
    _remove_stale(target, set(names) | set(small))
    if blobs is not None:
        _write_ref(target, revision)
        _prune_blobs(target, blobs)
    return target


def install_snapshot(root: Path, model_id: str, revision: str, files: dict[str, bytes]) -> Path:
    """Lay out a real checkpoint's files (e.g. the real vLLM's tiny model) as huggingface_hub caches them:
    safetensors as LFS blobs, the rest as git blobs, refs/main = revision. Returns the snapshot directory."""
    target = model_dir(Path(root), model_id, revision, "hf-cache")
    blobs = _model_dirs(target, "hf-cache")
    assert blobs is not None
    for fname, data in sorted(files.items()):
        _place(target, blobs, fname, [data], lfs=fname.endswith(".safetensors"))
    _write_ref(target, revision)
    return target


def verify_model(model_path: Path) -> list[str]:
    """Check every shard the index names (or every *.safetensors); return the shard names checked.
    Raises FileNotFoundError / ShardError like the stand-in would report."""
    model_path = Path(model_path)
    index = model_path / INDEX_NAME
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in model_path.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no safetensors files in {model_path}")
    for f in files:
        verify_shard(model_path / f)
    return files
