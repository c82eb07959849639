#!/usr/bin/env python3
"""`vllm` stand-in for the testbed: `vllm serve MODEL [flags]`. Stdlib only (runs in the minimal serving image).

What is real: flag parsing (unknown flags -> exit 2 like vLLM), model resolution (path or HF id in the hub cache,
HF_HUB_OFFLINE), safetensors header/size checks of every shard, the multi-node rendezvous over TCP
(head waits for nnodes-1 headless workers on --master-addr:--master-port), HTTP /health /v1/models /metrics
/v1/completions once ready, peer-loss handling, the Ray executor asking the local `ray` stand-in for nodes/GPUs.
What is fake: no GPU, no NCCL, no tensors are used; completions are canned. The start prints vLLM's own lines for
each stage (the shards' bar, torch.compile, the KV cache, the CUDA graph capture's bar redrawn with `\\r`, "init
engine ... took", uvicorn's), spread over STANDIN_LOAD_DELAY_S, so the reconciler's cold-start progress
(reconciler/core/vllm_log.py) reads the stand-in as it reads vLLM.

The scheduler is vLLM's shape (vllm/v1/core/sched/scheduler.py): at most `--max-num-seqs` sequences run, the rest
wait first come, first served (priority scheduling is opt-in, vllm-project/vllm PR #5958), every running sequence
gains a token per engine step, and `vllm:num_requests_running`, `vllm:num_requests_waiting` and the token counters
move as they do (counted per step, not per finished request). STANDIN_STEPS_PER_S sets the step rate (0: instant,
the default). SIGUSR1 wedges the engine: /health still answers 200, no token is produced, every request hangs
(an NCCL collective waiting for a rank that never comes); SIGUSR2 releases it.

Before it allocates, it asks STANDIN_DEVICE_MEMORY_URL (testbed/device_memory.py) what the GPU has free, as vLLM
asks the driver, and fails like vLLM's startup check when that is below gpu_memory_utilization x the node: on GB10
page cache is not free to the GPU (vllm-project/vllm#35313). Serving, each rank asks again every second for
STANDIN_RUNTIME_BYTES (what a rank allocates beyond its KV cache) and dies like a rank meeting NV_ERR_NO_MEMORY
when the pool has less free (`runtime_allocations`).

Environment knobs: STANDIN_GPUS_PER_NODE (1), STANDIN_LOAD_DELAY_S (0.5), STANDIN_CRASH=1, STANDIN_STEPS_PER_S (0),
STANDIN_DEVICE_MEMORY_URL (unset), STANDIN_RUNTIME_BYTES (0),
VLLM_ENGINE_READY_TIMEOUT_S (600), STANDIN_HEARTBEAT_S (1), STANDIN_PEER_TIMEOUT_S (5),
STANDIN_RAY_PG_TIMEOUT_S (10), RAY_ADDRESS, HF_HUB_CACHE / HF_HOME, HF_HUB_OFFLINE.
Marker file: `.standin-crash` in the model directory or any of its ancestors.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
import uuid
from collections.abc import Callable

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import (
    Body,
    HTTPServer,
    JsonObject,
    LineConn,
    QuietHandler,
    Terminated,
    connect,
    env_float,
    env_int,
    heartbeats,
    install_signal_handlers,
    listen,
    log,
    raw,
    raw_part,
    serve_http,
)
from model_check import ModelError, check_weights, crash_marker, read_config, resolve

VERSION = "0.11.0+standin"


class EngineError(Exception):
    def __init__(self, *lines: str):
        self.lines = list(lines)
        super().__init__(lines[-1] if lines else "")


# ------------------------------------------------------------------------------------------------ CLI


def _max_len(text: str) -> int:
    t = text.strip().lower()
    mult = 1
    if t.endswith("k"):
        mult, t = 1024, t[:-1]
    elif t.endswith("m"):
        mult, t = 1024 * 1024, t[:-1]
    try:
        return int(float(t) * mult)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid value: '{text}'") from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="vllm", description="vLLM CLI (testbed stand-in)")
    p.add_argument("-v", "--version", action="version", version=VERSION)
    sub = p.add_subparsers(dest="subcommand")
    s = sub.add_parser(
        "serve",
        prog="vllm serve",
        usage="vllm serve [model_tag] [options]",
        help="Start the vLLM OpenAI Compatible API server.",
    )
    s.add_argument("model_tag", nargs="?", help="The model tag to serve (optional if specified in config)")
    s.add_argument("--model", default=None)
    s.add_argument("--host", default=None)
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--served-model-name", nargs="+", default=None)
    s.add_argument("--api-key", default=None)
    s.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    s.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1)
    s.add_argument("--data-parallel-size", "-dp", type=int, default=1)
    s.add_argument("--nnodes", type=int, default=1)
    s.add_argument("--node-rank", type=int, default=0)
    s.add_argument("--master-addr", default="127.0.0.1")
    s.add_argument("--master-port", type=int, default=29501)
    s.add_argument("--headless", action="store_true")
    s.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    s.add_argument("--max-model-len", type=_max_len, default=None)
    s.add_argument("--distributed-executor-backend", choices=["ray", "mp", "uni", "external_launcher"], default=None)
    s.add_argument("--revision", default=None)
    s.add_argument("--download-dir", default=None)
    s.add_argument(
        "--load-format",
        choices=["auto", "pt", "safetensors", "npcache", "dummy", "tensorizer", "runai_streamer", "bitsandbytes",
                 "sharded_state", "gguf", "mistral", "fastsafetensors"],
        default="auto",
    )
    s.add_argument("--dtype", choices=["auto", "half", "float16", "bfloat16", "float", "float32"], default="auto")
    s.add_argument("--trust-remote-code", action="store_true")
    s.add_argument("--runner", choices=["auto", "generate", "pooling", "draft"], default="auto")
    s.add_argument("--convert", choices=["auto", "none", "embed", "classify", "reward"], default="auto")
    s.add_argument("--max-num-seqs", type=int, default=None)
    s.add_argument("--enforce-eager", action="store_true")
    s.add_argument(
        "--kv-cache-dtype",
        choices=["auto", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2", "fp8_inc", "fp8_ds_mla"],
        default="auto",
    )
    return p


def normalize_argv(argv: list[str]) -> list[str]:
    """vLLM's FlexibleArgumentParser accepts --foo_bar as --foo-bar."""
    out = []
    for a in argv:
        if a.startswith("--help="):  # vLLM's --help=all / --help=<group>: the stand-in has one page
            a = "--help"
        if a.startswith("--") and len(a) > 2:
            key, eq, val = a.partition("=")
            a = key.replace("_", "-") + eq + val
        out.append(a)
    return out


# ------------------------------------------------------------------------------------------------ engine


class Engine:
    srv: HTTPServer   # the API server, once it listens

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.model = args.model_tag or args.model or "Qwen/Qwen3-0.6B"
        self.served = (args.served_model_name or [self.model])
        self.ready = False
        self.healthy = True
        self.reason = ""
        self.max_len = args.max_model_len or 0
        self.started = time.time()
        self.requests = 0
        self.prompt_tokens = 0
        self.gen_tokens = 0
        self.lock = threading.Lock()
        self.peers: dict[int, LineConn] = {}
        self.hb = env_float("STANDIN_HEARTBEAT_S", 1.0)
        self.peer_timeout = env_float("STANDIN_PEER_TIMEOUT_S", 5.0)
        self.ready_timeout = env_float("VLLM_ENGINE_READY_TIMEOUT_S", 600.0)
        self.gpus = env_int("STANDIN_GPUS_PER_NODE", 1)
        self.exit_code: int | None = None
        self.kv_cache: list[bytearray] = []
        self.scheduler = Scheduler(self, args.max_num_seqs or DEFAULT_MAX_NUM_SEQS,
                                   env_float("STANDIN_STEPS_PER_S", 0.0))

    @property
    def world(self) -> int:
        size: int = self.args.tensor_parallel_size * self.args.pipeline_parallel_size
        return size

    def fail(self, msg: str) -> None:
        with self.lock:
            if self.healthy:
                self.healthy = False
                self.reason = msg

    # ---- checks shared by every rank
    def validate(self) -> None:
        a = self.args
        if not 0 < a.gpu_memory_utilization <= 1:
            raise EngineError("ValueError: GPU memory utilization must be within (0, 1]. "
                              f"Got {a.gpu_memory_utilization}.")
        for name in ("tensor_parallel_size", "pipeline_parallel_size", "nnodes"):
            if getattr(a, name) < 1:
                raise EngineError(f"ValueError: {name} must be >= 1, got {getattr(a, name)}")
        if not 0 <= a.node_rank < a.nnodes:
            raise EngineError(f"ValueError: node_rank ({a.node_rank}) must be in [0, nnodes={a.nnodes})")
        if a.node_rank > 0 and not a.headless:
            raise EngineError("ValueError: node_rank > 0 requires --headless (only rank 0 runs the API server)")
        if a.headless and a.node_rank == 0:
            raise EngineError("ValueError: --headless is for the nodes with node_rank > 0")
        backend = a.distributed_executor_backend
        if backend == "ray":
            return
        if self.world % a.nnodes:
            raise EngineError(
                f"ValueError: world_size ({self.world} = tp {a.tensor_parallel_size} x pp "
                f"{a.pipeline_parallel_size}) must be divisible by nnodes ({a.nnodes})"
            )
        local = self.world // a.nnodes
        if local > self.gpus:
            raise EngineError(
                f"ValueError: node {a.node_rank} needs {local} GPUs (world_size {self.world} over {a.nnodes} "
                f"node(s)) but only {self.gpus} available (CUDA_VISIBLE_DEVICES / STANDIN_GPUS_PER_NODE)."
            )

    def load_model(self) -> None:
        a = self.args
        log("INFO", "utils.py:253", f"non-default args: {{'model': '{self.model}', 'tensor_parallel_size': "
            f"{a.tensor_parallel_size}, 'pipeline_parallel_size': {a.pipeline_parallel_size}, 'nnodes': {a.nnodes}, "
            f"'node_rank': {a.node_rank}}}")
        path = resolve(self.model, a.revision, a.download_dir)
        cfg = read_config(path, self.model)
        native = int(cfg.get("max_position_embeddings") or 4096)
        if self.max_len and self.max_len > native:
            raise EngineError(
                f"ValueError: User-specified max_model_len ({self.max_len}) is greater than the derived "
                f"max_model_len (max_position_embeddings={native} in model's config.json). To allow overriding "
                "this maximum, set the env var VLLM_ALLOW_LONG_MAX_MODEL_LEN=1."
            )
        self.max_len = self.max_len or native
        log("INFO", "model.py:547", f"Resolved architecture: {(cfg.get('architectures') or ['?'])[0]}")
        log("INFO", "model.py:1510", f"Using max model len {self.max_len}")
        marker = crash_marker(path)
        if marker or os.environ.get("STANDIN_CRASH") == "1":
            raise EngineError(
                "torch.AcceleratorError: CUDA error: an illegal memory access was encountered",
                "CUDA kernel errors might be asynchronously reported at some other API call, so the stacktrace "
                "below might be incorrect.",
                f"(stand-in: crash requested by {marker or 'STANDIN_CRASH=1'})",
                "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}",
            )
        if a.load_format == "dummy":
            log("INFO", "default_loader.py:267", "Loading weights with load_format=dummy: skipping checkpoint")
        else:
            t0 = time.monotonic()
            log("INFO", "gpu_model_runner.py:2602", f"Starting to load model {self.model}...")

            # vLLM's bar: tqdm's `\r`, then its _BAR_FORMAT, which ends in a newline
            def progress(i: int, n: int) -> None:
                raw(f"\rLoading safetensors checkpoint shards: {int(100 * i / n):3d}% Completed | {i}/{n} "
                    f"[00:00<00:00]")

            total = check_weights(path, progress)
            log("INFO", "default_loader.py:267",
                f"Loading weights took {time.monotonic() - t0:.2f} seconds ({total / 2**30:.4f} GiB, from {path})")
        self.path = path

    def pause(self, seconds: float) -> None:
        """Time passing in the engine's start, cut short by a lost peer."""
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            if not self.healthy:
                raise EngineError(f"RuntimeError: {self.reason}")
            time.sleep(min(0.05, max(0.0, end - time.monotonic())))

    def simulate_load(self) -> None:
        """STANDIN_LOAD_DELAY_S of a cold start, printed as vLLM prints its stages (reconciler/core/vllm_log.py):
        torch.compile's lines for the first half, then the KV cache, then the CUDA graph capture's bar redrawn on
        one line for the second half (rank 0 only, as vLLM's tqdm); none of either under --enforce-eager."""
        delay = env_float("STANDIN_LOAD_DELAY_S", 0.5)
        compiled = not self.args.enforce_eager
        log("INFO", "gpu_model_runner.py:2007", "Model loading took 0.0 GiB and 0.00 seconds")
        if compiled:
            log("INFO", "backends.py:643", "Using cache directory: /root/.cache/vllm/torch_compile_cache/standin/"
                "rank_0_0/backbone for vLLM's torch.compile")
            log("INFO", "backends.py:703", f"Dynamo bytecode transform time: {delay / 4:.2f} s")
        self.pause(delay / 2 if compiled else delay)
        if compiled:
            log("INFO", "monitor.py:34", f"torch.compile takes {delay / 2:.2f} s in total")
        check_device_memory(self.args.gpu_memory_utilization)
        self.kv_cache = hold_memory(self.args.gpu_memory_utilization)
        need = env_int("STANDIN_RUNTIME_BYTES", 0)
        if need > 0:
            threading.Thread(target=runtime_allocations, args=(need,), daemon=True).start()
        log("INFO", "gpu_worker.py:298", f"Available KV cache memory: {sum(map(len, self.kv_cache)) / 2**30:.2f} GiB "
            f"(gpu_memory_utilization {self.args.gpu_memory_utilization:g} of {node_memory() / 2**30:.2f} GiB)")
        log("INFO", "kv_cache_utils.py:1087", f"GPU KV cache size: 65,536 tokens; max_model_len {self.max_len}")
        if compiled:
            self.capture_graphs(delay / 2)
        log("INFO", "core.py:250", f"init engine (profile, create kv cache, warmup model) took {delay:.2f} seconds")

    def capture_graphs(self, seconds: float, shapes: int = 10) -> None:
        """vLLM's CUDA graph capture bar (vllm/v1/worker/gpu_model_runner.py): tqdm's default format, each redraw
        `\\r` on the same line, a newline once done; then its summary line."""
        for n in range(shapes + 1):
            if self.args.node_rank == 0:
                bar = "#" * n + " " * (shapes - n)
                raw_part(f"\rCapturing CUDA graphs (mixed prefill-decode, PIECEWISE): {100 * n // shapes:3d}%|{bar}| "
                         f"{n}/{shapes} [00:0{n % 10}<00:00,  {shapes / max(seconds, 0.01):.2f}it/s]")
            if n < shapes:
                self.pause(seconds / shapes)
        if self.args.node_rank == 0:
            raw_part("\n")
        log("INFO", "gpu_model_runner.py:3480", f"Graph capturing finished in {seconds:.0f} secs, took 0.00 GiB")

    # ---- rendezvous (mp executor, --nnodes > 1)
    def hello(self) -> JsonObject:
        a = self.args
        return {"op": "hello", "rank": a.node_rank, "tp": a.tensor_parallel_size, "pp": a.pipeline_parallel_size,
                "nnodes": a.nnodes, "model": self.model, "gpus": self.gpus, "version": VERSION}

    def head_rendezvous(self) -> None:
        a = self.args
        try:
            srv = listen(a.master_addr, a.master_port)
        except OSError as e:
            raise EngineError(
                f"torch.distributed.DistNetworkError: The server socket has failed to listen on any local network "
                f"address. port: {a.master_port}, useIpv6: false, code: -{e.errno}, name: {os.strerror(e.errno or 0)}, "
                f"message: {e.strerror} ({a.master_addr})"
            ) from None
        self.store = srv
        need = set(range(1, a.nnodes))
        log("INFO", "multiproc_executor.py:720",
            f"Waiting for {len(need)} headless node(s) on tcp://{a.master_addr}:{a.master_port}")
        deadline = time.monotonic() + self.ready_timeout
        mine = self.hello()
        while need:
            left = deadline - time.monotonic()
            if left <= 0:
                raise EngineError(
                    f"torch.distributed.DistStoreError: Timed out after {int(self.ready_timeout)} seconds waiting "
                    f"for clients. {a.nnodes - len(need)}/{a.nnodes} clients joined (missing node rank(s) "
                    f"{sorted(need)})."
                )
            srv.settimeout(min(left, 0.5))
            try:
                sock, addr = srv.accept()
            except TimeoutError:
                continue
            conn = LineConn(sock)
            try:
                msg = conn.recv(5.0)
            except TimeoutError:
                conn.close()
                continue
            if not msg or msg.get("op") != "hello":
                conn.close()
                continue
            bad = [k for k in ("tp", "pp", "nnodes", "model") if msg.get(k) != mine[k]]
            rank = msg.get("rank")
            if bad:
                detail = ", ".join(f"{k}: head={mine[k]!r} node{rank}={msg.get(k)!r}" for k in bad)
                conn.send({"op": "reject", "error": f"configuration mismatch ({detail})"})
                conn.close()
                raise EngineError(f"RuntimeError: node rank {rank} from {addr[0]} joined with a different "
                                  f"configuration: {detail}")
            if rank not in need:
                conn.send({"op": "reject", "error": f"node rank {rank} invalid or already joined"})
                conn.close()
                log("WARNING", "multiproc_executor.py:741", f"rejected node rank {rank} from {addr[0]}")
                continue
            need.discard(rank)
            self.peers[rank] = conn
            conn.send({"op": "welcome"})
            log("INFO", "multiproc_executor.py:733", f"node rank {rank} joined from {addr[0]}")
            threading.Thread(target=self._watch_peer, args=(rank, conn), daemon=True).start()
        log("INFO", "parallel_state.py:1165",
            f"world_size={self.world} rank=0 local_rank=0 distributed_init_method=tcp://{a.master_addr}:"
            f"{a.master_port} backend=nccl")

    def _watch_peer(self, rank: int, conn: LineConn) -> None:
        peer = conn.sock.getpeername()[0]
        for msg in heartbeats(conn, self.hb, self.peer_timeout):
            if msg is None:
                text = (f"Worker proc on node rank {rank} died unexpectedly (connection to {peer} lost), "
                        "shutting down executor.")
                log("ERROR", "multiproc_executor.py:154", text)
                log("ERROR", "core_client.py:564",
                    "Engine core proc EngineCore_DP0 died unexpectedly, shutting down client.")
                self.fail(text)
                conn.close()
                return

    def worker_rendezvous(self) -> None:
        a = self.args
        deadline = time.monotonic() + self.ready_timeout
        last_warn = 0.0
        while True:
            try:
                sock = connect(a.master_addr, a.master_port, timeout=2.0)
                break
            except OSError as e:
                now = time.monotonic()
                if now - last_warn > 5:
                    raw(f"[W socket.cpp:755] [c10d] The client socket has failed to connect to "
                        f"[{a.master_addr}]:{a.master_port} (errno: {e.errno} - {e.strerror or e}).")
                    last_warn = now
                if now > deadline:
                    raise EngineError(
                        f"torch.distributed.DistNetworkError: The client socket has timed out after "
                        f"{int(self.ready_timeout)}s while trying to connect to ({a.master_addr}, {a.master_port})."
                    ) from None
                time.sleep(0.5)
        conn = LineConn(sock)
        conn.send(self.hello())
        try:
            msg = conn.recv(30.0)
        except TimeoutError:
            msg = None
        if not msg or msg.get("op") != "welcome":
            err = (msg or {}).get("error", "connection closed by the head during the handshake")
            raise EngineError(f"RuntimeError: rendezvous with {a.master_addr}:{a.master_port} failed: {err}")
        log("INFO", "parallel_state.py:1165",
            f"world_size={self.world} rank={a.node_rank} distributed_init_method=tcp://{a.master_addr}:"
            f"{a.master_port} backend=nccl")
        self.head = conn
        # The link to the head lives from the rendezvous on, also while this rank loads and fills its memory
        # (seconds on a node under memory pressure): a rank that went silent during its own load used to be
        # taken for dead by the head, which no real rank is.
        self.head_outcome: list[str] = []
        self.head_beat = threading.Thread(target=self._beat_head, daemon=True)
        self.head_beat.start()

    def _beat_head(self) -> None:
        a = self.args
        for msg in heartbeats(self.head, self.hb, self.peer_timeout):
            if msg is None:
                self.head_outcome.append(f"RuntimeError: lost connection to the head node {a.master_addr}:"
                                         f"{a.master_port} (engine core on node rank 0 gone); shutting down.")
                self.fail(self.head_outcome[0])
                return
            if msg.get("op") == "shutdown":
                self.head_outcome.append("shutdown")
                return

    def worker_loop(self) -> int:
        """Headless: stay until the head goes away (exit 1) or shuts down (exit 0)."""
        log("INFO", "launcher.py:110", f"Headless node rank {self.args.node_rank} ready; serving no API")
        self.head_beat.join()
        if self.head_outcome and self.head_outcome[0] == "shutdown":
            log("INFO", "launcher.py:130", "Head shut down; exiting")
            return 0
        raise EngineError(self.head_outcome[0] if self.head_outcome else "RuntimeError: head link ended")

    # ---- ray executor
    def ray_placement(self) -> None:
        from ray_client import RayError, ray_request

        need = self.world
        timeout = env_float("STANDIN_RAY_PG_TIMEOUT_S", 10.0)
        deadline = time.monotonic() + timeout
        warned = False
        while True:
            try:
                st = ray_request({"op": "status"})
            except RayError as e:
                raise EngineError(str(e)) from None
            gpus = sum(n.get("gpus", 0) for n in st["nodes"])
            if gpus >= need:
                break
            if not warned:
                log("WARNING", "ray_utils.py:370",
                    f"Waiting for creating a placement group of specs for {int(timeout)} seconds. specs="
                    f"{[{'GPU': 1.0}] * need}. Check `ray status` and `ray list nodes` to see if you have enough "
                    f"resources, and make sure the IP addresses used by ray cluster are the same as VLLM_HOST_IP "
                    f"environment variable specified in each node if you are running on a multi-node.")
                raw("(autoscaler +1s) Warning: The following resource request cannot be scheduled right now: "
                    "{'GPU': 1.0}. This is likely due to all cluster resources being claimed by actors. Consider "
                    "creating fewer actors or adding more nodes to this Ray cluster.")
                warned = True
            if time.monotonic() > deadline:
                raise EngineError(
                    f"ValueError: Cannot provide a placement group of placement_group_specs={[{'GPU': 1.0}] * need} "
                    f"within {int(timeout)} seconds. See `ray status` and `ray list nodes` to make sure the cluster "
                    f"has enough resources. (cluster has {len(st['nodes'])} node(s), {gpus} GPU(s); "
                    "No available node types can fulfill resource request)"
                )
            time.sleep(0.5)
        # every node loads its own shards: ask the ray stand-ins to check the model on their disks
        try:
            res = ray_request({"op": "check_model", "model": self.model, "revision": self.args.revision,
                               "download_dir": self.args.download_dir, "load_format": self.args.load_format},
                              timeout=120)
        except RayError as e:
            raise EngineError(str(e)) from None
        for node in res.get("results", []):
            if not node.get("ok"):
                ip = node.get("ip")
                raise EngineError(*[f"(RayWorkerWrapper ip={ip}) {line}" for line in node.get("lines", [])])
        self.ray_nodes = len(st["nodes"])
        log("INFO", "ray_distributed_executor.py:185",
            f"Ray cluster: {len(st['nodes'])} node(s), {gpus} GPU(s); placement group of {need} bundle(s) ready")
        threading.Thread(target=self._watch_ray, args=(len(st["nodes"]),), daemon=True).start()

    def _watch_ray(self, nodes: int) -> None:
        from ray_client import RayError, ray_request

        while True:
            time.sleep(self.hb)
            try:
                st = ray_request({"op": "status"}, timeout=self.peer_timeout)
                if sum(n.get("gpus", 0) for n in st["nodes"]) < self.world:
                    raise RayError(f"Ray node died: {len(st['nodes'])}/{nodes} node(s) alive")
            except RayError as e:
                text = f"ray.exceptions.ActorDiedError: The actor died unexpectedly before finishing this task. ({e})"
                log("ERROR", "ray_distributed_executor.py:612", text)
                self.fail(text)
                return


# ------------------------------------------------------------------------------------------------ HTTP


def node_memory() -> int:
    """The memory of the machine this rank runs on, as vLLM sees a GB10's: one pool. In the testbed a node is a
    memory cgroup with a limit (testbed/memory.py), which a container sees as hierarchical_memory_limit. Run
    on the host (the stand-in's own unit tests), STANDIN_NODE_MEMORY_BYTES says how big the pretend node is."""
    if os.environ.get("STANDIN_NODE_MEMORY_BYTES"):
        return int(os.environ["STANDIN_NODE_MEMORY_BYTES"])
    total = 0
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                total = int(line.split()[1]) * 1024
    try:
        with open("/sys/fs/cgroup/memory/memory.stat") as f:
            for line in f:
                if line.startswith("hierarchical_memory_limit "):
                    total = min(total, int(line.split()[1]))
    except OSError:
        pass
    return total


def device_memory() -> tuple[int, int] | None:
    """(total, free) of the node's device memory as a GB10 driver reports it: page cache is not free
    (testbed/device_memory.py, asked at STANDIN_DEVICE_MEMORY_URL). None without that URL (the stand-in's own
    tests on the host): nothing to ask, nothing is checked."""
    url = os.environ.get("STANDIN_DEVICE_MEMORY_URL")
    if not url:
        return None
    import json
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            device = json.loads(r.read())
    except (OSError, ValueError) as exc:
        raise EngineError(f"RuntimeError: cudaMemGetInfo failed: {exc}") from None
    return int(device["total"]), int(device["free"])


def check_device_memory(gpu_memory_utilization: float) -> None:
    """vLLM's startup check (vllm/v1/worker/gpu_worker.py: free memory against `gpu_memory_utilization` x total)
    against the node's device memory."""
    device = device_memory()
    if device is None:
        return
    total, free = device
    requested = gpu_memory_utilization * node_memory()
    if free < requested:
        gib = 2**30
        raise EngineError(f"ValueError: Free memory on device cuda:0 ({free / gib:.2f}/{total / gib:.2f} GiB) on "
                          f"startup is less than desired GPU memory utilization ({gpu_memory_utilization}, "
                          f"{requested / gib:.2f} GiB). Decrease GPU memory utilization or reduce GPU memory used "
                          "by other processes.")


def runtime_allocations(need: int, every: float = 1.0) -> None:
    """A serving rank's allocations after the KV cache (activations of a long prefill, sampler tensors, NCCL
    buffers): `need` bytes the driver must find free, asked for every `every` seconds. On a GB10 page cache is
    not free to the driver, and a rank that meets a full pool dies with NV_ERR_NO_MEMORY
    (NVIDIA/dgx-spark-playbooks#97: the head reset during a 128K prefill; vllm-project/vllm#35313), taking the
    engine with it: its peers see it gone. STANDIN_RUNTIME_BYTES sets `need` (0: never asked)."""
    while True:
        time.sleep(every)
        try:
            device = device_memory()
        except EngineError:
            continue  # the driver did not answer this time: no allocation was refused
        if device is not None and device[1] < need:
            log("ERROR", "gpu_model_runner.py:2391",
                f"CUDA error: out of memory (NV_ERR_NO_MEMORY): tried to allocate {need / 2**20:.0f} MiB with "
                f"{device[1] / 2**20:.0f} MiB free of {device[0] / 2**30:.2f} GiB")
            log("ERROR", "multiproc_executor.py:599", "WorkerProc hit an exception; the worker dies.")
            sys.stdout.flush()
            os._exit(1)


def hold_memory(gpu_memory_utilization: float) -> list[bytearray]:
    """Hold gpu_memory_utilization x the node's memory, resident: what vLLM takes for weights and KV cache on
    unified memory. More than the node has left meets its OOM killer.

    In 64 MiB pieces with the GIL given up in between: `bytearray(n)` zero-fills all n bytes in one C call that
    holds the GIL, so at gmu 0.6 of 8 GiB the heartbeat threads stopped for ~5 s on a node under memory pressure
    and each rank took the other for dead."""
    n = int(gpu_memory_utilization * node_memory())
    chunk = 64 << 20
    held = []
    for start in range(0, n, chunk):
        held.append(bytearray(min(chunk, n - start)))  # zero-filled: every page touched, resident
        time.sleep(0)
    return held


def _models(engine: Engine) -> JsonObject:
    """/v1/models: every served name, as vLLM lists them."""
    data = [
        {"id": name, "object": "model", "created": int(engine.started), "owned_by": "vllm",
         "root": engine.model, "parent": None, "max_model_len": engine.max_len, "permission": []}
        for name in engine.served
    ]
    return {"object": "list", "data": data}


DEFAULT_MAX_NUM_SEQS = 256  # vLLM's default outside its per-hardware overrides (vllm/engine/arg_utils.py)


class Scheduler:
    """At most `slots` sequences run; the others wait in arrival order; each running sequence gains one token per
    step of 1/rate seconds (all of them in the same step, as a batch does). A wedged engine makes no step."""

    def __init__(self, engine: Engine, slots: int, rate: float):
        self.engine, self.slots, self.rate = engine, max(1, slots), rate
        self.cond = threading.Condition()
        self.queue: list[object] = []
        self.running = 0
        self.wedged = False

    def load(self) -> tuple[int, int]:
        with self.cond:
            return self.running, len(self.queue)

    def wedge(self, on: bool) -> None:
        with self.cond:
            self.wedged = on
            self.cond.notify_all()

    def run(self, prompt_tokens: int, n: int) -> bool:
        """Wait for a slot (first come, first served), then generate `n` tokens. False: the engine died."""
        ticket = object()
        with self.cond:
            self.queue.append(ticket)
            while self.queue[0] is not ticket or self.running >= self.slots or self.wedged:
                if not self.engine.healthy:
                    self.queue.remove(ticket)
                    self.cond.notify_all()
                    return False
                self.cond.wait(0.2)
            self.queue.pop(0)
            self.running += 1
            self.cond.notify_all()
        try:
            with self.engine.lock:
                self.engine.prompt_tokens += prompt_tokens
            for _ in range(n):
                with self.cond:
                    while self.wedged and self.engine.healthy:
                        self.cond.wait(0.2)
                if not self.engine.healthy:
                    return False
                if self.rate > 0:
                    time.sleep(1 / self.rate)
                with self.engine.lock:
                    self.engine.gen_tokens += 1
            return True
        finally:
            with self.cond:
                self.running -= 1
                self.cond.notify_all()


def _complete(engine: Engine, path: str, body: JsonObject) -> tuple[int, JsonObject]:
    """(status, JSON) for a completion or chat request to a healthy engine: `max_tokens` words of "stand-in"
    (up to 4096), through the scheduler, counted in the engine's metrics as they are made."""
    model = body.get("model") or engine.served[0]
    if model not in engine.served:
        return 404, {"error": {"message": f"The model `{model}` does not exist.",
                               "type": "NotFoundError", "param": None, "code": 404}}
    n = max(1, min(int(body.get("max_tokens") or 16), 4096))
    text = " ".join(["stand-in"] * n)
    prompt_tokens = len(str(body.get("prompt") or body.get("messages") or "").split())
    if not engine.scheduler.run(prompt_tokens, n):
        return 500, {"error": {"message": "EngineCore encountered an issue. See stack trace for the root cause.",
                               "type": "EngineDeadError", "code": 500}}
    with engine.lock:
        engine.requests += 1
    rid = uuid.uuid4().hex
    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": n, "total_tokens": prompt_tokens + n}
    if path == "/v1/completions":
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": "length", "stop_reason": None}
        return 200, {"id": f"cmpl-{rid}", "object": "text_completion", "created": int(time.time()),
                     "model": model, "choices": [choice], "usage": usage}
    choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "length"}
    return 200, {"id": f"chatcmpl-{rid}", "object": "chat.completion", "created": int(time.time()),
                 "model": model, "choices": [choice], "usage": usage}


def _get(engine: Engine, path: str) -> tuple[int, Body, str]:
    """(code, body, content type) of a GET, as vLLM's api_server answers it."""
    up = 200 if engine.healthy else 503
    routes: dict[str, Callable[[], tuple[int, Body, str]]] = {
        "/health": lambda: (up, b"", "application/json"),
        "/ping": lambda: (up, b"", "application/json"),
        "/version": lambda: (200, {"version": VERSION}, "application/json"),
        "/v1/models": lambda: (200, _models(engine), "application/json"),
        "/metrics": lambda: (200, metrics(engine), "text/plain; version=0.0.4; charset=utf-8"),
    }
    return routes[path]() if path in routes else (404, {"detail": "Not Found"}, "application/json")


def make_handler(engine: Engine) -> type[QuietHandler]:
    # vLLM's api_server: `--api-key` (else VLLM_API_KEY) guards every path under /v1 (and /v2, /inference,
    # /cohere); /health, /ping, /version and /metrics stay open; a wrong or missing key answers 401.
    key = engine.args.api_key or os.environ.get("VLLM_API_KEY")

    class Handler(QuietHandler):
        def _refused(self, path: str) -> bool:
            if key and path.startswith(("/v1", "/v2", "/inference", "/cohere")) and \
                    self.headers.get("Authorization") != f"Bearer {key}":
                self.reply(401, {"error": "Unauthorized"})
                return True
            return False

        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0]
            if self._refused(path):
                return
            self.reply(*_get(engine, path))

        def do_POST(self) -> None:
            path = self.path.split("?", 1)[0]
            if self._refused(path):
                return
            pooling = engine.args.runner == "pooling"
            if path not in (POOLING_ROUTES if pooling else ("/v1/completions", "/v1/chat/completions")):
                self.reply(404, {"detail": "Not Found"})
                return
            if not engine.healthy:
                self.reply(500, {"error": {"message": "EngineCore encountered an issue. See stack trace for the root "
                                                      "cause.", "type": "EngineDeadError", "code": 500}})
                return
            body = self.read_json()
            if body is None:
                self.reply(400, {"error": {"message": "Invalid JSON", "type": "BadRequestError", "code": 400}})
                return
            self.reply(*(_pool(engine, path, body) if pooling else _complete(engine, path, body)))

    return Handler


#: What `vllm serve --runner pooling` answers instead of completions (vLLM's pooling entrypoints: the Pooling API,
#: and the OpenAI embeddings one); a completion then gets 404, as no completions route is mounted.
POOLING_ROUTES = ("/pooling", "/v1/embeddings")


def _pool(engine: Engine, path: str, body: JsonObject) -> tuple[int, JsonObject]:
    """(status, JSON) for a pooling request to a healthy pooling engine: one vector per input, through the
    scheduler (one pass, no generated token), as vLLM's PoolingResponse / EmbeddingResponse shape it."""
    model = body.get("model") or engine.served[0]
    if model not in engine.served:
        return 404, {"error": {"message": f"The model `{model}` does not exist.",
                               "type": "NotFoundError", "param": None, "code": 404}}
    inputs = body.get("input")
    texts = inputs if isinstance(inputs, list) else [inputs]
    tokens = sum(len(str(t).split()) for t in texts)
    if not engine.scheduler.run(tokens, 0):
        return 500, {"error": {"message": "EngineCore encountered an issue. See stack trace for the root cause.",
                               "type": "EngineDeadError", "code": 500}}
    with engine.lock:
        engine.requests += 1
    kind = "embedding" if path == "/v1/embeddings" else "pooling"
    data = [{"index": i, "object": kind, ("embedding" if kind == "embedding" else "data"): [0.0] * 8}
            for i in range(len(texts))]
    return 200, {"id": f"pool-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()), "model": model,
                 "data": data, "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


def metrics(e: Engine) -> str:
    name = e.served[0]
    lab = f'engine="0",model_name="{name}"'
    running, waiting = e.scheduler.load()
    rows = [
        ("vllm:num_requests_running", "gauge", "Number of requests in model execution batches.", running),
        ("vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed.", waiting),
        ("vllm:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage.", 0.0),
        ("vllm:gpu_cache_usage_perc", "gauge", "GPU KV-cache usage. 1 means 100 percent usage.", 0.0),
        ("vllm:prompt_tokens_total", "counter", "Number of prefill tokens processed.", e.prompt_tokens),
        ("vllm:generation_tokens_total", "counter", "Number of generation tokens processed.", e.gen_tokens),
    ]
    out = []
    for metric, kind, help_, value in rows:
        out += [f"# HELP {metric} {help_}", f"# TYPE {metric} {kind}", f"{metric}{{{lab}}} {float(value)}"]
    out += ["# HELP vllm:request_success_total Count of successfully processed requests.",
            "# TYPE vllm:request_success_total counter",
            f'vllm:request_success_total{{{lab},finished_reason="length"}} {float(e.requests)}',
            "# HELP vllm:engine_healthy Stand-in: 1 while the engine and all peers are alive.",
            "# TYPE vllm:engine_healthy gauge",
            f"vllm:engine_healthy{{{lab}}} {1.0 if e.healthy else 0.0}"]
    return "\n".join(out) + "\n"


# ------------------------------------------------------------------------------------------------ main


def serve(args: argparse.Namespace) -> int:
    engine = Engine(args)
    a = args
    log("INFO", "api_server.py:1896", f"vLLM API server version {VERSION}")
    backend = a.distributed_executor_backend or ("mp" if (a.nnodes > 1 or engine.world > 1) else "uni")
    engine.validate()
    engine.load_model()
    if backend == "ray":
        engine.ray_placement()
    elif a.nnodes > 1:
        if a.node_rank == 0:
            engine.head_rendezvous()
        else:
            engine.worker_rendezvous()
    engine.simulate_load()
    if a.headless:
        return engine.worker_loop()
    if not engine.healthy:
        raise EngineError(f"RuntimeError: {engine.reason}")
    host = a.host or "0.0.0.0"
    try:
        srv = serve_http(host, a.port, make_handler(engine))
    except OSError as e:
        raise EngineError(f"ERROR:    [Errno {e.errno}] error while attempting to bind on address "
                          f"('{host}', {a.port}): {e.strerror}") from None
    engine.ready = True
    log("INFO", "api_server.py:1971", f"Starting vLLM API server 0 on http://{host}:{a.port}")
    log("INFO", "launcher.py:29", "Available routes are: /health, /v1/models, /metrics, /v1/completions, "
        "/v1/chat/completions, /version, /ping")
    raw(f"INFO:     Started server process [{os.getpid()}]")
    raw("INFO:     Waiting for application startup.")
    raw("INFO:     Application startup complete.")
    raw(f"INFO:     Uvicorn running on http://{host}:{a.port} (Press CTRL+C to quit)")
    engine.srv = srv
    signal.signal(signal.SIGUSR1, lambda *_: engine.scheduler.wedge(True))
    signal.signal(signal.SIGUSR2, lambda *_: engine.scheduler.wedge(False))
    while True:
        time.sleep(0.5)


def main(argv: list[str] | None = None) -> int:
    install_signal_handlers()
    parser = build_parser()
    argv = normalize_argv(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)  # exits 2 on unknown flags: "vllm: error: unrecognized arguments: ..."
    if args.subcommand != "serve":
        parser.print_help()
        return 0 if args.subcommand is None and not argv else 2
    try:
        return serve(args) or 0
    except (EngineError, ModelError) as e:
        for line in e.lines:
            if line.startswith(("ERROR:", "  File")):
                raw(line)
            else:
                log("ERROR", "core.py:708", line)
        log("ERROR", "core.py:708", "EngineCore failed to start.")
        return 1
    except Terminated:
        raw("INFO:     Shutting down")
        log("INFO", "launcher.py:80", "Shutting down FastAPI HTTP server.")
        return 0


if __name__ == "__main__":
    sys.exit(main())
