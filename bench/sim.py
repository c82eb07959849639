"""9. The head's own cost of a no-op cycle as the cluster grows: a simulated cluster of up to 64 nodes in-process.

On this machine every testbed "node" shares the head's 2 cores, so wall time at 8 real nodes mostly measures that
(benchmark 7). What grows with the node count on a real head is the daemon's own work per cycle: one thread and
one probe per node, parsing each node's output, drift and plan over all of them. This measures exactly that:
`observe()` + `plan()` over N nodes whose probe answers are **recordings** of real probe outputs (a converged
4-node testbed, recorded by the scaling benchmark of the same run: the head's and a worker's output, each a real
`probe_script` over SSH, kept in bench/results/recordings/), rewritten
for each simulated node (its name in paths, its fabric addresses, its rank's spec hash). The plan must be empty
every cycle, so the rewrite is checked: a node whose recording did not fit would show as drift and fail the run.

Not included: the SSH transport (encryption and packet handling of each node's ~12 KB answer; benchmark 1's
per-node CPU includes it) and the node side. Each size runs in a fresh interpreter so its memory is its own.
"""
from __future__ import annotations

import json
import resource
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, cast

from bench.common import PY, ROOT, Options, Result, rss_bytes, save, scratch_dir, summary
from testbed.recordings import nonce_of, reseal, unseal

if TYPE_CHECKING:
    from reconciler.core.spec import Desired
    from reconciler.edge.ssh import Sessions

RECORDED_NODES = 4  # the testbed the recordings come from: head + worker1..3 (the naming of every size above 2)
TEMPLATE_WORKER = "worker2"


def record(desired_path: Path) -> dict[str, str]:
    """The real probe outputs of a converged testbed, over the daemon's own sessions (kept unsealed)."""
    from reconciler.core import spec
    from reconciler.edge.observe import probe_script
    from reconciler.edge.ssh import Sessions
    desired = spec.load(desired_path)
    sessions = Sessions(desired)
    try:
        scripts = {n.name: probe_script(desired, n) for n in desired.nodes}
        return {n.name: unseal(sessions[n.name].run_script(scripts[n.name].script, timeout=30).stdout,
                               scripts[n.name].nonce) for n in desired.nodes}
    finally:
        sessions.close()


def cluster_yaml(nodes: int, state: Path) -> str:
    from testbed import api
    from testbed.layout import layout
    return api.desired_state(layout(nodes), state=state)


def _hashes(desired: Desired) -> dict[str, str]:
    from reconciler.core.vllm import launch_specs
    return {s.node: s.spec_hash for s in launch_specs(desired)}


def _addresses(desired: Desired, name: str) -> list[str]:
    node = desired.node(name)
    out = [f'"{node.fabric.address.ip}"']
    if node.fabric.twin is not None:
        out.append(f'"{node.fabric.twin.address.ip}"')
    return out


def rewrite(output: str, recorded: Desired, src: str, desired: Desired, dst: str) -> str:
    """A recorded node's probe output as node `dst` of `desired` would answer it in the same (converged) state."""
    swaps = [(f'spec-hash":"{_hashes(recorded)[src]}"', f'spec-hash":"{_hashes(desired)[dst]}"'),
             (f"/{src}/", f"/{dst}/")]
    swaps += zip(_addresses(recorded, src), _addresses(desired, dst), strict=True)
    for old, new in swaps:
        if old not in output:
            raise ValueError(f"{old!r} is not in {src}'s recorded probe output")
        output = output.replace(old, new)
    return output


@dataclass(frozen=True)
class _Answer:
    stdout: str
    stderr: str = ""
    exit_code: int = 0


class _Replay:
    """One node's session, answering every probe with its (rewritten) recording, sealed with the probe's nonce."""

    def __init__(self, output: str) -> None:
        self.output = output

    def run_script(self, script: str, *, timeout: float, cancel: threading.Event | None = None) -> _Answer:
        return _Answer(reseal(self.output, nonce_of(script)))


AREAS = (("reconciler/edge/observe.py", "parse the probe output"), ("reconciler/core/observed.py", "observed models"),
         ("reconciler/core/drift.py", "drift"), ("reconciler/core/planning.py", "plan"),
         ("reconciler/core/vllm.py", "launch specs"),
         ("pydantic", "pydantic models"), ("json", "json"), ("threading", "threads"),
         ("concurrent/futures", "threads"), ("~", "C built-ins called from these (str, re, json scanning)"))


def serial_cycle(desired: Desired, sessions: Sessions) -> None:
    """The cycle's work in this thread (cProfile sees one thread): every node's probe parsed, then the plan."""
    from reconciler.core.observed import Observed
    from reconciler.core.planning import plan
    from reconciler.edge.observe import observe_node
    plan(desired, Observed(nodes={n.name: observe_node(desired, sessions, n) for n in desired.nodes}))


def profile(cycle: Callable[[], object], cycles: int) -> dict[str, float]:
    """Where a cycle's CPU goes (cProfile, own time per area, as shares; the threads of the real cycle aside)."""
    import cProfile
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(cycles):
        cycle()
    prof.disable()
    shares: dict[str, float] = {}
    prof.create_stats()  # what pstats.Stats(prof) reads: the raw table, keyed (filename, line, function)
    stats = prof.stats
    for (filename, _line, _name), (_cc, _nc, tottime, _ct, _callers) in stats.items():
        area = next((label for part, label in AREAS if part in filename), "other")
        shares[area] = shares.get(area, 0.0) + tottime
    total = sum(shares.values()) or 1.0
    return {k: round(v / total, 3) for k, v in sorted(shares.items(), key=lambda kv: -kv[1])}


def child(nodes: int, recording_path: Path, cycles: int) -> Result:
    """In a fresh interpreter: build the N-node cluster, then time `cycles` no-op cycles (wall and CPU)."""
    from reconciler.core import spec
    from reconciler.core.planning import plan
    from reconciler.edge.observe import observe

    rec = json.loads(recording_path.read_text())
    work = recording_path.parent
    (work / "recorded.yaml").write_text(rec["desired"])
    (work / f"sim-{nodes}.yaml").write_text(cluster_yaml(nodes, Path(rec["state"])))
    recorded = spec.load(work / "recorded.yaml")
    desired = spec.load(work / f"sim-{nodes}.yaml")
    head = desired.head.name
    replays = {head: _Replay(rewrite(rec["outputs"][head], recorded, head, desired, head))}
    for n in desired.nodes[1:]:
        replays[n.name] = _Replay(rewrite(rec["outputs"][TEMPLATE_WORKER], recorded, TEMPLATE_WORKER, desired,
                                           n.name))
    before = rss_bytes() // 1024
    # the replays stand in for the pool: observe only asks `sessions[name].run_script(script, timeout=, cancel=)`
    sessions = cast("Sessions", replays)
    walls: list[float] = []
    cpus: list[float] = []
    for i in range(cycles + 3):
        w, c = time.perf_counter(), time.process_time()
        observed, _ = observe(desired, sessions, timeout=20, ask_flags=False)
        result = plan(desired, observed)
        w, c = time.perf_counter() - w, time.process_time() - c
        if result.steps or result.drift:
            raise RuntimeError(f"{nodes} nodes: not a no-op cycle: {[d.as_dict() for d in result.drift][:3]}")
        if i >= 3:
            walls.append(w)
            cpus.append(c)
    return {"nodes": nodes, "wall": summary(walls), "cpu": summary(cpus), "rss_before_kib": before,
            "profile": profile(lambda: serial_cycle(desired, sessions), cycles),
            "rss_after_kib": rss_bytes() // 1024, "rss_peak_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}


def recording_path(opts: Options) -> Path:
    return opts.results_dir / "recordings" / f"probe-{RECORDED_NODES}-nodes.json"


def save_recording(opts: Options, desired_path: Path) -> None:
    """Called by the scaling benchmark on its converged 4-node testbed (no extra testbed start for this one)."""
    path = recording_path(opts)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"desired": desired_path.read_text(), "state": str(desired_path.parent),
                                "outputs": record(desired_path)}, indent=1))


def run_sim(opts: Options) -> Result:
    sizes = [2, 8, 16] if opts.quick else [2, 8, 16, 32, 64]
    cycles = opts.n(30, 3)
    path = recording_path(opts)
    if not path.exists():
        raise RuntimeError(f"no recording at {path}: run the scaling benchmark first (python -m bench scaling sim)")
    work = scratch_dir("sim")
    shutil.copy(path, work / "recording.json")
    rows = {}
    for n in sizes:
        p = subprocess.run([PY, "-m", "bench.sim", str(n), str(work / "recording.json"), str(cycles)],
                           capture_output=True, text=True, timeout=900, cwd=ROOT, check=False)
        if p.returncode != 0:
            raise RuntimeError(f"sim {n} nodes failed: {p.stderr[-2000:]}")
        rows[n] = json.loads(p.stdout)
        opts.log(f"sim {n} nodes: cycle {rows[n]['wall']['median'] * 1000:.1f} ms, "
                 f"CPU {rows[n]['cpu']['median'] * 1000:.1f} ms, RSS {rows[n]['rss_after_kib'] / 1024:.0f} MB")
    shutil.rmtree(work, ignore_errors=True)
    recorded = json.loads(path.read_text())["outputs"]
    data = {"rows": rows, "recorded_bytes": {k: len(v) for k, v in recorded.items()}, "leftovers": []}
    save(opts, "sim", data)
    return data


if __name__ == "__main__":
    print(json.dumps(child(int(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]))))
