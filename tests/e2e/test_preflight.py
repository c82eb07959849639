"""Issue 29 end to end: a start that cannot succeed is found before anything stops, and the running generation
keeps answering. Each test converges the seed, makes one thing a new start needs impossible on the real nodes,
asks `apply` for a change that would restart serving, and reads the nodes directly: the same serving containers
(same ids) still run, the API still answers, and the reconciler said what to do."""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
from pathlib import Path

import pytest

from tests.e2e.test_converge import DESIRED, api_models, containers, reconciler, variant

pytestmark = pytest.mark.e2e

OTHER_PLATFORM = "vllm-arm64:preflight"


@pytest.fixture
def serving(seed_testbed):
    """The seed converged: the generation every test here must leave serving."""
    result = reconciler("apply", str(DESIRED), "--yes")
    assert result.returncode == 0, result.stdout + result.stderr
    return seed_testbed


def _arm64_archive(path: Path) -> None:
    """A one-layer image in `docker save` form (manifest.json, the config blob, the layer) for linux/arm64/v8."""
    layer = io.BytesIO()
    with tarfile.open(fileobj=layer, mode="w") as t:
        info = tarfile.TarInfo("x")
        info.size = 2
        t.addfile(info, io.BytesIO(b"x\n"))
    diff_id = hashlib.sha256(layer.getvalue()).hexdigest()
    config = json.dumps({"architecture": "arm64", "os": "linux", "variant": "v8",
                         "config": {"Entrypoint": ["/x"]}, "rootfs": {"type": "layers",
                                                                     "diff_ids": [f"sha256:{diff_id}"]}}).encode()
    config_name = hashlib.sha256(config).hexdigest() + ".json"
    manifest = json.dumps([{"Config": config_name, "RepoTags": [OTHER_PLATFORM],
                            "Layers": [f"{diff_id}/layer.tar"]}]).encode()
    with tarfile.open(path, mode="w") as t:
        for name, data in ((config_name, config), (f"{diff_id}/layer.tar", layer.getvalue()),
                           ("manifest.json", manifest)):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            t.addfile(info, io.BytesIO(data))
    path.chmod(0o644)


def _serving_ids(tb) -> dict[str, str]:
    return {n: containers(tb, n)["vllm_serving"]["Id"] for n in ("head", "worker")}


def _still_serving(tb, before: dict[str, str]) -> None:
    assert _serving_ids(tb) == before, "the running generation was not stopped"
    for n in ("head", "worker"):
        assert containers(tb, n)["vllm_serving"]["State"]["Running"], n
    assert api_models(tb) == ["tiny-moe"], "and it still answers"


def test_an_image_of_another_platform_stops_nothing(serving, tmp_path):
    """The testbed's nodes are x86_64; an arm64 image is what an amd64 tag is on a Spark. It is loaded from a
    `docker save` archive written here whose config says arm64, as a pulled arm64 image's does (docker 20.10's
    `import --platform` records the engine's own platform instead)."""
    tb = serving
    archive = Path("/tmp/spark-preflight-arm64.tar")  # one root filesystem under every node: the head reads it
    _arm64_archive(archive)
    tb.docker("worker", "rmi", "-f", OTHER_PLATFORM, check=False)  # the seed keeps images it did not make
    tb.exec("head", f"docker load -i {archive}", check=True)
    try:
        before = _serving_ids(tb)
        desired = variant(tmp_path, lambda d: d["serving"].update(image=OTHER_PLATFORM))
        result = reconciler("apply", str(desired), "--yes", "--max-passes", "1")
        out = result.stdout + result.stderr
        assert result.returncode != 0, out
        assert "an image for linux/amd64 (uname -m: x86_64)" in out and "linux/arm64/v8 on head" in out, out
        assert "exec format error" in out and "stop-serving" not in out, out
        _still_serving(tb, before)
        images = tb.docker("worker", "images", "--format", "{{.Repository}}:{{.Tag}}").stdout.split()
        assert OTHER_PLATFORM not in images, "nothing is copied to a node it cannot run on"
    finally:
        for node in ("head", "worker"):
            tb.docker(node, "rmi", "-f", OTHER_PLATFORM, check=False)


def test_a_port_another_process_holds_stops_nothing(serving, tmp_path):
    """A web UI listens on the head's 8080 (a Python HTTP server here, bounded by `timeout`); the API is moved
    there. Without the check every rank would be stopped and rank 0 would exit with "Address already in use"."""
    tb = serving
    tb.exec("head", "nohup timeout 300 python3 -m http.server 8080 --bind 0.0.0.0 >/dev/null 2>&1 &", check=True)
    try:
        tb.exec("head", "for i in $(seq 100); do curl -s -o /dev/null http://127.0.0.1:8080/ && exit 0; "
                        "sleep 0.1; done; exit 1", check=True)  # up within 10 s
        before = _serving_ids(tb)
        desired = variant(tmp_path, lambda d: d["serving"].update(port=8080))
        result = reconciler("apply", str(desired), "--yes", "--max-passes", "1")
        out = result.stdout + result.stderr
        assert result.returncode != 0, out
        # the probe finds the port's listener is not root (not our serving): blocking drift that names its uid
        # (issue 31); a root squatter would meet the start's own port check instead
        assert ("port 8080 (serving.port) on head is held by a process the reconciler did not start" in out
                or "port 8080 held by uid" in out), out
        assert "stop-serving" not in out, out
        _still_serving(tb, before)
    finally:
        tb.exec("head", "pkill -f 'http.server 8080'")


@pytest.mark.parametrize("state", ["mismatch", "hung"])
def test_a_gpu_stack_that_fails_stops_nothing(serving, tmp_path, state):
    """The worker's driver updated without a reboot (nvidia-smi: "Driver/library version mismatch"; every
    `docker run --gpus` fails in the toolkit's hook), or nvidia-smi hangs on a wedged driver. A serving change
    would have stopped both ranks and failed to start them; it waits, and says what to do."""
    tb = serving
    before = _serving_ids(tb)
    tb.fault("gpu", "worker", state=state)
    try:
        desired = variant(tmp_path, lambda d: d["serving"].update(max_model_len=8192))
        result = reconciler("apply", str(desired), "--yes", "--max-passes", "1")
        out = result.stdout + result.stderr
        assert result.returncode != 0, out
        words = {"mismatch": "nvidia-smi exited 18: Failed to initialize NVML: Driver/library version mismatch "
                             "(the driver was updated without a reboot",
                 "hung": "nvidia-smi exited 124: no output (nvidia-smi did not answer within 10 s"}[state]
        assert words in out and "stop-serving" not in out, out
        _still_serving(tb, before)
        start = tb.exec("worker", "docker run --rm --gpus all --network none cotenant-standin:latest true")
        assert "nvml error: driver/library version mismatch" in start.stderr or state == "hung", start.stderr
    finally:
        tb.fault("gpu", "worker", state="ok")
    result = reconciler("apply", str(desired), "--yes")
    assert result.returncode == 0, result.stdout + result.stderr
    assert api_models(tb) == ["tiny-moe"], "once the GPU answers, the change goes through"


def test_a_model_that_does_not_fit_on_the_worker_stops_nothing(serving, tmp_path):
    """The worker's model disk is full (a root-owned file, as another user's download would leave it): the
    second model cannot be copied there. The copy is not started, serving is not stopped, and the drift says how
    much to free on which path."""
    tb = serving
    before = _serving_ids(tb)
    tb.fault("fill-disk", "worker", leave=16 << 20)
    try:
        def dense(d):
            d["model"].update(id="testorg/tiny-dense", revision="2" * 40)
            d["serving"]["served_model_name"] = "tiny-dense"

        desired = variant(tmp_path, dense)
        result = reconciler("apply", str(desired), "--yes", "--max-passes", "1")
        out = result.stdout + result.stderr
        assert result.returncode != 0, out
        assert "free on /srv/spark-testbed/worker/models/hub for the copy" in out, out
        assert "the copy would fill the disk" in out and "stop-serving" not in out and "weights/worker" not in \
            out.split("Steps")[-1], out
        _still_serving(tb, before)
        assert tb.exec("worker", "test -e /srv/spark-testbed/worker/models/hub/models--testorg--tiny-dense"
                       ).returncode != 0, "nothing was copied"
    finally:
        tb.fault("free-disk", "worker")
