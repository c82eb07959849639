"""A loop that never blocks and never lies, on the testbed (issue 14's "done when").

- A throttled 64 MiB weight sync is in flight; a co-tenant starts on the worker and the head's fabric link drops:
  the link is repaired while the sync still runs, and /status shows the sync's progress moving meanwhile. The
  co-tenant, with nothing of ours running yet, serves on through the copy and is stopped before the start it
  makes room for (issue 32: nothing that works is stopped before it must be).
- A serving whose API stops answering (its process frozen with SIGSTOP: alive, holding its memory, answering
  nothing, which is what a wedged engine looks like) is restarted in order after `serving.unhealthy_grace`, not
  before.
- One node's probe output turns to garbage: that node is ProbeFailed with the reason, the other node is still
  reconciled, and the status says so instead of Converged.
- SIGTERM during a cold start's wait for health (the stand-in's load takes 20 s) and during an image copy: the
  daemon exits within its deadline, nothing is lost, and the next start converges.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from testbed.proc import wait_for
from tests.e2e.daemon import holds_for
from tests.e2e.test_reliability import (
    assert_nothing_lost,
    converged,
    daemon,
    serving_ok,
    sigterm_during,
    slow_sync,
    step_starts,
    write_desired,
)

pytestmark = pytest.mark.e2e


def operation(d, step: str) -> dict | None:
    doc = d.status() or {}
    return next((o for o in doc.get("operations", []) if o["step"] == step), None)


def link_up(tb, node: str) -> bool:
    out = tb.exec(node, "ip -o link show dev enp1s0f1np1").stdout
    return ",UP" in out or "<UP" in out


def serving_ids(tb, node: str) -> set[str]:
    """Ids of the node's managed containers, from one `docker ps` (no inspect: a restart may remove a container
    between a listing and an inspect)."""
    return set(tb.docker(node, "ps", "-aq", "--no-trunc", "--filter", "label=spark-reconciler.managed=true").stdout
               .split())


def running(tb, node: str, name: str) -> bool:
    return bool(tb.docker(node, "ps", "-q", "--filter", f"name=^{name}$", check=False).stdout.strip())


def test_repairs_and_progress_during_a_throttled_weight_sync(seed_testbed, tmp_path):
    tb = seed_testbed.reset("seed")
    desired = write_desired(tmp_path / "cluster.yaml", lambda d: slow_sync(d, rate="3000KB"), resync_interval="1h")
    d = daemon(desired, tmp_path / "state")
    try:
        first = wait_for(lambda: (lambda o: o if o and o["bytesDone"] > 0 else None)(
            operation(d, "weights/worker")), 120, "the weight sync in flight with bytes moved")
        assert first["bytesTotal"] and first["bytesTotal"] >= 60 * 2**20, first

        tb.fault("rogue-container", "worker", name="intruder")
        tb.fault("link-down", "head")
        faulted = time.monotonic()
        wait_for(lambda: link_up(tb, "head"), 60, "the head's link up again")
        repaired = time.monotonic() - faulted
        later = operation(d, "weights/worker")
        assert later is not None, "the link was repaired while the sync was still in flight"
        assert running(tb, "worker", "intruder"), "the co-tenant serves on through the copy"
        print(f"FIGURE sync-repairs: link repaired {repaired:.1f}s after the faults, sync at "
              f"{later['bytesDone'] / 2**20:.1f} of {later['bytesTotal'] / 2**20:.1f} MiB")
        def moving():
            now = operation(d, "weights/worker")
            assert now is not None, "the 64 MiB sync at 3 MB/s ended before its progress moved"
            return now if now["bytesDone"] > first["bytesDone"] and now["bytesPerSecond"] else None

        moved = wait_for(moving, 60, "/status showing the sync's progress move, and its rate")
        # the rate /status shows: rsync's --bwlimit caps the one stream near 3000 KB/s, the link is much faster
        assert 0 < moved["bytesPerSecond"] <= 3000 * 1024 * 1.2, moved
        progressing = d.condition("", "Progressing")
        assert progressing and progressing["status"] == "True" and "weights/worker" in progressing["message"]

        converged(d, 300)
        assert not running(tb, "worker", "intruder")
        assert_nothing_lost(tb, d)
    finally:
        d.close()


GRACE = 12


def test_a_frozen_serving_api_is_restarted_after_the_grace_not_before(seed_testbed, tmp_path):
    tb = seed_testbed.reset("converged")

    def grace(data):
        data["serving"]["unhealthy_grace"] = f"{GRACE}s"
        # A real worker rank waits for a frozen peer in its collective until torch.distributed's NCCL timeout
        # (10 min: the `_ALLGATHER_BASE` watchdog timeout after 600 s, docs/troubleshooting.md); the stand-in's
        # default of 5 s would end the worker first and turn the wedge into a crash.
        data["serving"]["env"] = {**data["serving"].get("env", {}), "STANDIN_PEER_TIMEOUT_S": "600"}

    desired = write_desired(tmp_path / "cluster.yaml", grace, resync_interval="2s")
    d = daemon(desired, tmp_path / "state")
    try:
        converged(d, 120)
        before = serving_ids(tb, "head") | serving_ids(tb, "worker")
        pid = int(tb.docker("head", "inspect", "--format", "{{.State.Pid}}", "vllm_serving").stdout)
        os.kill(pid, signal.SIGSTOP)  # alive, holding its memory, answering nothing
        frozen_at = time.monotonic()
        wait_for(lambda: any("restarted in order after" in b["reason"]
                               for b in ((d.status() or {}).get("lastPlan") or {}).get("blocked", [])),
                   30, "the plan saying it waits out the grace")
        # The grace runs from the first failed check, which is after the freeze: until GRACE seconds after the
        # freeze, nothing may be stopped (a hiccup must not cost a reload).
        holds_for(lambda: serving_ids(tb, "head") <= before,
                  max(0.5, GRACE - 1 - (time.monotonic() - frozen_at)), "serving left alone within the grace")
        wait_for(lambda: not serving_ids(tb, "head") <= before, 120, "the restart")
        print(f"FIGURE frozen-api: restart began {time.monotonic() - frozen_at:.1f}s after the freeze "
              f"(grace {GRACE}s)")
        converged(d, 180)
        after = serving_ids(tb, "head") | serving_ids(tb, "worker")
        assert after and not after & before, "every serving container was replaced: an ordered restart"
        restarts = [e for e in d.log_events() if e.get("event") == "step.start" and e.get("kind") == "stop-serving"]
        assert restarts and all("failed its health check" in e.get("reason", "") for e in restarts), restarts
        # stopped with 1 s, not the policy's 30: the frozen API never acts on SIGTERM, and nothing is left to drain
        assert all(e.get("params", {}).get("grace") == "1" for e in restarts), restarts
        assert serving_ok(tb) == []
    finally:
        d.close()


def test_hostile_probe_output_on_one_node_is_that_nodes_condition(seed_testbed, tmp_path):
    tb = seed_testbed.reset("converged")
    desired = write_desired(tmp_path / "cluster.yaml")
    d = daemon(desired, tmp_path / "state")
    try:
        converged(d, 120)
        tb.fault("hostile-probe", "worker")
        tb.fault("rogue-container", "head", name="intruder")
        t = time.monotonic()
        probed = wait_for(lambda: (lambda c: c if c and c["status"] == "False" else None)(
            d.condition("worker", "Probed")), 30, "worker ProbeFailed")
        assert probed["reason"] == "ProbeFailed" and "meminfo" in probed["message"], probed
        print(f"FIGURE hostile-probe: worker ProbeFailed {time.monotonic() - t:.1f}s after the fault: "
              f"{probed['message']}")
        wait_for(lambda: not running(tb, "head", "intruder"), 60, "the head still reconciled")
        status = d.status()
        assert status["phase"] != "Converged" and d.metric("reconciler_converged") == 0
        assert d.condition("head", "Probed")["status"] == "True"
        assert d.proc.poll() is None, "the daemon lives on"

        tb.fault("probe-restore", "worker")
        converged(d, 60)
    finally:
        tb.fault("probe-restore", "worker")
        d.close()


def test_sigterm_during_a_cold_start_wait_then_restart(seed_testbed, tmp_path):
    tb = seed_testbed.reset("converged")

    def slow_load(data):
        # a 20 s load on each rank; no heartbeat timeout meanwhile (real ranks have none: they meet in the first
        # collective, under torch.distributed's 10 min timeout)
        data["serving"]["env"] = {**data["serving"].get("env", {}), "STANDIN_LOAD_DELAY_S": "20",
                                  "STANDIN_PEER_TIMEOUT_S": "600"}

    stopped = sigterm_during(tb, write_desired(tmp_path / "cluster.yaml", slow_load), tmp_path / "state",
                             lambda d: operation(d, "await-health/head"), "the wait for health in flight", 180)
    print(f"FIGURE sigterm: exit 0 {stopped:.2f}s after SIGTERM")


def test_sigterm_during_an_image_copy_then_restart(seed_testbed, tmp_path):
    tb = seed_testbed.reset("seed")
    stopped = sigterm_during(tb, write_desired(tmp_path / "cluster.yaml"), tmp_path / "state",
                             lambda d: step_starts(d, "image"), "an image copy", 180,
                             orphans="docker (save|load)|dd bs=4M status=progress")
    print(f"FIGURE sigterm: exit 0 {stopped:.2f}s after SIGTERM")
