"""An independent statement of "the cluster is as the file declares", for the core's property tests.

The properties used to let the plan judge itself ("the next plan is empty"): a mutant of `drift` that forgets a
kind of difference plans nothing for it and passed. And an oracle that asks the core's own predicates (whose a
container is, the launch's spec hash, the serving nodes) agrees with the core by construction: with
`Container.owned_by` made to ignore the instance label, another cluster's serving was stopped, removed and
replaced by ours, and every property still passed (issue 34).

So this oracle knows only the contract. From `reconciler.core` it imports the data models and nothing else, and
of them it reads *fields*: the file's values (`Desired` and its sections) and what the probe saw (`Observed`),
never a method or property that judges (`owned_by`, `managed`, `running`, `Link.up`, `serves`, `matches_pin`,
`serving_nodes`, `is_allowed`, `Observed.node`, ...). Every judgement is written here from the documents:
whose a container is from its labels and the head's cluster id (docs/security.md "Containers", docs/operations.md
"Cluster identity"), the serving nodes and the defaults from docs/desired-state.md, a serving container's launch
from its `spark-reconciler.launch` label (docs/cli.md, docs/architecture.md "The plan's field diff").

- `violations(desired, observed)`: what differs from the file in a state.
- `excuse(desired, before, v)`: which of those the reconciler cannot fix on its own, judged from the state before
  the plan (a node it cannot reach, hardware, a missing source, a full node, ...).
- `harm(desired, before, after)`: what a plan did that the file never allows, whatever it fixed: a container
  stopped or removed that is protected, allowed, or not this cluster's.

A property applies a plan's promised effects (`core.simulate`: the system's own promise of what each step does)
and requires every violation left to have an excuse and no harm done.
"""

from __future__ import annotations

import fnmatch
import json
from collections.abc import Iterable
from dataclasses import dataclass

from reconciler.core.observed import Container, Link, NodeObservation, Observed
from reconciler.core.spec import Desired, FabricPort, Node

# The labels, as the documents name them (docs/security.md, docs/operations.md, docs/cli.md).
MANAGED = "spark-reconciler.managed"
INSTANCE = "spark-reconciler.instance"
LAUNCH = "spark-reconciler.launch"
#: What `docker ps` lists without `-a`: a container in any of these states holds its name, its ports, its memory.
RUNNING_STATES = ("running", "restarting", "paused")


@dataclass(frozen=True)
class Violation:
    node: str
    #: co-tenant, stray, link-missing, link-down, mtu, address, rdma, image, weights, serving, health; touched: harm
    what: str
    detail: str = ""


# --- the file, read from its fields (docs/desired-state.md) ------------------------------------------------------

def head(desired: Desired) -> Node:
    """The one node of role `head`."""
    return next(n for n in desired.nodes if n.role == "head")


def serving_nodes(desired: Desired) -> list[Node]:
    """`serving.nodes`, else head first, then workers in file order, as many as tp x pp GPUs need; rank order is
    the head first."""
    s = desired.serving
    if s.nodes is not None:
        chosen = [n for name in s.nodes for n in desired.nodes if n.name == name]
    else:
        chosen, need = [], s.tensor_parallel_size * s.pipeline_parallel_size
        for node in [head(desired), *(n for n in desired.nodes if n.role == "worker")]:
            if sum(n.gpus for n in chosen) >= need:
                break
            chosen.append(node)
    return [n for n in chosen if n.role == "head"] + [n for n in chosen if n.role != "head"]


def image_sources(desired: Desired) -> list[str]:
    """`serving.image_sources`, default: the head only."""
    return desired.serving.image_sources or [head(desired).name]


def weights_source(desired: Desired) -> str:
    """`model.source`, default: the head."""
    return desired.model.source or head(desired).name


def served_name(desired: Desired) -> str:
    """`serving.served_model_name`, else the model id (vLLM's default for `--served-model-name`)."""
    return desired.serving.served_model_name or desired.model.id


def node_of(desired: Desired, name: str) -> Node:
    return next(n for n in desired.nodes if n.name == name)


def ports(node: Node) -> list[FabricPort]:
    """The declared fabric ports: the first (`fabric` itself), then its `twin`."""
    return [node.fabric, *([node.fabric.twin] if node.fabric.twin else [])]


def _listed(table: dict[str, list[str]], node: str, name: str) -> bool:
    """A co-tenant table names `name` on `node`: a shell pattern under the node's key or under `*`."""
    return any(fnmatch.fnmatchcase(name, p) for p in [*table.get(node, []), *table.get("*", [])])


def protected(desired: Desired, node: str, name: str) -> bool:
    return _listed(desired.co_tenants.protected, node, name)


def allowed(desired: Desired, node: str, name: str) -> bool:
    return _listed(desired.co_tenants.allowed, node, name)


# --- what was seen, read from its fields -----------------------------------------------------------------------

def seen(observed: Observed, name: str) -> NodeObservation | None:
    """The node's observation; None: not observed at all (as good as unreachable)."""
    return observed.nodes.get(name)


def answers(obs: NodeObservation | None) -> bool:
    """SSH answered and the probe's output parsed: what it says of the node is known."""
    return obs is not None and obs.reachable and obs.probe_error is None


def usable(observed: Observed, name: str) -> bool:
    """It answers and docker answers: the reconciler can act on the node."""
    obs = seen(observed, name)
    return answers(obs) and obs is not None and obs.docker_reachable


def runs(c: Container) -> bool:
    return c.state in RUNNING_STATES


def named(obs: NodeObservation, name: str) -> Container | None:
    return next((c for c in obs.containers if c.name == name), None)


def cluster_names(desired: Desired, observed: Observed) -> set[str]:
    """The instance labels that are this cluster's (docs/operations.md "Cluster identity"): the cluster id the
    head keeps and every former name listed with it; where the head's id was not read, the head's `host:port`."""
    h = head(desired)
    identity = obs.identity if (obs := seen(observed, h.name)) is not None else None
    if identity is None:
        return {f"{h.ssh.host}:{h.ssh.port}"}
    return {identity.id, *identity.known_as}


def managed(c: Container) -> bool:
    return c.labels.get(MANAGED) == "true"


def ours(desired: Desired, observed: Observed, c: Container) -> bool:
    """Created by this cluster's reconciler (docs/security.md "Containers"): the managed label, and an instance
    label that is one of the cluster's names; no instance label at all is ours too (made before it existed)."""
    label = c.labels.get(INSTANCE)
    return managed(c) and (label is None or label in cluster_names(desired, observed))


# --- the launch a serving container was started with -----------------------------------------------------------

def launch_fields(desired: Desired, node: Node) -> dict[str, str | float | None]:
    """The file's fields a rank's launch on `node` is rendered from, as its `spark-reconciler.launch` label names
    them (docs/cli.md `field_changes`: the desired-state path -> the value; None: unset, so the label must not
    hold it; a float is compared as a number). Not every field the label holds: those the documents spell out,
    which is every field the property tests vary. Its spec hash stays opaque here: re-deriving it would be a
    second `core/vllm.py`; the label is what the documents promise about what a container runs."""
    s, model = desired.serving, desired.model
    me = f"nodes.{node.name}."
    plain = model.layout == "plain"  # serves the mounted directory: neither the id nor the revision is rendered
    return {
        "serving.image": s.image, "serving.container_name": s.container_name, "serving.launcher": s.launcher,
        "serving.nodes": ",".join(n.name for n in serving_nodes(desired)),
        "serving.tensor_parallel_size": str(s.tensor_parallel_size),
        "serving.pipeline_parallel_size": str(s.pipeline_parallel_size),
        "serving.gpu_memory_utilization": s.gpu_memory_utilization,
        "serving.port": str(s.port), "serving.host": s.host,
        "serving.max_model_len": str(s.max_model_len) if s.max_model_len else None,
        "serving.served_model_name": s.served_model_name,
        "model.layout": model.layout, "model.id": None if plain else model.id,
        "model.revision": None if plain else model.revision,
        "model.path": model.path if isinstance(model.path, str) else model.path[node.name],
        me + "fabric.interface": node.fabric.interface, me + "fabric.address": str(node.fabric.address.ip),
        f"nodes.{head(desired).name}.fabric.address": str(head(desired).fabric.address.ip),
        **{f"serving.env.{k}": v for k, v in s.env.items()},
    }


def _label_inputs(c: Container) -> dict[str, str] | None:
    """The launch label as JSON (an object of field -> text); None: no label, or not such an object."""
    try:
        value = json.loads(c.labels.get(LAUNCH, ""))
    except ValueError:
        return None
    if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
        return None
    return value


def _differs(want: str | float | None, got: str | None) -> bool:
    if want is None or got is None:
        return want is not got
    if isinstance(want, float):
        try:
            return float(got) != want
        except ValueError:
            return True
    return got != want


def launch_mismatch(desired: Desired, node: Node, c: Container) -> str | None:
    """Why `c`'s launch is not the file's, or None: the label's fields against the file's."""
    got = _label_inputs(c)
    if got is None:
        return "no readable launch label"
    want = launch_fields(desired, node)
    want |= {k: None for k in got if k.startswith("serving.env.") and k not in want}  # the file's env, no more
    wrong = [k for k, value in want.items() if _differs(value, got.get(k))]
    return ", ".join(f"{k} {got.get(k)!r}" for k in wrong) or None


# --- violations ---------------------------------------------------------------------------------------------------

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
    if want.rdma_device and link.rdma is not None and not link.rdma.state.strip().endswith("ACTIVE"):
        out.append(Violation(node, "rdma", f"{want.interface} {want.rdma_device}"))
    return out


def _links(obs: NodeObservation) -> tuple[Link | None, Link | None]:
    return obs.fabric, obs.fabric_twin


def _unwanted(desired: Desired, observed: Observed, node: str, c: Container) -> str | None:
    """Why a running container must not run on `node`, or None."""
    if not runs(c) or protected(desired, node, c.name):
        return None
    if managed(c):  # a reconciler's: ours only when its instance is ours (no instance label = ours, legacy)
        if not ours(desired, observed, c):
            return None
        spans = node in {n.name for n in serving_nodes(desired)}
        return None if spans and c.name == desired.serving.container_name else "stray"
    return None if allowed(desired, node, c.name) else "co-tenant"


def reference_image(desired: Desired, observed: Observed) -> tuple[str, str] | None:
    """(node, content) of the image serving must run: the first usable image source that holds the tag."""
    for name in image_sources(desired):
        obs = seen(observed, name)
        image = obs.images.get(desired.serving.image) if obs is not None else None
        if usable(observed, name) and image is not None:
            return name, image.content
    return None


def _same_weights(desired: Desired, observed: Observed, node: str) -> bool:
    """Every file of the source's tree is on `node` with its size (and hash where both know it)."""
    src, here = seen(observed, weights_source(desired)), seen(observed, node)
    source = src.weights if src is not None else None
    have_tree = here.weights if here is not None else None
    if source is None or have_tree is None or not have_tree.present:
        return False
    have = {f.path: (f.size, f.sha256) for f in have_tree.files}
    for f in source.files:
        size, sha = have.get(f.path, (None, None))
        if size != f.size or (f.sha256 and sha and sha != f.sha256):
            return False
    return True


def _serving_violation(desired: Desired, observed: Observed, node: Node) -> Violation | None:
    obs = seen(observed, node.name)
    assert obs is not None
    image = obs.images.get(desired.serving.image)
    c = named(obs, desired.serving.container_name)
    if c is None:
        return Violation(node.name, "serving", "missing")
    if not ours(desired, observed, c):
        return Violation(node.name, "serving", f"another's: {c.labels.get(INSTANCE)}")
    if not runs(c):
        return Violation(node.name, "serving", c.state)
    if why := launch_mismatch(desired, node, c):
        return Violation(node.name, "serving", f"launched from another file: {why}")
    if image is not None and c.image_id and c.image_id != image.id:
        return Violation(node.name, "serving", f"runs image {c.image_id}, the node holds {image.id}")
    return None


def serves(desired: Desired, observed: Observed) -> bool:
    """The head's API answers as docs/architecture.md says healthy is: /health 200, the model listed, one
    completion answered, and the port held by the serving (root), not someone else."""
    obs = seen(observed, head(desired).name)
    api = obs.serving if obs is not None else None
    return (api is not None and api.healthy and served_name(desired) in api.models
            and api.completion_error is None and api.port_holder is None)


def violations(desired: Desired, observed: Observed) -> list[Violation]:
    """Everything in `observed` that differs from the file, on the nodes whose state is known."""
    out: list[Violation] = []
    for node in desired.nodes:
        obs = seen(observed, node.name)
        if obs is None or not answers(obs):
            continue
        for want, link in zip(ports(node), _links(obs), strict=False):
            out += _port_violations(node.name, want, node.fabric.mtu, link)
        if obs.docker_reachable:
            out += [Violation(node.name, why, c.name) for c in obs.containers
                    if (why := _unwanted(desired, observed, node.name, c))]
    ref = reference_image(desired, observed)
    for node in serving_nodes(desired):
        if not usable(observed, node.name):
            continue
        obs = seen(observed, node.name)
        assert obs is not None
        image = obs.images.get(desired.serving.image)
        if ref is None or image is None or image.content != ref[1]:
            out.append(Violation(node.name, "image"))
        if node.name != weights_source(desired) and not _same_weights(desired, observed, node.name):
            out.append(Violation(node.name, "weights"))
        if v := _serving_violation(desired, observed, node):
            out.append(v)
    if usable(observed, head(desired).name) and not serves(desired, observed):
        out.append(Violation(head(desired).name, "health"))
    return out


# --- harm: what no plan may do -----------------------------------------------------------------------------------

def may_stop(desired: Desired, before: Observed, node: str, c: Container) -> str | None:
    """Why the reconciler must not stop `c` on `node`, or None (docs/security.md "Containers", co_tenants in
    docs/desired-state.md): protected wins everywhere; a container another reconciler made is never touched; of
    the others, only an unlisted one, and only with `unlisted: stop`."""
    if protected(desired, node, c.name):
        return "protected"
    if ours(desired, before, c):
        return None
    if managed(c):
        return f"another cluster's (instance {c.labels.get(INSTANCE)})"
    if allowed(desired, node, c.name):
        return "allowed"
    return "unlisted: report" if desired.co_tenants.unlisted == "report" else None


def _by_id(containers: Iterable[Container]) -> dict[str, Container]:
    return {c.id: c for c in containers}


def harm(desired: Desired, before: Observed, after: Observed) -> list[Violation]:
    """Containers a plan stopped or removed that it must not have: any the file or ownership forbids stopping,
    and any removed that was not this cluster's (the reconciler removes only its own)."""
    out = []
    for name, was in before.nodes.items():
        now = seen(after, name)
        left = _by_id(now.containers if now is not None else ())
        for c in was.containers:
            kept = left.get(c.id)
            if kept is None and not ours(desired, before, c):
                out.append(Violation(name, "touched", f"{c.name} removed, not this cluster's"))
            elif runs(c) and (kept is None or not runs(kept)) and (why := may_stop(desired, before, name, c)):
                out.append(Violation(name, "touched", f"{c.name} stopped: {why}"))
    return out


# --- what the reconciler cannot fix on its own, judged from the state before the plan ---------------------------

def _netdev_fine(node: str, want: FabricPort, mtu: int, link: Link | None) -> bool:
    return not [v for v in _port_violations(node, want, mtu, link) if v.what != "rdma"]


def _can_fetch(desired: Desired, before: Observed, node: str) -> bool:
    """The file says `node` has internet and it answers: it downloads the weights or pulls the image itself
    (docs/architecture.md, "Staging")."""
    return node_of(desired, node).internet and usable(before, node)


def _image_unavailable(desired: Desired, before: Observed) -> bool:
    """No image source holds the image (and none can pull it), or the one that does misses the pin
    (`serving.image_id`: the image's id or one of its repository digests, docs/desired-state.md)."""
    ref = reference_image(desired, before)
    if ref is None:
        return not any(_can_fetch(desired, before, n) for n in image_sources(desired))
    pin = desired.serving.image_id
    obs = seen(before, ref[0])
    assert obs is not None
    image = obs.images[desired.serving.image]
    return bool(pin) and pin != image.id and not any(d.rpartition("@")[2] == pin for d in image.digests)


def _weights_unavailable(desired: Desired, before: Observed) -> str | None:
    """Why no node can be brought the weights: the source cannot be read or lacks them (only matters when
    another serving node needs a copy), or its hub cache does not resolve model.revision (nothing can load it)."""
    source = weights_source(desired)
    src = seen(before, source)
    needed = any(n.name != source for n in serving_nodes(desired))
    if src is None or not answers(src):
        return "the weights' source cannot be read" if needed else None
    online = node_of(desired, source).internet
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
    obs = seen(before, node)
    assert obs is not None
    own = named(obs, desired.serving.container_name)
    if own is not None and ours(desired, before, own) and runs(own):
        return False
    if desired.co_tenants.unlisted == "stop" and any(_unwanted(desired, before, node, c) == "co-tenant"
                                                     for c in obs.containers):
        return False
    mem = obs.memory
    return mem is not None and mem.available_bytes < (desired.serving.gpu_memory_utilization * mem.total_bytes
                                                      + desired.policy.memory_overhead_per_instance
                                                      + desired.policy.memory_margin)


def _image_refuses(desired: Desired, before: Observed) -> bool:
    """The image's own `vllm serve --help=all` (asked once per image id) is pending, lacks `ray` for the Ray
    launcher, or does not know a flag of serving.extra_args (vLLM takes `--a_b` for `--a-b`)."""
    flags, ref = before.serve_flags, reference_image(desired, before)
    obs = seen(before, ref[0]) if ref is not None else None
    if flags is None or obs is None or obs.images[desired.serving.image].id != flags.image_id:
        return False
    if flags.pending or (desired.serving.launcher == "ray" and flags.has_ray is False):
        return True
    known = set(flags.flags)
    return flags.error is None and any(
        a.split("=", 1)[0] not in known and a.split("=", 1)[0].replace("_", "-") not in known
        for a in desired.serving.extra_args if a.startswith("--"))


def serving_cannot_restart(desired: Desired, before: Observed) -> str | None:
    """Why an ordered serving (re)start must wait for someone else, or None."""
    for node in serving_nodes(desired):
        obs = seen(before, node.name)
        if obs is None or not usable(before, node.name):
            return f"{node.name} cannot be reached or asked"
        for want, link in zip(ports(node), _links(obs), strict=False):
            if link is None or not link.exists:
                return f"{node.name} has no {want.interface}"
            if (want.rdma_device and link.rdma is not None and not link.rdma.state.strip().endswith("ACTIVE")
                    and _netdev_fine(node.name, want, node.fabric.mtu, link)):
                return f"{node.name}: RDMA port down with its netdev fine (cabling)"
        c = named(obs, desired.serving.container_name)
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
    obs = seen(before, head(desired).name)
    health = obs.serving if obs is not None else None
    if health is None or not health.served_before:
        return False
    grace = desired.serving.unhealthy_grace * 2 ** min(health.health_restarts, 4)
    return (health.unhealthy_for or 0.0) < grace


def excuse(desired: Desired, before: Observed, v: Violation) -> str | None:
    """Why `v` may remain after the plan's effects, or None when the reconciler should have fixed it."""
    if v.what == "link-missing":
        return "hardware: the interface does not exist"
    if v.what == "rdma":
        node = node_of(desired, v.node)
        obs = seen(before, v.node)
        assert obs is not None
        if all(_netdev_fine(v.node, want, node.fabric.mtu, link) for want, link in zip(ports(node), _links(obs),
                                                                                        strict=False)):
            return "cabling or firmware: the netdev was fine"
        return None
    if v.what == "co-tenant":
        if desired.co_tenants.unlisted == "report":
            return "unlisted: report"
        # A start is wanted when serving is wrong, or when a serving node lacks the reference image: its rank
        # must then restart on the reference (a rank left on the old content would serve beside the new ones).
        spans = {n.name for n in serving_nodes(desired)}
        wanted = any(w.what in ("serving", "health") or (w.what == "image" and w.node in spans)
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
