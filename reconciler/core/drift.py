"""desired x observed -> the list of differences. Pure: no I/O, no clock, no globals.

A drift names one resource on one node, what was expected and what was seen. It says whether the reconciler can
act on it (`actionable`) and whether it stops other work (`blocking`: an unreachable node, memory that no planned
step frees, a serving name taken by a container the reconciler did not create).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Final, Literal, get_args

from reconciler.core.budget import budgets, gib
from reconciler.core.completeness import incomplete_reason
from reconciler.core.cuda import judge
from reconciler.core.fabric import ports_seen, twin_only_down
from reconciler.core.observed import (
    LABEL_INSTANCE,
    LABEL_LAUNCH,
    LABEL_SPEC_HASH,
    Container,
    Image,
    Link,
    NodeObservation,
    Observed,
    Weights,
)
from reconciler.core.ownership import Owner, owner
from reconciler.core.platforms import machine_platform, runs_on
from reconciler.core.spec import Desired, FabricPort, Node
from reconciler.core.vllm import LaunchSpec, launch_specs, memory_needed, weights_size

DriftKind = Literal["unreachable", "probe", "docker", "co-tenant", "link", "rdma", "gpu", "weights", "image",
                    "serving", "health", "memory"]
DRIFT_KINDS: tuple[DriftKind, ...] = get_args(DriftKind)


@dataclass(frozen=True)
class NodeCondition:
    """A per-node condition of /status (Kubernetes style): its type and its reason when it holds or not."""

    type: str
    good: str
    bad: str


REACHABLE: Final = NodeCondition("Reachable", "SshOk", "Unreachable")
PROBED: Final = NodeCondition("Probed", "ProbeOk", "ProbeFailed")
DOCKER_REACHABLE: Final = NodeCondition("DockerReachable", "DockerOk", "DockerUnreachable")
FABRIC_LINK_UP: Final = NodeCondition("FabricLinkUp", "LinkUp", "LinkDrift")
WEIGHTS_IN_SYNC: Final = NodeCondition("WeightsInSync", "InSync", "WeightsDrift")
GPU_READY: Final = NodeCondition("GpuReady", "GpuAnswers", "GpuStackFailing")
IMAGE_IN_SYNC: Final = NodeCondition("ImageInSync", "InSync", "ImageDrift")
SERVING_RUNNING: Final = NodeCondition("ServingRunning", "Running", "ServingDrift")

#: The node's own conditions, judged from its observation (the same fact as its `unreachable`, `probe` or
#: `docker` drift, with the reason the observation gives), then those judged from its drift, in /status order.
REACHABILITY_CONDITIONS: Final = (REACHABLE, PROBED, DOCKER_REACHABLE)
DRIFT_CONDITIONS: Final = (FABRIC_LINK_UP, WEIGHTS_IN_SYNC, GPU_READY, IMAGE_IN_SYNC, SERVING_RUNNING)

#: The node condition each drift kind shows in: a new kind is declared here or the import fails, so no drift that
#: needs action can go unsaid in /status, the metrics and `reconciler status` (a co-tenant to stop once showed in
#: none). A co-tenant is said under ServingRunning: the file keeps the node for its serving, and the stop frees
#: memory for it. `health` shows in none: it is the head's API, not a node's, and has its own gauge
#: (`reconciler_serving_healthy`), alert and ServingBusy; None says so on purpose.
CONDITION_OF: Final[Mapping[DriftKind, NodeCondition | None]] = {
    "unreachable": REACHABLE, "probe": PROBED, "docker": DOCKER_REACHABLE,
    "co-tenant": SERVING_RUNNING, "link": FABRIC_LINK_UP, "rdma": FABRIC_LINK_UP, "gpu": GPU_READY,
    "weights": WEIGHTS_IN_SYNC, "image": IMAGE_IN_SYNC, "serving": SERVING_RUNNING, "health": None,
    "memory": SERVING_RUNNING,
}
if set(CONDITION_OF) != set(DRIFT_KINDS) or not {
        c for c in CONDITION_OF.values() if c} <= {*REACHABILITY_CONDITIONS, *DRIFT_CONDITIONS}:
    raise AssertionError("every DriftKind declares its node condition (CONDITION_OF), one of the listed ones")

#: The kinds that say a node is not usable (`NodeObservation.usable`): nothing is planned on it.
UNUSABLE_KINDS: Final = frozenset(k for k, c in CONDITION_OF.items() if c in REACHABILITY_CONDITIONS)


SECRET_FIELD = "serving.secrets."


@dataclass(frozen=True)
class FieldChange:
    """One field of a serving launch that differs between the running container (its `LABEL_LAUNCH`) and the
    file: what the plan shows as `~ serving.max_model_len = 32768 -> 65536  # forces replacement`. A secret's
    values are fingerprints, which are never shown: it is `secret NAME changed`."""

    field: str
    old: str | None  # None: not set then
    new: str | None  # None: not set now

    @property
    def secret(self) -> bool:
        return self.field.startswith(SECRET_FIELD)

    @property
    def action(self) -> Literal["changed", "added", "removed"]:
        return "added" if self.old is None else "removed" if self.new is None else "changed"

    def words(self) -> str:
        if self.secret:
            return f"secret {self.field.removeprefix(SECRET_FIELD)} {self.action}"
        return f"{self.field} = {_or_null(self.old)} -> {_or_null(self.new)}"

    def as_dict(self, node: str) -> dict[str, object]:
        """For `plan --json`: a secret's old and new are null, as its fingerprints are no one's business."""
        shown = (None, None) if self.secret else (self.old, self.new)
        return {"node": node, "field": self.field, "old": shown[0], "new": shown[1], "secret": self.secret,
                "action": self.action}


def _or_null(value: str | None) -> str:
    return "null" if value is None else value


def field_changes(old: dict[str, str], new: dict[str, str]) -> tuple[FieldChange, ...]:
    """Every field whose value differs, in field order (a secret by its fingerprint)."""
    return tuple(FieldChange(k, old.get(k), new.get(k)) for k in sorted(old.keys() | new.keys())
                 if old.get(k) != new.get(k))


@dataclass(frozen=True)
class Drift:
    node: str
    kind: DriftKind
    resource: str
    expected: str
    observed: str
    actionable: bool = True
    blocking: bool = False
    #: The container a co-tenant or serving drift names (its resource is `container/NAME`): typed for the plan, so
    #: nothing parses the resource back. Left out of equality: the resource already says it.
    container: str | None = field(default=None, compare=False)
    #: A serving container on another spec: the fields of its launch that differ (`FieldChange`), which its
    #: `observed` says in words. Empty when the label does not say (an older container) or nothing of the file
    #: differs (the rendering changed). Left out of equality, like `container`.
    changes: tuple[FieldChange, ...] = field(default=(), compare=False)
    #: The deployment it is about, in a file of several (None: the node's own, or a file of one).
    deployment: str | None = None

    def as_dict(self) -> dict[str, object]:
        return {"node": self.node, "kind": self.kind, "resource": self.resource, "expected": self.expected,
                "observed": self.observed, "actionable": self.actionable, "blocking": self.blocking,
                **({"deployment": self.deployment} if self.deployment else {})}


def _on_container(node: str, kind: DriftKind, container: str, expected: str, observed: str, *,
                  actionable: bool = True, blocking: bool = False, changes: tuple[FieldChange, ...] = ()) -> Drift:
    return Drift(node, kind, f"container/{container}", expected, observed, actionable, blocking, container, changes)


def _reachability(name: str, obs: NodeObservation) -> list[Drift]:
    if not obs.reachable:
        return [Drift(name, "unreachable", f"node/{name}", "reachable over SSH", obs.error or "unreachable",
                      actionable=False, blocking=True)]
    if obs.probe_error is not None:
        return [Drift(name, "probe", f"probe/{name}", "probe output that parses", obs.probe_error,
                      actionable=False, blocking=True)]
    if not obs.docker_reachable:
        return [Drift(name, "docker", f"docker/{name}", "docker engine answering",
                      obs.docker_error or "docker not reachable", actionable=False, blocking=True)]
    return []


def co_tenant_drift(desired: Desired, name: str, obs: NodeObservation) -> list[Drift]:
    """Running containers that are neither allowed, protected, managed by us nor one of our questions."""
    out = []
    ct = desired.co_tenants
    for c in obs.containers:
        if (not c.running or c.managed or c.query or ct.is_allowed(name, c.name)
                or ct.is_protected(name, c.name)):
            continue
        out.append(_on_container(name, "co-tenant", c.name, "not running (not allowed)",
                         f"running ({c.image})", actionable=ct.unlisted == "stop"))
    return out


def link_drift(node: Node, obs: NodeObservation) -> list[Drift]:
    """Every declared port of the node's fabric (the first, and its twin) as declared: present, up, MTU, address,
    RDMA port active. A twin whose RDMA port is not ACTIVE while the first port carries blocks nothing: NCCL
    serves on the first (core/fabric.py); it is said, in the drift and the FabricLinkUp condition."""
    degraded = twin_only_down(node, obs)
    return [dataclasses.replace(d, blocking=False) if i == 1 and degraded and d.kind == "rdma" else d
            for i, (port, link) in enumerate(ports_seen(node, obs))
            for d in _port_drift(node.name, port, node.fabric.mtu, link)]


def _port_drift(name: str, want: FabricPort, mtu: int, link: Link | None) -> list[Drift]:
    res = f"link/{want.interface}"
    if link is None or not link.exists:
        return [Drift(name, "link", res, "interface present", "no such interface", actionable=False,
                      blocking=True)]
    out = []
    if not link.admin_up:
        out.append(Drift(name, "link", res, "up", "admin-down"))
    elif not link.carrier:
        # Up on this side but no carrier: the peer's port or the cable. Not this node's to fix; it clears when
        # the peer's link step brings the other end up, and a dead fabric shows up as a failed serving start.
        out.append(Drift(name, "link", res + "/carrier", "carrier", "no carrier (peer port down or cable)",
                         actionable=False))
    elif not link.up:
        # Up with carrier, and still the kernel passes nothing (`Link.up`): 802.1X, a driver's self-test. Not
        # the link step's to fix either (`ip link set up` is done already).
        out.append(Drift(name, "link", res + "/operstate", "operstate up", f"operstate {link.operstate} (admin "
                         "up with carrier, but the kernel passes no traffic)", actionable=False))
    if link.mtu != mtu:
        out.append(Drift(name, "link", res + "/mtu", str(mtu), str(link.mtu)))
    if str(want.address) not in link.addresses:
        out.append(Drift(name, "link", res + "/address", str(want.address), ", ".join(link.addresses) or "none"))
    if want.rdma_device and link.rdma is not None and not link.rdma.active:
        # Bringing the netdev up is what activates the RDMA port; alone, it is a cabling/firmware matter.
        out.append(Drift(name, "rdma", f"rdma/{want.rdma_device}", "4: ACTIVE",
                         f"{link.rdma.state} ({link.rdma.phys_state})", actionable=any(d.actionable for d in out),
                         blocking=not any(d.actionable for d in out)))
    return out


def weights_difference(expected: Weights, seen: Weights | None) -> str | None:
    """None when `seen` holds every expected path with the same resolved size (and hash, where both know it).

    Sizes are those of the link targets, so a copy holding only symlinks (broken: size None) never passes; a
    link on one side and a real file of the same size on the other is fine (real bytes either way)."""
    if seen is None or not seen.present:
        return "missing"
    have = {f.path: f for f in seen.files}
    missing = wrong = 0
    for f in expected.files:
        got = have.get(f.path)
        if got is None or (got.size is None and f.size is not None):
            missing += 1
        elif got.size != f.size or (f.sha256 and got.sha256 and f.sha256 != got.sha256):
            wrong += 1
    if missing or wrong:
        return f"{missing} missing, {wrong} different of {len(expected.files)} files"
    return None


def _memory_drift(desired: Desired, name: str, obs: NodeObservation, weights: int | None) -> list[Drift]:
    mem = obs.memory
    if mem is None:
        return []
    need = memory_needed(desired, mem.total_bytes, weights)
    if mem.available_bytes >= need:
        return []
    gib = 2**30
    return [Drift(name, "memory", f"memory/{name}", f">= {need / gib:.1f} GiB available",
                  f"{mem.available_bytes / gib:.1f} GiB available of {mem.total_bytes / gib:.1f} GiB",
                  actionable=False, blocking=True)]


def serving_drift(desired: Desired, observed: Observed, reference: str | None = None) -> list[Drift]:
    """Serving containers as the launch specs say. A container on another image than its node now holds under
    the reference must restart (compared by the node's own id: ids are per engine), and so must one on a node
    whose image is not the reference's content (`reference`), which this plan's image step replaces. Whose a
    container is, `core.ownership` says: a container labelled with another name is never ours, and the drift says
    how it may be adopted (a renumbered head) or that the head could not be asked. A node the observation lacks
    (one made under an older file) did not answer."""
    out = []
    observed = observed.covering(n.name for n in desired.nodes)
    ours = owner(desired, observed)
    specs = {s.node: s for s in launch_specs(desired)}
    for node in desired.nodes:
        obs = observed.node(node.name)
        if not obs.usable:
            continue
        if not desired.is_part:  # a file of several says its stale containers once, on the whole (`diff`)
            out += _stale_on(desired, node.name, obs, ours)
        spec = specs.get(node.name)
        if spec is not None and (drift := _serving_container_drift(desired, node.name, obs, spec, ours,
                                                                   reference)) is not None:
            out.append(drift)
    return out


def _serving_container_drift(desired: Desired, node: str, obs: NodeObservation, spec: LaunchSpec, ours: Owner,
                             reference: str | None) -> Drift | None:
    """How the node's serving container differs from its launch spec, the first difference only (missing,
    someone else's, stopped, another spec, another image), or None when it is as specified."""
    name = desired.serving.container_name
    c = obs.container(name)
    if c is None:
        return _on_container(node, "serving", name, f"running, spec {spec.spec_hash}", "missing")
    if not c.owned_by(ours):
        seen = (ours.foreign(c.labels.get(LABEL_INSTANCE)) if c.managed
                else "a container not created by the reconciler holds the name")
        return _on_container(node, "serving", name, f"created by this reconciler ({ours.describe()})",
                             seen, actionable=False, blocking=True)
    if not c.running:
        return _on_container(node, "serving", name, "running", c.state)
    if c.labels.get(LABEL_SPEC_HASH) != spec.spec_hash:
        return _spec_drift(node, spec, c)
    return _serving_image_drift(desired, node, obs, c, reference)


def _serving_image_drift(desired: Desired, node: str, obs: NodeObservation, c: Container,
                         reference: str | None) -> Drift | None:
    """Our running container on its spec, but on another image than the node holds under the reference, or on
    a node whose image is not the reference's content; None when neither."""
    name = desired.serving.container_name
    local = obs.images.get(desired.serving.image)
    if local and c.image_id and c.image_id != local.id:
        return _on_container(node, "serving", name, f"image {local.id[:19]}", f"image {c.image_id[:19]}")
    if reference is not None and (local is None or local.content != reference):
        # the image step brings the reference's content in this plan; a rank left on the old one would
        # serve beside ranks of the new (found by the oracle property, tests/unit/oracle.py)
        return _on_container(node, "serving", name, f"image content {reference[:19]}",
                             f"image content {local.content[:19] if local else 'missing'}")
    return None


def _stale_on(desired: Desired, node: str, obs: NodeObservation, ours: Owner) -> list[Drift]:
    """Our running containers on `node` that no deployment wants there (a node left a span, a container name
    changed, a deployment left the file): stopped, never removed; a protected one is left alone."""
    wanted = desired.serving_containers
    return [_on_container(node, "serving", c.name, "not running (no longer wanted)", "running")
            for c in obs.containers if c.owned_by(ours) and c.running and (node, c.name) not in wanted
            and not desired.co_tenants.is_protected(node, c.name)]


def stale_serving_drift(desired: Desired, observed: Observed) -> list[Drift]:
    """`_stale_on` on every usable node, for a file of several deployments (a file of one says it in
    `serving_drift`, in the order it always did)."""
    ours = owner(desired, observed)
    return [d for node in desired.nodes if observed.node(node.name).usable
            for d in _stale_on(desired, node.name, observed.node(node.name), ours)]


def _spec_drift(node: str, spec: LaunchSpec, c: Container) -> Drift:
    """Our running container on another spec hash, with what differs: the fields of its launch label against the
    file's (`~ serving.max_model_len = 32768 -> 65536`, `secret NAME changed`); none when the label's inputs are
    the file's (the same file renders another launch: a reconciler upgrade); only the hashes when it has no
    label, or one that does not parse."""
    seen = f"spec {c.labels.get(LABEL_SPEC_HASH, 'none')}"
    old = c.launch_inputs
    if old is None:
        why = "started before field labels" if LABEL_LAUNCH not in c.labels else "its field label is unreadable"
        return _on_container(node, "serving", spec.container_name, f"spec {spec.spec_hash}", f"{seen} ({why})")
    changes = field_changes(old, spec.inputs)
    words = ("; ".join(ch.words() for ch in changes) if changes else
             "no field of the file differs: the reconciler renders the launch differently now (an upgrade)")
    return _on_container(node, "serving", spec.container_name, f"spec {spec.spec_hash}", f"{seen} ({words})",
                         changes=changes)


def image_holder(desired: Desired, observed: Observed) -> str | None:
    """The node whose image is the reference: the first usable image source (the head, unless the file lists
    others) that has it. Never another node: a compromised worker that claims the tag must not become the
    source whose `docker save` the other nodes load."""
    return next((name for name in desired.image_sources if observed.node(name).usable
                 and observed.node(name).images.get(desired.serving.image)), None)


def image_puller(desired: Desired, observed: Observed) -> str | None:
    """The image source that pulls the serving image when no image source holds it: the first usable one with
    `internet: true`. None when none can (the file says the sources are offline, or none answers)."""
    return next((name for name in desired.image_sources
                 if desired.node(name).internet and observed.node(name).usable), None)


def budget_drift(desired: Desired, observed: Observed) -> list[Drift]:
    """A node whose deployments and co-tenant reservations pass its memory (core/budget.py): blocking, so no
    start is planned there and nothing stops for one (the plan holds the co-tenant stops of a blocked start);
    the owner lowers a fraction or a reservation, or moves a deployment."""
    return [Drift(b.node, "memory", f"budget/{b.node}", f"at most {gib(b.total)}: the node's memory",
                  f"over-committed: {b.words()}; lower a deployment's gpu_memory_utilization or a "
                  "co_tenants.memory reservation, or place a deployment elsewhere", actionable=False, blocking=True)
            for b in budgets(desired, observed) if b.over and observed.node(b.node).usable]


def _node_drift(desired: Desired, observed: Observed) -> list[Drift]:
    """Per node: reachability, the fabric link, co-tenants."""
    out: list[Drift] = []
    for node in desired.nodes:
        obs = observed.node(node.name)
        out += _reachability(node.name, obs)
        if obs.probed:
            out += link_drift(node, obs)
        if obs.usable:
            out += co_tenant_drift(desired, node.name, obs)
    return out


def _image_drift(desired: Desired, observed: Observed, ready: list[str], holder: str | None) -> list[Drift]:
    """Every usable serving node holds the reference image's content (the head's copy, or the first holder's),
    and the reference is the pinned one when `serving.image_id` pins it. Content, not id: a copy's id differs
    on Docker's containerd image store (moby#44833); its layers and config do not."""
    image = desired.serving.image
    res = f"image/{image}"
    if holder is None:
        return _image_nowhere(desired, observed, ready)
    reference = observed.node(holder).images[image]
    pin = desired.serving.image_id
    if pin and not reference.matches_pin(pin):
        online = next((n.name for n in desired.nodes if n.internet), holder)  # the worker cannot pull
        return [Drift(holder, "image", res, f"pinned {pin[:19]}", f"{reference.id[:19]} (pull the pinned image "
                      f"on {online}; nothing is copied or started on another)", actionable=False, blocking=True)]
    return [d for name in ready if (d := _node_image_drift(desired, observed, name, reference, holder)) is not None]


def _image_nowhere(desired: Desired, observed: Observed, ready: list[str]) -> list[Drift]:
    """No image source holds the serving image: pulled on the first internet source that answers, else each
    ready node says which source must pull it (blocking)."""
    image = desired.serving.image
    res = f"image/{image}"
    if puller := image_puller(desired, observed):
        # staged on the internet node first; the copies and the start follow on the next pass
        return [Drift(puller, "image", res, f"present on {puller}", f"missing: pulled there first (`docker "
                      f"pull {image}`), while what runs keeps serving")]
    sources, first = ", ".join(desired.image_sources), desired.image_sources[0]
    how = (f"{first} pulls it once it answers" if desired.node(first).internet else
           f"pull it on {first} (`docker pull {image}`): the file gives it no internet, so the reconciler does "
           "not")
    return [Drift(name, "image", res, f"present on an image source ({sources})",
                  f"on no reachable image source: {how}", actionable=False, blocking=True) for name in ready]


def _node_image_drift(desired: Desired, observed: Observed, name: str, reference: Image,
                      holder: str) -> Drift | None:
    """One ready node against the reference image: a platform it cannot run (blocking, nothing copied), content
    that differs (a copy, or blocking when docker's data root lacks the room), or None when it holds it."""
    image = desired.serving.image
    res = f"image/{image}"
    got = observed.node(name).images.get(image)
    machine = observed.node(name).machine
    if not runs_on(reference.platform, machine):
        assert machine is not None, "runs_on judges nothing without a machine"
        arch = machine_platform(machine).split("/")[1]
        return Drift(name, "image", res, f"an image for {machine_platform(machine)} (uname -m: {machine})",
                     f"{reference.platform} on {holder}: every rank would exit with 'exec format error'; "
                     f"pull the {arch} image on {holder} (or a multi-platform tag); nothing is copied, "
                     "stopped or started", actionable=False, blocking=True)
    if got is not None and got.content == reference.content:
        return None
    seen = f"content {got.content[:19]}" if got else "missing"
    lack = shortfall(observed.node(name), "image", disk_needs(desired, observed, name))
    return (Drift(name, "image", res, f"content {reference.content[:19]}", seen) if lack is None else
            Drift(name, "image", res, f"{gib(lack.needed)} free in docker's data root for the copy",
                  f"{seen}; {lack}", actionable=False, blocking=True))


#: What each way nvidia-smi fails means and what to do, by its exit status (NVML's nvmlReturn_t: 9 driver not
#: loaded, 18 library/driver version mismatch; 124 is `timeout`'s, 127 the shell's "not found").
_GPU_HINTS = {
    9: "the NVIDIA driver is not loaded (`dkms status`, `sudo dmesg | grep -i nvrm`); a reboot loads it",
    18: "the driver was updated without a reboot: reboot the node once the running generation can be spared",
    124: "nvidia-smi did not answer within 10 s: the driver is wedged; reboot the node",
    127: "no nvidia-smi: the NVIDIA driver is not installed (DGX OS ships it)",
}


def _gpu_drift(desired: Desired, observed: Observed, ready: list[str]) -> list[Drift]:
    """Every usable serving node's GPU stack answers, when the file asks for GPUs: nvidia-smi names the GPU and
    the driver, and docker can hand the GPU to a container. Blocking, never actionable: the reconciler does not
    reboot nodes or install drivers; the restart waits, so the running generation keeps serving."""
    if desired.serving.docker.gpus is None:
        return []
    out = []
    for name in ready:
        stack = observed.node(name).gpu_stack
        if stack is None:
            continue
        if stack.error is not None:
            hint = _GPU_HINTS.get(stack.status, "see `nvidia-smi` on the node")
            out.append(Drift(name, "gpu", f"gpu/{name}", "nvidia-smi naming the GPU and its driver",
                             f"nvidia-smi exited {stack.status}: {stack.error} ({hint}); every `docker run --gpus` "
                             "would fail too", actionable=False, blocking=True))
        if not stack.hook:
            out.append(Drift(name, "gpu", f"gpu/{name}/docker", "nvidia-container-runtime-hook on the PATH",
                             "missing: every `docker run --gpus` fails with 'could not select device driver \"\" "
                             "with capabilities: [[gpu]]' (install nvidia-container-toolkit, then restart docker: "
                             "moby registers its nvidia driver only when dockerd starts with the hook on its PATH)",
                             actionable=False, blocking=True))
    return out


def _driver_drift(desired: Desired, observed: Observed, ready: list[str]) -> list[Drift]:
    """The serving image's CUDA against each usable serving node's driver (core/cuda), once the image answered:
    below its CUDA major's floor a start cannot succeed, so it blocks before anything stops; in minor-version
    compatibility it is said (report only) and the start goes on."""
    flags = observed.serve_flags
    if desired.serving.docker.gpus is None or flags is None:
        return []
    out = []
    for name in ready:
        stack = observed.node(name).gpu_stack
        verdict = judge(stack.driver if stack is not None else None, flags.cuda_version, flags.cuda_driver_version,
                        flags.require_cuda)
        if verdict is not None:
            out.append(Drift(name, "gpu", f"gpu/{name}/cuda", f"a driver for {desired.serving.image}'s CUDA",
                             verdict.why, actionable=False, blocking=verdict.blocking))
    return out


def _weights_drift(desired: Desired, observed: Observed, ready: list[str]) -> list[Drift]:
    """Every usable serving node but the source matches the source's manifest."""
    out = []
    source = desired.source_node
    src_obs = observed.node(source)
    res = f"weights/{desired.model.id}"
    if src_obs.probed and (staging := _source_drift(desired, src_obs, res)):
        # once, and also when the source serves alone: nothing can serve (or be copied) what the source lacks
        return [staging]
    for name in ready:
        if name == source:
            continue
        if not src_obs.reachable:
            out.append(Drift(name, "weights", res, f"copy of {source}", f"source {source} unreachable",
                             actionable=False, blocking=True))
        elif src_obs.weights is None or not src_obs.weights.present:
            continue  # a source that answered but could not be read: its own drift says why (probe)
        else:
            target = observed.node(name)
            problem = weights_difference(src_obs.weights, target.weights)
            if problem:
                lack = shortfall(target, "weights", disk_needs(desired, observed, name))
                out.append(Drift(name, "weights", res, f"{len(src_obs.weights.files)} files, "
                                 f"{src_obs.weights.total_bytes} bytes", problem) if lack is None else
                           Drift(name, "weights", res, f"{gib(lack.needed)} free on "
                                 f"{desired.model.path_on(name)} for the copy", f"{problem}; {lack}",
                                 actionable=False, blocking=True))
    return out


#: What a filesystem needs free beyond the bytes copied to it: rsync's and docker's own files, and room for the
#: node to go on. Once per filesystem, however many copies write to it (`shortfall`).
DISK_MARGIN = 1 << 30


def missing_bytes(source: Weights, target: Weights | None) -> int:
    """Bytes of the source's files the target lacks or holds at another size: what the copy writes."""
    have = {f.path: f.size for f in target.files} if target is not None else {}
    return sum(f.size or 0 for f in source.files if f.link_target is None and have.get(f.path) != f.size)


def disk_needs(desired: Desired, observed: Observed, name: str) -> dict[str, int]:
    """What the plan copies to `name`, by where it writes: `weights` the bytes its tree lacks of the source's
    (`missing_bytes`), `image` the reference image's size where its content differs (and it runs there). The
    needs every judgement of free disk sums per filesystem (`shortfall`): the drift, doctor's `disk` check and
    the staging steps, which add their own (the download's bytes, the pull's floor)."""
    needs: dict[str, int] = {}
    target = observed.node(name)
    source = observed.node(desired.source_node)
    if name != desired.source_node and source.weights is not None and source.weights.present:
        needs["weights"] = missing_bytes(source.weights, target.weights)
    holder = image_holder(desired, observed)
    if holder is not None and holder != name:
        reference = observed.node(holder).images[desired.serving.image]
        got = target.images.get(desired.serving.image)
        if (got is None or got.content != reference.content) and runs_on(reference.platform, target.machine):
            needs["image"] = reference.size or 0
    return needs


def same_filesystem(obs: NodeObservation, where: str) -> list[str]:
    """The rows of `disk_free` on `where`'s filesystem, `where` first: by `disk_fs`, which the probe reads with
    the free bytes. A row without it (an older snapshot) is a filesystem of its own, as it was judged before."""
    on = (obs.disk_fs or {}).get(where)
    return [where, *(w for w in (obs.disk_free or {}) if w != where and on is not None
                     and (obs.disk_fs or {}).get(w) == on)]


@dataclass(frozen=True)
class Shortfall:
    """A copy that does not fit: `where`'s `bytes` and the `others` (where, bytes) writing to the same filesystem
    (`on`, as the probe named it), plus one DISK_MARGIN, are `needed`; the probe read `free` there."""

    where: str
    bytes: int
    free: int
    needed: int
    others: tuple[tuple[str, int], ...] = ()
    on: str | None = None

    def __str__(self) -> str:
        if not self.others:
            return (f"only {gib(self.free)} free: the copy would fill the disk; free {gib(self.needed - self.free)} "
                    "there (nothing is copied, stopped or started)")
        copies = " and ".join(f"the {w} copy ({gib(b)})" for w, b in ((self.where, self.bytes), *self.others))
        return (f"{copies} write to one filesystem ({self.on}) with only {gib(self.free)} free: together they would "
                f"fill the disk; free {gib(self.needed - self.free)} there (nothing is copied, stopped or started)")


def shortfall(obs: NodeObservation, where: str, needs: Mapping[str, int]) -> Shortfall | None:
    """The one judgement of free disk: what is copied to `where` (`needs[where]`) and every other need in `needs`
    on the same filesystem (`same_filesystem`: on DGX OS the model path and docker's data root are both on the
    one NVMe's `/`), plus one margin, against the free bytes the probe read there. None when it fits, or when
    the probe did not read `where` (an older snapshot)."""
    free = obs.disk_free
    if free is None or where not in free:
        return None
    rows = same_filesystem(obs, where)
    others = tuple((w, needs[w]) for w in rows[1:] if needs.get(w, 0) > 0)
    room = min(free[w] for w in rows)  # two reads of one filesystem: the lower
    mine = needs.get(where, 0)
    needed = mine + sum(b for _, b in others) + DISK_MARGIN
    if room >= needed:
        return None
    return Shortfall(where, mine, room, needed, others, (obs.disk_fs or {}).get(where))


def short_of(obs: NodeObservation, where: str, needs: Mapping[str, int]) -> str | None:
    """Why what is copied to `where` does not fit (`shortfall`, said); None when it does or was not read."""
    found = shortfall(obs, where, needs)
    return None if found is None else str(found)


def _source_drift(desired: Desired, src_obs: NodeObservation, res: str) -> Drift | None:
    """The source lacks the weights (or the declared revision): with `internet: true` it downloads them first
    (the `download` step: `hf download` there, while what runs keeps serving); offline, someone must put them
    there, and the drift says how (blocking). Either way nothing is copied or started before they are there: the
    plan's restart waits for the download step (planning._serving_steps)."""
    source, model = desired.source_node, desired.model
    problem = source_problem(desired, src_obs.weights)
    if problem is None:
        return None
    fetch = f"`hf download {model.id} --revision {model.revision}`"
    if desired.node(source).internet:
        return Drift(source, "weights", res, f"{model.id} at revision {model.revision} on the source",
                     f"{problem}: downloaded there first ({fetch}), while what runs keeps serving")
    return Drift(source, "weights", res, f"{model.id} at revision {model.revision} on the source",
                 f"{problem}: {source} has no internet in the file, so put them there ({fetch} where the Hub is "
                 f"reachable, then copy the tree to {model.path_on(source)})", actionable=False, blocking=True)


def source_problem(desired: Desired, weights: Weights | None) -> str | None:
    """Why the source's tree cannot be copied or served as the declared revision, or None: missing, the revision
    not resolvable offline, or a download not finished (core/completeness). One verdict for the plan, the
    preflight and the download step's own check after `hf download`."""
    model = desired.model
    if weights is None or not weights.present:
        return f"missing in {model.path_on(desired.source_node)}"
    if (unresolved := unresolved_revision(desired, weights)) is not None:
        return unresolved
    if (partial := incomplete_reason(weights, model.revision, model.layout)) is not None:
        return f"incomplete in {weights.root}: {partial}"
    return None


def unresolved_revision(desired: Desired, weights: Weights) -> str | None:
    """Why model.revision cannot be served offline from the source's HF cache, or None. Every serving node runs
    with HF_HUB_OFFLINE=1, where huggingface_hub resolves a branch or tag only by `refs/<revision>` and a commit
    only by `snapshots/<commit>/` (file_download.py); online, the head would re-resolve `main` at every start
    and could load a newer revision than the worker's copy (two ranks, two revisions)."""
    rev = desired.model.revision
    if desired.model.layout != "hf-cache":
        return None
    if any(f.path == f"refs/{rev}" or f.path.startswith(f"snapshots/{rev}/") for f in weights.files):
        return None
    return f"neither refs/{rev} nor snapshots/{rev}/ in {weights.root} (better pinned to a commit)"


def _freeing_memory(desired: Desired, observed: Observed, drift: list[Drift]) -> set[str]:
    """Nodes where the plan stops something that holds memory: an unallowed co-tenant, or our own running serving
    container (a serving restart stops it first). On unified memory (GB10) the running vLLM's share shows up as
    used in MemAvailable, so counting only MemAvailable would make every serving change wait for memory that
    only its own stop frees: a deadlock. The start step's preflight still checks the real MemAvailable after
    the stop."""
    stopping = {d.node for d in drift if d.kind == "co-tenant" and d.actionable}
    name = desired.serving.container_name
    ours = owner(desired, observed)
    for node in desired.serving_nodes:
        own = observed.node(node.name).container(name)
        if own is not None and own.owned_by(ours) and own.running:
            stopping.add(node.name)
    return stopping


def _memory_drift_where_serving_starts(desired: Desired, observed: Observed, ready: list[str],
                                       served: list[Drift], freeing: set[str]) -> list[Drift]:
    """Memory only matters where serving must (re)start and no planned stop frees memory there. `ready` leaves out
    a node over its budget: what its MemAvailable says does not matter while the total cannot hold the file."""
    out = []
    for name in sorted({d.node for d in served if d.actionable} - freeing):
        if name in ready:
            out += _memory_drift(desired, name, observed.node(name), weights_size(desired, observed))
    return out


def _health_drift(desired: Desired, observed: Observed) -> list[Drift]:
    """The API on the head answers and lists the served model."""
    head = desired.api_node.name
    if not observed.node(head).usable:
        return []
    want = desired.served_name
    health = observed.node(head).serving
    if health is not None and health.working(want):
        return []  # busy is serving: every slot taken, the probe's completion queued behind them (issue 30)
    if health is not None and health.port_holder is not None:
        # blocking, not actionable: a restart would stop our containers and then find the port taken
        return [Drift(head, "health", f"api/:{desired.serving.port}", f"healthy, serving {want}, completing",
                      f"port {desired.serving.port} held by uid {health.port_holder}, not by our serving (root): it "
                      "was sent no API key; stop that process", actionable=False, blocking=True)]
    if health is None or not health.reachable:
        seen = "not answering"
    elif not health.healthy:
        seen = "unhealthy"
    elif want not in health.models:
        seen = f"serving {', '.join(health.models) or 'nothing'}"
    else:
        seen = f"/health 200 but a completion failed: {health.completion_error}"
    return [Drift(head, "health", f"api/:{desired.serving.port}", f"healthy, serving {want}, completing", seen)]


def diff(desired: Desired, observed: Observed) -> list[Drift]:
    """Every difference between the declared and the observed cluster, in a stable order. A node the observation
    lacks (a snapshot from before the file named it) is one that did not answer.

    The nodes' own drift (reachability, links, co-tenants, the memory budget) is said once; then each
    deployment's, judged on its view of the file and of the observation (`Desired.view`, `Observed.view`), so a
    file of several is each of its deployments as a file of one, plus what only the whole knows: our stale
    containers, and one GPU drift per node however many deployments use it."""
    observed = observed.covering(n.name for n in desired.nodes)
    nodes = _node_drift(desired, observed) + budget_drift(desired, observed)
    if len(desired.deployments) == 1:
        return nodes + _deployment_drift(desired, observed, nodes)
    out = nodes + stale_serving_drift(desired, observed)
    for view in desired.views():
        name = view.deployment.name
        out += [d if d.kind == "gpu" else dataclasses.replace(d, deployment=name)
                for d in _deployment_drift(view, observed.view(name), nodes)]
    return list(dict.fromkeys(out))  # a node's GPU drift once


def _deployment_drift(desired: Desired, observed: Observed, nodes: list[Drift]) -> list[Drift]:
    """One deployment's drift: its GPUs, image, weights, serving containers, memory where it starts, health.
    `nodes`: the nodes' own drift said before it: the co-tenant stops that free memory, the budgets."""
    out: list[Drift] = []
    serving = {n.name for n in desired.serving_nodes}
    ready = [n.name for n in desired.nodes if n.name in serving and observed.node(n.name).usable]  # in file order
    holder = image_holder(desired, observed)
    out += _gpu_drift(desired, observed, ready)
    out += _driver_drift(desired, observed, ready)
    out += _image_drift(desired, observed, ready, holder)
    out += _weights_drift(desired, observed, ready)
    served = serving_drift(desired, observed,
                           observed.node(holder).images[desired.serving.image].content if holder else None)
    out += served
    over = {d.node for d in nodes if d.resource.startswith("budget/")}
    out += _memory_drift_where_serving_starts(desired, observed, [n for n in ready if n not in over], served,
                                              _freeing_memory(desired, observed, nodes + out))
    out += _health_drift(desired, observed)
    out += _port_neighbour_drift(desired, observed)
    return out


def _port_neighbour_drift(desired: Desired, observed: Observed) -> list[Drift]:
    """Listeners on the serving port at another address (`ServingApi.port_neighbours`: `[::1]`, `127.0.0.2`): in
    the way of neither the health checks nor vLLM's bind, so said, never acted on nor blocking (issue 53, B; a
    co-tenant's process, like a co-tenant under `unlisted: report`). A client that dials that address reaches
    them, not vLLM: `localhost` may resolve to ::1 first."""
    head = desired.api_node.name
    health = observed.node(head).serving if observed.node(head).usable else None
    if health is None or not health.port_neighbours:
        return []
    port = desired.serving.port
    return [Drift(head, "co-tenant", f"api/:{port}", f"no other listener on port {port}",
                  f"also listening on it at another address: {', '.join(health.port_neighbours)}; neither asked nor "
                  "in vLLM's way, but a client that dials that address (`localhost` may be ::1) reaches it, not "
                  f"vLLM: `sudo ss -ltnp 'sport = :{port}'` names the process", actionable=False)]
