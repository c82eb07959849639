"""start-serving, launch-model and await-health: the start of vLLM on each node and the wait for it to serve.

start-serving and launch-model run over the sample (desired-state/cluster.yaml: two GB10 nodes, 121.6 GiB of
MemTotal as `/proc/meminfo` says on a DGX Spark); await-health over the recorded testbed (its head's API as the
probe read it, tests/unit/fixtures/probe-4-nodes.json) and the recorded vLLM cold start's log lines; its end,
serving.verify, over answers shaped as vLLM 0.32.0 shapes them (the real vLLM's garbage, the stand-in's words).
"""

from __future__ import annotations

import json
import shlex
from functools import cache
from typing import Any

from reconciler.core.fabric import rdma_at_start
from reconciler.core.observed import (
    LABEL_INSTANCE,
    LABEL_MANAGED,
    LABEL_SPEC_HASH,
    NodeObservation,
    Observed,
    WeightFile,
    Weights,
)
from reconciler.core.planning import Step
from reconciler.core.spec import Desired
from reconciler.core.vllm import LaunchSpec, at_start, launch_specs
from reconciler.edge.facts.base import Section
from reconciler.edge.ssh import Result
from reconciler.edge.steps.serving import CACHE_DIRS as CACHE_DIRS_SCRIPT
from reconciler.edge.steps.serving import NON_CARRY_OVER_WRITE
from tests.unit.recorded import RAW, load, observe, sections_of
from tests.unit.step_cases import HEAD, WORKER, Case, Raw, inspected, no_such, reachable, sample

NAME = "vllm_serving"
INSTANCE = "10.1.230.180:22"  # the sample head's ssh host:port: this cluster's label while it has no cluster id


@cache
def _spec(node: str = HEAD) -> LaunchSpec:
    """The launch the step must run (core.vllm, pure): its hash, its `docker run`."""
    d = sample()
    spec = next(s for s in launch_specs(d, INSTANCE) if s.node == node)
    return at_start(spec, rdma_at_start(d.node(node), reachable().node(node)))


def ours(state: str = "running", spec_hash: str | None = None, exit_code: int = 0) -> Raw:
    labels = {LABEL_MANAGED: "true", LABEL_INSTANCE: INSTANCE, LABEL_SPEC_HASH: spec_hash or _spec().spec_hash}
    return inspected(NAME, state, labels, exit_code)


def meminfo(available_gib: float) -> Raw:
    """A DGX Spark's /proc/meminfo (MemTotal 121.6 GiB); the sample needs 109.3 GiB available."""
    return Raw(f"MemTotal:       127535224 kB\nMemAvailable:   {int(available_gib * (1 << 20))} kB")


# 0.8 x 127535220 kB = 102028176 kB, + policy.memory_overhead_per_instance (the default 8 GiB) 8388608 kB,
# + policy.memory_margin (the sample's 4 GiB) 4194304 kB
TOTAL_KB, NEED_KB = 127535220, 114611088


def at_need(kib: int = 0) -> Raw:
    """A /proc/meminfo whose MemAvailable is the sample's need to the kB, give or take `kib`."""
    return Raw(f"MemTotal:       {TOTAL_KB} kB\nMemAvailable:   {NEED_KB + kib} kB")


def _kv_cache() -> Desired:
    """The sample with vLLM's KV cache sized in bytes: the need is then the rank's share of the weights (the
    source's tree over tensor_parallel_size 2) + that cache + the margin, not the utilization's pool."""
    d = sample()
    args = [*d.serving.extra_args, "--kv-cache-memory-bytes", str(8 * 2**30)]
    return d.with_deployment(serving=d.serving.model_copy(update={"extra_args": args}))


def _with_weights() -> Observed:
    """The source (the head) holds a 20 GiB model tree: each of the two ranks loads 10 GiB of it."""
    tree = Weights(root="/m", present=True, files=[WeightFile(path="model.safetensors", size=20 * 2**30, mtime=1.0)])
    return Observed(nodes={HEAD: NodeObservation(name=HEAD, reachable=True, weights=tree),
                           WORKER: NodeObservation(name=WORKER, reachable=True)})


def _docker_run_of(d: Desired) -> str:
    spec = next(s for s in launch_specs(d, INSTANCE) if s.node == HEAD)
    return f"run {HEAD} " + shlex.join(["docker", *spec.run_argv(1, env_file="/dev/stdin")])


def _kv_docker_run() -> str:
    return _docker_run_of(_kv_cache())


def _no_compile_cache() -> Desired:
    d = sample()
    return d.with_deployment(serving=d.serving.model_copy(update={"compile_cache": None}))


def _start(node: str = HEAD, after: tuple[str, ...] = ()) -> Step:
    return Step("start-serving", node, "missing", after, rank=0 if node == HEAD else 1)


STOP = Step("stop-serving", HEAD, "restart", (), container=NAME).id
DROP = [f"run {HEAD} sync -f /home/spark/.cache/huggingface/hub",
        f"run {HEAD} sudo /usr/sbin/sysctl -w vm.drop_caches=3"]
CACHE_DIRS = ["/home/spark/.cache/vllm", "/home/spark/.cache/flashinfer", "/home/spark/.triton",
              "/home/spark/.tilelang"]
CACHES = f"run {HEAD} " + shlex.join(["sh", "-c", CACHE_DIRS_SCRIPT, "sh", *CACHE_DIRS])  # run for real: test_trust_low


def docker_run(node: str = HEAD) -> str:
    return f"run {node} " + shlex.join(["docker", *_spec(node).run_argv(1, env_file="/dev/stdin")])


START = [*DROP, f"read {HEAD} meminfo", f"run {HEAD} sh -s", CACHES]  # then `docker run` (docker_run())
STARTED = [f"wait {HEAD} container {NAME}"]
ENOUGH = {f"{HEAD} meminfo": [meminfo(110)]}


def _no_drop() -> Desired:
    d = sample()
    return d.model_copy(update={"policy": d.policy.model_copy(update={"drop_caches": False})})


def _ray() -> Desired:
    d = sample()
    return d.with_deployment(serving=d.serving.model_copy(update={"launcher": "ray"}))


def _launch(wrapper: tuple[str, ...] | None = None) -> Step:
    return Step("launch-model", HEAD, "missing", (), wrapper=wrapper)


# `ray status` in the head container once both nodes joined (the autoscaler's summary, as Ray 2.x prints it)
RAY_JOINED = Raw("======== Autoscaler status: 2026-12-06 10:00:00.000000 ========\nNode status\n"
                 "---------------------------------------------------------------\nActive:\n"
                 " 1 node_6f0d8c3a4b5e2f1a9c7d\n 1 node_1b2c3d4e5f60718293a4\nPending:\n (no pending nodes)\n"
                 "Recent failures:\n (no failures)\n")
RAY_ALONE = Raw(RAY_JOINED.body.replace(" 1 node_1b2c3d4e5f60718293a4\n", ""))
LAUNCH_READ = [f"wait {HEAD} ray {NAME}", f"read {HEAD} vllm-serve {NAME}"]


def _exec_serve(wrapper: tuple[str, ...] = ()) -> str:
    serve = _ray_spec().serve_exec
    assert serve is not None
    return (f"run {HEAD} " + shlex.join(["docker", "exec", "-d", NAME, "sh", "-c",
                                        f"exec {shlex.join((*wrapper, *serve))} >/proc/1/fd/1 2>/proc/1/fd/2"]))


@cache
def _ray_spec() -> LaunchSpec:
    return next(s for s in launch_specs(_ray(), INSTANCE) if s.node == HEAD)


WRITE_LIST = f"run {HEAD} " + shlex.join(["docker", "exec", "-i", NAME, "sh", "-c", NON_CARRY_OVER_WRITE])

# -- await-health, over the recorded testbed ------------------------------------------------------------------
WORKERS = ("worker1", "worker2", "worker3")
_HEAD = sections_of(RAW["outputs"]["head"])
LOADING = "(EngineCore_DP0 pid=9) \rLoading safetensors checkpoint shards:  45% Completed | 9/20\n"
MORE = LOADING + "\rLoading safetensors checkpoint shards:  90% Completed | 18/20\n"


def head(state: str = "running", api: str = "serving", log: str = "", exit_code: int = 0) -> dict[str, Section]:
    """One poll of the head (`facts.serving.start_fact`): its container, its API (the recording's, or not answering
    yet) and its log's tail."""
    container = inspected(NAME, state, exit_code=exit_code)
    sections = {"container": Section(container.body, container.rc), "start_log": Section(log, 0)}
    if api == "serving":
        sections |= {k: _HEAD[k] for k in ("health", "models", "completion", "engine")}
    else:
        sections |= {"health": Section("000", 7), "models": Section("", 0), "completion": Section("", 0),
                     "engine": Section("", 0)}
    return sections


def _health() -> Step:
    return Step("await-health", "head", "health", ())


def _recorded(**kw: Any) -> dict[str, Any]:
    return {"desired": load, "observed": lambda: observe(load()), **kw}


WORKERS_READ = [f"read {w} container {NAME}" for w in WORKERS]
RUNNING = {f"{w} container {NAME}": [inspected(NAME)] for w in WORKERS}

# The Docker Engine API's `GET /containers/vllm_serving/stats?stream=false&one-shot=true` as the testbed's engines
# (cgroup v1) answer it, cut to its memory: `memory_stats.usage` is the cgroup's memory.usage_in_bytes (on DGX OS's
# cgroup v2, memory.current, with `inactive_file` among its stats instead of `cache`). The fields and the formula
# `docker stats` shows (usage - cache on v1, usage - inactive_file on v2) are docs.docker.com's ("Get container
# stats based on resource usage", Engine API v1.44+); the numbers are the stand-in's: gmu 0.05 of the node's 8 GiB
# (429496729 bytes) and its 128 MiB STANDIN_RUNTIME_BYTES, plus its Python.
STATS_V1 = ('{"read":"2026-12-06T10:02:11.504361875Z","preread":"0001-01-01T00:00:00Z","memory_stats":{"usage":'
            '592801792,"max_usage":601882624,"stats":{"active_anon":579289088,"active_file":4112384,"cache":'
            '8486912,"inactive_anon":0,"inactive_file":4374528,"rss":579289088,"total_cache":8486912,'
            '"total_inactive_file":4374528,"total_rss":579289088},"limit":8589934592},"name":"/vllm_serving"}')


def rank_memory(node: str) -> dict[str, Section]:
    """A serving node once its rank answers (`facts.memory.rank_fact`), from the recording: its /proc/meminfo and
    containers as the probe read them, the rank's stats (`STATS_V1`)."""
    seen = sections_of(RAW["outputs"][node])
    return {"meminfo": seen["meminfo"], "containers": seen["containers"], "stats": Section(STATS_V1, 0)}


READINGS = {f"{n} rank {NAME}": [rank_memory(n)] for n in ("head", *WORKERS)}
DONE = ["report serving.done", *(line for n in ("head", *WORKERS)
                                 for line in (f"read {n} rank {NAME}", "report serving.memory",
                                              "report serving.transport"))]

CASES = [
    # -- start-serving
    Case("start-serving: nothing there: caches dropped, memory enough, `served` noted, caches made, run, running",
         _start(), [f"read {HEAD} container {NAME}", *START, docker_run(), *STARTED],
         facts={f"{HEAD} container {NAME}": [no_such(NAME), ours()], **ENOUGH}),
    Case("start-serving: already what we want (running, the same spec hash): nothing run", _start(),
         [f"read {HEAD} container {NAME}"], facts={f"{HEAD} container {NAME}": [ours()]}),
    Case("start-serving: ours, stopped: removed first (no `name already in use`), then started", _start(),
         [f"read {HEAD} container {NAME}", f"run {HEAD} docker rm {NAME}", *START, docker_run(), *STARTED],
         facts={f"{HEAD} container {NAME}": [ours("exited", "0123456789abcdef"), ours()], **ENOUGH}),
    Case("start-serving: ours running another spec: the plan stops it first, nothing run", _start(),
         [f"read {HEAD} container {NAME}"], facts={f"{HEAD} container {NAME}": [ours(spec_hash="0123456789abcdef")]},
         raises="vllm_serving on spark-1a32 runs another spec; the plan stops it first"),
    Case("start-serving: a foreign container holds the name: blocked, nothing run", _start(),
         [f"read {HEAD} container {NAME}"], facts={f"{HEAD} container {NAME}": [inspected(NAME, "exited")]},
         raises="vllm_serving exists and is not ours to replace: vllm_serving on spark-1a32 was not created by the "
                "reconciler", error="StepBlocked"),
    Case("start-serving: another cluster's container holds the name: blocked, with how to adopt it", _start(),
         [f"read {HEAD} container {NAME}"],
         facts={f"{HEAD} container {NAME}": [inspected(NAME, "exited", {LABEL_MANAGED: "true",
                                                                         LABEL_INSTANCE: "10.9.9.9:22"})]},
         raises=r"not ours to replace: .*is not this cluster's \(instance 10.9.9.9:22", error="StepBlocked"),
    Case("start-serving: a protected container holds the name: blocked", _start(), [f"read {HEAD} container {NAME}"],
         facts={f"{HEAD} container {NAME}": [ours("exited")]},
         desired=lambda: _protected(), raises="is protected", error="StepBlocked"),
    Case("start-serving: memory short, no stop before it: blocked at once, nothing started", _start(),
         [f"read {HEAD} container {NAME}", *DROP, f"read {HEAD} meminfo"],
         facts={f"{HEAD} container {NAME}": [no_such(NAME)], f"{HEAD} meminfo": [meminfo(60), meminfo(110)]},
         raises=r"spark-1a32: 60.0 GiB available, but gpu_memory_utilization 0.8 x 121.6 GiB 97.3 GiB \+ "
                r"policy.memory_overhead_per_instance 8.0 GiB \+ policy.memory_margin 4.0 GiB = 109.3 GiB is "
                r"needed$", error="StepBlocked"),
    Case("start-serving: memory short after a stop: waits for it, then deferred (never counted toward holds)",
         _start(after=(STOP,)), [f"read {HEAD} container {NAME}", *DROP, f"read {HEAD} meminfo",
                                 f"wait {HEAD} meminfo"],
         facts={f"{HEAD} container {NAME}": [no_such(NAME)], f"{HEAD} meminfo": [meminfo(60), meminfo(70)]},
         raises=r"spark-1a32: 70.0 GiB available, .* up to 90 s after the stop on spark-1a32 \(GB10 returns a "
                r"stopped generation's memory with a lag\); tried again at the next reconcile",
         error="StepDeferred"),
    Case("start-serving: memory back after a stop: the start goes on", _start(after=(STOP,)),
         [f"read {HEAD} container {NAME}", *DROP, f"read {HEAD} meminfo", f"wait {HEAD} meminfo",
          *START[3:], docker_run(), *STARTED],
         facts={f"{HEAD} container {NAME}": [no_such(NAME), ours()],
                f"{HEAD} meminfo": [meminfo(60), meminfo(80), meminfo(110)]}),
    Case("start-serving: a co-tenant's stop before it settles too", _start(
        after=(Step("stop-container", HEAD, "not allowed", (), container="vllm_node").id,)),
         [f"read {HEAD} container {NAME}", *DROP, f"read {HEAD} meminfo", f"wait {HEAD} meminfo"],
         facts={f"{HEAD} container {NAME}": [no_such(NAME)], f"{HEAD} meminfo": [meminfo(60)]},
         raises="after the stop on spark-1a32", error="StepDeferred"),
    Case("start-serving: a stop on another node does not settle this one: blocked at once",
         _start(after=(Step("stop-serving", WORKER, "restart", (), container=NAME).id,)),
         [f"read {HEAD} container {NAME}", *DROP, f"read {HEAD} meminfo"],
         facts={f"{HEAD} container {NAME}": [no_such(NAME)], f"{HEAD} meminfo": [meminfo(60), meminfo(110)]},
         raises="is needed$", error="StepBlocked"),
    Case("start-serving: /proc/meminfo unanswered fails the step", _start(),
         [f"read {HEAD} container {NAME}", *DROP, f"read {HEAD} meminfo"],
         facts={f"{HEAD} container {NAME}": [no_such(NAME)], f"{HEAD} meminfo": [Raw("", 1)]},
         raises="/proc/meminfo on spark-1a32 did not answer"),
    Case("start-serving: a sudoers without the drop line: said, and the start goes on", _start(),
         [f"read {HEAD} container {NAME}", *DROP, "report serving.drop-caches-refused", *START[2:], docker_run(),
          *STARTED],
         facts={f"{HEAD} container {NAME}": [no_such(NAME), ours()], **ENOUGH},
         results={DROP[1][4:]: [Result("", "sudo: a password is required", 1)]}),
    Case("start-serving: a sync past its deadline does not hold the start", _start(),
         [f"read {HEAD} container {NAME}", DROP[0], "report serving.sync-skipped", *START[1:], docker_run(),
          *STARTED],
         facts={f"{HEAD} container {NAME}": [no_such(NAME), ours()], **ENOUGH},
         results={DROP[0][4:]: [Result("", "", 124)]}),
    Case("start-serving: policy.drop_caches off: nothing dropped", _start(),
         [f"read {HEAD} container {NAME}", *START[2:], docker_run(), *STARTED],
         facts={f"{HEAD} container {NAME}": [no_such(NAME), ours()], **ENOUGH}, desired=_no_drop),
    Case("start-serving: a ledger that cannot be written is said, never a failure of the start", _start(),
         [f"read {HEAD} container {NAME}", *START[:4], "report ledger.unwritten", CACHES, docker_run(), *STARTED],
         facts={f"{HEAD} container {NAME}": [no_such(NAME), ours()], **ENOUGH},
         results={f"{HEAD} sh -s": [Result("", "sh: 1: cannot create /home/spark/.spark-reconciler/copies: "
                                               "Read-only file system", 2)]}),
    Case("start-serving: a compile cache directory that is a link fails the step, naming it, before `docker run`",
         _start(), [f"read {HEAD} container {NAME}", *START],
         facts={f"{HEAD} container {NAME}": [no_such(NAME)], **ENOUGH},
         results={CACHES[4:]: [Result("/home/spark/.cache/vllm\n", "", 3)]},
         raises="^the compile cache directory /home/spark/.cache/vllm on spark-1a32 is a symbolic link: refused, "
                "never followed"),
    Case("start-serving: the compile cache directories not made: the command's failure fails the step", _start(),
         [f"read {HEAD} container {NAME}", *START],
         facts={f"{HEAD} container {NAME}": [no_such(NAME)], **ENOUGH},
         results={CACHES[4:]: [Result("", "mkdir: cannot create directory: Permission denied", 1)]},
         raises="Permission denied", error="CommandFailed"),
    Case("start-serving: the container exits at start: fails with its exit code and last lines", _start(),
         [f"read {HEAD} container {NAME}", *START, docker_run(), *STARTED, f"read {HEAD} logs {NAME}"],
         facts={f"{HEAD} container {NAME}": [no_such(NAME), ours("exited")], **ENOUGH,
                f"{HEAD} logs {NAME}": [Raw("torch.OutOfMemoryError: CUDA out of memory.\n")]},
         raises="vllm_serving on spark-1a32 exited with 0 at start:\ntorch.OutOfMemoryError: CUDA out of memory."),
    Case("start-serving: a container that never shows running fails the step", _start(),
         [f"read {HEAD} container {NAME}", *START, docker_run(), *STARTED],
         facts={f"{HEAD} container {NAME}": [no_such(NAME), ours("created")], **ENOUGH},
         raises="timed out after 60s waiting for vllm_serving to run on spark-1a32"),
    Case("start-serving: `docker run` failing fails the step", _start(),
         [f"read {HEAD} container {NAME}", *START, docker_run()],
         facts={f"{HEAD} container {NAME}": [no_such(NAME)], **ENOUGH},
         results={docker_run()[4:]: [Result("", "docker: Error response from daemon: Conflict. The container name "
                                                "\"/vllm_serving\" is already in use", 125)]},
         raises="is already in use", error="CommandFailed"),
    Case("start-serving: MemAvailable exactly what is needed: the start goes on", _start(),
         [f"read {HEAD} container {NAME}", *START, docker_run(), *STARTED],
         facts={f"{HEAD} container {NAME}": [no_such(NAME), ours()], f"{HEAD} meminfo": [at_need()]}),
    Case("start-serving: after a stop, MemAvailable exactly what is needed at once: no settle", _start(after=(STOP,)),
         [f"read {HEAD} container {NAME}", *START, docker_run(), *STARTED],
         facts={f"{HEAD} container {NAME}": [no_such(NAME), ours()], f"{HEAD} meminfo": [at_need()]}),
    Case("start-serving: after a stop, memory reaching exactly the need ends the settle", _start(after=(STOP,)),
         [f"read {HEAD} container {NAME}", *DROP, f"read {HEAD} meminfo", f"wait {HEAD} meminfo", *START[3:],
          docker_run(), *STARTED],
         facts={f"{HEAD} container {NAME}": [no_such(NAME), ours()],
                f"{HEAD} meminfo": [at_need(-1), at_need(), at_need(-1)]}),
    Case("start-serving: one kB short after the settle: deferred", _start(after=(STOP,)),
         [f"read {HEAD} container {NAME}", *DROP, f"read {HEAD} meminfo", f"wait {HEAD} meminfo"],
         facts={f"{HEAD} container {NAME}": [no_such(NAME)], f"{HEAD} meminfo": [at_need(-1)]},
         raises=r"spark-1a32: 109.3 GiB available, but .* = 109.3 GiB is needed, up to 90 s after the stop",
         error="StepDeferred"),
    Case("start-serving: /proc/meminfo unanswered while settling fails the step, naming the node",
         _start(after=(STOP,)), [f"read {HEAD} container {NAME}", *DROP, f"read {HEAD} meminfo",
                                 f"wait {HEAD} meminfo"],
         facts={f"{HEAD} container {NAME}": [no_such(NAME)], f"{HEAD} meminfo": [meminfo(60), Raw("", 1)]},
         raises="^/proc/meminfo on spark-1a32 did not answer$"),
    Case("start-serving: with --kv-cache-memory-bytes, the need is the rank's share of the observed weights",
         _start(), [f"read {HEAD} container {NAME}", *START, _kv_docker_run()],
         facts={f"{HEAD} container {NAME}": [no_such(NAME)], f"{HEAD} meminfo": [meminfo(60)]},
         results={_kv_docker_run()[4:]: [Result("", "docker: stopped here", 125)]},
         desired=_kv_cache, observed=_with_weights, raises="stopped here", error="CommandFailed"),
    Case("start-serving: with --kv-cache-memory-bytes, short of the share of the weights: said term by term",
         _start(), [f"read {HEAD} container {NAME}", *DROP, f"read {HEAD} meminfo"],
         facts={f"{HEAD} container {NAME}": [no_such(NAME)], f"{HEAD} meminfo": [meminfo(20)]},
         desired=_kv_cache, observed=_with_weights, error="StepBlocked",
         raises=r"^spark-1a32: 20.0 GiB available, but the rank's share of the weights 10.0 GiB \+ "
                r"--kv-cache-memory-bytes 8.0 GiB \+ policy.memory_overhead_per_instance 8.0 GiB \+ "
                r"policy.memory_margin 4.0 GiB = 30.0 GiB is needed$"),
    Case("start-serving: the container dead at start: fails at once with its exit code and last lines", _start(),
         [f"read {HEAD} container {NAME}", *START, docker_run(), *STARTED, f"read {HEAD} logs {NAME}"],
         facts={f"{HEAD} container {NAME}": [no_such(NAME), ours("dead", exit_code=137)], **ENOUGH,
                f"{HEAD} logs {NAME}": [Raw("Killed\n")]},
         raises="^vllm_serving on spark-1a32 exited with 137 at start:\nKilled$"),
    Case("start-serving: no compile cache kept: no directory made before `docker run`", _start(),
         [f"read {HEAD} container {NAME}", *START[:4], _docker_run_of(_no_compile_cache())],
         facts={f"{HEAD} container {NAME}": [no_such(NAME)], **ENOUGH}, desired=_no_compile_cache,
         results={_docker_run_of(_no_compile_cache())[4:]: [Result("", "docker: stopped here", 125)]},
         raises="stopped here", error="CommandFailed"),
    Case("start-serving: a worker starts its own rank", _start(WORKER),
         [f"read {WORKER} container {NAME}", *(line.replace(HEAD, WORKER) for line in START), docker_run(WORKER),
          f"wait {WORKER} container {NAME}"],
         facts={f"{WORKER} container {NAME}": [no_such(NAME), ours()], f"{WORKER} meminfo": [meminfo(110)]}),
    # -- launch-model (the Ray launcher)
    Case("launch-model: every node joined: the non-carry-over list, then `vllm serve` exec'd", _launch(),
         [*LAUNCH_READ, WRITE_LIST, _exec_serve()],
         facts={f"{HEAD} ray {NAME}": [RAY_JOINED], f"{HEAD} vllm-serve {NAME}": [Raw("0")]}, desired=_ray),
    Case("launch-model: under the image's Entrypoint wrapper (NGC's CUDA setup)",
         _launch(("/opt/nvidia/nvidia_entrypoint.sh",)),
         [*LAUNCH_READ, WRITE_LIST, _exec_serve(("/opt/nvidia/nvidia_entrypoint.sh",))],
         facts={f"{HEAD} ray {NAME}": [RAY_JOINED], f"{HEAD} vllm-serve {NAME}": [Raw("0")]}, desired=_ray),
    Case("launch-model: already serving (one `vllm serve`): no exec", _launch(), LAUNCH_READ,
         facts={f"{HEAD} ray {NAME}": [RAY_JOINED], f"{HEAD} vllm-serve {NAME}": [Raw("1")]}, desired=_ray),
    Case("launch-model: a container without `ps` reads as not serving: launched", _launch(),
         [*LAUNCH_READ, WRITE_LIST, _exec_serve()],
         facts={f"{HEAD} ray {NAME}": [RAY_JOINED],
                f"{HEAD} vllm-serve {NAME}": [Raw("sh: 1: ps: not found\n0", 1)]}, desired=_ray),
    Case("launch-model: the worker joins late: waited for", _launch(), [*LAUNCH_READ, WRITE_LIST, _exec_serve()],
         facts={f"{HEAD} ray {NAME}": [Raw("", 1), RAY_ALONE, RAY_JOINED], f"{HEAD} vllm-serve {NAME}": [Raw("0")]},
         desired=_ray),
    Case("launch-model: a node never joins: fails, nothing exec'd", _launch(), LAUNCH_READ[:1],
         facts={f"{HEAD} ray {NAME}": [RAY_ALONE]}, desired=_ray,
         raises=r"timed out after 120s waiting for 2 nodes in `ray status`"),
    # -- await-health
    Case("await-health: serving at the first poll: the other nodes read, the head's poll, done", _health(),
         ["report serving.stage", *WORKERS_READ, f"wait head start {NAME}", *DONE],
         facts={**RUNNING, **READINGS, f"head start {NAME}": [head()]}, **_recorded()),
    Case("await-health: each change of the head's log is reported once, then done", _health(),
         ["report serving.stage", *WORKERS_READ, f"wait head start {NAME}", "report serving.stage",
          *WORKERS_READ, f"wait head start {NAME}", "report serving.progress", *WORKERS_READ,
          f"wait head start {NAME}", *DONE],
         facts={**RUNNING, **READINGS, f"head start {NAME}": [head(api="down"), head(api="down", log=LOADING),
                                                    head(api="down", log=LOADING), head(api="down", log=MORE),
                                                    head(log=MORE)]}, **_recorded()),
    Case("await-health: quiet polls read the other nodes again every few polls", _health(),
         ["report serving.stage", *WORKERS_READ, f"wait head start {NAME}", *WORKERS_READ, f"wait head start {NAME}",
          *DONE],
         facts={**RUNNING, **READINGS, f"head start {NAME}": [*[head(api="down")] * 5, head()]}, **_recorded()),
    Case("await-health: a quiet head is polled five times before the other nodes are read again", _health(),
         ["report serving.stage", *WORKERS_READ, f"wait head start {NAME}", *DONE],
         facts={**RUNNING, **READINGS, f"head start {NAME}": [*[head(api="down")] * 4, head()]}, **_recorded()),
    Case("await-health: a head serving alone polls on: no other node's round ends its wait", _health(),
         ["report serving.stage", f"wait head start {NAME}", "report serving.done", f"read head rank {NAME}",
          "report serving.memory"],
         facts={f"head start {NAME}": [*[head(api="down")] * 5, head()], **READINGS},
         desired=lambda: _alone(load()), observed=lambda: observe(load())),
    Case("await-health: a worker's container exited: fails with its exit code and last lines", _health(),
         ["report serving.stage", *WORKERS_READ, f"wait head start {NAME}", *WORKERS_READ[:1],
          f"read worker1 logs {NAME}"],
         facts={f"worker1 container {NAME}": [inspected(NAME), inspected(NAME, "exited", exit_code=137)],
                **{f"{w} container {NAME}": [inspected(NAME)] for w in WORKERS[1:]},
                f"head start {NAME}": [head(api="down")] * 5, f"worker1 logs {NAME}": [Raw("Killed\n")]},
         raises="^vllm_serving on worker1 is exited \\(exit 137\\) while waiting for health:\nKilled$",
         **_recorded()),
    Case("await-health: the head's container exits while waiting: fails with its last lines", _health(),
         ["report serving.stage", *WORKERS_READ, f"wait head start {NAME}", f"read head logs {NAME}"],
         facts={**RUNNING, f"head start {NAME}": [head(api="down"), head("exited", api="down", exit_code=1)],
                f"head logs {NAME}": [Raw("RuntimeError: NCCL error: unhandled system error\n")]},
         raises="vllm_serving on head is exited \\(exit 1\\) while waiting for health:\nRuntimeError: NCCL error",
         **_recorded()),
    Case("await-health: a worker's container gone: fails at the next read of the workers", _health(),
         ["report serving.stage", *WORKERS_READ, f"wait head start {NAME}", *WORKERS_READ[:1],
          f"read worker1 logs {NAME}"],
         facts={f"worker1 container {NAME}": [inspected(NAME), no_such(NAME)],
                **{f"{w} container {NAME}": [inspected(NAME)] for w in WORKERS[1:]},
                f"head start {NAME}": [head(api="down")] * 5, f"worker1 logs {NAME}": [Raw("")]},
         raises="vllm_serving on worker1 is missing \\(exit None\\) while waiting for health", **_recorded()),
    Case("await-health: never serving within serving.health_timeout: fails naming what it waited for", _health(),
         ["report serving.stage", f"wait head start {NAME}"],
         facts={f"head start {NAME}": [head(api="down")]},
         desired=lambda: _alone(load()), observed=lambda: observe(load()),
         raises=r"timed out after 120s waiting for http://127.0.0.1:8000/health on head, 'tiny-moe' in /v1/models "
                "and one completion"),
    Case("await-health: a node whose reading does not parse is reported as read, unread parts empty", _health(),
         ["report serving.stage", f"wait head start {NAME}", "report serving.done", f"read head rank {NAME}",
          "report serving.memory"],
         facts={f"head start {NAME}": [head()], f"head rank {NAME}": [
             {"meminfo": Section("MemTotal: lots", 0), "containers": Section("API [not json", 0),
              "stats": Section("curl: (7) Couldn't connect to server", 7)}]},
         desired=lambda: _alone(load()), observed=lambda: observe(load())),
]


# -- serving.verify at the end of await-health (issue 52, item 8), over the recorded testbed with a verify declared
VERIFY_KEY = "head verify tiny-moe"
VERIFIED = [*DONE, f"wait {VERIFY_KEY}", "report serving.verify"]


def _verifying(endpoint: str = "completions") -> Desired:
    """The recorded cluster with NVIDIA's playbook check (12*17 -> 204) declared."""
    return load(("  health_timeout: 2m\n", "  health_timeout: 2m\n  verify: {prompt: '12*17=', expect: '\\b204\\b', "
                                             f"endpoint: {endpoint}}}\n"))


def _completion(text: str) -> str:
    """A /v1/completions answer as vLLM 0.32.0 shapes it (tests/unit/core/test_completion_check.py: REAL_ANSWER), the
    greedy `text` given."""
    return json.dumps({"id": "cmpl-aa28977b610327c4", "object": "text_completion", "created": 1796277722,
                       "model": "tiny-moe", "choices": [{"index": 0, "text": text, "logprobs": None,
                                                         "finish_reason": "length", "stop_reason": None,
                                                         "token_ids": None, "prompt_logprobs": None}],
                       "usage": {"prompt_tokens": 6, "total_tokens": 10, "completion_tokens": 4}})


def asked(body: str, code: str = "200", rc: int = 0, owners: str = "0 ") -> dict[str, Section]:
    """One answer to serving.verify's request (`facts.verify.verify_fact`): the serving port's listeners, then curl's
    body and the HTTP code on its own line (`-w '\\n%{http_code}'`), and curl's exit code."""
    return {"port_owner": Section(owners, 0), "verify": Section(f"{body}\n{code}", rc)}


RIGHT = asked(_completion(" 204"))
#: What the real vLLM 0.32.0 CPU build's tiny random Llama answered (test_completion_check.REAL_ANSWER): the
#: garbage a kernel that computes wrong serves with /health 200 and one token answered.
GARBAGE = asked(_completion("ow\ufffd\ufffd{Spar"))
#: What the testbed's stand-in answers every completion: max_tokens words of "stand-in" (testbed/standin).
STANDIN = asked(_completion(" ".join(["stand-in"] * 8)))
ENGINE_DEAD = asked('{"error": {"message": "EngineCore encountered an issue. See stack trace for the root cause.", '
                    '"type": "EngineDeadError", "code": 500}}', "500")
HUNG = asked("", "000", 28)
REFUSED = asked("", "000", 7)
ASKED = "serving.verify on head: completions of '12\\*17=' \\(greedy, at most 8 tokens\\)"
SERVING = {**RUNNING, **READINGS, f"head start {NAME}": [head()]}

VERIFY_CASES = [
    Case("await-health: serving.verify answered right: reported, done", _health(),
         ["report serving.stage", *WORKERS_READ, f"wait head start {NAME}", *VERIFIED],
         facts={**SERVING, VERIFY_KEY: [RIGHT]}, **_recorded(desired=_verifying)),
    Case("await-health: no serving.verify declared: nothing asked after the readings", _health(),
         ["report serving.stage", *WORKERS_READ, f"wait head start {NAME}", *DONE],
         facts={**SERVING, VERIFY_KEY: [GARBAGE]}, **_recorded()),
    Case("await-health: serving.verify answered garbage: reported, fails quoting the answer and the pattern",
         _health(), ["report serving.stage", *WORKERS_READ, f"wait head start {NAME}", *VERIFIED],
         facts={**SERVING, VERIFY_KEY: [GARBAGE]}, **_recorded(desired=_verifying),
         raises=f"^{ASKED} answered 'ow\ufffd\ufffd{{Spar', which does not match '\\\\b204\\\\b'$"),
    Case("await-health: the stand-in's canned words are no 204 either", _health(),
         ["report serving.stage", *WORKERS_READ, f"wait head start {NAME}", *VERIFIED],
         facts={**SERVING, VERIFY_KEY: [STANDIN]}, **_recorded(desired=_verifying),
         raises="answered 'stand-in stand-in stand-in stand-in stand-in stand-in stand-in stand-in', which does "
                "not match"),
    Case("await-health: serving.verify got an error answer: fails with vLLM's message at once", _health(),
         ["report serving.stage", *WORKERS_READ, f"wait head start {NAME}", *VERIFIED],
         facts={**SERVING, VERIFY_KEY: [ENGINE_DEAD, RIGHT]}, **_recorded(desired=_verifying),
         raises=f"^{ASKED} got no text \\(HTTP 500: EngineCore encountered an issue. See stack trace for the root "
                "cause.\\); expected a match of '\\\\b204\\\\b'$"),
    Case("await-health: serving.verify never answered: fails after its wait, saying the last try", _health(),
         ["report serving.stage", *WORKERS_READ, f"wait head start {NAME}", *VERIFIED],
         facts={**SERVING, VERIFY_KEY: [REFUSED, HUNG]}, **_recorded(desired=_verifying),
         raises=f"^{ASKED} got no answer within 120s \\(no answer within 30s\\); expected a match of "),
    Case("await-health: serving.verify asked again while no answer comes, then answered right", _health(),
         ["report serving.stage", *WORKERS_READ, f"wait head start {NAME}", *VERIFIED],
         facts={**SERVING, VERIFY_KEY: [HUNG, REFUSED, RIGHT]}, **_recorded(desired=_verifying)),
    Case("await-health: a chat answer whose content a reasoning model left empty is no answer to check", _health(),
         ["report serving.stage", *WORKERS_READ, f"wait head start {NAME}", *VERIFIED],
         facts={**SERVING, VERIFY_KEY: [asked(json.dumps({"object": "chat.completion", "choices": [
             {"index": 0, "message": {"role": "assistant", "content": None, "reasoning_content": "12 times 17"},
              "finish_reason": "length"}]}))]},
         **_recorded(desired=lambda: _verifying("chat")),
         raises="chat of .* got no text \\(the answer has no content \\(a reasoning model may think past "
                "max_tokens\\)"),
    Case("await-health: a chat answer's content is what is checked", _health(),
         ["report serving.stage", *WORKERS_READ, f"wait head start {NAME}", *VERIFIED],
         facts={**SERVING, VERIFY_KEY: [asked(json.dumps({"object": "chat.completion", "choices": [
             {"index": 0, "message": {"role": "assistant", "content": "12*17 = 204."}}]}))]},
         **_recorded(desired=lambda: _verifying("chat"))),
    Case("await-health: a port held by another user is not asked (the key stays home): fails", _health(),
         ["report serving.stage", *WORKERS_READ, f"wait head start {NAME}", *VERIFIED],
         facts={**SERVING, VERIFY_KEY: [asked("", "000", 0, owners="1000 ")]}, **_recorded(desired=_verifying),
         raises="got no text \\(uid 1000 \\(not root, so not vLLM\\) listens on the serving port: not asked\\)"),
]
CASES += VERIFY_CASES


def _protected() -> Desired:
    d = sample()
    co = d.co_tenants.model_copy(update={"protected": {**d.co_tenants.protected, HEAD: [NAME]}})
    return d.model_copy(update={"co_tenants": co})


def _alone(d: Desired) -> Desired:
    """The file with its head alone (one node serves): no other container to read."""
    return d.model_copy(update={"nodes": [d.head]})



