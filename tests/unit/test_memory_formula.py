"""One memory formula (`vllm.memory_for`): the drift and the start's preflight apply it, discover inverts it to
guess gpu_memory_utilization. The inverse is judged here by the formula itself: the guess fits what is available,
and a step more would not."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from reconciler.core.vllm import largest_utilization, memory_for

GIB = 2**30
TOTALS = st.integers(min_value=1 * GIB, max_value=256 * GIB)  # a node's MemTotal: a GB10 has 128 GB
BYTES = st.integers(min_value=0, max_value=256 * GIB)


@given(total=TOTALS, available=BYTES, margin=BYTES)
def test_the_largest_utilization_fits_and_a_step_more_does_not(total, available, margin):
    available = min(available, total)  # MemAvailable never exceeds MemTotal
    u = largest_utilization(total, available, margin)
    assert u >= 0
    if available < margin:
        assert u == 0, "not even the margin fits: nothing may be guessed"
        return
    assert memory_for(u, total, margin) <= available
    assert memory_for(u + 2 / total, total, margin) > available, "a larger share would still have fit"


def test_the_formula_on_a_gb10():
    """0.8 of a GB10's 119.7 GiB unified memory plus the default 4 GiB margin (policy.memory_margin)."""
    total = int(119.7 * GIB)
    assert memory_for(0.8, total, 4 * GIB) == int(0.8 * total) + 4 * GIB
    assert abs(largest_utilization(total, int(0.8 * total) + 4 * GIB, 4 * GIB) - 0.8) < 1e-9


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


def _with_args(*args: str):
    from tests.unit.recorded import load

    return load(("  max_model_len: 4096", "  max_model_len: 4096\n  extra_args: [" + ", ".join(args) + "]"))


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
