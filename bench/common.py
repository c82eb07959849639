"""Shared pieces of the benchmarks: the testbed lock, statistics, the machine description, result files.

Every benchmark touches the one testbed of this machine, so `testbed_lock()` takes the same flock as the e2e
fixture (/run/spark-testbed.lock) and `fresh_testbed()` brings the testbed up in a known shape and always down
again. Results go to bench/results/NAME.json (full runs) or a temp dir (--quick); docs/benchmarks.md is
rendered from the full-run files, so each benchmark can be re-run alone.
"""
from __future__ import annotations

import contextlib
import datetime as dt
import fcntl
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any, Unpack

if TYPE_CHECKING:
    from testbed.api import SizeOptions, Testbed

#: A benchmark's result as `save` writes it and docs/benchmarks.md is rendered from it: a JSON document.
Result = dict[str, Any]

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
LOCK = Path("/run/spark-testbed.lock")
PY = sys.executable


@dataclass
class Options:
    quick: bool = False
    results_dir: Path = RESULTS
    log: Callable[[str], None] = field(default=lambda msg: print(msg, file=sys.stderr, flush=True))

    def n(self, full: int, quick: int) -> int:
        return quick if self.quick else full


# -- statistics -------------------------------------------------------------------------------------------------

def pct(values: list[float], p: float) -> float:
    """Nearest-rank percentile (p in 0..100) of a non-empty list."""
    s = sorted(values)
    k = max(0, min(len(s) - 1, int(round(p / 100 * len(s) + 0.4999)) - 1))
    return s[k]


def summary(values: list[float]) -> dict[str, float]:
    return {"n": len(values), "median": statistics.median(values), "p95": pct(values, 95),
            "min": min(values), "max": max(values)}


def busy_cpu_seconds() -> float:
    """CPU seconds the whole machine has spent busy (/proc/stat: user, nice, system, irq, softirq): on this one
    VM that is both ends of a transfer, every process of it, plus what idles beside it (a few ms per second)."""
    fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    user, nice, system, _idle, _iowait, irq, softirq = (int(x) for x in fields[:7])
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


def transfer_cpu_seconds() -> float:
    """CPU seconds spent so far by the processes a transfer runs, on both ends and nothing else: every testbed
    node's SSH sessions and `exec` commands (their cpuacct cgroups: a sender, an ssh client, sshd's cipher, the
    receiving rsync, the daemon helper; the exited ones included), plus this process itself (the project's SSH
    client). Unlike `busy_cpu_seconds`, it leaves out the kernel threads that write the nodes' loop-mounted
    filesystems back (on a Spark: an NVMe queue), the containers, and whatever else runs on the VM."""
    from testbed import api, memory
    t = os.times()
    nodes = [memory.cpu_seconds(n) for n in api.current_layout().nodes]
    if any(n is None for n in nodes):
        raise RuntimeError("the testbed has no per-node CPU accounting (cgroup v1 cpuacct)")
    return t.user + t.system + sum(n or 0.0 for n in nodes)


def rss_bytes(pid: int | str = "self") -> int:
    """A process's resident memory now (/proc/PID/status VmRSS), 0 if it is gone."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def ratio(a: float, b: float) -> float | None:
    return a / b if b else None


# -- the testbed ------------------------------------------------------------------------------------------------

@contextlib.contextmanager
def testbed_lock(timeout: float = 1800) -> Iterator[None]:
    """The machine-wide testbed lock (the e2e fixture takes the same one). Waits, bounded.

    BENCH_TESTBED_LOCK_HELD=1: the parent already holds it (the pytest smoke test runs us under its session
    fixture's lock); taking it again from here would wait for ourselves."""
    if os.environ.get("BENCH_TESTBED_LOCK_HELD") == "1":
        yield
        return
    LOCK.parent.mkdir(parents=True, exist_ok=True)
    handle = open(LOCK, "a")  # noqa: SIM115

    def expired(_sig: int, _frame: FrameType | None) -> None:
        raise TimeoutError(f"{LOCK} held by someone else for {timeout:.0f}s")

    # a blocking flock queues us with the other waiters (pytest sessions); SIGALRM bounds the wait
    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(int(timeout))
    try:
        fcntl.flock(handle, fcntl.LOCK_EX)
    except BaseException:
        handle.close()
        raise
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    try:
        yield
    finally:
        handle.close()


def testbed_up(nodes: int = 2, scenario: str = "converged", **kw: Unpack[SizeOptions]) -> Testbed:
    """Bring the testbed up in exactly this shape: down first when another shape is up."""
    from reconciler.core.spec import parse_size
    from testbed import api
    cfg = api._load_config()
    if cfg and (cfg["nodes"] != nodes or any(cfg.get(k) != parse_size(v, short_units=True) for k, v in kw.items()
                                              if isinstance(v, str | int))):
        api.down()
    return api.up(nodes=nodes, scenario=scenario, **kw)


def testbed_down() -> list[str]:
    from testbed import api
    return api.down()


class TestbedRun:
    """What `on_testbed` hands a benchmark: the testbed, and afterwards what `down` left behind (must be [])."""

    def __init__(self) -> None:
        self._tb: Testbed | None = None
        self.leftovers: list[str] = []

    @property
    def tb(self) -> Testbed:
        """The testbed the benchmark runs on (set before `on_testbed` hands the run over)."""
        if self._tb is None:
            raise RuntimeError("the testbed is not up yet")
        return self._tb

    @tb.setter
    def tb(self, tb: Testbed) -> None:
        self._tb = tb


@contextlib.contextmanager
def on_testbed(nodes: int = 2, scenario: str = "converged", serving: bool = False,
               **kw: Unpack[SizeOptions]) -> Iterator[TestbedRun]:
    """Lock the testbed, bring it up in `scenario` (with `serving`: converged by `reconciler apply`, so vLLM runs),
    run the benchmark, and always bring it down again."""
    run = TestbedRun()
    with testbed_lock():
        try:
            run.tb = tb = testbed_up(nodes, scenario, **kw)
            if serving:
                converge(tb.desired_state)
            yield run
        finally:
            run.leftovers = testbed_down()


def converge(desired: Path, timeout: float = 180) -> float:
    """`reconciler apply FILE --yes` (starts serving on a `converged`-scenario testbed); returns seconds."""
    t = time.monotonic()
    p = subprocess.run([str(ROOT / ".venv" / "bin" / "reconciler"), "apply", str(desired), "--yes"],
                       capture_output=True, text=True, timeout=timeout, check=False)
    if p.returncode != 0:
        raise RuntimeError(f"reconciler apply failed ({p.returncode}): {(p.stderr + p.stdout)[-2000:]}")
    return time.monotonic() - t


def write_desired(src: Path, dest: Path, replace: dict[str, str] | None = None) -> Path:
    text = src.read_text()
    for old, new in (replace or {}).items():
        if old not in text:
            raise ValueError(f"{old!r} not in {src}")
        text = text.replace(old, new)
    dest.write_text(text)
    return dest


# -- machine and results ----------------------------------------------------------------------------------------

def machine() -> dict[str, object]:
    cpu = "unknown"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    mem = 0
    with contextlib.suppress(OSError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem = int(line.split()[1]) * 1024
    return {"cpu": cpu, "cores": os.cpu_count(), "memory_gib": round(mem / 2**30, 1), "commit": commit(),
            "kernel": platform.release(), "python": platform.python_version(),
            "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")}


def commit() -> str:
    """The commit measured; `+changes` when the product, the harness or the testbed differ from it."""
    def git(*argv: str) -> str:
        p = subprocess.run(["git", *argv], cwd=ROOT, capture_output=True, text=True, timeout=30, check=False)
        return p.stdout.strip() if p.returncode == 0 else ""
    head = git("rev-parse", "--short=12", "HEAD") or "unknown"
    return head + ("+changes" if git("status", "--porcelain", "--", "reconciler", "bench/*.py", "testbed") else "")


def save(opts: Options, name: str, data: Result) -> Path:
    opts.results_dir.mkdir(parents=True, exist_ok=True)
    data = {"benchmark": name, "quick": opts.quick, "machine": machine(), **data}
    path = opts.results_dir / f"{name}.json"
    path.write_text(json.dumps(data, indent=1, default=str))
    return path


def scratch_dir(prefix: str) -> Path:
    return Path(tempfile.mkdtemp(prefix=f"bench-{prefix}-"))
