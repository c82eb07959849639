"""The stand-in images built for real and run in a throwaway docker engine (own socket, data root, exec root under
/tmp; --network host containers talking over 127.0.0.1 only). Needs root and Debian's docker.io (dockerd, runc)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path

import pytest

from testbed.images import IMAGES, archive, build
from testbed.proc import free_port, wait_for
from testbed.standin.testing import http_get
from testbed.weights import generate

pytestmark = pytest.mark.e2e


# this throwaway engine is not a testbed node (no memory budget): the stand-in holds gmu x a pretend 64 MiB node
SMALL_NODE = f"STANDIN_NODE_MEMORY_BYTES={64 << 20}"


@pytest.fixture(scope="module")
def engine():
    if os.geteuid() != 0 or not shutil.which("dockerd"):
        pytest.fail("needs root and dockerd: run `make test` (it installs docker.io, runc, containerd)")
    d = Path(tempfile.mkdtemp(prefix="tbimg-", dir="/tmp"))
    sock = d / "docker.sock"
    log = open(d / "dockerd.log", "wb")  # noqa: SIM115 - closed in the finally below
    p = subprocess.Popen(
        ["dockerd", "--host", f"unix://{sock}", "--data-root", str(d / "data"), "--exec-root", str(d / "exec"),
         "--pidfile", str(d / "docker.pid"), "--iptables=false", "--ip6tables=false", "--bridge=none"],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )
    host = f"unix://{sock}"
    try:
        wait_for(lambda: docker(host, "version", check=False).returncode == 0, timeout=60, interval=0.2,
                 what="throwaway dockerd")
        yield host
    finally:
        subprocess.run(["docker", "rm", "-f", *docker(host, "ps", "-aq", check=False).stdout.split()],
                       env=dict(os.environ, DOCKER_HOST=host), capture_output=True, check=False)
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(10)
        log.close()
        _umount_under(d)
        shutil.rmtree(d, ignore_errors=True)


def _umount_under(d: Path) -> None:
    """dockerd leaves mounts behind (exec-root/netns/default is an nsfs bind mount): unmount them, deepest first."""
    with open("/proc/mounts") as f:
        points = [line.split()[1] for line in f]
    for mp in sorted((m for m in points if m == str(d) or m.startswith(f"{d}/")), key=len, reverse=True):
        subprocess.run(["umount", "-l", mp], capture_output=True, check=False)


def docker(host: str, *args: str, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess:
    res = subprocess.run(["docker", *args], env=dict(os.environ, DOCKER_HOST=host), capture_output=True, text=True,
                         timeout=timeout, check=False)
    if check and res.returncode:
        raise AssertionError(f"docker {args}: {res.stderr}")
    return res


def stopped_by_sigterm(engine, name: str) -> bool:
    """`docker stop` ended the container by its own SIGTERM handling, not by the SIGKILL after the grace period
    (exit 137): the property a fast stop depends on, without timing it."""
    return docker(engine, "inspect", "-f", "{{.State.ExitCode}}", name).stdout.strip() != "137"


@pytest.fixture(scope="module")
def images(engine):
    return build(engine)  # archive cached in $SPARK_TESTBED_IMAGE_CACHE (default /var/cache/spark-testbed/images)


def test_build_ids_are_stable_distinct_and_cached(engine, images):
    assert set(images) == set(IMAGES)
    assert len(set(images.values())) == 2
    path = archive()[0]
    written = path.stat().st_mtime_ns
    assert build(engine) == images
    assert archive() == (path, images) and path.stat().st_mtime_ns == written, "cached: the archive is not rebuilt"
    out = docker(engine, "image", "inspect", "vllm-standin:latest").stdout
    info = json.loads(out)[0]
    assert info["Id"] == images["vllm-standin:latest"]
    assert info["Size"] < 100 << 20
    assert info["Config"]["Labels"]["org.spark-testbed.image"] == "vllm-standin"


def test_cli_in_the_image(engine, images):
    r = docker(engine, "run", "--rm", "--network", "host", "vllm-standin:latest", "vllm", "serve", "m", "--nope",
               check=False)
    assert r.returncode == 2 and "unrecognized arguments: --nope" in r.stderr
    r = docker(engine, "run", "--rm", "--network", "host", "vllm-standin:latest", "sh", "-c",
               "bash -c 'echo $BASH_VERSION' && sleep 0.01 && ls /usr/local/bin && ray --version")
    assert r.returncode == 0, r.stderr
    assert "vllm" in r.stdout and "cotenant" in r.stdout and "ray, version" in r.stdout


def test_two_containers_rendezvous_and_stop_fast(engine, images, tmp_path):
    models = tmp_path / "hf"
    generate(models, "testorg/tiny-dense", "2" * 40, "hf-cache", 2, 64 * 1024)
    mport, port = free_port(), free_port()
    common = ["--network", "host", "-v", f"{models}:/root/.cache/huggingface", "-e", "HF_HUB_OFFLINE=1",
              "-e", "STANDIN_PEER_TIMEOUT_S=2", "-e", SMALL_NODE]
    flags = ["-tp", "2", "--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", str(mport)]
    docker(engine, "run", "-d", "--name", "tbw", *common, "vllm-standin:latest", "vllm", "serve", "testorg/tiny-dense",
           *flags, "--node-rank", "1", "--headless")
    docker(engine, "run", "-d", "--name", "tbh", *common, "vllm-standin:latest", "vllm", "serve", "testorg/tiny-dense",
           *flags, "--host", "127.0.0.1", "--port", str(port), "--served-model-name", "dense")
    wait_for(lambda: http_get(f"http://127.0.0.1:{port}/health")[0] == 200, timeout=30, what="head healthy")
    assert json.loads(http_get(f"http://127.0.0.1:{port}/v1/models")[1])["data"][0]["id"] == "dense"
    docker(engine, "stop", "tbw")
    assert stopped_by_sigterm(engine, "tbw")
    wait_for(lambda: http_get(f"http://127.0.0.1:{port}/health")[0] == 503, timeout=15, what="head unhealthy")
    docker(engine, "stop", "tbh")
    assert stopped_by_sigterm(engine, "tbh")
    docker(engine, "rm", "tbh", "tbw")


def test_ray_in_containers(engine, images, tmp_path):
    models = tmp_path / "hf"
    generate(models, "testorg/tiny-moe", "1" * 40, "hf-cache", 2, 32 * 1024)
    gcs, port = free_port(), free_port()
    common = ["--network", "host", "-v", f"{models}:/root/.cache/huggingface", "-e", "HF_HUB_OFFLINE=1",
              "-e", SMALL_NODE]
    docker(engine, "run", "-d", "--name", "rh", *common, "vllm-standin:latest", "ray", "start", "--head", "--port",
           str(gcs), "--node-ip-address", "127.0.0.1", "--block")
    docker(engine, "run", "-d", "--name", "rw", *common, "vllm-standin:latest", "ray", "start",
           f"--address=127.0.0.1:{gcs}", "--node-ip-address", "127.0.0.1", "--block")
    wait_for(lambda: "0.0/2.0 GPU" in docker(engine, "exec", "rh", "ray", "status", check=False).stdout, timeout=20,
             what="2 ray nodes")
    docker(engine, "exec", "-d", "rh", "sh", "-c",
           f"vllm serve testorg/tiny-moe -tp 2 --distributed-executor-backend ray --host 127.0.0.1 --port {port} "
           "> /tmp/vllm.log 2>&1")
    wait_for(lambda: http_get(f"http://127.0.0.1:{port}/health")[0] == 200, timeout=30, what="vllm on ray")
    docker(engine, "rm", "-f", "rw", "rh")


def test_cotenant_image(engine, images):
    port = free_port()
    docker(engine, "run", "-d", "--name", "ct", "--network", "host", "cotenant-standin:latest", "cotenant", "--port",
           str(port), "--hold-mb", "16", "--label", "reranker", "--host", "127.0.0.1")
    wait_for(lambda: http_get(f"http://127.0.0.1:{port}/health")[0] == 200, timeout=20, what="cotenant")
    docker(engine, "stop", "ct")
    assert stopped_by_sigterm(engine, "ct")
    assert docker(engine, "inspect", "-f", "{{.State.ExitCode}}", "ct").stdout.strip() == "0"
    docker(engine, "rm", "ct")
