"""A first start on three nodes, planned for each launcher, judged by the order docs/architecture.md gives and
by the words the plan shows (`reconciler plan` prints each step's reason): deterministic, so it does not depend
on the property tests drawing a Ray start (under mutation testing they draw a fifth of their examples).

native: the headless workers first, rank 0 last (it waits for them), then health. Ray: the head's GCS first, the
workers join it, `vllm serve` on the head once all joined, then health. Every start waits for every link, image
and weights step; ranks follow the file's order."""

from __future__ import annotations

import pytest

from reconciler import spec
from reconciler.observed import Image, Link, Memory, NodeObservation, Observed, RdmaPort, WeightFile, Weights
from reconciler.plan import plan
from tests.unit.strategies import GIB, IMAGE, desired_dict, manifest
from tests.unit.test_core_properties import closure


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
