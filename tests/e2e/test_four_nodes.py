"""Past two nodes: a 4-node testbed (head + worker1..3 on a fabric bridge) converges with tp=4 in one apply.

Runs inside the session's `testbed` fixture, so it holds the same machine-wide lock; it replaces the 2-node testbed
with a 4-node one and restores the 2-node seed testbed afterwards (also when it fails), so the tests after it see
what the session fixture promised."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from reconciler.core import spec
from testbed import api

pytestmark = pytest.mark.e2e

CLI = str(Path(sys.executable).with_name("reconciler"))


@pytest.fixture
def four(testbed):
    api.down()
    try:
        yield api.up(nodes=4, scenario="seed")
    finally:
        left = api.down()
        api.up(nodes=2, scenario="seed")
        assert not left, f"4-node down left behind: {left}"


def test_four_nodes_converge_with_tp4(four):
    tb = four
    desired_file = tb.desired_state
    desired = spec.load(desired_file)
    assert [n.name for n in desired.serving_nodes] == ["head", "worker1", "worker2", "worker3"]
    assert desired.serving.tensor_parallel_size == 4

    t = time.monotonic()
    result = subprocess.run([CLI, "apply", str(desired_file), "--yes"], capture_output=True, text=True, timeout=900,
                            check=False)
    elapsed = time.monotonic() - t
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Converged" in result.stdout

    body = tb.exec("head", "curl -s -m 2 http://127.0.0.1:8000/v1/models", check=True).stdout
    assert [m["id"] for m in json.loads(body)["data"]] == ["tiny-moe"]
    for n in tb.workers:
        ps = json.loads(tb.docker(n.name, "inspect", "vllm_serving").stdout)[0]
        assert ps["State"]["Running"], f"{n.name}: serving runs"
        argv = ps["Config"]["Cmd"] if ps["Config"]["Cmd"] else ps["Args"]
        assert "--headless" in argv and argv[argv.index("--nnodes") + 1] == "4"
        assert argv[argv.index("--node-rank") + 1] == str(n.index)
    again = subprocess.run([CLI, "plan", str(desired_file)], capture_output=True, text=True, timeout=120, check=False)
    assert again.returncode == 0, again.stdout + again.stderr
    print(f"4-node seed -> converged in {elapsed:.1f}s")
