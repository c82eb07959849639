import functools
import hashlib
import json
import os
import struct

import pytest

from reconciler.core.spec import parse_size
from testbed.weights import (
    INDEX_NAME,
    ShardError,
    generate,
    model_dir,
    verify_model,
    verify_shard,
)

REV = "1" * 40


def _files(d):
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


def test_plain_layout_is_valid_and_deterministic(tmp_path):
    d = generate(tmp_path, "testorg/tiny-moe", REV, "plain", 3, 64 * 1024)
    assert d == tmp_path / "plain" / "testorg--tiny-moe" == model_dir(tmp_path, "testorg/tiny-moe", REV, "plain")
    names = [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert verify_model(d) == names
    for n in ("config.json", INDEX_NAME, "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (d / n).is_file()
    index = json.loads((d / INDEX_NAME).read_text())
    assert set(index["weight_map"].values()) == set(names)
    # total_size is the sum of tensor payloads, as in real checkpoints
    total = 0
    for n in names:
        raw = (d / n).read_bytes()
        (hlen,) = struct.unpack("<Q", raw[:8])
        header = json.loads(raw[8 : 8 + hlen])
        assert header["__metadata__"] == {"format": "pt"}
        assert hlen % 8 == 0
        tensors = {k: v for k, v in header.items() if k != "__metadata__"}
        assert all(index["weight_map"][t] == n for t in tensors)
        end = max(v["data_offsets"][1] for v in tensors.values())
        assert len(raw) == 8 + hlen + end
        assert 64 * 1024 - 1024 <= end <= 64 * 1024 + 1024
        total += end
    assert index["metadata"]["total_size"] == total
    before = _files(d)
    assert generate(tmp_path, "testorg/tiny-moe", REV, "plain", 3, 64 * 1024) == d
    assert _files(d) == before
    other = generate(tmp_path / "x", "testorg/tiny-dense", REV, "plain", 3, 64 * 1024)
    assert (other / names[0]).read_bytes() != before[names[0]]


def test_hf_cache_layout_like_huggingface_hub(tmp_path):
    snap = generate(tmp_path, "testorg/tiny-dense", "2" * 40, "hf-cache", 2, 10_000)
    repo = tmp_path / "hub" / "models--testorg--tiny-dense"
    assert snap == repo / "snapshots" / ("2" * 40)
    assert (repo / "refs" / "main").read_text() == "2" * 40
    for entry in snap.iterdir():
        assert entry.is_symlink()
        target = os.readlink(entry)
        assert target.startswith("../../blobs/")
        blob = (snap / target).resolve()
        assert blob.parent == (repo / "blobs").resolve() and blob.is_file() and not blob.is_symlink()
        data = blob.read_bytes()
        if entry.name.endswith(".safetensors"):
            assert blob.name == hashlib.sha256(data).hexdigest()  # LFS files: sha256
        else:
            assert blob.name == hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()  # git blob sha1
    assert verify_model(snap) == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    blobs = sorted(p.name for p in (repo / "blobs").iterdir())
    generate(tmp_path, "testorg/tiny-dense", "2" * 40, "hf-cache", 2, 10_000)
    assert sorted(p.name for p in (repo / "blobs").iterdir()) == blobs
    # fewer shards: stale shards and their blobs go away
    generate(tmp_path, "testorg/tiny-dense", "2" * 40, "hf-cache", 1, 10_000)
    assert verify_model(snap) == ["model-00001-of-00001.safetensors"]
    assert len(list((repo / "blobs").iterdir())) == len(list(snap.iterdir()))


def test_big_shards_are_streamed_not_held_in_memory(tmp_path):
    """Bounded work: a 64 MiB shard is written in chunks (peak Python allocation well under one shard)."""
    import tracemalloc

    tracemalloc.start()
    try:
        d = generate(tmp_path, "testorg/big", REV, "hf-cache", 2, 64 << 20)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20, f"peak allocation {peak} bytes while writing 64 MiB shards"
    assert (d / "model-00001-of-00002.safetensors").stat().st_size > (64 << 20) - 4096


def test_verify_shard_detects_damage(tmp_path):
    d = generate(tmp_path, "testorg/tiny-moe", REV, "plain", 2, 20_000)
    shard = d / "model-00001-of-00002.safetensors"
    good = shard.read_bytes()
    verify_shard(shard)
    shard.write_bytes(good[:-10])
    with pytest.raises(ShardError, match="MetadataIncompleteBuffer"):
        verify_shard(shard)
    shard.write_bytes(good[:5])
    with pytest.raises(ShardError, match="HeaderTooSmall"):
        verify_shard(shard)
    shard.write_bytes(struct.pack("<Q", 10**9) + good[8:])
    with pytest.raises(ShardError, match="HeaderTooLarge"):
        verify_shard(shard)
    shard.write_bytes(good[:8] + b"[" + good[9:])
    with pytest.raises(ShardError, match="InvalidHeader"):
        verify_shard(shard)
    shard.unlink()
    with pytest.raises(FileNotFoundError):
        verify_model(d)


def test_broken_symlink_in_cache(tmp_path):
    snap = generate(tmp_path, "testorg/tiny-moe", REV, "hf-cache", 2, 20_000)
    (snap / "model-00002-of-00002.safetensors").resolve().unlink()
    with pytest.raises(FileNotFoundError):
        verify_shard(snap / "model-00002-of-00002.safetensors")


def test_bad_arguments(tmp_path):
    with pytest.raises(ValueError):
        generate(tmp_path, "no-slash", REV, "plain", 1, 10)
    with pytest.raises(ValueError):
        generate(tmp_path, "a/b", REV, "zip", 1, 10)
    with pytest.raises(ValueError):
        generate(tmp_path, "a/b", "../x", "hf-cache", 1, 10)
    size = functools.partial(parse_size, short_units=True)  # the testbed's sizes (`--weights-size 64M`)
    assert size("64K") == 65536 and size("1.5G") == 3 << 29 and size("10MiB") == 10 << 20


def test_the_difference_counts_each_missing_and_each_different_file():
    """What `plan` shows for a copy that lags: missing paths (or a broken link: no size) and files of another
    size or hash are counted apart, out of the source's count."""
    from reconciler.core.drift import weights_difference
    from reconciler.core.observed import WeightFile, Weights

    def f(path, size, sha=None):
        return WeightFile(path=path, size=size, mtime=1.0, sha256=sha)
    source = Weights(root="/m", present=True, files=[f("a", 1, "1" * 64), f("b", 2, "2" * 64), f("c", 3, "3" * 64),
                                                      f("d", 4), f("e", 5)])
    copy = Weights(root="/m", present=True, files=[f("a", 1, "1" * 64), f("b", 2, "f" * 64), f("c", 4),
                                                    f("d", None)])
    assert weights_difference(source, copy) == "2 missing, 2 different of 5 files"
    assert weights_difference(source, None) == "missing"
    assert weights_difference(source, Weights(root="/m", present=False)) == "missing"
    assert weights_difference(source, source) is None
