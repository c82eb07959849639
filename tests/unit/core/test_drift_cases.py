"""Every kind of drift, one case at a time, as a user reads it in `plan`, `status` and `/status`.

Each case starts from **recorded real output**: what the probe printed on a converged 4-node testbed
(`tests/unit/fixtures/probe-4-nodes.json`, see test_probe_recorded.py), which diffs to nothing. One thing is
changed the way the world changes it (a container dies, a port goes down, a shard is damaged, the API stops
answering), and the whole drift list is compared with the one written here by hand: which node, which kind,
which resource, what was expected and seen in words, whether the reconciler can act and whether it blocks. The
words are the contract of docs/troubleshooting.md and docs/cli.md: a user greps for them, Grafana shows them.

The properties (test_core_properties.py) judge what a plan does against an independent oracle; these cases pin
what a single drift says, which the properties cannot know.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from reconciler.core import spec
from reconciler.core.drift import Drift, diff, weights_difference
from reconciler.core.observed import (
    LABEL_INSTANCE,
    LABEL_MANAGED,
    LABEL_SPEC_HASH,
    Container,
    Image,
    Link,
    Memory,
    Observed,
    RdmaPort,
    ServingApi,
    WeightFile,
    Weights,
)
from tests.unit.recorded import (
    CLUSTER_ID,
    IF0,
    IF1,
    IMAGE,
    REV,
    SERVING,
    WEIGHTS,
    changed,
    hashes,
    link,
    load,
    observe,
    serving_with,
    without,
)

GIB = 2**30


def unreachable(name: str, why: str) -> Drift:
    return Drift(name, "unreachable", f"node/{name}", "reachable over SSH", why, actionable=False, blocking=True)


# ------------------------------------------------------------------------------------------ who can be asked


@pytest.mark.parametrize(("error", "words"), [("timed out after 10s", "timed out after 10s"), (None, "unreachable")])
def test_an_unreachable_node_is_one_blocking_drift_and_nothing_is_judged_on_it(desired, seen, error, words):
    after = changed(seen, "worker2", reachable=False, error=error, fabric=None, fabric_twin=None, containers=[],
                    images={}, weights=None)
    assert diff(desired, after) == [unreachable("worker2", words)]


def test_output_that_does_not_parse_blocks_its_node_and_only_it(desired, seen):
    after = changed(seen, "worker1", probe_error="docker section: not JSON", fabric=None, fabric_twin=None)
    assert diff(desired, after) == [Drift("worker1", "probe", "probe/worker1", "probe output that parses",
                                          "docker section: not JSON", actionable=False, blocking=True)]


@pytest.mark.parametrize(("error", "words"), [("Cannot connect to the Docker daemon", "Cannot connect to the Docker "
                                               "daemon"), (None, "docker not reachable")])
def test_a_dead_docker_engine_blocks_its_node_but_its_fabric_is_still_judged(desired, seen, error, words):
    after = changed(seen, "worker3", docker_reachable=False, docker_error=error, containers=[], images={},
                    fabric=link(seen, "worker3", mtu=1500))
    assert diff(desired, after) == [
        Drift("worker3", "docker", "docker/worker3", "docker engine answering", words, actionable=False,
              blocking=True),
        Drift("worker3", "link", f"link/{IF0}/mtu", "9000", "1500")]


def test_the_source_unreachable_blocks_every_copy_and_the_image(desired, seen):
    after = changed(seen, "head", reachable=False, error="connection refused", fabric=None, fabric_twin=None,
                    containers=[], images={}, weights=None, serving=None)
    workers = ["worker1", "worker2", "worker3"]
    assert diff(desired, after) == [
        unreachable("head", "connection refused"),
        *[Drift(w, "image", IMAGE, "present on an image source (head)", "on no reachable image source: head "
                "pulls it once it answers", actionable=False, blocking=True) for w in workers],
        *[Drift(w, "weights", WEIGHTS, "copy of head", "source head unreachable", actionable=False, blocking=True)
          for w in workers]]


# ------------------------------------------------------------------------------------------------ co-tenants


def _foreign(name: str, state: str = "running", **labels: str) -> Container:
    return Container(name=name, id="f" * 64, image="glm-4.5-air:latest", image_id="sha256:" + "f" * 64, state=state,
                     labels=labels)


def test_a_container_that_is_not_allowed_is_stopped(desired, seen):
    after = changed(seen, "worker1", containers=[*seen.node("worker1").containers, _foreign("vllm_node")])
    assert diff(desired, after) == [Drift("worker1", "co-tenant", "container/vllm_node", "not running (not allowed)",
                                          "running (glm-4.5-air:latest)")]


def test_with_unlisted_report_it_is_reported_and_left_running():
    desired = load(("unlisted: stop", "unlisted: report"))
    seen = observe(desired)
    after = changed(seen, "worker1", containers=[*seen.node("worker1").containers, _foreign("vllm_node")])
    assert diff(desired, after) == [Drift("worker1", "co-tenant", "container/vllm_node", "not running (not allowed)",
                                          "running (glm-4.5-air:latest)", actionable=False)]


def test_allowed_protected_stopped_and_our_own_containers_are_no_co_tenant_drift():
    desired = load(("protected: {}", "protected: {worker1: [postgres]}"))
    seen = observe(desired)
    extra = [_foreign("postgres"), _foreign("vllm_node", state="exited"),
             _foreign("vllm_embeddings").model_copy(update={"id": "e" * 64})]
    after = changed(seen, "worker1", containers=[*without(seen, "worker1", "vllm_embeddings"), *extra])
    assert diff(desired, after) == []


# ------------------------------------------------------------------------------------------------ the fabric


@pytest.mark.parametrize("missing", [None, "not-there"])
def test_a_missing_interface_blocks_and_cannot_be_created(desired, seen, missing):
    port = None if missing is None else Link(name=IF0, exists=False)
    assert diff(desired, changed(seen, "worker1", fabric=port)) == [
        Drift("worker1", "link", f"link/{IF0}", "interface present", "no such interface", actionable=False,
              blocking=True)]


def test_a_missing_twin_is_named_by_its_own_interface(desired, seen):
    assert diff(desired, changed(seen, "worker2", fabric_twin=None)) == [
        Drift("worker2", "link", f"link/{IF1}", "interface present", "no such interface", actionable=False,
              blocking=True)]


def test_an_admin_down_port_with_the_mtu_reset_and_its_address_gone(desired, seen):
    port = link(seen, "worker1", admin_up=False, carrier=False, mtu=1500, addresses=[])
    assert diff(desired, changed(seen, "worker1", fabric=port)) == [
        Drift("worker1", "link", f"link/{IF0}", "up", "admin-down"),
        Drift("worker1", "link", f"link/{IF0}/mtu", "9000", "1500"),
        Drift("worker1", "link", f"link/{IF0}/address", "10.232.0.11/24", "none")]


def test_no_carrier_is_the_peer_or_the_cable_not_this_node(desired, seen):
    port = link(seen, "head", carrier=False, addresses=["10.9.9.9/24", "10.9.9.10/24"])
    assert diff(desired, changed(seen, "head", fabric=port)) == [
        Drift("head", "link", f"link/{IF0}/carrier", "carrier", "no carrier (peer port down or cable)",
              actionable=False),
        Drift("head", "link", f"link/{IF0}/address", "10.232.0.10/24", "10.9.9.9/24, 10.9.9.10/24")]


RDMA = (("address: 10.232.0.11/24\n", "address: 10.232.0.11/24\n      rdma_device: rocep1s0f1\n"),
        ("address: 10.232.1.11/24\n", "address: 10.232.1.11/24\n        rdma_device: roceP2p1s0f1\n"))


def rdma_cluster() -> tuple[spec.Desired, Observed]:
    """worker1's ports declare their RDMA devices (which enters its NCCL env, so its rank runs that spec)."""
    desired = load(*RDMA)
    seen = observe(desired)
    c = seen.node("worker1").container("vllm_serving")
    assert c is not None
    relabelled = {**c.labels, LABEL_SPEC_HASH: hashes(desired)["worker1"]}
    seen = changed(seen, "worker1", containers=serving_with(seen, "worker1", labels=relabelled))
    assert diff(desired, seen) == []
    return desired, seen


def test_an_rdma_port_down_under_a_fine_netdev_is_cabling_and_blocks():
    desired, seen = rdma_cluster()
    port = link(seen, "worker1", rdma=RdmaPort(state="1: DOWN", phys_state="3: Disabled"))
    assert diff(desired, changed(seen, "worker1", fabric=port)) == [
        Drift("worker1", "rdma", "rdma/rocep1s0f1", "4: ACTIVE", "1: DOWN (3: Disabled)", actionable=False,
              blocking=True)]


def test_an_rdma_port_down_under_a_down_netdev_comes_up_with_it():
    desired, seen = rdma_cluster()
    port = link(seen, "worker1", admin_up=False, rdma=RdmaPort(state="1: DOWN", phys_state="3: Disabled"))
    assert diff(desired, changed(seen, "worker1", fabric=port)) == [
        Drift("worker1", "link", f"link/{IF0}", "up", "admin-down"),
        Drift("worker1", "rdma", "rdma/rocep1s0f1", "4: ACTIVE", "1: DOWN (3: Disabled)")]


@pytest.mark.parametrize("rdma", [None, RdmaPort(state="4: ACTIVE", phys_state="5: LinkUp")])
def test_an_active_or_unreadable_rdma_port_is_no_drift(rdma):
    desired, seen = rdma_cluster()
    assert diff(desired, changed(seen, "worker1", fabric=link(seen, "worker1", rdma=rdma))) == []


# ------------------------------------------------------------------------------------------------ the weights


def _weights(seen: Observed, node: str, keep=lambda f: True, **sizes: int) -> Weights:
    w = seen.node(node).weights
    assert w is not None
    files = [f.model_copy(update={"size": sizes.get(Path(f.path).name, f.size)}) for f in w.files if keep(f)]
    return w.model_copy(update={"files": files})


def _expected_weights(seen: Observed) -> str:
    w = seen.node("head").weights
    assert w is not None
    return f"{len(w.files)} files, {w.total_bytes} bytes"


def test_a_worker_without_the_weights_gets_a_copy(desired, seen):
    after = changed(seen, "worker2", weights=Weights(root="/srv/x", present=False))
    assert diff(desired, after) == [Drift("worker2", "weights", WEIGHTS, _expected_weights(seen), "missing")]


def test_a_short_shard_and_a_lost_one_are_counted(desired, seen):
    files = seen.node("head").weights.files  # type: ignore[union-attr]
    shard = next(f for f in files if f.link_target is None and (f.size or 0) > 0)
    lost = next(f for f in files if f.link_target is None and f.path != shard.path)
    damaged = _weights(seen, "worker3", keep=lambda f: f.path != lost.path, **{Path(shard.path).name: 1})
    assert diff(desired, changed(seen, "worker3", weights=damaged)) == [
        Drift("worker3", "weights", WEIGHTS, _expected_weights(seen), f"1 missing, 1 different of {len(files)} files")]


HUB_PATH = "/srv/spark-testbed/head/models/hub"
FETCH = f"`hf download testorg/tiny-moe --revision {REV}`"
OFFLINE_HEAD = ("    internet: true             # declared only", "    internet: false            # declared only")


def test_weights_missing_on_an_internet_source_are_downloaded_there_once(desired, seen):
    after = changed(seen, "head", weights=Weights(root="/srv/x", present=False))
    assert diff(desired, after) == [Drift(
        "head", "weights", WEIGHTS, f"testorg/tiny-moe at revision {REV} on the source",
        f"missing in {HUB_PATH}: downloaded there first ({FETCH}), while what runs keeps serving")]


def test_weights_missing_on_an_offline_source_say_how_to_put_them_there():
    desired = load(OFFLINE_HEAD)
    after = changed(observe(desired), "head", weights=Weights(root="/srv/x", present=False))
    assert diff(desired, after) == [Drift(
        "head", "weights", WEIGHTS, f"testorg/tiny-moe at revision {REV} on the source",
        f"missing in {HUB_PATH}: head has no internet in the file, so put them there ({FETCH} where the Hub is "
        f"reachable, then copy the tree to {HUB_PATH})", actionable=False, blocking=True)]


def test_weights_missing_on_a_source_that_serves_alone_are_drift_too():
    desired = load(("tensor_parallel_size: 4", "tensor_parallel_size: 1\n  nodes: [head]"))
    after = changed(observe(desired), "head", weights=Weights(root="/srv/x", present=False))
    assert [(d.node, d.kind, d.actionable) for d in diff(desired, after) if d.kind == "weights"] == [
        ("head", "weights", True)]


def test_a_revision_the_source_cache_cannot_resolve_offline_is_downloaded_once(desired, seen):
    w = seen.node("head").weights
    assert w is not None
    unresolved = w.model_copy(update={"files": [f for f in w.files if not f.path.startswith(("refs/", "snapshots/"))]})
    assert diff(desired, changed(seen, "head", weights=unresolved)) == [
        Drift("head", "weights", WEIGHTS, f"testorg/tiny-moe at revision {REV} on the source",
              f"neither refs/{REV} nor snapshots/{REV}/ in {w.root} (better pinned to a commit): downloaded there "
              f"first ({FETCH}), while what runs keeps serving")]


def test_a_resolvable_revision_by_snapshot_alone_is_enough(desired, seen):
    w = seen.node("head").weights
    assert w is not None
    snapshot_only = w.model_copy(update={"files": [f for f in w.files if not f.path.startswith("refs/")]})
    assert any(f.path.startswith(f"snapshots/{REV}/") for f in snapshot_only.files)
    after = changed(seen, "head", weights=snapshot_only)
    for name in ("worker1", "worker2", "worker3"):
        after = changed(after, name, weights=snapshot_only)
    assert diff(desired, after) == []


def _file(path: str, size: int | None, sha: str | None = None) -> WeightFile:
    return WeightFile(path=path, size=size, sha256=sha)


@pytest.mark.parametrize(("have", "problem"), [
    ([_file("a", 10, "x"), _file("b", 20)], None),
    ([_file("a", 10), _file("b", 20, "y")], None),  # a hash known on one side only is no evidence
    ([_file("a", 10, "z"), _file("b", 20)], "0 missing, 1 different of 2 files"),
    ([_file("a", 11, "x"), _file("b", 20)], "0 missing, 1 different of 2 files"),
    ([_file("a", None, "x"), _file("b", 20)], "1 missing, 0 different of 2 files"),  # a dangling link
    ([_file("b", 20)], "1 missing, 0 different of 2 files"),
    ([], "2 missing, 0 different of 2 files"),
])
def test_weights_difference_counts_missing_and_different_files(have, problem):
    expected = Weights(root="/m", present=True, files=[_file("a", 10, "x"), _file("b", 20)])
    assert weights_difference(expected, Weights(root="/n", present=True, files=have)) == problem
    assert weights_difference(expected, None) == "missing"


# ------------------------------------------------------------------------------------------------ the image


NEW_ID, NEW_CONTENT = "sha256:" + "b" * 64, "sha256:" + "c" * 64


def _reference(seen: Observed) -> Image:
    return seen.node("head").images["vllm-standin:latest"]


PULLED = Drift("head", "image", IMAGE, "present on head", "missing: pulled there first (`docker pull "
               "vllm-standin:latest`), while what runs keeps serving")


def test_the_image_missing_on_every_source_is_pulled_on_the_internet_one(desired, seen):
    assert diff(desired, changed(seen, "head", images={})) == [PULLED]


def test_the_image_missing_on_every_offline_source_cannot_be_copied_from_anywhere():
    desired = load(OFFLINE_HEAD)
    assert diff(desired, changed(observe(desired), "head", images={})) == [
        Drift(n, "image", IMAGE, "present on an image source (head)", "on no reachable image source: pull it on "
              "head (`docker pull vllm-standin:latest`): the file gives it no internet, so the reconciler does not",
              actionable=False, blocking=True) for n in ("head", "worker1", "worker2", "worker3")]


def test_several_image_sources_the_first_with_internet_pulls():
    desired = load(("  health_timeout: 2m\n", "  health_timeout: 2m\n  image_sources: [worker1, head]\n"))
    seen = observe(desired)
    after = changed(changed(seen, "head", images={}), "worker1", images={})
    assert [d for d in diff(desired, after) if d.kind == "image"] == [PULLED]


def test_a_worker_on_other_image_content_gets_the_reference_and_its_rank_restarts(desired, seen):
    ref = _reference(seen)
    after = changed(seen, "worker2", images={"vllm-standin:latest": Image(id=NEW_ID, content=NEW_CONTENT)})
    assert diff(desired, after) == [
        Drift("worker2", "image", IMAGE, f"content {ref.content[:19]}", f"content {NEW_CONTENT[:19]}"),
        Drift("worker2", "serving", SERVING, f"image {NEW_ID[:19]}", f"image {ref.id[:19]}")]


def test_a_worker_without_the_image_gets_it_and_its_rank_restarts_on_it(desired, seen):
    ref = _reference(seen)
    assert diff(desired, changed(seen, "worker1", images={})) == [
        Drift("worker1", "image", IMAGE, f"content {ref.content[:19]}", "missing"),
        Drift("worker1", "serving", SERVING, f"image content {ref.content[:19]}", "image content missing")]


def test_a_worker_whose_container_runs_the_image_it_holds_but_of_other_content_restarts(desired, seen):
    ref = _reference(seen)
    other = Image(id=ref.id, content=NEW_CONTENT)  # same id, other content: a containerd-store copy gone wrong
    after = changed(seen, "worker3", images={"vllm-standin:latest": other})
    assert diff(desired, after) == [
        Drift("worker3", "image", IMAGE, f"content {ref.content[:19]}", f"content {NEW_CONTENT[:19]}"),
        Drift("worker3", "serving", SERVING, f"image content {ref.content[:19]}",
              f"image content {NEW_CONTENT[:19]}")]


PIN = "sha256:" + "9" * 64


def test_a_pin_the_reference_does_not_match_blocks_and_says_where_to_pull():
    desired = load(("  health_timeout: 2m\n", f"  health_timeout: 2m\n  image_id: \"{PIN}\"\n"))
    seen = observe(desired)
    ref = _reference(seen)
    assert diff(desired, seen) == [
        Drift("head", "image", IMAGE, f"pinned {PIN[:19]}", f"{ref.id[:19]} (pull the pinned image on head; nothing "
              "is copied or started on another)", actionable=False, blocking=True)]


def test_without_an_online_node_the_pin_is_pulled_where_the_reference_is():
    desired = load(("  health_timeout: 2m\n", f"  health_timeout: 2m\n  image_id: \"{PIN}\"\n"),
                   ("internet: true ", "internet: false"))
    seen = observe(desired)
    assert "(pull the pinned image on head;" in diff(desired, seen)[0].observed


def test_a_pin_by_repository_digest_is_met():
    desired = load(("  health_timeout: 2m\n", f"  health_timeout: 2m\n  image_id: \"{PIN}\"\n"))
    seen = observe(desired)
    pinned = _reference(seen).model_copy(update={"digests": [f"vllm-standin@{PIN}"]})
    after = seen
    for node in desired.nodes:
        after = changed(after, node.name, images={"vllm-standin:latest": pinned})
    assert diff(desired, after) == []


# ------------------------------------------------------------------------------------------------ serving


def test_a_missing_rank_is_started_with_its_spec(desired, seen):
    after = changed(seen, "worker3", containers=without(seen, "worker3", "vllm_serving"))
    assert diff(desired, after) == [
        Drift("worker3", "serving", SERVING, f"running, spec {hashes(desired)['worker3']}", "missing")]


def test_an_exited_rank_is_restarted(desired, seen):
    after = changed(seen, "worker1", containers=serving_with(seen, "worker1", state="exited"))
    assert diff(desired, after) == [Drift("worker1", "serving", SERVING, "running", "exited")]


def test_a_rank_on_an_old_spec_is_replaced_and_a_rank_without_one_too(desired, seen):
    c = seen.node("worker2").container("vllm_serving")
    assert c is not None
    unlabelled = {k: v for k, v in c.labels.items() if k != LABEL_SPEC_HASH}
    old = {**c.labels, LABEL_SPEC_HASH: "0"}
    after = changed(seen, "worker2", containers=serving_with(seen, "worker2", labels=old))
    after = changed(after, "worker3", containers=serving_with(seen, "worker3", labels=unlabelled))
    h = hashes(desired)
    assert diff(desired, after) == [
        Drift("worker2", "serving", SERVING, f"spec {h['worker2']}", "spec 0 (started before field labels)"),
        Drift("worker3", "serving", SERVING, f"spec {h['worker3']}", "spec none (started before field labels)")]


def test_a_serving_name_held_by_a_stranger_blocks(desired, seen):
    after = changed(seen, "worker1", containers=serving_with(seen, "worker1", labels={}))
    assert diff(desired, after) == [
        Drift("worker1", "co-tenant", SERVING, "not running (not allowed)", "running (vllm-standin:latest)"),
        Drift("worker1", "serving", SERVING, f"created by this reconciler (cluster {CLUSTER_ID})",
              "a container not created by the reconciler holds the name", actionable=False, blocking=True)]


def test_a_serving_name_held_by_another_reconciler_blocks_and_names_it(desired, seen):
    labels = {LABEL_MANAGED: "true", LABEL_INSTANCE: "10.9.9.9:22"}
    after = changed(seen, "worker1", containers=serving_with(seen, "worker1", labels=labels))
    assert diff(desired, after) == [
        Drift("worker1", "serving", SERVING, f"created by this reconciler (cluster {CLUSTER_ID})",
              "another reconciler's container (instance 10.9.9.9:22) holds the name: if that is this head under a "
              "former address, add the line `10.9.9.9:22` to ~/.spark-reconciler/cluster-id on head and it is "
              "adopted; otherwise remove or rename that container", actionable=False, blocking=True)]


def test_our_container_under_a_former_name_is_stopped_unless_protected():
    for protected, expected in (("{}", 1), ("{worker2: [vllm_old]}", 0)):
        desired = load(("protected: {}", f"protected: {protected}"))
        seen = observe(desired)
        c = seen.node("worker2").container("vllm_serving")
        assert c is not None
        old = c.model_copy(update={"name": "vllm_old", "id": "0" * 64})
        after = changed(seen, "worker2", containers=[*seen.node("worker2").containers, old])
        assert diff(desired, after) == [Drift("worker2", "serving", "container/vllm_old",
                                              "not running (no longer wanted)", "running")] * expected


def test_a_stopped_container_under_a_former_name_is_left_alone(desired, seen):
    c = seen.node("worker2").container("vllm_serving")
    assert c is not None
    old = c.model_copy(update={"name": "vllm_old", "id": "0" * 64, "state": "exited"})
    assert diff(desired, changed(seen, "worker2", containers=[*seen.node("worker2").containers, old])) == []


# ------------------------------------------------------------------------------------------------ memory


def _memory(total_gib: float, available_gib: float) -> Memory:
    return Memory(total_bytes=int(total_gib * GIB), available_bytes=int(available_gib * GIB))


def test_a_rank_that_must_start_where_memory_is_short_blocks(desired, seen):
    # need = gpu_memory_utilization 0.05 x 100 GiB + memory_overhead_per_instance 128 MiB + memory_margin 1 GiB
    after = changed(seen, "worker3", containers=without(seen, "worker3", "vllm_serving"), memory=_memory(100, 5.5))
    assert diff(desired, after) == [
        Drift("worker3", "serving", SERVING, f"running, spec {hashes(desired)['worker3']}", "missing"),
        Drift("worker3", "memory", "memory/worker3", ">= 6.1 GiB available", "5.5 GiB available of 100.0 GiB",
              actionable=False, blocking=True)]


@pytest.mark.parametrize("available", [6.125, 7])  # the need to the byte, and more
def test_exactly_enough_memory_is_enough(desired, seen, available):
    after = changed(seen, "worker3", containers=without(seen, "worker3", "vllm_serving"),
                    memory=_memory(100, available))
    assert [d.kind for d in diff(desired, after)] == ["serving"]


def test_memory_held_by_our_own_running_rank_is_freed_by_its_restart(desired, seen):
    after = changed(seen, "worker1", containers=serving_with(seen, "worker1", state="exited"), memory=_memory(100, 1))
    assert [d.kind for d in diff(desired, after)] == ["serving", "memory"]  # exited: holds nothing, frees nothing
    c = seen.node("worker1").container("vllm_serving")
    assert c is not None
    relabelled = serving_with(seen, "worker1", labels={**c.labels, LABEL_SPEC_HASH: "0"})
    assert [d.kind for d in diff(desired, changed(seen, "worker1", containers=relabelled,
                                                  memory=_memory(100, 1)))] == ["serving"]


def test_memory_is_not_judged_where_nothing_starts(desired, seen):
    assert diff(desired, changed(seen, "worker2", memory=_memory(100, 0.1))) == []


# ------------------------------------------------------------------------------------------------ the API


def _api(**fields: object) -> ServingApi:
    return ServingApi(reachable=True, healthy=True, models=["tiny-moe"]).model_copy(update=fields)


@pytest.mark.parametrize(("health", "words"), [
    (None, "not answering"),
    (ServingApi(reachable=False), "not answering"),
    (_api(healthy=False), "unhealthy"),
    (_api(models=["glm-4.5-air"]), "serving glm-4.5-air"),
    (_api(models=["a", "b"]), "serving a, b"),
    (_api(models=[]), "serving nothing"),
    (_api(completion_error="HTTP 500"), "/health 200 but a completion failed: HTTP 500"),
])
def test_the_api_on_the_head_is_judged_by_health_models_and_a_completion(desired, seen, health, words):
    assert diff(desired, changed(seen, "head", serving=health)) == [
        Drift("head", "health", "api/:8000", "healthy, serving tiny-moe, completing", words)]


def test_the_api_is_not_judged_while_the_head_cannot_be_asked(desired, seen):
    after = changed(seen, "head", docker_reachable=False, serving=None)
    assert [d.kind for d in diff(desired, after)] == ["docker", "image", "image", "image"]
