"""What each step kind promises to change, applied to an observed state. Pure.

It is the written-down contract of every step kind: a new step kind adds its promised effect here (`EFFECTS`,
docs/architecture.md "Where a change goes"). Only the tests apply it: the property tests
(tests/unit/core/test_core_properties.py with the oracle) apply a plan's effects and check that the plan of the result
is empty (convergence; a plan that stages, downloading the weights or pulling the image, leaves the copies and the
start to the next pass, as `apply` and the daemon do: `settle`), and the plan-case tests build the state a deploy
leaves with it. The product never calls it: `plan` and `apply --dry-run` print the plan, not the state it would
leave, and `apply` and the daemon judge a step by observing the nodes again. So a step whose real effect differs
from its promise here shows only there: the next observation still differs and the next plan is not empty.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType

from reconciler.core.kinds import FETCHES, StepKind
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

#: A step kind's promised effect: (the file, the state before, the step) -> the state after.
Effect = Callable[[Desired, Observed, Step], Observed]


def _node(obs: Observed, name: str) -> NodeObservation:
    return obs.node(name)


def _with(obs: Observed, name: str, **update: object) -> Observed:
    """`obs` with node `name`'s fields replaced by `update`."""
    return obs.model_copy(update={"nodes": {**obs.nodes, name: _node(obs, name).model_copy(update=update)}})


def _downloaded(desired: Desired, obs: Observed, step: Step) -> Observed:
    """What a download leaves on the internet node: the Hub's revision (one shard and the ref, as this simulation
    has it)."""
    rev, root = desired.model.revision, desired.weights_root(step.node)
    shard = "model.safetensors" if desired.model.layout == "plain" else f"snapshots/{rev}/model.safetensors"
    files = [WeightFile(path=shard, size=1 << 20)] + (
        [WeightFile(path=f"refs/{rev}", size=40)] if desired.model.layout == "hf-cache" else [])
    return _with(obs, step.node, weights=Weights(root=root, present=True, files=files))


def _pulled(desired: Desired, obs: Observed, step: Step) -> Observed:
    """What a pull leaves on the internet node: the registry's image (whose `vllm serve` flags the daemon asks as
    for any image id)."""
    assert step.image is not None
    node = _node(obs, step.node)
    pulled = Image(id="sha256:" + "e" * 64, content="sha256:" + "f" * 64)
    flags = obs.serve_flags.model_copy(update={"image_id": pulled.id}) if obs.serve_flags is not None else None
    return _with(obs.model_copy(update={"serve_flags": flags}), step.node,
                 images=dict(node.images) | {step.image: pulled})


def _co_tenant(state: str) -> Effect:
    """A co-tenant stopped (`exited`) or started again (`running`)."""
    def effect(desired: Desired, obs: Observed, step: Step) -> Observed:
        containers = [c.model_copy(update={"state": state}) if c.name == step.container else c
                      for c in _node(obs, step.node).containers]
        return _with(obs, step.node, containers=containers)
    return effect


def _linked(desired: Desired, obs: Observed, step: Step) -> Observed:
    """Every declared port up, at the file's MTU, with its address, its RDMA port active."""
    node, fabric = _node(obs, step.node), desired.node(step.node).fabric
    update = {}
    seen = {"fabric": node.fabric, "fabric_twin": node.fabric_twin}
    for (field, link_seen), want in zip(seen.items(), fabric.ports(), strict=False):
        link = link_seen or Link(name=want.interface)
        addresses = list(link.addresses) + ([str(want.address)] if str(want.address) not in link.addresses else [])
        rdma = RdmaPort(state="4: ACTIVE", phys_state="5: LinkUp") if link.rdma is not None else None
        update[field] = link.model_copy(update={"operstate": "up", "admin_up": True, "carrier": True,
                                                "mtu": fabric.mtu, "addresses": addresses, "rdma": rdma})
    return _with(obs, step.node, **update)


def _image_copied(desired: Desired, obs: Observed, step: Step) -> Observed:
    ref = step.image
    assert ref is not None and step.source is not None
    return _with(obs, step.node, images=dict(_node(obs, step.node).images) | {ref: _node(obs, step.source).images[ref]})


def _weights_copied(desired: Desired, obs: Observed, step: Step) -> Observed:
    assert step.source is not None
    src = _node(obs, step.source).weights
    assert src is not None
    return _with(obs, step.node, weights=src.model_copy(update={"root": step.path}))


def _pruned(pruned: str) -> Effect:
    """Retention's removal of `pruned` copies (`weights`, `image`): their ledger lines end with the removal."""
    def effect(desired: Desired, obs: Observed, step: Step) -> Observed:
        node, removed = _node(obs, step.node), set(step.remove or ())
        copies = [r for r in node.copies or [] if not (r.kind == pruned and r.key in removed)]
        return _with(obs, step.node, copies=copies if node.copies is not None else None)
    return effect


def _serving_stopped(desired: Desired, obs: Observed, step: Step) -> Observed:
    """Removed under the serving name, only stopped under a former one."""
    gone, name = step.container, desired.serving.container_name
    containers = [c if c.name != gone else c.model_copy(update={"state": "exited"})
                  for c in _node(obs, step.node).containers if not (c.name == gone == name)]
    return _with(obs, step.node, containers=containers)


def _serving_started(desired: Desired, obs: Observed, step: Step) -> Observed:
    """The node's rank runs under its launch spec's labels, from the image the node holds."""
    node = _node(obs, step.node)
    spec = next(s for s in launch_specs(desired, owner(desired, obs).label) if s.node == step.node)
    argv = spec.run_argv(generation=0)
    labels = dict(argv[i + 1].split("=", 1) for i, a in enumerate(argv) if a == "--label")
    started = Container(name=spec.container_name, id=f"sim-{step.node}", image=spec.image,
                        image_id=image.id if (image := node.images.get(spec.image)) else "", state="running",
                        labels=labels)
    return _with(obs, step.node, containers=[c for c in node.containers if c.name != spec.container_name] + [started])


def _unchanged(desired: Desired, obs: Observed, step: Step) -> Observed:
    """`vllm serve` inside the Ray head: nothing the probe reads changes until the API answers (await-health)."""
    return obs


def _healthy(desired: Desired, obs: Observed, step: Step) -> Observed:
    return _with(obs, step.node, serving=ServingApi(reachable=True, healthy=True, models=[desired.served_name]))


#: Every step kind's promised effect (tests/unit/core/test_step_kinds.py: one per kind). It stays here, not as a column
#: of `core.kinds.KINDS`: an effect needs the `Step`, and `core.planning`, which defines it, reads the table.
EFFECTS: Mapping[StepKind, Effect] = MappingProxyType({
    "download": _downloaded,
    "pull-image": _pulled,
    "stop-container": _co_tenant("exited"),
    "start-container": _co_tenant("running"),
    "link": _linked,
    "image": _image_copied,
    "weights": _weights_copied,
    "prune-weights": _pruned("weights"),
    "prune-images": _pruned("image"),
    "stop-serving": _serving_stopped,
    "start-serving": _serving_started,
    "launch-model": _unchanged,
    "await-health": _healthy,
})


def apply_plan(desired: Desired, observed: Observed, plan: Plan) -> Observed:
    for step in plan.steps:
        observed = EFFECTS[step.kind](desired, observed, step)
    return observed


def settle(desired: Desired, observed: Observed) -> Observed:
    """The state after a plan's effects, and after the passes a plan that fetches leaves for later (at most one
    per fetching step kind: the download, then the pull, then everything else)."""
    for _ in range(len(FETCHES) + 1):
        planned = plan(desired, observed)
        observed = apply_plan(desired, observed, planned)
        if not any(s.kind in FETCHES for s in planned.steps):
            break
    return observed
