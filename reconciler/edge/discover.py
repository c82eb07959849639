"""`reconciler discover`: read what is on the nodes and write a commented starter desired state.

One batched, read-only POSIX sh script per node (over the same strict-host-key SSH sessions as everything else),
pure parsers for each section (unit-tested on recorded real outputs in tests/unit/fixtures/), and a renderer that
writes YAML with a `# GUESS:` comment on every value the tool inferred rather than read. The result must pass
`spec.loads`; the operator reviews the guesses before the first `apply`.

Nothing here sends traffic anywhere but the SSH sessions: "does the node reach the internet" is answered from the
routing table only (`ip route get 1.1.1.1`, a netlink lookup: no packet leaves), never a ping or an HTTP request.
"""

from __future__ import annotations

import ipaddress
import json
import re
from dataclasses import dataclass, field
from typing import Literal

from reconciler.core.text import printable
from reconciler.edge.probes import split_sections

# --------------------------------------------------------------------------------------------------- the probe

#: `docker inspect`'s Go template: one JSON object per running container (read by parse_containers).
_INSPECT_FORMAT = ('{"name":{{json .Name}},"image":{{json .Config.Image}},"args":{{json .Args}},'
                   '"entrypoint":{{json .Config.Entrypoint}},"labels":{{json .Config.Labels}}}')

#: Read-only, no interpolated values (nothing to quote). Sections as in observe.py: `@@name` ... `@@rc N`.
SCRIPT = r"""export LC_ALL=C
sec() { printf '\n@@%s\n' "$1"; }
sec hostname
hostname; echo "@@rc $?"
sec ssh
printf '%s\n' "${SSH_CONNECTION:-}"; echo "@@rc 0"
sec ibdev2netdev
if command -v ibdev2netdev >/dev/null 2>&1; then ibdev2netdev 2>&1; echo "@@rc $?"; else echo "@@rc 127"; fi
sec rdma_sysfs
for d in /sys/class/infiniband/*; do
  [ -d "$d" ] || continue
  printf 'dev %s\n' "${d##*/}"
  printf 'state %s\n' "$(cat "$d/ports/1/state" 2>/dev/null)"
  printf 'phys_state %s\n' "$(cat "$d/ports/1/phys_state" 2>/dev/null)"
  for n in "$d"/device/net/*; do [ -e "$n" ] && printf 'net %s\n' "${n##*/}"; done
done; echo "@@rc 0"
sec addr
ip -j addr 2>&1; echo "@@rc $?"
sec route
ip route get 1.1.1.1 2>&1; echo "@@rc $?"
sec containers
ids=$(docker ps -q --no-trunc 2>&1); rc=$?
if [ $rc -eq 0 ] && [ -n "$ids" ]; then
  docker inspect --format '""" + _INSPECT_FORMAT + r"""' $ids 2>&1
elif [ $rc -ne 0 ]; then printf '%s\n' "$ids"; fi
echo "@@rc $rc"
sec images
docker images --format '{{json .}}' 2>&1; echo "@@rc $?"
sec runtimes
docker info --format '{{json .Runtimes}}' 2>&1; echo "@@rc $?"
sec meminfo
grep -E '^(MemTotal|MemAvailable):' /proc/meminfo; echo "@@rc $?"
sec ulimit
ulimit -Hn; ulimit -Hl; echo "@@rc 0"
sec listen
ss -ltnH 2>/dev/null; echo "@@rc $?"
sec hf_home
printf '%s\n' "${HF_HOME:-}"; echo "@@rc 0"
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
done; echo "@@rc 0"
"""

EXCLUDED_IFACE = re.compile(r"^(lo|docker\d*|veth.*|br-.*|virbr.*|wl.*|tailscale.*|cni.*|flannel.*)$")
ROCE_NAME = re.compile(r"np\d+$")  # mlx5 netdevs carry the physical port name: enp1s0f1np1, enP2p1s0f1np1
SERVING_LAUNCHER_NAMES = (re.compile(r"^vllm_node$"), re.compile(r"^node-\d+$"))  # eugr launch-cluster, run_cluster.sh
MANAGED_LABEL = "spark-reconciler.managed"


# --------------------------------------------------------------------------------------------------- parsing

@dataclass(frozen=True)
class RdmaLink:
    device: str
    netdev: str | None
    active: bool
    state: str = ""
    phys_state: str = ""


@dataclass(frozen=True)
class Iface:
    name: str
    up: bool          # admin up and carrier (LOWER_UP)
    mtu: int
    ipv4: tuple[ipaddress.IPv4Interface, ...]
    operstate: str = ""


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
    mem_total: int = 0
    mem_available: int = 0
    nofile_hard: int | None = None
    memlock_unlimited: bool = False
    listening: set[int] = field(default_factory=set)
    hf_home: str = ""
    model_roots: list[str] = field(default_factory=list)
    models: list[ModelDir] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


def parse_port_state(text: str) -> tuple[int | None, str]:
    """`4: ACTIVE` -> (4, "ACTIVE"); `5: LinkUp` -> (5, "LinkUp"); anything else -> (None, text)."""
    m = re.fullmatch(r"\s*(\d+)\s*:\s*(\S+)\s*", text or "")
    return (int(m.group(1)), m.group(2)) if m else (None, (text or "").strip())


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
    """The `dev/state/phys_state/net` lines the script prints from /sys/class/infiniband."""
    out: list[RdmaLink] = []
    cur: dict | None = None

    def flush():
        if cur is not None:
            code, _ = parse_port_state(cur["state"])
            nets = cur["net"] or [None]
            for net in nets:
                out.append(RdmaLink(device=cur["dev"], netdev=net, active=code == 4, state=cur["state"],
                                    phys_state=cur["phys_state"]))

    for line in text.splitlines():
        key, _, value = line.partition(" ")
        if key == "dev":
            flush()
            cur = {"dev": value.strip(), "state": "", "phys_state": "", "net": []}
        elif cur is not None and key in ("state", "phys_state"):
            cur[key] = value.strip()
        elif cur is not None and key == "net":
            cur["net"].append(value.strip())
    flush()
    return out


def parse_ip_addr(text: str) -> list[Iface]:
    """`ip -j addr` -> candidate interfaces (loopback, docker, veth, bridges and Wi-Fi excluded)."""
    out = []
    for link in json.loads(text or "[]"):
        name = link.get("ifname", "")
        if EXCLUDED_IFACE.match(name) or "LOOPBACK" in link.get("flags", []):
            continue
        flags = link.get("flags", [])
        v4 = tuple(ipaddress.IPv4Interface(f"{a['local']}/{a['prefixlen']}") for a in link.get("addr_info", [])
                   if a.get("family") == "inet")
        out.append(Iface(name=name, up="UP" in flags and "LOWER_UP" in flags and "NO-CARRIER" not in flags,
                         mtu=int(link.get("mtu", 0)), ipv4=v4, operstate=str(link.get("operstate", "")).lower()))
    return out


def parse_meminfo(text: str) -> tuple[int, int]:
    vals = {}
    for line in text.splitlines():
        m = re.match(r"^(MemTotal|MemAvailable):\s+(\d+)\s*kB", line)
        if m:
            vals[m.group(1)] = int(m.group(2)) * 1024
    return vals.get("MemTotal", 0), vals.get("MemAvailable", 0)


def parse_containers(text: str) -> list[RunningContainer]:
    out = []
    for line in text.splitlines():
        if not line.startswith("{"):
            continue
        raw = json.loads(line)
        args = [*(raw.get("entrypoint") or []), *(raw.get("args") or [])]
        out.append(RunningContainer(name=raw["name"].lstrip("/"), image=raw.get("image", ""),
                                    args=tuple(str(a) for a in args),
                                    managed=(raw.get("labels") or {}).get(MANAGED_LABEL) == "true"))
    return out


_SIZE_UNITS = {"B": 1, "kB": 1000, "KB": 1000, "MB": 10**6, "GB": 10**9, "TB": 10**12}


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


def parse_listen(text: str) -> set[int]:
    ports = set()
    for line in text.splitlines():
        cols = line.split()
        if len(cols) >= 4 and cols[0] == "LISTEN":
            port = cols[3].rpartition(":")[2]
            if port.isdigit():
                ports.add(int(port))
    return ports


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
        elif cols[0] == "hf" and len(cols) >= 4 and cols[2].startswith("models--"):
            org_name = cols[2].removeprefix("models--").split("--", 1)
            if len(org_name) != 2:
                continue
            rev = cols[4].strip() if len(cols) > 4 else ""
            models.append(ModelDir("hf-cache", cols[1], "/".join(org_name), int(cols[3] or 0), rev))
        elif cols[0] == "plain" and len(cols) >= 3:
            name = cols[1].rstrip("/").rsplit("/", 1)[-1]
            mid = "/".join(name.split("--", 1)) if "--" in name else f"local/{name}"
            models.append(ModelDir("plain", cols[1], mid, int(cols[2] or 0)))
    return list(dict.fromkeys(roots + homes)), models


def parse_facts(host: str, output: str) -> NodeFacts:
    """The whole script output -> NodeFacts. Pure; a missing or failed section leaves its default."""
    sec = split_sections(output)
    f = NodeFacts(host=host)

    def body(name: str, ok_only: bool = True) -> str:
        s = sec.get(name)
        if s is None or (ok_only and s.rc != 0):
            return ""
        return s.body

    f.hostname = body("hostname").strip()
    conn = body("ssh").split()
    f.ssh_local = conn[2] if len(conn) >= 4 else None
    if sec.get("ibdev2netdev") and sec["ibdev2netdev"].rc == 0:
        f.rdma, f.rdma_source = parse_ibdev2netdev(sec["ibdev2netdev"].body), "ibdev2netdev"
    if not f.rdma:
        f.rdma = parse_rdma_sysfs(body("rdma_sysfs"))
        f.rdma_source = "sysfs" if f.rdma else "none"
    try:
        f.ifaces = parse_ip_addr(body("addr"))
    except ValueError as exc:
        f.errors.append(f"ip -j addr: {exc}")
    f.internet = bool(sec.get("route")) and sec["route"].rc == 0
    if sec.get("containers") and sec["containers"].rc != 0:
        f.errors.append("docker: " + sec["containers"].body.strip()[:200])
    f.containers = parse_containers(body("containers"))
    f.images = parse_images(body("images"))
    f.nvidia_runtime = '"nvidia"' in body("runtimes")
    f.mem_total, f.mem_available = parse_meminfo(body("meminfo"))
    lim = body("ulimit").split()
    if lim:
        f.nofile_hard = None if lim[0] == "unlimited" else int(lim[0]) if lim[0].isdigit() else None
        f.memlock_unlimited = len(lim) > 1 and lim[1] == "unlimited"
    f.listening = parse_listen(body("listen"))
    f.hf_home = body("hf_home").strip()
    f.model_roots, f.models = parse_models(body("models"))
    return f


# --------------------------------------------------------------------------------------------------- guessing

@dataclass
class FabricGuess:
    interface: str
    rdma_device: str | None
    address: ipaddress.IPv4Interface | None
    observed_mtu: int | None
    notes: list[str] = field(default_factory=list)
    twins: list[str] = field(default_factory=list)   # other Up RoCE netdevs with IPv4 (for NCCL_IB_HCA)


def _mgmt_networks(facts: NodeFacts, ssh_hosts: list[str]) -> set[str]:
    """Interfaces that carry management traffic: the SSH session's address, or a subnet holding an SSH target."""
    targets = []
    for h in ssh_hosts + ([facts.ssh_local] if facts.ssh_local else []):
        try:
            targets.append(ipaddress.ip_address(h))
        except ValueError:
            pass
    return {i.name for i in facts.ifaces for a in i.ipv4 if any(t in a.network for t in targets)}


def guess_fabric(facts: NodeFacts, ssh_hosts: list[str], prefer_name: str | None = None) -> FabricGuess:
    """The fabric netdev: an Up RoCE netdev with IPv4, preferring one whose RDMA port is ACTIVE (the
    autodiscover.sh rule, eugr/spark-vllm-docker); without RDMA information, a ConnectX-named (`...npN`) netdev
    that is not management; `prefer_name` (the head's choice) breaks ties and fills in when nothing fits."""
    mgmt = _mgmt_networks(facts, ssh_hosts)
    by_name = {i.name: i for i in facts.ifaces}
    rdma_of = {r.netdev: r for r in facts.rdma if r.netdev}
    notes: list[str] = []
    if rdma_of:
        cands = [by_name[n] for n in rdma_of if n in by_name and n not in mgmt]
        why = f"RoCE netdev ({facts.rdma_source})"
    else:
        cands = [i for i in facts.ifaces if i.name not in mgmt and ROCE_NAME.search(i.name)]
        why = "ConnectX-style name (npN); no RDMA information on this node"
        if not cands:
            cands = [i for i in facts.ifaces if i.name not in mgmt]
            why = "the only non-management interface"

    def score(i: Iface):
        r = rdma_of.get(i.name)
        return (bool(i.ipv4), bool(r and r.active), i.up, i.name == prefer_name,
                not any(c.isupper() for c in i.name))   # enp1s0f1np1 before its twin enP2p1s0f1np1

    cands.sort(key=score, reverse=True)
    if not cands:
        name = prefer_name or "enp1s0f1np1"
        return FabricGuess(name, None, None, None, [f"no candidate interface found; {name} assumed (the Spark's "
                                                    f"outer QSFP port)"])
    best = cands[0]
    r = rdma_of.get(best.name)
    notes.append(f"{best.name}: {why}; {'up' if best.up else 'DOWN'}, mtu {best.mtu}, "
                 f"IPv4 {', '.join(map(str, best.ipv4)) or 'none'}"
                 + (f", RDMA {r.device} {'ACTIVE' if r.active else 'not active'}" if r else ""))
    twins = [i for i in cands[1:] if i.ipv4 and i.name in rdma_of and rdma_of[i.name].active]
    if best.ipv4:
        for t in twins:
            if any(a.network == b.network for a in t.ipv4 for b in best.ipv4):
                notes.append(f"WARNING: twin {t.name} is in the SAME subnet as {best.name}: routing ambiguity and "
                             f"NCCL failures (NVIDIA connect-two-sparks); give the twins different subnets")
            else:
                notes.append(f"twin {t.name} ({', '.join(map(str, t.ipv4))}) is in a different subnet (good)")
    return FabricGuess(best.name, r.device if r else None, best.ipv4[0] if best.ipv4 else None, best.mtu, notes,
                       [rdma_of[t.name].device for t in twins])


def node_name(hostname: str, fallback: str, taken: set[str]) -> str:
    name = re.sub(r"[^a-z0-9-]+", "-", hostname.split(".")[0].lower()).strip("-")[:63].strip("-") or fallback
    base, k = name, 2
    while name in taken:
        name, k = f"{base}-{k}", k + 1
    return name


def _owns(path: str, hostname: str, name: str) -> bool:
    """A directory named after the host (per-host directories on shared storage) belongs to that host."""
    tokens = {t for t in re.split(r"[-_.]", hostname.lower()) + [hostname.lower(), name] if len(t) >= 3}
    return any(part.lower() in tokens for part in path.split("/"))


def pick_model(all_facts: list[NodeFacts]) -> tuple[ModelDir | None, int]:
    """The largest Hugging Face cache directory, on the head first (index 0), else on any node."""
    for i, f in enumerate(all_facts):
        hf = [m for m in f.models if m.layout == "hf-cache"]
        if hf:
            return max(hf, key=lambda m: m.size_kib), i
    return None, 0


def model_root_for(facts: NodeFacts, name: str, model: ModelDir, fallback: str) -> tuple[str, str]:
    """(hub dir, why) for this node: its own directory (HF_HOME, named after the host, holding the model)
    before a shared one; the source's path when the node has none (same user, same path on every Spark)."""
    hf_home_hub = f"{facts.hf_home.rstrip('/')}/hub" if facts.hf_home else None
    holding = {m.root for m in facts.models if m.layout == "hf-cache" and m.model_id == model.model_id}

    def score(root: str):
        return (root == hf_home_hub, _owns(root, facts.hostname, name), root in holding)

    roots = sorted(facts.model_roots, key=score, reverse=True)
    roots = [r for r in roots if r.endswith("/hub") and (any(score(r)) or r.endswith("/.cache/huggingface/hub"))]
    if roots:
        r = roots[0]
        why = ("$HF_HOME/hub" if r == hf_home_hub else "named after this host" if _owns(r, facts.hostname, name)
               else "holds the model" if r in holding else "the Hugging Face cache here")
        return r, why
    return fallback, "no model directory on this node; the source's path (same user, same path)"


def guess_gmu(facts: list[NodeFacts], margin: int) -> tuple[float, str]:
    fits = [max(0.0, (f.mem_available - margin) / f.mem_total) for f in facts if f.mem_total]
    if not fits:
        return 0.8, "no /proc/meminfo; 0.8 is NVIDIA's TP2 playbook value"
    fit = min(fits)
    gmu = min(0.8, int((fit - 0.05) * 20) / 20)
    if gmu >= 0.8:
        return 0.8, "NVIDIA's TP2 playbook value; MemAvailable on every node leaves room for it"
    gmu = max(gmu, 0.05)
    return gmu, (f"MemAvailable now allows ~{fit:.2f} of MemTotal (minus policy.memory_margin) on the tightest "
                 f"node; 0.8 is usual once co-tenants are stopped")


def pick_image(head: NodeFacts) -> tuple[str, str]:
    cotenant_images = {c.image for c in head.containers if not c.managed}
    vllm = [(ref, size) for ref, size in head.images if "vllm" in ref.lower()]
    vllm.sort(key=lambda rs: (rs[0] not in cotenant_images or "vllm" in rs[0].split("/")[-1], rs[1]), reverse=True)
    if vllm:
        return vllm[0][0], f"the largest image named *vllm* on the head (of {', '.join(r for r, _ in vllm)})"
    return "nvcr.io/nvidia/vllm:26.05-py3", "no vLLM image on the head; NVIDIA's playbook image (pull it first)"


def holds_serving_port(c: RunningContainer, port: int) -> bool:
    """A container of another launcher (eugr's `vllm_node`, run_cluster.sh's `node-N`) or one started with the
    serving port: it must stop for ours to bind (policy `unlisted: stop`)."""
    if any(p.match(c.name) for p in SERVING_LAUNCHER_NAMES):
        return True
    args = list(c.args)
    for i, a in enumerate(args):
        if a in ("--port", "-p") and i + 1 < len(args) and args[i + 1] == str(port):
            return True
        if a == f"--port={port}" or a.endswith(f":{port}"):
            return True
    return False


# --------------------------------------------------------------------------------------------------- rendering

def _y(value: object) -> str:
    """A YAML scalar: JSON strings are valid YAML double-quoted strings (no injection from remote text: a `#` or a
    line break stays inside the quotes), of printable text (reconciler/core/text.py: no value read back from the file
    holds a control character; the spec's patterns then reject what a node should never have sent)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return f"{value:g}" if isinstance(value, float) else str(value)
    if value is None:
        return "null"
    return json.dumps(printable(str(value)))


def _c(text: object) -> str:
    """Remote text made safe for a comment: one line, printable (reconciler/core/text.py), at most 300 characters."""
    return printable(str(text))[:300]


@dataclass(frozen=True)
class _SshChoice:
    """How the operator asked to reach the nodes (discover's own options), repeated in every node's `ssh`."""

    user: str
    known_hosts: str
    identity: str | None
    jump: bool


@dataclass(frozen=True)
class _NodeDraft:
    """One node as it will be written: what was read from it, its name, and the fabric guessed for it."""

    facts: NodeFacts
    name: str
    fabric: FabricGuess
    address: ipaddress.IPv4Interface
    address_note: str | None


_HEADER = ["# Starter desired state written by `reconciler discover` (read-only probe of each node over SSH).",
           "# Review every `# GUESS:` line, then: reconciler validate FILE && reconciler plan FILE.",
           "# Values without a GUESS comment were read from the nodes as they are now."]

_POLICY = ["policy:",
           "  mode: enforce   # `observe` to only report drift for a first look",
           "  resync_interval: 30s",
           '  listen: "127.0.0.1:9464"']

#: NVIDIA's netplan example subnet (connect-two-sparks), for a cluster where no node has a fabric address yet.
_EXAMPLE_FABRIC = ipaddress.IPv4Interface("192.168.100.10/24")


def _node_names(facts: list[NodeFacts]) -> list[str]:
    """Names from the hostnames, made unique; `head`/`workerN` where a hostname is unreadable."""
    taken: set[str] = set()
    names = []
    for i, f in enumerate(facts):
        n = node_name(f.hostname, "head" if i == 0 else f"worker{i}", taken)
        taken.add(n)
        names.append(n)
    return names


def _guess_fabrics(facts: list[NodeFacts]) -> list[FabricGuess]:
    """Each node's fabric netdev; the head's choice breaks the workers' ties (same port on identical machines)."""
    ssh_hosts = [f.host for f in facts]
    fabrics: list[FabricGuess] = []
    for f in facts:
        fabrics.append(guess_fabric(f, ssh_hosts, prefer_name=fabrics[0].interface if fabrics else None))
    return fabrics


def _next_free_address(ref: ipaddress.IPv4Interface, after: int, used: set[ipaddress.IPv4Address]) -> int | None:
    """The first host address after `after` in ref's subnet that no node uses, wrapping around to the subnet's
    start; None when every host address is taken (a /30, or the head at .254 of a /24 with no room above was
    once an endless loop)."""
    hosts = [int(h) for h in ref.network.hosts() if h not in used]
    return next((h for h in hosts if h > after), hosts[0] if hosts else None)


def _fabric_addresses(fabrics: list[FabricGuess]) -> tuple[list[ipaddress.IPv4Interface], list[str | None]]:
    """(address, GUESS note or None) per node: one subnet (the first observed one); a node without an address
    there gets the next free host address of it, and a note saying so."""
    ref = next((g.address for g in fabrics if g.address is not None), None)
    notes: list[str | None] = [None] * len(fabrics)
    if ref is None:
        ref = _EXAMPLE_FABRIC
        notes = ["no fabric address on any node; NVIDIA's netplan example subnet"] * len(fabrics)
    used = {g.address.ip for g in fabrics if g.address is not None and g.address.network == ref.network}
    nxt = int(ref.ip)
    addrs = []
    for i, g in enumerate(fabrics):
        if g.address is not None and g.address.network == ref.network:
            addrs.append(g.address)
            continue
        if g.address is not None:
            notes[i] = f"observed {g.address}, not in the fabric subnet {ref.network}"
        free = _next_free_address(ref, nxt, used)
        if free is None:  # the file will not validate (a shared address): the note says what to do
            addrs.append(ref)
            notes[i] = f"the fabric subnet {ref.network} has no free address: choose one in a larger subnet"
            continue
        nxt = free
        cand = ipaddress.IPv4Address(nxt)
        used.add(cand)
        addrs.append(ipaddress.IPv4Interface(f"{cand}/{ref.network.prefixlen}"))
        notes[i] = notes[i] or "no IPv4 on it yet; next free address in the fabric subnet"
    return addrs, notes


def _draft_nodes(facts: list[NodeFacts]) -> list[_NodeDraft]:
    fabrics = _guess_fabrics(facts)
    addrs, notes = _fabric_addresses(fabrics)
    return [_NodeDraft(f, name, g, addr, note)
            for f, name, g, addr, note in zip(facts, _node_names(facts), fabrics, addrs, notes)]


def _node_ssh_lines(node: _NodeDraft, is_head: bool, head_name: str, ssh: _SshChoice) -> list[str]:
    f = node.facts
    out = [f"  - name: {_y(node.name)}" + ("" if f.hostname else "   # GUESS: hostname unreadable"),
           f"    role: {'head' if is_head else 'worker'}"
           + ("   # GUESS: the first --head host runs rank 0 and the API" if is_head else ""),
           "    ssh:",
           f"      host: {_y(f.host)}",
           f"      user: {_y(ssh.user)}"]
    if not is_head and ssh.jump:
        out.append(f"      jump: {_y(head_name)}            # through the head (--jump-through-head)")
    out.append(f"      known_hosts: {_y(ssh.known_hosts)}")
    if ssh.identity:
        out.append(f"      identity_file: {_y(ssh.identity)}")
    return out


def _node_fabric_lines(node: _NodeDraft) -> list[str]:
    f, g = node.facts, node.fabric
    out = [f"    # {_c(note)}" for note in g.notes]
    out.append("    fabric:")
    out.append(f"      interface: {_y(g.interface)}   # GUESS: see the note above")
    if g.rdma_device:
        out.append(f"      rdma_device: {_y(g.rdma_device)}   # its RDMA port as read ({f.rdma_source})")
    else:
        out.append("      # rdma_device: omitted, no RDMA device maps to this netdev here")
    guess = f"   # GUESS: {_c(node.address_note)}" if node.address_note else ""
    out.append(f"      address: {_y(str(node.address))}{guess}")
    mtu_note = ("" if g.observed_mtu == 9000 else
                f"   # GUESS: observed {g.observed_mtu or 'nothing'}; 9000 is the Spark recipes' value "
                f"(set by the link step)")
    out.append(f"      mtu: 9000{mtu_note}")
    if g.twins:
        out.append(f"      # twins with IPv4 and an ACTIVE port: {_c(', '.join(g.twins))}; for both rails set "
                   f"serving.env.NCCL_IB_HCA: \"{_c(','.join([g.rdma_device or ''] + g.twins))}\"")
    return out


def _node_state_lines(f: NodeFacts) -> list[str]:
    """Internet, GPUs, and as comments what the node has and runs now, and what could not be read."""
    mem = (f"MemTotal {f.mem_total / 2**30:.1f} GiB, MemAvailable {f.mem_available / 2**30:.1f} GiB"
           if f.mem_total else "memory unknown")
    return [f"    internet: {_y(f.internet)}   # from the routing table (`ip route get 1.1.1.1`); "
            + ("a route exists" if f.internet else "no route: gets HF_HUB_OFFLINE=1"),
            "    gpus: 1                        # GUESS: a DGX Spark has one GB10",
            f"    # {mem}; running: {_c(', '.join(c.name for c in f.containers) or 'nothing')}",
            *(f"    # problem while reading this node: {_c(e)}" for e in f.errors)]


def _nodes_section(nodes: list[_NodeDraft], ssh: _SshChoice) -> list[str]:
    out = ["nodes:"]
    for i, node in enumerate(nodes):
        out += _node_ssh_lines(node, i == 0, nodes[0].name, ssh)
        out += _node_fabric_lines(node)
        out += _node_state_lines(node.facts)
    return out


def _placeholder_model_section(user: str) -> list[str]:
    return ["# GUESS: no Hugging Face cache directory found under $HF_HOME/hub, ~/.cache/huggingface/hub,",
            "# /srv/*/models or /srv/*/*/models/hub: put the model's id, revision and path here.",
            "model:",
            '  id: "org/model"   # GUESS: placeholder',
            "  revision: main",
            "  layout: hf-cache",
            '  path: "/home/' + user + '/.cache/huggingface/hub"   # GUESS: the default cache']


def _model_section(nodes: list[_NodeDraft], model: ModelDir, src: int) -> list[str]:
    """The model found on node `src`; its path as one value when every node would use the same, else per node."""
    paths = [model_root_for(n.facts, n.name, model, model.root) for n in nodes]
    source = nodes[src]
    seen = ", ".join(f"{m.model_id} ({m.size_kib / 2**20:.1f} GiB, {m.layout})" for m in source.facts.models)
    out = [f"# models on {source.name}: {_c(seen)}",
           "model:",
           f"  id: {_y(model.model_id)}   # GUESS: the largest Hugging Face cache directory on {source.name}",
           f"  revision: {_y(model.revision or 'main')}"
           + ("   # refs/main of the cache" if model.revision else "   # GUESS: no refs/main"),
           "  layout: hf-cache",
           f"  source: {_y(source.name)}   # the node that holds the weights"]
    if len({p for p, _ in paths}) == 1:
        out.append(f"  path: {_y(paths[0][0])}   # GUESS: {_c(paths[0][1])}")
    else:
        out.append("  path:")
        for (p, why), node in zip(paths, nodes):
            out.append(f"    {_y(node.name)}: {_y(p)}   # GUESS: {_c(why)}")
    return out


def _serving_section(facts: list[NodeFacts], model: ModelDir | None, port: int, margin: int) -> list[str]:
    image, image_why = pick_image(facts[0])
    gmu, gmu_why = guess_gmu(facts, margin)
    out = ["serving:",
           f"  image: {_y(image)}   # GUESS: {_c(image_why)}",
           "  launcher: native",
           "  container_name: vllm_serving",
           f"  tensor_parallel_size: {len(facts)}   # GUESS: one GPU per node, every node serves",
           "  pipeline_parallel_size: 1",
           f"  port: {port}",
           "  master_port: 29501",
           f"  gpu_memory_utilization: {gmu:g}   # GUESS: {_c(gmu_why)}"]
    if model is not None:
        served = model.model_id.split("/", 1)[1]
        out.append(f"  served_model_name: {_y(served)}   # GUESS: the model's name")
    return out + _docker_lines(facts[0])


def _docker_lines(head: NodeFacts) -> list[str]:
    """serving.docker from the head's docker runtimes and hard limits."""
    nofile = min(1048576, head.nofile_hard) if head.nofile_hard else 1048576
    ulimits = [f'nofile: "{nofile}:{nofile}"'] + (['memlock: "-1"'] if head.memlock_unlimited else [])
    memlock = "unlimited" if head.memlock_unlimited else "limited"
    return ["  docker:",
            f"    gpus: {_y('all') if head.nvidia_runtime else 'null'}"
            + ("   # the nvidia runtime is installed" if head.nvidia_runtime
               else "   # GUESS: docker has no nvidia runtime on the head: no --gpus"),
            "    privileged: false              # true needs trust.privileged: root over the node (docs/security.md)",
            *(["    devices: [/dev/infiniband]     # NCCL's RoCE transport without privileged (eugr --non-privileged)",
               "    cap_add: [IPC_LOCK]"] if head.rdma_source != "none" else []),
            "    ipc: host",
            '    shm_size: "64g"',
            f"    ulimits: {{{', '.join(ulimits)}}}   # GUESS: capped by the head's hard limits "
            f"(nofile {head.nofile_hard or 'unlimited'}, memlock {memlock})"]


def _co_tenants_section(nodes: list[_NodeDraft], port: int) -> list[str]:
    """What runs now may keep running, except another launcher's serving container or one on the serving port:
    those are listed as comments, to be stopped."""
    allowed_lines: list[str] = []
    stop_lines: list[str] = []
    for node in nodes:
        others = [c for c in node.facts.containers if not c.managed]
        keep = [c for c in others if not holds_serving_port(c, port)]
        stop = [c for c in others if holds_serving_port(c, port)]
        if keep:
            allowed_lines.append(f"    {_y(node.name)}:   # GUESS: running now, allowed to keep running "
                                 f"(remove to have it stopped)")
            allowed_lines += [f"      - {_y(c.name)}   # image {_c(c.image)}" for c in keep]
        stop_lines += [f"  # {node.name}: {_c(c.name)} is NOT allowed   # GUESS: another launcher's serving container "
                       f"or it holds :{port}; the reconciler STOPS it (never removes)" for c in stop]
    return ["co_tenants:", "  allowed:" if allowed_lines else "  allowed: {}", *allowed_lines, *stop_lines,
            "  protected: {}",
            "  unlisted: stop   # GUESS: unlisted containers are stopped to free unified memory; `report` only reports"]


def render(heads_and_workers: list[NodeFacts], *, user: str, known_hosts: str, identity: str | None,
           jump: bool, port: int = 8000, margin: int = 4 * 2**30) -> str:
    """The starter desired state. Node 0 is the head. Every inferred value carries `# GUESS:`.

    Node text reaches the file only through `_y` (a quoted scalar) or `_c` (comment text); each line is made
    printable once more as it is joined, so no line break a node sends can ever start a line of live YAML."""
    facts = heads_and_workers
    nodes = _draft_nodes(facts)
    model, src = pick_model(facts)
    out = [*_HEADER, *_nodes_section(nodes, _SshChoice(user, known_hosts, identity, jump)), ""]
    out += _placeholder_model_section(user) if model is None else _model_section(nodes, model, src)
    out += ["", *_serving_section(facts, model, port, margin)]
    out += ["", *_co_tenants_section(nodes, port)]
    out += ["", *_POLICY, "...   # the end marker: keep it the last line (a half-written save is then refused)"]
    return "\n".join(map(printable, out)) + "\n"


# --------------------------------------------------------------------------------------------------- the edge

def probe(sessions: list, timeout: float = 60) -> list[NodeFacts]:
    """Run SCRIPT once per session (head first); raises RemoteError on SSH problems."""
    from concurrent.futures import ThreadPoolExecutor

    def one(session) -> NodeFacts:
        result = session.run_script(SCRIPT, timeout=timeout)
        return parse_facts(session.node.ssh.host, result.stdout)

    with ThreadPoolExecutor(max_workers=min(8, len(sessions))) as pool:
        return list(pool.map(one, sessions))


def sessions_for(head: str, workers: list[str], *, user: str, known_hosts: str, identity: str | None,
                 jump: bool, port: int = 22) -> list:
    """Sessions on synthetic spec.Nodes (the fabric section is a placeholder: only `ssh` is used)."""
    from reconciler.core import spec
    from reconciler.edge.ssh import Session

    placeholder = spec.Fabric(interface="discover", address=ipaddress.IPv4Interface("192.0.2.1/32"))

    def node(name: str, role: Literal["head", "worker"], host: str, via: str | None) -> spec.Node:
        return spec.Node(name=name, role=role, fabric=placeholder,
                         ssh=spec.Ssh(host=host, user=user, port=port, jump=via, known_hosts=known_hosts,
                                      identity_file=identity))

    head_session = Session(node("head", "head", head, None))
    out = [head_session]
    for i, w in enumerate(workers, start=1):
        out.append(Session(node(f"worker{i}", "worker", w, "head" if jump else None),
                           gateway=head_session if jump else None))
    return out
