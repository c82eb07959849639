"""The rules across fields: one head, no jump-host cycles, tp x pp against the GPUs, what `trust` must allow, ...

A field's own type (`values.py`) cannot judge what depends on another field; these rules can, once every field is
valid. Each reports the exact field path it concerns, so `placing.py` can point at the offending line, and all of
them run, so a file's every problem is reported at once. `Desired`'s validator (`models.py`) runs them: this module
therefore imports no model at run time (that would be an import cycle), only names them for the type checker; the
rules read the validated models they are given and nothing else.
"""

from __future__ import annotations

import fnmatch
import ipaddress
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from reconciler.core import loader
from reconciler.core.loader import Loc
from reconciler.core.spec.values import _is_under, mount_refusal

if TYPE_CHECKING:
    from reconciler.core.spec.models import Desired, FabricPort, Node, Serving

KEY = "[key]"  # last element of a problem's path when the mapping key itself is wrong (pydantic's convention)


class MissingSecrets(ValueError):
    """Declared serving.secrets the reconciler's environment cannot give: absent or empty (`names`), or holding a
    control character (`unusable`; a newline would start a variable of its own in docker's `--env-file`). A rule
    between the file and the environment, checked when `Desired.with_secrets` takes the values, never when the
    file is read. It carries names only: a value is never in a message."""

    def __init__(self, names: list[str], unusable: list[str] | None = None):
        self.names, self.unusable = names, unusable or []
        super().__init__(", ".join(self.names + self.unusable))


class ConsistencyError(ValueError):
    """Every cross-field problem of one file. Raised inside pydantic's validation, where `placing.py` finds it
    in an error's context and places each problem at its own path."""

    def __init__(self, problems: list[tuple[Loc, str]]):
        super().__init__("; ".join(f"{loader.format_loc(loc[:-1] if loc[-1:] == (KEY,) else loc)}: {msg}"
                                   for loc, msg in problems))
        self.problems = problems


_Problem = tuple[Loc, str]  # a field path and what is wrong there


@dataclass(frozen=True)
class _Facts:
    """What every cross-field rule looks up: computed once per check."""

    d: Desired
    names: list[str]
    index: dict[str, int]  # node name -> position in `nodes` (the last one for a duplicate name)
    heads: list[int]  # positions of the nodes with role head

    @classmethod
    def of(cls, d: Desired) -> _Facts:
        return cls(d, [n.name for n in d.nodes], {n.name: i for i, n in enumerate(d.nodes)},
                   [i for i, n in enumerate(d.nodes) if n.role == "head"])


def _one_head(f: _Facts) -> list[_Problem]:
    if len(f.heads) == 1:
        return []
    where = ("nodes", f.heads[1], "role") if len(f.heads) > 1 else ("nodes",)
    return [(where, f"exactly one node must have role head (found {len(f.heads)})")]


def _unique_node_names(f: _Facts) -> list[_Problem]:
    return [(("nodes", i, "name"), f"duplicate node name {name!r}")
            for i, name in enumerate(f.names) if name in f.names[:i]]


def _jump_cycle_through(f: _Facts, node: Node) -> str | None:
    """The node where following `ssh.jump` from `node` comes back to a node already passed, if it does."""
    seen, cur = {node.name}, node.ssh.jump
    while cur is not None and cur in f.index:
        if cur in seen:
            return cur
        seen.add(cur)
        cur = f.d.nodes[f.index[cur]].ssh.jump
    return None


def _jump_hosts(f: _Facts) -> list[_Problem]:
    out: list[_Problem] = []
    for i, n in enumerate(f.d.nodes):
        jump, where = n.ssh.jump, ("nodes", i, "ssh", "jump")
        if jump is None:
            continue
        if jump == n.name:
            out.append((where, "a node cannot be its own jump host"))
        elif jump not in f.index:
            out.append((where, f"jump host {jump!r} is not a node (known: {', '.join(sorted(set(f.names)))})"))
        elif (cycle := _jump_cycle_through(f, n)) is not None:
            out.append((where, f"jump hosts form a cycle through {cycle!r}"))
    return out


def _one_fabric_subnet(f: _Facts) -> list[_Problem]:
    if not f.d.nodes:
        return []
    first = f.d.nodes[0]
    net0 = first.fabric.address.network
    return [(("nodes", i, "fabric", "address"),
             f"{n.fabric.address} is not in the fabric subnet {net0} of node {first.name!r}")
            for i, n in enumerate(f.d.nodes[1:], start=1) if n.fabric.address.network != net0]


def _unique_fabric_addresses(f: _Facts) -> list[_Problem]:
    addrs = [n.fabric.address.ip for n in f.d.nodes]
    return [(("nodes", i, "fabric", "address"), f"fabric address {a} is used by another node")
            for i, a in enumerate(addrs) if a in addrs[:i]]


def _twin_problems(where: Loc, first: FabricPort, twin: FabricPort,
                   net0: ipaddress.IPv4Network | None) -> list[_Problem]:
    """One node's twin against that node's first port: another netdev, another subnet (the twins' one), and an
    RDMA device of its own exactly when the first port has one."""
    out: list[_Problem] = []
    if twin.interface == first.interface:
        out.append(((*where, "interface"), f"{twin.interface} is the fabric's first interface already"))
    if twin.address.network == first.address.network:
        out.append(((*where, "address"), f"{twin.address} is in the subnet of {first.interface}; "
                    "the twins need different subnets"))
    elif twin.address.network != net0:
        out.append(((*where, "address"), f"{twin.address} is not in the twins' subnet {net0}"))
    if (twin.rdma_device is None) != (first.rdma_device is None):
        out.append(((*where, "rdma_device"), "an RDMA device on both twins or on neither"))
    elif twin.rdma_device is not None and twin.rdma_device == first.rdma_device:
        out.append(((*where, "rdma_device"), f"{twin.rdma_device} is the first port's RDMA device already"))
    return out


def _twins(f: _Facts) -> list[_Problem]:
    """A twin is another netdev in another subnet (one subnet on both twins breaks routing and NCCL: eugr
    docs/NETWORKING.md), one subnet for all twins, no address used twice. Every node or none: NCCL would pair a
    twin's device with a peer's only one, across two subnets. An RDMA device on both ports or neither."""
    declared = [n.fabric.twin is not None for n in f.d.nodes]
    if any(declared) and not all(declared):
        return [(("nodes", i, "fabric", "twin"), "declare the fabric twin on every node or on none (NCCL pairs "
                 "the devices across nodes)") for i, d in enumerate(declared) if not d]
    out: list[_Problem] = []
    seen: dict[ipaddress.IPv4Address, str] = {n.fabric.address.ip: n.name for n in f.d.nodes}
    net0 = next((n.fabric.twin.address.network for n in f.d.nodes if n.fabric.twin), None)
    for i, n in enumerate(f.d.nodes):
        twin, where = n.fabric.twin, ("nodes", i, "fabric", "twin")
        if twin is None:
            continue
        out += _twin_problems(where, n.fabric, twin, net0)
        if twin.address.ip in seen:
            out.append(((*where, "address"), f"{twin.address.ip} is used by {seen[twin.address.ip]!r} already"))
        seen[twin.address.ip] = n.name
    return out


def _weights_source_is_a_node(f: _Facts) -> list[_Problem]:
    source = f.d.model.source
    if source is not None and source not in f.index:
        return [(("model", "source"), f"weights source {source!r} is not a node")]
    return []


def _gpus_needed(s: Serving) -> int:
    return s.tensor_parallel_size * s.pipeline_parallel_size


def _listed_serving_nodes(f: _Facts) -> list[_Problem]:
    """serving.nodes, when given: real nodes, each once, exactly tp x pp GPUs. Rank 0 and the API run on the head
    when it is listed, else on the first listed node (`Desired.api_node`)."""
    s, d = f.d.serving, f.d
    if s.nodes is None:
        return []
    out: list[_Problem] = []
    for j, name in enumerate(s.nodes):
        if name not in f.index:
            out.append((("serving", "nodes", j), f"{name!r} is not a node"))
        elif name in s.nodes[:j]:
            out.append((("serving", "nodes", j), f"{name!r} is listed twice"))
    need, span = _gpus_needed(s), sum(d.nodes[f.index[n]].gpus for n in set(s.nodes) if n in f.index)
    if span != need:
        out.append((("serving", "tensor_parallel_size"), f"tensor_parallel_size x pipeline_parallel_size = "
                                                         f"{need} but the serving nodes have {span} GPUs"))
    return out


def _default_serving_span(f: _Facts) -> list[_Problem]:
    """Without serving.nodes: the cluster has tp x pp GPUs, and whole nodes (head first) add up to exactly that."""
    s, d = f.d.serving, f.d
    if s.nodes is not None:
        return []
    need, total = _gpus_needed(s), sum(n.gpus for n in d.nodes)
    if need > total:
        return [(("serving", "tensor_parallel_size"),
                 f"tensor_parallel_size x pipeline_parallel_size = {need} exceeds the cluster's {total} GPUs")]
    if len(f.heads) == 1 and sum(n.gpus for n in d.serving_nodes) != need:
        return [(("serving", "tensor_parallel_size"),
                 f"tensor_parallel_size x pipeline_parallel_size = {need} does not match the GPUs of "
                 f"whole nodes (head first): set serving.nodes explicitly")]
    return []


def _distinct_ports(f: _Facts) -> list[_Problem]:
    s = f.d.serving
    out: list[_Problem] = []
    ports = {"port": s.port, "master_port": s.master_port, "ray_port": s.ray_port}
    for value in set(ports.values()):
        same = [k for k, v in ports.items() if v == value]
        if len(same) > 1:  # point at what the operator wrote, not at a default they never saw
            written = [k for k in same if k in s.model_fields_set] or same[1:]
            for key in written:
                others = ", ".join(f"serving.{k}" for k in same if k != key)
                out.append((("serving", key), f"port {value} is also {others}"))
    return out


def _model_path_keys_are_nodes(f: _Facts) -> list[_Problem]:
    path = f.d.model.path
    if not isinstance(path, dict):
        return []
    return [(("model", "path", key, KEY), f"{key!r} is not a node") for key in path if key not in f.index]


def _model_path_for_every_serving_node(f: _Facts) -> list[_Problem]:
    """Needs the derived serving nodes, so it runs only on an otherwise consistent file (see _RULES)."""
    path = f.d.model.path
    if not isinstance(path, dict) or len(f.heads) != 1:
        return []
    return [(("model", "path"), f"no model path for serving node {n.name!r}")
            for n in f.d.serving_nodes if n.name not in path]


def _model_path_for_the_source(f: _Facts) -> list[_Problem]:
    path, source = f.d.model.path, f.d.model.source
    if isinstance(path, dict) and source and source in f.index and source not in path:
        return [(("model", "path"), f"no model path for the source node {source!r}")]
    return []


def _co_tenant_keys_are_nodes(f: _Facts, table: str, patterns: Mapping[str, object]) -> list[_Problem]:
    return [(("co_tenants", table, key, KEY), f"{key!r} is not a node")
            for key in patterns if key != "*" and key not in f.index]


def _co_tenants_spare_the_serving_container(f: _Facts, table: str,
                                            patterns: Mapping[str, list[str]]) -> list[_Problem]:
    name = f.d.serving.container_name
    return [(("co_tenants", table, key, j), f"{p!r} matches the managed serving container {name!r}")
            for key, listed in patterns.items()
            for j, p in enumerate(listed) if fnmatch.fnmatchcase(name, p)]


# What a serving container may have without `trust`: the RDMA devices and locked memory NCCL's RoCE transport
# needs (eugr/spark-vllm-docker's --non-privileged set), nothing that reaches the node itself.
SAFE_CAPABILITIES = ("IPC_LOCK",)
SAFE_DEVICE_PREFIX = "/dev/infiniband"
_DOCKER: Loc = ("serving", "docker")


def _privileged_is_trusted(f: _Facts) -> list[_Problem]:
    if f.d.serving.docker.privileged and not f.d.trust.privileged:
        return [((*_DOCKER, "privileged"), "a privileged container is root over the node: allow it with "
                 "trust.privileged: true")]
    return []


def _capabilities_are_trusted(f: _Facts) -> list[_Problem]:
    return [((*_DOCKER, "cap_add", j), f"{cap} is not allowed: add it to trust.capabilities (IPC_LOCK needs "
             "nothing)") for j, cap in enumerate(f.d.serving.docker.cap_add)
            if cap not in SAFE_CAPABILITIES and cap not in f.d.trust.capabilities]


def _devices_are_trusted(f: _Facts) -> list[_Problem]:
    return [((*_DOCKER, "devices", j), f"{dev} is not allowed: add it to trust.devices ({SAFE_DEVICE_PREFIX} needs "
             "nothing)") for j, dev in enumerate(f.d.serving.docker.devices)
            if not any(_is_under(dev, p) for p in (SAFE_DEVICE_PREFIX, *f.d.trust.devices))]


def _volumes_are_trusted(f: _Facts) -> list[_Problem]:
    out: list[_Problem] = []
    for j, volume in enumerate(f.d.serving.docker.volumes):
        host = volume.split(":", 1)[0]
        if (refusal := mount_refusal(host)) is not None:
            out.append(((*_DOCKER, "volumes", j), f"{refusal}: never mounted into a serving container"))
        elif not any(_is_under(host, p) for p in f.d.trust.host_paths):
            out.append(((*_DOCKER, "volumes", j), f"{host} is not below a trusted host path: add its directory to "
                        "trust.host_paths"))
    return out


def _trusted_host_paths_are_not_system(f: _Facts) -> list[_Problem]:
    """A trusted path may not hold a refused one either: trusting `/var` would let a volume mount /var itself,
    and /var/lib/docker with it."""
    return [(("trust", "host_paths", j), f"{refusal}: never mounted")
            for j, p in enumerate(f.d.trust.host_paths) if (refusal := mount_refusal(p)) is not None]


def _trusted(f: _Facts) -> list[_Problem]:
    """What reaches beyond the container needs its `trust` entry; system paths are refused even then
    (`_trusted_host_paths_are_not_system`, once for the file)."""
    return (_privileged_is_trusted(f) + _capabilities_are_trusted(f) + _devices_are_trusted(f)
            + _volumes_are_trusted(f))


def _image_sources_are_nodes(f: _Facts) -> list[_Problem]:
    return [(("serving", "image_sources", j), f"{name!r} is not a node")
            for j, name in enumerate(f.d.serving.image_sources or []) if name not in f.index]


def _secret_twice(f: _Facts) -> list[_Problem]:
    return [(("serving", "secrets", name, KEY), f"{name} is also in serving.env")
            for name in f.d.serving.secrets if name in f.d.serving.env]


def _verify_needs_generated_text(f: _Facts) -> list[_Problem]:
    """serving.verify asks for a completion and matches its text: a pooling model (`--runner pooling`: embeddings,
    a reranker) serves no completions API and generates no text, so a verify there could only ever fail. Its health
    check already makes one pass through every rank (`POST /pooling`)."""
    from reconciler.core.vllm import pools  # at call time: core.vllm imports the spec, which imports this module

    s = f.d.serving
    if s.verify is None or not pools(s):
        return []
    return [(("serving", "verify"), "a pooling model (--runner pooling in serving.extra_args: embeddings, a "
             "reranker) generates no text to check: remove serving.verify (its health check already makes one "
             "pass through every rank, POST /pooling)")]


def _co_tenants(f: _Facts) -> list[_Problem]:
    tables: dict[str, Mapping[str, object]] = {"allowed": f.d.co_tenants.allowed,
                                               "protected": f.d.co_tenants.protected, "memory": f.d.co_tenants.memory}
    return [problem for table, patterns in tables.items() for problem in _co_tenant_keys_are_nodes(f, table, patterns)]


def _reservations_are_allowed(f: _Facts) -> list[_Problem]:
    """A co-tenant's memory reservation is for one the file lets run: one it does not allow is stopped (or only
    reported), and its reservation would take memory from the deployments for nothing."""
    ct, out = f.d.co_tenants, list[_Problem]()
    for key, held in ct.memory.items():
        for name in held:
            refused = [n for n in ([key] if key != "*" else f.names) if n in f.index and not ct.is_allowed(n, name)]
            if refused:
                out.append((("co_tenants", "memory", key, name, KEY), f"{name} is not allowed on {refused[0]} "
                            "(co_tenants.allowed): reserve memory only for a co-tenant that may run there"))
    return out


def _co_tenants_spare_serving(f: _Facts) -> list[_Problem]:
    tables = {"allowed": f.d.co_tenants.allowed, "protected": f.d.co_tenants.protected}
    return [problem for table, patterns in tables.items()
            for problem in _co_tenants_spare_the_serving_container(f, table, patterns)]


def _unique_deployment_names(f: _Facts) -> list[_Problem]:
    names = f.d.deployment_names
    return [(("deployments", i, "name"), f"duplicate deployment name {name!r}")
            for i, name in enumerate(names) if name in names[:i]]


def _unique_container_names(f: _Facts) -> list[_Problem]:
    """Each deployment its own container name: the name is how the reconciler finds a deployment's rank on a
    node, and docker refuses a second container of the same name anyway."""
    names = [d.serving.container_name for d in f.d.deployments]
    return [(("deployments", i, "serving", "container_name"), f"container name {name!r} is deployment "
             f"{f.d.deployments[names.index(name)].name!r}'s already") for i, name in enumerate(names)
            if name in names[:i]]


def _spans(f: _Facts) -> list[set[str]]:
    return [{n.name for n in f.d.view(d.name).serving_nodes} for d in f.d.deployments]


def _bound_ports(s: Serving, span: set[str]) -> dict[int, str]:
    """The ports a deployment's ranks listen on, with the field that names each: the API always, torch's
    rendezvous when native ranks span nodes, Ray's GCS with the Ray launcher (core/vllm.py renders the same)."""
    out = {s.port: "port"}
    if s.launcher == "native" and len(span) > 1:
        out.setdefault(s.master_port, "master_port")
    if s.launcher == "ray":
        out.setdefault(s.ray_port, "ray_port")
    return out


def _ports_across_deployments(f: _Facts) -> list[_Problem]:
    """Serving runs on the host network: two deployments on one node need other ports (the API, torch's
    rendezvous, Ray's GCS), or the second start fails with `address already in use` after the plan stopped
    nothing for it. The later deployment's field is the one pointed at."""
    out: list[_Problem] = []
    spans = _spans(f)
    for i, d in enumerate(f.d.deployments):
        mine = _bound_ports(d.serving, spans[i])
        for j, earlier in enumerate(f.d.deployments[:i]):
            shared = spans[i] & spans[j]
            taken = _bound_ports(earlier.serving, spans[j]) if shared else {}
            out += [(("deployments", i, "serving", key), f"port {port} is deployment {earlier.name!r}'s serving."
                     f"{taken[port]} on {', '.join(sorted(shared))} (the host network: one listener a port)")
                    for port, key in mine.items() if port in taken]
    return out


def _memory_fractions(f: _Facts) -> list[_Problem]:
    """Unified memory is one budget per node: the deployments on a node may together ask for at most
    policy.gpu_memory_utilization_ceiling of it (0.90 by default), one deployment alone included. vLLM's
    gpu_memory_utilization is a per-instance fraction of the whole GPU ("if you have two vLLM instances running on
    the same GPU, you can set the GPU memory utilization to 0.5 for each", vllm/config/cache.py), so fractions add
    up; and on a GB10 a node whose fractions reach the whole of it cannot start them all, whatever it holds: each
    instance holds memory outside its pool, and so does the OS (the ceiling's description cites the figures). The
    file does not know the node's MemTotal: the plan checks the bytes, with each rank's overhead, the co-tenants
    and the margin, against the node's real total (core/budget.py). The last deployment on the node is pointed
    at."""
    out: list[_Problem] = []
    spans = _spans(f)
    ceiling = f.d.policy.gpu_memory_utilization_ceiling
    for node in f.d.nodes:
        on = [(i, d) for i, d in enumerate(f.d.deployments) if node.name in spans[i]]
        total = sum(d.serving.gpu_memory_utilization for _, d in on)
        if on and total > ceiling + 1e-9:
            shares = " + ".join(f"{d.name} {d.serving.gpu_memory_utilization:g}" for _, d in on)
            summed = f" = {round(total, 9):g}" if len(on) > 1 else ""
            out.append((("deployments", on[-1][0], "serving", "gpu_memory_utilization"),
                        f"node {node.name!r} is over-committed: {shares}{summed} of its memory (at "
                        f"most {ceiling:g}, policy.gpu_memory_utilization_ceiling: a GB10 also holds each "
                        "instance's memory outside its pool and the OS's)"))
    return out


def _in_deployment(i: int, problems: list[_Problem]) -> list[_Problem]:
    """A deployment's own problems at its path in the list (`deployments.I.serving.port`); `placing.py` points a
    file of the single form back at `serving.port`."""
    return [((("deployments", i, *loc) if loc[:1] in (("model",), ("serving",)) else loc), msg)
            for loc, msg in problems]


_Rule = Callable[[_Facts], list[_Problem]]

# (rule, runs only when every rule before it found nothing), in the order the problems are reported: the
# cluster's own, then each deployment's (`_DEPLOYMENT_RULES`, on its view), then those across deployments.
_CLUSTER_RULES: tuple[tuple[_Rule, bool], ...] = (
    (_one_head, False),
    (_unique_node_names, False),
    (_jump_hosts, False),
    (_one_fabric_subnet, False),
    (_unique_fabric_addresses, False),
    (_twins, False),
    (_co_tenants, False),
    (_reservations_are_allowed, False),
    (_trusted_host_paths_are_not_system, False),
    (_unique_deployment_names, False),
)
_DEPLOYMENT_RULES: tuple[tuple[_Rule, bool], ...] = (
    (_weights_source_is_a_node, False),
    (_listed_serving_nodes, False),
    (_default_serving_span, False),
    (_distinct_ports, False),
    (_model_path_keys_are_nodes, False),
    (_model_path_for_every_serving_node, True),
    (_model_path_for_the_source, False),
    (_co_tenants_spare_serving, False),
    (_trusted, False),
    (_secret_twice, False),
    (_image_sources_are_nodes, False),
    (_verify_needs_generated_text, False),
)
_ACROSS_RULES: tuple[tuple[_Rule, bool], ...] = (
    (_unique_container_names, False),
    (_ports_across_deployments, True),
    (_memory_fractions, True),
)


def _run(rules: tuple[tuple[_Rule, bool], ...], facts: _Facts, out: list[_Problem]) -> list[_Problem]:
    found: list[_Problem] = []
    for rule, only_if_consistent_so_far in rules:
        if not (only_if_consistent_so_far and (out or found)):
            found += rule(facts)
    return found


def consistency_problems(d: Desired) -> list[_Problem]:
    """Rules across fields, each with the path it is about. Pure; returns all problems, not the first."""
    out = _run(_CLUSTER_RULES, _Facts.of(d), [])
    if len(set(d.deployment_names)) != len(d.deployments):
        return out  # a view by name would be ambiguous
    for i, deployment in enumerate(d.deployments):
        out += _in_deployment(i, _run(_DEPLOYMENT_RULES, _Facts.of(d.view(deployment.name)), out))
    return out + _run(_ACROSS_RULES, _Facts.of(d), out)
