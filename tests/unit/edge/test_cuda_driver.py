"""Driver against image (issue 52, item 5): the serving image's CUDA (its own ENV, read by the same throw-away
container that lists its flags) against each node's driver, before anything stops. Below the CUDA major's floor
the start blocks and GLM keeps serving; in minor-version compatibility it is said and the start goes on.

The floors are NVIDIA's (CUDA Compatibility, "Minor Version Compatibility", table 1); the drivers are the ones
public GB10s show (580.95.05 in the seed, 580.159.04 in shared/reference/recorded/nvidia-smi/nvidia-smi-busy.txt).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from reconciler.core.cuda import judge
from reconciler.core.drift import diff
from reconciler.core.loader import load_file
from reconciler.core.observed import Observed, ServeFlags
from reconciler.core.planning import plan
from reconciler.core.spec import Desired
from reconciler.core.vllm import parse_serve_help
from reconciler.edge.image_flags import ask_serve_flags
from reconciler.edge.ssh import Result

HEAD = "spark-1a32"
#: What an NGC image built on CUDA 13.2.1 sets (the CUDA base images' ENV; NGC adds CUDA_DRIVER_VERSION, the driver
#: its toolkit shipped with).
NGC = {"cuda_version": "13.2.1.006", "cuda_driver_version": "595.58.03",
       "require_cuda": "cuda>=13.2 brand=unknown,driver>=580,driver<581 brand=grid,driver>=580,driver<581"}


@pytest.mark.parametrize(("driver", "cuda", "shipped", "blocking"), [
    ("575.57.08", "13.2.1.006", "595.58.03", True),     # below 13's floor: nothing runs
    ("580.95.05", "13.2.1.006", "595.58.03", False),    # the GB10's branch: minor-version compatibility, said
    ("580.159.04", "13.0.2", "580.95.05", None),        # newer than what the toolkit shipped with: fine
    ("595.58.03", "13.2.1.006", "595.58.03", None),
    ("535.183.01", "12.9.1", "575.57.08", False),       # 12.x on a 535 driver: compatibility
    ("520.61.05", "12.1.0", "530.30.02", True),         # below 12's floor (525)
    ("580.95.05", None, None, None),                    # an image that does not say: not judged
    (None, "13.2.1.006", "595.58.03", None),            # nvidia-smi failed: its own drift says so
])
def test_the_driver_is_judged_against_the_images_cuda(driver, cuda, shipped, blocking):
    verdict = judge(driver, cuda, shipped, None)
    assert (None if verdict is None else verdict.blocking) == blocking, verdict


def test_the_major_comes_from_nvidia_require_cuda_when_cuda_version_is_not_set():
    verdict = judge("575.57.08", None, None, NGC["require_cuda"])
    assert verdict is not None and verdict.blocking and "CUDA 13's floor (580)" in verdict.why


def _seed(cluster_yaml, seed_snapshot, driver: str) -> tuple[Desired, Observed]:
    desired = Desired.model_validate(load_file(cluster_yaml).data)
    raw = json.loads(seed_snapshot.read_text())
    for node in raw["nodes"].values():  # a GB10 whose stack answers, at `driver`
        node["gpu_stack"] = {"gpu": "NVIDIA GB10", "driver": driver, "hook": True, "kernel": "6.11.0-1016-nvidia"}
    observed = Observed.model_validate(raw)
    image_id = observed.node(HEAD).images[desired.serving.image].id
    help_all = (Path(__file__).parents[2] / "fixtures" / "vllm-0.20.1-serve-help-all.txt").read_text()
    flags = ServeFlags(image_id=image_id, flags=parse_serve_help(help_all), has_ray=False, version="0.20.1", **NGC)
    return desired, observed.model_copy(update={"serve_flags": flags})


def test_a_driver_below_the_floor_blocks_before_glm_is_stopped(cluster_yaml, seed_snapshot):
    desired, observed = _seed(cluster_yaml, seed_snapshot, "575.57.08")
    cuda = [d for d in diff(desired, observed) if d.resource.endswith("/cuda")]
    assert cuda and all(d.blocking and not d.actionable for d in cuda), cuda
    steps = plan(desired, observed).steps
    assert not [s for s in steps if s.kind in ("start-serving", "stop-container", "stop-serving")], steps


def test_minor_version_compatibility_is_said_and_the_start_goes_on(cluster_yaml, seed_snapshot):
    desired, observed = _seed(cluster_yaml, seed_snapshot, "580.95.05")
    cuda = [d for d in diff(desired, observed) if d.resource.endswith("/cuda")]
    assert cuda and not any(d.blocking for d in cuda) and "minor-version compatibility" in cuda[0].observed
    assert any(s.kind == "start-serving" for s in plan(desired, observed).steps)


class _Session:
    def __init__(self, stdout: str):
        self.stdout, self.argv = stdout, None

    def run(self, argv, timeout, check):
        self.argv = argv
        return Result(self.stdout, "", 0)


def test_the_images_own_env_is_read_by_the_flags_query(cluster_yaml):
    """The lines the query script prints (run for real by sh in test_image_query_script below) parse into the
    answer; an empty variable is None, and a hostile value is made printable and capped."""
    desired = Desired.model_validate(load_file(cluster_yaml).data)
    out = ("@@ray no\n@@version 0.20.1\n@@env CUDA_VERSION=13.2.1.006\n@@env CUDA_DRIVER_VERSION=\n"
           f"@@env NVIDIA_REQUIRE_CUDA={'x' * 5000}\x1b[31m\n  --max-model-len MAX_MODEL_LEN\n")
    answer = ask_serve_flags(desired, {HEAD: _Session(out)}, HEAD,  # type: ignore[dict-item]
                             "sha256:" + "e" * 64)
    assert answer.cuda_version == "13.2.1.006" and answer.cuda_driver_version is None
    assert answer.require_cuda is not None and len(answer.require_cuda) == 2000 and "\x1b" not in answer.require_cuda


def test_image_query_script_prints_the_images_env():
    import subprocess

    from reconciler.edge.image_flags import _ASK_IMAGE
    script = _ASK_IMAGE.replace("exec vllm serve --help=all", "true")
    env = {"PATH": "/usr/bin:/bin", "CUDA_VERSION": "13.2.1.006", "NVIDIA_REQUIRE_CUDA": NGC["require_cuda"]}
    out = subprocess.run(["sh", "-c", script], capture_output=True, text=True, env=env, check=True,
                         timeout=30).stdout
    assert "@@env CUDA_VERSION=13.2.1.006\n" in out and "@@env CUDA_DRIVER_VERSION=\n" in out
    assert f"@@env NVIDIA_REQUIRE_CUDA={NGC['require_cuda']}\n" in out
