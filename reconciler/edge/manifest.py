"""The weights manifest: what the probe lists of a model tree, and the manifest it makes of that listing.

The listing is sizes, mtimes and symlink targets (`find -P`, no link followed, nothing hashed), so a no-op cycle
costs the same for a 1 GB and a 119 GB model; where each link leads is worked out here from the listing, never by
following it on the node. Its own module: path resolution over a listing is a concern of its own, and
`probes` (the fragments) and the weights step (the copy's completion check) both use it.
"""

from __future__ import annotations

import posixpath
from dataclasses import dataclass

from reconciler.core.completeness import PARTIAL_SUFFIX
from reconciler.core.observed import WeightFile, Weights
from reconciler.edge.probes import Fact, Section, node_output
from reconciler.edge.ssh import quote_word

PARTIAL_DIR = ".rsync-partial"
MAX_ENTRIES = 100_000  # entries listed per tree (and per blob store); beyond, the manifest is truncated
MAX_DEPTH = 8  # levels below the root: models--ORG--NAME/snapshots/REV/ and five levels of the repo's own dirs
UNSAFE_SHOWN = 10  # links a manifest names in `unsafe` (`unsafe_count` counts them all)


def weights_store(root: str) -> str | None:
    """The hub's shared blob store beside an hf-cache tree (`HUB/blobs`); None beside a plain model dir.

    huggingface_hub's cross-repo store (on by default for Xet files; HF_HUB_DISABLE_SHARED_BLOBS=1 turns it off)
    keeps the bytes in `HUB/blobs/<xx>/<xet hash>`, and the repo's own `blobs/<etag>` is a relative link
    `../../blobs/<xx>/<hash>` to them: outside models--ORG--NAME, yet the model's bytes. Links that land in it
    count as inside (and are copied as files: a target holds no store)."""
    if not posixpath.basename(root).startswith("models--"):
        return None
    return posixpath.join(posixpath.dirname(root), "blobs")


def manifest_script(root: str) -> str:
    """The `weights` section: a physical walk of the tree (`find -P`: no link is ever followed), at most MAX_DEPTH
    levels and MAX_ENTRIES entries (`head` ends the walk there), printing every entry (type, size, mtime, link
    value) and the tree's canonical path; for an hf-cache tree the same of the hub's blob store, two levels deep.
    Where each link leads is worked out from this listing by `read_listing`, never by following it on the node:
    a link to `/` costs one line, not a walk of the disk. A name or link value with a tab or newline is not listed
    (a `B` line instead: the tree is refused). No hashing: cheap at any size."""
    tab, nl = "\t", "\n"
    tab_in, nl_in = quote_word("*" + tab + "*"), quote_word("*" + nl + "*")
    odd = f"\\( -name {tab_in} -o -name {nl_in} -o -lname {tab_in} -o -lname {nl_in} \\)"
    entry = "\\t%P\\t%y\\t%s\\t%T@\\t%l\\n"
    # `C.` closes a canonical path: one holding a newline is then not mistaken for a shorter one
    canon = "printf 'C\\t%s\\t' {}; pwd -P; echo C."
    tree = (f"if cd -P -- {quote_word(root)}; then {canon.format('tree')}; LC_ALL=C find . -mindepth 1 "
            f"-maxdepth {MAX_DEPTH + 1} -name {quote_word(PARTIAL_DIR)} -prune -o {odd} -prune -printf 'B\\n' "
            f"-o -printf 'E{entry}'; printf 'F\\t%s\\n' \"$?\"; else printf 'F\\t2\\n'; fi")
    store = weights_store(root)
    if store is not None:
        tree += (f"; if [ -d {quote_word(store)} ] && cd -P -- {quote_word(store)}; then {canon.format('store')}; "
                 "LC_ALL=C find . "
                 f"-mindepth 1 -maxdepth 2 {odd} -prune -o -printf 'S{entry}'; printf 'G\\t%s\\n' \"$?\"; fi")
    # one pipeline, its left side a subshell (the cd stays there); `head` ends the walk past the cap (entries,
    # with room for the canonical paths and the end lines)
    return (f"sec weights\nif [ -d {quote_word(root)} ]; then {{ {tree}; }} | head -n {MAX_ENTRIES + 6}; "
            "rc 0; else rc 2; fi")


_MAX_HOPS = 40  # links one path resolution follows: Linux's MAXSYMLINKS (ELOOP beyond)
_UNKNOWN: tuple[str, ...] = ("\0",)  # a tree whose canonical path is not known: no real path is ever inside it


@dataclass(frozen=True)
class _Entry:
    kind: str  # find's %y: f, d, l, ...
    size: int
    mtime: str  # find's %T@ as printed (the source's hash cache keys on it)
    value: str  # a link's value; "" for anything else


_DIR = _Entry("d", 0, "", "")


@dataclass(frozen=True)
class Listing:
    """A tree as the manifest script listed it: its Weights and, for every regular file and every link that lands
    on one inside the tree (or the hub's blob store), the (size, mtime) of that file."""

    weights: Weights
    resolved: dict[str, tuple[int, str]]


def _components(path: str) -> tuple[str, ...]:
    return tuple(p for p in path.split("/") if p not in ("", "."))


class _Walk:
    """The kernel's path resolution replayed on a listing. The regions (a canonical root and its entries) are
    known, and so are the directories above them (a canonical path holds no link); any other place is `outside`:
    resolution stops there, so nothing outside the tree is ever looked at, on the node or here."""

    def __init__(self, regions: dict[tuple[str, ...], dict[str, _Entry]],
                 aliases: dict[tuple[str, ...], tuple[str, ...]]):
        self.regions = sorted(regions.items(), key=lambda r: -len(r[0]))
        self.aliases = aliases  # a configured absolute path -> the canonical path it resolves to

    def place(self, path: tuple[str, ...]) -> tuple[str, _Entry | None]:
        """("in", its entry, None when absent), ("above", a directory above a region) or ("outside", None)."""
        for root, entries in self.regions:
            if path[:len(root)] == root:
                return "in", entries.get("/".join(path[len(root):])) if len(path) > len(root) else _DIR
        if any(root[:len(path)] == path for root, _ in self.regions):
            return "above", _DIR
        return "outside", None

    def resolve(self, base: tuple[str, ...], value: str, hops: int = 0) -> tuple[str, tuple[str, ...], int]:
        """Where a link's `value`, read in the directory `base`, leads: ("ok", path), ("missing", path): absent,
        or not a directory where one is needed; ("loop", path); or ("outside", the path as far as it is known)."""
        parts = list(_components(value))
        cur = base
        if value.startswith("/"):
            cur = ()
            for alias, canonical in self.aliases.items():
                if tuple(parts[:len(alias)]) == alias:
                    cur, parts = canonical, parts[len(alias):]
                    break
        for i, name in enumerate(parts):
            if name == "..":
                cur = cur[:-1]  # `cur` is canonical: its parent is the physical one
                continue
            nxt = cur + (name,)
            where, entry = self.place(nxt)
            if where == "outside":
                return "outside", nxt + tuple(parts[i + 1:]), hops
            if entry is None:
                return "missing", nxt, hops
            if entry.kind == "l":
                if hops >= _MAX_HOPS:
                    return "loop", nxt, hops
                outcome, nxt, hops = self.resolve(cur, entry.value, hops + 1)
                if outcome != "ok":
                    return outcome, nxt, hops
                entry = self.place(nxt)[1]
            cur = nxt
            if (i < len(parts) - 1 or value.endswith(("/", "/."))) and (entry is None or entry.kind != "d"):
                return "missing", cur, hops
        return "ok", cur, hops


def _shown(path: tuple[str, ...]) -> str:
    return "/" + "/".join(path).replace("\0", "?")


@dataclass
class _Lines:
    """The `weights` section's lines, sorted by kind."""

    tree: dict[str, _Entry]
    store: dict[str, _Entry]
    canonical: dict[str, tuple[str, ...]]
    ends: dict[str, int]
    odd: int


def _lines(body: str) -> _Lines:
    out = _Lines({}, {}, {}, {}, 0)
    lines = body.splitlines()
    for i, line in enumerate(lines):
        parts = line.split("\t")
        if parts[0] in ("E", "S") and len(parts) >= 6:
            float(parts[4])  # a number, or the section does not parse
            (out.tree if parts[0] == "E" else out.store)[parts[1]] = _Entry(parts[2], int(parts[3]), parts[4],
                                                                            "\t".join(parts[5:]))
        elif parts[0] == "C" and len(parts) == 3 and parts[2].startswith("/") and lines[i + 1:i + 2] == ["C."]:
            out.canonical[parts[1]] = _components(parts[2])
        elif parts[0] in ("F", "G") and len(parts) == 2:
            out.ends[parts[0]] = int(parts[1])
        elif parts[0] == "B":
            out.odd += 1
    return out


def _truncation(seen: _Lines) -> str | None:
    """Why the listing is partial: over MAX_ENTRIES entries (`head` cut the walk, before the end line of the tree
    or of the hub's blob store), or entries MAX_DEPTH + 1 levels deep (the walk stops there)."""
    if len(seen.tree) + seen.odd > MAX_ENTRIES or ("F" not in seen.ends and len(seen.tree) + seen.odd >= MAX_ENTRIES):
        return f"more than {MAX_ENTRIES} entries"
    if "F" not in seen.ends:
        return "the listing ended early"
    if any(path.count("/") >= MAX_DEPTH for path in seen.tree):
        return f"entries deeper than {MAX_DEPTH} levels"
    if "store" in seen.canonical and "G" not in seen.ends:
        return f"more than {MAX_ENTRIES} entries in the tree and the hub's blob store"
    return None


def _walk(root: str, seen: _Lines) -> tuple[_Walk, tuple[str, ...]]:
    """The walk over the tree (and the hub's blob store, where listed), and the tree's canonical path."""
    tree_root = seen.canonical.get("tree", _UNKNOWN)
    regions, aliases = {tree_root: seen.tree}, {}
    if "tree" in seen.canonical:
        aliases[_components(root)] = tree_root
    store_path = weights_store(root)
    if store_path is not None and "store" in seen.canonical:
        regions[seen.canonical["store"]] = seen.store
        aliases[_components(store_path)] = seen.canonical["store"]
    return _Walk(regions, aliases), tree_root


@node_output("weights manifest")
def read_listing(root: str, sec: Section | None) -> Listing:
    """The `weights` section (`manifest_script`) as a Listing. Each link is resolved on the listing (`_Walk`):
    one that lands outside the tree and the hub's blob store is `unsafe` (named, with where it leads), one that
    lands on a regular file inside gets that file's size, anything else (broken, a loop, a directory) None.
    More than MAX_ENTRIES entries, or any deeper than MAX_DEPTH, make the listing `truncated`."""
    if sec is None or sec.rc != 0:
        return Listing(Weights(root=root, present=False), {})
    seen = _lines(sec.body)
    if seen.ends.get("F", 0) != 0:  # find failed (an unreadable directory): not a tree to trust
        return Listing(Weights(root=root, present=False), {})
    walk, tree_root = _walk(root, seen)
    files, resolved = [], {}
    unsafe = [f"{seen.odd} names or link values with a tab or newline, not listed (`find -name '*[[:cntrl:]]*' "
              "-o -lname '*[[:cntrl:]]*'` shows them)"] if seen.odd else []
    partials = []
    for path, e in sorted(seen.tree.items()):
        if e.kind == "f" and path.endswith(PARTIAL_SUFFIX):
            partials.append(path)
        elif e.kind == "f":
            files.append(WeightFile(path=path, size=e.size, mtime=float(e.mtime)))
            resolved[path] = (e.size, e.mtime)
        elif e.kind == "l":
            outcome, end, _ = walk.resolve(tree_root + _components(path)[:-1], e.value)
            where, target = walk.place(end) if outcome == "ok" else (outcome, None)
            size = None
            if outcome == "outside" or where == "above":
                unsafe.append(f"{path} -> {e.value} (outside the tree: {_shown(end)})")
            elif target is not None and target.kind == "f":
                size = target.size
                resolved[path] = (target.size, target.mtime)
            files.append(WeightFile(path=path, size=size, mtime=float(e.mtime), link_target=e.value))
    weights = Weights(root=root, present=bool(files), files=files, unsafe=unsafe[:UNSAFE_SHOWN],
                      unsafe_count=len(unsafe), truncated=_truncation(seen), partials=partials)
    return Listing(weights, resolved)


def parse_weights(root: str, sec: Section | None) -> Weights:
    """The weights manifest of a `weights` section (ProbeError when it does not parse)."""
    return read_listing(root, sec).weights


def listing_fact(root: str) -> Fact[Listing]:
    """The tree at `root` as the probe lists it (`manifest_script`, `read_listing`), with what each regular file
    resolves to (the hash cache's keys): what the weights step re-reads on both ends."""
    return Fact("weights", tuple(manifest_script(root).split("\n", 1)),
                lambda sections: read_listing(root, sections.get("weights")))


def tree_fact(root: str) -> Fact[Weights | None]:
    """The tree as `listing_fact` reads it, None when it is gone (the script's exit 2: no such directory): what
    retention re-reads before it removes a tree."""
    def parse(sections: dict[str, Section]) -> Weights | None:
        section = sections.get("weights")
        if section is not None and section.rc == 2:
            return None
        return read_listing(root, section).weights
    return Fact(f"tree {root}", tuple(manifest_script(root).split("\n", 1)), parse)
