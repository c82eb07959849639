"""One memory formula (`vllm.memory_for`): the drift and the start's preflight apply it, discover inverts it to
guess gpu_memory_utilization. The inverse is judged here by the formula itself: the guess fits what is available,
and a step more would not. Each rank's term for what its `vllm serve` holds outside its pool
(policy.memory_overhead_per_instance, issue 52) is in it."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from reconciler.core.vllm import largest_utilization, memory_for

GIB = 2**30
TOTALS = st.integers(min_value=1 * GIB, max_value=256 * GIB)  # a node's MemTotal: a GB10 has 128 GB
BYTES = st.integers(min_value=0, max_value=256 * GIB)
OVERHEADS = st.integers(min_value=0, max_value=32 * GIB)


@given(total=TOTALS, available=BYTES, margin=BYTES, overhead=OVERHEADS)
def test_the_largest_utilization_fits_and_a_step_more_does_not(total, available, margin, overhead):
    available = min(available, total)  # MemAvailable never exceeds MemTotal
    u = largest_utilization(total, available, margin, overhead)
    assert u >= 0
    if available < margin + overhead:
        assert u == 0, "not even the margin and the overhead fit: nothing may be guessed"
        return
    assert memory_for(u, total, margin, overhead) <= available
    assert memory_for(u + 2 / total, total, margin, overhead) > available, "a larger share would still have fit"


def test_the_formula_on_a_gb10():
    """0.8 of a GB10's 121.6 GiB unified memory, the default 8 GiB outside the pool and the default 6 GiB margin
    (policy.memory_overhead_per_instance, policy.memory_margin): the defaults are what the formula takes when
    discover gives it no overhead."""
    total = 127535220 * 1024
    assert memory_for(0.8, total, 6 * GIB, 8 * GIB) == int(0.8 * total) + 8 * GIB + 6 * GIB
    assert memory_for(0.8, total, 6 * GIB) == memory_for(0.8, total, 6 * GIB, 8 * GIB)
    assert abs(largest_utilization(total, int(0.8 * total) + 14 * GIB, 6 * GIB, 8 * GIB) - 0.8) < 1e-9


def test_the_start_needs_the_formula_of_its_file():
    """Without the flags that size memory their own way, a rank's need is `memory_for` its file's fraction,
    margin and overhead (the sample: 0.8, a 4 GiB margin, the default 8 GiB overhead)."""
    from reconciler.core.vllm import memory_needed, memory_words
    from tests.unit.step_cases import sample

    total = 127535220 * 1024
    assert memory_needed(sample(), total) == memory_for(0.8, total, 4 * GIB, 8 * GIB) == \
        int(0.8 * total) + 12 * GIB
    assert memory_words(sample(), total) == ("gpu_memory_utilization 0.8 x 121.6 GiB 97.3 GiB + "
                                             "policy.memory_overhead_per_instance 8.0 GiB + policy.memory_margin "
                                             "4.0 GiB = 109.3 GiB")


# -- the flags that change how vLLM sizes its memory (issue 30, finding 5) ----------------------------------------

def test_sizes_read_as_vllm_reads_them():
    """vLLM's own examples (`human_readable_int`: '1k' -> 1,000, '1K' -> 1,024, '25.6k' -> 25,600), the IEC
    spelling newer releases read, and what vLLM refuses."""
    from reconciler.core.vllm import vllm_int

    assert [vllm_int(t) for t in ("1k", "1K", "25.6k", "20G", "20Gi", "3000000", " 2M ")] == \
        [1000, 1024, 25600, 20 * GIB, 20 * GIB, 3_000_000, 2 * 2**20]
    assert [vllm_int(t) for t in ("1.5K", "1.5", "lots", "", "-1G")] == [None] * 5


def test_the_last_value_of_a_flag_counts_in_either_spelling():
    from reconciler.core.vllm import flag_value

    args = ["--kv-cache-memory-bytes", "1G", "--max-num-seqs", "4", "--kv_cache_memory_bytes=2G"]
    assert flag_value(args, "--kv-cache-memory-bytes") == "2G"
    assert flag_value(args, "--cpu-offload-gb") is None


@pytest.fixture
def desired():
    """The recorded cluster (for conftest's `seen`), its stand-in given no overhead, as `_with_args` gives it."""
    return _with_args()


def _with_args(*args: str, overhead: int = 0):
    """The recorded cluster with `args`; its stand-in given `overhead` outside its pool (the file's own value or
    none: the recorded file predates the field)."""
    from tests.unit.recorded import load

    d = load(("  max_model_len: 4096", "  max_model_len: 4096\n  extra_args: [" + ", ".join(args) + "]"))
    return d.model_copy(update={"policy": d.policy.model_copy(update={"memory_overhead_per_instance": overhead})})


def test_a_fixed_kv_cache_replaces_the_utilization_pool_and_offload_adds_to_it():
    """With --kv-cache-memory-bytes vLLM ignores gpu_memory_utilization: a rank holds its share of the weights
    and that cache (the recorded cluster: TP 4, gmu 0.05 of 8 GiB, a 1 GiB margin)."""
    from reconciler.core.vllm import memory_needed, memory_words

    total, weights = 8 * GIB, 4 * GIB
    assert memory_needed(_with_args(), total, weights) == int(0.05 * total) + GIB
    fixed = _with_args('"--kv-cache-memory-bytes"', '"3G"')
    assert memory_needed(fixed, total, weights) == GIB + 3 * GIB + GIB, "a quarter of the weights, the cache, margin"
    assert memory_needed(fixed, total, None) == int(0.05 * total) + 3 * GIB + GIB, "weights unknown: the pool"
    offload = _with_args('"--cpu-offload-gb"', '"2.5"')
    assert memory_needed(offload, total, weights) == int(0.05 * total) + int(2.5 * GIB) + GIB
    assert memory_words(fixed, total, weights) == ("the rank's share of the weights 1.0 GiB + --kv-cache-memory-bytes "
                                                    "3.0 GiB + policy.memory_margin 1.0 GiB = 5.0 GiB")


def test_the_overhead_is_one_term_of_each_rank_beside_the_flags():
    """The rank's overhead comes after what vLLM sizes (its pool, or its share and KV cache, and the offload), before
    the margin; 0 is no term."""
    from reconciler.core.vllm import memory_needed, memory_terms

    total, weights = 8 * GIB, 4 * GIB
    fixed = _with_args('"--kv-cache-memory-bytes"', '"3G"', '"--cpu-offload-gb"', '"1"', overhead=GIB // 2)
    assert memory_terms(fixed, total, weights) == [
        ("the rank's share of the weights", GIB), ("--kv-cache-memory-bytes", 3 * GIB), ("--cpu-offload-gb", GIB),
        ("policy.memory_overhead_per_instance", GIB // 2), ("policy.memory_margin", GIB)]
    assert memory_needed(fixed, total, weights) == GIB + 3 * GIB + GIB + GIB // 2 + GIB
    assert [t for t, _ in memory_terms(_with_args(), total)] == ["gpu_memory_utilization 0.05 x 8.0 GiB",
                                                                 "policy.memory_margin"]


def test_a_kv_cache_that_does_not_fit_blocks_the_start_before_anything_stops(seen):
    """worker3 lost its serving container: the restart starts a rank there, beside 7.5 GiB available. The pool of
    gmu 0.05 fits; a 6.6 GiB KV cache does not (though with the margin it fits the node's 8 GiB: a larger one is
    the budget's, test_budget.py), and the plan says so instead of starting a rank that fails."""
    from reconciler.core.planning import plan
    from tests.unit.recorded import changed

    observed = changed(seen, "worker3",
                       containers=[c for c in seen.node("worker3").containers if c.name != "vllm_serving"])
    assert not [d for d in plan(_with_args(), observed).drift if d.kind == "memory"]
    result = plan(_with_args('"--kv-cache-memory-bytes"', '"6800M"'), observed)
    [short] = [d for d in result.drift if d.kind == "memory"]
    assert short.node == "worker3" and short.blocking and ">= 7.7 GiB available" in short.expected
    assert not [s for s in result.steps if s.kind in ("stop-serving", "start-serving")]
