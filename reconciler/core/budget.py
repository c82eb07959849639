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
"""

from __future__ import annotations

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
    terms = [(f"{v.deployment.name} ({', '.join(words for words, _ in _own_terms(v, memory.total_bytes, observed))})",
              sum(size for _, size in _own_terms(v, memory.total_bytes, observed))) for v in views]
    terms += [(f"co-tenant {name}", size) for name, size in desired.co_tenants.reserved(node).items()]
    return Budget(node, memory.total_bytes, (*terms, (MARGIN_TERM, desired.policy.memory_margin)))


def _own_terms(view: Desired, total: int, observed: Observed) -> list[tuple[str, int]]:
    """What one deployment's rank holds on a node (`memory_terms` without the margin, counted once per node)."""
    return [(words, size) for words, size in memory_terms(view, total, weights_size(view, observed))
            if words != MARGIN_TERM]


def budgets(desired: Desired, observed: Observed) -> list[Budget]:
    """The budget of every node that has one, in file order."""
    return [b for n in desired.nodes if (b := node_budget(desired, observed, n.name)) is not None]
