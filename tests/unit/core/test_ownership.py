"""The reconciler acts only on containers it owns (issue 16, finding 1; docs/security.md "Containers").

Owned = the managed label and this cluster's instance label (or no instance label: created before it existed).
Protected wins over everything; a container under any name but the configured serving name is never removed.
The plan is judged against the observation, and the step over recorded `docker inspect` answers
(tests/unit/step_driver.py).
"""

from __future__ import annotations

import os

import pytest

from reconciler.core.observed import LABEL_INSTANCE, LABEL_MANAGED, Container, Observed
from reconciler.core.planning import Step, plan
from reconciler.core.spec import Desired, load, loads
from reconciler.edge.steps import StepFailed
from reconciler.edge.steps.actions import Given
from reconciler.edge.steps.containers import stop_serving
from tests.unit.conftest import converged_in_simulator
from tests.unit.step_cases import inspected, no_such, reachable
from tests.unit.step_driver import drive

NODE = "spark-1a32"  # the sample's head


@pytest.fixture
def desired(cluster_yaml) -> Desired:
    return load(cluster_yaml, os.environ)


@pytest.fixture
def converged(desired, seed_snapshot) -> Observed:
    return converged_in_simulator(desired, seed_snapshot)


def _with(observed: Observed, *containers: Container) -> Observed:
    node = observed.node(NODE)
    return observed.model_copy(update={"nodes": {**observed.nodes, NODE: node.model_copy(
        update={"containers": [*node.containers, *containers]})}})


def _managed(name: str, instance: str | None = None) -> Container:
    labels = {LABEL_MANAGED: "true", **({LABEL_INSTANCE: instance} if instance else {})}
    return Container(name=name, id=f"id-{name}", image="nvcr.io/nvidia/vllm:26.05-py3", state="running",
                     labels=labels)


def _touching(result, name: str) -> list[str]:
    return [s.id for s in result.steps if s.params.get("container") == name]


def test_a_protected_container_with_the_managed_label_is_never_stopped(cluster_yaml, converged):
    """A copied `docker run` line (or another deployment) carries the managed label: it used to get
    stop-serving, i.e. docker stop then docker rm, although the file protects it."""
    text = cluster_yaml.read_text().replace("  protected: {}", "  protected: {\"*\": [old_serving]}")
    protecting = loads(text).with_secrets(os.environ)
    result = plan(protecting, _with(converged, _managed("old_serving")))
    assert _touching(result, "old_serving") == []


def test_another_reconcilers_container_is_left_alone_and_blocks_our_name(desired, converged):
    foreign = _managed("other_serving", instance="10.9.9.9:22")
    assert _touching(plan(desired, _with(converged, foreign)), "other_serving") == []
    node = converged.node(NODE)
    ours = node.container(desired.serving.container_name)
    taken = ours.model_copy(update={"labels": {**ours.labels, LABEL_INSTANCE: "10.9.9.9:22"}})
    held = converged.model_copy(update={"nodes": {**converged.nodes, NODE: node.model_copy(update={
        "containers": [c if c.name != ours.name else taken for c in node.containers]})}})
    result = plan(desired, held)
    assert _touching(result, ours.name) == []
    assert any("another reconciler's container (instance 10.9.9.9:22)" in d.observed for d in result.drift
               if d.blocking)


def test_our_container_under_a_former_name_is_stopped_never_removed(desired, converged):
    result = plan(desired, _with(converged, _managed("vllm_serving_old", instance=desired.instance)))
    assert _touching(result, "vllm_serving_old") == [f"stop-serving/{NODE}/vllm_serving_old"]
    ran, error = stop_serving_on(desired, "vllm_serving_old", {LABEL_MANAGED: "true", LABEL_INSTANCE: desired.instance})
    assert (ran, error) == (["docker stop -t 30 vllm_serving_old"], None)


def test_the_step_checks_ownership_again_on_the_node(desired):
    """The plan may be minutes old: the step re-reads the labels and the file before it acts."""
    cases = {
        "not managed": {},
        "another instance": {LABEL_MANAGED: "true", LABEL_INSTANCE: "10.9.9.9:22"},
    }
    name = desired.serving.container_name
    for why, labels in cases.items():
        ran, error = stop_serving_on(desired, name, labels)
        assert isinstance(error, StepFailed) and ran == [], why
    ran, error = stop_serving_on(desired, name, {LABEL_MANAGED: "true", LABEL_INSTANCE: desired.instance})
    assert (ran, error) == ([f"docker stop -t 30 {name}", f"docker rm {name}"], None)


def test_a_container_made_before_the_instance_label_is_still_ours(desired):
    name = desired.serving.container_name
    ran, error = stop_serving_on(desired, name, {LABEL_MANAGED: "true"})
    assert error is None and f"docker rm {name}" in ran


def test_new_containers_carry_the_instance(desired):
    from reconciler.core.vllm import launch_specs

    for s in launch_specs(desired):
        argv = s.run_argv(1)
        assert f"{LABEL_INSTANCE}={desired.instance}" in argv and desired.instance == "10.1.230.180:22"


# ------------------------------------------------------------------------------------ the step, from recorded facts


def stop_serving_on(desired: Desired, name: str, labels: dict[str, str], observed: Observed | None = None,
                    node: str = NODE) -> tuple[list[str], BaseException | None]:
    """Drive the stop-serving step over a container with `labels` that stops and goes when asked: the commands
    it ran (`docker ...`) and what it ended with."""
    facts = {f"{node} container {name}": [inspected(name, labels=labels), inspected(name, "exited", labels=labels),
                                          no_such(name)]}
    step = Step("stop-serving", node, "test", (), container=name)
    transcript, error = drive(stop_serving(Given(desired, observed or reachable(), 1), step), facts)
    return [line.split(" ", 2)[2] for line in transcript if line.startswith("run ")], error


def _step(name: str) -> Step:
    return Step("stop-serving", NODE, "test", (), container=name)


def test_a_headless_rank_is_stopped_with_a_short_grace_and_the_api_rank_with_the_policys(desired):
    """A headless rank (role worker) has no API and nothing to drain: vLLM itself SIGKILLs its workers 5 s after
    SIGTERM, and in an ordered restart they wait that long for rank 0 (measured: 5.5 s of outage). The API rank
    keeps `policy.timeouts.stop_grace` to drain its requests."""
    from reconciler.core.observed import LABEL_ROLE

    own = {LABEL_MANAGED: "true", LABEL_INSTANCE: desired.instance}
    ran, _ = stop_serving_on(desired, "vllm_serving", {**own, LABEL_ROLE: "worker"})
    assert ran[0] == "docker stop -t 1 vllm_serving"
    ran, _ = stop_serving_on(desired, "vllm_serving", {**own, LABEL_ROLE: "head"})
    assert ran[0] == "docker stop -t 30 vllm_serving"
