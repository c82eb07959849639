"""Every shell fragment the reconciler runs to *read* a node, each beside the parser of what it prints. One also
writes, once: the head's cluster id (`identity_script`), the reconciler's own bookkeeping beside its lease.

The probe (`observe`) joins the fragments into one script per node per cycle; a step that must read the same fact
again right before acting (a link's state, MemAvailable, the serving API, one container) runs the same fragment
through `read_sections` and the same parser. So the probe and the steps can never disagree on what a node said.

Only tools a stock DGX OS has: the docker CLI (or the engine's socket via curl), `ip -j`, cat of /sys and /proc,
curl. A fragment prints sections (`sec NAME` ... `rc N`, their markers sealed: `sealed`); each section fails on
its own, so a dead docker engine still leaves the link and memory observed. Every interpolated value is validated
by spec and quoted by `ssh.quote`; every parser goes through `node_output`, so odd bytes are one node's
ProbeError, never a crash.
"""

from __future__ import annotations

import functools
import hashlib
import ipaddress
import json
import math
import re
import secrets
import urllib.parse
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Generic, ParamSpec, TypeVar

from reconciler.core.listeners import MAPPED_HEX, WILDCARD4_HEX, WILDCARD6_HEX, proc_address
from reconciler.core.nccl import NETWORK_LINES, is_network_name
from reconciler.core.observed import (
    MAX_KNOWN_AS,
    ClusterIdentity,
    Container,
    EngineLoad,
    GpuStack,
    Image,
    Link,
    Memory,
    RdmaPort,
    ServingApi,
)
from reconciler.core.platforms import image_platform
from reconciler.core.spec import Desired, Node
from reconciler.core.text import printable
from reconciler.core.vllm import pools
from reconciler.edge.ssh import ENDED_BY_TIMEOUT, CommandTimeout, Session, quote, quote_word

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


#: JSON values one document of node output may hold (`node_json`). `json.loads` builds the whole document, and a
#: value costs the daemon 30 to 90 bytes however few bytes spell it: 28.6 MiB of `{},` in the `containers` section
#: (under both of the command's caps) peaked at 724 MiB, above the unit's MemoryMax=512M (issue 53). The docker
#: API's list of a node's containers holds ~150 values per container; at the cap a document costs under 90 MiB.
MAX_JSON_VALUES = 1_000_000


def node_json(text: str, start: int = 0) -> Any:
    """`json.loads(text[start:])` of node output, refused (ValueError) past MAX_JSON_VALUES values before anything
    is built, not even the slice: counted from above by the characters that open or follow one (`[{,:`)."""
    if sum(text.count(c, start) for c in "[{,:") >= MAX_JSON_VALUES:
        raise ValueError(f"more than {MAX_JSON_VALUES} JSON values")
    try:
        return json.loads(text[start:] if start else text)
    except RecursionError:  # nested deeper than the interpreter's stack
        raise ValueError("JSON nested too deep") from None


@dataclass
class Section:
    body: str
    rc: int


# Sections are sealed: each marker line is `@@NONCE NAME` or `@@NONCE rc N`, the nonce fresh for each script and
# known only to the head and the shell reading the script on its stdin (in no argv, no file: `printf` is a builtin).
# Much of a section's body comes from elsewhere: the serving port's HTTP answers (whoever listens there), `ray
# status`, docker's JSON, file names. With a fixed `@@name`, a local user who bound the serving port while vLLM was
# down forged the head's containers, weights, links and memory (issue 31); without the nonce no line can close a
# section or open another.
# A section's name takes the prefix `$PFX` (`NAME/` while one deployment's fragments run, in a file of several;
# empty otherwise), so each deployment's `weights`, `health`, ... are its own (observe.py).
SECTION_FUNCTION = ("sec() { printf '\\n%s %s%s\\n' \"$SEAL\" \"${PFX:-}\" \"$1\"; }; "
                    "rc() { printf '\\n%s rc %s\\n' \"$SEAL\" \"$1\"; }")


@dataclass(frozen=True)
class Sealed:
    """A script of fragments and the nonce its section markers carry."""

    script: str
    nonce: str

    def __repr__(self) -> str:  # the script may carry the API key's header
        return f"Sealed(nonce={self.nonce[:4]}...)"


def sealed(lines: list[str]) -> Sealed:
    """The fragments as one script for `sh -s`, its markers sealed with a fresh nonce."""
    nonce = secrets.token_hex(16)
    return Sealed("\n".join([f"SEAL=@@{nonce}", "export LC_ALL=C", SECTION_FUNCTION, *lines]) + "\n", nonce)


#: Where `str.splitlines` ends a line, besides "\n".
_LINE_BREAKS = re.compile("\r\n|[\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029]")
_LINE_END = re.compile("\r\n|[\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029]")
_NEWLINES = re.compile("\n*")


def each_line(text: str) -> Iterator[str]:
    """`text.splitlines()` one line at a time: a parser that stops at a bound never splits the rest (issue 53)."""
    start = 0
    for end in _LINE_END.finditer(text):
        yield text[start:end.start()]
        start = end.end()
    if start < len(text):
        yield text[start:]


def _stripped(text: str, start: int, end: int) -> str:
    """`text[start:end].strip("\n")`, copied once."""
    lead = _NEWLINES.match(text, start, end)
    start = lead.end() if lead else start
    while end > start and text[end - 1] == "\n":
        end -= 1
    return text[start:end]


@node_output("probe output")
def split_sections(output: str, nonce: str) -> dict[str, Section]:
    """The sections of a sealed script's output: only a line starting with `@@NONCE ` is a marker. The output's
    lines are `output.splitlines()`, and a body is its lines joined by "\\n"; each body is one slice of the output,
    never a list of its lines: a million 31-byte lines (30 MiB, under both of the command's caps) made a million
    strings and peaked at 123 MiB (issue 53), now at about the output's own size."""
    text = _LINE_BREAKS.sub("\n", output) if _LINE_BREAKS.search(output) else output
    marker = re.compile(f"^{re.escape(f'@@{nonce} ')}(.*)$", re.MULTILINE)
    sections: dict[str, Section] = {}
    name: str | None = None
    start = 0  # where the open section's body begins
    for line in marker.finditer(text):
        word = line[1].strip()
        if word.startswith("rc ") and name is not None:
            sections[name] = Section(_stripped(text, start, line.start()), int(word[3:].strip() or 1))
            name = None
        elif not word.startswith("rc "):
            name, start = word, line.end() + 1
    return sections


def read_sections(session: Session, lines: list[str], timeout: float) -> dict[str, Section]:
    """Run fragments on a node outside the probe (a step re-reading one fact right before it acts). Past the
    deadline this is CommandTimeout, as for any command a step runs (the probe instead reads what did arrive)."""
    script = sealed(lines)
    result = session.run_script(script.script, timeout=timeout)
    if result.exit_code in ENDED_BY_TIMEOUT:
        raise CommandTimeout(session.name, f"reading {', '.join(_section_names(lines))} did not finish within "
                                           f"{timeout:g}s (ended on the node)")
    return split_sections(result.stdout, script.nonce)


def _section_names(lines: list[str]) -> list[str]:
    return [line.split(" ", 1)[1] for line in lines if line.startswith("sec ")]


# The Docker API over its unix socket: one curl instead of two or three Go CLI start-ups (85 -> 49 ms per no-op
# cycle, docs/benchmarks.md); the CLI stays the fallback (TCP DOCKER_HOST, no curl).
_DOCKER_SOCKET = 'sock=/var/run/docker.sock; case "${DOCKER_HOST:-}" in unix://*) sock=${DOCKER_HOST#unix://};; esac'


_INSPECT = ('{"name":{{json .Name}},"id":{{json .Id}},"image":{{json .Config.Image}},"image_id":{{json .Image}},'
            '"state":{{json .State.Status}},"labels":{{json .Config.Labels}},"started_at":{{json .State.StartedAt}},'
            '"mounts":{{json .Mounts}}}')


def containers_script() -> list[str]:
    """The `containers` section: every container, running or not (`parse_containers`)."""
    return [
        _DOCKER_SOCKET,
        "sec containers",
        "if out=$(curl -sf --unix-socket \"$sock\" 'http://docker/containers/json?all=1' 2>/dev/null); then "
        "printf 'API %s\\n' \"$out\"; rc=0; else "
        "ids=$(docker ps -aq --no-trunc 2>&1); rc=$?; "
        f"if [ $rc -eq 0 ] && [ -n \"$ids\" ]; then docker inspect --format {quote_word(_INSPECT)} $ids 2>&1; "
        "elif [ $rc -ne 0 ]; then printf '%s\\n' \"$ids\"; fi; fi",
        "rc $rc",
    ]


def _bind_sources(mounts: object) -> list[str] | None:
    """The host paths of a container's bind mounts (Docker's `Mounts`, in /containers/json and inspect alike);
    volumes live in docker's own data root. None when the engine did not say (retention then keeps every tree)."""
    if not isinstance(mounts, list):
        return None
    return sorted({m["Source"] for m in mounts if isinstance(m, dict) and m.get("Type") == "bind"
                   and isinstance(m.get("Source"), str)})


def _created(raw: dict[str, Any]) -> str | None:
    """The API's `Created` (unix seconds: the list has no `State.StartedAt`) as the RFC 3339 time the CLI path
    reads from inspect. For the serving containers it is their start: `docker run` creates and starts in one, with
    `--restart no`, and they are never started again in place (a stopped one is removed before the next run). So
    the health watch can tell a container older than the cold-start allowance after a daemon restart (issue 30)."""
    created = raw.get("Created")
    if isinstance(created, bool) or not isinstance(created, int) or created <= 0:
        return None
    return datetime.fromtimestamp(created, tz=UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _api_container(raw: dict[str, Any]) -> Container:
    return Container(name=(raw.get("Names") or ["/"])[0].lstrip("/"), id=raw["Id"], image=raw.get("Image", ""),
                     image_id=raw.get("ImageID", ""), state=raw["State"], labels=raw.get("Labels") or {},
                     mounts=_bind_sources(raw.get("Mounts")), started_at=_created(raw))


#: Containers a node's `containers` section may list (running or not): a model each, ~1.5 KB, so a section of 250,000
#: minimal ones (`{"Id":"a","State":"running"}`, under MAX_JSON_VALUES) would cost hundreds of MiB (issue 53).
MAX_CONTAINERS = 20_000


@node_output("containers")
def parse_containers(sec: Section | None) -> tuple[bool, str | None, list[Container]]:
    if sec is None:
        return False, "probe did not report containers", []
    too_many = ValueError(f"more than {MAX_CONTAINERS} containers")
    if sec.rc == 0 and sec.body.startswith("API "):
        listed = node_json(sec.body, 4)
        if isinstance(listed, list) and len(listed) > MAX_CONTAINERS:
            raise too_many
        found = [_api_container(raw) for raw in listed]
        return True, None, sorted(found, key=lambda c: c.name)
    found = []
    for line in each_line(sec.body):
        if line.startswith("{"):
            if len(found) == MAX_CONTAINERS:
                raise too_many
            raw = node_json(line)
            raw["name"] = raw["name"].lstrip("/")
            raw["labels"] = raw.get("labels") or {}
            raw["mounts"] = _bind_sources(raw.get("mounts"))
            found.append(Container.model_validate(raw))
    if sec.rc != 0 and not found:
        return False, sec.body.strip()[-500:] or f"docker exited {sec.rc}", []
    return True, None, sorted(found, key=lambda c: c.name)


def image_script(image: str) -> list[str]:
    """The `image` section: the engine's inspect object of `image` (`parse_image`); needs `containers_script`'s
    socket line before it."""
    return [
        "sec image",
        f"if img=$(curl -sf --unix-socket \"$sock\" {quote_word('http://docker/images/' + image + '/json')}"
        " 2>/dev/null); then printf 'API %s\\n' \"$img\"; else "
        f"docker image inspect {quote_word(image)} 2>/dev/null; fi; rc $?",
    ]


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
    entrypoint = config.get("Entrypoint") or []
    if not isinstance(entrypoint, list) or not all(isinstance(a, str) for a in entrypoint):
        raise TypeError(f"not an image Entrypoint: {str(entrypoint)[:80]!r}")
    platform = image_platform(str(raw.get("Os") or ""), str(raw.get("Architecture") or ""),
                              str(raw.get("Variant") or ""))
    size = raw.get("Size")
    return Image(id=raw["Id"], content="sha256:" + hashlib.sha256(body.encode()).hexdigest(), digests=digests,
                 store=store, entrypoint=entrypoint, platform=platform,
                 size=size if isinstance(size, int) and size >= 0 else None)


@node_output("image")
def parse_image(sec: Section | None) -> Image | None:
    """The serving image on a node (None: absent). `API {...}`: the engine's API answered; else the CLI's
    `docker image inspect` array."""
    body = sec.body.strip() if sec and sec.rc == 0 else ""
    if not body:
        return None
    if body.startswith("API "):
        return image_from_inspect(node_json(body, 4))
    found = node_json(body)
    return image_from_inspect(found[0]) if found else None


_TWIN = "-twin"  # section suffix of the fabric's twin port


def link_script(node: Node) -> list[str]:
    """Script lines reading each fabric port: `link`/`rdma` sections for the first, `link-twin`/`rdma-twin` for
    the twin (needs `sec`). The probe and the link step read the ports with these same lines."""
    lines = []
    for port, suffix in zip(node.fabric.ports(), ("", _TWIN), strict=False):
        lines += [f"sec link{suffix}", f"ip -j addr show dev {quote_word(port.interface)} 2>&1; rc $?",
                  f"sec rdma{suffix}"]
        if port.rdma_device:
            sysfs = f"/sys/class/infiniband/{port.rdma_device}/ports/1"
            # the RoCE v2 GIDs: `grep -l` names the types that say so (an unused entry's type is EINVAL, hence
            # 2>/dev/null), each printed `gid N VALUE` after the two state lines (NCCL_IB_GID_INDEX, at_start)
            gids = (f"(cd {quote_word(sysfs + '/gid_attrs/types')} 2>/dev/null && grep -lx 'RoCE v2' -- * "
                    "2>/dev/null | head -n 64 | while read -r i; do printf 'gid %s %s\\n' \"$i\" "
                    "\"$(cat ../../gids/\"$i\" 2>/dev/null)\"; done)")
            lines.append(f"if [ -d {quote_word(sysfs)} ]; then "
                         f"cat {quote_word(sysfs + '/state')} {quote_word(sysfs + '/phys_state')}; "
                         f"r=$?; {gids}; rc $r; else rc 2; fi")
        else:
            lines.append("rc 2")
    return lines


def _link(name: str, info: dict[str, Any], rdma: RdmaPort | None) -> Link:
    """One interface of `ip -j addr` as a Link: the one reading of iproute2's JSON (flags, mtu, IPv4)."""
    flags = info.get("flags", [])
    addresses = [f"{a['local']}/{a['prefixlen']}" for a in info.get("addr_info", []) if a.get("family") == "inet"]
    return Link(name=name, operstate=str(info.get("operstate", "UNKNOWN")).lower(), admin_up="UP" in flags,
                carrier="LOWER_UP" in flags, mtu=int(info.get("mtu", 0)), addresses=addresses, rdma=rdma)


@node_output("link")
def parse_link(name: str, link_sec: Section | None, rdma_sec: Section | None) -> Link:
    if link_sec is None or link_sec.rc != 0:
        return Link(name=name, exists=False)
    data = node_json(link_sec.body or "[]")
    if not data:
        return Link(name=name, exists=False)
    rdma = None
    if rdma_sec is not None and rdma_sec.rc == 0:
        lines = rdma_sec.body.split("\n")
        state, phys = (lines + ["", ""])[:2]
        rdma = RdmaPort(state=state.strip(), phys_state=phys.strip(), roce_v2_gids=_gids(lines[2:]))
    return _link(name, data[0], rdma)


_GID = re.compile(r"^gid (\d{1,4}) ((?:[0-9a-f]{4}:){7}[0-9a-f]{4})$")


def _gids(lines: list[str]) -> dict[int, str]:
    """The `gid N VALUE` lines of a port's RoCE v2 entries; any other line (a GID that did not read) is left out."""
    return {int(m.group(1)): m.group(2) for line in lines if (m := _GID.match(line.strip()))}


def parse_links(node: Node, sections: dict[str, Section]) -> tuple[Link, Link | None]:
    """The first port's link and the twin's (None when no twin is declared), from `link_script`'s sections."""
    first = parse_link(node.fabric.interface, sections.get("link"), sections.get("rdma"))
    twin = node.fabric.twin
    if twin is None:
        return first, None
    return first, parse_link(twin.interface, sections.get("link" + _TWIN), sections.get("rdma" + _TWIN))


def interfaces_script() -> list[str]:
    """The `addr` and `rdma_sysfs` sections, for a node whose fabric is not declared yet (discover): every
    interface's `ip -j addr` (`parse_interfaces`) and every RDMA device's port 1 with the netdevs it drives
    (`parse_rdma_devices`). `link_script` reads the declared ports only."""
    return [
        "sec addr",
        "ip -j addr 2>&1; rc $?",
        "sec rdma_sysfs",
        "for d in /sys/class/infiniband/*; do",
        "  [ -d \"$d\" ] || continue",
        "  printf 'dev %s\\n' \"${d##*/}\"",
        "  printf 'state %s\\n' \"$(cat \"$d/ports/1/state\" 2>/dev/null)\"",
        "  printf 'phys_state %s\\n' \"$(cat \"$d/ports/1/phys_state\" 2>/dev/null)\"",
        "  for n in \"$d\"/device/net/*; do [ -e \"$n\" ] && printf 'net %s\\n' \"${n##*/}\"; done",
        "done; rc 0",
    ]


@node_output("interfaces")
def parse_interfaces(sec: Section | None) -> list[Link]:
    """Every interface of `interfaces_script`'s `addr` section but the loopback, in the kernel's order, read as
    `parse_link` reads one (their RDMA ports are `parse_rdma_devices`')."""
    if sec is None or sec.rc != 0:
        return []
    return [_link(str(info["ifname"]), info, None) for info in node_json(sec.body or "[]")
            if "LOOPBACK" not in info.get("flags", [])]


@dataclass(frozen=True)
class RdmaDevice:
    """An RDMA device (`rocep1s0f1`), the netdevs it drives (`enp1s0f1np1`) and the state of its port 1."""

    name: str
    netdevs: tuple[str, ...]
    port: RdmaPort


@node_output("rdma devices")
def parse_rdma_devices(sec: Section | None) -> list[RdmaDevice]:
    """The `dev`/`state`/`phys_state`/`net` lines of `interfaces_script`'s `rdma_sysfs` section."""
    if sec is None or sec.rc != 0:
        return []
    devices: list[dict[str, Any]] = []
    for line in sec.body.splitlines():
        key, _, value = line.partition(" ")
        if key == "dev":
            devices.append({"name": value.strip(), "state": "", "phys_state": "", "netdevs": []})
        elif devices and key in ("state", "phys_state"):
            devices[-1][key] = value.strip()
        elif devices and key == "net":
            devices[-1]["netdevs"].append(value.strip())
    return [RdmaDevice(d["name"], tuple(d["netdevs"]), RdmaPort(state=d["state"], phys_state=d["phys_state"]))
            for d in devices]


def machine_script() -> list[str]:
    """The `machine` section: `uname -m`, which the serving image's platform must fit (`parse_machine`)."""
    return ["sec machine", "uname -m; rc $?"]


_MACHINE = re.compile(r"[A-Za-z0-9_.-]{1,32}")


@node_output("machine")
def parse_machine(sec: Section | None) -> str | None:
    """The node's machine name; None when uname did not answer. Anything but one plain word is odd output."""
    if sec is None or sec.rc != 0:
        return None
    word = sec.body.strip()
    if not _MACHINE.fullmatch(word):
        raise ValueError(f"not a machine name: {word[:40]!r}")
    return word


#: Bytes of the cluster-id file the probe prints: an id and MAX_KNOWN_AS names of at most 300 bytes fit; a file
#: that does not is odd output (the parser sees the cut).
IDENTITY_MAX_BYTES = 1 << 15


def identity_script(instance: str) -> list[str]:
    """The `identity` section, on the head only: the cluster's id in `~/.spark-reconciler/cluster-id`, made here
    when the file is absent or empty (`parse_identity`).

    This is the reconciler's own bookkeeping beside the lease (`edge.lease`, same 0700 directory, umask 077),
    never cluster state or user data: it changes nothing a container, a model or a co-tenant sees, so even
    `reconciler observe` may make it. It belongs to the head machine, not to an address, so every tool that
    reaches the head (the daemon, `reconciler apply` from a laptop, under any address the head answers on) finds
    the same id. Made once: the id (/proc/sys/kernel/random/uuid) and `instance`, the head's `host:port` its
    containers were labelled with until now (adopted as `known_as`), go to a temp file in the directory, which
    `ln` links to the name; `ln` fails when another probe made it first, and that one's file is what is printed.
    An empty file (no probe writes one) is removed first. `instance` comes from the spec (validated) and is
    quoted here."""
    return ["sec identity",
            f"(i={quote_word(instance)}; d=\"$HOME/.spark-reconciler\"; f=\"$d/cluster-id\"; umask 077; "
            "mkdir -p -- \"$d\" || exit 70; "
            "if [ ! -s \"$f\" ]; then "
            "[ -e \"$f\" ] && rm -f -- \"$f\"; "
            "u=$(cat /proc/sys/kernel/random/uuid) && [ -n \"$u\" ] || exit 71; "
            "t=\"$d/.cluster-id.$$\"; printf '%s\\n%s\\n' \"$u\" \"$i\" > \"$t\" || { rm -f -- \"$t\"; exit 72; }; "
            "ln -- \"$t\" \"$f\" 2>/dev/null; rm -f -- \"$t\"; fi; "
            f"head -c {IDENTITY_MAX_BYTES + 1} -- \"$f\") 2>&1; rc $?"]


@node_output("identity")
def parse_identity(sec: Section | None) -> ClusterIdentity | None:
    """The head's cluster id and former names (None: not asked, a node other than the head). A head that could
    not make or read the file, or a file that is not one id line then `host:port` lines, is odd output: the head's
    ProbeError, never a guess at whose its containers are. Blank lines (a hand edit) are skipped."""
    if sec is None:
        return None
    if sec.rc != 0:
        raise ValueError(f"~/.spark-reconciler/cluster-id could not be made or read on the head (exit {sec.rc}): "
                         f"{sec.body.strip()[-200:] or 'no output'}")
    if len(sec.body.encode()) > IDENTITY_MAX_BYTES:
        raise ValueError(f"~/.spark-reconciler/cluster-id is longer than {IDENTITY_MAX_BYTES} bytes")
    lines = [line.strip() for line in sec.body.splitlines() if line.strip()]
    if not lines:
        raise ValueError("~/.spark-reconciler/cluster-id is empty")
    if len(lines) > 1 + MAX_KNOWN_AS:
        raise ValueError(f"~/.spark-reconciler/cluster-id has {len(lines) - 1} former names, more than "
                         f"{MAX_KNOWN_AS}")
    return ClusterIdentity(id=lines[0], known_as=list(dict.fromkeys(lines[1:])))


def gpu_script() -> list[str]:
    """The `gpu`, `gpu_hook` and `os` sections (`parse_gpu_stack`). nvidia-smi under `timeout`: a wedged driver
    can hang it, and the probe must answer within its deadline. It asks for the two fields the GPU stack needs;
    a GB10's memory fields, `[N/A]` there, are not among them (tests/unit/fixtures/nvidia-smi/README.md). Only
    the DGX OS version lines of /etc/dgx-release are read (the file also holds the serial number)."""
    return ["sec gpu",
            "if command -v nvidia-smi >/dev/null 2>&1; then timeout 10 nvidia-smi "
            "--query-gpu=name,driver_version --format=csv,noheader 2>&1; rc $?; "
            "else echo 'nvidia-smi: command not found'; rc 127; fi",
            "sec gpu_hook",
            "command -v nvidia-container-runtime-hook; rc $?",
            "sec os",
            "uname -r; grep -E '^DGX_(SWBUILD_VERSION|OTA_VERSION)=' /etc/dgx-release 2>/dev/null; rc 0"]


_DRIVER = re.compile(r"\d+(\.\d+)+")
_KERNEL = re.compile(r"[A-Za-z0-9_.+~-]{1,64}")  # 6.17.0-1014-nvidia


def parse_gpu_stack(gpu: Section | None, hook: Section | None, os_release: Section | None) -> GpuStack | None:
    """The node's GPU stack; None when the probe did not ask (no `gpu` section)."""
    if gpu is None:
        return None
    stack = GpuStack(hook=hook is not None and hook.rc == 0, **_os_release(os_release))
    lines = [line.strip() for line in gpu.body.splitlines() if line.strip()]
    if gpu.rc != 0 or not lines:
        first = lines[0] if lines else "no output"
        return stack.model_copy(update={"error": first[:200], "status": gpu.rc})
    return stack.model_copy(update=_gpu_line(lines[0]))


@node_output("gpu")
def _gpu_line(line: str) -> dict[str, str]:
    """`NVIDIA GB10, 580.95.05`: the first GPU's name and the driver (one driver serves every GPU)."""
    name, _, driver = line.rpartition(", ")
    if not name or not _DRIVER.fullmatch(driver):
        raise ValueError(f"not `name, driver_version`: {line[:80]!r}")
    return {"gpu": name, "driver": driver}


#: The /etc/dgx-release keys the DGX OS release is read from: the image's, then one per OTA update (DGX OS appends
#: a DGX_OTA_VERSION/DGX_OTA_DATE block after each, fixtures/dgx-release-*.txt); never DGX_SERIAL_NUMBER, a date.
_DGX_VERSION_KEYS = ("DGX_SWBUILD_VERSION", "DGX_OTA_VERSION")


@node_output("os")
def _os_release(sec: Section | None) -> dict[str, str | None]:
    """`uname -r`, then DGX_SWBUILD_VERSION and any DGX_OTA_VERSION lines (an OTA update appends one: the last
    is the release now). Only those two keys are read, whatever else a line says (the probe's grep keeps only
    them; a whole file read here would still give the release, never the serial number or an OTA date)."""
    lines = each_line(sec.body) if sec is not None else iter(())
    kernel = next(lines, "").strip()
    if kernel and not _KERNEL.fullmatch(kernel):
        raise ValueError(f"not a kernel release: {kernel[:60]!r}")
    last = None  # the last version line: nothing kept of the others (issue 53)
    for key, eq, value in (line.partition("=") for line in lines):
        if eq and key.strip() in _DGX_VERSION_KEYS:
            last = value
    return {"kernel": kernel, "dgx_os": last.strip().strip('"')[:40] if last is not None else None}


def disk_script(weights_path: str) -> list[str]:
    """The `disk` section: free bytes where the weights go (the model path, or its nearest existing parent: a
    first copy creates it) and where docker keeps images (its data root, from the engine's /info), one
    `weights`/`image` line of `df -P -B1` each: its free bytes (`parse_disk`) and the filesystem it is on
    (`parse_disk_fs`: both on one filesystem share its room). Needs `containers_script`'s socket line before."""
    return ["sec disk",
            f"p={quote_word(weights_path)}; while [ ! -e \"$p\" ] && [ \"$p\" != / ]; do p=$(dirname -- \"$p\"); "
            "done; printf 'weights '; df -P -B1 -- \"$p\" 2>/dev/null | tail -n 1; "
            "r=$(curl -sf --unix-socket \"$sock\" http://docker/info 2>/dev/null | "
            "grep -o '\"DockerRootDir\":\"[^\"]*\"' | cut -d '\"' -f 4); "
            "[ -n \"$r\" ] || r=$(docker info --format '{{.DockerRootDir}}' 2>/dev/null); "
            "if [ -n \"$r\" ]; then printf 'image '; df -P -B1 -- \"$r\" 2>/dev/null | tail -n 1; fi; "
            "rc 0"]


@node_output("disk")
def parse_disk(sec: Section | None) -> dict[str, int] | None:
    """`weights`/`image` -> free bytes, from `df -P` rows (`FS 1-blocks Used Available Capacity Mount`); a line
    df did not complete is left out (not known)."""
    if sec is None or sec.rc != 0:
        return None
    free = {}
    for line in sec.body.splitlines():
        what, _, row = line.partition(" ")
        cols = row.split()
        if what not in ("weights", "image"):
            if line.strip():
                raise ValueError(f"not a df line: {line[:80]!r}")
            continue
        if not cols:
            continue  # df did not answer for it
        if len(cols) < 6 or not cols[3].isdigit():
            raise ValueError(f"not a `df -P -B1` row: {row[:80]!r}")
        free[what] = int(cols[3])
    return free


@node_output("disk")
def parse_disk_fs(sec: Section | None) -> dict[str, str] | None:
    """`weights`/`image` -> the filesystem its `df -P` row is on (`NodeObservation.disk_fs`): the row's device
    when it names a device node (`/dev/nvme0n1p2`: a bind mount of it is the same filesystem, so the same room),
    else its mount point (`tmpfs`, `overlay`: a name many filesystems share). On DGX OS the model path and
    docker's data root are both on the one NVMe's `/`: one room for both copies. The rows `parse_disk` reads."""
    if parse_disk(sec) is None:
        return None
    assert sec is not None
    where_on = {}
    for line in sec.body.splitlines():
        what, _, row = line.partition(" ")
        cols = row.split()
        if what in ("weights", "image") and cols:
            device, mount = cols[0], " ".join(cols[5:])  # a mount point may hold spaces; df's last column
            where_on[what] = device if device.startswith("/dev/") else mount
    return where_on


def listen_script() -> list[str]:
    """The `listen` section: the LISTEN rows (state 0A) of /proc/net/tcp and tcp6, filtered on the node so a busy
    node's thousands of connections never fill the probe (`parse_listening`). /proc, not `ss`: nothing to
    install, and the same kernel table. tcp6 is absent where IPv6 is off."""
    return ["sec listen",
            "if [ -r /proc/net/tcp ]; then cat /proc/net/tcp /proc/net/tcp6 2>/dev/null | "
            "grep -E '^ *[0-9]+: [0-9A-Fa-f]+:[0-9A-Fa-f]{4} [0-9A-Fa-f]+:[0-9A-Fa-f]{4} 0A '; "
            "rc 0; else rc 2; fi"]


def listening_ports(text: str) -> set[int]:
    """The local ports of /proc/net/tcp{,6} LISTEN rows (`sl local rem st ...`, addresses `HEX:PORT` in hex)."""
    ports = set()
    for line in text.splitlines():
        cols = line.split()
        if not cols:
            continue
        if len(cols) < 4 or cols[3] != "0A":
            raise ValueError(f"not a LISTEN row of /proc/net/tcp: {line[:80]!r}")
        ports.add(int(cols[1].rpartition(":")[2], 16))
    return ports


@node_output("listen")
def parse_listening(sec: Section | None) -> list[int] | None:
    """The node's listening TCP ports, sorted; None when /proc/net/tcp could not be read."""
    if sec is None or sec.rc != 0:
        return None
    return sorted(listening_ports(sec.body))


def listen_addresses(text: str) -> dict[int, list[str]]:
    """The local addresses each port of /proc/net/tcp{,6} LISTEN rows is listened on at, as text
    (`core.listeners.proc_address`: `127.0.0.1`, `::1`), sorted. A row whose address does not read is left out:
    its port then has no address known, which `planning._ports_taken` counts as in the way."""
    found: dict[int, set[str]] = {}
    for line in text.splitlines():
        cols = line.split()
        if len(cols) < 4 or cols[3] != "0A":
            continue  # `listening_ports` names such a row
        address, _, port = cols[1].rpartition(":")
        try:
            found.setdefault(int(port, 16), set()).add(proc_address(address))
        except ValueError:
            continue
    return {port: sorted(addresses) for port, addresses in sorted(found.items())}


@node_output("listen")
def parse_listen_addresses(sec: Section | None) -> dict[int, list[str]] | None:
    """Where each listening port is listened on (`listen_addresses`); None when /proc/net/tcp could not be read."""
    if sec is None or sec.rc != 0:
        return None
    return listen_addresses(sec.body)


def memory_script() -> list[str]:
    """The `meminfo` section: MemTotal and MemAvailable, the unified memory GPU and CPU share (`parse_memory`)."""
    return ["sec meminfo", "grep -E '^(MemTotal|MemAvailable):' /proc/meminfo; rc $?"]


@node_output("meminfo")
def parse_memory(sec: Section | None) -> Memory | None:
    if sec is None or sec.rc != 0:
        return None
    values = {}
    for line in each_line(sec.body):  # every line a number, and only the two kept (issue 53: a million other
        key, _, rest = line.partition(":")  # keys, 13 MiB, made a dict of 180 MiB)
        value = int(rest.split()[0]) * 1024
        if key in ("MemTotal", "MemAvailable"):
            values[key] = value
    return Memory(total_bytes=values["MemTotal"], available_bytes=values["MemAvailable"])


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
    the check that cannot be fooled. The served name is validated by spec; the body is JSON, quoted once.
    A pooling model (`--runner pooling`: embeddings, a reranker) has no completions API; vLLM's Pooling API
    (`POST /pooling` with `input`, every pooling model: vllm/entrypoints/pooling/pooling/serving.py) takes the
    same one pass through every rank."""
    name = desired.served_name
    if pools(desired.serving):  # an embeddings model or a reranker answers no completion: its own request
        body, path = json.dumps({"model": name, "input": "ping"}), "/pooling"
    else:
        body, path = json.dumps({"model": name, "prompt": "ping", "max_tokens": 1, "temperature": 0}), "/v1/completions"
    url = f"http://127.0.0.1:{desired.serving.port}{path}"
    return api_argv(desired, "-s", "-m", str(COMPLETION_DEADLINE), "-H", "Content-Type: application/json",
                    "-w", "\\n%{http_code}", "-d", body, url)


VERIFY_DEADLINE = 30  # seconds for the verify's answer: a few tokens, after the first request of a fresh engine


def verify_argv(desired: Desired) -> list[str]:
    """serving.verify's one request (`curl`, body then the HTTP code on its own line), beside the completion's and
    sent the same way (`api_argv`: the API key's header from stdin): greedy (`temperature` 0, so the same weights
    give the same text), at most `max_tokens`, to /v1/completions with the prompt as it is or to
    /v1/chat/completions with the prompt as the user's message. The prompt is the file's, validated there; the
    body is JSON, quoted once."""
    verify = desired.serving.verify
    assert verify is not None, "a verify is asked only of a deployment that declares one"
    common = {"model": desired.served_name, "max_tokens": verify.max_tokens, "temperature": 0}
    if verify.endpoint == "chat":
        body, path = {**common, "messages": [{"role": "user", "content": verify.prompt}]}, "/v1/chat/completions"
    else:
        body, path = {**common, "prompt": verify.prompt}, "/v1/completions"
    url = f"http://127.0.0.1:{desired.serving.port}{path}"
    return api_argv(desired, "-s", "-m", str(VERIFY_DEADLINE), "-H", "Content-Type: application/json",
                    "-w", "\\n%{http_code}", "-d", json.dumps(body), url)


def api_script(desired: Desired) -> list[str]:
    """The `health`, `models` and `completion` sections of the head's API (`parse_serving`).

    /v1/models and the completion only when /health answered 200: a frozen API would cost their whole deadlines
    (2 s + 5 s) on every probe, and what they say of an unhealthy API is never used. The API key travels in the
    script (stdin of `sh -s`) and into curl by a builtin's pipe: never in an argv."""
    port = desired.serving.port
    header = auth_header(desired)
    auth = f"printf %s {quote_word(header.decode())} | " if header else ""
    return [
        *port_owner_script(port, desired.serving.host),
        "sec health",
        f"code=$(curl -s -o /dev/null -m 2 -w '%{{http_code}}' {quote_word(f'http://127.0.0.1:{port}/health')}); "
        "rc=$?; [ \"$owners\" = \"0 \" ] || code=; printf '%s\\n' \"$code\"; rc $rc",
        "sec models",
        f"rc=0; if [ \"$code\" = 200 ]; then {auth}"
        f"{quote(api_argv(desired, '-s', '-m', '2', f'http://127.0.0.1:{port}/v1/models'))}; rc=$?; "
        "fi; echo; rc $rc",
        "sec completion",
        f"rc=0; if [ \"$code\" = 200 ]; then {auth}{quote(completion_argv(desired))}; rc=$?; fi; echo; "
        "rc $rc",
        "sec engine",
        f"rc=0; if [ \"$code\" = 200 ]; then curl -s -m 2 {quote_word(f'http://127.0.0.1:{port}/metrics')} | "
        f"grep -E {quote_word(_ENGINE_LINES)}; rc=$?; fi; rc $rc",
    ]


#: The lines of vLLM's /metrics the engine section keeps (read after the completion, so its own token counts):
#: a real vLLM's page is tens of KB of histograms, filtered on the node.
ENGINE_METRICS = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:prompt_tokens_total",
                  "vllm:generation_tokens_total")
#: Read when the image exports it: what moves while a long chunked prefill is the only work (core.observed.EngineLoad).
KV_USAGE = "vllm:kv_cache_usage_perc"
_ENGINE_LINES = "^(" + "|".join((*ENGINE_METRICS, KV_USAGE)) + ")[{ ]"


def _sample(line: str) -> tuple[str, float | None]:
    """A Prometheus text sample line: its name and value (the first field after the name and its labels; an
    optional timestamp follows). A line cut short by `curl -m` on a busy server, or a value that is no count (NaN,
    Inf), gives None: skipped, and a metric missing in the end makes the whole answer None."""
    head, brace, rest = line.partition("{")
    if brace:
        labels, closed, after = rest.rpartition("}")
        fields = after.split() if closed else []
    else:
        parts = line.split()
        head, fields = (parts[0], parts[1:]) if parts else ("", [])
    try:
        value = float(fields[0]) if fields else None
    except ValueError:
        value = None
    return head.strip(), value if value is not None and math.isfinite(value) else None


@node_output("engine")
def parse_engine(sec: Section | None) -> EngineLoad | None:
    """vLLM's counters, summed over label sets (one engine per API server here; several with data parallel).
    None: not read (an unhealthy API, no /metrics, a page without them)."""
    if sec is None or sec.rc not in (0, 1):  # grep's 1: no such line
        return None
    sums: dict[str, float] = {}
    for line in sec.body.splitlines():
        name, value = _sample(line)
        if (name in ENGINE_METRICS or name == KV_USAGE) and value is not None:
            sums[name] = sums.get(name, 0.0) + value
    if not all(m in sums for m in ENGINE_METRICS):
        return None
    return EngineLoad(running=sums[ENGINE_METRICS[0]], waiting=sums[ENGINE_METRICS[1]],
                      tokens=sums[ENGINE_METRICS[2]] + sums[ENGINE_METRICS[3]], kv_usage=sums.get(KV_USAGE))


@node_output("completion")
def parse_completion(sec: Section | None) -> str | None:
    """None when the completion answered with a choice (a pooling model's /pooling: with data); else a short
    reason (node bytes never raise)."""
    if sec is None:
        return "not tried"
    body, _, code = sec.body.strip().rpartition("\n")
    if sec.rc == 28:
        return f"no answer within {COMPLETION_DEADLINE}s"
    if code.strip() != "200":
        return f"HTTP {code.strip() or 'none'} (curl exit {sec.rc})"
    try:
        answer = node_json(body)
        choices = answer.get("choices", answer.get("data"))
    except (ValueError, AttributeError):
        return "the answer is not JSON"
    return None if isinstance(choices, list) and choices else "the answer has no choices"


@dataclass(frozen=True)
class VerifyAnswer:
    """What serving.verify's request got: the answer's text (None when there is none), or why not (`problem`:
    printable, short); `answered`: the API gave an HTTP answer (a wrong one included), so asking again changes
    nothing; False while no answer came (curl's deadline, a refused connection): worth another try."""

    text: str | None
    problem: str = ""
    answered: bool = True


VERIFY_SHOWN = 200  # characters of an answer or an error a message quotes


def shown(text: str) -> str:
    """Node text as a message quotes it: one printable line, at most VERIFY_SHOWN characters."""
    text = printable(text)
    return text if len(text) <= VERIFY_SHOWN else text[:VERIFY_SHOWN - 1] + "…"


def _error_of(body: str) -> str:
    """The message of an error answer (vLLM's `{"error": {"message": ...}}`, an older `{"message": ...}`, a
    proxy's `{"detail": ...}`), else the body itself."""
    try:
        doc = node_json(body)
    except ValueError:
        return body
    error = doc.get("error", doc) if isinstance(doc, dict) else None
    if isinstance(error, dict):
        said = error.get("message") or error.get("detail")
        return said if isinstance(said, str) else body
    return error if isinstance(error, str) else body


def _answer_text(body: str, chat: bool) -> str | None:
    """The first choice's text (`text` of a completion, `message.content` of a chat completion); None when the
    answer has none (not JSON, no choice, a null content)."""
    try:
        choices = node_json(body).get("choices")
        choice = choices[0] if isinstance(choices, list) and choices else {}
        text = choice.get("message", {}).get("content") if chat else choice.get("text")
    except (ValueError, AttributeError):
        return None
    return text if isinstance(text, str) else None


@node_output("verify")
def parse_verify(sec: Section | None, port_owner: Section | None, chat: bool) -> VerifyAnswer:
    """serving.verify's section (`verify_fact`). Node bytes never raise: whatever came back is an answer, a problem,
    or no answer yet."""
    holder = parse_port_holder(port_owner)
    if holder is not None:
        return VerifyAnswer(None, f"uid {holder} (not root, so not vLLM) listens on the serving port: not asked")
    if sec is None:
        return VerifyAnswer(None, "not asked", answered=False)
    body, _, code = sec.body.strip().rpartition("\n")
    if not code.strip():  # curl always writes the code (000 without an answer): it did not run
        return VerifyAnswer(None, "not asked: no process of root's listens on the serving port", answered=False)
    if sec.rc == 28:
        return VerifyAnswer(None, f"no answer within {VERIFY_DEADLINE}s", answered=False)
    if sec.rc != 0 or not code.strip().isdigit() or code.strip() == "000":
        return VerifyAnswer(None, f"no answer (curl exit {sec.rc})", answered=False)
    if code.strip() != "200":
        return VerifyAnswer(None, f"HTTP {code.strip()}: {shown(_error_of(body).strip())}")
    text = _answer_text(body, chat)
    if text is None:
        what = "content (a reasoning model may think past max_tokens)" if chat else "text"
        return VerifyAnswer(None, f"the answer has no {what}: {shown(body.strip())}")
    return VerifyAnswer(text)


def _takes_awk(host: str) -> str:
    """`core.listeners.takes(address, host)` as an awk condition on `a`, the address as /proc/net/tcp{,6} prints
    it (tests/unit/test_port_neighbours.py holds the two to the same answers)."""
    if host == "0.0.0.0":  # every IPv4 address, `::`, every IPv4-mapped one
        return f'(length(a) == 8 || a == "{WILDCARD6_HEX}" || substr(a, 1, 24) == "{MAPPED_HEX}")'
    own = ipaddress.IPv4Address(host).packed[::-1].hex().upper()  # 127.0.0.1 -> 0100007F
    return " || ".join(["(" + f'a == "{own}"', f'a == "{WILDCARD4_HEX}"', f'a == "{WILDCARD6_HEX}"',
                        f'a == "{MAPPED_HEX}{own}"', f'a == "{MAPPED_HEX}{WILDCARD4_HEX}")'])


def port_owner_script(port: int, host: str = "127.0.0.1") -> list[str]:
    """The `port_owner` section: the uids owning a LISTEN socket on the serving port that is in the way
    (/proc/net/tcp{,6}, column 8; `core.listeners.takes`: it would receive the checks' connection to 127.0.0.1 or
    keep vLLM from binding `host`), as `$owners` ("0 " when only root does) on the first line; then every LISTEN
    row on the port, `+ UID ADDRESS` (in the way) or `- UID ADDRESS` (another address: `[::1]`, `127.0.0.2`).
    Serving containers run as root; a squatter does not (a local user who bound the port while vLLM was down,
    after a crash). Only when root alone is in the way is /health taken and the API asked, with its key: any other
    listener in the way gets nothing (`$code` is emptied) and is named (`port_holder`); one elsewhere is said
    (`port_neighbours`) and holds nothing (issue 53, B: `[::1]:8000` held serving while vLLM served).

    A `::` row of another uid beside root's IPv4 listener in the way is not counted: the kernel refuses a
    dual-stack `::` bind beside any IPv4 listener on the port (SO_REUSEPORT lets only one uid share it), so that
    socket is IPV6_V6ONLY and takes neither. Without root's, a `::` row counts: /proc does not say IPV6_V6ONLY."""
    takes = _takes_awk(host)
    program = (f'$4 == "0A" && $2 ~ /:{port:04X}$/ {{ a = substr($2, 1, index($2, ":") - 1); n++; at[n] = a; '
               f'uid[n] = $8; if (length(a) == 8 && $8 == 0 && {takes}) root4 = 1 }} '
               'END { for (i = 1; i <= n; i++) { a = at[i]; c = "-"; '
               f'if (({takes}) && !(a == "{WILDCARD6_HEX}" && uid[i] != 0 && root4)) c = "+"; '
               'print c, uid[i], a } }')
    return ["sec port_owner",
            f"rows=$(cat /proc/net/tcp /proc/net/tcp6 2>/dev/null | awk {quote_word(program)} | sort -u); "
            "owners=$(printf '%s\\n' \"$rows\" | awk '$1 == \"+\" {print $2}' | sort -un | tr '\\n' ' '); "
            "printf '%s\\n' \"$owners\" \"$rows\"; rc 0"]


@node_output("port_owner")
def parse_port_holder(sec: Section | None) -> int | None:
    """The first uid other than root in the way on the serving port (`port_owner_script`'s first line), or None."""
    if sec is None:
        return None
    others = [int(word) for word in sec.body.split("\n", 1)[0].split() if word != "0"]
    return others[0] if others else None


MAX_NEIGHBOURS = 8  # listeners elsewhere on the serving port named in `ServingApi.port_neighbours`


def parse_port_neighbours(sec: Section | None) -> list[str]:
    """The listeners on the serving port at another address (`port_owner_script`'s `-` rows), as `uid U on
    ADDRESS`, sorted, at most MAX_NEIGHBOURS. A row that does not read is left out: this is a warning, never a
    failed probe."""
    if sec is None:
        return []
    found = set()
    for line in sec.body.splitlines()[1:]:
        cols = line.split()
        if len(cols) != 3 or cols[0] != "-" or not (cols[1].isascii() and cols[1].isdigit()):
            continue
        try:
            found.add(f"uid {int(cols[1])} on {proc_address(cols[2])}")
        except ValueError:
            continue
    return sorted(found)[:MAX_NEIGHBOURS]


@node_output("serving API")
def parse_serving(health: Section | None, models: Section | None, ray: Section | None,
                  completion: Section | None = None, engine: Section | None = None,
                  port_owner: Section | None = None) -> ServingApi:
    holder, neighbours = parse_port_holder(port_owner), parse_port_neighbours(port_owner)
    if holder is not None:
        return ServingApi(reachable=True, healthy=False, port_holder=holder, port_neighbours=neighbours)
    code = health.body.strip() if health else ""
    served: list[str] = []
    if models is not None and models.body.strip().startswith("{"):
        try:
            served = [m["id"] for m in node_json(models.body).get("data", [])]
        except (ValueError, KeyError, TypeError):
            served = []
    ray_nodes = None
    if ray is not None and ray.rc == 0:
        ray_nodes = count_ray_nodes(ray.body)
    healthy = code == "200"
    return ServingApi(reachable=code not in ("", "000"), healthy=healthy, models=served, ray_nodes=ray_nodes,
                      completion_error=parse_completion(completion) if healthy and served else None,
                      engine=parse_engine(engine) if healthy else None, port_neighbours=neighbours)


def ray_script(container: str) -> list[str]:
    """The `ray` section: `ray status` inside the head's serving container (`count_ray_nodes`)."""
    return ["sec ray", f"docker exec {quote_word(container)} ray status 2>&1; rc $?"]


def count_ray_nodes(status: str) -> int:
    """Nodes alive in `ray status` output: one `1 node_<id>` line per node under "Active:"."""
    return sum(1 for line in status.splitlines() if line.strip().split(" ")[-1].startswith("node_"))


# -- the facts a step re-reads right before it acts (edge/steps/actions.py `Read`) --------------------------------


@dataclass(frozen=True)
class Fact(Generic[R]):
    """One fact a step re-reads on a node right before it acts: a probe fragment and its parser, named by `key`
    (`container vllm`), the name the step cases (tests/unit/step_cases/) give its recorded answer. The fragments
    and parsers are the probe's own, so a step and the plan can never read a node differently."""

    key: str
    lines: tuple[str, ...] = field(repr=False)
    parse: Callable[[dict[str, Section]], R] = field(repr=False, compare=False)

    def read(self, session: Session, timeout: float) -> R:
        return self.parse(read_sections(session, list(self.lines), timeout))


@dataclass(frozen=True)
class ContainerState:
    """One container as `docker inspect` tells it: the probe's model of it and the exit code its state has (the
    list of containers carries no exit code; a step's failure message does)."""

    container: Container
    exit_code: int | None


_INSPECT_ONE = _INSPECT[:-1] + ',"exit_code":{{json .State.ExitCode}}}'


@node_output("container")
def parse_container(sec: Section | None) -> ContainerState | None:
    """None when there is no such container; any other failure of `docker inspect` is a ProbeError (the step
    cannot judge what it cannot see)."""
    if sec is None:
        raise ProbeError("docker inspect did not answer")
    if sec.rc != 0:
        if "no such" in sec.body.lower():
            return None
        raise ProbeError(f"docker inspect failed: {sec.body.strip()[-300:]}")
    raw = node_json(sec.body)
    exit_code = raw.pop("exit_code", None)
    raw["name"] = str(raw["name"]).lstrip("/")
    raw["labels"] = raw.get("labels") or {}
    raw["mounts"] = _bind_sources(raw.get("mounts"))
    return ContainerState(Container.model_validate(raw), exit_code if isinstance(exit_code, int) else None)


def container_fact(name: str) -> Fact[ContainerState | None]:
    """One container by name, running or not (None: no such container)."""
    return Fact(f"container {name}",
                ("sec container", f"docker inspect --type container --format {quote_word(_INSPECT_ONE)} "
                                  f"{quote_word(name)} 2>&1; rc $?"),
                lambda sections: parse_container(sections.get("container")))


# -- the copies' facts (images, staging, weights) ---------------------------------------------------------------

@node_output("image")
def parse_image_inspect(ref: str, sec: Section | None) -> Image | None:
    """`docker image inspect REF` as a step re-reads it: None only when the engine says it has no such image; any
    other failure is a ProbeError (a broken engine is no reason to copy 20 GB)."""
    if sec is None:
        raise ProbeError(f"`docker image inspect {ref}` did not answer")
    if sec.rc != 0:
        if "no such image" in sec.body.lower():
            return None
        raise ProbeError(f"`docker image inspect {ref}` failed (exit {sec.rc}): {sec.body.strip()[-300:]}")
    found = node_json(sec.body)
    if not isinstance(found, list) or not found:
        raise ProbeError(f"`docker image inspect {ref}` printed no image")
    return image_from_inspect(found[0])


def image_fact(ref: str) -> Fact[Image | None]:
    """One image by reference (None: the engine has none by that name)."""
    return Fact(f"image {ref}", ("sec image", f"docker image inspect {quote_word(ref)} 2>&1; rc $?"),
                lambda sections: parse_image_inspect(ref, sections.get("image")))


@dataclass(frozen=True)
class HubSize:
    """The Hub's size of a revision (`bytes`), or why it gave none (`problem`, and curl's `exit`)."""

    bytes: int | None
    problem: str = ""
    exit: int = 0


def hub_size(payload: str) -> int:
    """Total bytes of a revision from the Hub's model-info answer (`siblings[].size`). A sibling without a size
    (an answer without `blobs=true`) makes the size unknown: ValueError, and nothing is downloaded."""
    doc = node_json(payload)
    siblings = doc.get("siblings") if isinstance(doc, dict) else None
    if not isinstance(siblings, list) or not siblings:
        raise ValueError("the Hub's answer lists no files")
    sizes = [s.get("size") if isinstance(s, dict) else None for s in siblings]
    counted = [n for n in sizes if isinstance(n, int) and not isinstance(n, bool) and n >= 0]
    if len(counted) != len(sizes):
        raise ValueError("the Hub's answer gives no size for some files")
    return sum(counted)


def parse_hub_size(sec: Section | None) -> HubSize:
    if sec is None:
        return HubSize(None, "no answer", -1)
    if sec.rc != 0:
        return HubSize(None, sec.body.strip()[-300:], sec.rc)
    try:
        return HubSize(hub_size(sec.body))
    except ValueError as exc:  # json's errors are ValueErrors too
        return HubSize(None, str(exc))


def hub_size_fact(model_id: str, revision: str, token: str | None, timeout: float) -> Fact[HubSize]:
    """The Hub's size of `model_id` at `revision` (`GET /api/models/ID/revision/REV?blobs=true`, what
    `HfApi.model_info(files_metadata=True)` asks), asked from the node (HF_ENDPOINT as its owner set it). The
    token, when there is one, is in the script (stdin of `sh -s`) and reaches curl through a builtin's pipe
    (`-H @-`): never an argv."""
    header = f"Authorization: Bearer {token}\n" if token else "Accept: application/json\n"
    path = f"/api/models/{model_id}/revision/{urllib.parse.quote(revision, safe='')}?blobs=true"
    return Fact(f"hub-size {model_id}@{revision}",
                ("sec hub_size",
                 f"printf %s {quote_word(header)} | curl -fsS --max-time {int(timeout)} -H @- "
                 f'"${{HF_ENDPOINT:-https://huggingface.co}}"{quote_word(path)} 2>&1; rc $?'),
                lambda sections: parse_hub_size(sections.get("hub_size")))


def parse_avail(sec: Section | None) -> int | None:
    """`df --output=avail`'s number (None: df did not say)."""
    words = sec.body.split() if sec is not None and sec.rc == 0 else []
    return int(words[-1]) if words and words[-1].isdigit() else None


def avail_fact(path: str) -> Fact[int | None]:
    """Bytes available to the SSH user on the filesystem of `path` (a failed copy's explanation)."""
    return Fact(f"df {path}", ("sec avail", f"df -B1 --output=avail {quote_word(path)} 2>/dev/null; rc $?"),
                lambda sections: parse_avail(sections.get("avail")))


@node_output("ssh_connection")
def parse_session_address(sec: Section | None) -> str | None:
    """The node's own address the SSH session arrived on: `$SSH_CONNECTION`'s third field (client address, client
    port, server address, server port); None when sshd did not set it as documented."""
    words = sec.body.split() if sec is not None else []
    return words[2] if len(words) == 4 else None


SESSION_ADDRESS: Fact[str | None] = Fact(
    "session-address", ("sec ssh_connection", 'printf "%s\\n" "${SSH_CONNECTION:-}"; rc 0'),
    lambda sections: parse_session_address(sections.get("ssh_connection")))


@node_output("vllm_serve")
def parse_serve_processes(sec: Section | None) -> int:
    """How many `vllm serve` processes the container runs; 0 when that cannot be read (a container without `ps`,
    one not running): the launch then runs, and a second `vllm serve` fails on the taken port, loudly."""
    body = sec.body.strip() if sec is not None else ""
    return int(body) if body.isdigit() else 0


_SERVE_COUNT = "ps -eo args | grep -c '[v]llm serve'"


def serve_processes_fact(container: str) -> Fact[int]:
    """The `vllm serve` processes inside `container` (the Ray launcher's exec: already launched?)."""
    return Fact(f"vllm-serve {container}",
                ("sec vllm_serve", f"docker exec {quote_word(container)} sh -c {quote_word(_SERVE_COUNT)} "
                                   "2>/dev/null; rc $?"),
                lambda sections: parse_serve_processes(sections.get("vllm_serve")))


def links_fact(node: Node) -> Fact[tuple[Link, Link | None]]:
    """The node's declared fabric ports as they are now (`link_script`, `parse_links`)."""
    return Fact("links", tuple(link_script(node)), lambda sections: parse_links(node, sections))


MEMORY: Fact[Memory | None] = Fact("meminfo", tuple(memory_script()),
                                   lambda sections: parse_memory(sections.get("meminfo")))


def ray_nodes_fact(container: str) -> Fact[int | None]:
    """Nodes alive in the head container's `ray status`; None when it did not answer."""
    def parse(sections: dict[str, Section]) -> int | None:
        status = sections.get("ray")
        return count_ray_nodes(status.body) if status is not None and status.rc == 0 else None
    return Fact(f"ray {container}", tuple(ray_script(container)), parse)


def api_fact(desired: Desired) -> Fact[ServingApi]:
    """The head's API now: health, the served names and one completion, as the probe reads them."""
    def parse(sections: dict[str, Section]) -> ServingApi:
        return parse_serving(sections.get("health"), sections.get("models"), None, sections.get("completion"),
                             sections.get("engine"), sections.get("port_owner"))
    return Fact("api", tuple(api_script(desired)), parse)


def verify_fact(desired: Desired) -> Fact[VerifyAnswer]:
    """serving.verify's one request to the head's API (`verify_argv`), asked only when root alone listens on the
    serving port (`port_owner_script`, as the health check asks): the API key travels in the script (stdin of
    `sh -s`) and into curl by a builtin's pipe, never in an argv."""
    verify = desired.serving.verify
    assert verify is not None, "a verify is asked only of a deployment that declares one"
    header = auth_header(desired)
    auth = f"printf %s {quote_word(header.decode())} | " if header else ""
    lines = (*port_owner_script(desired.serving.port, desired.serving.host), "sec verify",
             f"rc=0; if [ \"$owners\" = \"0 \" ]; then {auth}{quote(verify_argv(desired))}; rc=$?; fi; echo; rc $rc")
    chat = verify.endpoint == "chat"
    return Fact(f"verify {desired.served_name}", lines,
                lambda sections: parse_verify(sections.get("verify"), sections.get("port_owner"), chat))


# -- facts of the serving and retention steps (steps/serving.py, steps/retention.py) ------------------------------


def _all_containers(sections: dict[str, Section]) -> list[Container]:
    ok, error, found = parse_containers(sections.get("containers"))
    if not ok:
        raise ProbeError(f"the containers could not be read: {error}")
    return found


#: Every container on the node now, with its bind mounts; unreadable is a ProbeError (a step cannot judge what it
#: cannot see).
CONTAINERS: Fact[list[Container]] = Fact("containers", tuple(containers_script()), _all_containers)


@node_output("realpath")
def parse_canonical(sec: Section | None, count: int) -> list[str]:
    """`realpath -m`'s answer, one line per path asked, in order; anything else is a ProbeError."""
    if sec is None or sec.rc != 0:
        raise ProbeError(f"realpath failed: {sec.body.strip()[-200:] if sec else 'no answer'}")
    lines = sec.body.splitlines()
    if len(lines) != count:
        raise ProbeError(f"`realpath` answered {len(lines)} lines for {count} paths")
    return lines


def canonical_fact(paths: list[str]) -> Fact[list[str]]:
    """The node's own answer to where each path leads (`realpath -m`: symlinks, `.` and `..` resolved; a path
    that does not exist yet resolves as far as it does)."""
    return Fact("realpath", ("sec realpath", f"realpath -m -- {quote(paths)} 2>&1; rc $?"),
                lambda sections: parse_canonical(sections.get("realpath"), len(paths)))


LOG_TAIL_CHARS = 1500  # of a failed container's last lines, in the step's failure message


def log_tail_fact(container: str, lines: int = 15) -> Fact[str]:
    """A container's last `lines` log lines (stdout and stderr), for the message of a start that failed."""
    return Fact(f"logs {container}",
                ("sec logs", f"docker logs --tail {lines} {quote_word(container)} 2>&1 | tail -c {LOG_TAIL_CHARS}; "
                             "rc 0"),
                lambda sections: (sections["logs"].body if "logs" in sections else "").strip()[-LOG_TAIL_CHARS:])


@dataclass(frozen=True)
class StartSeen:
    """One poll of a cold start on the head, in one round trip: its serving container, the API, and the tail of
    the container's log (`core.vllm_log.start_progress` reads where the start is from it; "" when unread)."""

    container: ContainerState | None
    api: ServingApi
    log: str


START_LOG_LINES = 200  # the head's last log lines each poll of the health wait reads, at most MAX_TEXT bytes of them
START_LOG_DEADLINE = 10  # seconds: a `docker logs` that hangs leaves the poll's other sections answered


def start_fact(desired: Desired, container: str) -> Fact[StartSeen]:
    """The head while it starts (`container_fact`, `api_fact` and its log's tail, cut on the node: tqdm redraws a
    bar on one ever longer line)."""
    from reconciler.core.vllm_log import MAX_TEXT

    one, api = container_fact(container), api_fact(desired)

    def parse(sections: dict[str, Section]) -> StartSeen:
        log = sections.get("start_log")
        return StartSeen(one.parse(sections), api.parse(sections), log.body if log is not None else "")
    return Fact(f"start {container}",
                (*one.lines, *api.lines, "sec start_log",
                 f"timeout {START_LOG_DEADLINE} docker logs --tail {START_LOG_LINES} {quote_word(container)} 2>&1 | "
                 f"tail -c {MAX_TEXT}; rc 0"), parse)


# -- a rank once it serves: the memory it holds, the network NCCL chose (steps/serving.py, await-health) ---------


@dataclass(frozen=True)
class RankSeen:
    """A serving node once its rank answers: MemTotal and MemAvailable (`memory`, None when unread), the rank
    container's cgroup memory.current (`current`: the Docker Engine API's `memory_stats.usage`, memory.current on
    cgroup v2 and memory.usage_in_bytes on v1; None when unread), the names of the containers running on the
    node (`running`: whose reservations the budget counts there now), the rank container's id (`container`: which
    start the reading is of; None when not seen running) and the networks its log says NCCL chose (`networks`,
    `core.nccl`: None when the log was not read, empty when it names none)."""

    memory: Memory | None
    current: int | None
    running: tuple[str, ...]
    container: str | None = None
    networks: tuple[str, ...] | None = None


def parse_stats_usage(sec: Section | None) -> int | None:
    """`memory_stats.usage` of one `GET /containers/NAME/stats?stream=false` answer; None for anything else (an
    engine that did not answer, a container not running: docker then sends `"memory_stats":{}`)."""
    if sec is None or sec.rc != 0:
        return None
    try:
        usage = node_json(sec.body).get("memory_stats", {}).get("usage")
    except (ValueError, AttributeError):
        return None
    return usage if isinstance(usage, int) and not isinstance(usage, bool) and usage >= 0 else None


MAX_NETWORKS = 8  # distinct network names a rank's reading keeps: NCCL has three kinds (IB, Socket, a plugin)


def parse_networks(sec: Section | None) -> tuple[str, ...] | None:
    """The distinct networks of the node's `uniq -c` rows (`COUNT NAME`), most named first, ties by name
    (`core.nccl`); None when the section is missing or failed. A row that is not one is skipped, never a
    ProbeError: the node's `sed` prints only what `NETWORK_LINES` captured, so only a node that does not run the
    script sends anything else."""
    if sec is None or sec.rc != 0:
        return None
    counted: list[tuple[int, str]] = []
    for line in sec.body.splitlines()[:MAX_NETWORKS]:
        count, _, name = line.strip().partition(" ")
        if count.isdigit() and is_network_name(name) and name not in (n for _, n in counted):
            counted.append((int(count), name))
    return tuple(name for _, name in sorted(counted, key=lambda c: (-c[0], c[1])))


def networks_program() -> str:
    """The `sed -n -E` program that prints the network's name of each `NETWORK_LINES` line of a log, and nothing
    else (`|` delimits: the names and the patterns hold no `|`)."""
    return "; ".join(f"s|.*{line}.*|\\1|p" for line in NETWORK_LINES)


def parse_rank(container: str, sections: dict[str, Section]) -> RankSeen:
    """The reading, each part on its own: a part that does not parse is unread (None, or no running names), never
    a ProbeError. The rank already serves; what it holds is told, never a reason to fail its start."""
    try:
        memory = parse_memory(sections.get("meminfo"))
    except ProbeError:
        memory = None
    try:
        ok, _, found = parse_containers(sections.get("containers"))
    except ProbeError:
        ok, found = False, []
    running = tuple(c.name for c in found if c.running) if ok else ()
    mine = next((c.id for c in found if c.name == container and c.running), None) if ok else None
    return RankSeen(memory, parse_stats_usage(sections.get("stats")), running, mine,
                    parse_networks(sections.get("nccl")))


#: seconds `docker logs` of a rank may take on its node: a start's whole log, read once after it served
RANK_LOG_DEADLINE = 20


def rank_fact(container: str) -> Fact[RankSeen]:
    """The node of a rank that serves: /proc/meminfo, its running containers (`containers_script`), the
    container's memory from the Docker Engine API over the socket (the reading docker's own `docker stats` makes,
    the same on the cgroup v2 of DGX OS and the cgroup v1 of the testbed's engines; `one-shot`: one sample, no
    second for the CPU's rate) and the networks NCCL chose, counted on the node from the container's whole log
    (its start's: each start is a new container), so only a few short rows cross (`parse_networks`). `sed`, not
    `grep -a`: a log line is text vLLM's processes wrote, and only the captured name may leave the node."""
    url = f"http://docker/containers/{container}/stats?stream=false&one-shot=true"
    return Fact(f"rank {container}",
                (*memory_script(), *containers_script(), "sec stats",
                 f"curl -sf --max-time 10 --unix-socket \"$sock\" {quote_word(url)} 2>&1; rc $?",
                 "sec nccl",
                 f"timeout {RANK_LOG_DEADLINE} docker logs {quote_word(container)} 2>&1 | "
                 f"sed -n -E {quote_word(networks_program())} | sort | uniq -c | sort -rn | head -n {MAX_NETWORKS}; "
                 "rc 0"),
                functools.partial(parse_rank, container))
