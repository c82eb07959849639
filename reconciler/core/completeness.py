"""Whether a model tree on the source is the whole revision, judged from the probe's listing alone.

Why not trust `refs/<rev>` or the snapshot directory: huggingface_hub writes the ref before it fetches a single
file (`_snapshot_download.py`: `ref_path.write_text(commit_hash)` ahead of the `thread_map` of downloads; its own
offline branch says "we can't check if all the files are actually there"), and each file streams into
`blobs/<etag>.incomplete` until it is whole, then is renamed and linked from `snapshots/<sha>/`
(`file_download.py`, `_download_to_tmp_and_move`, `_create_symlink`). A download cut by the step's deadline, a
daemon restart, a reboot or a Hub error leaves exactly that: a ref, part of the snapshot and `.incomplete` blobs.
The next `hf download` fetches what is missing (clients before PR #4228 resumed a `.incomplete` with `Range:
bytes=N-`; 2.x starts each cut file over, under a name of its own).

Why a structural judgement and not a marker the download step writes when it finishes: most source trees were
downloaded by hand before the reconciler ever ran (the seed's head), and a marker would call every one of them
incomplete; and the Hub's file list is only reachable from a node with internet, once per download, not from
every observation. What the listing shows is enough for the ways a download is cut, because the client writes
in a fixed order:

* a blob still streaming is `*.incomplete` whose blob is not there yet (plain layout:
  `.cache/huggingface/download/*.incomplete`). huggingface_hub 2.x names them per process
  (`<etag>.<uuid8>.incomplete`, PR #4228): a killed download leaves them behind and the next one starts the file
  over beside them, so a partial next to its finished blob is a leftover, not a download in progress;
* a snapshot link whose blob is absent is broken (size None in the listing);
* sharded checkpoints name their count in every shard (`model-00010-of-00039.safetensors`, transformers'
  `SAFE_WEIGHTS_INDEX_NAME` convention), so a gap in the series is seen even before the index arrives;
* a ref with no file of its revision's snapshot yet is the cut right after `refs/<rev>` was written.

Pure: the listing in, a reason or None out. The download step asks the same question after `hf download` exits 0
(a tree that is still incomplete then holds a leftover the owner must look at: the step fails, naming it).
"""

from __future__ import annotations

import posixpath
import re
from collections import defaultdict
from collections.abc import Iterable

from reconciler.core.observed import WeightFile, Weights

#: transformers' shard names (`modeling_utils.py`: `{prefix}-{i:05d}-of-{n:05d}{ext}`) and the GGUF split's.
_SHARD = re.compile(r"^(?P<stem>.+)-(?P<i>\d{5})-of-(?P<n>\d{5})(?P<ext>\.[A-Za-z0-9_]+)$")
_COMMIT = re.compile(r"^[0-9a-f]{40}$")
PARTIAL_SUFFIX = ".incomplete"
#: How many offending paths a reason names (the count says the rest).
SHOWN = 3


def incomplete_reason(weights: Weights, revision: str, layout: str) -> str | None:
    """Why the tree is not the whole revision yet (the download must run, or resume), or None.

    Judged on the revision's own snapshot where the revision is a commit; for a branch or tag (whose commit only
    `refs/<rev>`'s bytes name) every snapshot in the tree must be whole."""
    files = weights.files
    streaming = _streaming(weights, layout)
    if streaming:
        return f"{_named(streaming)} still downloading ({PARTIAL_SUFFIX}: a cut `hf download`, which resumes)"
    groups = _revision_groups(files, revision, layout)
    if layout == "hf-cache" and any(f.path == f"refs/{revision}" for f in files) and not any(groups.values()):
        return f"refs/{revision} is written but no file of its snapshot is there yet (a cut `hf download`)"
    return next((why for where, members in sorted(groups.items())
                 if (why := _snapshot_reason(weights, where, members)) is not None), None)


def _snapshot_reason(weights: Weights, where: str, members: list[WeightFile]) -> str | None:
    """Why one snapshot directory (`where`, "" for the whole tree) is not whole: a link to a missing blob, or a
    shard its siblings' names promise; None when it is."""
    # a link leading out of the tree is broken in the listing too: the copy refuses that tree, saying why
    broken = [] if weights.unsafe_count else [f.path for f in members if f.link_target is not None and
                                              f.size is None]
    if broken:
        return f"{_named(broken)} link to blobs that are not there (a cut or pruned download)"
    count, gaps = missing_shards(posixpath.relpath(f.path, where) if where else f.path for f in members)
    if count:
        return f"{_count_named([posixpath.join(where, g) for g in gaps], count)} missing from a sharded checkpoint"
    return None


def _streaming(weights: Weights, layout: str) -> list[str]:
    """The partial files that stand for a file not yet whole. In a cache, `blobs/<etag>.incomplete` (clients
    before huggingface_hub PR #4228) or `blobs/<etag>.<uuid8>.incomplete` (2.x: one per process, removed on an
    exception but left behind by a kill, never resumed): one whose `blobs/<etag>` is there is a leftover of an
    earlier, cut attempt at a file that has since arrived whole. A plain dir's partials
    (`.cache/huggingface/download/<hash>.<etag>[.<uuid8>].incomplete`) cannot be matched to their file from
    the listing, so each counts; the download step names a leftover that outlives a finished download."""
    names = {f.path for f in weights.files}
    out = []
    for path in weights.partials:
        head, _, base = path.rpartition("/")
        if layout == "hf-cache" and head == "blobs" and f"blobs/{base.split('.', 1)[0]}" in names:
            continue
        out.append(path)
    return out


def _revision_groups(files: list[WeightFile], revision: str, layout: str) -> dict[str, list[WeightFile]]:
    """The snapshot directories to judge, each with its files: the whole tree ("") for a plain model dir; for a
    cache, `snapshots/<revision>/` when the revision is a commit, else every snapshot (the listing does not read
    which commit a branch's ref names)."""
    if layout != "hf-cache":
        return {"": [f for f in files if not f.path.startswith(".cache/")]}
    groups: dict[str, list[WeightFile]] = defaultdict(list)
    for f in files:
        parts = f.path.split("/", 2)
        if len(parts) == 3 and parts[0] == "snapshots":
            groups[f"snapshots/{parts[1]}"].append(f)
    if _COMMIT.match(revision):
        return {f"snapshots/{revision}": groups.get(f"snapshots/{revision}", [])}
    return dict(groups)


def missing_shards(paths: Iterable[str], shown: int = SHOWN) -> tuple[int, list[str]]:
    """How many shard names the checkpoint's own names promise and the listing lacks, and the first `shown` of
    them (sorted): for every `STEM-i-of-n.EXT` present, each of 1..n with the same stem, count and extension. The
    count is arithmetic and the names stop at `shown`: a hostile listing of `x-00001-of-99999` under 100,000
    stems costs no more than the listing."""
    seen: dict[tuple[str, int, str], set[int]] = defaultdict(set)
    for path in paths:
        m = _SHARD.match(path)
        if m and int(m["n"]) > 0:
            seen[m["stem"], int(m["n"]), m["ext"]].add(int(m["i"]))
    count, names = 0, list[str]()
    for (stem, n, ext), have in sorted(seen.items()):
        count += n - len({i for i in have if 1 <= i <= n})
        names += [f"{stem}-{i:05d}-of-{n:05d}{ext}" for i in _first_absent(have, n, shown - len(names))]
    return count, names


def _first_absent(have: set[int], n: int, k: int) -> list[int]:
    """The first `k` of 1..n not in `have`: at most len(have) + k steps, whatever n is."""
    out: list[int] = []
    i = 1
    while len(out) < k and i <= n:
        if i not in have:
            out.append(i)
        i += 1
    return out


def _named(paths: list[str]) -> str:
    return _count_named(paths[:SHOWN], len(paths))


def _count_named(first: list[str], count: int) -> str:
    shown = ", ".join(first)
    return shown if count <= len(first) else f"{shown} and {count - len(first)} more"
