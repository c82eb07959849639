"""The GPU stack as the probe reads it, from nvidia-smi's output recorded on a real driver
(fixtures/nvidia-smi/, copied from the project's recordings: an H200 on driver 580.159.04, the branch DGX OS ships
for the GB10; each file ends with `exit=N`), and what the plan makes of it: a serving node whose GPU stack fails
stops nothing; nodes on different drivers or kernels are a warning."""

from __future__ import annotations

from pathlib import Path

import pytest

from reconciler.core.observed import GpuStack, Observed
from reconciler.core.planning import plan
from reconciler.edge.facts.base import ProbeError, Section
from reconciler.edge.facts.gpu import parse_gpu_stack
from reconciler.loop import conditions
from tests.unit.recorded import WORKERS, changed, load

RECORDED = Path(__file__).parents[1] / "fixtures" / "nvidia-smi"
OS = Section("6.17.0-1014-nvidia\nDGX_SWBUILD_VERSION=\"7.2.3\"\nDGX_OTA_VERSION=\"7.4.0\"\n", 0)
HOOK = Section("/usr/bin/nvidia-container-runtime-hook\n", 0)
GPUS = ("    gpus: null                      # no GPU here", "    gpus: all")


def recorded(name: str) -> Section:
    """A recording as the probe's section: the output, and the exit status from its last line."""
    *body, status = (RECORDED / name).read_text().splitlines()
    assert status.startswith("exit=")
    return Section("\n".join(body) + "\n", int(status.removeprefix("exit=")))


def test_the_gpu_and_driver_are_read_with_the_kernel_and_the_dgx_release():
    stack = parse_gpu_stack(recorded("q-noheader.txt"), HOOK, OS)
    assert stack == GpuStack(gpu="NVIDIA H200", driver="580.159.04", hook=True, kernel="6.17.0-1014-nvidia",
                             dgx_os="7.4.0")


@pytest.mark.parametrize(("name", "status", "first"), [
    ("q-no-such-gpu.txt", 6, "No devices were found"),
    ("q-bad-field.txt", 2, 'Field "bogus_field" is not a valid field to query.'),
])
def test_a_failing_nvidia_smi_keeps_its_exit_status_and_first_line(name, status, first):
    stack = parse_gpu_stack(recorded(name), HOOK, OS)
    assert stack is not None and (stack.gpu, stack.status, stack.error) == (None, status, first)


@pytest.mark.parametrize("body", ["NVIDIA H200\n",                    # one field: not what was asked
                                  "NVIDIA H200, five-eighty\n"])       # a driver that is not a version
def test_a_line_that_is_not_name_and_driver_is_odd_output(body):
    with pytest.raises(ProbeError, match="gpu"):
        parse_gpu_stack(Section(body, 0), HOOK, OS)


def test_not_asked_is_not_read():
    assert parse_gpu_stack(None, None, None) is None


# ------------------------------------------------------------------------------------------------ the plan

MISMATCH = GpuStack(error="Failed to initialize NVML: Driver/library version mismatch", status=18, hook=True,
                    kernel="6.17.0-1014-nvidia")
GB10 = GpuStack(gpu="NVIDIA GB10", driver="580.95.05", hook=True, kernel="6.17.0-1014-nvidia", dgx_os="7.4.0")


def _stacks(seen: Observed, **per_node: GpuStack) -> Observed:
    for name in ("head", *WORKERS):
        seen = changed(seen, name, gpu_stack=per_node.get(name, GB10))
    return seen


@pytest.mark.parametrize(("stack", "words"), [
    (MISMATCH, "nvidia-smi exited 18: Failed to initialize NVML: Driver/library version mismatch (the driver was "
               "updated without a reboot: reboot the node once the running generation can be spared)"),
    (GB10.model_copy(update={"hook": False}), "could not select device driver \"\" with capabilities: [[gpu]]"),
])
def test_a_serving_change_waits_for_a_gpu_stack_that_fails(seen, stack, words):
    desired = load(GPUS, ("max_model_len: 4096", "max_model_len: 8192"))
    result = plan(desired, _stacks(seen, worker2=stack))
    assert result.steps == [] and [b.node for b in result.blocked] == ["worker2"]
    [gpu] = [d for d in result.drift if d.kind == "gpu"]
    assert gpu.node == "worker2" and gpu.blocking and not gpu.actionable and words in gpu.observed


def test_a_stack_that_answers_restarts_as_before_and_without_gpus_nothing_is_judged(seen):
    change = ("max_model_len: 4096", "max_model_len: 8192")
    with_gpus = plan(load(GPUS, change), _stacks(seen))
    without = plan(load(change), _stacks(seen, head=MISMATCH))
    for result in (with_gpus, without):
        assert result.blocked == [] and [s.kind for s in result.steps].count("stop-serving") == 4


def _uniform(observed: Observed) -> dict:
    snap = conditions.Snapshot(generation=1, observed_generation=1, observed=observed)
    [cond] = [c for c in conditions.conditions(snap, list(observed.nodes), [], 0.0) if c["type"] == "GpuStackUniform"]
    return cond


def test_nodes_on_different_drivers_are_a_warning_not_drift(seen):
    behind = GB10.model_copy(update={"driver": "580.82.09", "dgx_os": "7.2.3"})
    observed = _stacks(seen, worker1=behind)
    cond = _uniform(observed)
    assert (cond["status"], cond["reason"]) == ("False", "StackSkew")
    assert cond["message"] == ("driver 580.95.05 on head, 580.82.09 on worker1, 580.95.05 on worker2, 580.95.05 on "
                               "worker3; DGX OS 7.4.0 on head, 7.2.3 on worker1, 7.4.0 on worker2, 7.4.0 on worker3")
    assert not [d for d in plan(load(GPUS), observed).drift if d.kind == "gpu"]
    assert _uniform(_stacks(seen))["status"] == "True" and _uniform(seen)["status"] == "Unknown"
