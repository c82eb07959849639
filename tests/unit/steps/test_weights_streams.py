"""How a weight sync splits the shards over its parallel rsync runs (`_groups`, reconciler/edge/steps/weights.py),
judged on the result: every file in exactly one run, no more runs than streams and no empty one, and the runs
balanced as the greedy largest-first split guarantees (no run more than one file above the even share)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from reconciler.edge.steps.weights import _groups
from tests.unit.examples import examples

files = st.dictionaries(st.from_regex(r"[a-z]{1,8}\.safetensors", fullmatch=True),
                        st.integers(min_value=1, max_value=10**11), min_size=1, max_size=60)


@settings(**examples(300))
@given(files, st.integers(min_value=1, max_value=32))
def test_every_shard_goes_in_exactly_one_balanced_run(sizes, streams):
    groups = _groups(list(sizes.items()), streams)
    listed = [p for g in groups for p in g]
    assert sorted(listed) == sorted(sizes), "every file once"
    assert 1 <= len(groups) <= min(streams, len(sizes)) and all(groups)
    assert len(groups) == min(streams, len(sizes)), "every stream the files allow is used"
    loads = [sum(sizes[p] for p in g) for g in groups]
    assert max(loads) <= sum(loads) / len(groups) + max(sizes.values())
