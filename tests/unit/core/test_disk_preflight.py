"""The disk preflight: free bytes where a copy writes, read with `df -P -B1`, against what the copy still has to
write plus a margin. A copy that would fill the disk is blocking drift that says how much to free and where, and
nothing is copied, stopped or started: a model change would otherwise stop serving only after a copy that dies
partway."""

from __future__ import annotations

import pytest

from reconciler.core.drift import DISK_MARGIN
from reconciler.core.observed import Observed
from reconciler.core.planning import plan
from reconciler.edge.facts.base import ProbeError, Section
from reconciler.edge.facts.disk import parse_disk
from tests.unit.recorded import changed, load

# `df -P -B1` rows as GNU coreutils prints them (this machine, 2026-12-05)
DF = ("weights /dev/loop3 2040373248 1104019456 831262720 58% /srv/spark-testbed/worker\n"
      "image overlay 105089261568 60833734656 38865063936 62% /\n")


def test_free_bytes_are_read_per_destination():
    assert parse_disk(Section(DF, 0)) == {"weights": 831262720, "image": 38865063936}
    assert parse_disk(Section("weights \n", 0)) == {}, "a df that did not answer: not known"
    assert parse_disk(None) is None


@pytest.mark.parametrize("body", ["weights /dev/sda 1 2 lots 4% /\n", "boom\n"])
def test_odd_df_output_is_odd_output(body):
    with pytest.raises(ProbeError, match="disk"):
        parse_disk(Section(body, 0))


def _missing_on_worker2(seen: Observed, weights_free: int, image_free: int) -> Observed:
    """worker2 without the weights and the image, and that much free for each."""
    return changed(seen, "worker2", weights=None, images={},
                   disk_free={"weights": weights_free, "image": image_free})


def test_a_copy_that_fits_is_planned(seen):
    desired = load()
    steps = plan(desired, _missing_on_worker2(seen, 100 << 30, 100 << 30)).steps
    assert {"weights/worker2", "image/worker2"} <= {s.id for s in steps}


def test_copies_that_would_fill_the_disk_are_refused_with_what_to_free(seen):
    desired = load()
    weights = seen.node("head").weights
    image = seen.node("head").images["vllm-standin:latest"]
    assert weights is not None and image.size
    free = DISK_MARGIN  # the margin alone: neither copy fits
    result = plan(desired, _missing_on_worker2(seen, free, free))
    assert not any(s.node == "worker2" for s in result.steps)
    assert not any(s.kind in ("stop-serving", "start-serving") for s in result.steps)
    drift = {d.kind: d for d in result.drift if d.node == "worker2" and d.kind in ("weights", "image")}
    assert all(d.blocking and not d.actionable for d in drift.values())
    want = weights.total_bytes  # the whole tree is missing
    assert f"free {want / 2**30:.1f} GiB there" in drift["weights"].observed
    assert f"free {image.size / 2**30:.1f} GiB there" in drift["image"].observed
    assert drift["weights"].observed.startswith("missing; only 1.0 GiB free: the copy would fill the disk")
