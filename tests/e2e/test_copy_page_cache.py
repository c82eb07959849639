"""A weights copy beside a serving generation, on a node whose serving holds most of its unified memory.

On a GB10 the page cache a copy leaves is memory the GPU's driver does not count as free (vllm-project/vllm#35313),
and a rank whose runtime allocation meets a full pool dies (NV_ERR_NO_MEMORY, NVIDIA/dgx-spark-playbooks#97). The
testbed has both rules: each node's memory cgroup is charged with the cache its processes make, its device memory
says free = budget - usage (testbed/device_memory.py), and a serving stand-in rank asks for STANDIN_RUNTIME_BYTES
every second and dies when the pool has less. Here a model twice the size of what the worker has left free is
copied to it by the project's own step: bounded (`policy.weights.drop_behind`, the default), the serving keeps
answering and the worker's rank lives; unbounded, the same copy kills that rank, which is why the bound exists."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

from reconciler.core import spec
from reconciler.core.observed import Observed
from reconciler.core.planning import Step
from reconciler.edge.ssh import Sessions
from reconciler.edge.steps import StepContext
from reconciler.edge.steps.weights import sync_weights
from testbed import api
from testbed.proc import wait_for
from testbed.weights import generate
from tests.e2e.test_converge import containers, reconciler, variant

pytestmark = pytest.mark.e2e

MIB, GIB = 1 << 20, 1 << 30
MODEL, REV = "testorg/copy-beside-serving", "5" * 40
GMU = 0.7  # of a 4 GiB node: 2.8 GiB held by the serving rank, ~1 GiB left free
# The copy's rate scaled to the node as its memory is: a Spark moves ~2 GB/s into ~20 GiB left free beside a
# serving generation (~100 MB/s per GiB free); this worker has ~1 GiB. What the bound leaves cached grows with the
# rate (what is written between two of its passes), what the copy leaves without it does not depend on the rate.
RATE = "40MB"  # per stream, 4 streams


@pytest.fixture
def small_nodes(testbed):
    """4 GiB nodes with a 3 GiB model filesystem on the worker; the usual testbed again afterwards."""
    api.down()
    try:
        yield api.up(nodes=2, scenario="seed", node_memory="4G", worker_disk="3G")
    finally:
        api.down()
        api.up(nodes=2, scenario="seed")


def device_free(tb, node: str) -> int:
    return json.loads(tb.exec(node, "curl -s -m 2 http://127.0.0.1:9479/", check=True).stdout)["free"]


def answered(tb) -> bool:
    body = json.dumps({"model": "tiny-moe", "prompt": "ping", "max_tokens": 2})
    out = tb.exec("head", f"curl -s -m 10 -H 'Content-Type: application/json' -d '{body}' "
                          "http://127.0.0.1:8000/v1/completions")
    try:
        return bool(json.loads(out.stdout)["choices"])
    except (ValueError, KeyError, TypeError):
        return False


def serving_ranks(tb) -> dict[str, dict]:
    return {node: containers(tb, node)["vllm_serving"] for node in ("head", "worker")}


def out_of_memory(tb) -> list[str]:
    """The nodes whose serving rank met NV_ERR_NO_MEMORY."""
    return [node for node in ("head", "worker")
            if "NV_ERR_NO_MEMORY" in tb.docker(node, "logs", "vllm_serving", check=False).stdout]


def copy_desired(tmp_path: Path, tb, source: Path, drop_behind: bool) -> Path:
    def change(data):
        data["model"].update({"id": MODEL, "revision": REV, "layout": "plain",
                              "path": {"head": str(source), "worker": f"{tb.workers[0].model_root}/copy/{MODEL}"}})
        data["policy"]["weights"] = {"drop_behind": drop_behind, "parallel_streams": 4, "bandwidth_limit": RATE}
    where = tmp_path / ("bounded" if drop_behind else "unbounded")
    where.mkdir()
    return variant(where, change)


def copy_beside_serving(tb, desired_path: Path) -> tuple[list[bool], int]:
    """The project's weights step from the head to the worker, run as the daemon runs it, while completions are
    asked on the head and both nodes' device memory is read: (each completion's outcome, the least free seen on
    either node: the source's reads are cached too)."""
    desired = spec.load(desired_path)
    outcomes: list[bool] = []
    least = [min(device_free(tb, n) for n in ("head", "worker"))]
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            outcomes.append(answered(tb))
            least[0] = min(least[0], *(device_free(tb, n) for n in ("head", "worker")))
            done.wait(0.3)

    watcher = threading.Thread(target=watch, daemon=True)
    sessions = Sessions(desired)
    try:
        watcher.start()
        ctx = StepContext(desired=desired, sessions=sessions, observed=Observed(nodes={}),
                          deadline=time.monotonic() + 600)
        ctx.perform(sync_weights(ctx.given, Step(kind="weights", node="worker", reason="e2e", source="head")))
    finally:
        done.set()
        watcher.join(30)
        sessions.close()
    return outcomes, least[0]


def test_a_copy_twice_the_free_memory_leaves_the_serving_answering(small_nodes, tmp_path):
    tb = small_nodes
    applied = reconciler("apply", str(variant(tmp_path, lambda d: d["serving"].update(gpu_memory_utilization=GMU))),
                         "--yes", timeout=600)
    assert applied.returncode == 0, applied.stdout + applied.stderr
    assert answered(tb)
    ranks = serving_ranks(tb)
    free = device_free(tb, "worker")
    assert free < 1536 * MIB, f"the premise: the worker's serving holds most of it ({free >> 20} MiB free)"
    size = 2 * free
    root = tb.head.model_root / "copy"
    source = generate(root, MODEL, REV, "plain", 4, size // 4)
    api.exec_("head", f"chown -R spark:spark {root} && sync", user="root", check=True, timeout=300)

    outcomes, least = copy_beside_serving(tb, copy_desired(tmp_path, tb, source, drop_behind=True))
    assert len(outcomes) >= 3, "the copy took long enough to be watched"
    assert all(outcomes), f"{outcomes.count(False)} of {len(outcomes)} completions failed during the bounded copy"
    assert least >= 128 * MIB, f"free memory fell to {least >> 20} MiB on a node during the bounded copy"
    for node, after in serving_ranks(tb).items():
        assert after["Id"] == ranks[node]["Id"] and after["State"]["Running"], (node, after["State"])
    assert not out_of_memory(tb)

    # the same copy, unbounded: the cache fills a node's pool (the worker's writes, the head's reads: both are
    # charged) and a serving rank meets NV_ERR_NO_MEMORY; the engine goes with it
    tb.exec("worker", f"rm -rf {tb.workers[0].model_root}/copy", check=True)
    copy_beside_serving(tb, copy_desired(tmp_path, tb, source, drop_behind=False))
    wait_for(lambda: not all(r["State"]["Running"] for r in serving_ranks(tb).values()), timeout=60,
             what="a serving rank to die")
    assert out_of_memory(tb), "a rank died of the copy's cache"
    assert not answered(tb)
