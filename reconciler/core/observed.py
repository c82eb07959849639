"""The observed state: what one probe saw on each node, as frozen, JSON round-trippable models.

These models are the contract between the edge (the probe in `observe.py` fills them) and the pure core (drift and
plan read them). A snapshot printed by `reconciler observe --json` loads back with `Observed.model_validate_json`
and plans exactly like the live state, which is what makes offline `plan --observed` trustworthy.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Annotated, Any, Final, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, model_validator

if TYPE_CHECKING:
    from reconciler.core.ownership import Owner

SNAPSHOT_VERSION: Final = "spark-reconciler/observed/v1"

LABEL_MANAGED = "spark-reconciler.managed"
LABEL_SPEC_HASH = "spark-reconciler.spec-hash"
LABEL_GENERATION = "spark-reconciler.generation"
LABEL_ROLE = "spark-reconciler.role"
# On the reconciler's throw-away containers that answer a question and end by themselves (the serving image's own
# `vllm serve --help=all`): never a co-tenant to stop. Once unlabelled, the daemon stopped its own question as
# "running but not allowed" and the flag check failed open (issue 31).
LABEL_QUERY = "spark-reconciler.query"
# Which reconciler created the container: the cluster it serves, named by its head's cluster id (ClusterIdentity,
# `core.ownership`), or by the head's SSH address (Desired.instance) where that id is not known. Without it a
# container another reconciler made (or a copied `docker run` line) would look like one of ours.
LABEL_INSTANCE = "spark-reconciler.instance"
# The fixed TCP ports the container listens on (`LaunchSpec.listens`), comma-separated: which listeners on a node
# are our own generation's, so a held port is judged before anything stops.
LABEL_PORTS = "spark-reconciler.ports"
# The weights tree the container serves (`Desired.weights_root`): a container that mounts a whole hub still names
# the one model in it it uses, so retention may remove the hub's other models (core/retention.py).
LABEL_WEIGHTS = "spark-reconciler.weights"
# What the launch was rendered from (`vllm.launch_inputs`: dotted field -> short value, a secret as a fingerprint),
# compact JSON; not hashed. The next plan diffs it against the file's to say which fields force the restart. A
# label rather than the state directory: every observer reads it (`plan` run by another user, `apply`, the
# daemon), and it travels with the container it describes (docs/architecture.md, "The plan's field diff").
LABEL_LAUNCH = "spark-reconciler.launch"
#: Bounds of that label, the same for the writer and the reader: a label a node returns beyond them (or not
#: JSON, or holding what the writer never writes) is read as no label, so odd bytes cost the field diff, never
#: the plan.
MAX_LAUNCH_LABEL: Final = 32 * 1024
MAX_LAUNCH_VALUE: Final = 200
LAUNCH_KEY_PATTERN: Final = re.compile(r"[A-Za-z0-9_.-]{1,200}")


#: Whose a container is, judged on its labels alone (`whose`): not created by any spark-reconciler; this cluster's
#: (its instance label is one of the cluster's names); created before the instance label existed (managed, no
#: instance: an upgrade takes it over as its own); another cluster's (managed under another instance label).
Whose = Literal["unmanaged", "ours", "unlabelled", "another"]


def is_managed(labels: Mapping[str, str]) -> bool:
    """Created by a spark-reconciler, any cluster's: its managed label. Never a co-tenant to stop."""
    return labels.get(LABEL_MANAGED) == "true"


def whose(labels: Mapping[str, str], names: frozenset[str]) -> Whose:
    """The one judgement of whose a container is, on its labels: what the plan reads from the probe's container
    list and what a step reads from `docker inspect` right before acting, so the two can never disagree.
    `names`: every instance label that is this cluster's (`ownership.Owner.names`)."""
    if not is_managed(labels):
        return "unmanaged"
    label = labels.get(LABEL_INSTANCE)
    if label is None:
        return "unlabelled"
    return "ours" if label in names else "another"


def owned_by(labels: Mapping[str, str], owner: Owner) -> bool:
    """Created by the reconciler of this cluster (`core.ownership.owner`): its instance label is one of the names
    the cluster goes by. A container made before the instance label existed (managed, no instance) counts as
    ours, so an upgrade takes over its own serving."""
    return whose(labels, owner.names) in ("ours", "unlabelled")


def parse_launch_label(raw: str) -> dict[str, str] | None:
    """The launch inputs a container's label holds; None when it is not what `vllm.launch_label` writes (too
    long, not a JSON object of field -> printable value within the bounds). Never raises: the text is a node's."""
    if len(raw) > MAX_LAUNCH_LABEL:
        return None
    try:
        value = json.loads(raw)
    except (ValueError, RecursionError):
        return None
    if not isinstance(value, dict) or not all(
            isinstance(k, str) and LAUNCH_KEY_PATTERN.fullmatch(k) and isinstance(v, str)
            and len(v) <= MAX_LAUNCH_VALUE and v.isprintable() for k, v in value.items()):
        return None
    return value


class _Model(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class Container(_Model):
    name: str
    id: str
    image: str
    image_id: str = ""
    state: Literal["created", "running", "paused", "restarting", "removing", "exited", "dead"]
    labels: dict[str, str] = Field(default_factory=dict)
    started_at: str | None = None
    mounts: list[str] | None = Field(None, description="the host paths it bind-mounts, running or not; None: "
                                     "not read (an older snapshot): retention then removes no weights on its node")

    @model_validator(mode="before")
    @classmethod
    def _without_restart_count(cls, value: Any) -> Any:
        """Snapshots written before issue 34 carry docker's `restart_count`, which nothing ever judged (the
        serving containers run with `--restart no`): dropped, so `plan --observed` still reads them."""
        if isinstance(value, dict) and "restart_count" in value:
            return {k: v for k, v in value.items() if k != "restart_count"}
        return value

    @property
    def running(self) -> bool:
        return self.state in ("running", "restarting", "paused")

    @property
    def managed(self) -> bool:
        return is_managed(self.labels)

    @property
    def query(self) -> bool:
        """One of the reconciler's throw-away question containers (`LABEL_QUERY`)."""
        return LABEL_QUERY in self.labels

    @property
    def held_ports(self) -> frozenset[int] | None:
        """The fixed ports it was started to listen on; None: started before the label existed (not known)."""
        raw = self.labels.get(LABEL_PORTS)
        if raw is None:
            return None
        return frozenset(int(p) for p in raw.split(",") if p.isdigit())

    @property
    def launch_inputs(self) -> dict[str, str] | None:
        """What its launch was rendered from (`LABEL_LAUNCH`); None: no label, or one that does not parse."""
        raw = self.labels.get(LABEL_LAUNCH)
        return None if raw is None else parse_launch_label(raw)

    def owned_by(self, owner: Owner) -> bool:
        """This cluster's (`owned_by` over its labels)."""
        return owned_by(self.labels, owner)


class RdmaPort(_Model):
    """Kernel strings as read from /sys/class/infiniband/DEV/ports/1/{state,phys_state}, and the port's RoCE v2
    GIDs (`gid_attrs/types/N` reading "RoCE v2": index -> `gids/N` as the kernel prints it, `%pI6`)."""

    state: str  # e.g. "4: ACTIVE", "1: DOWN"
    phys_state: str  # e.g. "5: LinkUp", "3: Disabled"
    roce_v2_gids: dict[int, str] = Field(default_factory=dict, description="index -> GID of the port's RoCE v2 "
                                         "entries (an IPv4 one reads 0000:0000:0000:0000:0000:ffff:c0a8:c80d)")

    @property
    def active(self) -> bool:
        return self.state.strip().endswith("ACTIVE")


class Link(_Model):
    name: str
    exists: bool = True
    operstate: str = "unknown"  # "up", "down", "unknown" (veth/lo report unknown when up without carrier info)
    admin_up: bool = False
    carrier: bool = False
    mtu: int = 0
    addresses: list[str] = Field(default_factory=list, description="IPv4 with prefix, e.g. 192.168.200.12/24")
    rdma: RdmaPort | None = None

    @property
    def up(self) -> bool:
        """The one definition of a port that passes traffic, which the drift, the plan's text, the metrics, the
        doctor and the link step all ask. Three facts, as `ip -j addr` gives them: the port exists, is admin up
        (the `UP` flag: what `ip link set up` changes), has carrier (`LOWER_UP`: the peer's port and the cable),
        and the kernel's RFC 2863 operstate lets traffic through: `up`, or `unknown` from a driver that does not
        report one (lo, tun). With carrier the kernel may still hold a port `dormant` (802.1X waiting for its
        supplicant) or `testing`, and `lowerlayerdown` on a stacked one: none of those carries a packet."""
        return self.exists and self.admin_up and self.carrier and self.operstate in ("up", "unknown")


class Memory(_Model):
    total_bytes: int
    available_bytes: int


class GpuStack(_Model):
    """What a GPU start needs of a node, as its own tools say: the GPU and driver (`nvidia-smi --query-gpu=name,
    driver_version`), docker's way to them (moby registers its `nvidia` device driver, which `--gpus` selects,
    only when `nvidia-container-runtime-hook` is on dockerd's PATH: daemon/nvidia_linux.go), the kernel and the
    DGX OS release. After a driver update without a reboot nvidia-smi fails ("Failed to initialize NVML:
    Driver/library version mismatch") and so does every `docker run --gpus` (docs/troubleshooting.md)."""

    gpu: str | None = Field(None, description="the GPU's name (`NVIDIA GB10` on a Spark); None: nvidia-smi failed")
    driver: str | None = Field(None, description="the driver version (580.95.05 on the seed's Sparks)")
    error: str | None = Field(None, description="nvidia-smi's first line when it failed")
    status: int = Field(0, description="nvidia-smi's exit status (NVML's nvmlReturn_t where it has one)")
    hook: bool = Field(False, description="nvidia-container-runtime-hook is on the PATH (docker `--gpus`)")
    kernel: str = Field("", description="`uname -r`")
    dgx_os: str | None = Field(None, description="DGX OS release (`/etc/dgx-release`); None: not a DGX OS")


class WeightFile(_Model):
    path: str  # relative to the model root
    size: int | None  # None: a symlink whose target is missing
    mtime: float = 0.0
    sha256: str | None = None
    link_target: str | None = None


class Weights(_Model):
    root: str
    present: bool
    files: list[WeightFile] = Field(default_factory=list)
    unsafe: list[str] = Field(default_factory=list, description="links that leave the tree, as `PATH -> VALUE "
                              "(outside the tree: WHERE)`; the first few only (`unsafe_count` has them all). A tree "
                              "with any is never copied: rsync would carry what they point to")
    unsafe_count: int = 0
    partials: list[str] = Field(default_factory=list, description="files a Hub client is streaming or left behind "
                                "when cut (`*.incomplete`): not the model's, so never listed in `files`, never "
                                "copied or compared; they only tell whether a download finished "
                                "(core/completeness)")
    truncated: str | None = Field(None, description="why the listing is partial (more entries or levels than the "
                                  "probe lists): a partial view is never synced from")

    @property
    def total_bytes(self) -> int:
        return sum(f.size or 0 for f in self.files if f.link_target is None)

    def digest(self) -> str:
        """The tree as a copy leaves it: every path with its size, its mtime (find's `%T@`, as the listing read
        it) and its link value; no hashing: cheap at any size. Retention removes a tree it copied only while this
        still matches what the copy recorded, so a file a person added, resized or rewrote since keeps the whole
        tree: a fine-tune saved over the shards, or an edited config.json, keeps every size but not its mtime
        (issue 53, finding D: the digest once held no mtime, and such a tree was removed)."""
        lines = sorted(f"{f.path}\t{f.size}\t{f.mtime!r}\t{f.link_target}" for f in self.files)
        return hashlib.sha256("\n".join(lines).encode()).hexdigest()


class EngineLoad(_Model):
    """vLLM's own scheduler counters from the head's /metrics (vllm/v1/metrics/loggers.py names them), summed over
    their label sets: what tells a busy engine (every `--max-num-seqs` slot taken, the probe's completion waiting
    in the first-come-first-served queue, tokens still coming) from a wedged one (no token since the last probe)."""

    running: float = Field(description="vllm:num_requests_running")
    waiting: float = Field(description="vllm:num_requests_waiting")
    tokens: float = Field(description="vllm:prompt_tokens_total + vllm:generation_tokens_total: generation tokens "
                          "grow per engine step while long generations run; prompt tokens only when a request's "
                          "prefill completes (vLLM 0.20.1 `v1/metrics/stats.py`: `update_from_output` counts them "
                          "`if is_prefilling`, and the scheduler emits no partial-prefill output)")
    kv_usage: float | None = Field(None, description="vllm:kv_cache_usage_perc: set every engine step from the KV "
                                   "blocks allocated, so it moves while a chunked prefill runs with no token coming "
                                   "out; None: the image does not export it")


class ServingApi(_Model):
    """What the head's API answers (only probed on the head)."""

    reachable: bool = False
    healthy: bool = False
    models: list[str] = Field(default_factory=list)
    ray_nodes: int | None = None
    completion_error: str | None = Field(None, description="why one short completion failed; None: it answered "
                                         "or was not tried (the API was not healthy)")

    unhealthy_for: float | None = Field(None, description="seconds the head's serving has failed the health "
                                        "check, as the daemon watched it; None: serving, or not watched")
    served_before: bool = Field(False, description="this head container served since it started (or is older "
                                "than the cold-start allowance): a failure now is a wedge, not a slow start")
    health_restarts: int = Field(0, description="restarts for health in a row that did not hold (backoff)")
    engine: EngineLoad | None = Field(None, description="the engine's counters (read when /health answers 200); "
                                      "None: not read")
    busy: bool = Field(False, description="the completion did not answer, but the engine made progress since the "
                       "last probe (its tokens grew), as the daemon watched it: busy, not unhealthy")
    port_holder: int | None = Field(None, description="the uid of a listener on the serving port that is not "
                                    "root, which every serving container runs as: not our serving, so the probe "
                                    "sent it no API key and took nothing it said (issue 31); None: root or nobody")
    port_neighbours: list[str] = Field(default_factory=list, description="listeners on the serving port at another "
                                       "address (`uid 65534 on ::1`, `uid 1000 on 127.0.0.2`): in the way of "
                                       "neither the health checks nor vLLM's bind (core.listeners), so they hold "
                                       "nothing; said as report-only drift, since a client dialing that address "
                                       "(`localhost` may be ::1) reaches them, not vLLM (issue 53, B)")

    def serves(self, name: str) -> bool:
        """The one definition of healthy serving: /health 200, `name` listed, and a completion answered."""
        return (self.healthy and name in self.models and self.completion_error is None
                and self.port_holder is None)

    def working(self, name: str) -> bool:
        """Serving `name`, or busy serving it (the completion queued behind full slots while tokens keep coming):
        what the health drift, the healthy gauge and the alert judge. Never a reason to restart."""
        return self.serves(name) or (self.busy and self.healthy and name in self.models)


class Image(_Model):
    """One node's copy of the serving image. `id` is the engine's own and only good on that node: with Docker's
    containerd image store it is the digest of the manifest (list) the image came with, which `docker save |
    docker load` does not keep (moby#44833, docs/troubleshooting.md "Image ids"). `content` is what a copy
    keeps on either store: a hash of the layers' diff ids and the runtime config."""

    id: str
    content: str
    digests: list[str] = Field(default_factory=list, description="repository digests (`repo@sha256:...`)")
    store: str = Field("", description="the engine's image store: `containerd` or the graph driver's name")
    entrypoint: list[str] = Field(default_factory=list, description="the image config's Entrypoint (NGC's: "
                                  "/opt/nvidia/nvidia_entrypoint.sh, which sets up CUDA forward compatibility)")
    size: int | None = Field(None, description="bytes of the unpacked image (inspect `Size`): what a `docker load` "
                             "of it writes; None: not said")
    platform: str = Field("", description="`OS/ARCH[/VARIANT]` from the inspect object (`linux/arm64` on a "
                          "Spark); \"\": not said (an older snapshot)")

    @model_validator(mode="before")
    @classmethod
    def _from_id(cls, value: Any) -> Any:
        """Snapshots written before `content` existed hold only the id: the id stands for the content."""
        return {"id": value, "content": value} if isinstance(value, str) else value

    def matches_pin(self, pin: str) -> bool:
        """A pin (`serving.image_id`) is the image's id or one of its repository digests."""
        return pin == self.id or any(d.rpartition("@")[2] == pin for d in self.digests)


class CopyRecord(_Model):
    """One thing this cluster copied to a node, as the node's copy ledger (`~/.spark-reconciler/copies`) says:
    written by the weights and image steps after a verified copy, and marked used by every serving start there.
    Retention removes only what has a record, so what a person or another tool put on the node is never touched."""

    kind: Literal["weights", "image"]
    key: str = Field(description="weights: the tree's root on the node; image: its content id")
    detail: str = Field(description="weights: the tree's digest at the copy (`Weights.digest`); image: its id "
                        "on the node")
    by: str = Field(description="the cluster that copied it (its containers' instance label)")
    copied_at: int = Field(description="the node's clock, seconds")
    used_at: int = Field(description="the last copy or serving start with it, the node's clock, seconds")


#: A cluster id: what /proc/sys/kernel/random/uuid gives (a random UUID, lowercase), nothing else.
CLUSTER_ID_PATTERN: Final = r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$"
#: A name the head's containers were labelled with before the id existed: an `ssh.host:port` (a host name, an IPv4
#: or IPv6 address, a zone), nothing a message or a label could be fooled by.
KNOWN_AS_PATTERN: Final = r"^[A-Za-z0-9._:%\[\]-]{1,300}$"
#: More former names than anyone renumbers a head through is odd output, not history.
MAX_KNOWN_AS: Final = 64


class ClusterIdentity(_Model):
    """The cluster's own name, kept on its head in `~/.spark-reconciler/cluster-id` (`edge.facts.host.identity_script`):
    a random id made once, and the instance names (`host:port`) the head's containers were labelled with before
    it existed. It belongs to the head machine, not to an address, so a renumbered head (DHCP, a move to its
    `.local` name) still owns its running containers (issue 29, finding 7)."""

    id: Annotated[str, StringConstraints(pattern=CLUSTER_ID_PATTERN)]
    known_as: list[Annotated[str, StringConstraints(pattern=KNOWN_AS_PATTERN)]] = Field(
        default_factory=list, max_length=MAX_KNOWN_AS, description="former instance labels (`host:port`) this "
        "head's containers may carry: the one it was reached by when the id was made, and any an operator adds")


class DeploymentFacts(_Model):
    """What the probe reads of one deployment, in a file of several: its weights tree, its API (the head), the
    room where its copies write. A file of one keeps them in the node's own fields, as before the list."""

    weights: Weights | None = None
    serving: ServingApi | None = None
    disk_free: dict[str, int] | None = None
    disk_fs: dict[str, str] | None = None


class NodeObservation(_Model):
    name: str
    reachable: bool
    error: str | None = None
    probe_error: str | None = Field(None, description="the node answered, but its output did not parse (which "
                                    "section, why): nothing else of it is known; steps on it wait")
    machine: str | None = Field(None, description="`uname -m` (`aarch64` on a Spark): what an image's platform "
                                "must fit; None: not read (a snapshot from before it was)")
    listening: list[int] | None = Field(None, description="TCP ports something listens on (/proc/net/tcp, tcp6): "
                                        "a start needs its own free; None: not read (an older snapshot)")
    listen_addresses: dict[int, list[str]] | None = Field(
        None, description="the local addresses each port of `listening` is listened on at (`0.0.0.0`, `127.0.0.1`, "
        "`::`, `::1`, `::ffff:127.0.0.1`): whether one is in the way of a bind of serving.host "
        "(core.listeners.takes); a port without addresses here, or None (an older snapshot), is in the way")
    gpu_stack: GpuStack | None = Field(None, description="read when the file asks for GPUs (serving.docker.gpus); "
                                       "None: not asked, or an older snapshot")
    disk_free: dict[str, int] | None = Field(None, description="free bytes (`df -P -B1`) where a copy writes: "
                                             "`weights` (the model path, or its nearest existing parent) and "
                                             "`image` (docker's data root); None: not read (an older snapshot)")
    disk_fs: dict[str, str] | None = Field(None, description="the filesystem each row of `disk_free` is on, as "
                                           "`df -P` names it: its device when that is a device node (`/dev/...`: "
                                           "bind mounts of one device are one filesystem), else its mount point "
                                           "(tmpfs, overlay); rows on one filesystem share its free bytes "
                                           "(`drift.shortfall`); None: not read (an older snapshot: each row is "
                                           "judged alone)")
    copies: list[CopyRecord] | None = Field(None, description="what this node's copy ledger records (read when "
                                            "policy.retention.prune is on); None: not read")
    docker_reachable: bool = False
    docker_error: str | None = None
    containers: list[Container] = Field(default_factory=list)
    images: dict[str, Image] = Field(default_factory=dict, description="image reference -> that image here")
    fabric: Link | None = None
    fabric_twin: Link | None = Field(None, description="the fabric's twin port, when one is declared")
    memory: Memory | None = None
    weights: Weights | None = None
    serving: ServingApi | None = None
    deployments: dict[str, DeploymentFacts] = Field(
        default_factory=dict, description="deployment name -> what is read of it here, in a file of several "
        "(`Observed.view` puts them in the fields above for the per-deployment core); empty for a file of one")
    identity: ClusterIdentity | None = Field(None, description="the cluster's id as the head keeps it (`~/.spark-"
                                            "reconciler/cluster-id`), read on the head only: which containers are "
                                            "this cluster's; None: not read (another node, or an older snapshot)")

    @property
    def probed(self) -> bool:
        """The node answered and its probe's output parsed: what the observation says of it can be believed."""
        return self.reachable and self.probe_error is None

    @property
    def usable(self) -> bool:
        """The one definition of a node the plan may work on: probed, and its docker engine answers. A node that
        is not has exactly one of the `unreachable`, `probe` or `docker` drifts saying why."""
        return self.probed and self.docker_reachable

    def container(self, name: str) -> Container | None:
        return next((c for c in self.containers if c.name == name), None)

    def links(self) -> list[Link]:
        """The fabric ports seen: the first, then the twin."""
        return [link for link in (self.fabric, self.fabric_twin) if link is not None]


class UnknownNode(KeyError):
    """`Observed.node` asked for a node the observation does not hold: a misspelt or stale name."""

    def __init__(self, name: str, known: tuple[str, ...]) -> None:
        super().__init__(name)
        self.name = name
        self.known = known

    def __str__(self) -> str:
        return f"no node {self.name!r} in the observation (it holds {', '.join(self.known) or 'none'})"


class ServeFlags(_Model):
    """The flags `vllm serve` of one image knows, as its own `vllm serve --help=all` lists them."""

    image_id: str
    flags: list[str] = Field(default_factory=list)
    has_ray: bool | None = Field(None, description="`ray` is on the image's PATH (`launcher: ray` runs `ray "
                                 "start` in it); None: not known")
    version: str | None = Field(None, description="the image's vLLM version (`importlib.metadata`, else `vllm "
                                "--version`); None: it did not say")
    cuda_version: str | None = Field(None, description="the image's `CUDA_VERSION` (NGC and CUDA base images set it: "
                                     "`13.2.1.006`); None: not set")
    cuda_driver_version: str | None = Field(None, description="the image's `CUDA_DRIVER_VERSION`: the driver its "
                                            "CUDA shipped with (NGC images set it); None: not set")
    require_cuda: str | None = Field(None, description="the image's `NVIDIA_REQUIRE_CUDA`, which "
                                     "nvidia-container-cli checks at start; None: not set")
    error: str | None = Field(None, description="why the image could not be asked: a serving (re)start is refused "
                              "until it can (asked again with backoff)")
    pending: bool = Field(False, description="asked, no answer yet: a serving (re)start waits for it")


class Observed(_Model):
    version: Literal["spark-reconciler/observed/v1"] = SNAPSHOT_VERSION
    nodes: dict[str, NodeObservation]
    deployment_flags: dict[str, ServeFlags] = Field(
        default_factory=dict, description="deployment name -> what its image's `vllm serve` knows, in a file of "
        "several (`view` puts it in `serve_flags`); empty for a file of one")
    serve_flags: ServeFlags | None = Field(None, description="what the serving image's `vllm serve` knows, asked "
                                           "once per image id; None: not asked, and a serving (re)start waits")

    def node(self, name: str) -> NodeObservation:
        """The observation of `name`. A name it does not hold is a mistake, never an unreachable node: it
        raises `UnknownNode`. Where a node may legitimately be missing (a snapshot from an older file), the
        caller says so: `covering` first, or `nodes.get`."""
        try:
            return self.nodes[name]
        except KeyError:
            raise UnknownNode(name, tuple(self.nodes)) from None

    def covering(self, names: Iterable[str]) -> Observed:
        """This observation with every one of `names`, a node it did not observe read as unreachable ("not
        observed"): what a plan from a snapshot taken before the file named that node is made from. The node then
        counts as not answering (`partial`), as it did not."""
        missing = {n: NodeObservation(name=n, reachable=False, error="not observed")
                   for n in names if n not in self.nodes}
        return self.model_copy(update={"nodes": {**self.nodes, **missing}}) if missing else self

    def view(self, deployment: str) -> Observed:
        """This observation as the deployment `deployment` sees it: on each node its own weights, API and disk
        room in the node's fields (`NodeObservation.deployments`), and its image's flags (`deployment_flags`), so
        the per-deployment core reads a file of several as it reads a file of one. A node that holds nothing for
        it is left as it is."""
        def one(node: NodeObservation) -> NodeObservation:
            facts = node.deployments.get(deployment)
            if facts is None:
                return node
            return node.model_copy(update={"weights": facts.weights, "serving": facts.serving,
                                           "disk_free": facts.disk_free, "disk_fs": facts.disk_fs})
        return self.model_copy(update={"nodes": {name: one(node) for name, node in self.nodes.items()},
                                       "serve_flags": self.deployment_flags.get(deployment, self.serve_flags)})

    def by_deployment(self, roots: dict[str, dict[str, str]]) -> Observed:
        """A snapshot of the single form (no node holds per-deployment facts: a file of one observed it) read for a
        file of several: each deployment gets a node's tree only where that tree is its own (`roots`: deployment ->
        node -> Desired.weights_root), else none (not listed). Without this every deployment would take the one
        tree listed for its own (`plan --observed`, issue 52). The API and the disk room stay the node's."""
        if len(roots) < 2 or any(node.deployments for node in self.nodes.values()):
            return self

        def spread(node: NodeObservation) -> NodeObservation:
            tree = node.weights
            facts = {name: DeploymentFacts(weights=tree if tree is not None and tree.root == where.get(node.name)
                                           else None, serving=node.serving, disk_free=node.disk_free,
                                           disk_fs=node.disk_fs)
                     for name, where in roots.items()}
            return node.model_copy(update={"deployments": facts})
        return self.model_copy(update={"nodes": {name: spread(node) for name, node in self.nodes.items()}})

    @property
    def partial(self) -> bool:
        """A node did not answer: what was planned from this cannot be whole (exit 5, reconciler.core.exits)."""
        return any(not n.reachable for n in self.nodes.values())
