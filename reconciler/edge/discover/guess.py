"""What discover infers from the facts: every value of the starter file that was guessed rather than read.

Why apart from the reading and the writing: these are the rules an operator argues with ("why this port?", "why
0.35?"), so each returns its reason with its value, and the renderer writes the reason as the `# GUESS:` comment
beside it. Pure functions of `NodeFacts` (facts.py); nothing here talks to a node or formats YAML.

The rules follow the Spark recipes: the fabric is the Up RoCE netdev with IPv4 whose RDMA port is ACTIVE (eugr's
autodiscover.sh), in one subnet for all nodes (NVIDIA's connect-two-sparks); gpu_memory_utilization is the
inverse of the reconciler's own memory check (`vllm.largest_utilization`), capped at NVIDIA's TP2 value 0.8.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass, field

from reconciler.core.spec import Policy
from reconciler.core.vllm import flag_value, largest_utilization
from reconciler.edge.discover.facts import Iface, ModelDir, NodeFacts, RdmaLink, RunningContainer

ROCE_NAME = re.compile(r"np\d+$")  # mlx5 netdevs carry the physical port name: enp1s0f1np1, enP2p1s0f1np1
SERVING_LAUNCHER_NAMES = (re.compile(r"^vllm_node$"), re.compile(r"^node-\d+$"))  # eugr launch-cluster, run_cluster.sh
#: NVIDIA's netplan example subnet (connect-two-sparks), for a cluster where no node has a fabric address yet.
EXAMPLE_FABRIC = ipaddress.IPv4Interface("192.168.100.10/24")
#: NVIDIA's TP2 playbook value: the most discover proposes, whatever memory is free.
PLAYBOOK_UTILIZATION = 0.8


# --------------------------------------------------------------------------------------------------- the fabric

@dataclass
class FabricGuess:
    interface: str
    rdma_device: str | None
    address: ipaddress.IPv4Interface | None
    observed_mtu: int | None
    notes: list[str] = field(default_factory=list)
    twins: list[str] = field(default_factory=list)   # other Up RoCE netdevs' RDMA devices (for NCCL_IB_HCA)


def _management_interfaces(facts: NodeFacts, ssh_hosts: list[str]) -> set[str]:
    """Interfaces that carry management traffic: the SSH session's address, or a subnet holding an SSH target."""
    targets = []
    for host in ssh_hosts + ([facts.ssh_local] if facts.ssh_local else []):
        try:
            targets.append(ipaddress.ip_address(host))
        except ValueError:
            pass
    return {i.name for i in facts.ifaces for a in i.ipv4 if any(t in a.network for t in targets)}


def _twin_notes(best: Iface, twins: list[Iface]) -> list[str]:
    """Twins in the fabric's subnet break routing and NCCL (NVIDIA connect-two-sparks): warn; else say it is fine."""
    if not best.ipv4:
        return []
    notes = []
    for twin in twins:
        if any(a.network == b.network for a in twin.ipv4 for b in best.ipv4):
            notes.append(f"WARNING: twin {twin.name} is in the SAME subnet as {best.name}: routing ambiguity and "
                         f"NCCL failures (NVIDIA connect-two-sparks); give the twins different subnets")
        else:
            notes.append(f"twin {twin.name} ({', '.join(map(str, twin.ipv4))}) is in a different subnet (good)")
    return notes


def guess_fabric(facts: NodeFacts, ssh_hosts: list[str], prefer_name: str | None = None) -> FabricGuess:
    """The fabric netdev: an Up RoCE netdev with IPv4, preferring one whose RDMA port is ACTIVE (the
    autodiscover.sh rule, eugr/spark-vllm-docker); without RDMA information, a ConnectX-named (`...npN`) netdev
    that is not management; `prefer_name` (the head's choice) breaks ties and fills in when nothing fits."""
    management = _management_interfaces(facts, ssh_hosts)
    rdma_of = {r.netdev: r for r in facts.rdma if r.netdev}
    candidates, why = _fabric_candidates(facts, management, rdma_of)
    candidates.sort(key=lambda iface: _rank(iface, rdma_of, prefer_name), reverse=True)
    if not candidates:
        name = prefer_name or "enp1s0f1np1"
        return FabricGuess(name, None, None, None, [f"no candidate interface found; {name} assumed (the Spark's "
                                                    f"outer QSFP port)"])
    best = candidates[0]
    rdma = rdma_of.get(best.name)
    twins = [i for i in candidates[1:] if i.ipv4 and i.name in rdma_of and rdma_of[i.name].active]
    return FabricGuess(best.name, rdma.device if rdma else None, best.ipv4[0] if best.ipv4 else None, best.mtu,
                       [_fabric_summary(best, why, rdma), *_twin_notes(best, twins)],
                       [rdma_of[t.name].device for t in twins])


def _fabric_candidates(facts: NodeFacts, management: set[str],
                       rdma_of: dict[str, RdmaLink]) -> tuple[list[Iface], str]:
    """The interfaces that may be the fabric, and why: the RoCE netdevs when the node says which are; else the
    ConnectX-named ones; else any that is not management."""
    if rdma_of:
        by_name = {i.name: i for i in facts.ifaces}
        return ([by_name[n] for n in rdma_of if n in by_name and n not in management],
                f"RoCE netdev ({facts.rdma_source})")
    candidates = [i for i in facts.ifaces if i.name not in management and ROCE_NAME.search(i.name)]
    if candidates:
        return candidates, "ConnectX-style name (npN); no RDMA information on this node"
    return [i for i in facts.ifaces if i.name not in management], "the only non-management interface"


def _rank(iface: Iface, rdma_of: dict[str, RdmaLink], prefer_name: str | None) -> tuple[bool, ...]:
    """The fabric candidates' order (highest first): with IPv4, RDMA port active, up, the head's choice, and
    lower-case (enp1s0f1np1 before its twin enP2p1s0f1np1)."""
    rdma = rdma_of.get(iface.name)
    return (bool(iface.ipv4), bool(rdma and rdma.active), iface.up, iface.name == prefer_name,
            not any(c.isupper() for c in iface.name))


def _fabric_summary(best: Iface, why: str, rdma: RdmaLink | None) -> str:
    """The guess's first note: the interface, why it was chosen, and its state."""
    return (f"{best.name}: {why}; {'up' if best.up else 'DOWN'}, mtu {best.mtu}, "
            f"IPv4 {', '.join(map(str, best.ipv4)) or 'none'}"
            + (f", RDMA {rdma.device} {'ACTIVE' if rdma.active else 'not active'}" if rdma else ""))


def next_free_address(ref: ipaddress.IPv4Interface, after: int, used: set[ipaddress.IPv4Address]) -> int | None:
    """The first host address after `after` in ref's subnet that no node uses, wrapping around to the subnet's
    start; None when every host address is taken (a /30, or the head at .254 of a /24 with no room above was
    once an endless loop)."""
    hosts = [int(h) for h in ref.network.hosts() if h not in used]
    return next((h for h in hosts if h > after), hosts[0] if hosts else None)


def fabric_addresses(fabrics: list[FabricGuess]) -> tuple[list[ipaddress.IPv4Interface], list[str | None]]:
    """(address, GUESS note or None) per node: one subnet (the first observed one); a node without an address
    there gets the next free host address of it, and a note saying so."""
    ref = next((g.address for g in fabrics if g.address is not None), None)
    notes: list[str | None] = [None] * len(fabrics)
    if ref is None:
        ref = EXAMPLE_FABRIC
        notes = ["no fabric address on any node; NVIDIA's netplan example subnet"] * len(fabrics)
    used = {g.address.ip for g in fabrics if g.address is not None and g.address.network == ref.network}
    last = int(ref.ip)
    addresses = []
    for i, fabric in enumerate(fabrics):
        if fabric.address is not None and fabric.address.network == ref.network:
            addresses.append(fabric.address)
            continue
        if fabric.address is not None:
            notes[i] = f"observed {fabric.address}, not in the fabric subnet {ref.network}"
        free = next_free_address(ref, last, used)
        if free is None:  # the file will not validate (a shared address): the note says what to do
            addresses.append(ref)
            notes[i] = f"the fabric subnet {ref.network} has no free address: choose one in a larger subnet"
            continue
        last = free
        used.add(ipaddress.IPv4Address(free))
        addresses.append(ipaddress.IPv4Interface(f"{ipaddress.IPv4Address(free)}/{ref.network.prefixlen}"))
        notes[i] = notes[i] or "no IPv4 on it yet; next free address in the fabric subnet"
    return addresses, notes


# --------------------------------------------------------------------------------------------------- the nodes

def node_name(hostname: str, fallback: str, taken: set[str]) -> str:
    name = re.sub(r"[^a-z0-9-]+", "-", hostname.split(".")[0].lower()).strip("-")[:63].strip("-") or fallback
    base, k = name, 2
    while name in taken:
        name, k = f"{base}-{k}", k + 1
    return name


@dataclass(frozen=True)
class NodeDraft:
    """One node as it will be written: what was read from it, its name, and the fabric guessed for it."""

    facts: NodeFacts
    name: str
    fabric: FabricGuess
    address: ipaddress.IPv4Interface
    address_note: str | None


def draft_nodes(all_facts: list[NodeFacts]) -> list[NodeDraft]:
    """Node 0 is the head. Names from the hostnames, made unique (`head`/`workerN` where a hostname is
    unreadable); each node's fabric netdev, the head's choice breaking the workers' ties (the same port on
    identical machines); addresses in one subnet."""
    taken: set[str] = set()
    ssh_hosts = [facts.host for facts in all_facts]
    names: list[str] = []
    fabrics: list[FabricGuess] = []
    for i, facts in enumerate(all_facts):
        names.append(node_name(facts.hostname, "head" if i == 0 else f"worker{i}", taken))
        taken.add(names[-1])
        fabrics.append(guess_fabric(facts, ssh_hosts, prefer_name=fabrics[0].interface if fabrics else None))
    addresses, notes = fabric_addresses(fabrics)
    return [NodeDraft(facts, name, fabric, address, note)
            for facts, name, fabric, address, note in zip(all_facts, names, fabrics, addresses, notes)]


# --------------------------------------------------------------------------------------------------- the model

def _owns(path: str, hostname: str, name: str) -> bool:
    """A directory named after the host (per-host directories on shared storage) belongs to that host."""
    tokens = {t for t in re.split(r"[-_.]", hostname.lower()) + [hostname.lower(), name] if len(t) >= 3}
    return any(part.lower() in tokens for part in path.split("/"))


def pick_model(all_facts: list[NodeFacts]) -> tuple[ModelDir | None, int]:
    """The largest Hugging Face cache directory, on the head first (index 0), else on any node."""
    for i, facts in enumerate(all_facts):
        hf_cache = [m for m in facts.models if m.layout == "hf-cache"]
        if hf_cache:
            return max(hf_cache, key=lambda m: m.size_kib), i
    return None, 0


def model_root_for(facts: NodeFacts, name: str, model: ModelDir, fallback: str) -> tuple[str, str]:
    """(hub dir, why) for this node: its own directory (HF_HOME, named after the host, holding the model)
    before a shared one; the source's path when the node has none (same user, same path on every Spark)."""
    hf_home_hub = f"{facts.hf_home.rstrip('/')}/hub" if facts.hf_home else None
    holding = {m.root for m in facts.models if m.layout == "hf-cache" and m.model_id == model.model_id}

    def rank(root: str) -> tuple[bool, bool, bool]:
        return (root == hf_home_hub, _owns(root, facts.hostname, name), root in holding)

    roots = sorted(facts.model_roots, key=rank, reverse=True)
    roots = [r for r in roots if r.endswith("/hub") and (any(rank(r)) or r.endswith("/.cache/huggingface/hub"))]
    if roots:
        root = roots[0]
        why = ("$HF_HOME/hub" if root == hf_home_hub else "named after this host" if _owns(root, facts.hostname, name)
               else "holds the model" if root in holding else "the Hugging Face cache here")
        return root, why
    return fallback, "no model directory on this node; the source's path (same user, same path)"


# --------------------------------------------------------------------------------------------------- serving

def guess_gmu(all_facts: list[NodeFacts], policy: Policy) -> tuple[float, str]:
    """gpu_memory_utilization: what MemAvailable allows now on the tightest node (the reconciler's own memory
    check, inverted, with the memory_margin and memory_overhead_per_instance of `policy`, the policy of the file
    being written), less 0.05, in steps of 0.05, capped at the playbook's 0.8."""
    fits = [largest_utilization(f.mem_total, f.mem_available, policy.memory_margin, policy.memory_overhead_per_instance)
            for f in all_facts if f.mem_total]
    if not fits:
        return PLAYBOOK_UTILIZATION, "no /proc/meminfo; 0.8 is NVIDIA's TP2 playbook value"
    fit = min(fits)
    gmu = min(PLAYBOOK_UTILIZATION, int((fit - 0.05) * 20) / 20)
    if gmu >= PLAYBOOK_UTILIZATION:
        return PLAYBOOK_UTILIZATION, "NVIDIA's TP2 playbook value; MemAvailable on every node leaves room for it"
    gmu = max(gmu, 0.05)
    return gmu, (f"MemAvailable now allows ~{fit:.2f} of MemTotal (minus policy.memory_margin and "
                 f"policy.memory_overhead_per_instance) on the tightest node; 0.8 is usual once co-tenants are "
                 f"stopped")


def pick_image(head: NodeFacts) -> tuple[str, str]:
    """The largest image named *vllm* on the head; one a co-tenant runs comes last unless its own name (the last
    path part) says vllm: that is the co-tenant's image, not a serving image."""
    cotenant_images = {c.image for c in head.containers if not c.managed}
    vllm = [(ref, size) for ref, size in head.images if "vllm" in ref.lower()]
    vllm.sort(key=lambda rs: (rs[0] not in cotenant_images or "vllm" in rs[0].split("/")[-1], rs[1]), reverse=True)
    if vllm:
        return vllm[0][0], f"the largest image named *vllm* on the head (of {', '.join(r for r, _ in vllm)})"
    return "nvcr.io/nvidia/vllm:26.05-py3", "no vLLM image on the head; NVIDIA's playbook image (pull it first)"


def holds_serving_port(container: RunningContainer, port: int) -> bool:
    """A container of another launcher (eugr's `vllm_node`, run_cluster.sh's `node-N`) or one started with the
    serving port: it must stop for ours to bind (policy `unlisted: stop`)."""
    if any(p.match(container.name) for p in SERVING_LAUNCHER_NAMES):
        return True
    args = list(container.args)
    for i, arg in enumerate(args):
        if arg in ("--port", "-p") and i + 1 < len(args) and args[i + 1] == str(port):
            return True
        if arg == f"--port={port}" or arg.endswith(f":{port}"):
            return True
    return False


#: vLLM's gpu_memory_utilization when a command line names none: 0.9 for years, 0.92 in recent releases
#: (`vllm serve --help`: "If unspecified, will use the default value of 0.92"); a reservation takes the larger.
VLLM_DEFAULT_UTILIZATION = 0.92


def runs_vllm(container: RunningContainer) -> bool:
    """A container serving with vLLM: `vllm serve ...`, `python -m vllm.entrypoints...`, or an image named *vllm*
    given a command line (a bare `sleep` in a vllm image is not serving)."""
    args = list(container.args)
    return (any("vllm" in a for a in args) or
            ("vllm" in container.image.rsplit("/", 1)[-1].lower() and any(a.startswith("--") for a in args)))


def vllm_reservation(container: RunningContainer, mem_total: int) -> tuple[int, str] | None:
    """What a running vLLM co-tenant holds of its node's unified memory, from its own command line: its
    gpu_memory_utilization x MemTotal, rounded up to a GiB (vLLM's fraction is of the whole GPU,
    vllm/config/cache.py), and the words for the comment; None when it does not run vLLM or the node's memory
    is not known."""
    if not runs_vllm(container) or mem_total <= 0:
        return None
    text = flag_value(container.args, "--gpu-memory-utilization")
    try:
        fraction = float(text) if text is not None else VLLM_DEFAULT_UTILIZATION
    except ValueError:
        fraction = VLLM_DEFAULT_UTILIZATION
    fraction = min(max(fraction, 0.0), 1.0)
    gib = -(-int(fraction * mem_total) // 2**30)
    how = f"--gpu-memory-utilization {text}" if text is not None else f"vLLM's default {VLLM_DEFAULT_UTILIZATION}"
    return gib * 2**30, f"it runs vLLM ({how} x MemTotal {mem_total / 2**30:.1f} GiB)"
