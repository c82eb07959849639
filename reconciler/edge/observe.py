"""The probe: ONE POSIX sh script per node per cycle, and its parsing into `observed` models.

Only tools a stock DGX OS has: the docker CLI, `ip -j`, cat of /sys and /proc, GNU find, curl. The script prints
sections (`@@name` ... `@@rc N`); each section fails on its own, so a dead docker engine still leaves the link,
memory and weights observed. Nothing here hashes weights: the manifest is sizes, mtimes and symlink targets, so
a no-op cycle costs the same for a 1 GB and a 119 GB model.
"""

from __future__ import annotations

import functools
import hashlib
import json
import posixpath
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import ParamSpec, TypeVar

from reconciler.core.drift import image_holder
from reconciler.core.observed import (
    Container,
    Image,
    Link,
    Memory,
    NodeObservation,
    Observed,
    RdmaPort,
    ServeFlags,
    Serving,
    WeightFile,
    Weights,
)
from reconciler.core.spec import Desired, Node
from reconciler.core.vllm import extra_flags, parse_serve_help
from reconciler.edge.ssh import OutputTooLarge, RemoteError, Sessions, quote

P = ParamSpec("P")
R = TypeVar("R")


class ProbeError(Exception):
    """Output from a node that does not parse: the one error a parser of node output raises. It makes that node
    ProbeFailed (a per-node condition; its steps wait); it never ends a reconcile for the other nodes."""


def node_output(what: str) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """Decorate a parser of node output: whatever the bytes (missing fields, garbage, nesting, odd names), it
    returns a model or raises ProbeError naming `what` and why. Node output is untrusted input, so a parser bug or
    a hostile node is one node's condition, never a crash of the loop."""
    def wrap(parse: Callable[P, R]) -> Callable[P, R]:
        @functools.wraps(parse)
        def guarded(*args: P.args, **kwargs: P.kwargs) -> R:
            try:
                return parse(*args, **kwargs)
            except ProbeError:
                raise
            except Exception as exc:  # noqa: BLE001 - see the docstring: one typed error for any node bytes
                raise ProbeError(f"{what}: {type(exc).__name__}: {str(exc)[:200]}") from None
        return guarded
    return wrap

_INSPECT = ('{"name":{{json .Name}},"id":{{json .Id}},"image":{{json .Config.Image}},"image_id":{{json .Image}},'
            '"state":{{json .State.Status}},"labels":{{json .Config.Labels}},"started_at":{{json .State.StartedAt}},'
            '"restart_count":{{json .RestartCount}}}')
PARTIAL_DIR = ".rsync-partial"
MAX_ENTRIES = 100_000  # entries listed per tree (and per blob store); beyond, the manifest is truncated
MAX_DEPTH = 8  # levels below the root: models--ORG--NAME/snapshots/REV/ and five levels of the repo's own dirs
UNSAFE_SHOWN = 10  # links a manifest names in `unsafe` (`unsafe_count` counts them all)


def weights_root(desired: Desired, node: str) -> str:
    """The directory whose tree is the manifest: the model dir (plain) or models--ORG--NAME (hf-cache)."""
    path = desired.model.path_on(node)
    if desired.model.layout == "plain":
        return path
    return posixpath.join(path, "models--" + desired.model.id.replace("/", "--"))


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
    q = lambda *argv: quote(argv)  # noqa: E731 - local shorthand
    tab, nl = "\t", "\n"
    odd = (f"\\( -name {q('*' + tab + '*')} -o -name {q('*' + nl + '*')} -o -lname {q('*' + tab + '*')} "
           f"-o -lname {q('*' + nl + '*')} \\)")
    entry = "\\t%P\\t%y\\t%s\\t%T@\\t%l\\n"
    # `C.` closes a canonical path: one holding a newline is then not mistaken for a shorter one
    canon = "printf 'C\\t%s\\t' {}; pwd -P; echo C."
    tree = (f"if cd -P -- {q(root)}; then {canon.format('tree')}; LC_ALL=C find . -mindepth 1 "
            f"-maxdepth {MAX_DEPTH + 1} -name {q(PARTIAL_DIR)} -prune -o {odd} -prune -printf 'B\\n' "
            f"-o -printf 'E{entry}'; printf 'F\\t%s\\n' \"$?\"; else printf 'F\\t2\\n'; fi")
    store = weights_store(root)
    if store is not None:
        tree += (f"; if [ -d {q(store)} ] && cd -P -- {q(store)}; then {canon.format('store')}; LC_ALL=C find . "
                 f"-mindepth 1 -maxdepth 2 {odd} -prune -o -printf 'S{entry}'; printf 'G\\t%s\\n' \"$?\"; fi")
    # one pipeline, its left side a subshell (the cd stays there); `head` ends the walk past the cap (entries,
    # with room for the canonical paths and the end lines)
    return (f"printf '\\n@@weights\\n'\nif [ -d {q(root)} ]; then {{ {tree}; }} | head -n {MAX_ENTRIES + 6}; "
            "echo '@@rc 0'; else echo '@@rc 2'; fi")


COMPLETION_DEADLINE = 5  # seconds: one token of a loaded model answers in milliseconds; a wedged rank never does


def auth_header(desired: Desired) -> bytes | None:
    """The header the OpenAI API wants when serving.secrets holds VLLM_API_KEY (vLLM then guards every /v1 path;
    /health stays open). Callers hand it to `curl -H @-` on stdin: the key is never on a command line."""
    key = desired.secret("VLLM_API_KEY")
    return f"Authorization: Bearer {key}\n".encode() if key else None


def api_argv(desired: Desired, *argv: str) -> list[str]:
    """`curl ARGV`, reading the API key's header from stdin when there is one."""
    return ["curl", *(["-H", "@-"] if auth_header(desired) else []), *argv]


def completion_argv(desired: Desired) -> list[str]:
    """One short completion through the head's OpenAI API (`curl`, body then the HTTP code on its own line).

    /health only says the API process is up: with a rank unreachable over the fabric, vLLM's /health kept
    answering 200 while completions hung (docs/testbed.md). One token through the whole tensor-parallel group is
    the check that cannot be fooled. The served name is validated by spec; the body is JSON, quoted once."""
    name = desired.serving.served_model_name or desired.model.id
    body = json.dumps({"model": name, "prompt": "ping", "max_tokens": 1, "temperature": 0})
    url = f"http://127.0.0.1:{desired.serving.port}/v1/completions"
    return api_argv(desired, "-s", "-m", str(COMPLETION_DEADLINE), "-H", "Content-Type: application/json",
                    "-w", "\\n%{http_code}", "-d", body, url)


@node_output("completion")
def parse_completion(sec: Section | None) -> str | None:
    """None when the completion answered with a choice; else a short reason (node bytes never raise)."""
    if sec is None:
        return "not tried"
    body, _, code = sec.body.strip().rpartition("\n")
    if sec.rc == 28:
        return f"no answer within {COMPLETION_DEADLINE}s"
    if code.strip() != "200":
        return f"HTTP {code.strip() or 'none'} (curl exit {sec.rc})"
    try:
        choices = json.loads(body).get("choices")
    except (ValueError, AttributeError):
        return "the answer is not JSON"
    return None if isinstance(choices, list) and choices else "the answer has no choices"


SEC = "sec() { printf '\\n@@%s\\n' \"$1\"; }"
_TWIN = "-twin"  # section suffix of the fabric's twin port


def link_script(node: Node) -> list[str]:
    """Script lines reading each fabric port: `link`/`rdma` sections for the first, `link-twin`/`rdma-twin` for
    the twin (needs `sec`). The probe and the link step read the ports with these same lines."""
    q = lambda *argv: quote(argv)  # noqa: E731 - local shorthand
    lines = []
    for port, suffix in zip(node.fabric.ports(), ("", _TWIN), strict=False):
        lines += [f"sec link{suffix}", f"ip -j addr show dev {q(port.interface)} 2>&1; echo \"@@rc $?\"",
                  f"sec rdma{suffix}"]
        if port.rdma_device:
            sysfs = f"/sys/class/infiniband/{port.rdma_device}/ports/1"
            lines.append(f"if [ -d {q(sysfs)} ]; then cat {q(sysfs + '/state')} {q(sysfs + '/phys_state')}; "
                         "echo \"@@rc $?\"; else echo '@@rc 2'; fi")
        else:
            lines.append("echo '@@rc 2'")
    return lines


def parse_links(node: Node, sections: dict[str, Section]) -> tuple[Link, Link | None]:
    """The first port's link and the twin's (None when no twin is declared), from `link_script`'s sections."""
    first = parse_link(node.fabric.interface, sections.get("link"), sections.get("rdma"))
    twin = node.fabric.twin
    if twin is None:
        return first, None
    return first, parse_link(twin.interface, sections.get("link" + _TWIN), sections.get("rdma" + _TWIN))


def probe_script(desired: Desired, node: Node) -> str:
    """The script for one node. Every interpolated value is validated by spec and quoted by remote.quote."""
    q = lambda *argv: quote(argv)  # noqa: E731 - local shorthand
    root = weights_root(desired, node.name)
    lines = [
        "export LC_ALL=C",
        SEC,
        # the Docker API over its unix socket: one curl instead of two or three Go CLI start-ups (85 -> 49 ms per
        # no-op cycle, docs/benchmarks.md); the CLI stays the fallback (TCP DOCKER_HOST, no curl)
        'sock=/var/run/docker.sock; case "${DOCKER_HOST:-}" in unix://*) sock=${DOCKER_HOST#unix://};; esac',
        "sec containers",
        "if out=$(curl -sf --unix-socket \"$sock\" 'http://docker/containers/json?all=1' 2>/dev/null); then "
        "printf 'API %s\\n' \"$out\"; rc=0; else "
        "ids=$(docker ps -aq --no-trunc 2>&1); rc=$?; "
        f"if [ $rc -eq 0 ] && [ -n \"$ids\" ]; then docker inspect --format {q(_INSPECT)} $ids 2>&1; "
        "elif [ $rc -ne 0 ]; then printf '%s\\n' \"$ids\"; fi; fi",
        "echo \"@@rc $rc\"",
        "sec image",
        f"if img=$(curl -sf --unix-socket \"$sock\" {q('http://docker/images/' + desired.serving.image + '/json')}"
        " 2>/dev/null); then printf 'API %s\\n' \"$img\"; else "
        f"docker image inspect {q(desired.serving.image)} 2>/dev/null; fi; echo \"@@rc $?\"",
        *link_script(node),
        "sec meminfo",
        "grep -E '^(MemTotal|MemAvailable):' /proc/meminfo; echo \"@@rc $?\"",
        manifest_script(root),
    ]
    if node.role == "head":
        api_port = desired.serving.port
        # /v1/models and the completion only when /health answered 200: a frozen API would cost their whole
        # deadlines (2 s + 5 s) on every probe, and what they say of an unhealthy API is never used.
        header = auth_header(desired)
        # the key travels in this script (stdin of `sh -s`), and into curl by a builtin's pipe: never in an argv
        auth = f"printf %s {q(header.decode())} | " if header else ""
        lines += [
            "sec health",
            f"code=$(curl -s -o /dev/null -m 2 -w '%{{http_code}}' {q(f'http://127.0.0.1:{api_port}/health')}); "
            "rc=$?; printf '%s\\n' \"$code\"; echo \"@@rc $rc\"",
            "sec models",
            f"rc=0; if [ \"$code\" = 200 ]; then {auth}"
            f"{quote(api_argv(desired, '-s', '-m', '2', f'http://127.0.0.1:{api_port}/v1/models'))}; rc=$?; "
            "fi; echo; echo \"@@rc $rc\"",
            "sec completion",
            f"rc=0; if [ \"$code\" = 200 ]; then {auth}{quote(completion_argv(desired))}; rc=$?; fi; echo; "
            "echo \"@@rc $rc\"",
        ]
        if desired.serving.launcher == "ray":
            lines += ["sec ray",
                      f"docker exec {q(desired.serving.container_name)} ray status 2>&1; echo \"@@rc $?\""]
    return "\n".join(lines) + "\n"


@dataclass
class Section:
    body: str
    rc: int


@node_output("probe output")
def split_sections(output: str) -> dict[str, Section]:
    sections: dict[str, Section] = {}
    name: str | None = None
    body: list[str] = []
    for line in output.splitlines():
        if line.startswith("@@rc ") and name is not None:
            sections[name] = Section("\n".join(body).strip("\n"), int(line[5:].strip() or 1))
            name, body = None, []
        elif line.startswith("@@") and not line.startswith("@@rc"):
            name, body = line[2:].strip(), []
        elif name is not None:
            body.append(line)
    return sections


def _api_container(raw: dict) -> Container:
    return Container(name=(raw.get("Names") or ["/"])[0].lstrip("/"), id=raw["Id"], image=raw.get("Image", ""),
                     image_id=raw.get("ImageID", ""), state=raw["State"], labels=raw.get("Labels") or {})


@node_output("containers")
def parse_containers(sec: Section | None) -> tuple[bool, str | None, list[Container]]:
    if sec is None:
        return False, "probe did not report containers", []
    if sec.rc == 0 and sec.body.startswith("API "):
        found = [_api_container(raw) for raw in json.loads(sec.body[4:])]
        return True, None, sorted(found, key=lambda c: c.name)
    found = []
    for line in sec.body.splitlines():
        if line.startswith("{"):
            raw = json.loads(line)
            raw["name"] = raw["name"].lstrip("/")
            raw["labels"] = raw.get("labels") or {}
            found.append(Container.model_validate(raw))
    if sec.rc != 0 and not found:
        return False, sec.body.strip()[-500:] or f"docker exited {sec.rc}", []
    return True, None, sorted(found, key=lambda c: c.name)


@node_output("link")
def parse_link(name: str, link_sec: Section | None, rdma_sec: Section | None) -> Link:
    if link_sec is None or link_sec.rc != 0:
        return Link(name=name, exists=False)
    data = json.loads(link_sec.body or "[]")
    if not data:
        return Link(name=name, exists=False)
    info = data[0]
    flags = info.get("flags", [])
    addresses = [f"{a['local']}/{a['prefixlen']}" for a in info.get("addr_info", []) if a.get("family") == "inet"]
    rdma = None
    if rdma_sec is not None and rdma_sec.rc == 0:
        state, _, phys = rdma_sec.body.partition("\n")
        rdma = RdmaPort(state=state.strip(), phys_state=phys.strip())
    return Link(name=name, operstate=str(info.get("operstate", "UNKNOWN")).lower(), admin_up="UP" in flags,
                carrier="LOWER_UP" in flags, mtu=int(info.get("mtu", 0)), addresses=addresses, rdma=rdma)


@node_output("meminfo")
def parse_memory(sec: Section | None) -> Memory | None:
    if sec is None or sec.rc != 0:
        return None
    values = {}
    for line in sec.body.splitlines():
        key, _, rest = line.partition(":")
        values[key] = int(rest.split()[0]) * 1024
    return Memory(total_bytes=values["MemTotal"], available_bytes=values["MemAvailable"])


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
    for path, e in sorted(seen.tree.items()):
        if e.kind == "f":
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
                      unsafe_count=len(unsafe), truncated=_truncation(seen))
    return Listing(weights, resolved)


def parse_weights(root: str, sec: Section | None) -> Weights:
    """The weights manifest of a `weights` section (ProbeError when it does not parse)."""
    return read_listing(root, sec).weights


@node_output("serving API")
def parse_serving(health: Section | None, models: Section | None, ray: Section | None,
                  completion: Section | None = None) -> Serving:
    code = health.body.strip() if health else ""
    served: list[str] = []
    if models is not None and models.body.strip().startswith("{"):
        try:
            served = [m["id"] for m in json.loads(models.body).get("data", [])]
        except (ValueError, KeyError, TypeError):
            served = []
    ray_nodes = None
    if ray is not None and ray.rc == 0:
        ray_nodes = sum(1 for line in ray.body.splitlines() if line.strip().split(" ")[-1].startswith("node_"))
    healthy = code == "200"
    return Serving(reachable=code not in ("", "000"), healthy=healthy, models=served, ray_nodes=ray_nodes,
                   completion_error=parse_completion(completion) if healthy and served else None)


# What `docker load` keeps of an image on either store: the layers' diff ids and the runtime config (the config
# blob travels byte for byte in the archive). Not the id, not the history, not the size (docs/troubleshooting.md).
_CONTENT_CONFIG = ("Env", "Entrypoint", "Cmd", "WorkingDir", "User", "Labels")
# The graph driver names a containerd image store reports: its snapshotter (moby daemon/containerd/image.go).
_SNAPSHOTTERS = {"overlayfs", "native", "btrfs", "zfs", "stargz", "fuse-overlayfs"}


def image_from_inspect(raw: object) -> Image:
    """One image from the engine's inspect object (`/images/REF/json`, or one element of `docker image
    inspect`). KeyError/TypeError on anything else; callers on node bytes go through `node_output`."""
    if not isinstance(raw, dict) or not isinstance(raw["Id"], str):
        raise TypeError(f"not an image inspect object: {str(raw)[:80]!r}")
    config = raw.get("Config") or {}
    layers = (raw.get("RootFS") or {}).get("Layers") or []  # the API may leave out an empty list
    content = {"layers": list(layers), "os": raw.get("Os", ""), "arch": raw.get("Architecture", ""),
               "variant": raw.get("Variant", ""), "config": {k: config.get(k) or None for k in _CONTENT_CONFIG}}
    body = json.dumps(content, sort_keys=True, separators=(",", ":"))
    driver = str((raw.get("GraphDriver") or {}).get("Name", ""))
    store = "containerd" if "Descriptor" in raw or driver in _SNAPSHOTTERS else driver
    digests = [d for d in raw.get("RepoDigests") or [] if isinstance(d, str)]
    return Image(id=raw["Id"], content="sha256:" + hashlib.sha256(body.encode()).hexdigest(), digests=digests,
                 store=store)


@node_output("image")
def parse_image(sec: Section | None) -> Image | None:
    """The serving image on a node (None: absent). `API {...}`: the engine's API answered; else the CLI's
    `docker image inspect` array."""
    body = sec.body.strip() if sec and sec.rc == 0 else ""
    if not body:
        return None
    if body.startswith("API "):
        return image_from_inspect(json.loads(body[4:]))
    found = json.loads(body)
    return image_from_inspect(found[0]) if found else None


def parse_probe(desired: Desired, node: Node, output: str) -> NodeObservation:
    """One node's probe output as its observation; ProbeError (naming the section) when it does not parse."""
    sections = split_sections(output)
    docker_ok, docker_error, containers = parse_containers(sections.get("containers"))
    image = parse_image(sections.get("image"))
    images = {desired.serving.image: image} if image else {}
    fabric, fabric_twin = parse_links(node, sections)
    serving = None
    if node.role == "head":
        serving = parse_serving(sections.get("health"), sections.get("models"), sections.get("ray"),
                                sections.get("completion"))
    return NodeObservation(
        name=node.name, reachable=True, docker_reachable=docker_ok, docker_error=docker_error,
        containers=containers, images=images,
        fabric=fabric, fabric_twin=fabric_twin,
        memory=parse_memory(sections.get("meminfo")),
        weights=parse_weights(weights_root(desired, node.name), sections.get("weights")), serving=serving)


def observe_node(desired: Desired, sessions: Sessions, node: Node, timeout: float = 20.0,
                 cancel: threading.Event | None = None) -> NodeObservation:
    try:
        result = sessions[node.name].run_script(probe_script(desired, node), timeout=timeout, cancel=cancel)
    except OutputTooLarge as exc:
        return NodeObservation(name=node.name, reachable=True, probe_error=exc.message)
    except RemoteError as exc:
        return NodeObservation(name=node.name, reachable=False, error=exc.message)
    try:
        return parse_probe(desired, node, result.stdout)
    except ProbeError as exc:
        return NodeObservation(name=node.name, reachable=True, probe_error=str(exc))


def observe(desired: Desired, sessions: Sessions, timeout: float = 20.0, cancel: threading.Event | None = None,
            ask_flags: bool = True) -> tuple[Observed, dict[str, float]]:
    """Probe all nodes in parallel (an unreachable node never stalls the others); also return seconds per node.
    `cancel` (the daemon's shutdown) ends a probe that waits on a hung node within a second, not its timeout.
    `ask_flags`: also ask the serving image for its flags here and now (the one-shot commands); the daemon asks
    beside its loop instead (`reconciler.loop.operations.FlagsQuery`)."""
    durations: dict[str, float] = {}

    def one(node: Node) -> NodeObservation:
        start = time.perf_counter()
        try:
            return observe_node(desired, sessions, node, timeout, cancel)
        finally:
            durations[node.name] = time.perf_counter() - start

    with ThreadPoolExecutor(max_workers=max(1, len(desired.nodes))) as pool:
        results = list(pool.map(one, desired.nodes))
    observed = Observed(nodes={r.name: r for r in results})
    if ask_flags and (wanted := flags_wanted(desired, observed)):
        holder, image_id = wanted
        if image_id not in _asked:
            _asked[image_id] = ask_serve_flags(desired, sessions, holder, image_id)
        observed = observed.model_copy(update={"serve_flags": _asked[image_id]})
    return observed, durations


_asked: dict[str, ServeFlags] = {}  # image id -> its flags: an id is a content hash, the same id knows the same


FLAGS_DEADLINE = 180.0  # `vllm serve --help=all` imports torch: ~12 s on 2 CPU cores, more on a busy node


def flags_wanted(desired: Desired, observed: Observed) -> tuple[str, str] | None:
    """(node, image id) to ask what the serving image can do: the node holding the reference image; None when
    there is nothing to judge (serving.extra_args has no flags and the launcher is native) or no node has it."""
    holder = image_holder(desired, observed)
    if not (extra_flags(desired.serving.extra_args) or desired.serving.launcher == "ray") or holder is None:
        return None
    return holder, observed.node(holder).images[desired.serving.image].id


# One throw-away container answers both questions: `sh` is in every vLLM image (NGC's and vLLM's own are Ubuntu).
_ASK_IMAGE = ('if command -v ray >/dev/null 2>&1; then echo "@@ray yes"; else echo "@@ray no"; fi; '
              'exec vllm serve --help=all')


def ask_serve_flags(desired: Desired, sessions: Sessions, holder: str, image_id: str) -> ServeFlags:
    """What the serving image's own `vllm serve` accepts (its `--help=all`) and whether it has Ray, from a
    throw-away container (no network) on `holder`. Image ids name one content: callers ask once per id."""
    argv = ["docker", "run", "--rm", "--network", "none", "--entrypoint", "sh", desired.serving.image, "-c",
            _ASK_IMAGE]
    has_ray = None
    try:
        res = sessions[holder].run(argv, timeout=FLAGS_DEADLINE, check=False)
        flags = parse_serve_help(res.stdout)
        ray_line = next((line for line in res.stdout.splitlines() if line.startswith("@@ray ")), "")
        has_ray = {"@@ray yes": True, "@@ray no": False}.get(ray_line.strip())
        error = None if flags else f"exit {res.exit_code}, no flags listed: {res.stderr.strip()[-300:]}"
    except RemoteError as exc:
        flags, error = [], exc.message
    return ServeFlags(image_id=image_id, flags=flags, has_ray=has_ray, error=error)
