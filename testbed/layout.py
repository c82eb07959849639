"""Names, addresses and paths of the testbed: the single place that encodes docs/testbed.md ("The contract").

Everything else derives from :func:`layout`, so the contract (which desired-state/testbed.yaml and the
reconciler's tests depend on) cannot drift between modules.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

SSH_USER = "spark"
MGMT_IFACE = "enP7s7"          # the head's (and each worker's) management NIC, as on a real Spark
INNER_IFACE = "enP7s8"         # the head's second management NIC, towards the workers (the head is the jump host)
FABRIC_IFACE = "enp1s0f1np1"   # the RoCE port; a veth here
FABRIC_TWIN_IFACE = "enP2p1s0f1np1"  # its twin (the same QSFP port's second PCIe x4 half); another veth
ROOT_MGMT_IFACE = "sb-mgmt0"   # root-namespace end of the veth to the head
ROOT_MGMT_ADDR = "10.231.0.1/24"
FABRIC_MTU = 9000
SWITCH_NS = "sb-switch"        # holds the bridges when there are more than 2 nodes (and for inner mgmt always)
SRV_ROOT = Path("/srv/spark-testbed")
DATA_ROOT = Path("/var/lib/spark-testbed")   # docker/containerd data roots, kept across down/up (image cache)
SUDOERS = Path("/etc/sudoers.d/spark-testbed")
# Subnets routed to "unreachable" in the root namespace, so that nothing meant for a testbed address can leak
# to the machine's default route (the testbed must never send traffic anywhere else).
TESTBED_SUPERNETS = ("10.231.0.0/16", "10.232.0.0/16")

MODELS = {
    # model id -> revision (contract: both generated on the head, both layouts)
    "testorg/tiny-moe": "1" * 40,
    "testorg/tiny-dense": "2" * 40,
}
SERVED_MODEL = "testorg/tiny-moe"


def state_dir() -> Path:
    return Path(os.environ.get("SPARK_TESTBED_STATE", "/run/spark-testbed"))


@dataclass(frozen=True)
class Node:
    name: str
    index: int                      # 0 = head, i = worker i
    mgmt_addrs: tuple[str, ...]     # CIDRs sshd listens on (first = the one clients use)
    fabric_addr: str                # CIDR
    twin_addr: str = ""             # CIDR of the fabric twin (its own subnet)

    @property
    def role(self) -> str:
        return "head" if self.index == 0 else "worker"

    @property
    def netns(self) -> str:
        return f"sb-{self.name}"

    @property
    def ssh_host(self) -> str:
        return self.mgmt_addrs[0].split("/")[0]

    @property
    def fabric_ip(self) -> str:
        return self.fabric_addr.split("/")[0]

    @property
    def state(self) -> Path:
        return state_dir() / self.name

    @property
    def docker_sock(self) -> Path:
        return self.state / "docker.sock"

    @property
    def docker_host(self) -> str:
        return f"unix://{self.docker_sock}"

    @property
    def srv(self) -> Path:
        return SRV_ROOT / self.name

    @property
    def model_root(self) -> Path:
        return self.srv / "models"

    @property
    def data(self) -> Path:
        return DATA_ROOT / self.name


@dataclass(frozen=True)
class Layout:
    nodes: tuple[Node, ...]
    extra: dict[str, object] = field(default_factory=dict, compare=False)

    @property
    def head(self) -> Node:
        return self.nodes[0]

    @property
    def workers(self) -> tuple[Node, ...]:
        return self.nodes[1:]

    def node(self, name: str) -> Node:
        for n in self.nodes:
            if n.name == name:
                return n
        raise KeyError(f"no node {name!r} (nodes: {', '.join(n.name for n in self.nodes)})")


def layout(n: int = 2) -> Layout:
    """The contract's layout for *n* nodes: ``head`` + ``worker`` (n=2) or ``worker1..worker{n-1}``."""
    if not 2 <= n <= 200:
        raise ValueError("nodes must be between 2 and 200")
    nodes = [Node("head", 0, ("10.231.0.2/24", "10.231.1.1/24"), "10.232.0.10/24", "10.232.1.10/24")]
    for i in range(1, n):
        name = "worker" if n == 2 else f"worker{i}"
        nodes.append(Node(name, i, (f"10.231.1.{10 + i}/24",), f"10.232.0.{10 + i}/24", f"10.232.1.{10 + i}/24"))
    return Layout(tuple(nodes))
