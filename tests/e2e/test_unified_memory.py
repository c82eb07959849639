"""Unified memory end to end: each node's MemTotal is its own budget, and a serving change restarts in order.

On a GB10 the running vLLM's share of the one memory pool shows up as used in MemAvailable. The testbed now
has the same physics (testbed/memory.py: a memory cgroup per node, lxcfs's meminfo over /proc/meminfo in each
node's SSH sessions; the stand-in holds gpu_memory_utilization x the node's memory). With gmu 0.6 the running
serving holds 60% of each node, so a restart needs the memory only its own stop frees: the first serving change
after a deploy deadlocked here before the fix ("serving restart waits for memory ..."), as on real Sparks.
"""

from __future__ import annotations

import json

import pytest

from testbed.proc import wait_for
from tests.e2e.test_converge import containers, reconciler, variant

pytestmark = pytest.mark.e2e

GIB = 2**30
GMU = 0.6


def meminfo(tb, node: str) -> dict[str, int]:
    out = tb.exec(node, "grep -E '^(MemTotal|MemAvailable):' /proc/meminfo", check=True).stdout
    return {line.split(":")[0]: int(line.split()[1]) * 1024 for line in out.splitlines()}


def completion(tb, model: str) -> dict:
    body = json.dumps({"model": model, "prompt": "ping", "max_tokens": 2})
    out = tb.exec("head", f"curl -s -m 30 -H 'Content-Type: application/json' -d '{body}' "
                          "http://127.0.0.1:8000/v1/completions", check=True).stdout
    return json.loads(out)


def test_each_node_sees_its_own_budget_and_what_it_holds(seed_testbed):
    tb = seed_testbed
    budget = {n: meminfo(tb, n)["MemTotal"] for n in ("head", "worker")}
    assert budget["head"] == budget["worker"] == 8 * GIB, "the default node budget, not the host's memory"
    before = meminfo(tb, "worker")["MemAvailable"]
    tb.exec("worker", "docker run -d --name holder --network host cotenant-standin:latest "
                      "cotenant --port 8097 --hold-mb 512 --label holder", check=True)
    try:  # it listens once its memory is held and touched
        tb.exec("worker", "curl -sf --retry 200 --retry-connrefused --retry-delay 0 --retry-max-time 30 "
                          "-o /dev/null http://127.0.0.1:8097/health", check=True)
        held = before - meminfo(tb, "worker")["MemAvailable"]
        assert 500 << 20 <= held <= 600 << 20, f"512 MiB held on the worker shows as {held >> 20} MiB used there"
        assert meminfo(tb, "head")["MemAvailable"] > budget["head"] - (256 << 20), "and not on the head"
    finally:
        tb.docker("worker", "rm", "-f", "holder", check=False)


def test_serving_change_on_unified_memory_restarts_in_order(seed_testbed, tmp_path):
    tb = seed_testbed

    def big(data):
        data["serving"]["gpu_memory_utilization"] = GMU

    deployed = variant(tmp_path, big)
    result = reconciler("apply", str(deployed), "--yes")
    assert result.returncode == 0, result.stdout + result.stderr
    for node in ("head", "worker"):
        # at least 90 % of its share shows as used (MemAvailable also counts reclaimable memory: CI once saw it a
        # few MiB above (1 - GMU) x MemTotal). Waited for: `apply` returns when the head answers, and a worker rank
        # may still be touching the last of its share (CI: 3.78 GiB free right after apply)
        wait_for(lambda n=node: meminfo(tb, n)["MemAvailable"] < (1 - 0.9 * GMU) * 8 * GIB, 60,
                   f"the serving container on {node} to hold its share of the node's memory")

    def changed(data):
        big(data)
        data["serving"]["max_model_len"] = 2048

    (tmp_path / "changed").mkdir()
    edit = variant(tmp_path / "changed", changed)
    result = reconciler("apply", str(edit), "--yes", timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "waits for memory" not in result.stdout
    order = [line.split()[1] for line in result.stdout.splitlines() if line.strip().startswith("ok ")]
    stops = [i for i, s in enumerate(order) if s.startswith("stop-serving/")]
    starts = [i for i, s in enumerate(order) if s.startswith("start-serving/")]
    assert len(stops) == 2 and len(starts) == 2 and max(stops) < min(starts), order
    for node in ("head", "worker"):
        args = containers(tb, node)["vllm_serving"]["Args"]
        assert args[args.index("--max-model-len") + 1] == "2048"
    assert completion(tb, "tiny-moe")["choices"]


def test_up_heals_a_killed_meminfo_view(seed_testbed):
    """A run killed mid-suite (SIGKILL reaches lxcfs too) leaves a dead FUSE mount: every stat of it fails with
    ENOTCONN, and the next `up` crashed on it (CI, stop 22). `up` now unmounts it by the mount table and binds a
    fresh view into each sshd."""
    import os
    import signal

    from testbed import api
    from testbed.memory import LXCFS_PID
    from testbed.proc import wait_for

    tb = seed_testbed
    os.kill(api.load_pids()[LXCFS_PID]["pid"], signal.SIGKILL)
    wait_for(lambda: not api.alive(api.load_pids()[LXCFS_PID]["pid"]), timeout=10, what="lxcfs's exit")
    dead = tb.exec("head", "cat /proc/meminfo")
    assert dead.returncode != 0 and "not connected" in dead.stderr, "the fault is real: the node's view is dead"
    api.up(nodes=2, scenario="seed")
    assert {n: meminfo(tb, n)["MemTotal"] for n in ("head", "worker")} == {"head": 8 * GIB, "worker": 8 * GIB}


def test_page_cache_is_dropped_before_a_start_as_a_gb10_needs(seed_testbed, tmp_path):
    """The worker's page cache holds 4.5 GiB of a file it read (a weights copy leaves the same), charged to the
    node. MemAvailable counts it as free, so the preflight passes; the GPU's free memory does not (GB10,
    vllm-project/vllm#35313; the testbed's device memory, testbed/device_memory.py), so vLLM's startup check fails
    at gmu 0.5 without the drop, and the start succeeds with it (policy.drop_caches, now the default)."""
    tb = seed_testbed
    fill = "/tmp/spark-testbed-cache-fill"  # written and read on the worker: its cache is the worker's
    try:
        result = reconciler("apply", str(variant(tmp_path, lambda d: None)), "--yes")
        assert result.returncode == 0, result.stdout + result.stderr

        def cached() -> None:
            tb.exec("worker", f"dd if=/dev/zero of={fill} bs=1M count=4608 status=none && sync "
                              f"&& cat {fill} > /dev/null", check=True, timeout=300)
            device = json.loads(tb.exec("worker", "curl -s -m 2 http://127.0.0.1:9479/", check=True).stdout)
            assert device["free"] < 0.5 * device["total"], device  # the cache is not free to the GPU
            assert meminfo(tb, "worker")["MemAvailable"] > (0.5 * 8 + 1) * GIB, "but MemAvailable counts it"

        def half(drop: bool):
            def change(data):
                data["serving"]["gpu_memory_utilization"] = 0.5
                data["policy"]["drop_caches"] = drop
            return change

        cached()
        (tmp_path / "nodrop").mkdir()
        failed = reconciler("apply", str(variant(tmp_path / "nodrop", half(False))), "--yes", "--max-passes", "1")
        out = failed.stdout + failed.stderr
        assert failed.returncode != 0, out
        assert "Free memory on device cuda:0" in out and "is less than desired GPU memory utilization (0.5" in out, out

        cached()
        (tmp_path / "drop").mkdir()
        result = reconciler("apply", str(variant(tmp_path / "drop", half(True))), "--yes", timeout=600)
        assert result.returncode == 0, result.stdout + result.stderr
        assert completion(tb, "tiny-moe")["choices"]
    finally:
        tb.exec("worker", f"rm -f {fill}")
