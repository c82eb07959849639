"""The `ray` stand-in and `vllm serve --distributed-executor-backend ray`, as host processes on 127.0.0.1."""

import json

import pytest

from testbed.proc import free_port, wait_for
from testbed.standin.testing import Proc, http_get
from testbed.weights import generate

REV = "1" * 40


@pytest.fixture
def procs():
    started = []
    yield started
    for p in started:
        p.stop()


def test_ray_cluster_status_and_vllm_on_ray(procs, tmp_path):
    model = generate(tmp_path / "models", "testorg/tiny-moe", REV, "plain", 2, 16 * 1024)
    gcs = free_port()
    env_head = {"RAY_TMPDIR": str(tmp_path / "ray-head")}
    env_worker = {"RAY_TMPDIR": str(tmp_path / "ray-worker")}

    def start(args, env, name, program="ray"):
        p = Proc(program, args, tmp_path, env=env, name=name)
        procs.append(p)
        return p

    def status():
        s = start(["status"], env_head, f"status{len(procs)}")
        s.wait(10)
        return s

    bad = start(["start", "--head", "--bogus"], env_head, "bad")
    assert bad.wait(10) == 2 and "No such option: --bogus" in bad.output
    nohead = start(["status"], env_worker, "nohead")
    assert nohead.wait(10) == 1 and "Could not find any running Ray instance" in nohead.output

    head = start(["start", "--head", "--port", str(gcs), "--node-ip-address", "127.0.0.1", "--block"], env_head, "head")
    wait_for(lambda: "Ray runtime started." in head.output, what="ray head")
    worker = start(["start", f"--address=127.0.0.1:{gcs}", "--node-ip-address", "127.0.0.1", "--block"], env_worker,
                   "worker")
    wait_for(lambda: "0.0/2.0 GPU" in status().output, what="2 GPUs in ray status")
    out = status().output
    assert "======== Autoscaler status" in out and "Active:" in out
    assert sum(1 for line in out.splitlines() if line.startswith(" 1 node_")) == 2

    # tp 3 > 2 GPUs: the Ray resource error
    big = start(["serve", str(model), "-tp", "3", "--distributed-executor-backend", "ray", "--port", str(free_port())],
                env_head, "big", program="vllm")
    assert big.wait(15) == 1
    assert "No available node types can fulfill resource request" in big.output

    port = free_port()
    start(["serve", str(model), "-tp", "2", "--distributed-executor-backend", "ray", "--host", "127.0.0.1",
               "--port", str(port)], env_head, "vllm", program="vllm")
    wait_for(lambda: http_get(f"http://127.0.0.1:{port}/health")[0] == 200, what="vllm on ray healthy")
    assert json.loads(http_get(f"http://127.0.0.1:{port}/v1/models")[1])["data"][0]["id"] == str(model)

    worker.p.kill()
    wait_for(lambda: "0.0/1.0 GPU" in status().output, what="ray head notices the dead node")
    wait_for(lambda: http_get(f"http://127.0.0.1:{port}/health")[0] == 503, what="vllm unhealthy")

    worker2 = start(["start", f"--address=127.0.0.1:{gcs}", "--block"], env_worker, "worker2")
    wait_for(lambda: "0.0/2.0 GPU" in status().output, what="node back")
    head.p.kill()
    assert worker2.wait(15) == 1
    assert "Failed to connect to GCS" in worker2.output


def test_ray_checks_weights_on_every_node(procs, tmp_path):
    model = generate(tmp_path / "models", "testorg/tiny-moe", REV, "plain", 2, 16 * 1024)
    gcs = free_port()
    env = {"RAY_TMPDIR": str(tmp_path / "ray")}
    head = Proc("ray", ["start", "--head", "--port", str(gcs), "--node-ip-address", "127.0.0.1", "--block"], tmp_path,
                env=env, name="head")
    procs.append(head)
    wait_for(lambda: "Ray runtime started." in head.output, what="ray head")
    shard = model / "model-00001-of-00002.safetensors"
    shard.write_bytes(shard.read_bytes()[:-1])
    v = Proc("vllm", ["serve", str(model), "--distributed-executor-backend", "ray", "--port", str(free_port())],
             tmp_path, env=env, name="vllm")
    procs.append(v)
    assert v.wait(15) == 1 and "file not fully covered" in v.output


def test_ray_start_without_block_daemonizes_and_stop(procs, tmp_path):
    gcs = free_port()
    env = {"RAY_TMPDIR": str(tmp_path / "ray")}
    s = Proc("ray", ["start", "--head", "--port", str(gcs), "--node-ip-address", "127.0.0.1"], tmp_path, env=env,
             name="start")
    procs.append(s)
    assert s.wait(15) == 0 and "Ray runtime started." in s.output
    st = Proc("ray", ["status"], tmp_path, env=env, name="status")
    assert st.wait(10) == 0 and "0.0/1.0 GPU" in st.output
    stop = Proc("ray", ["stop"], tmp_path, env=env, name="stop")
    assert stop.wait(10) == 0 and "Stopped all 1 Ray processes." in stop.output

    def gone():
        st = Proc("ray", ["status"], tmp_path, env=env, name="status2")
        return st.wait(10) == 1

    wait_for(gone, what="daemon stopped")
