"""Safetensors header checks, stdlib only.

Shared by the weight generator (testbed.weights) on the host and by the vLLM stand-in inside the serving image
(copied next to it), so both agree on what a valid shard is. Error texts follow the safetensors Rust crate
(``safetensors_rust.SafetensorError: Error while deserializing header: <Kind>``) so that logs look like vLLM's.
"""

from __future__ import annotations

import json
import os
import struct

# dtype -> bytes per element, as in the safetensors format
DTYPE_SIZES = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E5M2": 1,
    "F8_E4M3": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "F64": 8,
    "I64": 8,
    "U64": 8,
}

# the crate refuses headers above 100 MB
MAX_HEADER_BYTES = 100_000_000


class ShardError(Exception):
    """A shard that safetensors (and so vLLM) would refuse. ``kind`` is the crate's error kind."""

    def __init__(self, kind: str, detail: str = ""):
        self.kind = kind
        self.detail = detail
        super().__init__(f"Error while deserializing header: {kind}" + (f" ({detail})" if detail else ""))

    def vllm_line(self) -> str:
        """The exception line vLLM prints when loading such a shard (wording of current safetensors releases)."""
        text = _MESSAGES.get(self.kind, self.kind)
        return f"safetensors_rust.SafetensorError: Error while deserializing header: {text}"


# current safetensors wording per error kind (older releases printed the kind name itself)
_MESSAGES = {
    "HeaderTooSmall": "header too small",
    "HeaderTooLarge": "header too large",
    "InvalidHeaderLength": "invalid header length",
    "InvalidHeaderStart": "invalid header start",
    "InvalidHeaderDeserialization": "invalid JSON in header",
    "MetadataIncompleteBuffer": "incomplete metadata, file not fully covered",
    "InvalidOffset": "invalid offset",
    "TensorInvalidInfo": "invalid tensor info",
}


def _read_header(path: str) -> tuple[bytes, int]:
    """The raw JSON header and the file's size, after the checks on the 8-byte header length."""
    size = os.stat(path).st_size  # follows symlinks: FileNotFoundError on a dangling one
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ShardError("HeaderTooSmall")
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER_BYTES:
            raise ShardError("HeaderTooLarge")
        if 8 + n > size:
            raise ShardError("InvalidHeaderLength")
        raw = f.read(n)
    if len(raw) < n:
        raise ShardError("InvalidHeaderLength")
    return raw, size


def _parse_header(raw: bytes) -> dict[str, object]:
    """UTF-8, starting with `{`, a JSON object whose `__metadata__` (if any) maps str to str."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ShardError("InvalidHeader", str(e)) from None
    if not text.startswith("{"):
        raise ShardError("InvalidHeaderStart")
    try:
        header = json.loads(text)
    except ValueError as e:
        raise ShardError("InvalidHeaderDeserialization", str(e)) from None
    if not isinstance(header, dict):
        raise ShardError("InvalidHeaderDeserialization")
    meta = header.get("__metadata__", {})
    if meta is not None and not (isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values())):
        raise ShardError("InvalidHeaderDeserialization", "__metadata__ must map str to str")
    return header


def _tensor_span(name: str, info: object) -> tuple[int, int, str]:
    """(begin, end, name) of one tensor's data, after checking its dtype, shape and offsets agree."""
    if not isinstance(info, dict) or set(info) - {"dtype", "shape", "data_offsets"}:
        raise ShardError("InvalidHeaderDeserialization", name)
    dtype, shape, offs = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if dtype not in DTYPE_SIZES:
        raise ShardError("InvalidHeaderDeserialization", f"unknown dtype {dtype!r} for {name}")
    if not (isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)):
        raise ShardError("InvalidHeaderDeserialization", f"bad shape for {name}")
    if not (isinstance(offs, list) and len(offs) == 2 and all(isinstance(o, int) for o in offs)):
        raise ShardError("InvalidHeaderDeserialization", f"bad data_offsets for {name}")
    begin, end = offs
    if end < begin:
        raise ShardError("InvalidOffset", name)
    count = 1
    for d in shape:
        count *= d
    if count * DTYPE_SIZES[dtype] != end - begin:
        raise ShardError("TensorInvalidInfo", name)
    return begin, end, name


def _data_length(spans: list[tuple[int, int, str]]) -> int:
    """The length of the data section the tensors cover, which must be contiguous from 0 with no overlap."""
    pos = 0
    for begin, end, name in sorted(spans):
        if begin != pos:
            raise ShardError("InvalidOffset", name)
        pos = end
    return pos


def verify_shard(path: str | os.PathLike[str]) -> dict[str, object]:
    """Parse and check a safetensors file; return its header (tensor name -> info, plus ``__metadata__``).

    Checks: the file exists (a broken symlink raises FileNotFoundError, as open() would), the 8-byte header length,
    the JSON header, every tensor's dtype/shape/offsets (contiguous, no overlap) and that the data section is exactly
    as long as the offsets say (a truncated shard raises ShardError("MetadataIncompleteBuffer")).
    """
    raw, size = _read_header(os.fspath(path))
    header = _parse_header(raw)
    spans = [_tensor_span(name, info) for name, info in header.items() if name != "__metadata__"]
    if 8 + len(raw) + _data_length(spans) != size:
        raise ShardError("MetadataIncompleteBuffer")
    return header
