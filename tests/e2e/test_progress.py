"""Issue 33, item 6 on the testbed: the two long waits show progress a person can watch.

- `reconciler apply` on the seed (no terminal: a plain line per report, as in CI or a journal) says the image copy's
  bytes of the source's `docker image inspect` size and its rate, and the cold start's stage, in vLLM's words,
  before the start is healthy;
- a running daemon shows the same cold start in /status (stage, percent, vLLM's line) and in the metrics
  (`reconciler_serving_start_stage`), and its series leave with the wait.

What the log cannot show, these tests do not ask: vLLM's CUDA graph bar is redrawn with `\\r` and no newline, and
Docker's log copier passes a line on only at its newline (moby daemon/logger/copier.go), so `docker logs` has the
capture's bar only once it ends; meanwhile the stage stays the one before (reconciler/core/vllm_log.py).

The stand-in serves (testbed/standin): it prints vLLM's own lines for each stage over STANDIN_LOAD_DELAY_S.
"""

from __future__ import annotations

import json
import re
import urllib.request

import pytest
from rich.filesize import decimal

from reconciler.core.vllm_log import STAGES
from testbed.proc import wait_for
from tests.e2e.test_converge import reconciler, variant
from tests.e2e.test_loop import operation
from tests.e2e.test_reliability import converged, daemon, write_desired

pytestmark = pytest.mark.e2e

IMAGE = "vllm-standin:latest"  # desired-state/testbed.yaml's serving image: on the head only in the seed


def slow_load(seconds: int):
    """Each rank's load takes `seconds` (half torch.compile, half CUDA graphs in the stand-in's log); no heartbeat
    timeout meanwhile (real ranks have none)."""
    def change(data: dict) -> None:
        data["serving"]["env"] = {**data["serving"].get("env", {}), "STANDIN_LOAD_DELAY_S": str(seconds),
                                  "STANDIN_PEER_TIMEOUT_S": "600"}
    return change


def test_apply_shows_the_image_copy_of_its_total_and_the_cold_start_before_it_serves(seed_testbed, tmp_path):
    tb = seed_testbed
    size = json.loads(tb.docker("head", "image", "inspect", IMAGE).stdout)[0]["Size"]
    result = reconciler("apply", str(variant(tmp_path, slow_load(8))), "--yes", timeout=600)
    out = result.stdout
    assert result.returncode == 0, out[-6000:] + result.stderr[-3000:]

    copy = re.findall(rf"^  image -> worker: (.+) of ~{re.escape(decimal(size))} \((\d+)%\)(.*)$", out, re.M)
    assert copy, f"no image line with the source's size ({decimal(size)}):\n{out[-4000:]}"
    assert copy[-1][2].endswith(", done") and " at " in copy[-1][2], copy[-1]
    sent = int(tb.exec("head", f"docker save {IMAGE} | wc -c", check=True).stdout)
    print(f"FIGURE image total: inspect Size {size} B, docker save {sent} B ({100 * (sent - size) / size:+.2f}%)")

    lines = out.splitlines()
    healthy = next(i for i, line in enumerate(lines) if line.strip().startswith("ok") and "await-health/head" in line)
    said = [m.group(1) for line in lines[:healthy] if (m := re.match(r"^  cold start on head: ([\w-]+)", line))]
    assert set(said) & {"loading-weights", "compiling", "cuda-graphs", "api-starting"}, (said, out[-4000:])
    assert said == sorted(said, key=STAGES.index), f"stages out of order: {said}"
    print("FIGURE apply's progress lines:\n" + "\n".join(line for line in lines if line.startswith(
        ("  image -> ", "  cold start on "))))


def series(d, name: str) -> dict[str, float]:
    """Every sample of one metric family as `{labels: value}`; absent series are absent, not 0."""
    with urllib.request.urlopen(f"{d.url}/metrics", timeout=2) as r:
        text = r.read().decode()
    return {m.group(1): float(m.group(2)) for m in re.finditer(rf"^{name}\{{([^}}]*)\}} (\S+)$", text, re.M)}


def test_the_daemon_shows_the_cold_start_in_status_and_metrics(seed_testbed, tmp_path):
    tb = seed_testbed.reset("converged")  # image and weights everywhere, nothing serving: a cold start at once
    d = daemon(write_desired(tmp_path / "cluster.yaml", slow_load(20)), tmp_path / "state")
    try:
        waiting = wait_for(lambda: (lambda o: o if o and o.get("stage") == "compiling" else None)(
            operation(d, "await-health/head")), 180, "the cold start's stage in /status")
        assert waiting["detail"], waiting
        stages = series(d, "reconciler_serving_start_stage")
        assert stages[f'node="head",stage="{waiting["stage"]}"'] == 1, stages
        assert sum(stages.values()) == 1 and len(stages) == len(STAGES), stages

        converged(d, 120)
        assert tb.exec("head", "curl -s -o /dev/null -w '%{http_code}' http://127.0.0.1:8000/health").stdout == "200"
        assert series(d, "reconciler_serving_start_stage") == {}, "the series leave with the wait"
        said = [e["stage"] for e in d.log_events() if e.get("event") == "serving.stage" and e.get("node") == "head"]
        assert said[:1] == ["waiting"] and "compiling" in said, said
    finally:
        d.close()
