"""Copy the model weights from the source node to a node that lacks them: rsync over the FABRIC address.

The source node pushes with rsync to the target's fabric IP (the 200 Gb/s link, not the 10G management port): by
default to a one-time rsync daemon there, without a cipher (`reconciler.edge.steps.rsyncd`: one core's SSH cipher capped
each stream at ~0.45 GB/s on a Spark), or over SSH with `policy.weights.transport: ssh`. Either way the same rsync
options, and these safety properties, each from a failure seen in the field:
- real bytes, not symlinks: the whole `models--ORG--NAME` tree is copied (blobs included); links stay links where
  their value stays inside the tree by its text (`snapshots/REV/FILE -> ../../blobs/ETAG`), and a link whose value
  leaves it (absolute, or climbing out, like huggingface_hub's shared-store links `blobs/ETAG ->
  ../../blobs/XX/HASH`) becomes the file it points to. Afterwards the target's manifest (every path with its
  resolved size) must equal the source's, so "13 MB and 98 broken symlinks, copy complete" cannot pass;
- nothing from outside the model: a tree holding a link that leads out of it and out of the hub's blob store
  (to `~/.ssh`, the HF token, `/`) is refused, and so is a partial listing (the walk is bounded:
  `manifest.manifest_script`). What was checked is what is copied (issue 53, finding A): no rsync follows a
  link, nor carries one. Each file is read where the listing found it (a regular file at its path, a link copied
  as a file at the file it was resolved to, in the tree or the hub's blob store: `Listing.landing`), through its
  directory held open on the source since it was checked once more (`links_helper send`: opened from `/` down
  with no link followed, then rsync reads `FD/NAME` below `/proc/self/fd/`, the last component with O_NOFOLLOW).
  It lands in a staging directory below the target's root (`STAGING`), from which the reconciler moves it to its
  path as soon as it is whole (`start_receiving`), and makes the links kept as links (`make_links`), from the
  source's verified manifest, with no link followed on the target either (`links_helper`). So a swap of a store
  file or of a directory on the way for a link to `~/.ssh` between the listing and the read sends nothing (the step
  fails, naming it); neither a source nor a cable holding the daemon's secret can plant a link for a later stream
  to write through (issue 31: rsync 3.4.1's daemon could be led out of its module that way), and a target tree
  that already holds a link leading out is refused for the daemon;
- never a half-written file under its final name: rsync writes to a temporary name and renames when complete;
  an interrupted transfer keeps its data in `.rsync-partial/` and the next run resumes from it (the staged names are
  numbered from the source's whole listing, the same on every run);
- only the source gets in: the daemon's secret is made for the step and its door opens only to the source's fabric
  address (`rsyncd`); over SSH, strict host keys on the node-to-node hop too (`reconciler.edge.steps.hop`);
- on the disk before it is called done (`sync -f`), then the target's manifest must equal the source's;
- never a node's memory filled with its cache: both ends drop the tree's pages behind the copy (`drop_behind`).
Large models go in several parallel rsync streams (files split by size).
"""

from __future__ import annotations

import functools
import hashlib
import posixpath
import re
import threading
from collections.abc import Generator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from reconciler.core.drift import weights_difference
from reconciler.core.observed import Weights
from reconciler.core.planning import Step
from reconciler.core.spec import Desired
from reconciler.edge import ledger
from reconciler.edge.facts.disk import avail_fact
from reconciler.edge.manifest import PARTIAL_DIR, UNSAFE_SHOWN, Listing, listing_fact
from reconciler.edge.ssh import MAX_CHANNELS, CommandFailed, Session, Sessions, quote
from reconciler.edge.steps import hop, note
from reconciler.edge.steps.actions import (
    Action,
    Actions,
    Given,
    Parallel,
    Report,
    Run,
    Start,
    StepFailed,
    Stop,
    read,
)
from reconciler.edge.steps.drop_behind import end_bound, start_bound
from reconciler.edge.steps.links_helper import CHANGED, MAX_PINS, PIN_BASE, SOURCE, STAGING
from reconciler.edge.steps.retention import IN_UNLINKED_DIR, LINK_ON_THE_WAY
from reconciler.edge.steps.rsyncd import Door, confirm, start_daemon

_LINKS_HELPER = Path(__file__).with_name("links_helper.py").read_text()

RSYNC_IO_TIMEOUT = 60  # seconds without any data moved: the hop is dead (rsync exits 30, partial data kept)
# Regular files only, with their times and modes: no -l (links are made by `make_links`), no -L or -k (what was
# checked is read, never a link again: `links_helper send` refuses them), no -D, -o, -g (the one-time daemon
# refuses each: `rsyncd_helper.REFUSED`).
COPY_OPTIONS = ("--recursive", "--times", "--perms")
# Streams of one copy (`_stream_groups`): at most this many, all on the source's bulk connection (`Session.bulk`),
# whose channel budget (MAX_CHANNELS = 9) holds them with room to spare; a larger `parallel_streams` is held to it
# (its field says so). It was per kind of run, when the checked links had runs of their own.
BULK_STREAMS = MAX_CHANNELS // 2
_PROGRESS = re.compile(rb"([\d,]+)\s+\d+%")


def read_manifest(given: Given, node: str) -> Generator[Action, Any, Weights]:
    """The weights tree on `node` as the probe lists it now."""
    return (yield from read(node, listing_fact(given.desired.weights_root(node)))).weights


# -- links: which rsync keeps, which are copied as files, which trees are refused ---------------------------------

def rsync_keeps_link(path: str, value: str) -> bool:
    """Whether the link `path -> value` (path relative to the tree's top) is made as a link on the target: its value
    stays inside the tree by its text alone, never resolved. The rule is `unsafe_symlink()` of rsync's util1.c as of
    3.4 (CVE-2024-12088), stricter than 3.2's (a `..` after a name, or at the end, is unsafe too), the one rsync's
    `--safe-links` applied when rsync still carried links. Absolute or empty: never kept."""
    if not value or value.startswith("/"):
        return False
    rest = value
    while rest.startswith("../"):
        rest = rest[3:].lstrip("/")
    if "/../" in rest or (len(value) > 3 and value.endswith("/..")):
        return False
    return _stays_inside(value, _link_depth(path))


def _link_depth(path: str) -> int:
    """How deep the link `path` sits below the tree's top, counted as rsync counts it: its safety margin."""
    *dirs, last = re.split("/+", path)
    depth = 0
    for name in dirs:
        depth = 0 if name == ".." else depth if name == "." else depth + 1
    return 0 if last == ".." else depth


def _stays_inside(value: str, depth: int) -> bool:
    """Whether the link's value, followed by its text from `depth` below the top, never climbs above it."""
    *steps, last = re.split("/+", value)
    for name in steps:
        if name == "..":
            depth -= 1
            if depth < 0:
                return False
        elif name != ".":
            depth += 1
    if last == "..":
        depth -= 1
    return depth >= 0


def links_to_make(expected: Weights) -> list[tuple[str, str]]:
    """(path, value) of the links made as links on the target (`make_links`): every link not copied as a file.
    `refusal` has already refused a tree holding any other kind."""
    copied = links_to_copy(expected)
    return sorted((f.path, f.link_target) for f in expected.files
                  if f.link_target is not None and f.path not in copied
                  and inside_tree(f.path) and rsync_keeps_link(f.path, f.link_target))


def make_links(target: str, root: str, links: list[tuple[str, str]]) -> Actions:
    """Make `links` below `root` on `target`, never through a link on the way (`links_helper`)."""
    if not links:
        return
    said = yield Run(target, ("python3", "-c", _LINKS_HELPER, root),
                     stdin=b"".join(p.encode() + b"\0" + v.encode() + b"\0" for p, v in links), check=False)
    if not said.ok:
        raise StepFailed(f"making the model's links on {target} failed (exit {said.exit_code}): "
                         f"{said.stderr.strip()[-800:]}")


def start_receiving(given: Given, target: str, root: str,
                    moves: list[tuple[str, str]]) -> Generator[Action, Any, Start]:
    """`links_helper receive` beside the copy on `target`: the root (as `mkdir -p` made it), its staging directory
    made and cleared of links, and each file moved from there to its path as soon as it arrived, never through a
    link on the way; a copy interrupted half-way keeps its whole files at their paths."""
    pairs = b"".join(s.encode() + b"\0" + p.encode() + b"\0" for s, p in moves)
    helper = Start(target, ("python3", "-c", _LINKS_HELPER, "receive", root,
                            str(int(given.desired.policy.timeouts.weights_sync))),
                   stdin=f"{len(pairs)}\n".encode() + pairs)
    first = yield helper
    if first != "ready":
        said = yield Stop(helper, "finish")
        raise StepFailed(f"the copy's staging directory {root}/{STAGING} on {target} could not be made (exit "
                         f"{said.exit_code}): {(said.stderr or first or 'no output').strip()[-800:]}")
    return helper


def finish_receiving(helper: Start) -> Actions:
    """Its last look once every stream ended: each file must have arrived and be at its path."""
    said = yield Stop(helper, "end")
    if said.exit_code != 0:
        raise StepFailed(f"moving the copied files into place on {helper.node} failed (exit {said.exit_code}): "
                         f"{said.stderr.strip()[-800:]}")


def links_to_copy(expected: Weights) -> set[str]:
    """The links copied as the file they point to: those that land on a regular file inside the tree or the hub's
    blob store (the manifest gave them that file's size) and whose value rsync would not keep."""
    return {f.path for f in expected.files
            if f.link_target is not None and f.size is not None and not rsync_keeps_link(f.path, f.link_target)}


def _unsafe(weights: Weights) -> str:
    more = weights.unsafe_count - len(weights.unsafe)
    return "; ".join(weights.unsafe) + (f"; and {more} more" if more > 0 else "")


def refusal(weights: Weights, node: str) -> str | None:
    """Why the tree on `node` must not be synced from, or None: a partial listing, a link leading out of the tree,
    or a link rsync would neither keep nor copy as a file inside (absolute or climbing out, and not landing on a
    regular file inside: broken, a loop, a directory)."""
    where = f"the weights tree on {node} at {weights.root}"
    if weights.truncated:
        return f"{where} is not fully listed ({weights.truncated}): refusing to sync from a partial view"
    if weights.unsafe_count:
        return (f"{where} has {weights.unsafe_count} link(s) leading out of it: {_unsafe(weights)}. Refusing to "
                "sync (rsync would copy what they point to): replace each with the file it stands for, or remove it")
    stuck = [f"{f.path} -> {f.link_target}" for f in weights.files if f.link_target is not None and f.size is None
             and not rsync_keeps_link(f.path, f.link_target)]
    if stuck:
        more = f"; and {len(stuck) - UNSAFE_SHOWN} more" if len(stuck) > UNSAFE_SHOWN else ""
        return (f"{where} has {len(stuck)} link(s) that rsync would not keep (absolute, or climbing out of the tree) "
                f"and that do not land on a file inside it: {'; '.join(stuck[:UNSAFE_SHOWN])}{more}. Refusing to "
                "sync: make them relative links inside the tree, or replace them with the files")
    return None


def _groups(files: list[tuple[str, int]], streams: int) -> list[list[str]]:
    """Split files into `streams` groups of similar total size (largest first, greedy)."""
    groups: list[tuple[int, list[str]]] = [(0, []) for _ in range(max(1, min(streams, len(files))))]
    for path, size in sorted(files, key=lambda f: -f[1]):
        total, members = min(groups, key=lambda g: g[0])
        groups.remove((total, members))
        groups.append((total + size, members + [path]))
    return [sorted(members) for _, members in groups if members]


def _rsync_argv(desired: Desired, source: str, target: str, files_from: str | None,
                door: Door | None = None) -> tuple[str, ...]:
    """The source's rsync for one stream: to the one-time daemon at `door` (its secret on stdin, bound to the
    source's fabric address, which is the only peer the daemon accepts), or over ssh (`policy.weights.transport:
    ssh`). It runs as `links_helper send` makes it (`_sender`): it reads `FD/NAME` below /proc/self/fd/, each FD a
    directory held open since it was checked, into the staging directory below the target's root."""
    # --timeout: a stalled hop (a link down, a peer gone) ends rsync with exit 30 and its partial data kept for
    # the resume, instead of holding the step until its 12 h deadline.
    # Links: none followed, none carried. Never --copy-links (issue 53: it resolved each checked link again when it
    # read it, after any swap) nor --copy-unsafe-links (it copies whatever an outside link points to: a link to /
    # copies the whole disk).
    dst_root = desired.weights_root(target)
    argv = ["rsync", *COPY_OPTIONS, f"--partial-dir={PARTIAL_DIR}", "--info=progress2", "--no-inc-recursive",
            f"--timeout={RSYNC_IO_TIMEOUT}"]
    if door is not None:
        argv += ["--password-file=-", f"--address={desired.node(source).fabric.address.ip}"]
    else:
        argv += ["-e", quote(hop.ssh_options(desired, target))]
    limit = desired.policy.weights.bandwidth_limit
    if limit:
        argv.append(f"--bwlimit={max(1, limit // 1024)}")
    if files_from:
        argv += [f"--files-from={files_from}", "--from0"]
    return (*argv, SOURCE, f"{door.url()}{STAGING}/" if door is not None
            else f"{hop.address(desired, target)}:{dst_root}/{STAGING}/")


def _sender(instructions: str, rsync: tuple[str, ...]) -> tuple[str, ...]:
    """A stream as the source runs it: `links_helper send` holds and checks what the listing checked, then execs
    `rsync` (the same process: its stdin, its output, its signals)."""
    return ("python3", "-c", _LINKS_HELPER, "send", instructions, *rsync)


def _explain_failure(given: Given, target: str, exc: CommandFailed, expected: Weights,
                     copied: set[str]) -> Generator[Action, Any, str]:
    text = exc.stderr + exc.stdout
    if exc.exit_code == CHANGED:
        return (f"the source's tree changed after it was checked, so what changed was not sent to {target} (the copy "
                f"reads only what the listing checked; the next cycle lists it again): {text.strip()[-800:]}")
    if "No space left" not in text:
        return f"rsync to {target} failed (exit {exc.exit_code}): {text.strip()[-800:]}"
    dst_root = given.desired.weights_root(target)
    avail = yield from read(target, avail_fact(dst_root))
    # from the target's files, not the sender's progress: a sender counts what it sent, and the socket's buffers
    # held much of that when the receiver's disk filled up
    missing = sum(size for _, size in _files_to_copy(expected, (yield from read_manifest(given, target)), copied))
    return (f"{target}: no space left on the filesystem of {dst_root}: {missing} bytes still to copy, "
            f"{avail if avail is not None else 'unknown'} bytes available; partial data kept in {PARTIAL_DIR} "
            "for resume")


def _files_to_copy(expected: Weights, before: Weights, copied: set[str] | None = None) -> list[tuple[str, int]]:
    """(path, bytes) to move: regular files, and the links copied as files (`copied`), that the target does not
    already hold at the right size. A link kept as a link moves no bytes (its target is counted once, as a blob)."""
    have = {f.path: f.size for f in before.files}
    copied = copied or set()
    return [(f.path, f.size or 0) for f in expected.files
            if (f.link_target is None or f.path in copied) and have.get(f.path) != f.size]


@dataclass(frozen=True)
class Plan:
    """The copy as the source's listing checked it. Each file to move is named by where it is read (`FD/NAME`: FD
    the source's directory held open for it, numbered from PIN_BASE over the whole listing, so a resumed copy finds
    its partial data under the same staged name), with its size; the directories to hold (FD: the canonical root,
    the tree's or the hub's blob store's, and the directory below it); where each file goes in the tree."""

    sends: dict[str, int]
    pins: dict[int, tuple[str, str]]
    moves: list[tuple[str, str]]  # (FD/NAME, path in the tree)


def _plan(listing: Listing, todo: list[tuple[str, int]], copied: set[str]) -> Plan:
    """Where each file of `todo` is read: a regular file at its path below the tree's canonical root (physical:
    the listing's walk follows no link), a link copied as a file at the file the listing resolved it to
    (`Listing.landing`), never through the link. Two paths of one file are read once."""
    where: dict[str, tuple[str, str]] = {}
    for f in listing.weights.files:
        if f.link_target is None and listing.tree is not None:
            where[f.path] = (listing.tree, f.path)
        elif f.path in copied and f.path in listing.landing:
            where[f.path] = listing.landing[f.path]
    folders = sorted({(root, posixpath.dirname(rel)) for root, rel in where.values()})
    if len(folders) > MAX_PINS:
        raise StepFailed(f"the weights tree at {listing.weights.root} spans {len(folders)} directories: more than "
                         f"the copy holds open ({MAX_PINS})")
    numbers = {folder: PIN_BASE + i for i, folder in enumerate(folders)}
    plan = Plan({}, {}, [])
    for path, size in todo:
        if path not in where:
            raise StepFailed(f"the listing of the weights tree at {listing.weights.root} does not say where {path} "
                             "is (no canonical path printed): refusing to copy it")
        root, rel = where[path]
        number = numbers[(root, posixpath.dirname(rel))]
        staged = f"{number}/{posixpath.basename(rel)}"
        plan.sends[staged] = size
        plan.pins[number] = (root, posixpath.dirname(rel))
        plan.moves.append((staged, path))
    return plan


def _instructions(plan: Plan, files: list[str]) -> bytes:
    """One stream's instructions for `links_helper send`: the directories it holds, then each file with its size."""
    numbers = sorted({int(staged.split("/", 1)[0]) for staged in files})
    records: list[tuple[str, ...]] = [("P", str(n), *plan.pins[n]) for n in numbers]
    records += [("F", *staged.split("/", 1), str(plan.sends[staged])) for staged in files]
    return b"".join("\0".join(record).encode() + b"\0" for record in records)


def _stream_groups(sends: dict[str, int], streams: int) -> list[list[str]]:
    """The file list of each rsync run: the files with bytes to move split by size into `streams` groups; the
    empty ones go with the last group, after the data. Every file to send is in exactly one list; no link is in any
    (`make_links` makes the links kept as links; a link copied as a file is read at its file)."""
    groups = _groups([(staged, size) for staged, size in sends.items() if size > 0], streams)
    rest = sorted(staged for staged, size in sends.items() if size == 0)
    if groups:
        groups[-1] = groups[-1] + rest
    elif rest:
        groups = [rest]
    return groups


def _upload_file_list(source: str, target: str, tree: str, index: int,
                      instructions: bytes) -> Generator[Action, Any, tuple[str, str]]:
    """Write a stream's instructions on the source (`links_helper send` reads them and writes rsync's own list
    beside them, of what it checked); returns both paths relative to $HOME (rsync's cwd). A file, not
    stdin: the supervised rsync's stdin is the channel watch. Named by the target and the tree it fills (a hash of
    its root): two deployments' copies to one node run at once, and with one name each overwrote the other's list
    (found by the seed's mix on the testbed: rsync then looked for one model's files in the other's tree). In the
    SSH user's own 0700 directory (HASH_CACHE_DIR), never ~/.cache, where whoever writes it could rewrite the
    list between this write and rsync's read (issue 53, finding M)."""
    stem = f"{HASH_CACHE_DIR}/rsync-{target}-{hashlib.sha256(tree.encode()).hexdigest()[:12]}-{index}"
    yield Run(source, ("sh", "-c", 'umask 077 && mkdir -p "$HOME/${0%/*}" && cat > "$HOME/$0"', f"{stem}.list"),
              stdin=instructions)
    return f"{stem}.list", f"{stem}.from"


class StreamMeter:
    """The bytes all streams moved, from each one's `--info=progress2` lines: the progress report of the copy.
    Fed one chunk at a time (the executor serialises the streams' output)."""

    def __init__(self, node: str, total: int, streams: int):
        self.node, self.total, self.done = node, total, [0] * streams

    def feed(self, index: int, chunk: bytes) -> Report | None:
        matches = _PROGRESS.findall(chunk)
        if not matches:
            return None
        self.done[index] = int(matches[-1].replace(b",", b""))
        return Report("weights.progress", {"node": self.node, "bytes_done": min(sum(self.done), self.total),
                                           "bytes_total": self.total})


def _refuse_target(before: Weights, target: str) -> None:
    """A link already in the target's tree that leads out is a way out for whatever writes through it: rsync's
    receiver (a daemon <= 3.4.1 follows links on its path) and `make_links` (which refuses, but after the data)."""
    blocked = refusal(before, target) if before.present else None
    if blocked:
        raise StepFailed(f"{blocked} (a copy into it could be led out of the tree)")


def _streams(given: Given, step: Step, plan: Plan, groups: list[list[str]], meter: StreamMeter,
             door: Door | None) -> Generator[Action, Any, None]:
    """Each stream's instructions written on the source, then all its rsyncs at once on the source's bulk
    connection (every one runs to its end; the first failure is raised once all ended)."""
    target, source = step.node, step.source
    assert source is not None
    runs = []
    for index, files in enumerate(groups):
        send, listing = yield from _upload_file_list(source, target, given.desired.weights_root(target), index,
                                                     _instructions(plan, files))
        runs.append(Run(source, _sender(send, _rsync_argv(given.desired, source, target, listing, door)),
                        stdin=f"{door.secret}\n".encode() if door is not None else None,
                        timeout=given.desired.policy.timeouts.weights_sync, long=True, bulk=True,
                        on_output=functools.partial(meter.feed, index)))
    yield Parallel(tuple(runs))


def sync_weights(given: Given, step: Step) -> Actions:
    """Re-checks first: the source's tree is there and safe to copy from, the target's differs and is safe to
    copy into. Then the copy between the page-cache bounds, the links, `sync -f` and the manifests compared."""
    target, source = step.node, step.source
    assert source is not None, "the plan sets it for a weights step"
    desired = given.desired
    src_root, dst_root = desired.weights_root(source), desired.weights_root(target)
    listing = yield from read(source, listing_fact(src_root))
    expected = listing.weights
    if not expected.present:
        raise StepFailed(f"the weights are not present on the source {source} at {src_root}")
    refused = refusal(expected, source)
    if refused:
        raise StepFailed(refused)
    before = yield from read_manifest(given, target)
    if weights_difference(expected, before) is None:
        return
    _refuse_target(before, target)
    # only a tree this cluster began is its copy (retention may remove it later): one it topped up may be a person's
    fresh = not before.present
    if fresh:
        yield from note(given, target, ("started", "weights", dst_root, "-"))
    copied = links_to_copy(expected)
    todo = _files_to_copy(expected, before, copied)
    plan = _plan(listing, todo, copied)
    total = sum(size for _, size in todo)
    receiving = yield from start_receiving(given, target, dst_root, plan.moves)
    groups = _stream_groups(plan.sends, min(desired.policy.weights.parallel_streams, BULK_STREAMS))
    yield Report("weights.start", {"node": target, "bytes_total": total, "files": len(todo),
                                   "streams": len(groups)})
    src_bound = yield from start_bound(given, source, src_root)
    dst_bound = yield from start_bound(given, target, dst_root)
    if groups:
        daemon, door = None, None
        if desired.policy.weights.transport == "rsync-daemon":
            daemon, door = yield from start_daemon(given, source, target, dst_root, len(groups))
        else:
            yield from hop.trust_target_on_source(desired, source, target)
        try:
            yield from _streams(given, step, plan, groups, StreamMeter(target, total, len(groups)), door)
        except CommandFailed as exc:
            if daemon is not None:
                yield Stop(daemon, "close")
            raise StepFailed((yield from _explain_failure(given, target, exc, expected, copied))) from None
        if daemon is not None:
            yield from confirm(daemon)
    yield from finish_receiving(receiving)
    yield from make_links(target, dst_root, links_to_make(expected))
    after = yield from _check_copy(given, expected, source, target)
    yield from end_bound(dst_bound)
    yield from end_bound(src_bound)
    yield Report("weights.done", {"node": target, "bytes_total": total, "files": len(expected.files)})
    yield from _record_copy(given, target, after, fresh)


def _record_copy(given: Given, target: str, after: Weights, fresh: bool) -> Actions:
    """The copy into the ledger (retention may remove it later), when this cluster began the tree: in this step,
    or in one interrupted before it (its `started` line)."""
    dst_root = given.desired.weights_root(target)
    if not fresh:
        fresh = dst_root in (yield from read(target, ledger.started_fact(target, given.owner.label)))
    if fresh:
        yield from note(given, target, ("copied", "weights", dst_root, after.digest()))


def _check_copy(given: Given, expected: Weights, source: str, target: str) -> Generator[Action, Any, Weights]:
    """Make the copy durable (before it is called done: the page cache still holds much of it, and a power cut
    would lose that), then require the target's manifest to equal the source's."""
    dst_root = given.desired.weights_root(target)
    yield Run(target, ("sync", "-f", dst_root), timeout=given.desired.policy.timeouts.weights_sync)
    after = yield from read_manifest(given, target)
    problem = weights_difference(expected, after)
    if problem:
        raise StepFailed(f"after rsync, the weights on {target} still differ from {source}: {problem}")
    if after.truncated or after.unsafe_count:
        raise StepFailed(f"after rsync, the weights tree on {target} at {dst_root} "
                         + (f"is not fully listed ({after.truncated})" if after.truncated else
                            f"holds link(s) leading out of it, not made by the reconciler: {_unsafe(after)}; "
                            "remove them"))
    return after


# -- full verification (the flipped byte that sizes and mtimes cannot see) -------------------------------------

# Under the source node's $HOME: the SSH user's own 0700 directory (the lease's and the ledger's), where no one
# else writes. It was `.cache/spark-reconciler`, which anyone who can write ~/.cache (a co-tenant container that
# mounts it) could fill with entries `verify` believed: a forged hash for a flipped byte (issue 53, finding M).
HASH_CACHE_DIR = ".spark-reconciler"


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
    problem: str | None = None  # a tree not fully listed, or links leading out of one: not all could be compared

    @property
    def ok(self) -> bool:
        return not self.mismatched and self.problem is None

    def message(self) -> str:
        if self.ok:
            return f"{self.node}: {self.checked} files match {self.source} (sha256)"
        text = f"{self.node}: {len(self.mismatched)} of {self.checked} files differ from {self.source} (sha256)"
        if self.mismatched:
            text += ": " + ", ".join(self.mismatched[:10])
        return text + (f"; {self.problem}" if self.problem else "")


def _sha256_lines(out: str) -> dict[str, str]:
    """`sha256sum` output -> {relative path: hex}; names with a newline or backslash come escaped with a
    leading backslash and are skipped (never produced by a model tree; the manifest check covers them)."""
    hashes: dict[str, str] = {}
    for line in out.splitlines():
        if len(line) < 67 or line.startswith("\\"):
            continue
        digest, path = line[:64], line[66:]
        hashes[path[2:] if path.startswith("./") else path] = digest
    return hashes


def _listing(session: Session, root: str, timeout: float) -> Listing:
    return listing_fact(root).read(session, timeout)


def _hash_files(session: Session, root: str, paths: list[str], timeout: float,
                cancel: threading.Event | None = None) -> dict[str, str]:
    if not paths:
        return {}
    stdin = b"".join(f"./{p}".encode() + b"\0" for p in paths)
    # beside a serving vLLM: lowest CPU priority and the idle I/O class (where the disk's scheduler honours it)
    out = session.run(["sh", "-c", 'cd "$1" && if command -v ionice >/dev/null 2>&1; then set -- ionice -c 3; '
                       'else set --; fi; exec nice -n 19 "$@" xargs -0 -r sha256sum --', "sh", root], stdin=stdin,
                      timeout=timeout, cancel=cancel).stdout
    return _sha256_lines(out)


def _cache_path(root: str) -> str:
    return f"{HASH_CACHE_DIR}/sha256-{hashlib.sha256(root.encode()).hexdigest()[:16]}.tsv"


def source_hashes(session: Session, root: str, paths: list[str], timeout: float,
                  cancel: threading.Event | None = None,
                  stats: dict[str, tuple[int, str]] | None = None) -> tuple[dict[str, str], int]:
    """sha256 of `paths` (relative to root) on the source node, from the cache in ~/.spark-reconciler/ (0700,
    HASH_CACHE_DIR) where (path, size, mtime) did not change; the cache is rewritten (0600). Only what the
    manifest resolved inside the tree is hashed (`stats`, read here when not given: a regular file, or a link
    landing on one inside the tree or the hub's blob store, keyed by that file's size and mtime); a path it did
    not resolve (a link leading out, a broken one) is not hashed. Returns the hashes and how many files had to be
    hashed."""
    if stats is None:
        stats = _listing(session, root, timeout).resolved
    cache_file = _cache_path(root)
    known = _read_hash_cache(session, cache_file, timeout)
    wanted = [p for p in paths if p in stats]
    hashes = {p: known[(p, *stats[p])] for p in wanted if (p, *stats[p]) in known}
    todo = [p for p in wanted if p not in hashes]
    hashes |= _hash_files(session, root, todo, timeout, cancel)
    _write_hash_cache(session, cache_file, known, hashes, stats, timeout)
    return hashes, len(todo)


#: A hash cache's key: (path, size, mtime) of the file the hash was made of.
_CacheKey = tuple[str, int, str]


def _read_hash_cache(session: Session, cache_file: str, timeout: float) -> dict[_CacheKey, str]:
    """The source's hash cache (`PATH\tSIZE\tMTIME\tSHA256` lines); a line that does not read so is skipped."""
    cached = session.run(["sh", "-c", 'cat "$HOME/$1" 2>/dev/null || true', "sh", cache_file],
                         timeout=timeout).stdout
    known: dict[_CacheKey, str] = {}
    for line in cached.splitlines():
        parts = line.split("\t")
        if len(parts) == 4 and parts[1].isdigit() and len(parts[3]) == 64:
            known[(parts[0], int(parts[1]), parts[2])] = parts[3]
    return known


def _write_hash_cache(session: Session, cache_file: str, known: dict[_CacheKey, str], hashes: dict[str, str],
                      stats: dict[str, tuple[int, str]], timeout: float) -> None:
    """Rewrite the cache (0600, in a 0700 directory): every still-valid entry kept (other targets may ask for
    other paths), the rest replaced by this run's hashes."""
    keep = {(p, *stats[p]): h for (p, size, mtime), h in known.items() if p in stats and stats[p] == (size, mtime)}
    keep |= {(p, *stats[p]): h for p, h in hashes.items()}
    text = "".join(f"{p}\t{size}\t{mtime}\t{h}\n" for (p, size, mtime), h in sorted(keep.items()))
    session.run(["sh", "-c", 'umask 077 && mkdir -p "$HOME/$(dirname "$1")" && cat > "$HOME/$1.tmp" && '
                 'mv -f "$HOME/$1.tmp" "$HOME/$1"', "sh", cache_file], stdin=text.encode(), timeout=timeout)


def inside_tree(path: str) -> bool:
    """Whether `path`, relative to a tree's root, names something strictly inside it by its text alone: not
    empty, not absolute, no `..` (nor `.` or empty) component, no NUL or newline. Pure: whether a directory on the
    way is a link is checked on the node, just before the removal (`_REMOVE`)."""
    if not path or path.startswith("/") or "\0" in path or "\n" in path:
        return False
    return all(part not in ("", ".", "..") for part in path.split("/"))


# Remove regular files below the root ($1), each given relative to it (the other arguments, all passing
# `inside_tree`): never when the root's own path goes through a link (`retention.IN_UNLINKED_DIR`: a model
# directory linked to a home would put the home's files in the tree), and only where no directory on the way is a
# link (nor the file itself), so a path can never lead out of the tree; prints each path removed.
_REMOVE = (f'{IN_UNLINKED_DIR}; shift; for p; do d=; rest=$p; ok=1; '
           'while [ "${rest#*/}" != "$rest" ]; do d=${d:+$d/}${rest%%/*}; rest=${rest#*/}; '
           'if [ -L "$d" ] || [ ! -d "$d" ]; then ok=0; break; fi; done; '
           'if [ $ok = 1 ] && [ -f "$p" ] && [ ! -L "$p" ] && rm -f -- "$p"; then printf \'%s\\n\' "$p"; fi; done')


def remove_files(session: Session, root: str, paths: list[str], timeout: float) -> tuple[str, ...] | None:
    """Remove the regular files `paths` (relative to `root`) on a node, never anything outside the tree: a path
    failing `inside_tree`, or reaching its file through a link, is left alone. Returns the paths removed; None
    when nothing was, because `root` or a directory above it is a link."""
    wanted = [p for p in paths if inside_tree(p)]
    if not wanted:
        return ()
    try:
        out = session.run(["sh", "-c", _REMOVE, "sh", posixpath.normpath(root), *wanted], timeout=timeout).stdout
    except CommandFailed as exc:
        if exc.exit_code == LINK_ON_THE_WAY:
            return None
        raise
    removed = set(out.splitlines())
    return tuple(p for p in wanted if p in removed)


def _listing_problems(listings: tuple[tuple[str, Weights], ...]) -> list[str]:
    """What keeps a verification partial, per node's listing: cut short, or holding links that lead out."""
    problems = [f"{name}: {w.truncated}" for name, w in listings if w.truncated]
    return problems + [f"{name}: links leading out of the tree: {_unsafe(w)}" for name, w in listings
                       if w.unsafe_count]


def verify_weights(desired: Desired, sessions: Sessions, node: str, *, repair: bool = False,
                   timeout: float = 3600, cancel: threading.Event | None = None) -> Verification:
    """Full verification of one target: sha256 of every regular file of the model tree on `node` against the
    source's (cached there by path, size and mtime). With `repair`, the differing files are removed from the
    target (only inside its tree: `remove_files`), so the next reconcile sees them missing and re-syncs exactly
    those (rsync alone would skip them: same size, same mtime)."""
    source = desired.source_node
    src_root, dst_root = desired.weights_root(source), desired.weights_root(node)
    target = sessions[node]
    mine_listing, theirs_listing = _listing(target, dst_root, timeout), _listing(sessions[source], src_root, timeout)
    files = sorted(f.path for f in mine_listing.weights.files if f.link_target is None)
    mine = _hash_files(target, dst_root, files, timeout, cancel)
    theirs, hashed = source_hashes(sessions[source], src_root, files, timeout, cancel,
                                   stats=theirs_listing.resolved)
    mismatched = tuple(sorted(p for p, h in mine.items() if p in theirs and theirs[p] != h))
    extra = tuple(sorted(p for p in mine if p not in theirs))
    problems = _listing_problems(((node, mine_listing.weights), (source, theirs_listing.weights)))
    repaired = remove_files(target, dst_root, list(mismatched), timeout) if repair and mismatched else ()
    if repaired is None:
        problems.append(f"{node}: {dst_root} goes through a link: nothing removed (name its real path in "
                        "model.path to repair)")
    return Verification(node=node, source=source, checked=len(mine), mismatched=mismatched, extra=extra,
                        hashed_on_source=hashed, repaired=repaired or (), problem="; ".join(problems) or None)
