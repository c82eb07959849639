"""The exact `docker run` each node gets, written out by hand for the shipped sample and its variants.

test_launch_properties.py judges properties of every rendering (each rank's own fabric, the hash follows the
argv, the docker CLI parses it); this file pins the words: a flag misspelt, a value dropped or an option lost
would start a container that does something else, and only the literal text shows it. The expected lines follow
the recipes in docs/reference (NVIDIA's and eugr's two-Spark launch lines) and vLLM 0.32's `vllm serve` options
(`tests/unit/fixtures/vllm-0.32.0-cpu-serve-help-all.txt`).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from reconciler.core import spec
from reconciler.core.vllm import cache_dirs, extra_flags, launch_specs, parse_serve_help, unknown_flags
from tests.unit.edits import edited

SAMPLE = (Path(__file__).parents[3] / "desired-state" / "cluster.yaml").read_text()
HELP = (Path(__file__).parents[1] / "fixtures" / "vllm-0.32.0-cpu-serve-help-all.txt").read_text()
HEAD_IP, WORKER_IP = "192.168.200.12", "192.168.200.13"
DOCKER = ["--network", "host", "--restart", "no", "--ipc", "host", "--gpus", "all",
          "--ulimit", "memlock=-1", "--ulimit", "nofile=1048576:1048576", "--ulimit", "stack=67108864",
          "--device", "/dev/infiniband", "--cap-add", "IPC_LOCK"]
MOUNTS = ["-v", "/home/spark/.cache/huggingface/hub:/root/.cache/huggingface/hub:ro",
          "-v", "/home/spark/.cache/vllm:/root/.cache/vllm",
          "-v", "/home/spark/.cache/flashinfer:/root/.cache/flashinfer",
          "-v", "/home/spark/.triton:/root/.triton",
          "-v", "/home/spark/.tilelang:/root/.tilelang"]
SERVE = ["vllm", "serve", "Qwen/Qwen3.5-122B-A10B-FP8", "--revision", "main", "--tensor-parallel-size", "2",
         "--pipeline-parallel-size", "1", "--gpu-memory-utilization", "0.8", "--max-model-len", "32768",
         "--served-model-name", "qwen3.5-122b", "--trust-remote-code"]


def desired(*edits: tuple[str, str]) -> spec.Desired:
    return spec.loads(edited(SAMPLE, *edits), "X")


def env(ip: str, *extra: str) -> str:
    lines = ["GLOO_SOCKET_IFNAME=enp1s0f1np1", "HF_HUB_CACHE=/root/.cache/huggingface/hub", "HF_HUB_OFFLINE=1",
             f"MASTER_ADDR={HEAD_IP}", "NCCL_IB_DISABLE=0", "NCCL_IB_HCA==rocep1s0f1,roceP2p1s0f1",
             "NCCL_IGNORE_CPU_AFFINITY=1", "NCCL_SOCKET_IFNAME=enp1s0f1np1", "OMPI_MCA_btl_tcp_if_include=enp1s0f1np1",
             "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True", "TORCHINDUCTOR_CACHE_DIR=/root/.cache/vllm/inductor",
             "TP_SOCKET_IFNAME=enp1s0f1np1", "UCX_NET_DEVICES=enp1s0f1np1", f"VLLM_HOST_IP={ip}", *extra]
    return "".join(f"{line}\n" for line in sorted(lines))


# the tree it serves, in the hub it mounts
WEIGHTS = "/home/spark/.cache/huggingface/hub/models--Qwen--Qwen3.5-122B-A10B-FP8"


# What each launch is rendered from, as its launch label carries it for the next plan's field diff (compact JSON)
SHARED_INPUTS = {
    "model.id": "Qwen/Qwen3.5-122B-A10B-FP8", "model.layout": "hf-cache",
    "model.path": "/home/spark/.cache/huggingface/hub", "model.revision": "main",
    "nodes.spark-1a32.fabric.address": HEAD_IP, "serving.compile_cache": "home",
    "serving.container_name": "vllm_serving", "serving.docker.cap_add": "IPC_LOCK",
    "serving.docker.devices": "/dev/infiniband", "serving.docker.gpus": "all", "serving.docker.ipc": "host",
    "serving.docker.privileged": "false", "serving.docker.ulimits": "memlock=-1 nofile=1048576:1048576 stack=67108864",
    "serving.extra_args": "--load-format fastsafetensors", "serving.gpu_memory_utilization": "0.8",
    "serving.host": "0.0.0.0", "serving.image": "nvcr.io/nvidia/vllm:26.05-py3", "serving.launcher": "native",
    "serving.master_port": "29501", "serving.max_model_len": "32768", "serving.nodes": "spark-1a32,spark-5be3",
    "serving.pipeline_parallel_size": "1", "serving.port": "8000", "serving.served_model_name": "qwen3.5-122b",
    "serving.tensor_parallel_size": "2", "trust.remote_code": "true"}


def inputs(node: str, ip: str) -> dict[str, str]:
    own = {"fabric.address": ip, "fabric.interface": "enp1s0f1np1", "fabric.rdma_device": "rocep1s0f1",
           "fabric.twin.rdma_device": "roceP2p1s0f1", "ssh.user": "spark"}
    return SHARED_INPUTS | {f"nodes.{node}.{k}": v for k, v in own.items()}


def labels(role: str, spec_hash: str) -> list[str]:
    ports = "8000,29501" if role == "head" else ""  # the API and torch's TCPStore: rank 0 alone listens on fixed ports
    launch = inputs("spark-1a32", HEAD_IP) if role == "head" else inputs("spark-5be3", WORKER_IP)
    return ["--label", "spark-reconciler.generation=3", "--label", "spark-reconciler.instance=10.1.230.180:22",
            "--label", "spark-reconciler.launch=" + json.dumps(launch, sort_keys=True, separators=(",", ":")),
            "--label", "spark-reconciler.managed=true", "--label", f"spark-reconciler.ports={ports}",
            "--label", f"spark-reconciler.role={role}",
            "--label", f"spark-reconciler.spec-hash={spec_hash}",
            "--label", f"spark-reconciler.weights={WEIGHTS}"]


def test_the_sample_starts_rank_0_and_a_headless_rank_1_over_the_fabric():
    head, worker = launch_specs(desired())
    assert (head.node, head.rank, worker.node, worker.rank) == ("spark-1a32", 0, "spark-5be3", 1)
    assert head.run_argv(3, "/dev/stdin") == [
        "run", "-d", "--name", "vllm_serving", *DOCKER, *MOUNTS, *labels("head", head.spec_hash),
        "--env-file", "/dev/stdin", "nvcr.io/nvidia/vllm:26.05-py3", *SERVE, "--host", "0.0.0.0", "--port", "8000",
        "--nnodes", "2", "--node-rank", "0", "--master-addr", HEAD_IP, "--master-port", "29501",
        "--load-format", "fastsafetensors"]
    assert worker.run_argv(3, "/dev/stdin") == [
        "run", "-d", "--name", "vllm_serving", *DOCKER, *MOUNTS, *labels("worker", worker.spec_hash),
        "--env-file", "/dev/stdin", "nvcr.io/nvidia/vllm:26.05-py3", *SERVE, "--host", "0.0.0.0", "--port", "8000",
        "--nnodes", "2", "--node-rank", "1", "--master-addr", HEAD_IP, "--master-port", "29501", "--headless",
        "--load-format", "fastsafetensors"]
    assert (head.env_file_text(), worker.env_file_text()) == (env(HEAD_IP), env(WORKER_IP))
    assert (head.serve_exec, head.keep_local, worker.serve_exec) == (None, (), None)


def test_one_node_serves_alone_without_the_multi_node_flags():
    one = desired(("tensor_parallel_size: 2", "tensor_parallel_size: 1"))
    [head] = launch_specs(one)
    assert head.command == (*SERVE[:6], "1", *SERVE[7:], "--host", "0.0.0.0", "--port", "8000",
                            "--load-format", "fastsafetensors")


def test_with_ray_each_node_starts_ray_and_the_head_execs_vllm_serve():
    head, worker = launch_specs(desired(("launcher: native ", "launcher: ray    ")))
    # as eugr/spark-vllm-docker's launch-cluster.sh starts Ray on Sparks (start_ray_head, start_ray_worker)
    eugr = ("--object-store-memory", "1073741824", "--num-cpus", "2", "--disable-usage-stats")
    assert head.command == ("ray", "start", "--block", "--head", "--port", "6379", "--node-ip-address", HEAD_IP,
                            *eugr, "--include-dashboard=false")
    assert worker.command == ("ray", "start", "--block", f"--address={HEAD_IP}:6379", "--node-ip-address", WORKER_IP,
                              *eugr)
    assert head.serve_exec == (*SERVE, "--host", "0.0.0.0", "--port", "8000", "--distributed-executor-backend",
                               "ray", "--load-format", "fastsafetensors")
    ray = ("RAY_memory_monitor_refresh_ms=0", "RAY_num_prestart_python_workers=0")
    assert head.env_file_text() == env(HEAD_IP, *ray, f"RAY_NODE_IP_ADDRESS={HEAD_IP}")
    assert worker.env_file_text() == env(WORKER_IP, *ray, f"RAY_NODE_IP_ADDRESS={WORKER_IP}")
    assert head.keep_local == tuple(sorted(line.split("=", 1)[0] for line in head.env_file_text().splitlines()))


def test_every_docker_option_is_passed_as_the_docker_cli_spells_it():
    options = ("    ipc: host", "    ipc: private\n    shm_size: 16g\n    volumes: [/data/a:/a:ro, /data/b:/b]\n"
                                "    ulimits: {nofile: '65536:65536'}")
    d = desired(("privileged: false ", "privileged: true  "), options,
                ("devices: [/dev/infiniband]", "devices: [/dev/infiniband, /dev/infiniband/uverbs0]"),
                ("cap_add: [IPC_LOCK]", "cap_add: [IPC_LOCK, SYS_NICE]"),
                ("  remote_code: true", "  remote_code: true\n  privileged: true\n  capabilities: [SYS_NICE]\n"
                                        "  host_paths: [/data]"))
    head = launch_specs(d)[0]
    assert list(head.docker_flags) == [
        "--network", "host", "--restart", "no", "--ipc", "private", "--privileged", "--gpus", "all",
        "--shm-size", "16g", "--ulimit", "memlock=-1", "--ulimit", "nofile=65536:65536",
        "--ulimit", "stack=67108864", "--device", "/dev/infiniband",
        "--device", "/dev/infiniband/uverbs0", "--cap-add", "IPC_LOCK", "--cap-add", "SYS_NICE",
        "-v", "/data/a:/a:ro", "-v", "/data/b:/b", *MOUNTS]


def test_no_gpus_no_ipc_and_shm_beside_the_hosts_ipc_are_left_out():
    d = desired(("    gpus: all\n", "    gpus: null\n    shm_size: 16g\n"))
    assert list(launch_specs(d)[0].docker_flags) == [f for f in DOCKER if f not in ("--gpus", "all")] + MOUNTS


def test_a_plain_model_directory_is_mounted_read_only_and_served_by_path():
    d = desired(("layout: hf-cache", "layout: plain   "), ("path: /home/spark/.cache/huggingface/hub",
                                                          "path: /data/models/qwen"))
    head = launch_specs(d)[0]
    assert head.docker_flags[len(DOCKER):len(DOCKER) + 2] == ("-v", "/data/models/qwen:/models/model:ro")
    assert head.command[:3] == ("vllm", "serve", "/models/model") and "--revision" not in head.command
    assert "HF_HUB_OFFLINE" not in head.env and "HF_HUB_CACHE" not in head.env


@pytest.mark.parametrize(("edits", "dirs"), [
    ([], {"vllm": "/home/spark/.cache/vllm", "flashinfer": "/home/spark/.cache/flashinfer",
          "triton": "/home/spark/.triton", "tilelang": "/home/spark/.tilelang"}),
    ([("      user: spark\n      known_hosts", "      user: root\n      known_hosts")],
     {"vllm": "/root/.cache/vllm", "flashinfer": "/root/.cache/flashinfer", "triton": "/root/.triton",
      "tilelang": "/root/.tilelang"}),
    ([("  health_timeout: 1h", "  health_timeout: 1h\n  compile_cache: /data/ccX/")],
     {"vllm": "/data/ccX/vllm", "flashinfer": "/data/ccX/flashinfer", "triton": "/data/ccX/triton",
      "tilelang": "/data/ccX/tilelang"}),
    ([("  health_timeout: 1h", "  health_timeout: 1h\n  compile_cache: null")], {}),
])
def test_compile_caches_live_in_the_ssh_users_home_or_below_the_declared_directory(edits, dirs):
    d = desired(*edits)
    head = launch_specs(d)[0]
    assert cache_dirs(d, d.nodes[0]) == dirs
    inner = {"vllm": "/root/.cache/vllm", "flashinfer": "/root/.cache/flashinfer", "triton": "/root/.triton",
             "tilelang": "/root/.tilelang"}
    mounts = [a for name, host in dirs.items() for a in ("-v", f"{host}:{inner[name]}")]
    assert list(head.docker_flags[len(DOCKER) + 2:]) == mounts
    assert ("TORCHINDUCTOR_CACHE_DIR" in head.env) == bool(dirs)


def test_the_option_names_of_extra_args_are_what_vllms_parser_would_read():
    args = ["--x=1", "--a=b=c", "-5", "-0.5", "-1.2.3", "-X1", "--y", "value", "--x", "--kv_cache_dtype", "fp8"]
    assert extra_flags(args) == ["--x", "--a", "-1.2.3", "-X1", "--y", "--kv_cache_dtype"]
    assert unknown_flags(args, ["--x", "--y", "--kv-cache-dtype"]) == ["--a", "-1.2.3", "-X1"]


def test_the_serve_help_of_vllm_0_32_lists_every_alias():
    flags = parse_serve_help(HELP)
    for name in ("--api-server-count", "-asc", "--tensor-parallel-size", "-tp", "--load-format", "--headless",
                 "--distributed-executor-backend", "--nnodes", "--node-rank", "--master-addr"):
        assert name in flags, name
    assert all(f.startswith("-") and " " not in f and "," not in f for f in flags)
    assert len(flags) == len(set(flags))
    assert parse_serve_help("  --a N, -b N  text  more\n  --c  x\nusage: --d\n  e --f\n") == ["--a", "-b", "--c"]
