"""A first start on three nodes, planned for each launcher, judged by the order docs/architecture.md gives and
by the words the plan shows (`reconciler plan` prints each step's reason): deterministic, so it does not depend
on the property tests drawing a Ray start (under mutation testing they draw a fifth of their examples).

native: the headless workers first, rank 0 last (it waits for them), then health. Ray: the head's GCS first, the
workers join it, `vllm serve` on the head once all joined, then health. Every start waits for every link, image
and weights step; ranks follow the file's order."""

from __future__ import annotations

import pytest

from reconciler.core import spec
from reconciler.core.observed import Image, Link, Memory, NodeObservation, Observed, RdmaPort, WeightFile, Weights
from reconciler.core.planning import plan
from tests.unit.core.test_core_properties import closure
from tests.unit.strategies import GIB, IMAGE, desired_dict, manifest


def fresh_cluster(desired: spec.Desired) -> Observed:
    """The head holds the image and the weights; the workers have neither, and their links are down."""
    rev = desired.model.revision
    files = manifest(2, prefix=f"snapshots/{rev}/") + [WeightFile(path=f"refs/{rev}", size=40, mtime=1.0)]
    nodes = {}
    for n in desired.nodes:
        head, port = n.role == "head", n.fabric
        nodes[n.name] = NodeObservation(
            name=n.name, reachable=True, docker_reachable=True,
            images={IMAGE: Image(id="sha256:good", content="sha256:good")} if head else {},
            fabric=Link(name=port.interface, admin_up=head, carrier=head, operstate="up" if head else "down",
                        mtu=port.mtu, addresses=[str(port.address)] if head else [],
                        rdma=RdmaPort(state="4: ACTIVE", phys_state="5: LinkUp") if port.rdma_device else None),
            memory=Memory(total_bytes=128 * GIB, available_bytes=120 * GIB),
            weights=Weights(root=desired.model.path_on(n.name), present=head, files=files if head else []))
    return Observed(nodes=nodes)


EXPECTED = {
    "native": [("start-serving/worker1", "start rank 1 (headless) first", {"rank": "1"}),
               ("start-serving/worker2", "start rank 2 (headless) first", {"rank": "2"}),
               ("start-serving/head", "start rank 0 last: it waits for the workers", {"rank": "0"}),
               ("await-health/head", "wait for /health and /v1/models", {})],
    "ray": [("start-serving/head", "start the Ray head first", {"rank": "0"}),
            ("start-serving/worker1", "join the Ray cluster", {"rank": "1"}),
            ("start-serving/worker2", "join the Ray cluster", {"rank": "2"}),
            ("launch-model/head", "vllm serve on the Ray head once all nodes joined", {}),
            ("await-health/head", "wait for /health and /v1/models", {})],
}


@pytest.mark.parametrize("launcher", ["native", "ray"])
def test_a_first_start_runs_in_the_launchers_order_after_everything_it_needs(launcher):
    desired = spec.Desired.model_validate(desired_dict(n_nodes=3, tp=3, launcher=launcher))
    steps = plan(desired, fresh_cluster(desired)).steps
    prepared = {s.id for s in steps if s.kind in ("link", "image", "weights")}
    assert prepared == {f"{k}/worker{i}" for k in ("link", "image", "weights") for i in (1, 2)}
    serving = [s for s in steps if s.id not in prepared]
    assert [(s.id, s.reason, s.params) for s in serving] == EXPECTED[launcher]
    waits = closure(steps)
    for s in serving:
        assert prepared <= waits[s.id], f"{s.id} waits for every link, image and weights step"
    for earlier, later in zip(serving, serving[1:], strict=False):
        if launcher == "native" and later.id == "start-serving/worker2":
            continue  # the headless workers start side by side
        if launcher == "ray" and later.id == "start-serving/worker2":
            assert "start-serving/head" in waits[later.id]
            continue
        assert earlier.id in waits[later.id], f"{later.id} waits for {earlier.id}"


def _running_old_generation(desired: spec.Desired, observed: Observed) -> Observed:
    """Every serving node runs our container with a spec the file no longer asks for: a restart is due."""
    from reconciler.core.observed import LABEL_INSTANCE, Container
    nodes = {}
    for name, obs in observed.nodes.items():
        old = Container(name=desired.serving.container_name, id=f"{name}-old", image=IMAGE, image_id="sha256:good",
                        state="running", labels={"spark-reconciler.managed": "true",
                                                 "spark-reconciler.spec-hash": "0123456789abcdef",
                                                 LABEL_INSTANCE: desired.instance})
        nodes[name] = obs.model_copy(update={"containers": [old]})
    return Observed(nodes=nodes)


def test_a_restart_waits_when_no_node_can_give_the_image_and_nothing_is_stopped():
    """The workers lack the image and no image source holds it (removed from the head): no copy can bring it, so
    the running generation must keep serving while the head pulls it; the plan says what the restart waits for."""
    desired = spec.Desired.model_validate(desired_dict(n_nodes=3, tp=3))
    cluster = fresh_cluster(desired)
    ready = {n: o.model_copy(update={"weights": cluster.node(desired.head.name).weights.model_copy(
        update={"root": desired.model.path_on(n)}), "fabric": cluster.node(desired.head.name).fabric.model_copy(
        update={"addresses": [str(desired.node(n).fabric.address)]}), "images": {}})
        for n, o in cluster.nodes.items()}
    observed = _running_old_generation(desired, Observed(nodes=ready))
    result = plan(desired, observed)
    assert not [s.id for s in result.steps if s.kind in ("stop-serving", "start-serving")], result.steps
    # the head has internet: it pulls the image first; the restart waits for that pull
    assert [s.id for s in result.steps if s.kind == "pull-image"] == [f"pull-image/{desired.head.name}"]
    assert any(f"serving restart waits for pull-image/{desired.head.name}" in b.reason for b in result.blocked), \
        result.blocked


def test_a_restart_that_needs_new_weights_is_ordered_after_the_sync_not_blocked():
    """A spec change while a worker's copy lags: the sync is planned, and the ordered restart follows it (the
    running generation is stopped only once the weights are in place)."""
    desired = spec.Desired.model_validate(desired_dict(n_nodes=2, tp=2))
    cluster = fresh_cluster(desired)
    head = cluster.node(desired.head.name)
    ready = {n: o.model_copy(update={"fabric": head.fabric.model_copy(
        update={"addresses": [str(desired.node(n).fabric.address)]}), "images": head.images})
        for n, o in cluster.nodes.items()}
    result = plan(desired, _running_old_generation(desired, Observed(nodes=ready)))
    ids = [s.id for s in result.steps]
    assert ids[0] == "weights/worker1" and not result.blocked, (ids, result.blocked)
    waits = closure(result.steps)
    for s in result.steps[1:]:
        assert "weights/worker1" in waits[s.id], f"{s.id} runs before the weights are in place"
    assert {s.kind for s in result.steps[1:]} == {"stop-serving", "start-serving", "await-health"}
