"""What each step kind promises to change, applied to an observed state. Pure.

It is the written-down contract of every step kind: a new step kind adds its promised effect here (`_effect`,
docs/architecture.md "Where a change goes"). Only the tests apply it: the property tests
(tests/unit/test_core_properties.py with the oracle) apply a plan's effects and check that the plan of the result
is empty (convergence; a plan that stages, downloading the weights or pulling the image, leaves the copies and the
start to the next pass, as `apply` and the daemon do: `settle`), and the plan-case tests build the state a deploy
leaves with it. The product never calls it: `plan` and `apply --dry-run` print the plan, not the state it would
leave, and `apply` and the daemon judge a step by observing the nodes again. So a step whose real effect differs
from its promise here shows only there: the next observation still differs and the next plan is not empty.
"""

from __future__ import annotations

from reconciler.core.observed import (
    Container,
    Image,
    Link,
    NodeObservation,
    Observed,
    RdmaPort,
    ServingApi,
    WeightFile,
    Weights,
)
from reconciler.core.ownership import owner
from reconciler.core.planning import Plan, Step, plan
from reconciler.core.spec import Desired
from reconciler.core.vllm import launch_specs

#: Steps whose result only the next observation can plan from (the tree the Hub sent, the image pulled).
STAGING = ("download", "pull-image")


def _node(obs: Observed, name: str) -> NodeObservation:
    return obs.node(name)


def _staged(desired: Desired, obs: Observed, step: Step) -> Observed:
    """What a download or a pull leaves on the internet node: the Hub's revision (one shard and the ref, as this
    simulation has it), the registry's image (whose `vllm serve` flags the daemon asks as for any image id)."""
    node = _node(obs, step.node)
    if step.kind == "download":
        rev, root = desired.model.revision, desired.weights_root(step.node)
        shard = "model.safetensors" if desired.model.layout == "plain" else f"snapshots/{rev}/model.safetensors"
        files = [WeightFile(path=shard, size=1 << 20)] + (
            [WeightFile(path=f"refs/{rev}", size=40)] if desired.model.layout == "hf-cache" else [])
        return obs.model_copy(update={"nodes": {**obs.nodes, step.node: node.model_copy(
            update={"weights": Weights(root=root, present=True, files=files)})}})
    assert step.image is not None
    pulled = Image(id="sha256:" + "e" * 64, content="sha256:" + "f" * 64)
    flags = obs.serve_flags.model_copy(update={"image_id": pulled.id}) if obs.serve_flags is not None else None
    return obs.model_copy(update={"serve_flags": flags, "nodes": {**obs.nodes, step.node: node.model_copy(
        update={"images": dict(node.images) | {step.image: pulled}})}})


def _effect(desired: Desired, obs: Observed, step: Step) -> Observed:
    if step.kind in STAGING:
        return _staged(desired, obs, step)
    nodes = dict(obs.nodes)
    node = _node(obs, step.node)
    if step.kind in ("stop-container", "start-container"):
        state = "exited" if step.kind == "stop-container" else "running"
        containers = [c.model_copy(update={"state": state}) if c.name == step.container else c
                      for c in node.containers]
        nodes[step.node] = node.model_copy(update={"containers": containers})
    elif step.kind == "link":
        fabric = desired.node(step.node).fabric
        update = {}
        seen = {"fabric": node.fabric, "fabric_twin": node.fabric_twin}
        for (field, link_seen), want in zip(seen.items(), fabric.ports(), strict=False):
            link = link_seen or Link(name=want.interface)
            addresses = list(link.addresses) + ([str(want.address)] if str(want.address) not in link.addresses
                                                else [])
            rdma = RdmaPort(state="4: ACTIVE", phys_state="5: LinkUp") if link.rdma is not None else None
            update[field] = link.model_copy(update={"operstate": "up", "admin_up": True, "carrier": True,
                                                    "mtu": fabric.mtu, "addresses": addresses, "rdma": rdma})
        nodes[step.node] = node.model_copy(update=update)
    elif step.kind == "image":
        ref = step.image
        assert ref is not None and step.source is not None
        images = dict(node.images) | {ref: _node(obs, step.source).images[ref]}
        nodes[step.node] = node.model_copy(update={"images": images})
    elif step.kind == "weights":
        assert step.source is not None
        src = _node(obs, step.source).weights
        assert src is not None
        nodes[step.node] = node.model_copy(update={"weights": src.model_copy(update={"root": step.path})})
    elif step.kind in ("prune-weights", "prune-images"):  # their ledger lines end with the removal
        pruned, removed = ("weights" if step.kind == "prune-weights" else "image"), set(step.remove or ())
        copies = [r for r in node.copies or [] if not (r.kind == pruned and r.key in removed)]
        nodes[step.node] = node.model_copy(update={"copies": copies if node.copies is not None else None})
    elif step.kind == "stop-serving":  # removed under the serving name, only stopped under a former one
        gone, name = step.container, desired.serving.container_name
        containers = [c if c.name != gone else c.model_copy(update={"state": "exited"})
                      for c in node.containers if not (c.name == gone == name)]
        nodes[step.node] = node.model_copy(update={"containers": containers})
    elif step.kind == "start-serving":
        spec = next(s for s in launch_specs(desired, owner(desired, obs).label) if s.node == step.node)
        argv = spec.run_argv(generation=0)
        labels = dict(argv[i + 1].split("=", 1) for i, a in enumerate(argv) if a == "--label")
        started = Container(name=spec.container_name, id=f"sim-{step.node}", image=spec.image,
                            image_id=image.id if (image := node.images.get(spec.image)) else "", state="running",
                            labels=labels)
        containers = [c for c in node.containers if c.name != spec.container_name] + [started]
        nodes[step.node] = node.model_copy(update={"containers": containers})
    elif step.kind == "await-health":
        served = desired.served_name
        nodes[step.node] = node.model_copy(update={"serving": ServingApi(reachable=True, healthy=True,
                                                                      models=[served])})
    return obs.model_copy(update={"nodes": nodes})


def apply_plan(desired: Desired, observed: Observed, plan: Plan) -> Observed:
    for step in plan.steps:
        observed = _effect(desired, observed, step)
    return observed


def settle(desired: Desired, observed: Observed) -> Observed:
    """The state after a plan's effects, and after the passes a staging plan leaves for later (at most one per
    staging step kind: the download, then the pull, then everything else)."""
    for _ in range(len(STAGING) + 1):
        planned = plan(desired, observed)
        observed = apply_plan(desired, observed, planned)
        if not any(s.kind in STAGING for s in planned.steps):
            break
    return observed
