"""Issue 52, item 10: the weights and the image judged on the filesystem they share. On DGX OS the model path and
docker's data root are both on the one NVMe's `/`, so 60 GB free there holds a 50 GB weights copy and a 20 GB image
copy each alone, not both. The probe keeps which filesystem each `df -P` row is on (`NodeObservation.disk_fs`), and
one judgement (`drift.shortfall`) sums the needs per filesystem for every caller: the plan's drift, doctor's
`disk` check, the staging steps (their cases: tests/unit/step_cases/staging.py). A snapshot without the
filesystems (older than this) judges each alone, as before; the probe's own fragment against the real `df` is in
tests/unit/edge/test_probe_scripts_run.py."""

from __future__ import annotations

from reconciler.core.budget import gib
from reconciler.core.drift import DISK_MARGIN, Shortfall, short_of, shortfall
from reconciler.core.observed import NodeObservation, Observed
from reconciler.core.planning import plan
from reconciler.edge.facts.base import Section
from reconciler.edge.facts.disk import parse_disk, parse_disk_fs
from tests.unit.edge.test_doctor import GIB, WORKER, one, run, with_obs
from tests.unit.recorded import changed, load

NVME = "/dev/nvme0n1p2"  # DGX OS: the one NVMe's root filesystem, where the hub and /var/lib/docker both live
ONE = {"weights": NVME, "image": NVME}
TWO = {"weights": "/dev/nvme1n1p1", "image": NVME}


def _missing_on_worker2(seen: Observed, free: int, fs: dict[str, str] | None) -> Observed:
    """worker2 without the weights and the image, `free` bytes read for each row, on the filesystems `fs`."""
    return changed(seen, "worker2", weights=None, images={}, disk_free={"weights": free, "image": free},
                   disk_fs=fs)


def _sizes(seen: Observed) -> tuple[int, int]:
    weights, image = seen.node("head").weights, seen.node("head").images["vllm-standin:latest"]
    assert weights is not None and image.size
    return weights.total_bytes, image.size


def test_both_copies_on_one_filesystem_that_holds_each_alone_but_not_both_are_refused(seen):
    """Fails on the code before issue 52's item 10: each copy judged alone against its own row fits, so both were
    planned, and the second would fill the disk partway."""
    desired = load()
    weights, image = _sizes(seen)
    free = max(weights, image) + DISK_MARGIN  # either copy fits alone, with the margin
    assert free < weights + image + DISK_MARGIN
    result = plan(desired, _missing_on_worker2(seen, free, ONE))
    assert not any(s.node == "worker2" for s in result.steps)
    assert not any(s.kind in ("stop-serving", "start-serving") for s in result.steps)
    drift = {d.kind: d for d in result.drift if d.node == "worker2" and d.kind in ("weights", "image")}
    assert set(drift) == {"weights", "image"}
    assert all(d.blocking and not d.actionable for d in drift.values())
    lack = gib(weights + image + DISK_MARGIN - free)
    assert drift["weights"].observed == (
        f"missing; the weights copy ({gib(weights)}) and the image copy ({gib(image)}) write to one filesystem "
        f"({NVME}) with only {gib(free)} free: together they would fill the disk; free {lack} there (nothing is "
        "copied, stopped or started)")
    assert drift["image"].observed.startswith(f"missing; the image copy ({gib(image)}) and the weights copy "
                                              f"({gib(weights)}) write to one filesystem ({NVME})")
    assert drift["weights"].expected.startswith(f"{gib(weights + image + DISK_MARGIN)} free on ")


def test_the_same_needs_on_two_filesystems_are_planned(seen):
    weights, image = _sizes(seen)
    result = plan(load(), _missing_on_worker2(seen, max(weights, image) + DISK_MARGIN, TWO))
    assert {"weights/worker2", "image/worker2"} <= {s.id for s in result.steps}
    assert not [d for d in result.drift if d.node == "worker2" and d.blocking]


def test_a_snapshot_without_the_filesystems_judges_each_alone_as_before(seen):
    """An `observe --json` from before `disk_fs` loads (the field is optional) and plans as it did."""
    weights, image = _sizes(seen)
    old = _missing_on_worker2(seen, max(weights, image) + DISK_MARGIN, None)
    text = old.model_dump_json(exclude={"nodes": {n: {"disk_fs"} for n in old.nodes}})
    assert "disk_fs" not in text
    result = plan(load(), Observed.model_validate_json(text))
    assert {"weights/worker2", "image/worker2"} <= {s.id for s in result.steps}


def test_the_margin_is_kept_once_per_filesystem_and_two_reads_of_it_count_the_lower():
    obs = NodeObservation(name="n", reachable=True, disk_free={"weights": 61 * GIB, "image": 60 * GIB}, disk_fs=ONE)
    needs = {"weights": 39 * GIB, "image": 20 * GIB}
    assert shortfall(obs, "weights", needs) is None  # 39 + 20 + 1 = 60: the lower read holds it, exactly
    needs = {"weights": 39 * GIB + 1, "image": 20 * GIB}
    assert shortfall(obs, "weights", needs) == Shortfall("weights", 39 * GIB + 1, 60 * GIB, 60 * GIB + 1,
                                                         (("image", 20 * GIB),), NVME)
    alone = obs.model_copy(update={"disk_fs": TWO})
    assert shortfall(alone, "weights", needs) is None and shortfall(alone, "image", needs) is None
    # a copy that is not made (no need, or nothing to write) is not summed: the message is the copy's alone
    assert short_of(obs, "image", {"weights": 0, "image": 60 * GIB}) == (
        "only 60.0 GiB free: the copy would fill the disk; free 1.0 GiB there (nothing is copied, stopped or "
        "started)")
    assert shortfall(obs.model_copy(update={"disk_free": None}), "weights", needs) is None  # not read
    assert shortfall(obs.model_copy(update={"disk_free": {"image": GIB}}), "weights", needs) is None


def test_doctor_names_both_copies_on_one_filesystem():
    """test_doctor's worker lacks a 3 GiB tree and a 2 GiB image: 5 GiB free holds each with the margin, not
    both."""
    c = one(run(worker=with_obs(WORKER, disk_free={"weights": 5 * GIB, "image": 5 * GIB}, disk_fs=ONE)),
            "disk", "worker")
    assert c.status == "fail"
    assert c.message == ("weights (/srv/spark-testbed/worker/models/hub): the weights copy (3.0 GiB) and the image "
                         f"copy (2.0 GiB) write to one filesystem ({NVME}) with only 5.0 GiB free: together they "
                         "would fill the disk; free 1.0 GiB there (nothing is copied, stopped or started)")
    c = one(run(worker=with_obs(WORKER, disk_free={"weights": 5 * GIB, "image": 5 * GIB}, disk_fs=TWO)),
            "disk", "worker")
    assert (c.status, c.message) == ("ok", "weights: 5.0 GiB free, 4.0 GiB needed; image: 5.0 GiB free, 3.0 GiB "
                                           "needed")
    c = one(run(worker=with_obs(WORKER, disk_free={"weights": 100 * GIB, "image": 100 * GIB}, disk_fs=ONE)),
            "disk", "worker")
    assert (c.status, c.message) == ("ok", f"weights and image (one filesystem, {NVME}): 100.0 GiB free, 6.0 GiB "
                                           "needed")


# `df -P -B1` rows as GNU coreutils prints them (tests/unit/core/test_disk_preflight.py's, this machine, 2026-12-05),
# and the DGX OS layout: the hub under /home and /var/lib/docker on the one root filesystem
DF_TESTBED = ("weights /dev/loop3 2040373248 1104019456 831262720 58% /srv/spark-testbed/worker\n"
              "image overlay 105089261568 60833734656 38865063936 62% /\n")
DF_ONE_NVME = (f"weights {NVME} 3936818806784 1211526279168 2525131599872 33% /\n"
               f"image {NVME} 3936818806784 1211526279168 2525131599872 33% /\n")


def test_the_probe_keeps_the_filesystem_of_each_row():
    assert parse_disk_fs(Section(DF_TESTBED, 0)) == {"weights": "/dev/loop3", "image": "/"}
    assert parse_disk_fs(Section(DF_ONE_NVME, 0)) == ONE
    bind = "weights /dev/sda1 10 1 9 10% /srv/models\nimage /dev/sda1 10 1 9 10% /var/lib/docker\n"
    assert parse_disk_fs(Section(bind, 0)) == {"weights": "/dev/sda1", "image": "/dev/sda1"}, "one device, one room"
    two_tmpfs = "weights tmpfs 10 1 9 10% /run/models\nimage tmpfs 10 1 9 10% /run/docker data\n"
    assert parse_disk_fs(Section(two_tmpfs, 0)) == {"weights": "/run/models", "image": "/run/docker data"}
    assert parse_disk_fs(Section("weights \n", 0)) == {} and parse_disk(Section("weights \n", 0)) == {}
    assert parse_disk_fs(None) is None and parse_disk_fs(Section("", 1)) is None
