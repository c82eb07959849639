"""Shared fixtures for the unit tests of the desired-state model, the loader and the CLI."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from reconciler.core import spec
from tests.unit.edits import edited

REPO = Path(__file__).resolve().parents[2]

# A short valid two-node desired state (the same base the files in invalid/ start from, without their first line).
BASE_YAML = """\
nodes:
  - name: head-a
    role: head
    ssh:
      host: 10.0.0.1
    fabric:
      interface: enp1s0f1np1
      rdma_device: rocep1s0f1
      address: 192.168.200.12/24
  - name: worker-b
    role: worker
    ssh:
      host: 192.168.200.13
      jump: head-a
    fabric:
      interface: enp1s0f1np1
      rdma_device: rocep1s0f1
      address: 192.168.200.13/24
    internet: false
model:
  id: Qwen/Qwen3.5-122B-A10B-FP8
  path: /home/spark/.cache/huggingface/hub
serving:
  image: nvcr.io/nvidia/vllm:26.05-py3
  tensor_parallel_size: 2
  port: 8000
  gpu_memory_utilization: 0.8
  extra_args: ["--enforce-eager"]
  env:
    VLLM_ENGINE_READY_TIMEOUT_S: "3600"
co_tenants:
  allowed:
    head-a: [vllm_embeddings, reranker]
  unlisted: stop
policy:
  resync_interval: 30s
  listen: 127.0.0.1:9464
...
"""


@pytest.fixture(scope="session")
def repo() -> Path:
    return REPO


@pytest.fixture(scope="session")
def cluster_yaml() -> Path:
    return REPO / "desired-state" / "cluster.yaml"


@pytest.fixture(scope="session")
def seed_snapshot() -> Path:
    return REPO / "tests" / "fixtures" / "seed-observed.json"


@pytest.fixture(scope="session")
def console_script() -> str:
    """The installed `reconciler` entry point of this venv (not `python -m`): what an operator runs."""
    venv_script = REPO / ".venv" / "bin" / "reconciler"
    found = str(venv_script) if venv_script.exists() else shutil.which("reconciler")
    assert found, "the `reconciler` console script is not installed (pip install -e .)"
    return found


@pytest.fixture
def base_yaml() -> str:
    return BASE_YAML


@pytest.fixture
def edit() -> Callable[..., str]:
    """edit((old, new), ...) -> the base text with each `old` replaced once (asserting it was there)."""
    return lambda *subs: edited(BASE_YAML, *subs)


@pytest.fixture
def problems() -> Callable[[str | bytes], list[str]]:
    """Rendered problem lines for a text (filename `X`); [] when it is valid."""

    def run(text: str | bytes) -> list[str]:
        try:
            spec.loads(text, "X")
        except spec.InvalidDesiredState as exc:
            return exc.lines()
        return []

    return run


class TooMuchWork(AssertionError):
    """Raised by the work meter: the loader built more values than its caps allow."""


@pytest.fixture
def build_meter(monkeypatch) -> Callable[[], int]:
    """Count the values the YAML loader builds for a document (the last one loaded), and stop it as soon as it
    exceeds its caps.

    Bounded *work*, not wall time, is what a cap promises (timing fails under load). And a regression in the
    alias cap must fail in milliseconds, not eat all memory until the OOM killer ends pytest: the meter raises
    once one document goes past the expansion cap plus the depth of one path, whatever the loader does."""
    from reconciler.core import loader

    limit = loader.MAX_EXPANDED_NODES + loader.MAX_DEPTH + 1
    real = loader._Builder.build
    meter = _Meter()

    def counted(self, node, loc):
        if meter.builder is not self:
            meter.builder, meter.built = self, 0
        meter.built += 1
        if meter.built > limit:
            raise TooMuchWork(f"the loader built more than {limit} values: its expansion cap does not hold")
        return real(self, node, loc)

    monkeypatch.setattr(loader._Builder, "build", counted)
    return lambda: meter.built


class _Meter:
    builder: object = None
    built: int = 0


@pytest.fixture(scope="session", autouse=True)
def _sample_secrets():
    """desired-state/cluster.yaml declares serving.secrets VLLM_API_KEY: the daemon takes its value from its
    environment (systemd EnvironmentFile), so the tests that run the loop or the CLI on the sample provide one."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("VLLM_API_KEY", "sk-unit-tests-0123456789")
        yield


def converged_in_simulator(desired, seed_snapshot: Path):
    """The seed snapshot after the simulator applied the plan until nothing is left (the shared starting point of
    the loop's, the health watch's and the ownership tests)."""
    import json

    from reconciler.core.observed import Observed
    from reconciler.core.planning import plan
    from reconciler.core.simulate import apply_plan

    after = Observed.model_validate(json.loads(seed_snapshot.read_text()))
    for _ in range(3):
        after = apply_plan(desired, after, plan(desired, after))
    assert not plan(desired, after).changes
    return after


@pytest.fixture
def desired():
    """The recorded converged 4-node cluster's desired state (tests/unit/recorded.py), for the case tests; a
    module with a `desired` of its own overrides it."""
    from tests.unit.recorded import load

    return load()


@pytest.fixture
def seen(desired):
    """What the probe really printed on that cluster, parsed: it plans nothing (checked here, once per test)."""
    from reconciler.core.planning import plan
    from tests.unit.recorded import observe

    observed = observe(desired)
    result = plan(desired, observed)
    assert (result.drift, result.steps, result.blocked) == ([], [], []), "the recording must plan nothing"
    return observed


@pytest.fixture
def nodes(tmp_path, monkeypatch):
    """Two nodes that are this machine (`test_weights_tree.Local`: homes under tmp_path), the hop between them
    made local: for the weights copy and retention's removal on real files."""
    from reconciler.edge.steps import hop
    from tests.unit.steps.test_weights_tree import Local

    monkeypatch.setattr(hop, "trust_target_on_source", lambda desired, source, target: iter(()))
    monkeypatch.setattr(hop, "ssh_options", lambda desired, target: ["ssh"])
    monkeypatch.setattr(hop, "address", lambda desired, target: "spark@192.0.2.1")
    return {"src": Local(tmp_path / "home-src"), "dst": Local(tmp_path / "home-dst")}


@pytest.fixture
def desired_path(cluster_yaml, tmp_path):
    """The sample desired state as a file of the test's own (a controller reads and watches its path)."""
    path = tmp_path / "cluster.yaml"
    path.write_text(cluster_yaml.read_text())
    return path


@pytest.fixture
def converged(desired_path, seed_snapshot):
    """The seed converged in the simulator under the sample file, with the sample's secrets (a test module may
    define its own)."""
    from reconciler.core.spec import load

    return converged_in_simulator(load(desired_path, os.environ), seed_snapshot)
