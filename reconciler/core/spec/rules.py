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
    """serving.nodes, when given: real nodes, each once, the head among them, exactly tp x pp GPUs."""
    s, d = f.d.serving, f.d
    if s.nodes is None:
        return []
    out: list[_Problem] = []
    for j, name in enumerate(s.nodes):
        if name not in f.index:
            out.append((("serving", "nodes", j), f"{name!r} is not a node"))
        elif name in s.nodes[:j]:
            out.append((("serving", "nodes", j), f"{name!r} is listed twice"))
    if f.heads and d.nodes[f.heads[0]].name not in s.nodes:
        out.append((("serving", "nodes"), "the head must be one of the serving nodes (it runs rank 0 and the API)"))
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


def _co_tenant_keys_are_nodes(f: _Facts, table: str, patterns: Mapping[str, list[str]]) -> list[_Problem]:
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
    """What reaches beyond the container needs its `trust` entry; system paths are refused even then."""
    return (_privileged_is_trusted(f) + _capabilities_are_trusted(f) + _devices_are_trusted(f)
            + _volumes_are_trusted(f) + _trusted_host_paths_are_not_system(f))


def _image_sources_are_nodes(f: _Facts) -> list[_Problem]:
    return [(("serving", "image_sources", j), f"{name!r} is not a node")
            for j, name in enumerate(f.d.serving.image_sources or []) if name not in f.index]


def _secret_twice(f: _Facts) -> list[_Problem]:
    return [(("serving", "secrets", name, KEY), f"{name} is also in serving.env")
            for name in f.d.serving.secrets if name in f.d.serving.env]


def _co_tenants(f: _Facts) -> list[_Problem]:
    tables = {"allowed": f.d.co_tenants.allowed, "protected": f.d.co_tenants.protected}
    return [problem for table, patterns in tables.items()
            for problem in (_co_tenant_keys_are_nodes(f, table, patterns)
                            + _co_tenants_spare_the_serving_container(f, table, patterns))]


# (rule, runs only when every rule before it found nothing), in the order the problems are reported.
_RULES: tuple[tuple[Callable[[_Facts], list[_Problem]], bool], ...] = (
    (_one_head, False),
    (_unique_node_names, False),
    (_jump_hosts, False),
    (_one_fabric_subnet, False),
    (_unique_fabric_addresses, False),
    (_twins, False),
    (_weights_source_is_a_node, False),
    (_listed_serving_nodes, False),
    (_default_serving_span, False),
    (_distinct_ports, False),
    (_model_path_keys_are_nodes, False),
    (_model_path_for_every_serving_node, True),
    (_model_path_for_the_source, False),
    (_co_tenants, False),
    (_trusted, False),
    (_secret_twice, False),
    (_image_sources_are_nodes, False),
)


def consistency_problems(d: Desired) -> list[_Problem]:
    """Rules across fields, each with the path it is about. Pure; returns all problems, not the first."""
    facts = _Facts.of(d)
    out: list[_Problem] = []
    for rule, only_if_consistent_so_far in _RULES:
        if not (only_if_consistent_so_far and out):
            out += rule(facts)
    return out

