"""Busy is not wedged, on the testbed (issue 30, finding 1), with the stand-in's vLLM scheduler: `--max-num-seqs 2`
slots, a first-come-first-served queue and 25 tokens per second per sequence.

- Six clients keep every slot full with 150-token generations (6 s each) for three graces: the probe's one-token
  completion waits in the queue past its 5 s deadline on most checks, yet the tokens keep coming, so serving is
  Busy (the condition says so), never restarted, and every client's request is answered.
- The engine then wedges (SIGUSR1: /health still 200, no token ever again, as a rank stuck in a collective): the
  status leaves Converged within two probes of the first failed check, and the pair is restarted in order after
  the grace.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Callable

import pytest

from testbed.proc import wait_for
from tests.e2e.test_loop import serving_ids
from tests.e2e.test_reliability import converged, daemon, serving_ok, write_desired

pytestmark = pytest.mark.e2e

GRACE = 10
RESYNC = 2
TOKENS = 150  # per client request: 6 s at 25 tokens/s, longer than the probe's 5 s deadline


def _busy_cluster(data):
    data["serving"]["unhealthy_grace"] = f"{GRACE}s"
    data["serving"]["extra_args"] = [*data["serving"].get("extra_args", []), "--max-num-seqs", "2"]
    data["serving"]["env"] = {**data["serving"].get("env", {}), "STANDIN_STEPS_PER_S": "25",
                              # a wedged rank waits for its peer as a real one does (NCCL's 10 min)
                              "STANDIN_PEER_TIMEOUT_S": "600"}


def _ask(tb) -> int:
    body = json.dumps({"model": "tiny-moe", "prompt": "load", "max_tokens": TOKENS})
    out = tb.exec("head", f"curl -s -o /dev/null -m 60 -w '%{{http_code}}' -H 'Content-Type: application/json' "
                          f"-d '{body}' http://127.0.0.1:8000/v1/completions").stdout
    return int(out or 0)


def load(ask: Callable[[], int], seconds: float, clients: int = 6) -> tuple[list[int], list[threading.Thread]]:
    """`clients` threads, each asking `ask()` again and again for `seconds` (bounded: the load stops by itself):
    the HTTP codes they got, and the threads to join."""
    answers: list[int] = []
    end = time.monotonic() + seconds

    def client() -> None:
        while time.monotonic() < end:
            answers.append(ask())

    threads = [threading.Thread(target=client, daemon=True) for _ in range(clients)]
    for t in threads:
        t.start()
    return answers, threads


def test_a_busy_cluster_is_left_serving_and_a_wedged_one_is_restarted(seed_testbed, tmp_path):
    tb = seed_testbed.reset("converged")
    desired = write_desired(tmp_path / "cluster.yaml", _busy_cluster, resync_interval=f"{RESYNC}s")
    d = daemon(desired, tmp_path / "state")
    try:
        converged(d, 180)
        before = serving_ids(tb, "head") | serving_ids(tb, "worker")
        answers, clients = load(lambda: _ask(tb), 3 * GRACE)
        wait_for(lambda: (d.condition("head", "ServingBusy") or {}).get("status") == "True", 3 * GRACE,
                 "the status saying Busy")
        busy_seen = d.condition("head", "ServingBusy")
        for c in clients:
            c.join(120)
        assert answers and all(code == 200 for code in answers), answers
        assert serving_ids(tb, "head") | serving_ids(tb, "worker") == before, "a busy cluster is never restarted"
        assert busy_seen["reason"] == "QueueFull" and "waiting" in busy_seen["message"], busy_seen
        converged(d, 60)

        pid = int(tb.docker("head", "inspect", "--format", "{{.State.Pid}}", "vllm_serving").stdout)
        os.kill(pid, signal.SIGUSR1)  # the engine wedges; /health still 200
        wedged_at = time.time()
        # two probes: the first check after the wedge fails on a counter that stands still
        wait_for(lambda: (s := d.status()) and s.get("time", 0) >= wedged_at and s["phase"] != "Converged",
                 3 * RESYNC + 2 * 5 + 3, "the status leaving Converged within two probes")
        assert tb.exec("head", "curl -s -o /dev/null -w '%{http_code}' http://127.0.0.1:8000/health").stdout == "200"
        wait_for(lambda: not serving_ids(tb, "head") <= before, GRACE + 60, "the restart of a wedged engine")
        converged(d, 180)
        assert serving_ok(tb) == []
        restarts = [e for e in d.log_events() if e.get("event") == "step.start" and e.get("kind") == "stop-serving"]
        assert restarts and all("failed its health check" in e.get("reason", "") for e in restarts), restarts
    finally:
        d.close()
