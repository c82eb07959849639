"""An independent statement of "the cluster is as the file declares", for the core's property tests.

The properties used to let the plan judge itself ("the next plan is empty"): a mutant of `drift` that forgets a
kind of difference plans nothing for it and passed. This oracle is written from the documented contract
(docs/desired-state.md, docs/architecture.md) and never calls `drift` or `plan`: `violations` says what differs
from the file in a state, and `excuse` says which of those the reconciler cannot fix on its own, judged from the
state before the plan (a node it cannot reach, hardware, a missing source, a full node, ...). A property then
applies a plan's promised effects (`simulate`) and requires every violation left to have an excuse.
"""

from __future__ import annotations

from dataclasses import dataclass

from reconciler.core.observed import LABEL_INSTANCE, Container, Link, NodeObservation, Observed
from reconciler.core.spec import Desired, FabricPort
from reconciler.core.vllm import launch_specs


@dataclass(frozen=True)
class Violation:
    node: str
    what: str  # co-tenant, stray, link-missing, link-down, mtu, address, rdma, image, weights, serving, health
    detail: str = ""


def usable(obs: NodeObservation) -> bool:
    """SSH answers, the probe parses and docker answers: the reconciler can act on the node."""
    return obs.reachable and obs.probe_error is None and obs.docker_reachable


def _port_violations(node: str, want: FabricPort, mtu: int, link: Link | None) -> list[Violation]:
    if link is None or not link.exists:
        return [Violation(node, "link-missing", want.interface)]
    out = []
    if not link.admin_up:
        out.append(Violation(node, "link-down", want.interface))
    if link.mtu != mtu:
        out.append(Violation(node, "mtu", f"{want.interface} {link.mtu} != {mtu}"))
    if str(want.address) not in link.addresses:
        out.append(Violation(node, "address", f"{want.interface} lacks {want.address}"))
    if want.rdma_device and link.rdma is not None and not link.rdma.active:
        out.append(Violation(node, "rdma", f"{want.interface} {want.rdma_device}"))
    return out


def ours(desired: Desired, observed: Observed, c: Container) -> bool:
    """Created by this cluster's reconciler (docs/operations.md "Cluster identity"): managed, and its instance
    label is the head's cluster id or a name the head was known as, or (the id not read) the head's SSH
    `host:port`; no instance label at all is ours too (made before the label existed)."""
    identity = observed.node(desired.head.name).identity
    names = {identity.id, *identity.known_as} if identity else {f"{desired.head.ssh.host}:{desired.head.ssh.port}"}
    label = c.labels.get(LABEL_INSTANCE)
    return c.managed and (label is None or label in names)


def _unwanted(desired: Desired, observed: Observed, node: str, c: Container) -> str | None:
    """Why a running container must not run on `node`, or None."""
    ct = desired.co_tenants
    if not c.running or ct.is_protected(node, c.name):
        return None
    if c.managed:  # a reconciler's: ours only when its instance is ours (no instance label = ours, legacy)
        if not ours(desired, observed, c):
            return None
        spans = node in {n.name for n in desired.serving_nodes}
        return None if spans and c.name == desired.serving.container_name else "stray"
    return None if ct.is_allowed(node, c.name) else "co-tenant"


def reference_image(desired: Desired, observed: Observed) -> tuple[str, str] | None:
    """(node, content) of the image serving must run: the first usable image source that holds the tag."""
    for name in desired.image_sources:
        obs = observed.node(name)
        image = obs.images.get(desired.serving.image)
        if usable(obs) and image is not None:
            return name, image.content
    return None


def _same_weights(desired: Desired, observed: Observed, node: str) -> bool:
    source = observed.node(desired.source_node).weights
    seen = observed.node(node).weights
    if source is None or seen is None or not seen.present:
        return False
    have = {f.path: (f.size, f.sha256) for f in seen.files}
    for f in source.files:
        size, sha = have.get(f.path, (None, None))
        if size != f.size or (f.sha256 and sha and sha != f.sha256):
            return False
    return True


def violations(desired: Desired, observed: Observed) -> list[Violation]:
    """Everything in `observed` that differs from the file, on the nodes whose state is known."""
    out: list[Violation] = []
    for node in desired.nodes:
        obs = observed.node(node.name)
        if not obs.reachable or obs.probe_error is not None:
            continue
        for want, link in zip(node.fabric.ports(), (obs.fabric, obs.fabric_twin), strict=False):
            out += _port_violations(node.name, want, node.fabric.mtu, link)
        if obs.docker_reachable:
            out += [Violation(node.name, why, c.name) for c in obs.containers
                    if (why := _unwanted(desired, observed, node.name, c))]
    ref = reference_image(desired, observed)
    specs = {s.node: s for s in launch_specs(desired)}
    for node in desired.serving_nodes:
        obs = observed.node(node.name)
        if not usable(obs):
            continue
        image = obs.images.get(desired.serving.image)
        if ref is None or image is None or image.content != ref[1]:
            out.append(Violation(node.name, "image"))
        if node.name != desired.source_node and not _same_weights(desired, observed, node.name):
            out.append(Violation(node.name, "weights"))
        c = obs.container(desired.serving.container_name)
        spec = specs[node.name]
        if (c is None or not ours(desired, observed, c) or not c.running
                or c.labels.get("spark-reconciler.spec-hash") != spec.spec_hash
                or (image is not None and c.image_id and c.image_id != image.id)):
            out.append(Violation(node.name, "serving", c.state if c else "missing"))
    head = observed.node(desired.head.name)
    want = desired.serving.served_model_name or desired.model.id
    if usable(head) and (head.serving is None or not head.serving.serves(want)):
        out.append(Violation(desired.head.name, "health"))
    return out


# --- what the reconciler cannot fix on its own, judged from the state before the plan ---------------------------

def _netdev_fine(node: str, want: FabricPort, mtu: int, link: Link | None) -> bool:
    return not [v for v in _port_violations(node, want, mtu, link) if v.what != "rdma"]


def _can_fetch(desired: Desired, before: Observed, node: str) -> bool:
    """The file says `node` has internet and it answers: it downloads the weights or pulls the image itself
    (docs/architecture.md, "Staging")."""
    return desired.node(node).internet and usable(before.node(node))


def _image_unavailable(desired: Desired, before: Observed) -> bool:
    ref = reference_image(desired, before)
    if ref is None:
        return not any(_can_fetch(desired, before, n) for n in desired.image_sources)
    pin = desired.serving.image_id
    return bool(pin) and not before.node(ref[0]).images[desired.serving.image].matches_pin(pin)


def _weights_unavailable(desired: Desired, before: Observed) -> str | None:
    """Why no node can be brought the weights: the source cannot be read or lacks them (only matters when
    another serving node needs a copy), or its hub cache does not resolve model.revision (nothing can load it)."""
    src = before.node(desired.source_node)
    needed = any(n.name != desired.source_node for n in desired.serving_nodes)
    if not src.reachable or src.probe_error is not None:
        return "the weights' source cannot be read" if needed else None
    online = desired.node(desired.source_node).internet
    if src.weights is None or not src.weights.present:
        return None if online else "the weights' source lacks them and has no internet"
    if online:
        return None  # a revision its cache does not resolve is downloaded too
    rev = desired.model.revision
    if desired.model.layout == "hf-cache" and not any(
            f.path == f"refs/{rev}" or f.path.startswith(f"snapshots/{rev}/") for f in src.weights.files):
        return f"revision {rev} does not resolve in the source's cache"
    return None


def _short_of_memory(desired: Desired, before: Observed, node: str) -> bool:
    """Serving must start from nothing on `node`, nothing the plan stops frees memory there, and MemAvailable is
    below what vLLM will claim (gpu_memory_utilization x MemTotal) plus the margin."""
    obs = before.node(node)
    own = obs.container(desired.serving.container_name)
    if own is not None and ours(desired, before, own) and own.running:
        return False
    if desired.co_tenants.unlisted == "stop" and any(_unwanted(desired, before, node, c) == "co-tenant"
                                                     for c in obs.containers):
        return False
    mem = obs.memory
    return mem is not None and mem.available_bytes < (desired.serving.gpu_memory_utilization * mem.total_bytes
                                                      + desired.policy.memory_margin)


def _image_refuses(desired: Desired, before: Observed) -> bool:
    flags, ref = before.serve_flags, reference_image(desired, before)
    if flags is None or ref is None or before.node(ref[0]).images[desired.serving.image].id != flags.image_id:
        return False
    if flags.pending or (desired.serving.launcher == "ray" and flags.has_ray is False):
        return True
    known = set(flags.flags)
    return flags.error is None and any(
        a.split("=", 1)[0] not in known and a.split("=", 1)[0].replace("_", "-") not in known
        for a in desired.serving.extra_args if a.startswith("--"))


def serving_cannot_restart(desired: Desired, before: Observed) -> str | None:
    """Why an ordered serving (re)start must wait for someone else, or None."""
    for node in desired.serving_nodes:
        obs = before.node(node.name)
        if not usable(obs):
            return f"{node.name} cannot be reached or asked"
        for want, link in zip(node.fabric.ports(), (obs.fabric, obs.fabric_twin), strict=False):
            if link is None or not link.exists:
                return f"{node.name} has no {want.interface}"
            if (want.rdma_device and link.rdma is not None and not link.rdma.active
                    and _netdev_fine(node.name, want, node.fabric.mtu, link)):
                return f"{node.name}: RDMA port down with its netdev fine (cabling)"
        c = obs.container(desired.serving.container_name)
        if c is not None and not ours(desired, before, c):
            return f"{node.name}: the serving name is another's"
        if _short_of_memory(desired, before, node.name):
            return f"{node.name}: short of memory"
    if _image_unavailable(desired, before):
        return "no image to serve"
    if why := _weights_unavailable(desired, before):
        return why
    if _image_refuses(desired, before):
        return "the image refuses the launch"
    return None


def _within_grace(desired: Desired, before: Observed) -> bool:
    """Serving served, then failed its health check for less than the (doubled) grace: wait, do not restart."""
    health = before.node(desired.head.name).serving
    if health is None or not health.served_before:
        return False
    grace = desired.serving.unhealthy_grace * 2 ** min(health.health_restarts, 4)
    return (health.unhealthy_for or 0.0) < grace


def excuse(desired: Desired, before: Observed, v: Violation) -> str | None:
    """Why `v` may remain after the plan's effects, or None when the reconciler should have fixed it."""
    if v.what == "link-missing":
        return "hardware: the interface does not exist"
    if v.what == "rdma":
        node = desired.node(v.node)
        obs = before.node(v.node)
        ports = zip(node.fabric.ports(), (obs.fabric, obs.fabric_twin), strict=False)
        if all(_netdev_fine(v.node, want, node.fabric.mtu, link) for want, link in ports):
            return "cabling or firmware: the netdev was fine"
        return None
    if v.what == "co-tenant":
        if desired.co_tenants.unlisted == "report":
            return "unlisted: report"
        # A start is wanted when serving is wrong, or when a serving node lacks the reference image: its rank
        # must then restart on the reference (a rank left on the old content would serve beside the new ones).
        serving_nodes = {n.name for n in desired.serving_nodes}
        wanted = any(w.what in ("serving", "health") or (w.what == "image" and w.node in serving_nodes)
                     for w in violations(desired, before))
        if wanted and (why := serving_cannot_restart(desired, before)):
            return f"kept running: the start it makes room for is blocked ({why})"
        return None
    if v.what == "image":
        return "no usable image source" if _image_unavailable(desired, before) else None
    if v.what == "weights":
        return _weights_unavailable(desired, before)
    if v.what in ("serving", "health"):
        if why := serving_cannot_restart(desired, before):
            return why
        if v.what == "health" and _within_grace(desired, before) and not any(
                w.what == "serving" for w in violations(desired, before)):
            return "within the unhealthy grace"
    return None

