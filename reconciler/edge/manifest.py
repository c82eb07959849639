"""The weights manifest: what the probe lists of a model tree, and the manifest it makes of that listing.

The listing is sizes, mtimes and symlink targets (`find -P`, no link followed, nothing hashed), so a no-op cycle
costs the same for a 1 GB and a 119 GB model; where each link leads is worked out here from the listing, never by
following it on the node. Its own module: path resolution over a listing is a concern of its own, and
the probe (`weights_fact`) and the weights step (the copy's completion check) both use it.
"""

from __future__ import annotations

import posixpath
from dataclasses import dataclass, field

from reconciler.core.completeness import PARTIAL_SUFFIX
from reconciler.core.observed import WeightFile, Weights
from reconciler.edge.facts.base import Fact, Section, each_line, node_output
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
#: Lines of the `weights` section read: what the node's `head -n` lets through. A hostile node runs no `head`: one
#: million `E` lines (15 MiB, under both of the command's caps) once made a million entries and files and peaked at
#: 828 MiB (tracemalloc; the review saw 1,007 MiB RSS), above the unit's MemoryMax=512M (issue 53). Lines past it
#: are never looked at: the listing is then `truncated`, as an honest one cut by `head` is.
MAX_LINES = MAX_ENTRIES + 6
#: Path components the resolution of one listing's links looks at, all links together (`_Walk.steps`). Each link's
#: value is resolved once (`_Walk._value_of`): an honest hf-cache tree at MAX_ENTRIES, half of it snapshot links
#: (`../../blobs/HASH`), takes 200,000. Past it the listing is `truncated` and its remaining links resolve to
#: nothing (a partial view is never synced from).
MAX_STEPS = 16 * MAX_ENTRIES


@dataclass(frozen=True, slots=True)
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
    #: Where the files are, as the listing checked them (the weights copy sends exactly these, never a link again:
    #: `weights.sync_weights`): the tree's canonical path (a regular file's path below it is physical, `find -P`),
    #: and for each link landing on a regular file inside, (the canonical path of the region it lands in, the
    #: tree's or the hub's blob store's; the file's path below it).
    tree: str | None = None
    landing: dict[str, tuple[str, str]] = field(default_factory=dict)


def _components(path: str) -> tuple[str, ...]:
    return tuple(p for p in path.split("/") if p not in ("", "."))


class _Deeper(Exception):
    """A link met with more than _MAX_HOPS links' values being resolved inside one another (`_Walk._value_of`)."""

    def __init__(self, link: tuple[str, ...]):
        super().__init__(link)
        self.link = link


class _Spent(Exception):
    """The listing's MAX_STEPS are spent."""


Resolution = tuple[str, tuple[str, ...], int]  # `_Walk.resolve`'s (outcome, path, links followed)


class _Walk:
    """The kernel's path resolution replayed on a listing. The regions (a canonical root and its entries) are
    known, and so are the directories above them (a canonical path holds no link); any other place is `outside`:
    resolution stops there, so nothing outside the tree is ever looked at, on the node or here.

    Each link's value is resolved once, from where the link lies (`_value_of`), and reused wherever a path passes
    through that link: a chain of N links costs O(N) steps, not N times _MAX_HOPS (a million links of chains once
    took 352 s of CPU, past the node's observation deadline: issue 53). All links together look at MAX_STEPS
    components at most (`_Spent` past them)."""

    def __init__(self, regions: dict[tuple[str, ...], dict[str, _Entry]],
                 aliases: dict[tuple[str, ...], tuple[str, ...]]):
        self.regions = sorted(regions.items(), key=lambda r: -len(r[0]))
        self.aliases = aliases  # a configured absolute path -> the canonical path it resolves to
        self.steps = 0  # components looked at
        self._values: dict[tuple[str, ...], Resolution] = {}  # a link -> its value resolved from 0 hops
        self._open: list[tuple[str, ...]] = []  # links whose value is being resolved, outermost first

    def place(self, path: tuple[str, ...]) -> tuple[str, _Entry | None]:
        """("in", its entry, None when absent), ("above", a directory above a region) or ("outside", None)."""
        for root, entries in self.regions:
            if path[:len(root)] == root:
                return "in", entries.get("/".join(path[len(root):])) if len(path) > len(root) else _DIR
        if any(root[:len(path)] == path for root, _ in self.regions):
            return "above", _DIR
        return "outside", None

    def resolve(self, base: tuple[str, ...], value: str) -> Resolution:
        """Where a link's `value`, read in the directory `base`, leads: ("ok", path), ("missing", path): absent,
        or not a directory where one is needed; ("loop", path); or ("outside", the path as far as it is known).
        `_Spent` once the listing's MAX_STEPS are spent."""
        while True:
            try:
                return self._resolve(base, value, 0)
            except _Deeper as deeper:  # resolve that link's value first, from its own start, then again
                try:
                    self._value_of(deeper.link)
                except _Deeper:  # its own value nests past _MAX_HOPS links: it needs more than _MAX_HOPS hops
                    self._values[deeper.link] = ("loop", deeper.link, _MAX_HOPS + 1)

    def _value_of(self, link: tuple[str, ...]) -> Resolution:
        """Where the value of the link at `link` leads, resolved from `link`'s directory with no hop taken yet; its
        count is the links that took. A link met again while its own value is being resolved leads through
        itself (a loop); _Deeper past _MAX_HOPS links resolved inside one another (their outermost needs more
        hops than that: `resolve` resolves the innermost first)."""
        known = self._values.get(link)
        if known is not None:
            return known
        if link in self._open:
            return "loop", link, 0
        if len(self._open) > _MAX_HOPS:
            raise _Deeper(link)
        entry = self.place(link)[1]
        assert entry is not None and entry.kind == "l"
        self._open.append(link)
        try:
            found = self._resolve(link[:-1], entry.value, 0)
        finally:
            self._open.pop()
        self._values[link] = found
        return found

    def _resolve(self, base: tuple[str, ...], value: str, hops: int) -> Resolution:
        """`resolve`, `hops` links already followed."""
        parts = list(_components(value))
        cur = base
        if value.startswith("/"):
            cur = ()
            for alias, canonical in self.aliases.items():
                if tuple(parts[:len(alias)]) == alias:
                    cur, parts = canonical, parts[len(alias):]
                    break
        for i, name in enumerate(parts):
            self.steps += 1
            if self.steps > MAX_STEPS:
                raise _Spent
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
                outcome, nxt, hops = self._follow(nxt, hops)
                if outcome != "ok":
                    return outcome, nxt, hops
                entry = self.place(nxt)[1]
            cur = nxt
            if (i < len(parts) - 1 or value.endswith(("/", "/."))) and (entry is None or entry.kind != "d"):
                return "missing", cur, hops
        return "ok", cur, hops

    def _follow(self, link: tuple[str, ...], hops: int) -> Resolution:
        """Through the link at `link`, `hops` links followed before it: where its value leads, and the hops then.
        The value is resolved from where the link lies (`_value_of`), then counted from here: each of its own
        `links` hops had to stay under _MAX_HOPS too, the last at hops + links."""
        if hops >= _MAX_HOPS:
            return "loop", link, hops
        outcome, end, links = self._value_of(link)
        if outcome == "loop" or (links and hops + links >= _MAX_HOPS):
            return "loop", link, hops
        return outcome, end, hops + 1 + links


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
    over: bool = False  # more than MAX_LINES lines: the rest was not read


def _lines(body: str) -> _Lines:
    """The section's first MAX_LINES lines, read one at a time (`over` when more follow)."""
    out = _Lines({}, {}, {}, {}, 0)
    candidate: tuple[str, tuple[str, ...]] | None = None  # a `C` line, canonical once `C.` follows it
    for count, line in enumerate(each_line(body)):
        if count == MAX_LINES:
            out.over = True
            break
        if candidate is not None and line == "C.":
            out.canonical[candidate[0]] = candidate[1]
        candidate = None
        parts = line.split("\t")
        if parts[0] in ("E", "S") and len(parts) >= 6:
            float(parts[4])  # a number, or the section does not parse
            (out.tree if parts[0] == "E" else out.store)[parts[1]] = _Entry(parts[2], int(parts[3]), parts[4],
                                                                            "\t".join(parts[5:]))
        elif parts[0] == "C" and len(parts) == 3 and parts[2].startswith("/"):
            candidate = parts[1], _components(parts[2])
        elif parts[0] in ("F", "G") and len(parts) == 2:
            out.ends[parts[0]] = int(parts[1])
        elif parts[0] == "B":
            out.odd += 1
    return out


def _truncation(seen: _Lines) -> str | None:
    """Why the listing is partial: over MAX_ENTRIES entries (`head` cut the walk, before the end line of the tree
    or of the hub's blob store; or more lines than `head` lets through), or entries MAX_DEPTH + 1 levels deep (the
    walk stops there)."""
    listed = len(seen.tree) + seen.odd
    if seen.over or listed > MAX_ENTRIES or ("F" not in seen.ends and listed >= MAX_ENTRIES):
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
    More than MAX_ENTRIES entries (or MAX_LINES lines), any deeper than MAX_DEPTH, or links that take more than
    MAX_STEPS to resolve make the listing `truncated`."""
    if sec is None or sec.rc != 0:
        return Listing(Weights(root=root, present=False), {})
    seen = _lines(sec.body)
    if seen.ends.get("F", 0) != 0:  # find failed (an unreadable directory): not a tree to trust
        return Listing(Weights(root=root, present=False), {})
    walk, tree_root = _walk(root, seen)
    read = _Read(walk, tree_root)
    if seen.odd:
        read.unsafe_count = 1
        read.unsafe.append(f"{seen.odd} names or link values with a tab or newline, not listed (`find -name "
                           "'*[[:cntrl:]]*' -o -lname '*[[:cntrl:]]*'` shows them)")
    for path, entry in sorted(seen.tree.items()):
        read.entry(path, entry)
    truncated = f"more than {MAX_STEPS} steps resolving its links" if read.spent else _truncation(seen)
    weights = Weights(root=root, present=bool(read.files), files=read.files, unsafe=read.unsafe,
                      unsafe_count=read.unsafe_count, truncated=truncated, partials=read.partials)
    return Listing(weights, read.resolved, None if tree_root == _UNKNOWN else _shown(tree_root), read.landing)


@dataclass
class _Read:
    """A listing's entries as `read_listing` reads them, one at a time (`entry`)."""

    walk: _Walk
    tree_root: tuple[str, ...]
    files: list[WeightFile] = field(default_factory=list)
    resolved: dict[str, tuple[int, str]] = field(default_factory=dict)
    landing: dict[str, tuple[str, str]] = field(default_factory=dict)
    unsafe: list[str] = field(default_factory=list)
    unsafe_count: int = 0
    partials: list[str] = field(default_factory=list)
    spent: bool = False  # MAX_STEPS spent: the remaining links resolve to nothing

    def entry(self, path: str, e: _Entry) -> None:
        """One entry of the tree: a partial file, a regular file or a link (anything else is not a file)."""
        if e.kind == "f" and path.endswith(PARTIAL_SUFFIX):
            self.partials.append(path)
        elif e.kind == "f":
            self.files.append(WeightFile(path=path, size=e.size, mtime=float(e.mtime)))
            self.resolved[path] = (e.size, e.mtime)
        elif e.kind == "l":
            self.files.append(WeightFile(path=path, size=self._link(path, e), mtime=float(e.mtime),
                                         link_target=e.value))

    def _link(self, path: str, e: _Entry) -> int | None:
        """Where the link at `path` lands, on the listing: its file's size when that is a regular file inside;
        `unsafe` when it leads outside; None for anything else."""
        try:
            outcome, end, _ = ("spent", (), 0) if self.spent else self.walk.resolve(
                self.tree_root + _components(path)[:-1], e.value)
        except _Spent:
            outcome, end, self.spent = "spent", (), True
        where, target = self.walk.place(end) if outcome == "ok" else (outcome, None)
        if outcome == "outside" or where == "above":
            self.unsafe_count += 1
            if len(self.unsafe) < UNSAFE_SHOWN:  # only these are shown: no string for each of a million
                self.unsafe.append(f"{path} -> {e.value} (outside the tree: {_shown(end)})")
            return None
        if target is not None and target.kind == "f":
            self.resolved[path] = (target.size, target.mtime)
            self.landing[path] = _landing(self.walk, end)
            return target.size
        return None


def _landing(walk: _Walk, end: tuple[str, ...]) -> tuple[str, str]:
    """(the canonical root of the region holding `end`, `end` below it): where a link checked inside lands."""
    region = next(root for root, _ in walk.regions if end[:len(root)] == root)
    return _shown(region), "/".join(end[len(region):])


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


def weights_fact(root: str) -> Fact[Weights]:
    """The weights manifest of the tree at `root`, as the probe reads it (`manifest_script`, `parse_weights`)."""
    return Fact("weights", tuple(manifest_script(root).split("\n", 1)),
                lambda sections: parse_weights(root, sections.get("weights")))
