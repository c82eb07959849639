"""The property tests' oracle (tests/unit/oracle.py) against hand-written cases: it must know the contract on its
own, so these cases are written from the documents, and the launch label below is written out as the core writes
it for `desired_dict()` (docs/cli.md `field_changes`), not computed by the core."""

from __future__ import annotations

import json

import pytest

from reconciler.core import spec
from reconciler.core.observed import (
    ClusterIdentity,
    Container,
    Image,
    Link,
    Memory,
    NodeObservation,
    Observed,
    RdmaPort,
    ServingApi,
    WeightFile,
    Weights,
)
from tests.unit.oracle import (
    Violation,
    harm,
    launch_mismatch,
    may_stop,
    ours,
    serving_cannot_restart,
    serving_nodes,
    violations,
)
from tests.unit.strategies import desired_dict

CLUSTER = "0f8fad5b-d9cb-469f-a165-70867728950e"
OTHER = "7c9e6679-7425-40de-944b-e07fc1f90ae7"
HEAD_SSH = "10.231.0.2:22"  # desired_dict's head: ssh.host 10.231.0.2, the default port
IMAGE = "vllm-standin:latest"
GIB = 2**30

#: What `desired_dict()` launches on every rank, as the `spark-reconciler.launch` label says it.
LAUNCH = {"model.id": "testorg/tiny-moe", "model.layout": "hf-cache", "model.path": "/srv/models/hub",
          "model.revision": "1" * 40, "nodes.head.fabric.address": "10.232.0.10",
          "serving.compile_cache": "home", "serving.container_name": "vllm_serving", "serving.docker.ipc": "host",
          "serving.docker.privileged": "false",
          "serving.docker.ulimits": "memlock=-1 nofile=1048576:1048576 stack=67108864",
          "serving.gpu_memory_utilization": "0.5", "serving.host": "127.0.0.1", "serving.image": IMAGE,
          "serving.launcher": "native", "serving.master_port": "29501", "serving.nodes": "head,worker1",
          "serving.pipeline_parallel_size": "1", "serving.port": "8000", "serving.served_model_name": "tiny",
          "serving.tensor_parallel_size": "2", "trust.remote_code": "false"}


def launch(node: str, **changed: str) -> dict[str, str]:
    """The launch label's inputs on `node` (its own fabric fields added), with `changed` fields over them."""
    own = {f"nodes.{node}.fabric.address": "10.232.0.10" if node == "head" else "10.232.0.11",
           f"nodes.{node}.fabric.interface": "enp1s0f1np1", f"nodes.{node}.fabric.rdma_device": "rocep1s0f1",
           f"nodes.{node}.ssh.user": "spark"}
    return LAUNCH | own | changed


def serving(node: str, instance: str | None = CLUSTER, state: str = "running", name: str = "vllm_serving",
            inputs: dict[str, str] | None = None) -> Container:
    labels = {"spark-reconciler.managed": "true", "spark-reconciler.spec-hash": "0123456789abcdef",
              "spark-reconciler.launch": json.dumps(launch(node) if inputs is None else inputs, sort_keys=True)}
    if instance is not None:
        labels["spark-reconciler.instance"] = instance
    return Container(name=name, id=f"{node}-{name}", image=IMAGE, image_id="sha256:good", state=state,
                     labels=labels)


def other(name: str, state: str = "running", **labels: str) -> Container:
    return Container(name=name, id=f"x-{name}", image="i", state=state, labels=labels)


def node(name: str, *containers: Container, identity: ClusterIdentity | None = None) -> NodeObservation:
    index = 0 if name == "head" else 1
    link = Link(name="enp1s0f1np1", operstate="up", admin_up=True, carrier=True, mtu=9000,
                addresses=[f"10.232.0.{10 + index}/24"], rdma=RdmaPort(state="4: ACTIVE", phys_state="5: LinkUp"))
    files = [WeightFile(path=f"snapshots/{'1' * 40}/model.safetensors", size=1000), WeightFile(
        path=f"refs/{'1' * 40}", size=40)]
    return NodeObservation(
        name=name, reachable=True, docker_reachable=True, containers=list(containers),
        images={IMAGE: Image(id="sha256:good", content="sha256:good")}, fabric=link,
        memory=Memory(total_bytes=128 * GIB, available_bytes=120 * GIB),
        weights=Weights(root="/srv/models/hub/models--testorg--tiny-moe", present=True, files=files),
        serving=ServingApi(reachable=True, healthy=True, models=["tiny"]) if name == "head" else None,
        identity=identity)


IDENTITY = ClusterIdentity(id=CLUSTER, known_as=["10.8.8.8:22"])


def cluster(head: list[Container] | None = None, worker: list[Container] | None = None,
            identity: ClusterIdentity | None = IDENTITY) -> Observed:
    return Observed(nodes={
        "head": node("head", *(head if head is not None else [serving("head")]), identity=identity),
        "worker1": node("worker1", *(worker if worker is not None else [serving("worker1")]))})


DESIRED = spec.Desired.model_validate(desired_dict())


def test_a_cluster_as_the_file_declares_has_no_violations() -> None:
    assert violations(DESIRED, cluster()) == []


def test_another_clusters_serving_container_is_not_ours_nor_to_be_touched() -> None:
    """Issue 34: with the core's own ownership predicate made to ignore the instance label, another cluster's
    serving was stopped, removed and replaced by ours, and the oracle, asking the same predicate, agreed."""
    foreign = serving("head", instance=OTHER)
    before = cluster(head=[foreign])
    assert not ours(DESIRED, before, foreign)
    assert Violation("head", "serving", f"another's: {OTHER}") in violations(DESIRED, before)
    assert serving_cannot_restart(DESIRED, before) == "head: the serving name is another's"
    assert may_stop(DESIRED, before, "head", foreign) == f"another cluster's (instance {OTHER})"
    replaced = cluster(head=[serving("head").model_copy(update={"id": "ours-now"})])
    assert violations(DESIRED, replaced) == []  # as declared afterwards, and still:
    assert harm(DESIRED, before, replaced) == [Violation("head", "touched", "vllm_serving removed, not this "
                                                                           "cluster's")]
    stopped = cluster(head=[foreign.model_copy(update={"state": "exited"})])
    assert harm(DESIRED, before, stopped) == [Violation("head", "touched", "vllm_serving stopped: another "
                                                                          f"cluster's (instance {OTHER})")]


def test_another_clusters_container_under_another_name_is_neither_stray_nor_a_co_tenant() -> None:
    theirs, mine = serving("worker1", OTHER, name="old_serving"), serving("worker1", CLUSTER, name="old_serving")
    assert violations(DESIRED, cluster(worker=[serving("worker1"), theirs])) == []
    assert violations(DESIRED, cluster(worker=[serving("worker1"), mine])) == [
        Violation("worker1", "stray", "old_serving")]


@pytest.mark.parametrize(("labels", "identity", "mine"), [
    ({"spark-reconciler.managed": "true", "spark-reconciler.instance": CLUSTER}, IDENTITY, True),
    ({"spark-reconciler.managed": "true", "spark-reconciler.instance": "10.8.8.8:22"}, IDENTITY, True),
    ({"spark-reconciler.managed": "true", "spark-reconciler.instance": HEAD_SSH}, IDENTITY, False),
    ({"spark-reconciler.managed": "true", "spark-reconciler.instance": HEAD_SSH}, None, True),
    ({"spark-reconciler.managed": "true", "spark-reconciler.instance": CLUSTER}, None, False),
    ({"spark-reconciler.managed": "true", "spark-reconciler.instance": OTHER}, IDENTITY, False),
    ({"spark-reconciler.managed": "true"}, IDENTITY, True),
    ({"spark-reconciler.managed": "false", "spark-reconciler.instance": CLUSTER}, IDENTITY, False),
    ({"spark-reconciler.instance": CLUSTER}, IDENTITY, False),
], ids=["the-id", "a-former-name", "the-address-once-the-id-is-read", "the-address-without-an-id",
        "an-id-the-head-did-not-say", "another-cluster", "before-instance-labels", "managed-false", "unmanaged"])
def test_whose_a_container_is_from_its_labels_and_the_heads_cluster_id(
        labels: dict[str, str], identity: ClusterIdentity | None, mine: bool) -> None:
    c = other("x", **labels)
    assert ours(DESIRED, cluster(identity=identity), c) is mine


@pytest.mark.parametrize(("changed", "named"), [
    ({"serving.max_model_len": "4096"}, "serving.max_model_len '4096'"),
    ({"serving.tensor_parallel_size": "1"}, "serving.tensor_parallel_size '1'"),
    ({"serving.gpu_memory_utilization": "0.9"}, "serving.gpu_memory_utilization '0.9'"),
    ({"nodes.worker1.fabric.interface": "enP2p1s0f1np1"}, "nodes.worker1.fabric.interface 'enP2p1s0f1np1'"),
    ({"serving.env.VLLM_LOGGING_LEVEL": "DEBUG"}, "serving.env.VLLM_LOGGING_LEVEL 'DEBUG'"),
])
def test_a_serving_container_launched_from_another_file_is_named_by_its_field(changed: dict[str, str],
                                                                             named: str) -> None:
    c = serving("worker1", inputs=launch("worker1", **changed))
    assert launch_mismatch(DESIRED, DESIRED.nodes[1], c) == named
    assert [v.what for v in violations(DESIRED, cluster(worker=[c]))] == ["serving"]


def test_the_launch_label_compares_a_number_as_a_number_and_an_unset_field_by_its_absence() -> None:
    assert launch_mismatch(DESIRED, DESIRED.nodes[1], serving(
        "worker1", inputs=launch("worker1", **{"serving.gpu_memory_utilization": "0.50"}))) is None
    without = {k: v for k, v in launch("worker1").items() if k != "serving.served_model_name"}
    assert launch_mismatch(DESIRED, DESIRED.nodes[1], serving("worker1", inputs=without)) == (
        "serving.served_model_name None")


@pytest.mark.parametrize("label", [None, "not json", "[1, 2]", '{"serving.image": 1}'])
def test_a_container_without_a_readable_launch_label_is_not_shown_to_be_the_files(label: str | None) -> None:
    c = serving("worker1")
    labels = {k: v for k, v in c.labels.items() if k != "spark-reconciler.launch"}
    c = c.model_copy(update={"labels": labels | ({"spark-reconciler.launch": label} if label else {})})
    assert launch_mismatch(DESIRED, DESIRED.nodes[1], c) == "no readable launch label"


def test_the_serving_nodes_are_the_files() -> None:
    assert [n.name for n in serving_nodes(spec.Desired.model_validate(desired_dict(n_nodes=3, tp=1)))] == ["head"]
    assert [n.name for n in serving_nodes(spec.Desired.model_validate(desired_dict(n_nodes=3, tp=2)))] == [
        "head", "worker1"]
    raw = desired_dict(n_nodes=3, tp=2)
    raw["serving"]["nodes"] = ["worker2", "head"]
    assert [n.name for n in serving_nodes(spec.Desired.model_validate(raw))] == ["head", "worker2"]


@pytest.mark.parametrize(("unlisted", "container", "left", "touched"), [
    ("stop", other("rogue-1"), "exited", None),
    ("report", other("rogue-1"), "exited", "rogue-1 stopped: unlisted: report"),
    ("stop", other("reranker"), "exited", "reranker stopped: allowed"),
    ("stop", other("monitor"), "exited", "monitor stopped: protected"),
    ("stop", serving("head", name="monitor"), "exited", "monitor stopped: protected"),
    ("stop", serving("head", name="old_serving"), "exited", None),
    ("stop", serving("head", name="old_serving"), "gone", None),
    ("stop", other("rogue-1", state="exited"), "gone", "rogue-1 removed, not this cluster's"),
    ("stop", other("rogue-1"), "gone", "rogue-1 removed, not this cluster's"),
], ids=["unlisted", "unlisted-report", "allowed", "protected", "protected-ours", "ours", "ours-removed",
        "a-strangers-exited-removed", "a-strangers-removed"])
def test_harm_is_any_stop_or_removal_the_file_or_ownership_forbids(
        unlisted: str, container: Container, left: str, touched: str | None) -> None:
    desired = spec.Desired.model_validate(desired_dict(unlisted=unlisted))
    before = cluster(head=[serving("head"), container])
    after = cluster(head=[serving("head")] + ([container.model_copy(update={"state": left})] if left != "gone"
                                              else []))
    assert harm(desired, before, after) == ([Violation("head", "touched", touched)] if touched else [])


def test_health_is_the_documented_one() -> None:
    """/health, the model listed, one completion answered, and the port not held by a user's process."""
    for api in (ServingApi(reachable=True, healthy=False, models=["tiny"]),
                ServingApi(reachable=True, healthy=True, models=["testorg/tiny-moe"]),
                ServingApi(reachable=True, healthy=True, models=["tiny"], completion_error="timed out"),
                ServingApi(reachable=True, healthy=True, models=["tiny"], port_holder=1000)):
        observed = cluster()
        head = observed.nodes["head"].model_copy(update={"serving": api})
        assert violations(DESIRED, observed.model_copy(update={"nodes": observed.nodes | {"head": head}})) == [
            Violation("head", "health")], api


#: The models' methods and properties that judge (whose, running, up, healthy, the file's defaults): the core's own
#: answers, which the oracle must not borrow, or it agrees with the core by construction. (`Desired.image_sources`
#: and `Weights.total_bytes` are left out: fields of the same names, `serving.image_sources` and
#: `Memory.total_bytes`, are what the oracle reads, and the syntax cannot tell them apart.)
JUDGING_METHODS = {"owned_by", "serves", "working", "matches_pin", "digest", "node", "container", "links",
                   "path_on", "weights_root", "is_allowed", "is_protected", "secrets_for", "ports"}
JUDGING_PROPERTIES = {"managed", "query", "running", "held_ports", "launch_inputs", "up", "active", "partial",
                      "serving_nodes", "source_node", "served_name", "instance", "head", "effective_ulimits"}


def test_the_oracle_borrows_no_judgement_from_the_core() -> None:
    """It imports nothing from `reconciler` but data models, and reads none of their judging members."""
    import ast
    from pathlib import Path

    import pydantic

    from tests.unit import oracle

    tree = ast.parse(Path(oracle.__file__).read_text())
    imported = [(node.module or "", alias.name) for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                for alias in node.names]
    assert not [n for n in ast.walk(tree) if isinstance(n, ast.Import) and any(
        a.name.startswith("reconciler") for a in n.names)]
    for module, name in imported:
        if module.startswith("reconciler"):
            value = getattr(__import__(module, fromlist=[name]), name)
            assert isinstance(value, type) and issubclass(value, pydantic.BaseModel), f"{module}.{name}"
    assert {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)} & JUDGING_PROPERTIES == set()
    called = {n.func.attr for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)}
    assert called & JUDGING_METHODS == set()
