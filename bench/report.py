"""Render bench/results/*.json into docs/benchmarks.md (the table, the machine, and the fixed prose)."""
from __future__ import annotations

import json
from pathlib import Path

from bench.common import ROOT

DOC = ROOT / "docs" / "benchmarks.md"


def _load(results: Path) -> dict[str, dict]:
    out = {}
    for p in sorted(Path(results).glob("*.json")):
        try:
            out[p.stem] = json.loads(p.read_text())
        except ValueError:
            pass
    return out


def ms(x: float) -> str:
    return f"{x * 1000:.0f} ms" if x < 10 else f"{x:.1f} s"


def s2(x: float) -> str:
    return f"{x:.2f} s" if x >= 1 else f"{x * 1000:.0f} ms"


def mp(d: dict) -> str:
    return f"{ms(d['median'])} / {ms(d['p95'])}"


def ok(flag: bool) -> str:
    return "yes" if flag else "**no**"


def rows(r: dict[str, dict]) -> list[list[str]]:
    out = []
    if "noop" in r:
        d = r["noop"]
        a, p, fl = d["ansible"], d["project"], d["floor"]
        out.append(["1 no-op cycle, 2 nodes (p50 / p95)", mp(p), f"Ansible {mp(a)}; floor {mp(fl)}",
                    f"Ansible/project {a['median'] / p['median']:.0f}x; "
                    f"project/floor {p['median'] / fl['median']:.2f}",
                    ">= 50x Ansible; <= 2x floor",
                    f"{ok(a['median'] / p['median'] >= 50)}; {ok(p['median'] / fl['median'] <= 2)}"])
    if "drift" in r:
        d = r["drift"]
        for k, label in (("kill-serving", "killed serving container"), ("link-down", "downed fabric link")):
            e, s = d["events"][k], d["resync_5s"][k]
            out.append([f"2 drift detection, {label} (p50 / p95)", mp(e), f"resync-only (5 s) {mp(s)}",
                        f"{s['median'] / e['median']:.1f}x faster", "< 1 s", ok(e["p95"] < 1)])
    if "edit" in r:
        d = r["edit"]
        for k, label in (("served_model_name", "served_model_name"), ("co_tenant_rule", "co-tenant rule")):
            e, m = d["daemon"][k], d["manual_apply"]
            out.append([f"3 edit -> first step, {label} (p50 / p95)", mp(e), f"manual `reconciler apply` {mp(m)}",
                        f"{m['median'] / e['median']:.1f}x faster", "< 0.5 s", ok(e["p95"] < 0.5)])
    if "weights" in r:
        d = r["weights"]
        rw = d["rows"]
        out.append([f"4 weight sync, {d['bytes'] / 1e9:.1f} GB in {d['shards']} shards (median)",
                    f"{rw['project, 4 streams']['mb_per_s']:.0f} MB/s (4 streams); "
                    f"{rw['project, 1 stream']['mb_per_s']:.0f} MB/s (1)",
                    f"ssh cat {rw['ssh cat (default cipher)']['mb_per_s']:.0f} MB/s "
                    f"(aes128-gcm {rw['ssh cat (aes128-gcm)']['mb_per_s']:.0f}); plain rsync "
                    f"{rw['plain rsync -a']['mb_per_s']:.0f} MB/s",
                    f"{d['vs_ssh_cat']:.2f}x ssh cat; {d['vs_plain_rsync']:.2f}x rsync; streams 4/1 "
                    f"{d['streams_gain']:.2f}x", ">= 0.9x ssh cat; >= 2x rsync",
                    f"{ok(d['vs_ssh_cat'] >= 0.9)}; {ok(d['vs_plain_rsync'] >= 2)}"])
    if "verify" in r:
        d = r["verify"]["rows"]
        keys = sorted(d, key=int)
        big = d[keys[-1]]
        out.append([f"5 no-op weights check, {', '.join(keys)} shards, {big['bytes'] / 1e9:.1f} GB (p50)",
                    " / ".join(ms(d[k]["noop_check"]["median"]) for k in keys),
                    "sha256sum on the worker " + " / ".join(f"{d[k]['sha256_seconds']:.1f} s" for k in keys),
                    f"{big['sha256_seconds'] / big['noop_check']['median']:.0f}x at {keys[-1]} shards",
                    "flat; < 1 s at 48", ok(big["noop_check"]["p95"] < 1)])
    if "footprint" in r:
        d = r["footprint"]
        out.append([f"6 idle footprint over {d['seconds']:.0f} s (events on, resync 30 s)",
                    f"RSS {d['rss_max_mb']:.0f} MB; CPU {d['cpu_percent']:.2f}% of a core", "", "",
                    "RSS < 100 MB; CPU < 1%", f"{ok(d['rss_max_mb'] < 100)}; {ok(d['cpu_percent'] < 1)}"])
    if "scaling" in r:
        d = r["scaling"]["rows"]
        keys = sorted(d, key=int)
        out.append([f"7 no-op cycle, {' / '.join(keys)} nodes (p50)",
                    " / ".join(ms(d[k]["project"]["median"]) for k in keys), "",
                    f"{keys[-1]} vs 2 nodes: {d[keys[-1]]['over_2_nodes']:.2f}x", "near flat",
                    ok(d[keys[-1]]["over_2_nodes"] < 1.5)])
    if "vllm_start" in r:
        d = r["vllm_start"]
        c, w = d["cold"], d["warm"]
        out.append([f"8 real vLLM start -> first completion, TP 1, compile cache kept ({d['runs']} runs, "
                    "p50 / p95)", f"{s2(w['median'])} / {s2(w['p95'])}",
                    f"cold cache {s2(c['median'])} / {s2(c['p95'])}", f"{d['ratio']:.2f}x faster warm",
                    "warm faster", ok(d["ratio"] > 1)])
    return out


HEADER = ["benchmark", "project", "alternative", "ratio", "target", "met"]


def table(results: Path) -> str:
    rs = rows(_load(results))
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    lines += ["| " + " | ".join(c or "" for c in row) + " |" for row in rs]
    return "\n".join(lines) + "\n"


def _details(r: dict[str, dict]) -> str:
    out = []
    if "noop" in r:
        c = r["noop"]["section_ms_head"]
        out.append("Probe sections on the head, each run alone locally (median ms, including one `testbed exec` "
                   "of " + f"{c.get('(exec overhead)', 0)} ms): "
                   + ", ".join(f"{k} {v}" for k, v in c.items() if k != "(exec overhead)") + ".")
    if "verify" in r:
        d = r["verify"]["rows"]
        out.append("No-op weights check by shard count: " + "; ".join(
            f"{k} shards: {mp(v['noop_check'])} (observe both nodes + diff), worker manifest section alone "
            f"{mp(v['manifest_worker'])}" for k, v in sorted(d.items(), key=lambda kv: int(kv[0]))) + ".")
    if "scaling" in r:
        d = r["scaling"]["rows"]
        out.append("Scaling (p50 / p95): " + "; ".join(
            f"{k} nodes: {mp(v['project'])}, testbed up {v['up_seconds']:.0f} s, "
            f"first converge {v['converge_seconds']:.0f} s" for k, v in sorted(d.items(), key=lambda kv: int(kv[0])))
            + ".")
    if "footprint" in r:
        d = r["footprint"]
        out.append(f"Footprint: {d['cpu_seconds']:.2f} CPU s over {d['seconds']:.0f} s, "
                   f"{d['reconciles_while_idle']} resync reconciles while idle, RSS last {d['rss_last_mb']:.0f} MB.")
    if "vllm_start" in r:
        d = r["vllm_start"]
        out.append(f"Real vLLM starts (bench/vllm_start.py): cold {d['cold']['min']:.0f}-{d['cold']['max']:.0f} s, "
                   f"warm {d['warm']['min']:.0f}-{d['warm']['max']:.0f} s; the kept cache is "
                   f"{d['cache_mb']:.0f} MB.")
    return "\n\n".join(out)


def write(results: Path) -> None:
    r = _load(results)
    m = next(iter(r.values()))["machine"] if r else {}
    dates = sorted({v["machine"]["date"] for v in r.values()})
    text = PROSE.format(
        machine=f"{m.get('cpu')}, {m.get('cores')} cores, {m.get('memory_gib')} GiB, Linux {m.get('kernel')}, "
                f"Python {m.get('python')}",
        dates=", ".join(dates) if dates else "never", table=table(results), details=_details(r))
    DOC.write_text(text)


PROSE = """# Benchmarks

Generated by `python -m bench all` (`make bench`) from `bench/results/*.json`; do not edit the tables by hand:
re-run a benchmark (`python -m bench noop`, ...) and the doc is rewritten. Every benchmark runs on the simulated
testbed (docs/testbed.md), measures the project and the alternative a user would reach for **in the same run**,
and reports the median (p50) and p95. `python -m bench all --quick` (run by tests/e2e/test_bench_smoke.py in
`make test`) uses tiny counts, checks only that the numbers are sane, and leaves this file alone.

**Machine:** {machine}. **Run:** {dates}. One VM: the "nodes" are network namespaces on the same 2 cores, so
every SSH hop, docker CLI and rsync competes for the same CPUs; numbers are comparable with each other, not
with real Sparks (see the end).

## Results

"project" is the product as it is in `reconciler/`. Its probe asks docker through the API socket instead of
starting the docker CLI two or three times per cycle (`reconciler/observe.py`, see the profile below); the first
full run, before that change, measured the no-op cycle at 85 / 94 ms (38x Ansible, target missed) and
83 / 137 / 257 ms at 2 / 4 / 8 nodes. The table below is the product with the change.

{table}
{details}

## What is measured, exactly

1. **No-op cycle**: in-process, sessions already open (as in the daemon): `observe()` of every node (one
   batched probe per node, in parallel, the worker through the head) + `drift` + `plan`; the plan must be empty
   (the benchmark fails otherwise). >= 100 cycles after 3 warm-ups. *Ansible*: `ansible-playbook` (ansible-core,
   `gather_facts: false`, pipelining on, OpenSSH ControlPersist so connections are reused like ours) running the
   same checks as tasks (docker ps, image inspect, `ip -j addr`, meminfo, the weights `find`, /health,
   /v1/models) over the same SSH: the testbed key and known_hosts, `StrictHostKeyChecking yes`, the worker via
   `ProxyJump head`; 10 runs after one that opens the masters. *Floor*: the same `probe_script()` run locally
   on both nodes at once with `testbed exec` (nsenter, no SSH) + parsing; it includes 5-12 ms of
   nsenter/setpriv start-up per node, which is why it is not lower than the SSH path on 2 cores.
2. **Drift detection latency**: the daemon (`reconciler run ... --listen 127.0.0.1:PORT --log-format json`,
   event streams on) on a converged cluster. t0 = the instant before `testbed.api.fault()` is called
   (`kill-container vllm_serving` = SIGKILL of the container's main process on the worker, or `link-down` of the
   worker's fabric port); t1 = arrival of the daemon's next `reconcile.plan` JSON log line on its stderr (a
   reconcile has observed the drift and planned its repair). It includes the fault injection itself (a few ms),
   the docker/`ip monitor` event over the SSH channel, one probe of every node, diff and plan. Between trials
   the daemon repairs the fault and the harness waits for a `reconcile.end` with phase Converged and nothing
   left; a random 0-1 s pause precedes each injection. *Alternative*: the same daemon with `--no-events` and
   `resync_interval: 5s` (random 0-5 s pause, so faults land anywhere in the resync period).
3. **Edit-to-first-step**: the daemon watches a copy of the desired state; the harness saves an edit the way
   editors do (write a temp file, `os.replace`). t0 = `os.replace` returned; t1 = arrival of the first
   `step.start` log line (`stop-serving/...` for `served_model_name`, `stop-container/head/reranker` when
   `reranker` is removed from `co_tenants.allowed.head`). *Alternative*: the same edit, then `reconciler apply
   FILE --yes` by hand: process start to its first `step.start` (Python start-up, connect, observe, plan).
4. **Weight sync**: a bench-only model (`bench/sync`, plain layout, 8 safetensors shards from
   `testbed.weights.generate`) on the head is copied to the worker's fabric address 10.232.0.11 from the head's
   namespace as `spark`: the project's `weights` step (`sync_weights`, rsync over ssh with aes128-gcm,
   `--partial-dir`, manifest check before and after; `policy.weights.parallel_streams` 4 and 1), against
   `cat SHARDS | ssh worker 'cat > f'` (OpenSSH's default cipher, and aes128-gcm) and plain `rsync -a SRC/
   worker:DST/`. The source is in the page cache for every method; the target is removed and `sync`ed between
   runs (not timed). The worker's model filesystem is a loop ext4 made 6 GiB for this run
   (`worker_disk="6G"`); everything is deleted afterwards.
5. **No-op weights check**: the same model generated as 1, 10 and 48 shards of the same total size, copied to
   the worker (`cp -a`), then 20 times: `observe()` of both nodes + `weights_difference()` (what a reconcile
   does when weights are in sync), and the worker's manifest section alone. *Alternative*: `sha256sum` of every
   shard on the worker (page cache warm: the most favourable case for hashing).
6. **Footprint**: the daemon on `STATE/testbed.yaml` (resync 30 s, docker and link event streams on), idle on a
   converged cluster: RSS sampled every 5 s from /proc/PID/status, CPU = utime+stime delta / wall time, over
   5 minutes (5 s in quick mode). The node side (one `docker events` + `ip monitor` per node) is not counted.
7. **Scaling**: the no-op cycle of benchmark 1 with 2, 4 and 8 nodes (`testbed up --nodes N --scenario converged` then
   `reconciler apply`), 30 cycles each.
8. **Real vLLM start, compile cache kept** (`python -m bench vllm-start`, not in `--quick`): the real vLLM 0.32.0
   CPU build (testbed/realvllm) on the head, TP 1, torch.compile on, from `docker run` to the first answered
   completion; cold = an empty `/root/.cache/vllm` each run, warm = the directory a cold run filled, kept on a
   volume (`TORCHINDUCTOR_CACHE_DIR` inside it). Runs alternate cold and warm. What an ordered restart costs
   depends on it: keep `~/.cache/vllm` on a host volume (`serving.docker.volumes`).

## Profile of the no-op cycle, and the fixes

py-spy (8 s, 214 samples) on the benchmark process during the no-op cycles of the first full run: most samples
wait in `Session.run_command` (`select` on the channel, reconciler/remote.py) and paramiko's packetizer, i.e. for
the remote script; parsing, pydantic, drift and plan together are a few percent. An empty script over both open
sessions costs ~15 ms (head 8 ms, worker through the jump host 5 ms, in parallel). So the cycle is the script,
and the script is its process start-ups: in that run the docker CLI sections (containers: `docker ps -aq` +
`docker inspect`; image: `docker image inspect`) were the largest, then the two curls of /health and
/v1/models. The per-section costs above are the current probe's.

1. **Applied**, in reconciler/observe.py (`probe_script` + `parse_containers` + `parse_probe`): the probe asks
   the Docker Engine API on its unix socket instead of starting the Go CLI three times: the socket is
   `${{DOCKER_HOST#unix://}}` (default `/var/run/docker.sock`), containers =
   `curl -sf --unix-socket "$sock" http://docker/containers/json?all=1` (one request; it carries every field
   drift.py uses: `Names`, `Id`, `Image`, `ImageID`, `State`, `Labels`), image =
   `curl -sf --unix-socket "$sock" http://docker/images/REF/json` (`Id`); the CLI commands stay as the
   fallback when the socket request fails (TCP DOCKER_HOST, no curl), and the API bodies carry an `API `
   prefix so the parser tells the two apart. It produces the same Observed: the benchmark asserts an empty
   plan on the converged cluster every cycle.
2. Proposed, not applied (reconciler/ belongs to others) and not measured: fetch /health and /v1/models with
   ONE curl process (two URLs and a `-w` format that prints the status code after each), and drop the `rdma`
   section when `rdma_device` is unset.
3. Measured and **not** proposed: running the sections concurrently inside the script (`&` + `wait`, outputs
   into a temp dir): on 2 cores it was slower (73 vs 68 ms in a 20-cycle trial); on a 20-core Spark it may win.

## Targets missed, and why

- **1, Ansible ratio**: missed by the first full run (~38x the tuned Ansible run, below 50x: the docker CLI
  start-ups in the probe); the table measures the product with the docker API probe (fix 1 above). Within 2x of
  the floor: met in both.
- **4, >= 2x plain rsync**: not reachable on this machine by any rsync-over-ssh design: the raw encrypted pipe
  itself (`ssh -c aes128-gcm 'cat > f'`) is only ~1.7x plain rsync here, and both ends of every stream share
  the same 2 vCPUs, so 4 streams gain little (1.06x) and vary with whatever else runs. The product is at ~0.9x
  of OpenSSH's default-cipher pipe and ~0.7x of the aes128-gcm pipe. Proposed for
  reconciler/steps/weights.py, `_rsync_argv`: add `--whole-file` to the first attempt (no delta pass; the
  issue's earlier measurement: `rsync --whole-file` with aes128-gcm ~ the ssh pipe) but keep the delta
  algorithm when `.rsync-partial/` already holds data (the resume path), and in `sync_weights` cap the
  streams at the source's cores / 2 (`nproc` in the probe), so a small box does not run 16 processes on 2
  cores. Not measured here (time), so no figure with it.
- **7, scaling**: the observation is parallel (one thread and one SSH channel per node), but on this VM all the
  nodes' probe scripts run on the same 2 cores, so their CPU adds up: 8 nodes cost ~3x 2 nodes. The docker API
  probe roughly halved every row against the first full run (83 / 137 / 257 ms) but not the slope. On real
  Sparks each script runs on its own machine; what stays on the head is one paramiko transport per node
  (workers tunnelled through the head's session) and the parsing, ~15 ms for 2 nodes here.

## What changes on real Sparks

- **Link and disks.** The CX-7 link is 200 Gb/s and the models sit on NVMe; here the "link" is a veth pair and
  every byte is encrypted and decrypted by the same 2 vCPUs, so the weight sync is CPU-bound at a few hundred
  MB/s. Published spark-to-spark figures: rsync over the CX-7 link `-a --partial` 404 MB/s and `-a
  --whole-file` 451 MB/s (MiaAI-Lab, DeepSeek-v4.1-Flash-EXL3 PR #3, ~387 GiB shipped); an ssh path 0.30-0.44
  GB/s and a custom fast path 0.55-0.80 GB/s (unsloth PR #10280); TCP iperf3 untuned 96.2 Gbit/s with MTU 9000
  and larger buffers (catharsis.net.au); bonded TCP 33.7 Gbit/s single stream vs 93.0 Gbit/s with 4 streams
  (elizabetht). So on Sparks a single ssh+rsync stream is limited by one core's cipher throughput (~0.4-0.45
  GB/s), far below the link; parallel streams are what use it (the 4-stream gain should be larger there than
  here, where all streams share 2 vCPUs). At ~0.45 GB/s a ~120 GB model takes ~4.5 min per stream.
- **The probe.** A Spark has 20 Arm cores: the script's process start-ups (curl, ip, find) cost less wall
  time, and two nodes never compete for the same CPU, so the no-op cycle should be below the figures here; the
  SSH round trip over the 10 GbE management link is sub-millisecond, negligible either way.
- **No-op weights check** does not read the shards (sizes, mtimes and link targets only), so it stays flat
  with model size on NVMe too; hashing 120 GB is minutes even on NVMe.
"""
