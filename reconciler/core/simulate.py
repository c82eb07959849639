"""What each step promises to change, applied to an observed state. Pure.

It is the written-down contract of every step: the property tests apply a plan's effects and check that the plan
of the result is empty (convergence), and `apply --dry-run` shows the state a plan would leave behind. A step
whose real effect differs from its promise here fails verification, because verification re-observes and diffs.
"""

from __future__ import annotations

from reconciler.core.observed import Container, Link, NodeObservation, Observed, RdmaPort, ServingApi
from reconciler.core.ownership import owner
from reconciler.core.planning import Plan, Step
from reconciler.core.spec import Desired
from reconciler.core.vllm import launch_specs


def _node(obs: Observed, name: str) -> NodeObservation:
    return obs.node(name)


def _effect(desired: Desired, obs: Observed, step: Step) -> Observed:
    nodes = dict(obs.nodes)
    node = _node(obs, step.node)
    if step.kind == "stop-container":
        containers = [c.model_copy(update={"state": "exited"}) if c.name == step.container else c
                      for c in node.containers]
        nodes[step.node] = node.model_copy(update={"containers": containers})
    elif step.kind == "link":
        fabric = desired.node(step.node).fabric
        update = {}
        for field, want in zip(("fabric", "fabric_twin"), fabric.ports(), strict=False):
            link = getattr(node, field) or Link(name=want.interface)
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
