"""`python -m bench [all|noop|drift|edit|weights|image|verify|footprint|scaling|sim|vllm-start|downtime ...] [--quick]
[--results DIR] [--no-doc]`: run benchmarks on the testbed and write docs/benchmarks.md from bench/results/*.json.

--quick: tiny counts (the smoke test in `make test`); results go to a temp dir (or --results) and the doc is not
touched. Each benchmark takes the testbed lock, brings the testbed up in its shape and down at the end.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

from bench import daemon, downtime, noop, report, sim, vllm_start, weights
from bench.common import RESULTS, Options, testbed_lock

BENCHMARKS = {
    "noop": noop.run_noop,
    "drift": daemon.run_drift,
    "edit": daemon.run_edit,
    "weights": weights.run_weights,
    "image": weights.run_image,
    "verify": weights.run_verify,
    "footprint": daemon.run_footprint,
    "scaling": noop.run_scaling,
    "sim": sim.run_sim,  # after scaling: it replays the probe outputs scaling recorded
    "vllm-start": vllm_start.run_vllm_start,
    "downtime": downtime.run_downtime,
}
#: Minutes of real vLLM starts each: tests/e2e/test_real_vllm.py already checks that it works.
NOT_QUICK = {"vllm-start", "downtime"}


def _run(names: list[str], opts: Options, failed: list[str]) -> None:
    for name in names:
        t = time.monotonic()
        opts.log(f"== {name}{' (quick)' if opts.quick else ''}")
        try:
            BENCHMARKS[name](opts)
        except Exception as exc:  # noqa: BLE001 - report, go on with the others, fail at the end
            import traceback
            traceback.print_exc()
            failed.append(f"{name}: {exc}")
        opts.log(f"== {name} done in {time.monotonic() - t:.0f}s")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n\n")[0])
    p.add_argument("names", nargs="*", default=["all"], help=f"all or any of: {', '.join(BENCHMARKS)}")
    p.add_argument("--quick", action="store_true", help="tiny counts; results to a temp dir; doc untouched")
    p.add_argument("--results", type=Path, default=None, help="where the JSON results go")
    p.add_argument("--no-doc", action="store_true", help="do not rewrite docs/benchmarks.md")
    a = p.parse_args(argv)
    names = [n for n in BENCHMARKS if not (a.quick and n in NOT_QUICK)] if "all" in a.names else a.names
    unknown = [n for n in names if n not in BENCHMARKS]
    if unknown:
        p.error(f"unknown benchmark(s): {', '.join(unknown)}")
    results = a.results or (Path(tempfile.mkdtemp(prefix="bench-quick-")) if a.quick else RESULTS)
    opts = Options(quick=a.quick, results_dir=results)
    failed: list[str] = []
    with testbed_lock():
        # one hold for the whole run, so a pytest session waiting for the testbed cannot slip in between two
        # benchmarks (the benchmarks' own testbed_lock() calls see the variable and do not wait again)
        os.environ["BENCH_TESTBED_LOCK_HELD"] = "1"
        _run(names, opts, failed)
    if not a.quick and not a.no_doc:
        report.write(results)
        opts.log(f"wrote {report.DOC}")
    print(report.table(results))
    if failed:
        print("FAILED: " + "; ".join(failed), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
