"""4. weight sync throughput over the fabric link, and 5. the no-op weights check against model size.

4: a multi-GB set of safetensors shards (testbed.weights.generate, plain layout, a bench-only model) on the
head is copied to the worker's fabric address by
   - the project: reconciler.steps.weights.sync_weights (rsync over ssh, aes128-gcm, --partial-dir, the
     manifest check before and after), policy.weights.parallel_streams 1 and 4;
   - `cat SHARDS | ssh worker 'cat > f'`: the raw pipe (OpenSSH default cipher, and aes128-gcm);
   - plain `rsync -a SRC/ worker:DST/` (OpenSSH defaults), as a user would type it.
   All from the head's namespace as `spark`, to 10.232.0.11, strict host keys. The source is in the page cache
   for every method (generated just before); the target is emptied and `sync`ed between runs (not timed).
5: the same model generated as 1, 10 and 48 shards (same total bytes), in sync on both nodes; timed: the no-op
   weights check = observe both nodes over the open sessions + weights_difference (what a reconcile does when
   the weights are in sync), against `sha256sum` of every shard on the worker (what a hash check costs).
"""
from __future__ import annotations

import time
from pathlib import Path

from bench.common import Options, busy_cpu_seconds, on_testbed, save, scratch_dir, summary, write_desired

MODEL, REV = "bench/sync", "3" * 40
KH = "/home/spark/.ssh/bench_fabric_known_hosts"


def _root(node) -> Path:
    return node.model_root / "bench"


def _model_dir(node) -> Path:
    return _root(node) / "plain" / "bench--sync"


def _generate(tb, shards: int, total: int) -> Path:
    from testbed import api
    from testbed.weights import generate
    root = _root(tb.head)
    api.exec_("head", f"rm -rf {root}", user="root", check=True)
    generate(root, MODEL, REV, "plain", shards, total // shards)
    api.exec_("head", f"chown -R spark:spark {root}", user="root", check=True)
    return _model_dir(tb.head)


def _desired(tb, work: Path, streams: int) -> Path:
    repl = {"id: testorg/tiny-moe": f"id: {MODEL}", "layout: hf-cache": "layout: plain",
            f'revision: "{"1" * 40}"': f'revision: "{REV}"',
            "policy:\n": f"policy:\n  weights: {{parallel_streams: {streams}}}\n"}
    for n in tb.nodes:
        repl[f"{n.name}: {n.model_root}/hub"] = f"{n.name}: {_model_dir(n)}"
    return write_desired(tb.desired_state, work / f"weights-{streams}.yaml", repl)


def _clear_target(tb) -> None:
    from testbed import api
    w = tb.workers[0]
    api.exec_(w.name, f"rm -rf {_root(w)} {w.model_root}/bench.cat; sync", user="root", check=True, timeout=300)


def _host_key(tb) -> None:
    import paramiko

    from testbed import api
    w = tb.workers[0]
    entry = paramiko.HostKeys(str(tb.known_hosts)).lookup(w.ssh_host)
    line = "".join(f"{w.fabric_ip} {k} {v.get_base64()}\n" for k, v in entry.items())
    api.exec_("head", f"umask 077; mkdir -p ~/.ssh; cat > {KH}", input=line, check=True)


def _ssh(cipher: str | None) -> str:
    return (f"ssh -o BatchMode=yes -o StrictHostKeyChecking=yes -o UserKnownHostsFile={KH}"
            + (f" -c {cipher}" if cipher else ""))


def _timed_exec(cmd: str, timeout: float = 900) -> tuple[float, float]:
    """(seconds, CPU seconds of the whole machine: both ends of the transfer, every process) of one command."""
    from testbed import api
    t, c = time.monotonic(), busy_cpu_seconds()
    api.exec_("head", cmd, check=True, timeout=timeout)
    return time.monotonic() - t, busy_cpu_seconds() - c


def _project_sync(desired_path: Path) -> tuple[float, float]:
    from reconciler import spec
    from reconciler.observed import Observed
    from reconciler.plan import Step
    from reconciler.remote import Sessions
    from reconciler.steps import StepContext
    from reconciler.steps.weights import sync_weights
    desired = spec.load(desired_path)
    sessions = Sessions(desired)
    try:
        ctx = StepContext(desired=desired, sessions=sessions, observed=Observed(nodes={}),
                          deadline=time.monotonic() + 900)
        step = Step(id="weights/worker", kind="weights", node="worker", reason="bench", params={"source": "head"})
        for n in desired.nodes:
            sessions[n.name].run(["true"], timeout=10)  # connect first: not part of the copy
        t, c = time.monotonic(), busy_cpu_seconds()
        sync_weights(ctx, step)
        return time.monotonic() - t, busy_cpu_seconds() - c
    finally:
        sessions.close()


def run_weights(opts: Options) -> dict:
    total = (2 << 30) if not opts.quick else (96 << 20)
    shards, rounds = (8, opts.n(5, 1))
    results: dict[str, list[float]] = {}
    cpu: dict[str, list[float]] = {}
    with on_testbed(2, "converged", worker_disk="6G" if not opts.quick else None) as run:
        tb = run.tb
        work = scratch_dir("weights")
        src = _generate(tb, shards, total)
        nbytes = sum(p.stat().st_size for p in src.iterdir())
        _host_key(tb)
        w = tb.workers[0]
        dst = _model_dir(w)
        files = " ".join(sorted(p.name for p in src.glob("*.safetensors")))
        methods = {
            "project, 4 streams": lambda: _project_sync(_desired(tb, work, 4)),
            "project, 1 stream": lambda: _project_sync(_desired(tb, work, 1)),
            "ssh cat (default cipher)": lambda: _timed_exec(
                f"cd {src} && cat {files} | {_ssh(None)} spark@{w.fabric_ip} 'cat > {w.model_root}/bench.cat'"),
            "ssh cat (aes128-gcm)": lambda: _timed_exec(
                f"cd {src} && cat {files} | {_ssh('aes128-gcm@openssh.com')} spark@{w.fabric_ip} "
                f"'cat > {w.model_root}/bench.cat'"),
            "plain rsync -a": lambda: _timed_exec(
                f"mkdir -p {dst.parent} && rsync -a -e '{_ssh(None)}' {src}/ "
                f"spark@{w.fabric_ip}:{dst}/"),
        }
        from testbed import api
        api.exec_(w.name, f"mkdir -p {_root(w)}/plain && chown -R spark:spark {_root(w)}", user="root",
                  check=True)
        for r in range(rounds):
            for name, fn in methods.items():
                _clear_target(tb)
                api.exec_(w.name, f"mkdir -p {_root(w)}/plain && chown -R spark:spark {_root(w)}",
                          user="root", check=True)
                took, used = fn()
                results.setdefault(name, []).append(took)
                cpu.setdefault(name, []).append(used)
                opts.log(f"weights round {r + 1}: {name}: {nbytes / took / 1e6:.0f} MB/s")
        _clear_target(tb)
        api.exec_("head", f"rm -rf {_root(tb.head)} {KH}", user="root", check=True)
    left = run.leftovers
    rows = {k: {"seconds": summary(v), "mb_per_s": nbytes / summary(v)["median"] / 1e6,
                "mb_per_s_range": [nbytes / max(v) / 1e6, nbytes / min(v) / 1e6],
                "cpu_s_per_gb": summary([c / (nbytes / 1e9) for c in cpu[k]])} for k, v in results.items()}
    proj = rows["project, 4 streams"]["mb_per_s"]
    data = {"bytes": nbytes, "shards": shards, "rows": rows,
            "vs_ssh_cat": proj / rows["ssh cat (default cipher)"]["mb_per_s"],
            "vs_ssh_cat_aes": proj / rows["ssh cat (aes128-gcm)"]["mb_per_s"],
            "vs_plain_rsync": proj / rows["plain rsync -a"]["mb_per_s"],
            "streams_gain": proj / rows["project, 1 stream"]["mb_per_s"], "leftovers": left}
    save(opts, "weights", data)
    return data


def _noop_check(desired_path: Path, repeat: int) -> tuple[list[float], list[float]]:
    from reconciler import spec
    from reconciler.drift import weights_difference
    from reconciler.observe import manifest_script, observe, weights_root
    from reconciler.remote import Sessions
    desired = spec.load(desired_path)
    sessions = Sessions(desired)
    try:
        full, section = [], []
        for i in range(repeat + 2):
            t = time.perf_counter()
            observed, _ = observe(desired, sessions, timeout=60)
            problem = weights_difference(observed.node("head").weights, observed.node("worker").weights)
            took = time.perf_counter() - t
            if problem is not None:
                raise RuntimeError(f"weights not in sync: {problem}")
            t = time.perf_counter()
            sessions["worker"].run_script(manifest_script(weights_root(desired, "worker")), timeout=60)
            if i >= 2:
                full.append(took)
                section.append(time.perf_counter() - t)
        return full, section
    finally:
        sessions.close()


def run_verify(opts: Options) -> dict:
    from testbed import api
    total = (2 << 30) if not opts.quick else (48 << 20)
    repeat = opts.n(20, 2)
    rows = {}
    with on_testbed(2, "converged", worker_disk="6G" if not opts.quick else None) as run:
        tb = run.tb
        work = scratch_dir("verify")
        w = tb.workers[0]
        desired = _desired(tb, work, 4)
        for shards in (1, 10, 48):
            src = _generate(tb, shards, total)
            api.exec_(w.name, f"rm -rf {_root(w)} && mkdir -p {_root(w)}/plain && cp -a {src} {_root(w)}/plain/ "
                      f"&& chown -R spark:spark {_root(w)} && sync", user="root", check=True, timeout=600)
            full, section = _noop_check(desired, repeat)
            t = time.monotonic()
            api.exec_(w.name, f"cd {_model_dir(w)} && sha256sum *.safetensors > /dev/null", check=True, timeout=600)
            sha = time.monotonic() - t
            nbytes = sum(p.stat().st_size for p in src.iterdir())
            rows[shards] = {"bytes": nbytes, "noop_check": summary(full), "manifest_worker": summary(section),
                            "sha256_seconds": sha}
            opts.log(f"verify {shards} shards: no-op check {summary(full)['median'] * 1000:.0f} ms, "
                     f"sha256sum {sha:.1f} s")
        api.exec_(w.name, f"rm -rf {_root(w)}", user="root", check=True)
        api.exec_("head", f"rm -rf {_root(tb.head)}", user="root", check=True)
    left = run.leftovers
    data = {"rows": rows, "leftovers": left}
    save(opts, "verify", data)
    return data
