"""Copy the model weights from the source node to a node that lacks them: rsync over the FABRIC address.

The source node pushes with rsync over SSH to the target's fabric IP (the 200 Gb/s link, not the 10G management
port). Safety properties, each from a failure seen in the field:
- real bytes, not symlinks: the whole `models--ORG--NAME` tree is copied (blobs included) and links pointing out
  of it become files (`--copy-unsafe-links`); afterwards the target's manifest (every path with its resolved
  size) must equal the source's, so "13 MB and 98 broken symlinks, copy complete" cannot pass;
- never a half-written file under its final name: rsync writes to a temporary name and renames when complete;
  an interrupted transfer keeps its data in `.rsync-partial/` and the next run resumes from it;
- strict host keys on the node-to-node hop too (`reconciler.steps.hop`).
Large models go in several parallel rsync streams (files split by size).
"""

from __future__ import annotations

import hashlib
import re
import shlex
import threading
from collections.abc import Callable
from dataclasses import dataclass

from reconciler.drift import weights_difference
from reconciler.observe import PARTIAL_DIR, manifest_script, parse_weights, split_sections, weights_root
from reconciler.observed import Weights
from reconciler.plan import Step
from reconciler.remote import CommandFailed
from reconciler.steps import StepContext, StepFailed, hop

RSYNC_IO_TIMEOUT = 60  # seconds without any data moved: the hop is dead (rsync exits 30, partial data kept)
_PROGRESS = re.compile(rb"([\d,]+)\s+\d+%")


def read_manifest(ctx: StepContext, node: str) -> Weights:
    root = weights_root(ctx.desired, node)
    out = ctx.sessions[node].run_script(manifest_script(root) + "\n", timeout=ctx.command_timeout).stdout
    return parse_weights(root, split_sections(out).get("weights"))


def _groups(files: list[tuple[str, int]], streams: int) -> list[list[str]]:
    """Split files into `streams` groups of similar total size (largest first, greedy)."""
    groups: list[tuple[int, list[str]]] = [(0, []) for _ in range(max(1, min(streams, len(files))))]
    for path, size in sorted(files, key=lambda f: -f[1]):
        total, members = min(groups, key=lambda g: g[0])
        groups.remove((total, members))
        groups.append((total + size, members + [path]))
    return [sorted(members) for _, members in groups if members]


def _rsync_argv(ctx: StepContext, source: str, target: str, src_root: str, dst_root: str,
                files_from: str | None) -> list[str]:
    ssh = shlex.join(hop.ssh_options(ctx, target))
    # --timeout: a stalled hop (a link down, a peer gone) ends rsync with exit 30 and its partial data kept for
    # the resume, instead of holding the step until its 12 h deadline.
    argv = ["rsync", "-a", "--copy-unsafe-links", f"--partial-dir={PARTIAL_DIR}", "--info=progress2",
            "--no-inc-recursive", f"--timeout={RSYNC_IO_TIMEOUT}", "-e", ssh]
    limit = ctx.desired.policy.weights.bandwidth_limit
    if limit:
        argv.append(f"--bwlimit={max(1, limit // 1024)}")
    if files_from:
        argv += [f"--files-from={files_from}", "--from0"]
    return argv + [f"{src_root}/", f"{hop.address(ctx, target)}:{dst_root}/"]


def _explain_failure(ctx: StepContext, target: str, dst_root: str, exc: CommandFailed, missing: int) -> str:
    text = exc.stderr + exc.stdout
    if "No space left" in text:
        df = ctx.sessions[target].run(["df", "-B1", "--output=avail", dst_root], timeout=ctx.command_timeout,
                                      check=False)
        avail = df.stdout.split()[-1] if df.ok and df.stdout.split() else "unknown"
        return (f"{target}: no space left on the filesystem of {dst_root}: {missing} bytes still to copy, "
                f"{avail} bytes available; partial data kept in {PARTIAL_DIR} for resume")
    return f"rsync to {target} failed (exit {exc.exit_code}): {text.strip()[-800:]}"


def _files_to_copy(expected: Weights, before: Weights) -> list[tuple[str, int]]:
    """(path, bytes) to move: regular files only (a link's size is its target's, which is counted once, as a
    blob), and only those the target does not already hold at the right size."""
    have = {f.path: f.size for f in before.files}
    return [(f.path, f.size or 0) for f in expected.files if f.link_target is None and have.get(f.path) != f.size]


def _stream_groups(expected: Weights, todo: list[tuple[str, int]], streams: int) -> list[list[str]]:
    """The files of each parallel rsync stream, split by size; [] for one stream over the whole tree.
    Everything not in a group (symlinks, empty files, refs) goes with the last stream, after the data."""
    groups = _groups([(p, s) for p, s in todo if s > 0], streams) if streams > 1 and len(todo) > 1 else []
    if groups:
        rest = sorted({f.path for f in expected.files} - {p for g in groups for p in g})
        groups[-1] = groups[-1] + rest
    return groups


def _upload_file_list(ctx: StepContext, source: str, target: str, index: int, files: list[str]) -> str:
    """Write a stream's file list on the source; returns its path relative to $HOME (rsync's cwd). A file, not
    stdin: the supervised rsync's stdin is the channel watch."""
    listing = f".cache/spark-reconciler/rsync-{target}-{index}.list"
    ctx.sessions[source].run(["sh", "-c", 'mkdir -p "$HOME/.cache/spark-reconciler" && cat > "$HOME/$0"',
                              listing], stdin=b"\0".join(f.encode() for f in files) + b"\0",
                             timeout=ctx.command_timeout)
    return listing


def _run_streams(run: Callable[[int, list[str] | None], None], groups: list[list[str]]) -> list[BaseException]:
    """One `run` per group, in parallel threads (one `run` over the whole tree without groups); returns what
    they raised, for the caller to re-raise in the step's thread."""
    errors: list[BaseException] = []

    def guarded(i: int, files: list[str] | None) -> None:
        try:
            run(i, files)
        except BaseException as exc:  # noqa: BLE001 - re-raised by the caller, in the step's thread
            errors.append(exc)

    if not groups:
        guarded(0, None)
        return errors
    threads = [threading.Thread(target=guarded, args=(i, g), daemon=True) for i, g in enumerate(groups)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return errors


def sync_weights(ctx: StepContext, step: Step) -> None:
    target, source = step.node, step.params["source"]
    src_root, dst_root = weights_root(ctx.desired, source), weights_root(ctx.desired, target)
    expected = read_manifest(ctx, source)
    if not expected.present:
        raise StepFailed(f"the weights are not present on the source {source} at {src_root}")
    before = read_manifest(ctx, target)
    if weights_difference(expected, before) is None:
        return
    todo = _files_to_copy(expected, before)
    total = sum(size for _, size in todo)
    ctx.sessions[target].run(["mkdir", "-p", dst_root], timeout=ctx.command_timeout)
    hop.trust_target_on_source(ctx, source, target)
    groups = _stream_groups(expected, todo, ctx.desired.policy.weights.parallel_streams)
    done = [0] * max(1, len(groups))
    lock = threading.Lock()
    ctx.progress("weights.start", {"node": target, "bytes_total": total, "files": len(todo),
                                   "streams": max(1, len(groups))})

    def run(index: int, files: list[str] | None) -> None:
        def seen(chunk: bytes) -> None:
            matches = _PROGRESS.findall(chunk)
            if matches:
                with lock:
                    done[index] = int(matches[-1].replace(b",", b""))
                    ctx.progress("weights.progress", {"node": target, "bytes_done": min(sum(done), total),
                                                      "bytes_total": total})

        listing = None if files is None else _upload_file_list(ctx, source, target, index, files)
        ctx.sessions[source].run(_rsync_argv(ctx, source, target, src_root, dst_root, listing),
                                 timeout=ctx.remaining(), on_output=seen, cancel=ctx.cancel, supervised=True)

    errors = _run_streams(run, groups)
    if errors:
        first = errors[0]
        if isinstance(first, CommandFailed):
            raise StepFailed(_explain_failure(ctx, target, dst_root, first, total - sum(done))) from None
        raise first
    after = read_manifest(ctx, target)
    problem = weights_difference(expected, after)
    if problem:
        raise StepFailed(f"after rsync, the weights on {target} still differ from {source}: {problem}")
    ctx.progress("weights.done", {"node": target, "bytes_total": total, "files": len(expected.files)})


# -- full verification (the flipped byte that sizes and mtimes cannot see) -------------------------------------

HASH_CACHE_DIR = ".cache/spark-reconciler"  # under the source node's $HOME


@dataclass(frozen=True)
class Verification:
    """What `verify_weights` found on one target: files whose sha256 differs from the source's, files the
    target has that the source does not, and how much was hashed."""

    node: str
    source: str
    checked: int
    mismatched: tuple[str, ...]
    extra: tuple[str, ...]
    hashed_on_source: int  # files the source had to hash (not answered from its cache)
    repaired: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        return not self.mismatched

    def message(self) -> str:
        if self.ok:
            return f"{self.node}: {self.checked} files match {self.source} (sha256)"
        return (f"{self.node}: {len(self.mismatched)} of {self.checked} files differ from {self.source} (sha256): "
                + ", ".join(self.mismatched[:10]))


def _sha256_lines(out: str) -> dict[str, str]:
    """`sha256sum` output -> {relative path: hex}; names with a newline or backslash come escaped with a
    leading backslash and are skipped (never produced by a model tree; the manifest check covers them)."""
    hashes = {}
    for line in out.splitlines():
        if len(line) < 67 or line.startswith("\\"):
            continue
        digest, path = line[:64], line[66:]
        hashes[path[2:] if path.startswith("./") else path] = digest
    return hashes


def _hash_files(session, root: str, paths: list[str], timeout: float, cancel=None) -> dict[str, str]:
    if not paths:
        return {}
    stdin = b"".join(f"./{p}".encode() + b"\0" for p in paths)
    # beside a serving vLLM: lowest CPU priority and the idle I/O class (where the disk's scheduler honours it)
    out = session.run(["sh", "-c", 'cd "$1" && if command -v ionice >/dev/null 2>&1; then set -- ionice -c 3; '
                       'else set --; fi; exec nice -n 19 "$@" xargs -0 -r sha256sum --', "sh", root], stdin=stdin,
                      timeout=timeout, cancel=cancel).stdout
    return _sha256_lines(out)


def _regular_files(session, root: str, follow: bool, timeout: float) -> dict[str, tuple[int, str]]:
    """{relative path: (size, mtime)} of the regular files under root (following links when `follow`),
    .rsync-partial excluded."""
    argv = ["find", *(["-L"] if follow else []), root, "-mindepth", "1", "-name", PARTIAL_DIR, "-prune", "-o",
            "-type", "f", "-printf", "%P\\t%s\\t%T@\\n"]
    result = session.run(argv, timeout=timeout, check=False)
    files = {}
    for line in result.stdout.splitlines():
        parts = line.split("\t")
        if len(parts) == 3 and parts[1].isdigit():
            files[parts[0]] = (int(parts[1]), parts[2])
    return files


def _cache_path(root: str) -> str:
    return f"{HASH_CACHE_DIR}/sha256-{hashlib.sha256(root.encode()).hexdigest()[:16]}.tsv"


def source_hashes(session, root: str, paths: list[str], timeout: float, cancel=None) -> tuple[dict[str, str], int]:
    """sha256 of `paths` (relative to root, links followed) on the source node, from the cache in
    ~/.cache/spark-reconciler/ where (path, size, mtime) did not change; the cache is rewritten (0600).
    Returns the hashes and how many files had to be hashed."""
    stats = _regular_files(session, root, follow=True, timeout=timeout)
    cache_file = _cache_path(root)
    cached = session.run(["sh", "-c", 'cat "$HOME/$1" 2>/dev/null || true', "sh", cache_file],
                         timeout=timeout).stdout
    known: dict[tuple[str, int, str], str] = {}
    for line in cached.splitlines():
        parts = line.split("\t")
        if len(parts) == 4 and parts[1].isdigit() and len(parts[3]) == 64:
            known[(parts[0], int(parts[1]), parts[2])] = parts[3]
    wanted = [p for p in paths if p in stats]
    hashes = {p: known[(p, *stats[p])] for p in wanted if (p, *stats[p]) in known}
    todo = [p for p in wanted if p not in hashes]
    hashes |= _hash_files(session, root, todo, timeout, cancel)
    # keep every still-valid entry (other targets may ask for other paths), replace the rest
    keep = {(p, *stats[p]): h for (p, size, mtime), h in known.items() if p in stats and stats[p] == (size, mtime)}
    keep |= {(p, *stats[p]): h for p, h in hashes.items()}
    text = "".join(f"{p}\t{size}\t{mtime}\t{h}\n" for (p, size, mtime), h in sorted(keep.items()))
    session.run(["sh", "-c", 'umask 077 && mkdir -p "$HOME/$(dirname "$1")" && cat > "$HOME/$1.tmp" && '
                 'mv -f "$HOME/$1.tmp" "$HOME/$1"', "sh", cache_file], stdin=text.encode(), timeout=timeout)
    return hashes, len(todo)


def verify_weights(desired, sessions, node: str, *, repair: bool = False, timeout: float = 3600,
                   cancel=None) -> Verification:
    """Full verification of one target: sha256 of every regular file of the model tree on `node` against the
    source's (cached there by path, size and mtime). With `repair`, the differing files are removed from the
    target, so the next reconcile sees them missing and re-syncs exactly those (rsync alone would skip them:
    same size, same mtime)."""
    source = desired.source_node
    src_root, dst_root = weights_root(desired, source), weights_root(desired, node)
    target = sessions[node]
    files = _regular_files(target, dst_root, follow=False, timeout=timeout)
    mine = _hash_files(target, dst_root, sorted(files), timeout, cancel)
    theirs, hashed = source_hashes(sessions[source], src_root, sorted(files), timeout, cancel)
    mismatched = tuple(sorted(p for p, h in mine.items() if p in theirs and theirs[p] != h))
    extra = tuple(sorted(p for p in mine if p not in theirs))
    repaired: tuple[str, ...] = ()
    if repair and mismatched:
        target.run(["rm", "-f", "--", *(f"{dst_root}/{p}" for p in mismatched)], timeout=timeout)
        repaired = mismatched
    return Verification(node=node, source=source, checked=len(mine), mismatched=mismatched, extra=extra,
                        hashed_on_source=hashed, repaired=repaired)
