"""What discover reads on a node: one read-only script, and the parsers that turn what it prints into NodeFacts.

Why a script of its own: discover reads a node nobody has described yet, so it cannot use the probe's fragments
that take a declared `Node` (which port, which RDMA device). It asks wider questions instead: every interface,
every RDMA device, the routes, the model directories, the images. Wherever it reads a fact the reconciler reads
too (the interfaces and their RDMA ports, the containers, MemTotal/MemAvailable), it runs the same fragment and
the same parser from `reconciler.edge.facts`, so discover's starter file and the first `observe` agree on what
the node said. What only discover asks stays here.

Nothing here sends traffic anywhere but the SSH session: "does the node reach the internet" is answered from the
routing table only (`ip route get 1.1.1.1`, a netlink lookup: no packet leaves), never a ping or an HTTP request.
Every parser is pure and goes through `node_output`: a section that does not parse is one line in
`NodeFacts.errors` (written into the file as a comment), never a crash of discover.
"""

from __future__ import annotations

import ipaddress
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

from reconciler.core.observed import Container
from reconciler.edge.facts.base import ProbeError, Section, node_output
from reconciler.edge.facts.containers import containers_script, parse_containers
from reconciler.edge.facts.gpu import gpu_script, parse_gpu_stack
from reconciler.edge.facts.links import interfaces_script, parse_interfaces, parse_rdma_devices
from reconciler.edge.facts.memory import memory_script, parse_memory

T = TypeVar("T")

#: The command line of each running container, which the probe's `containers` section does not carry (the
#: observed model has no argv, the engine's list only a joined string): discover alone needs it, to spot another
#: launcher's serving container by its `--port` (`guess.holds_serving_port`). Docker's errors are the
#: `containers` section's to report.
_COMMANDS_FORMAT = '{"name":{{json .Name}},"entrypoint":{{json .Config.Entrypoint}},"args":{{json .Args}}}'

_DISCOVER_ONLY = r"""sec hostname
hostname; rc $?
sec ssh
printf '%s\n' "${SSH_CONNECTION:-}"; rc 0
sec ibdev2netdev
if command -v ibdev2netdev >/dev/null 2>&1; then ibdev2netdev 2>&1; rc $?; else rc 127; fi
sec route
ip route get 1.1.1.1 2>&1; rc $?
sec commands
ids=$(docker ps -q --no-trunc 2>/dev/null); rc=$?
if [ $rc -eq 0 ] && [ -n "$ids" ]; then docker inspect --format '""" + _COMMANDS_FORMAT + r"""' $ids 2>/dev/null; fi
rc $rc
sec images
docker images --format '{{json .}}' 2>&1; rc $?
sec runtimes
docker info --format '{{json .Runtimes}}' 2>&1; rc $?
sec ulimit
ulimit -Hn; ulimit -Hl; rc 0
sec hf_home
printf '%s\n' "${HF_HOME:-}"; rc 0
sec models
for h in /srv/*/models /srv/*/*/models; do [ -d "$h" ] && printf 'home\t%s\n' "$h"; done
for r in "${HF_HOME:+$HF_HOME/hub}" "$HOME/.cache/huggingface/hub" \
         /srv/*/models /srv/*/models/hub /srv/*/*/models /srv/*/*/models/hub; do
  [ -n "$r" ] && [ -d "$r" ] || continue
  printf 'root\t%s\n' "$r"
  for m in "$r"/models--*; do
    [ -d "$m" ] || continue
    ref=$(cat "$m/refs/main" 2>/dev/null)
    printf 'hf\t%s\t%s\t%s\t%s\n' "$r" "${m##*/}" "$(du -sk "$m" 2>/dev/null | cut -f1)" "$ref"
  done
  for c in "$r"/*/config.json "$r"/plain/*/config.json; do
    [ -f "$c" ] || continue
    p=${c%/config.json}
    printf 'plain\t%s\t%s\n' "$p" "$(du -skL "$p" 2>/dev/null | cut -f1)"
  done
done; rc 0
"""

#: The script, run by `facts.base.read_sections` (its `sealed` puts `export LC_ALL=C` and `sec` first). Read-only, no
#: interpolated value (nothing to quote). Sections as everywhere: `sec NAME` ... `rc N`.
SCRIPT_LINES: list[str] = [*interfaces_script(), *containers_script(), *memory_script(), *gpu_script(),
                           *_DISCOVER_ONLY.splitlines()]

#: Never a fabric: loopback, docker's and libvirt's bridges and veths, Wi-Fi, VPN and CNI interfaces.
EXCLUDED_IFACE = re.compile(r"^(lo|docker\d*|veth.*|br-.*|virbr.*|wl.*|tailscale.*|cni.*|flannel.*)$")


# --------------------------------------------------------------------------------------------------- the facts

@dataclass(frozen=True)
class RdmaLink:
    """An RDMA device and the netdev it drives, as ibdev2netdev or sysfs tell."""

    device: str
    netdev: str | None
    active: bool
    state: str = ""
    phys_state: str = ""


@dataclass(frozen=True)
class Iface:
    """An interface that could carry the fabric."""

    name: str
    up: bool          # admin up and carrier (LOWER_UP)
    mtu: int
    ipv4: tuple[ipaddress.IPv4Interface, ...]


@dataclass(frozen=True)
class RunningContainer:
    name: str
    image: str
    args: tuple[str, ...] = ()
    managed: bool = False


@dataclass(frozen=True)
class ModelDir:
    layout: str       # hf-cache | plain
    root: str         # hf-cache: the hub dir; plain: the model dir itself
    model_id: str     # ORG/NAME (plain: ORG--NAME dir names are read back as ORG/NAME when they look like it)
    size_kib: int
    revision: str = ""


@dataclass
class NodeFacts:
    """What the script read on one node; a section that failed leaves its default (and maybe a line in errors)."""

    host: str
    hostname: str = ""
    ssh_local: str | None = None      # the node's address the SSH session arrived on
    rdma: list[RdmaLink] = field(default_factory=list)
    rdma_source: str = "none"         # ibdev2netdev | sysfs | none
    ifaces: list[Iface] = field(default_factory=list)
    internet: bool = False
    containers: list[RunningContainer] = field(default_factory=list)
    images: list[tuple[str, int]] = field(default_factory=list)   # (ref, size bytes)
    nvidia_runtime: bool = False
    gpu_hook: bool = False            # nvidia-container-runtime-hook on the PATH: docker `--gpus` works through it
    mem_total: int = 0
    mem_available: int = 0
    nofile_hard: int | None = None
    memlock_unlimited: bool = False
    hf_home: str = ""
    model_roots: list[str] = field(default_factory=list)
    models: list[ModelDir] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


# --------------------------------------------------------------------------------------------------- parsers

@node_output("ibdev2netdev")
def parse_ibdev2netdev(text: str) -> list[RdmaLink]:
    """`rocep1s0f1 port 1 ==> enp1s0f1np1 (Up)` per line (Mellanox OFED's ibdev2netdev)."""
    out = []
    for line in text.splitlines():
        m = re.match(r"^\s*(\S+)\s+port\s+(\d+)\s+==>\s+(\S+)\s+\((\w+)\)", line)
        if m:
            out.append(RdmaLink(device=m.group(1), netdev=m.group(3), active=m.group(4) == "Up",
                                state=m.group(4)))
    return out


def parse_rdma_sysfs(text: str) -> list[RdmaLink]:
    """The `rdma_sysfs` section (`facts.links.parse_rdma_devices`): one RdmaLink per device and netdev it drives."""
    return [RdmaLink(device=dev.name, netdev=netdev, active=dev.port.active, state=dev.port.state,
                     phys_state=dev.port.phys_state)
            for dev in parse_rdma_devices(Section(text, 0)) for netdev in dev.netdevs or (None,)]


def parse_ip_addr(text: str) -> list[Iface]:
    """`ip -j addr` (`facts.links.parse_interfaces`) -> the candidate interfaces, EXCLUDED_IFACE left out."""
    return [Iface(name=link.name, up=link.up, mtu=link.mtu,
                  ipv4=tuple(ipaddress.IPv4Interface(a) for a in link.addresses))
            for link in parse_interfaces(Section(text, 0)) if not EXCLUDED_IFACE.match(link.name)]


def parse_meminfo(text: str) -> tuple[int, int]:
    """(MemTotal, MemAvailable) in bytes, as the probe reads them (`facts.memory.parse_memory`); (0, 0) when empty."""
    memory = parse_memory(Section(text, 0)) if text.strip() else None
    return (memory.total_bytes, memory.available_bytes) if memory else (0, 0)


@node_output("commands")
def parse_commands(text: str) -> dict[str, tuple[str, ...]]:
    """The `commands` section: each running container's entrypoint and arguments, by name."""
    argv_by_name = {}
    for line in text.splitlines():
        if line.startswith("{"):
            raw = json.loads(line)
            argv = [*(raw.get("entrypoint") or []), *(raw.get("args") or [])]
            argv_by_name[raw["name"].lstrip("/")] = tuple(str(a) for a in argv)
    return argv_by_name


def running_containers(listed: list[Container], argv_by_name: dict[str, tuple[str, ...]]) -> list[RunningContainer]:
    """The probe's containers (`facts.containers.parse_containers`) that run now (as `docker ps` lists them), with their
    command lines."""
    return [RunningContainer(c.name, c.image, argv_by_name.get(c.name, ()), c.managed) for c in listed if c.running]


_SIZE_UNITS = {"B": 1, "kB": 1000, "KB": 1000, "MB": 10**6, "GB": 10**9, "TB": 10**12}


@node_output("images")
def parse_images(text: str) -> list[tuple[str, int]]:
    """`docker images --format '{{json .}}'` -> [(repo:tag, bytes)], dangling `<none>` images left out."""
    out = []
    for line in text.splitlines():
        if not line.startswith("{"):
            continue
        raw = json.loads(line)
        repo, tag = raw.get("Repository", ""), raw.get("Tag", "")
        if "<none>" in (repo, tag):
            continue
        m = re.fullmatch(r"([\d.]+)\s*([kKMGT]?B)", raw.get("Size", "0B").strip())
        size = int(float(m.group(1)) * _SIZE_UNITS[m.group(2)]) if m else 0
        out.append((f"{repo}:{tag}", size))
    return out


@node_output("models")
def parse_models(text: str) -> tuple[list[str], list[ModelDir]]:
    """Model directories. `roots` are Hugging Face hub directories: those that exist, then `HOME/hub` for each
    model home (/srv/*/models: a hub may be created there, like $HF_HOME/hub)."""
    roots, homes, models = [], [], []
    for line in text.splitlines():
        cols = line.split("\t")
        if cols[0] == "home" and len(cols) == 2:
            homes.append(cols[1].rstrip("/") + "/hub")
        elif cols[0] == "root" and len(cols) == 2:
            roots.append(cols[1])
        elif (model := _model_line(cols)) is not None:
            models.append(model)
    return list(dict.fromkeys(roots + homes)), models


def _model_line(cols: list[str]) -> ModelDir | None:
    """One `hf` (a cache's `models--ORG--NAME`) or `plain` line of the models section, or None for any other."""
    if cols[0] == "hf" and len(cols) >= 4 and cols[2].startswith("models--"):
        org_name = cols[2].removeprefix("models--").split("--", 1)
        if len(org_name) != 2:
            return None
        rev = cols[4].strip() if len(cols) > 4 else ""
        return ModelDir("hf-cache", cols[1], "/".join(org_name), int(cols[3] or 0), rev)
    if cols[0] == "plain" and len(cols) >= 3:
        name = cols[1].rstrip("/").rsplit("/", 1)[-1]
        model_id = "/".join(name.split("--", 1)) if "--" in name else f"local/{name}"
        return ModelDir("plain", cols[1], model_id, int(cols[2] or 0))
    return None


def _parse_ulimits(facts: NodeFacts, text: str) -> None:
    """`ulimit -Hn; ulimit -Hl`: the hard limits a container may be given."""
    limits = text.split()
    if limits:
        facts.nofile_hard = int(limits[0]) if limits[0].isdigit() else None
        facts.memlock_unlimited = len(limits) > 1 and limits[1] == "unlimited"


def _listed_containers(section: Section) -> tuple[list[Container], str | None]:
    """The probe's containers, and why docker did not list them (`facts.containers.parse_containers`)."""
    try:
        _, docker_error, listed = parse_containers(section)
    except ProbeError as exc:
        return [], str(exc)
    return listed, docker_error


# --------------------------------------------------------------------------------------------------- the whole

def facts_from_sections(host: str, sections: dict[str, Section]) -> NodeFacts:
    """The script's sections -> NodeFacts. Pure; a missing or failed section leaves its default, one that does
    not parse leaves its default and a line in `errors`."""
    facts = NodeFacts(host=host)

    def body(name: str) -> str:
        section = sections.get(name)
        return section.body if section is not None and section.rc == 0 else ""

    def read(parse: Callable[[], T], default: T) -> T:
        try:
            return parse()
        except ProbeError as exc:
            facts.errors.append(str(exc))
            return default

    facts.hostname = body("hostname").strip()
    connection = body("ssh").split()
    facts.ssh_local = connection[2] if len(connection) >= 4 else None
    if "ibdev2netdev" in sections and sections["ibdev2netdev"].rc == 0:
        facts.rdma = read(lambda: parse_ibdev2netdev(body("ibdev2netdev")), [])
        facts.rdma_source = "ibdev2netdev"
    if not facts.rdma:
        facts.rdma = read(lambda: parse_rdma_sysfs(body("rdma_sysfs")), [])
        facts.rdma_source = "sysfs" if facts.rdma else "none"
    facts.ifaces = read(lambda: parse_ip_addr(body("addr")), [])
    facts.internet = "route" in sections and sections["route"].rc == 0
    if "containers" in sections:
        listed, docker_error = _listed_containers(sections["containers"])
        if docker_error:
            facts.errors.append("docker: " + docker_error[:200])
        facts.containers = running_containers(listed, read(lambda: parse_commands(body("commands")), {}))
    facts.images = read(lambda: parse_images(body("images")), [])
    facts.nvidia_runtime = '"nvidia"' in body("runtimes")
    stack = read(lambda: parse_gpu_stack(sections.get("gpu"), sections.get("gpu_hook"), sections.get("os")), None)
    facts.gpu_hook = stack is not None and stack.hook
    facts.mem_total, facts.mem_available = read(lambda: parse_meminfo(body("meminfo")), (0, 0))
    _parse_ulimits(facts, body("ulimit"))
    facts.hf_home = body("hf_home").strip()
    facts.model_roots, facts.models = read(lambda: parse_models(body("models")),
                                                 (list[str](), list[ModelDir]()))
    return facts
