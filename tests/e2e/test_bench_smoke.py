"""The benchmarks keep working: `python -m bench all --quick` on the testbed, sane numbers (not the targets:
those live in the benchmarks and docs/benchmarks.md)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from testbed import api

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]


def test_bench_quick(testbed, tmp_path):
    # The session fixture holds /run/spark-testbed.lock: the benchmark must not wait for it again.
    env = {**os.environ, "BENCH_TESTBED_LOCK_HELD": "1"}
    try:
        p = subprocess.run([sys.executable, "-m", "bench", "all", "--quick", "--results", str(tmp_path)],
                           cwd=ROOT, env=env, capture_output=True, text=True, timeout=900, check=False)
    finally:
        api.up(nodes=2, scenario="seed")  # the benchmarks bring the testbed down; the session goes on with it
    assert p.returncode == 0, p.stderr[-4000:]
    r = {f.stem: json.loads(f.read_text()) for f in tmp_path.glob("*.json")}
    assert set(r) == {"noop", "drift", "edit", "weights", "image", "verify", "footprint", "scaling",
                      "sim"}, sorted(r)
    for name, d in r.items():
        assert d["quick"] is True and d["machine"]["cores"] >= 1
        assert d["leftovers"] == [], (name, d["leftovers"])

    noop = r["noop"]
    for k in ("project", "floor", "ansible"):
        assert 0 < noop[k]["median"] <= noop[k]["p95"] < 60, (k, noop[k])
    assert noop["ansible"]["median"] > noop["project"]["median"]   # sanity, not the 50x target
    for mode in ("events", "resync_5s"):
        for fault in ("kill-serving", "link-down"):
            assert 0 < r["drift"][mode][fault]["median"] < 30
    for k in ("served_model_name", "co_tenant_rule"):
        assert 0 < r["edit"]["daemon"][k]["median"] < 30
    assert 0 < r["edit"]["manual_apply"]["median"] < 120
    for row in r["weights"]["rows"].values():
        assert 1 < row["mb_per_s"] < 100_000
        assert 0 < row["cpu_s_per_gb"]["median"] < 1000  # every transfer's processes were counted, on some end
    for row in r["image"]["rows"].values():
        assert 1 < row["mb_per_s"] < 100_000
    for row in r["verify"]["rows"].values():
        assert 0 < row["noop_check"]["median"] < 30 and row["sha256_seconds"] > 0
    f = r["footprint"]
    assert 1 < f["rss_max_mb"] < 2000 and 0 <= f["cpu_percent"] < 100 and f["seconds"] >= 5
    for row in r["scaling"]["rows"].values():
        assert 0 < row["project"]["median"] < 60 and 0 < row["head_cpu"]["median"] < 60
    for row in r["sim"]["rows"].values():   # the simulated cluster's cycles were no-ops (else the run failed)
        assert 0 < row["cpu"]["median"] < 60 and row["rss_after_kib"] > 0
    assert "| benchmark |" in p.stdout   # the table rendered
