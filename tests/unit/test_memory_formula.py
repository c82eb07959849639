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
