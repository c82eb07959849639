"""2. drift detection latency, 3. edit-to-first-step latency, 6. idle footprint: the daemon as a real process.

The daemon runs as `reconciler run FILE --state-dir DIR --listen 127.0.0.1:PORT --log-format json`; a reader
thread stamps every JSON log line of its stderr with time.monotonic() on arrival (pipe latency is microseconds).

Definitions (docs/benchmarks.md repeats them):
  detection latency = from the instant before the fault is injected (testbed.api.fault called) to the arrival of
      the daemon's `reconcile.plan` log line that follows (a reconcile observed the drift and planned the fix);
      it includes the fault's own injection (an nsenter/docker call, a few ms), the event delivery over SSH, one
      probe of every node, diff and plan. Alternative: the same daemon with `--no-events` and resync 5 s.
  edit-to-first-step = from the return of os.replace() of the edited file (an editor's atomic save) to the
      arrival of the first `step.start` log line. Alternative: what a user without the daemon runs after the
      edit: `reconciler apply FILE --yes`, from process start to its first `step.start`.
"""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.common import (
    ROOT,
    Options,
    Result,
    on_testbed,
    rss_bytes,
    save,
    scratch_dir,
    summary,
    write_desired,
)
from testbed.proc import free_port

RECONCILER = ROOT / ".venv" / "bin" / "reconciler"


#: One line of the daemon's JSON log (event, phase, steps_started, ...).
LogLine = dict[str, Any]


class Daemon:
    def __init__(self, desired: Path, events: bool = True):
        self.dir = scratch_dir("daemon")
        self.port = free_port()
        argv = [str(RECONCILER), "run", str(desired), "--state-dir", str(self.dir / "state"),
                "--listen", f"127.0.0.1:{self.port}", "--log-format", "json"]
        if not events:
            argv.append("--no-events")
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self.lines: list[tuple[float, LogLine]] = []
        self.cond = threading.Condition()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.proc.stderr is not None    # stderr=PIPE
        for raw in self.proc.stderr:
            now = time.monotonic()
            try:
                doc = json.loads(raw)
            except ValueError:
                doc = {"event": "raw", "text": raw.rstrip()}
            with self.cond:
                self.lines.append((now, doc))
                self.cond.notify_all()

    def mark(self) -> int:
        with self.cond:
            return len(self.lines)

    def wait(self, pred: Callable[[LogLine], bool], after: int = 0, timeout: float = 60) -> tuple[float, LogLine]:
        deadline = time.monotonic() + timeout
        with self.cond:
            i = after
            while True:
                while i < len(self.lines):
                    t, doc = self.lines[i]
                    i += 1
                    if pred(doc):
                        return t, doc
                left = deadline - time.monotonic()
                if left <= 0 or self.proc.poll() is not None:
                    tail = [d.get("event") for _, d in self.lines[-15:]]
                    raise TimeoutError(f"daemon: no matching log line within {timeout}s; last events {tail}")
                self.cond.wait(min(left, 0.5))

    def event(self, name: str) -> Callable[[LogLine], bool]:
        return lambda d: d.get("event") == name

    def converged_after(self, after: int, timeout: float = 120) -> float:
        t, _ = self.wait(lambda d: d.get("event") == "reconcile.end" and d.get("phase") == "Converged"
                         and d.get("steps_started", 0) == 0 and d.get("drift", 0) == 0, after, timeout)
        return t

    def status(self) -> dict[str, Any]:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/status", timeout=5) as r:
            doc: dict[str, Any] = json.loads(r.read())
            return doc

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        subprocess.run(["rm", "-rf", str(self.dir)], check=False)


def _quiet(d: Daemon, seconds: float = 1.0) -> None:
    """Wait until no log line arrived for `seconds` (bounded: 60 s)."""
    end = time.monotonic() + 60
    while time.monotonic() < end:
        n = d.mark()
        time.sleep(seconds)
        if d.mark() == n:
            return


# -- 2. drift detection ------------------------------------------------------------------------------------------

FAULTS = {"kill-serving": ("kill-container", {"name": "vllm_serving"}), "link-down": ("link-down", {})}


def _serving_up(timeout: float = 120) -> None:
    """Wait until both ranks' serving containers run. A fault can take one down later than the daemon's last
    `converged` (a rank that loses the fabric exits after its peer timeout); the next trial must start from a
    serving cluster, or it measures nothing (and a kill finds no process)."""
    from testbed import api, dockerd
    lay = api.current_layout()
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        states = [dockerd.docker(lay.node(n), "inspect", "--format", "{{.State.Running}}", "vllm_serving",
                                 check=False).stdout.strip() for n in ("head", "worker")]
        if states == ["true", "true"]:
            return
        time.sleep(0.2)
    raise TimeoutError(f"serving not running on both nodes within {timeout:.0f} s")


def _detect(opts: Options, desired: Path, events: bool, trials: int, jitter: float) -> dict[str, list[float]]:
    from testbed import api
    from testbed.proc import TestbedError
    out: dict[str, list[float]] = {k: [] for k in FAULTS}
    d = Daemon(desired, events=events)
    try:
        d.converged_after(0, timeout=180)
        for i in range(trials):
            for name, (kind, kw) in FAULTS.items():
                for attempt in range(3):
                    _serving_up()
                    _quiet(d, 0.5)
                    time.sleep(random.uniform(0, jitter))
                    mark = d.mark()
                    t0 = time.monotonic()
                    try:
                        api.fault(kind, "worker", **kw)
                        break
                    except TestbedError as exc:  # the rank exited in the jitter: the last link fault's peer
                        if attempt == 2:  # timeout, after `converged` (the daemon repairs it): start again
                            raise
                        opts.log(f"drift[{'events' if events else 'resync'}] {name} #{i + 1}: {exc}; again")
                t1, _ = d.wait(d.event("reconcile.plan"), mark, timeout=30)
                out[name].append(t1 - t0)
                d.converged_after(mark, timeout=120)
                opts.log(f"drift[{'events' if events else 'resync'}] {name} #{i + 1}: {t1 - t0:.3f}s")
    finally:
        d.stop()
    return out


def run_drift(opts: Options) -> Result:
    trials, resync_trials = opts.n(10, 1), opts.n(5, 1)
    with on_testbed(2, "converged", serving=True) as run:
        tb = run.tb
        work = scratch_dir("drift")
        push = write_desired(tb.desired_state, work / "push.yaml")
        slow = write_desired(tb.desired_state, work / "resync.yaml", {"resync_interval: 30s": "resync_interval: 5s"})
        events = _detect(opts, push, True, trials, jitter=1.0)
        resync = _detect(opts, slow, False, resync_trials, jitter=5.0)
    left = run.leftovers
    data = {"events": {k: summary(v) for k, v in events.items()},
            "resync_5s": {k: summary(v) for k, v in resync.items()},
            "raw": {"events": events, "resync_5s": resync}, "leftovers": left}
    save(opts, "drift", data)
    return data


# -- 3. edit to first step ---------------------------------------------------------------------------------------

def _save_as_editor(path: Path, text: str) -> None:
    tmp = path.with_name("." + path.name + ".swp")
    tmp.write_text(text)
    os.replace(tmp, path)


def run_edit(opts: Options) -> Result:
    trials, apply_trials = opts.n(8, 1), opts.n(5, 1)
    from testbed import api
    with on_testbed(2, "converged", serving=True) as run:
        tb = run.tb
        work = scratch_dir("edit")
        live = write_desired(tb.desired_state, work / "cluster.yaml")
        base = live.read_text()
        names = ["served_model_name: tiny-moe", "served_model_name: tiny-moe-b"]
        rule_on = "head: [vllm_embeddings, reranker]"
        rule_off = "head: [vllm_embeddings]"
        lat: dict[str, list[float]] = {"served_model_name": [], "co_tenant_rule": []}
        d = Daemon(live)
        current = base
        try:
            d.converged_after(0, timeout=180)
            for i in range(trials):
                # a serving change: the name flips back and forth, each save is a new generation
                _quiet(d, 0.5)
                current = current.replace(names[i % 2], names[(i + 1) % 2])
                mark = d.mark()
                _save_as_editor(live, current)
                t0 = time.monotonic()
                t1, doc = d.wait(d.event("step.start"), mark, timeout=30)
                lat["served_model_name"].append(t1 - t0)
                d.converged_after(mark, timeout=120)
                # a co-tenant rule: reranker no longer allowed -> stop-container
                _quiet(d, 0.5)
                mark = d.mark()
                _save_as_editor(live, current.replace(rule_on, rule_off))
                t0 = time.monotonic()
                t1, doc = d.wait(d.event("step.start"), mark, timeout=30)
                lat["co_tenant_rule"].append(t1 - t0)
                d.converged_after(mark, timeout=120)
                mark = d.mark()
                _save_as_editor(live, current)       # allowed again; start it again by hand
                d.converged_after(mark, timeout=60)
                api.exec_("head", "docker start reranker", check=True)
                d.converged_after(mark, timeout=60)
                opts.log(f"edit #{i + 1}: name {lat['served_model_name'][-1]:.3f}s, "
                         f"rule {lat['co_tenant_rule'][-1]:.3f}s")
        finally:
            d.stop()
        # the alternative: edit, then run `reconciler apply --yes` by hand
        manual = []
        for i in range(apply_trials):
            current = current.replace(names[0], names[1]) if names[0] in current else \
                current.replace(names[1], names[0])
            live.write_text(current)
            t0 = time.monotonic()
            p = subprocess.Popen([str(RECONCILER), "apply", str(live), "--yes"], stdout=subprocess.DEVNULL,
                                 stderr=subprocess.PIPE, text=True)
            first = None
            assert p.stderr is not None    # stderr=PIPE
            for raw in p.stderr:
                if first is None and '"step.start"' in raw:
                    first = time.monotonic() - t0
            p.wait(180)
            if first is None:
                raise RuntimeError("reconciler apply ran no step")
            manual.append(first)
            opts.log(f"edit: manual apply #{i + 1}: first step after {first:.3f}s")
    left = run.leftovers
    data = {"daemon": {k: summary(v) for k, v in lat.items()}, "manual_apply": summary(manual),
            "raw": {**lat, "manual_apply": manual}, "leftovers": left}
    save(opts, "edit", data)
    return data


# -- 6. footprint ------------------------------------------------------------------------------------------------

def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_footprint(opts: Options) -> Result:
    duration = opts.n(300, 5)
    with on_testbed(2, "converged", serving=True) as run:
        tb = run.tb
        d = Daemon(tb.desired_state, events=True)     # testbed.yaml: resync 30 s, event streams on
        try:
            d.converged_after(0, timeout=180)
            _quiet(d, 1.0)
            pid = d.proc.pid
            rss, cpu0, t0 = [], _cpu_seconds(pid), time.monotonic()
            mark = d.mark()
            while time.monotonic() - t0 < duration:
                rss.append(rss_bytes(pid))
                time.sleep(min(5.0, max(0.1, duration - (time.monotonic() - t0))))
            wall = time.monotonic() - t0
            cpu = _cpu_seconds(pid) - cpu0
            rss.append(rss_bytes(pid))
            reconciles = sum(1 for _, doc in d.lines[mark:] if doc.get("event") == "reconcile.end")
        finally:
            d.stop()
    left = run.leftovers
    data = {"seconds": wall, "cpu_seconds": cpu, "cpu_percent": 100 * cpu / wall, "rss_max_mb": max(rss) / 1e6,
            "rss_last_mb": rss[-1] / 1e6, "reconciles_while_idle": reconciles, "leftovers": left}
    save(opts, "footprint", data)
    return data
