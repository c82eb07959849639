"""4. weight sync throughput over the fabric link, and 5. the no-op weights check against model size.

4: a multi-GB set of safetensors shards (testbed.weights.generate, plain layout, a bench-only model) on the
head is copied to the worker's fabric address by
   - the project: reconciler.edge.steps.weights.sync_weights (the one-time rsync daemon by default, over ssh
     with transport: ssh; --partial-dir, the manifest check before and after), policy.weights.parallel_streams 1
     and 4. Target: >= 0.9x raw TCP in the same run, with CPU <= 1/3 of plain `rsync -a` per GB;
   - `cat SHARDS | ssh worker 'cat > f'`: the raw pipe (OpenSSH default cipher, and aes128-gcm);
   - plain `rsync -a SRC/ worker:DST/` (OpenSSH defaults), as a user would type it.
   All from the head's namespace as `spark`, to 10.232.0.11, strict host keys. The source is in the page cache
   for every method (generated just before); the target is emptied and `sync`ed between runs (not timed).
5: the same model generated as 1, 10 and 48 shards (same total bytes), in sync on both nodes; timed: the no-op
   weights check = observe both nodes over the open sessions + weights_difference (what a reconcile does when
   the weights are in sync), against `sha256sum` of every shard on the worker (what a hash check costs).
"""
from __future__ import annotations

import os
import shlex
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from bench.common import (
    Options,
    Result,
    on_testbed,
    save,
    scratch_dir,
    summary,
    transfer_cpu_seconds,
    write_desired,
)

if TYPE_CHECKING:
    from reconciler.edge.ssh import Sessions
    from reconciler.edge.steps.actions import Actions
    from testbed.api import Testbed
    from testbed.layout import Node

MODEL, REV = "bench/sync", "3" * 40
KH = "/home/spark/.ssh/bench_fabric_known_hosts"


def _root(node: Node) -> Path:
    return node.model_root / "bench"


def _model_dir(node: Node) -> Path:
    return _root(node) / "plain" / "bench--sync"


def _generate(tb: Testbed, shards: int, total: int) -> Path:
    from testbed import api
    from testbed.weights import generate
    root = _root(tb.head)
    api.exec_("head", f"rm -rf {root}", user="root", check=True)
    generate(root, MODEL, REV, "plain", shards, total // shards)
    # on the disk before anything is timed: its writeback would otherwise compete with the first round
    api.exec_("head", f"chown -R spark:spark {root} && sync", user="root", check=True, timeout=300)
    return _model_dir(tb.head)


def _desired(tb: Testbed, work: Path, streams: int, transport: str = "rsync-daemon", bound: bool = True) -> Path:
    repl = {"id: testorg/tiny-moe": f"id: {MODEL}", "layout: hf-cache": "layout: plain",
            f'revision: "{"1" * 40}"': f'revision: "{REV}"',
            "policy:\n": f"policy:\n  weights: {{parallel_streams: {streams}, transport: {transport}, "
                         f"drop_behind: {str(bound).lower()}}}\n"}
    for n in tb.nodes:
        repl[f"{n.name}: {n.model_root}/hub"] = f"{n.name}: {_model_dir(n)}"
    return write_desired(tb.desired_state, work / f"weights-{streams}-{transport}-{bound}.yaml", repl)


def _clear_target(tb: Testbed) -> None:
    from testbed import api
    w = tb.workers[0]
    api.exec_(w.name, f"rm -rf {_root(w)} {w.model_root}/bench.cat; sync", user="root", check=True, timeout=300)


def _host_key(tb: Testbed) -> None:
    import paramiko

    from testbed import api
    w = tb.workers[0]
    entry = paramiko.HostKeys(str(tb.known_hosts)).lookup(w.ssh_host)
    if entry is None:
        raise RuntimeError(f"{tb.known_hosts} has no key of {w.ssh_host}")
    line = "".join(f"{w.fabric_ip} {k} {v.get_base64()}\n" for k, v in entry.items())
    api.exec_("head", f"umask 077; mkdir -p ~/.ssh; cat > {KH}", input=line, check=True)


def _ssh(cipher: str | None) -> str:
    return (f"ssh -o BatchMode=yes -o StrictHostKeyChecking=yes -o UserKnownHostsFile={KH}"
            + (f" -c {cipher}" if cipher else ""))


_RAW_PORT = 47000  # in the worker's own network namespace, which the testbed created

# raw TCP, the floor: the receiver copies the socket into one file on the worker's model filesystem; the sender
# hands the shards to the kernel (sendfile), no user-space copy, no checksum, no cipher
_RAW_RECV = """import socket, sys
s = socket.create_server((sys.argv[1], int(sys.argv[2])))
c, _ = s.accept()
buf = bytearray(1 << 20)
view = memoryview(buf)
with open(sys.argv[3], "wb") as f:
    while n := c.recv_into(buf):
        f.write(view[:n])
"""
_RAW_SEND = """import socket, sys, time
deadline = time.monotonic() + 30
while True:
    try:
        s = socket.create_connection((sys.argv[1], int(sys.argv[2])))
        break
    except ConnectionRefusedError:
        if time.monotonic() > deadline:
            raise
        time.sleep(0.02)
for p in sys.argv[3:]:
    with open(p, "rb") as f:
        s.sendfile(f)
s.close()
"""


def _cpu() -> dict[str, float]:
    """CPU seconds so far: each node's SSH sessions and `exec` commands, and this process (the project's
    client): `transfer_cpu_seconds` split by end."""
    from testbed import api, memory
    t = os.times()
    return {"bench": t.user + t.system, **{n.name: memory.cpu_seconds(n) or 0.0 for n in api.current_layout().nodes}}


def _measured(copy: Callable[[], None], w: Node) -> tuple[float, dict[str, float]]:
    """Seconds and CPU seconds by end of one copy, up to the data on the worker's disk (`sync -f` of its model
    filesystem, for every method alike: the project ends its step with the same)."""
    from testbed import api
    assert transfer_cpu_seconds() >= 0  # the testbed has per-node CPU accounting
    prepare, close = getattr(copy, "prepare", None), getattr(copy, "close", None)
    if prepare:
        prepare()
    try:
        t, c = time.monotonic(), _cpu()
        copy()
        api.exec_(w.name, f"sync -f {w.model_root}", check=True, timeout=300)
        after = _cpu()
        return time.monotonic() - t, {k: after[k] - c[k] for k in c}
    finally:
        if close:
            close()


def _exec(cmd: str, node: str = "head") -> Callable[[], None]:
    from testbed import api

    def run() -> None:
        api.exec_(node, cmd, check=True, timeout=900)
    return run


def _raw_tcp(src: Path, files: str, w: Node) -> Callable[[], None]:
    def copy() -> None:
        from testbed import api
        recv = threading.Thread(target=api.exec_, args=(w.name, f"python3 -c {shlex.quote(_RAW_RECV)} "
                                                        f"{w.fabric_ip} {_RAW_PORT} {w.model_root}/bench.raw"),
                                kwargs={"check": True, "timeout": 900})
        recv.start()
        api.exec_("head", f"cd {src} && python3 -c {shlex.quote(_RAW_SEND)} {w.fabric_ip} {_RAW_PORT} {files}",
                  check=True, timeout=900)
        recv.join(60)
    return copy


def _timing_streams(body: Actions, spans: list[float]) -> Actions:
    """The step's actions passed through unchanged (results sent, errors thrown in), the time of its `Parallel`
    (the rsync streams, from the first byte's connection to the last stream's exit) appended to `spans`: the
    part of the step that moves bytes, next to what the step does around it (probes, helpers, `sync -f`, the
    manifest check)."""
    from reconciler.edge.steps.actions import Parallel
    sent, error = None, None
    while True:
        try:
            action = body.throw(error) if error is not None else body.send(sent)
        except StopIteration:
            return  # a step's actions end with no value (`Actions`)
        sent, error, t = None, None, time.monotonic()
        try:
            sent = yield action
        except BaseException as exc:  # noqa: BLE001 - handed to the step as the executor raised it
            error = exc
        if isinstance(action, Parallel):
            spans.append(time.monotonic() - t)


class _ProjectSync:
    """The project's `weights` step as the daemon runs it: its SSH sessions open before the copy is timed (the
    daemon keeps them open; connecting is not the copy), closed after. `streams` collects each copy's rsync
    streams' own time (`_timing_streams`)."""

    def __init__(self, desired_path: Path):
        self.desired_path = desired_path
        self.sessions: Sessions | None = None
        self.streams: list[float] = []

    def prepare(self) -> None:
        from reconciler.core import spec
        from reconciler.edge.ssh import Sessions
        self.desired = spec.load(self.desired_path)
        self.sessions = sessions = Sessions(self.desired)
        for n in self.desired.nodes:
            sessions[n.name].run(["true"], timeout=10)

    def __call__(self) -> None:
        from reconciler.core.observed import Observed
        from reconciler.core.planning import Step
        from reconciler.edge.steps import StepContext
        from reconciler.edge.steps.weights import sync_weights
        ctx = StepContext(desired=self.desired, sessions=self.open_sessions(), observed=Observed(nodes={}),
                          deadline=time.monotonic() + 900)
        ctx.perform(_timing_streams(sync_weights(ctx.given, Step(kind="weights", node="worker", reason="bench",
                                                                 source="head")), self.streams))

    def open_sessions(self) -> Sessions:
        """The sessions `prepare` opened (before the copy is timed)."""
        if self.sessions is None:
            raise RuntimeError("prepare() opens the sessions before a copy")
        return self.sessions

    def close(self) -> None:
        if self.sessions is not None:
            self.sessions.close()
            self.sessions = None


def run_weights(opts: Options) -> Result:
    total = (2 << 30) if not opts.quick else (96 << 20)
    shards, rounds = (8, opts.n(5, 1))
    results: dict[str, list[float]] = {}
    cpu: dict[str, list[dict[str, float]]] = {}
    with on_testbed(2, "converged", worker_disk="6G" if not opts.quick else None) as run:
        tb = run.tb
        work = scratch_dir("weights")
        src = _generate(tb, shards, total)
        nbytes = sum(p.stat().st_size for p in src.iterdir())
        _host_key(tb)
        w = tb.workers[0]
        dst = _model_dir(w)
        files = " ".join(sorted(p.name for p in src.glob("*.safetensors")))
        methods: dict[str, Callable[[], None]] = {
            "project, 4 streams": _ProjectSync(_desired(tb, work, 4)),
            "project, 4 streams, page cache not bounded": _ProjectSync(_desired(tb, work, 4, bound=False)),
            "project, 1 stream": _ProjectSync(_desired(tb, work, 1)),
            "project over ssh, 4 streams": _ProjectSync(_desired(tb, work, 4, "ssh")),
            "raw TCP": _raw_tcp(src, files, w),
            "ssh cat (default cipher)": _exec(
                f"cd {src} && cat {files} | {_ssh(None)} spark@{w.fabric_ip} 'cat > {w.model_root}/bench.cat'"),
            "ssh cat (aes128-gcm)": _exec(
                f"cd {src} && cat {files} | {_ssh('aes128-gcm@openssh.com')} spark@{w.fabric_ip} "
                f"'cat > {w.model_root}/bench.cat'"),
            "plain rsync -a": _exec(
                f"mkdir -p {dst.parent} && rsync -a -e '{_ssh(None)}' {src}/ spark@{w.fabric_ip}:{dst}/"),
        }
        from testbed import api
        for r in range(rounds):
            for name, copy in methods.items():
                _clear_target(tb)
                api.exec_(w.name, f"mkdir -p {_root(w)}/plain && chown -R spark:spark {_root(w)}",
                          user="root", check=True)
                # the source in the page cache for every method alike (the bounded copy drops it behind itself)
                api.exec_("head", f"cat {src}/* > /dev/null", check=True, timeout=300)
                took, used = _measured(copy, w)
                results.setdefault(name, []).append(took)
                cpu.setdefault(name, []).append(used)
                opts.log(f"weights round {r + 1}: {name}: {nbytes / took / 1e6:.0f} MB/s, "
                         f"{sum(used.values()) / (nbytes / 1e9):.2f} CPU s/GB")
        _clear_target(tb)
        api.exec_("head", f"rm -rf {_root(tb.head)} {KH}", user="root", check=True)
    left = run.leftovers
    gb = nbytes / 1e9
    rows: dict[str, Result] = {k: {"seconds": summary(v), "mb_per_s": nbytes / summary(v)["median"] / 1e6,
                                  "mb_per_s_range": [nbytes / max(v) / 1e6, nbytes / min(v) / 1e6],
                                  "cpu_s_per_gb": summary([sum(c.values()) / gb for c in cpu[k]]),
                                  "cpu_s_per_gb_by_end": {end: summary([c[end] / gb for c in cpu[k]])
                                                          for end in cpu[k][0]}}
                               for k, v in results.items()}
    proj = rows["project, 4 streams"]
    project = methods["project, 4 streams"]
    assert isinstance(project, _ProjectSync)
    proj["streams_alone"] = summary(project.streams)
    proj["streams_mb_per_s"] = nbytes / proj["streams_alone"]["median"] / 1e6
    data: Result = {"bytes": nbytes, "shards": shards, "rows": rows,
            "vs_raw_tcp": proj["mb_per_s"] / rows["raw TCP"]["mb_per_s"],
            "streams_vs_raw_tcp": proj["streams_mb_per_s"] / rows["raw TCP"]["mb_per_s"],
            "bounded_vs_unbounded": proj["mb_per_s"] / rows["project, 4 streams, page cache not bounded"]["mb_per_s"],
            "cpu_vs_rsync": proj["cpu_s_per_gb"]["median"] / rows["plain rsync -a"]["cpu_s_per_gb"]["median"],
            "cpu_vs_ssh_cat_aes": proj["cpu_s_per_gb"]["median"]
            / rows["ssh cat (aes128-gcm)"]["cpu_s_per_gb"]["median"],
            "vs_ssh_cat_aes": proj["mb_per_s"] / rows["ssh cat (aes128-gcm)"]["mb_per_s"],
            "vs_plain_rsync": proj["mb_per_s"] / rows["plain rsync -a"]["mb_per_s"],
            "streams_gain": proj["mb_per_s"] / rows["project, 1 stream"]["mb_per_s"], "leftovers": left}
    save(opts, "weights", data)
    return data


BENCH_IMAGE = "bench-image:1"


class _ProjectImage(_ProjectSync):
    """The project's `image` step (`copy_image`: docker save | ssh -c aes128-gcm | docker load over the fabric)."""

    def __call__(self) -> None:
        from reconciler.core.observed import Observed
        from reconciler.core.planning import Step
        from reconciler.edge.steps import StepContext
        from reconciler.edge.steps.images import copy_image
        ctx = StepContext(desired=self.desired, sessions=self.open_sessions(), observed=Observed(nodes={}),
                          deadline=time.monotonic() + 900)
        ctx.perform(copy_image(ctx.given, Step(kind="image", node="worker", reason="bench", image=BENCH_IMAGE,
                                               source="head")))


def run_image(opts: Options) -> Result:
    """The serving image to the worker: the project's step against docker's own ends (`docker save` to /dev/null
    on the head, `docker load` of a local archive on the worker) and the hop's cipher alone (`ssh cat` of the
    same archive): which of them limits the copy. Target: >= 0.8x the slower docker end. Also timed: `docker
    save` to its first byte, the staging moby does before it streams (image/tarexport/save.go), which gives the
    bound any `save | load` pipeline has against the load alone: load / (staging + load)."""
    from testbed import api
    size, rounds = ((1 << 30) if not opts.quick else (32 << 20)), opts.n(5, 1)
    results: dict[str, list[float]] = {}
    with on_testbed(2, "converged", worker_disk="6G" if not opts.quick else None) as run:
        tb = run.tb
        w = tb.workers[0]
        work = scratch_dir("image")
        _host_key(tb)
        tar_head, tar_worker = f"{tb.head.model_root}/image.tar", f"{w.model_root}/image.tar"
        # one layer of random bytes: incompressible, like the weights and libraries of a serving image
        api.exec_("head", f"d=$(mktemp -d) && head -c {size} /dev/urandom > $d/blob && tar -C $d -cf - blob | "
                  f"docker import - {BENCH_IMAGE} >/dev/null && rm -rf $d && docker save {BENCH_IMAGE} > {tar_head} "
                  f"&& chmod 644 {tar_head} && sync", user="root", check=True, timeout=600)
        nbytes = int(api.exec_("head", f"stat -c %s {tar_head}", check=True).stdout)
        desired = write_desired(tb.desired_state, work / "image.yaml",
                                {'image: "vllm-standin:latest"': f'image: "{BENCH_IMAGE}"'})
        unload = f"docker rmi -f {BENCH_IMAGE} >/dev/null 2>&1; rm -f {tar_worker}; sync"
        methods: dict[str, Callable[[], None]] = {
            "project": _ProjectImage(desired),
            "docker save > /dev/null": _exec(f"docker save {BENCH_IMAGE} > /dev/null"),
            # moby's save stages the whole archive in its temp dir before the first byte leaves (tarexport/save.go):
            # the part of a save that no pipeline can overlap with the load
            "docker save, to its first byte": _exec(f"docker save {BENCH_IMAGE} | head -c 1 > /dev/null"),
            "docker load < archive": _exec(f"docker load -i {tar_worker} > /dev/null", node=w.name),
            "ssh cat (aes128-gcm)": _exec(f"cat {tar_head} | {_ssh('aes128-gcm@openssh.com')} "
                                          f"spark@{w.fabric_ip} 'cat > /dev/null'"),
        }
        for r in range(rounds):
            for name, copy in methods.items():
                api.exec_(w.name, unload, user="root", check=True, timeout=300)
                if name == "docker load < archive":
                    api.exec_("head", f"cat {tar_head} | {_ssh('aes128-gcm@openssh.com')} spark@{w.fabric_ip} "
                              f"'cat > {tar_worker}' && sync", check=True, timeout=600)
                took, _ = _measured(copy, w)
                results.setdefault(name, []).append(took)
                opts.log(f"image round {r + 1}: {name}: {nbytes / took / 1e6:.0f} MB/s")
        api.exec_(w.name, unload, user="root", check=True, timeout=300)
        api.exec_("head", f"docker rmi -f {BENCH_IMAGE} >/dev/null; rm -f {tar_head}", user="root", check=True)
    rows: dict[str, Result] = {
        k: {"seconds": summary(v), "mb_per_s": nbytes / summary(v)["median"] / 1e6,
            "mb_per_s_range": [nbytes / max(v) / 1e6, nbytes / min(v) / 1e6]} for k, v in results.items()}
    slowest_end = min(rows["docker save > /dev/null"]["mb_per_s"], rows["docker load < archive"]["mb_per_s"])
    # what docker's two staging steps leave to any save | load pipeline: the save's staging, then the whole load
    staged, load_s = (rows[k]["seconds"]["median"] for k in ("docker save, to its first byte", "docker load < archive"))
    data: Result = {"bytes": nbytes, "rows": rows, "vs_docker": rows["project"]["mb_per_s"] / slowest_end,
            "staging_bound": load_s / (staged + load_s), "save_staging_s": staged,
            "cipher_headroom": rows["ssh cat (aes128-gcm)"]["mb_per_s"] / slowest_end, "leftovers": run.leftovers}
    save(opts, "image", data)
    return data


def _noop_check(desired_path: Path, repeat: int) -> tuple[list[float], list[float]]:
    from reconciler.core import spec
    from reconciler.core.drift import weights_difference
    from reconciler.edge.facts.base import sealed
    from reconciler.edge.manifest import manifest_script
    from reconciler.edge.observe import observe
    from reconciler.edge.ssh import Sessions
    desired = spec.load(desired_path)
    sessions = Sessions(desired)
    try:
        full: list[float] = []
        section: list[float] = []
        for i in range(repeat + 2):
            t = time.perf_counter()
            observed, _ = observe(desired, sessions, timeout=60)
            expected = observed.node("head").weights
            if expected is None:
                raise RuntimeError(f"the head's weights were not observed: {observed.node('head').error}")
            problem = weights_difference(expected, observed.node("worker").weights)
            took = time.perf_counter() - t
            if problem is not None:
                raise RuntimeError(f"weights not in sync: {problem}")
            t = time.perf_counter()
            sessions["worker"].run_script(sealed([manifest_script(desired.weights_root("worker"))]).script,
                                          timeout=60)
            if i >= 2:
                full.append(took)
                section.append(time.perf_counter() - t)
        return full, section
    finally:
        sessions.close()


def run_verify(opts: Options) -> Result:
    from testbed import api
    total = (2 << 30) if not opts.quick else (48 << 20)
    repeat = opts.n(20, 2)
    rows: dict[int, Result] = {}
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
