"""`make soak`: the heavier randomized reliability runs behind docs/reliability.md (issue 7).

    python bench/soak.py [--trials 20] [--seed 7] [--weights-size 256M] [--storm 50] [--out FILE]

Takes the testbed lock (/run/spark-testbed.lock, like the e2e fixture), brings the testbed up with a larger model,
then runs, with the same helpers as tests/e2e/test_reliability.py:
- crash anywhere: `--trials` kill -9 trials (seeded), alternating step boundaries and random points in time;
- resume: a kill -9 and a SIGTERM in the middle of the weight sync, bytes re-sent measured on the fabric;
- a link-flap storm of `--storm` toggles;
and prints a markdown table (and JSON with --out). Leaves nothing running: the testbed goes down at the end.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import random
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from testbed import api  # noqa: E402
from tests.e2e import test_reliability as rel  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=20)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--weights-size", default="256M")
    p.add_argument("--storm", type=int, default=50, help="link toggles (down+up = 2)")
    p.add_argument("--out", type=Path)
    a = p.parse_args()

    guard = open("/run/spark-testbed.lock", "a")  # noqa: SIM115 - held for the run
    fcntl.flock(guard, fcntl.LOCK_EX)
    results: dict[str, Any] = {"seed": a.seed, "weights_size": a.weights_size, "crash": [], "resume": [], "storm": None}
    try:
        tb = api.up(nodes=2, scenario="seed", weights_size=a.weights_size)
        rng = random.Random(a.seed)
        with tempfile.TemporaryDirectory(prefix="soak-") as tmp:
            for i in range(a.trials):
                work = Path(tmp) / f"crash{i}"
                work.mkdir()
                where = "boundary" if i % 2 == 0 else "random"
                t = time.monotonic()
                r = rel.crash_trial(tb, work, rng, where)
                r["trial_s"] = round(time.monotonic() - t, 1)
                results["crash"].append(r)
                print(f"crash {i + 1}/{a.trials}: {r}", flush=True)
            for sig in (signal.SIGKILL, signal.SIGTERM):
                work = Path(tmp) / f"resume-{sig.name}"
                work.mkdir()
                r = rel.sync_resume_trial(tb, work, sig)
                results["resume"].append(r)
                print(f"resume: {r}", flush=True)
            results["storm"] = storm(tb, Path(tmp) / "storm", a.storm)
            print(f"storm: {results['storm']}", flush=True)
    finally:
        left = api.down()
        guard.close()
    print(table(results))
    if a.out:
        a.out.write_text(json.dumps(results, indent=1))
    return 1 if left else 0


def storm(tb: api.Testbed, work: Path, toggles: int) -> dict[str, object]:
    work.mkdir()
    tb.reset("converged")
    desired = rel.write_desired(work / "cluster.yaml")
    d = rel.daemon(desired, work / "state")
    try:
        rel.converged(d, 120)
        before = {k: rel.steps_run(d, k) for k in ("start-serving", "stop-serving", "link")}
        t = time.monotonic()
        tb.fault("link-flap", "worker", count=toggles // 2, interval=0.4)
        flap = time.monotonic() - t
        rel.converged(d, 120, since=time.time())
        recovered = time.monotonic() - t - flap
        after = {k: rel.steps_run(d, k) for k in before}
        rel.assert_nothing_lost(tb, d)
        return {"toggles": toggles, "storm_s": round(flap, 1), "recovered_s": round(recovered, 1),
                "steps": {k: after[k] - before[k] for k in after},
                "daemon_alive": d.proc is not None and d.proc.poll() is None}
    finally:
        d.close()


def table(r: dict[str, Any]) -> str:
    crash = r["crash"]
    rec = [c["recovered_s"] for c in crash]
    lines = ["| fault | trials | detected after | recovered after | data lost |", "|---|---|---|---|---|"]
    if rec:
        lines.append(f"| kill -9 anywhere (seed {r['seed']}) | {len(crash)} | n/a (restart) | median "
                     f"{statistics.median(rec):.1f} s, max {max(rec):.1f} s | none |")
    for x in r["resume"]:
        lines.append(f"| {x['signal']} mid-sync ({x['total']} B) | 1 | - | re-sent {x['resent_after']} B "
                     f"after {x['sent_before']} B | none |")
    if r["storm"]:
        s = r["storm"]
        lines.append(f"| link flap x{s['toggles']} in {s['storm_s']} s | 1 | - | {s['recovered_s']} s after; "
                     f"steps {s['steps']} | none |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
