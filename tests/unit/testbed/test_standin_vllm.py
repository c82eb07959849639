"""The vLLM stand-in run as host processes on 127.0.0.1 (no containers, no other addresses)."""

import json
import os

import pytest

from testbed.proc import free_port, wait_for
from testbed.standin.testing import Proc, http_get, http_post
from testbed.weights import generate

REV = "1" * 40


@pytest.fixture
def procs():
    started = []
    yield started
    for p in started:
        p.stop()


@pytest.fixture
def model(tmp_path):
    return generate(tmp_path / "models", "testorg/tiny-moe", REV, "plain", 3, 32 * 1024)


def start(procs, tmp_path, args, env=None, name=None, program="vllm"):
    p = Proc(program, args, tmp_path, env=env, name=name)
    procs.append(p)
    return p


def test_unknown_flag_is_rejected_like_vllm(procs, tmp_path, model):
    p = start(procs, tmp_path, ["serve", str(model), "--tensor-parallel-size", "1", "--no-such-flag", "3"])
    assert p.wait() == 2
    assert "vllm: error: unrecognized arguments: --no-such-flag 3" in p.output


def test_bad_values_are_rejected(procs, tmp_path, model):
    p = start(procs, tmp_path, ["serve", str(model), "--distributed-executor-backend", "nccl"], name="a")
    assert p.wait() == 2 and "invalid choice" in p.output
    p = start(procs, tmp_path, ["serve", str(model), "-tp", "two"], name="b")
    assert p.wait() == 2 and "invalid int value" in p.output


def test_accepts_every_launcher_flag_and_serves(procs, tmp_path, model):
    port = free_port()
    p = start(procs, tmp_path, [
        "serve", str(model), "--host", "127.0.0.1", "--port", str(port), "--tensor-parallel-size", "1",
        "--pipeline-parallel-size", "1", "--gpu-memory-utilization", "0.7", "--max-model-len", "8192",
        "--served-model-name", "moe", "--distributed-executor-backend", "mp", "--load-format", "safetensors",
        "--trust-remote-code", "--max-num-seqs", "4", "--enforce-eager", "--data-parallel-size", "1",
        "--kv-cache-dtype", "fp8", "--revision", "main", "--max_num_seqs=4",
    ])
    wait_for(lambda: http_get(f"http://127.0.0.1:{port}/health")[0] == 200, what="health 200")
    code, body = http_get(f"http://127.0.0.1:{port}/v1/models")
    assert code == 200
    data = json.loads(body)
    assert data["object"] == "list"
    assert data["data"][0]["id"] == "moe" and data["data"][0]["owned_by"] == "vllm"
    assert data["data"][0]["max_model_len"] == 8192
    code, metrics = http_get(f"http://127.0.0.1:{port}/metrics")
    assert code == 200 and 'vllm:num_requests_running{engine="0",model_name="moe"} 0.0' in metrics
    code, body = http_post(f"http://127.0.0.1:{port}/v1/completions",
                           b'{"model": "moe", "prompt": "hi", "max_tokens": 3}')
    assert code == 200 and json.loads(body)["choices"][0]["text"]
    code, _ = http_post(f"http://127.0.0.1:{port}/v1/completions", b'{"model": "other", "prompt": "hi"}')
    assert code == 404
    assert f"Uvicorn running on http://127.0.0.1:{port}" in p.output
    p.terminate()
    assert p.wait(5) == 0


def test_hf_id_resolved_in_cache_and_offline_miss(procs, tmp_path):
    generate(tmp_path / "hf", "testorg/tiny-dense", "2" * 40, "hf-cache", 2, 16 * 1024)
    port = free_port()
    env = {"HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"}
    start(procs, tmp_path, ["serve", "testorg/tiny-dense", "--host", "127.0.0.1", "--port", str(port)], env=env)
    wait_for(lambda: http_get(f"http://127.0.0.1:{port}/health")[0] == 200, what="health 200")
    assert json.loads(http_get(f"http://127.0.0.1:{port}/v1/models")[1])["data"][0]["id"] == "testorg/tiny-dense"
    miss = start(procs, tmp_path, ["serve", "testorg/absent", "--port", str(free_port())], env=env, name="miss")
    assert miss.wait() == 1
    assert "LocalEntryNotFoundError" in miss.output
    nodir = start(procs, tmp_path, ["serve", "/no/such/dir", "--port", str(free_port())], env=env, name="nodir")
    assert nodir.wait() == 1 and "HFValidationError" in nodir.output


def test_truncated_shard_fails_like_vllm(procs, tmp_path, model):
    shard = model / "model-00002-of-00003.safetensors"
    shard.write_bytes(shard.read_bytes()[:-100])
    p = start(procs, tmp_path, ["serve", str(model), "--port", str(free_port())])
    assert p.wait() == 1
    want = ("safetensors_rust.SafetensorError: Error while deserializing header: "
            "incomplete metadata, file not fully covered")
    assert want in p.output


def test_missing_shard_and_broken_symlink(procs, tmp_path, model):
    (model / "model-00003-of-00003.safetensors").unlink()
    p = start(procs, tmp_path, ["serve", str(model), "--port", str(free_port())], name="missing")
    assert p.wait() == 1 and "were not initialized from checkpoint" in p.output
    snap = generate(tmp_path / "hf", "testorg/tiny-dense", "2" * 40, "hf-cache", 2, 16 * 1024)
    (snap / "model-00001-of-00002.safetensors").resolve().unlink()
    p = start(procs, tmp_path, ["serve", str(snap), "--port", str(free_port())], name="dangling")
    assert p.wait() == 1 and "FileNotFoundError" in p.output


def test_crash_marker_and_env(procs, tmp_path, model):
    (tmp_path / "models" / ".standin-crash").write_text("")
    p = start(procs, tmp_path, ["serve", str(model), "--port", str(free_port())], name="marker")
    assert p.wait() == 1 and "CUDA error" in p.output
    os.unlink(tmp_path / "models" / ".standin-crash")
    p = start(procs, tmp_path, ["serve", str(model), "--port", str(free_port())], env={"STANDIN_CRASH": "1"},
              name="env")
    assert p.wait() == 1 and "CUDA error" in p.output


def test_gpu_count_checked(procs, tmp_path, model):
    p = start(procs, tmp_path, ["serve", str(model), "-tp", "2", "--port", str(free_port())], name="tp2")
    assert p.wait() == 1 and "GPUs" in p.output
    p = start(procs, tmp_path, ["serve", str(model), "-tp", "3", "--nnodes", "2", "--port", str(free_port())],
              name="div")
    assert p.wait() == 1 and "divisible" in p.output


def _pair(procs, tmp_path, model, head_extra=(), worker_extra=(), env=None):
    mport, port = free_port(), free_port()
    common = ["-tp", "2", "--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", str(mport)]
    worker = start(procs, tmp_path, ["serve", str(model), *common, "--node-rank", "1", "--headless", *worker_extra],
                   env=env, name="worker")
    head = start(procs, tmp_path, ["serve", str(model), *common, "--node-rank", "0", "--host", "127.0.0.1",
                                   "--port", str(port), "--served-model-name", "moe", *head_extra],
                 env=env, name="head")
    return head, worker, port


def test_two_node_rendezvous_then_worker_death(procs, tmp_path, model):
    head, worker, port = _pair(procs, tmp_path, model)
    wait_for(lambda: http_get(f"http://127.0.0.1:{port}/health")[0] == 200, what="head healthy")
    assert json.loads(http_get(f"http://127.0.0.1:{port}/v1/models")[1])["data"][0]["id"] == "moe"
    assert "node rank 1 joined" in head.output
    assert worker.alive()
    worker.p.kill()
    wait_for(lambda: http_get(f"http://127.0.0.1:{port}/health")[0] == 503, what="head unhealthy")
    assert "died unexpectedly" in head.output
    assert head.alive()


def test_head_waits_for_workers_and_worker_exits_when_head_dies(procs, tmp_path, model):
    mport, port = free_port(), free_port()
    common = ["-tp", "2", "--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", str(mport)]
    head = start(procs, tmp_path, ["serve", str(model), *common, "--host", "127.0.0.1", "--port", str(port)],
                 name="head")
    wait_for(lambda: "Waiting for 1 headless node" in head.output, what="head waiting")
    assert http_get(f"http://127.0.0.1:{port}/health")[0] == 0  # no API before the rendezvous, as vLLM
    worker = start(procs, tmp_path, ["serve", str(model), *common, "--node-rank", "1", "--headless"], name="worker")
    wait_for(lambda: http_get(f"http://127.0.0.1:{port}/health")[0] == 200, what="head healthy")
    head.p.kill()
    assert worker.wait(15) == 1
    assert "lost connection to the head" in worker.output


def test_rendezvous_mismatch_is_an_error(procs, tmp_path, model):
    other = generate(tmp_path / "m2", "testorg/other", REV, "plain", 1, 8192)
    mport = free_port()
    common = ["--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", str(mport)]
    h = start(procs, tmp_path, ["serve", str(model), "-tp", "2", *common, "--port", str(free_port()),
                                "--host", "127.0.0.1"], name="h2")
    w = start(procs, tmp_path, ["serve", str(other), "-tp", "2", *common, "--node-rank", "1", "--headless"], name="w2")
    assert h.wait(15) == 1 and w.wait(15) == 1
    assert "different configuration" in h.output
    assert "rendezvous" in w.output


def test_head_times_out_without_workers(procs, tmp_path, model):
    p = start(procs, tmp_path, ["serve", str(model), "-tp", "2", "--nnodes", "2", "--master-addr", "127.0.0.1",
                                "--master-port", str(free_port()), "--port", str(free_port())],
              env={"VLLM_ENGINE_READY_TIMEOUT_S": "1"})
    assert p.wait(10) == 1 and "Timed out" in p.output


def test_sigterm_while_waiting_is_prompt(procs, tmp_path, model):
    p = start(procs, tmp_path, ["serve", str(model), "-tp", "2", "--nnodes", "2", "--master-addr", "127.0.0.1",
                                "--master-port", str(free_port()), "--port", str(free_port())])
    wait_for(lambda: "Waiting for" in p.output, what="waiting")
    p.terminate()
    assert p.wait(3) == 0


def _engine(port: int) -> dict[str, float]:
    """The stand-in's scheduler counters, read off /metrics as the probe reads vLLM's."""
    _, text = http_get(f"http://127.0.0.1:{port}/metrics")
    out = {}
    for line in text.splitlines():
        if line.startswith(("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:generation_tokens_total")):
            out[line.split("{")[0].removeprefix("vllm:")] = float(line.rsplit(" ", 1)[1])
    return out


def test_the_scheduler_runs_max_num_seqs_and_queues_the_rest_first_come_first_served(procs, tmp_path, model):
    """vLLM's shape: one slot (`--max-num-seqs 1`), a token every 20 ms: a second request waits in the queue while
    the first generates, the counters show it, and the tokens grow while it runs; SIGUSR1 wedges the engine
    (/health still 200, no token), SIGUSR2 releases it."""
    import signal
    import threading

    port = free_port()
    p = start(procs, tmp_path, ["serve", str(model), "--host", "127.0.0.1", "--port", str(port), "--max-num-seqs",
                                "1", "--served-model-name", "moe"], env={"STANDIN_STEPS_PER_S": "50"})
    wait_for(lambda: http_get(f"http://127.0.0.1:{port}/health")[0] == 200, what="health 200")
    answers: list[int] = []

    def ask():
        code, _ = http_post(f"http://127.0.0.1:{port}/v1/completions",
                            b'{"model": "moe", "prompt": "hi", "max_tokens": 100}', timeout=30)
        answers.append(code)

    clients = [threading.Thread(target=ask) for _ in range(2)]
    for c in clients:
        c.start()
    wait_for(lambda: _engine(port).get("num_requests_waiting") == 1.0, what="the second request queued")
    assert _engine(port)["num_requests_running"] == 1.0
    first = _engine(port)["generation_tokens_total"]
    wait_for(lambda: _engine(port)["generation_tokens_total"] > first, what="tokens while it runs")
    p.p.send_signal(signal.SIGUSR1)
    seen: list[float] = []

    def standing_still() -> bool:  # two reads a poll apart (>= 5 steps at 50 tokens/s) that agree
        seen.append(_engine(port)["generation_tokens_total"])
        return len(seen) > 1 and seen[-1] == seen[-2]

    wait_for(standing_still, what="the counters to stand still", interval=0.2)
    assert seen[-1] < 200, "wedged before the two requests were done"
    assert http_get(f"http://127.0.0.1:{port}/health")[0] == 200, "a wedged engine still answers /health"
    p.p.send_signal(signal.SIGUSR2)
    for c in clients:
        c.join(30)
    assert answers == [200, 200] and _engine(port)["generation_tokens_total"] == 200.0
