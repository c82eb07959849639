"""Unified memory as one budget per node: every deployment on a node and every co-tenant's reservation there,
with the margin, must fit in the node's memory. Pure.

A GB10 has one memory pool (121.63 GiB as vLLM sees it) for the CPU and the GPU. vLLM's gpu_memory_utilization is
a per-instance fraction of the whole pool ("if you have two vLLM instances running on the same GPU, you can set
the GPU memory utilization to 0.5 for each instance", vllm/config/cache.py), so the instances on a node add up,
and what the owner's other containers hold (`co_tenants.memory`) comes on top. The file's rule
(spec/rules.py `_memory_fractions`) checks the fractions alone; this checks the bytes against the node's real
total, which only the probe knows. A node over its budget blocks every start there before anything stops
(drift.py turns it into a blocking drift): a start that cannot find its memory fails after the working model
was stopped for it, or, worse, takes the memory a running rank then dies for (NV_ERR_NO_MEMORY).

Each rank's terms carry policy.memory_overhead_per_instance, what its `vllm serve` holds outside its pool: a node of
three deployments counts it three times (issue 52: the budget counted it, inside the margin, once per node).

The budget is a forecast; `Overshoot` is its check against the node, once a deployment serves (await-health reads
each rank's node, the status publisher judges the reading): what the node holds (MemTotal - MemAvailable) beyond
what the budget reserved for the holders running there. The margin is reserved for no holder, so an overshoot up to
policy.memory_margin is the margin at work, and past it the node holds more than its whole budget: an owner tunes
memory_overhead_per_instance and memory_margin from these numbers (docs/operations.md "The memory budget").
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass

from reconciler.core.observed import Observed
from reconciler.core.spec import Desired
from reconciler.core.vllm import MARGIN_TERM, memory_terms, weights_size


@dataclass(frozen=True)
class Budget:
    """One node's budget: its total and what each holder takes (a deployment's terms, a co-tenant's
    reservation, the margin once), in bytes."""

    node: str
    total: int
    terms: tuple[tuple[str, int], ...]

    @property
    def needed(self) -> int:
        return sum(size for _, size in self.terms)

    @property
    def over(self) -> bool:
        return self.needed > self.total

    def words(self) -> str:
        """`big 85.1 GiB + co-tenant reranker 15.0 GiB + policy.memory_margin 4.0 GiB = 104.1 GiB of 121.6 GiB`."""
        return (" + ".join(f"{holder} {gib(size)}" for holder, size in self.terms)
                + f" = {gib(self.needed)} of {gib(self.total)}")


def gib(n: int) -> str:
    """Bytes as the messages about memory and disk say them: `85.1 GiB`."""
    return f"{n / 2**30:.1f} GiB"


def node_budget(desired: Desired, observed: Observed, node: str) -> Budget | None:
    """`node`'s budget, or None when the probe read no memory there or no deployment runs on it (a node that
    serves nothing holds only what its owner put there)."""
    memory = observed.node(node).memory
    views = [v for v in desired.views() if node in {n.name for n in v.serving_nodes}]
    if memory is None or not views:
        return None
    terms = [rank_term(v, memory.total_bytes, weights_size(v, observed)) for v in views]
    terms += [(f"co-tenant {name}", size) for name, size in desired.co_tenants.reserved(node).items()]
    return Budget(node, memory.total_bytes, (*terms, (MARGIN_TERM, desired.policy.memory_margin)))


def rank_terms(view: Desired, total: int, weights_bytes: int | None) -> list[tuple[str, int]]:
    """What one deployment's rank holds on a node: `memory_terms` without the margin (a node counts it once), its
    overhead included (a node counts it once per rank)."""
    return [(words, size) for words, size in memory_terms(view, total, weights_bytes) if words != MARGIN_TERM]


def rank_term(view: Desired, total: int, weights_bytes: int | None) -> tuple[str, int]:
    """A rank's terms as one holder of the node's budget: `big (gpu_memory_utilization 0.7 x 121.6 GiB,
    policy.memory_overhead_per_instance)` and their sum."""
    terms = rank_terms(view, total, weights_bytes)
    return f"{view.deployment.name} ({', '.join(words for words, _ in terms)})", sum(size for _, size in terms)


def budgets(desired: Desired, observed: Observed) -> list[Budget]:
    """The budget of every node that has one, in file order."""
    return [b for n in desired.nodes if (b := node_budget(desired, observed, n.name)) is not None]


@dataclass(frozen=True)
class Overshoot:
    """One node read once `deployment`'s rank there served: its MemTotal and MemAvailable, the rank container's
    cgroup memory.current (`current`, None when unread: its host side only, as on a GB10 the CUDA allocations are
    charged to no cgroup), and what the budget reserved for the holders running on the node then (`reserved`: that
    rank and every other deployment's rank running there, each with its overhead; the co-tenants' reservations of
    those running). `bytes`: what the node held beyond those reservations, the OS's share included; the margin is
    reserved for no holder, so `margin_left` is what is left of it (below 0: the node is past its whole budget)."""

    node: str
    deployment: str
    total: int
    available: int
    reserved: tuple[tuple[str, int], ...]
    margin: int
    current: int | None = None

    @property
    def used(self) -> int:
        return self.total - self.available

    @property
    def bytes(self) -> int:
        return self.used - sum(size for _, size in self.reserved)

    @property
    def margin_left(self) -> int:
        return self.margin - self.bytes

    def words(self) -> str:
        """`spark-1a32 holds 112.0 GiB of 121.6 GiB: big (...) 105.3 GiB reserved, 6.7 GiB beyond it
        (policy.memory_margin 6.0 GiB: -0.7 GiB of it left)`."""
        reserved = sum(size for _, size in self.reserved)
        beyond = f"{gib(self.bytes)} beyond it" if self.bytes >= 0 else f"{gib(-self.bytes)} less"
        return (f"{self.node} holds {gib(self.used)} of {gib(self.total)}: "
                + " + ".join(f"{holder} {gib(size)}" for holder, size in self.reserved)
                + (f" = {gib(reserved)}" if len(self.reserved) > 1 else "")
                + f" reserved, {beyond} (policy.memory_margin {gib(self.margin)}: {gib(self.margin_left)} of it "
                  "left)")

    def as_dict(self) -> dict[str, object]:
        """For /status: bytes, and the reservations by holder."""
        return {"node": self.node, "deployment": self.deployment, "memTotal": self.total,
                "memAvailable": self.available, "memoryCurrent": self.current,
                "reserved": dict(self.reserved),
                "overshoot": self.bytes, "margin": self.margin, "marginLeft": self.margin_left, "words": self.words()}


def overshoot(desired: Desired, node: str, deployment: str, total: int, available: int, running: Collection[str],
              weights: Mapping[str, int | None] | None = None, current: int | None = None) -> Overshoot:
    """`node` as read once `deployment`'s rank there served (`desired` the whole file): the holders counted are
    that rank, the other deployments' ranks on the node whose container is in `running` (the node's running
    containers then), and the co-tenants' reservations of those running. `weights`: each deployment's weights'
    size where it is known (a rank sized by --kv-cache-memory-bytes holds its share of them; unknown, its pool is
    counted, as the budget does)."""
    sizes = weights or {}
    held = [v for v in desired.views() if node in {n.name for n in v.serving_nodes}
            and (v.deployment.name == deployment or v.serving.container_name in running)]
    reserved = [rank_term(v, total, sizes.get(v.deployment.name)) for v in held]
    reserved += [(f"co-tenant {name}", size) for name, size in desired.co_tenants.reserved(node).items()
                 if name in running]
    return Overshoot(node, deployment, total, available, tuple(reserved), desired.policy.memory_margin, current)
