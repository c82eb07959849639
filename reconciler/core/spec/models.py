"""The desired state: what the operator declares, as frozen pydantic models.

Only the shape lives here: which fields there are, their types (`values.py`), defaults and descriptions (the
reference docs/desired-state.md is generated from them), and the views the core derives from a file (the head,
the serving nodes, the secrets each node gets). What the fields must satisfy together is `rules.py`, run by
`Desired`'s own validator, so no `Desired` exists that breaks a rule, however it was made.
"""

from __future__ import annotations

import fnmatch
import hashlib
import ipaddress
import json
import posixpath
import re
from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    SerializerFunctionWrapHandler,
    field_validator,
    model_serializer,
    model_validator,
)

from reconciler.core.spec.rules import KEY, ConsistencyError, MissingSecrets, consistency_problems
from reconciler.core.spec.values import (
    AbsPath,
    Capability,
    ContainerEnvName,
    ContainerName,
    ContainerPattern,
    DataPath,
    DeploymentName,
    DockerGpus,
    DockerShmSize,
    DockerVolume,
    Duration,
    EnvValue,
    ExtraArg,
    FabricInterface,
    HostName,
    ImageDigest,
    ImageRef,
    Listen,
    ModelId,
    NodeName,
    PlainEnvName,
    Port,
    RdmaDevice,
    Revision,
    ServedName,
    SizeInBytes,
    SshUser,
    UlimitName,
    UlimitValue,
    at_least,
    has_control_characters,
)


class SeveralDeployments(Exception):
    """`Desired.model`/`.serving` asked of a file with several deployments: the caller should have taken a view."""

    def __init__(self, names: list[str]):
        super().__init__(f"a file with several deployments ({', '.join(names)}): take one with Desired.view(name)")


class _Model(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class Ssh(_Model):
    """How the reconciler reaches a node. Host keys are always checked against `known_hosts`."""

    host: HostName
    user: SshUser = "spark"
    port: Port = 22
    jump: NodeName | None = Field(None, description="Name of another node to hop through (the internet-less worker "
                                                    "is reached through the head).")
    known_hosts: AbsPath = Field("/etc/spark-reconciler/known_hosts",
                                 description="known_hosts file every host key is checked against (strict).")
    identity_file: AbsPath | None = Field(None, description="Private key; default: the SSH agent / ~/.ssh keys.")
    connect_timeout: Annotated[Duration, at_least(1, "no SSH handshake completes in less")] = Duration(10)
    fallback_hosts: list[HostName] = Field(
        default_factory=list, description="Other addresses of the same node, tried in order when `host` cannot be "
        "reached (no TCP path, or the jump host cannot open one), e.g. the twin's fabric address of a worker reached "
        "over the fabric: the node stays reachable over one half of the port while the reconciler repairs the "
        "other. Only the path falls back: the host key is always checked under `host`'s known_hosts entry, and "
        "a refused key or login is never retried elsewhere.")

    @model_validator(mode="after")
    def _fallbacks_are_other_addresses(self) -> Ssh:
        hosts = [self.host, *self.fallback_hosts]
        if len(set(hosts)) != len(hosts):
            raise ValueError(f"ssh.fallback_hosts must name addresses other than `host` and each other: {hosts}")
        return self


class FabricPort(_Model):
    """One netdev of the fabric, with its RDMA device and address."""

    interface: FabricInterface = Field(
        description="Netdev, e.g. enp1s0f1np1 (<= 15 characters). Never `lo`; the reconciler also never changes "
        "the MTU of the interface its SSH session arrives on (that could cut the node off).")
    rdma_device: RdmaDevice | None = Field(None, description="RDMA device, e.g. rocep1s0f1; its port must be ACTIVE.")
    address: ipaddress.IPv4Interface = Field(description="IPv4 address with prefix, e.g. 192.168.200.12/24.")


class Fabric(FabricPort):
    """The RoCE link between the nodes (ConnectX-7 on a Spark): what NCCL, rendezvous and weight sync use."""

    mtu: int = Field(9000, ge=576, le=9216, description="Of every port of the fabric (both ends must agree).")
    twin: FabricPort | None = Field(
        None, description="The port's other half: each QSFP port of a Spark's ConnectX-7 shows up as two "
        "netdevs on two PCIe x4 links, ~100 Gb/s each (ibdev2netdev: roceP2p1s0f1 ==> enP2p1s0f1np1). Declared, "
        "it is observed and repaired like the first, and NCCL uses both RDMA devices. Its own subnet.")

    def ports(self) -> list[FabricPort]:
        """The declared ports, the first (`interface`) first."""
        return [self, *([self.twin] if self.twin else [])]


class Node(_Model):
    name: NodeName
    role: Literal["head", "worker"]
    ssh: Ssh
    fabric: Fabric
    internet: bool = Field(True, description="False for a node that must never reach the internet. A model "
                                             "source with internet downloads missing weights (`hf download`), "
                                             "an image source pulls a missing image (`docker pull`); an offline "
                                             "one never does, and never holds a secret scoped `internet`. "
                                             "Serving gets HF_HUB_OFFLINE=1 on every node either way: the "
                                             "weights come from the reconciler, never from the Hub.")
    gpus: int = Field(1, ge=1, le=16, description="GPUs on this node (a Spark has one GB10).")


class Model(_Model):
    id: ModelId
    revision: Revision = "main"
    layout: Literal["hf-cache", "plain"] = Field(
        "hf-cache", description="hf-cache: `path` is a Hugging Face hub directory holding models--ORG--NAME; "
                                "plain: `path` is the model directory itself.")
    source: NodeName | None = Field(None, description="Node that holds the weights (default: the head).")
    path: DataPath | dict[NodeName, DataPath] = Field(
        description="Path on every node, or a mapping node -> path. A directory of its own: not `/`, a "
        "top-level directory, a home itself or a system path.")

    def path_on(self, node: str) -> str:
        return self.path if isinstance(self.path, str) else self.path[node]


class DockerOptions(_Model):
    """`docker run` options of the serving containers. What reaches beyond the container (privileged, other
    capabilities and devices, host paths) needs the matching `trust` entry (docs/security.md)."""

    gpus: DockerGpus | None = "all"
    privileged: bool = Field(False, description="Root over the node (every device, every capability). Faster "
                             "RDMA on some reports; needs trust.privileged. Without it: devices "
                             "[/dev/infiniband] and cap_add [IPC_LOCK] give NCCL its RoCE transport.")
    ipc: Literal["host", "private", "shareable"] | None = "host"
    shm_size: DockerShmSize | None = Field(
        "64g", description="Only with ipc private or shareable: with `ipc: host` the container uses the host's "
        "/dev/shm, docker ignores --shm-size and podman refuses it, so it is not passed.")
    ulimits: dict[UlimitName, UlimitValue | None] = Field(
        default_factory=dict,
        description="Merged over the defaults, what NGC's containers ask for (memlock -1: RDMA memory "
        "registration; stack 64 MiB) and a high nofile: name only what differs; `null` removes a default. The "
        "plan shows the effective set.")
    devices: list[AbsPath] = Field(default_factory=list, description="/dev/infiniband (and below) freely; any "
                                   "other device must be listed in trust.devices.")
    cap_add: list[Capability] = Field(default_factory=list, description="IPC_LOCK freely; any other capability "
                                      "must be listed in trust.capabilities.")
    volumes: list[DockerVolume] = Field(default_factory=list)

    @property
    def effective_ulimits(self) -> dict[str, str]:
        """`ulimits` over `DEFAULT_ULIMITS`, a `null` removing one: a file that names only `nofile` keeps
        `memlock=-1` (NCCL's RDMA registers its buffers in locked memory) and the 64 MiB stack."""
        merged: dict[str, str | None] = {**DEFAULT_ULIMITS, **self.ulimits}
        return {name: value for name, value in sorted(merged.items()) if value is not None}


#: What each `vllm serve` holds outside its pool, the margin a node keeps, and the most a node's fractions add up to
#: (Policy: the figures behind each are in its field's description and docs/operations.md "The memory budget").
MEMORY_OVERHEAD_PER_INSTANCE = 8 * 2**30
MEMORY_MARGIN = 6 * 2**30
UTILIZATION_CEILING = 0.9

#: What NGC's containers are told to run with (NVIDIA's vLLM playbook: `--ulimit memlock=-1 --ulimit
#: stack=67108864`), and a nofile high enough for vLLM's API server under load.
DEFAULT_ULIMITS = {"nofile": "1048576:1048576", "memlock": "-1", "stack": "67108864"}


#: How much of an answer `Verify.expect` is matched against (the text of at most `Verify.max_tokens` tokens is
#: far shorter; a node that sends more is cut here).
VERIFY_TEXT_LIMIT = 4096


class Verify(_Model):
    """A question the deployment must answer right after each start, before it counts as served: one greedy
    completion (`temperature` 0, a few tokens) of `prompt`, whose text `expect` must match. Healthy alone means one
    token came back, which a kernel that computes garbage passes (NGC's SM121 notes on CUTLASS FP4: "produces
    garbage output silently"); a known answer does not."""

    prompt: str = Field(min_length=1, max_length=2000, description="What is asked, as written (no template "
                        "around it with `endpoint: completions`; the user's message with `chat`). NVIDIA's vLLM "
                        "playbook checks a new server with 12*17: `12*17=`.")
    expect: str = Field(min_length=1, max_length=500, description="A regular expression (Python's `re`, searched: "
                        "it may match anywhere in the answer's text; `(?i)` for any case) the answer must match, "
                        r"e.g. `\b204\b`. Checked when the file is read: a pattern that does not compile, or that "
                        "an empty answer matches (it would check nothing), is refused.")
    max_tokens: int = Field(8, ge=1, le=64, description="The most tokens the answer may have: a few are enough "
                            "for a checkable answer, and the check takes a slot of the engine while it runs.")
    endpoint: Literal["completions", "chat"] = Field(
        "completions", description="`completions` (/v1/completions: the prompt as it is, no chat template, no "
        "reasoning: a thinking model answers in its first tokens) or `chat` (/v1/chat/completions: the prompt as "
        "the user's message, through the model's chat template; the answer is the message's `content`, which a "
        "reasoning model may leave empty while it thinks within max_tokens).")

    @field_validator("prompt")
    @classmethod
    def _prompt_is_text(cls, value: str) -> str:
        if any((ord(c) < 32 and c not in "\n\t") or ord(c) == 127 for c in value):
            raise ValueError("contains control characters (only newlines and tabs are allowed in a prompt)")
        return value

    @field_validator("expect")
    @classmethod
    def _expect_is_a_pattern(cls, value: str) -> str:
        if has_control_characters(value):
            raise ValueError("contains control characters (write \\n for a newline in the pattern)")
        try:
            pattern = re.compile(value)
        except re.error as exc:
            raise ValueError(f"{value!r} is not a regular expression: {exc}") from None
        if pattern.search("") is not None:
            raise ValueError(f"{value!r} matches an empty answer, so it checks nothing")
        return value

    def matches(self, text: str) -> bool:
        """Whether `text` (cut at VERIFY_TEXT_LIMIT characters) is an answer this check takes."""
        return re.search(self.expect, text[:VERIFY_TEXT_LIMIT]) is not None


class Serving(_Model):
    engine: Literal["vllm"] = "vllm"
    image: ImageRef
    image_id: ImageDigest | None = Field(
        None, description="Pin: the image id or repository digest the source node's `image` must have (`docker "
        "image inspect --format '{{.Id}} {{.RepoDigests}}' IMAGE`). Nothing starts on another image; copies to "
        "the other nodes are checked by content (layers and config), which survives `docker save | load` on "
        "either image store.")
    image_sources: list[NodeName] | None = Field(
        None, description="Nodes the image may be copied from (default: the head only). A node not listed never "
        "becomes a source: a worker claiming to have the image cannot feed its `docker save` to the others.")
    launcher: Literal["native", "ray"] = "native"
    host: Literal["127.0.0.1", "0.0.0.0"] = Field(
        "127.0.0.1", description="Address vLLM's API binds on its node (host network): the head, or the first "
        "node of a deployment without it. Loopback by default: the "
        "API has no authentication unless serving.secrets holds VLLM_API_KEY. 0.0.0.0 to serve other machines: "
        "then with an API key or a proxy in front (docs/security.md). Nothing else: the reconciler's health checks "
        "ask 127.0.0.1 on that node, which a bind to one LAN address would not answer.")
    container_name: ContainerName = "vllm_serving"
    nodes: list[NodeName] | None = Field(None, description="Nodes the model spans (default: head first, then "
                                                           "workers in file order, as many as tp x pp needs). "
                                                           "Rank 0 and the API run on the head when it is listed, "
                                                           "else on the first listed node (a deployment on a worker "
                                                           "alone).")
    tensor_parallel_size: int = Field(1, ge=1, le=64)
    pipeline_parallel_size: int = Field(1, ge=1, le=64)
    port: Port = 8000
    master_port: Port = 29501
    ray_port: Port = 6379
    gpu_memory_utilization: float = Field(
        0.8, gt=0, le=1, description="vLLM's pool on each node of the deployment, as a fraction of the node's "
        "whole memory (weights, activations, KV cache). The deployments on a node add up to at most "
        "policy.gpu_memory_utilization_ceiling; each rank also holds policy.memory_overhead_per_instance.")
    max_model_len: int | None = Field(None, ge=16, le=10_000_000)
    served_model_name: ServedName | None = None
    extra_args: list[ExtraArg] = Field(default_factory=list)
    env: dict[PlainEnvName, EnvValue] = Field(default_factory=dict, description="Plain settings for every "
        "serving container. Not secrets (see `secrets`), not what the reconciler sets itself.")
    secrets: dict[ContainerEnvName, Literal["head", "serving", "internet"]] = Field(
        default_factory=dict, description="Environment variables whose values come from the reconciler's own "
        "environment (systemd EnvironmentFile), never from this file, to the nodes that need them: `head` (the "
        "API server's node, the head or a worker-only deployment's own: VLLM_API_KEY), `serving` (every serving "
        "node), `internet` (serving nodes with internet: HF_TOKEN; the offline worker never gets it). Sent on "
        "docker's stdin, never written to a node's disk by the reconciler, exported as secretKeyRef.")
    docker: DockerOptions = Field(default_factory=DockerOptions)
    compile_cache: Literal["home"] | DataPath | None = Field(
        "home", description="Where each node keeps what vLLM compiles (torch.compile/inductor, Triton, "
        "FlashInfer, TileLang), so a restart does not compile again. `home`: the SSH user's ~/.cache/vllm, "
        "~/.cache/flashinfer, ~/.triton and ~/.tilelang (home = /home/USER, /root for root), as eugr's launcher "
        "mounts them; an absolute path: vllm/, flashinfer/, triton/ and tilelang/ below it; null: nothing kept. "
        "Created as the SSH user.")
    health_timeout: Annotated[Duration, at_least(10, "a cold start takes longer")] = Field(
        Duration(3600), description="Deadline for /health after a (cold) start.")
    unhealthy_grace: Annotated[Duration, at_least(10, "shorter restarts serving on every hiccup")] = Field(
        Duration(300), description="How long serving that has served may fail its health check (/health, the "
        "model listed, one completion) before it is restarted in order. Longer than a restart takes, so a "
        "hiccup never costs a reload; doubled after each restart that did not hold, up to 16x.")
    verify: Verify | None = Field(
        None, description="Off when absent. A question with a checkable answer, asked after each start at the end "
        "of `await-health` (a new generation's start, a restart for a change or for health): `prompt` (as written; "
        "NVIDIA's vLLM playbook asks 12*17), `expect` (a regular expression, Python's `re`, searched in the "
        r"answer's text, e.g. `\b204\b`; one that does not compile or that an empty answer matches is refused), "
        "`max_tokens` (8; at most 64), `endpoint` (`completions`: the prompt as it is, the default; `chat`: as "
        "the user's message, through the chat template). Greedy (`temperature: 0`), with the API key as the "
        "health check sends it. A wrong answer, an error answer or none within 2 minutes fails `await-health`: "
        "not Ready, condition ServingVerified False, reconciler_serving_verified 0, and with "
        "policy.on_failed_change rollback a new generation that never served is rolled back. An edit of it "
        "restarts nothing: it is checked at the next start. Refused for a pooling model (`--runner pooling`), "
        "which generates no text. The generative recipes carry `12*17=` -> `\\b204\\b` (docs/operations.md, "
        "\"Checking the answer\").")


class CoTenants(_Model):
    """Other containers on the nodes. `*` as node key applies to every node."""

    allowed: dict[NodeName | Literal["*"], list[ContainerPattern]] = Field(default_factory=dict)
    protected: dict[NodeName | Literal["*"], list[ContainerPattern]] = Field(
        default_factory=dict, description="Never stopped or touched, whatever else the file says.")
    unlisted: Literal["stop", "report"] = "stop"
    memory: dict[NodeName | Literal["*"], dict[ContainerName, SizeInBytes]] = Field(
        default_factory=dict, description="What allowed co-tenants hold of a node's unified memory, by container "
        "(e.g. `head: {reranker: 15GiB}`; `*`: on every node). A reservation: counted in the node's budget beside "
        "every deployment on it whether the container runs now or not (a co-tenant stopped for a while comes "
        "back), so a file whose sum passes the node's memory is refused before anything stops.")

    def reserved(self, node: str) -> dict[str, int]:
        """The co-tenants' reservations on `node`: its own entries over the `*` ones."""
        return {**self.memory.get("*", {}), **self.memory.get(node, {})}

    def _matches(self, table: dict[str, list[str]], node: str, name: str) -> bool:
        patterns = table.get(node, []) + table.get("*", [])
        return any(fnmatch.fnmatchcase(name, p) for p in patterns)

    def is_allowed(self, node: str, name: str) -> bool:
        return self._matches(self.allowed, node, name)

    def is_protected(self, node: str, name: str) -> bool:
        return self._matches(self.protected, node, name)


_NO_COMMAND_IN_LESS = at_least(1, "no remote command completes in less; every node would look unreachable")


class Timeouts(_Model):
    step: Annotated[Duration, _NO_COMMAND_IN_LESS] = Duration(120)
    command: Annotated[Duration, _NO_COMMAND_IN_LESS] = Duration(60)
    stop_grace: Duration = Field(Duration(30), description="`docker stop -t`: time before SIGKILL.")
    weights_sync: Annotated[Duration, _NO_COMMAND_IN_LESS] = Duration(12 * 3600)
    image_sync: Annotated[Duration, _NO_COMMAND_IN_LESS] = Duration(3600)


class Retries(_Model):
    attempts: int = Field(3, ge=1, le=20, description="Tries per step for transient errors within one reconcile.")
    backoff_initial: Annotated[Duration, at_least(0.1, "a retry without a pause hammers the node")] = Duration(1)
    backoff_max: Annotated[Duration, at_least(0.1, "a retry without a pause hammers the node")] = Duration(300)
    hold_after: int = Field(5, ge=1, le=100, description="Consecutive failed reconciles before a step is held.")


class WeightsPolicy(_Model):
    parallel_streams: int = Field(4, ge=1, le=32, description="rsync streams of one copy (the regular files and the "
                                  "links copied as the files they land on, read by the same streams). At most 4 "
                                  "run: the source's bulk SSH connection has 9 channels (docs/weights-transport.md).")
    transport: Literal["rsync-daemon", "ssh"] = Field(
        "rsync-daemon", description="rsync-daemon: a one-time rsync daemon on the target's fabric address, with a "
        "one-time secret (no cipher: the fabric is a dedicated cable, the bytes are public weights; "
        "docs/weights-transport.md). ssh: rsync over ssh (aes128-gcm), slower, for a fabric you do not trust. "
        "Either way the target needs python3 (the reconciler makes the tree's links there).")
    bandwidth_limit: SizeInBytes | None = Field(None, description="Per stream, bytes/s (e.g. 500MB); none: unlimited.")
    drop_behind: bool = Field(
        True, description="Keep a copy's page cache small on both ends: the copied files are dropped from the cache "
        "behind the copy, so a copy beside a serving generation does not fill a GB10's one memory pool "
        "(docs/weights-transport.md \"Page cache\"); needs python3 on both nodes.")


class Retention(_Model):
    """What a node keeps of what this cluster copied to it. Opt-in: removing files is the one thing the
    reconciler does that cannot be undone, so it waits for the owner to ask (issue 29: a 1 TB Spark fills after a
    few model changes of ~119 GB). Only copies this cluster made and recorded are ever removed (docs/operations.md
    "Retention"); the weights source and anything a person put there are never touched."""

    prune: bool = Field(False, description="Remove the models and images this cluster copied to a node, beyond "
                        "the current ones and the `previous` most recently used (a rollback needs them).")
    previous: int = Field(1, ge=1, le=10, description="How many earlier models and images each node keeps, by "
                          "last use (served or copied), besides the current ones.")


class Policy(_Model):
    mode: Literal["enforce", "observe"] = "enforce"
    paused: bool = False
    resync_interval: Annotated[Duration, at_least(1, "shorter is a busy loop of SSH probes")] = Duration(30)
    timeouts: Timeouts = Field(default_factory=Timeouts)
    retries: Retries = Field(default_factory=Retries)
    weights: WeightsPolicy = Field(default_factory=WeightsPolicy)
    memory_overhead_per_instance: SizeInBytes = Field(
        MEMORY_OVERHEAD_PER_INSTANCE, description="What each `vllm serve` holds outside its "
        "gpu_memory_utilization pool: counted once per rank of every deployment on a node, in the node's budget "
        "and in each start's memory check. vLLM's fraction is the model executor's (`--help=all`): its API server "
        "process, the CUDA context it takes before sizing the pool, and (in releases that do not estimate them) "
        "the CUDA graphs captured after the KV cache is sized lie outside it. Measured on GB10: about 13 GiB "
        "beyond the pool at 0.80 (huggingface.co nvidia/GLM-5.3-Flash-FP4-Local discussion #7, caches dropped), "
        "at most 9.5 GiB at 0.90 with the OS's share in it (d9628102/ai-agent-os docs/gx10-known-issues.md §6). "
        "Tune it from `reconciler_memory_overshoot_bytes` (docs/operations.md \"The memory budget\").")
    memory_margin: SizeInBytes = Field(
        MEMORY_MARGIN, description="What a node holds besides the ranks and the co-tenants' reservations (the "
        "kernel, DGX OS's services, docker, sshd, a desktop if one runs, page cache that stays): counted once per "
        "node. A start needs MemAvailable >= its pool + memory_overhead_per_instance + this; a node's budget is "
        "its ranks' terms + co_tenants.memory + this. On the GB10 of discussion #7 everything but vLLM held about "
        "4.5 GiB (121.6 - 97.3 pool - 13 beyond it - 6.8 free).")
    gpu_memory_utilization_ceiling: float = Field(
        UTILIZATION_CEILING, gt=0, le=1, description="The most the gpu_memory_utilization of the deployments on "
        "one node may add up to (a file above it is refused at its line). 0.90 is the public record's hard limit "
        "on a GB10 (conselara.dev: \"never exceed 0.90; in practice 0.85\"; at 0.90 one instance left 2.6 of "
        "121.63 GiB and a second could not start, gx10-known-issues.md §6); CUDA's free memory caps near "
        "101-102 of 121.69 GiB on some images (MiaAI-Lab/GLM-5.3-Flash-EXL3-2x-DGX-Sparks#47). The plan then "
        "checks the bytes against the node's real total.")
    drop_caches: bool = Field(True, description="Write back and drop the page cache before every serving start "
                              "(sudo: `sysctl -w vm.drop_caches=3`): on GB10 the GPU cannot use the cache that "
                              "MemAvailable counts as free.")
    retention: Retention = Field(default_factory=Retention)
    on_failed_change: Literal["rollback", "hold"] = Field(
        "rollback", description="A change whose serving never answers (its start fails, or it is not healthy "
        "within serving.health_timeout) or that the image refuses: `rollback` brings the last generation that "
        "served back up and holds the new one until the file changes; `hold` keeps trying the new one (with "
        "backoff) while the API stays down. docs/operations.md \"History and rollback\".")
    history: int = Field(10, ge=2, le=100, description="How many generations of this file the state directory "
                         "keeps (`reconciler history`, `reconciler rollback`); the last one that served is kept "
                         "besides.")
    listen: Listen = Field(
        "127.0.0.1:9464", description="Metrics and status endpoint. Keep it on localhost unless you mean it.")


class Trust(_Model):
    """What this file lets the serving containers do beyond the safe default: each entry is root-equivalent
    or close to it on every serving node, so each is an explicit opt-in, listed by `plan` (docs/security.md)."""

    privileged: bool = Field(False, description="Allow serving.docker.privileged.")
    capabilities: list[Capability] = Field(default_factory=list, description="Allow these in cap_add (beyond "
                                           "IPC_LOCK).")
    devices: list[AbsPath] = Field(default_factory=list, description="Allow these devices (beyond "
                                   "/dev/infiniband), each with what lies below it.")
    host_paths: list[AbsPath] = Field(default_factory=list, description="Host directories serving.docker.volumes "
                                      "may mount (the model and the compile caches are mounted by the reconciler "
                                      "itself). System paths, key directories and the directories holding "
                                      "either (/var, /home/USER) stay refused.")
    remote_code: bool = Field(False, description="Pass --trust-remote-code: vLLM then runs Python from the model "
                              "repository, as root in the container.")

    def granted(self) -> list[str]:
        """Each opt-in in words, for `plan` (empty: nothing beyond the default)."""
        return ([*(["privileged containers"] if self.privileged else []),
                 *(f"capability {c}" for c in self.capabilities), *(f"device {d}" for d in self.devices),
                 *(f"host path {p}" for p in self.host_paths),
                 *(["the model repository's code (--trust-remote-code)"] if self.remote_code else [])])


#: The name of the one deployment a file in the single form (`model:` and `serving:` at the top) declares: what its
#: metrics' `deployment` label and its status say.
SINGLE = "default"


class Deployment(_Model):
    """One model served across some nodes by its own containers: its weights, its image, its launch. Deployments
    share the nodes, their fabric and their unified memory (`co_tenants.memory` and the budget rule), nothing
    else: each has its own container name, ports and health."""

    name: DeploymentName = Field(description="Its label in metrics and status, its LeaderWorkerSet's name.")
    model: Model
    serving: Serving


def json_schema() -> dict[str, Any]:
    """`Desired`'s JSON Schema with both forms, so an editor checking a file against `reconciler schema` accepts
    a file of the single form as the reconciler does: `model` and `serving` at the top, or `deployments`, not
    both."""
    schema = Desired.model_json_schema(mode="validation")
    props = schema["properties"]
    props["model"] = {"$ref": "#/$defs/Model", "description": "The single form: the one deployment's model."}
    props["serving"] = {"$ref": "#/$defs/Serving", "description": "The single form: the one deployment's serving."}
    schema["required"] = ["nodes"]
    schema["oneOf"] = [{"required": ["deployments"], "not": {"anyOf": [{"required": ["model"]},
                                                                         {"required": ["serving"]}]}},
                       {"required": ["model", "serving"], "not": {"required": ["deployments"]}}]
    return schema


class Desired(_Model):
    nodes: list[Node] = Field(min_length=1)
    deployments: list[Deployment] = Field(
        min_length=1, description="What the cluster serves, each model its own deployment (a TP-2 model across "
        "both nodes, an embeddings model beside it). A file with one may say `model:` and `serving:` at the top "
        f"instead: that is one deployment named `{SINGLE}`.")
    co_tenants: CoTenants = Field(default_factory=CoTenants)
    policy: Policy = Field(default_factory=Policy)
    trust: Trust = Field(default_factory=Trust)
    # The values of serving.secrets, from the reconciler's environment (with_secrets); never from the file, never
    # dumped. Compared with ==, so a rotated key is a new desired state (and a restart: the spec hash covers it).
    _secret_values: dict[str, str] = PrivateAttr(default_factory=dict)
    # A view of one deployment of a file of several (`view`): what only the whole file can judge (our stale
    # containers) is then judged once, on the whole, not in each view.
    _part: bool = PrivateAttr(default=False)
    # The text this state was read from (None: built in code): a generation's history keeps it, so `reconciler
    # rollback` writes back the owner's own file, comments included, not a dump of its meaning.
    _source: str | None = PrivateAttr(default=None)

    @model_validator(mode="before")
    @classmethod
    def _single_form(cls, data: object) -> object:
        """`model:` and `serving:` at the top are the list form's one deployment, so every file written before
        `deployments:` means what it meant (tests/unit/core/test_deployments.py compares the launches)."""
        if not isinstance(data, dict) or not ({"model", "serving"} & data.keys()):
            return data
        if "deployments" in data:
            raise ConsistencyError([((next(k for k in ("model", "serving") if k in data), KEY), "declare either "
                                     "`model:` and `serving:` (one deployment) or `deployments:`, not both")])
        one = {"name": SINGLE, **{k: data[k] for k in ("model", "serving") if k in data}}
        return {**{k: v for k, v in data.items() if k not in ("model", "serving")}, "deployments": [one]}

    @model_serializer(mode="wrap")
    def _dump_single_form(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """A file of one deployment named `default` is dumped in the single form it is read from: what `plan`,
        discover and the fingerprint see of a file written before the list form stays what it was (an upgrade
        makes no new generation)."""
        data: dict[str, Any] = handler(self)
        if [d.name for d in self.deployments] == [SINGLE] and "deployments" in data:
            one = data.pop("deployments")[0]
            data = {"nodes": data.pop("nodes"), "model": one["model"], "serving": one["serving"], **data}
        return data

    @model_validator(mode="after")
    def _consistent(self) -> Desired:
        problems = consistency_problems(self)
        if problems:
            raise ConsistencyError(problems)
        return self

    def with_secrets(self, environ: Mapping[str, str]) -> Desired:
        """This desired state with the values of serving.secrets taken from `environ` (the edge passes the
        process environment). Raises MissingSecrets naming each declared one that is absent or empty, or whose
        value holds a control character (the values reach docker as `--env-file` lines)."""
        declared = list(dict.fromkeys(name for d in self.deployments for name in d.serving.secrets))
        missing = [name for name in declared if not environ.get(name)]
        unusable = [name for name in declared if name not in missing and has_control_characters(environ[name])]
        if missing or unusable:
            raise MissingSecrets(missing, unusable)
        out = self.model_copy()
        out._secret_values = {name: environ[name] for name in declared}
        return out

    def __eq__(self, other: object) -> bool:
        """Equal in meaning: the fields, the secrets' values and whether it is a view. The text a state was read
        from is not part of it (a prefix of a file that parses to the whole is the whole: tests/unit/
        test_truncation.py; two saves of one meaning are one desired state)."""
        if not isinstance(other, Desired):
            return NotImplemented
        return (self.__dict__ == other.__dict__ and self._secret_values == other._secret_values
                and self._part == other._part)

    def __hash__(self) -> int:
        """Unhashable, as Python makes a class that defines __eq__ alone: its lists make it mutable in meaning (pydantic
        would otherwise hash a frozen model by its fields, and fail on the first list)."""
        raise TypeError(f"unhashable type: '{type(self).__name__}'")

    def with_source(self, text: str) -> Desired:
        out = self.model_copy()
        out._source = text
        return out

    @property
    def source(self) -> str | None:
        """The text this state was read from; None for a state built in code."""
        return self._source

    def secret_names_for(self, node: Node) -> list[str]:
        """The secrets `node`'s serving container gets: `head` only where the API runs (`api_node`: the head, or
        the first node of a deployment without it), `internet` only on nodes with internet (the offline worker
        never holds an HF token), `serving` on every serving node."""
        wanted = {"head": node.name == self.api_node.name, "internet": node.internet, "serving": True}
        return [name for name, to in self.serving.secrets.items() if wanted[to]]

    def secrets_for(self, node: Node) -> dict[str, str]:
        return {name: self._secret_values[name] for name in self.secret_names_for(node)
                if name in self._secret_values}

    def secret(self, name: str) -> str | None:
        return self._secret_values.get(name)

    def fingerprint(self) -> str:
        """What makes a new generation: the file's meaning and the secrets' values (a rotated key is a change).
        A sha256, so the state directory never holds a value."""
        body = self.model_dump_json() + "\0" + json.dumps(sorted(self._secret_values.items()))
        return hashlib.sha256(body.encode()).hexdigest()

    def secret_values(self) -> list[str]:
        """For the log's redaction: every value the edge must never print."""
        return list(self._secret_values.values())

    # -- derived views the core uses; defined here so there is one place that decides them

    @property
    def deployment(self) -> Deployment:
        """The deployment this desired state is about: the per-deployment core (drift, plan, launch) reads one,
        and is given a file of several through `view`. Asked of a file of several, it is a bug of the caller."""
        if len(self.deployments) != 1:
            raise SeveralDeployments([d.name for d in self.deployments])
        return self.deployments[0]

    @property
    def model(self) -> Model:
        return self.deployment.model

    @property
    def serving(self) -> Serving:
        return self.deployment.serving

    def view(self, name: str) -> Desired:
        """This file as the deployment `name` sees it: the nodes, policy and trust, that deployment alone, and
        the secrets' values. Not validated again: a part of a valid file is valid."""
        chosen = [d for d in self.deployments if d.name == name]
        if not chosen:
            raise KeyError(f"no deployment {name!r} (the file has {', '.join(self.deployment_names)})")
        out = self.model_copy(update={"deployments": chosen})
        out._part = len(self.deployments) > 1
        return out

    @property
    def is_part(self) -> bool:
        """A view of one deployment of a file of several (`view`), not a whole file."""
        return self._part

    def views(self) -> list[Desired]:
        return [self.view(d.name) for d in self.deployments]

    @property
    def deployment_names(self) -> list[str]:
        return [d.name for d in self.deployments]

    def with_deployment(self, *, model: Model | None = None, serving: Serving | None = None) -> Desired:
        """The one deployment's model or serving replaced (not validated again: callers build test cases and
        what-if views from a valid file)."""
        one = self.deployment.model_copy(update={k: v for k, v in (("model", model), ("serving", serving)) if v})
        return self.model_copy(update={"deployments": [one]})

    def node(self, name: str) -> Node:
        return next(n for n in self.nodes if n.name == name)

    @property
    def served_name(self) -> str:
        """The name the OpenAI API serves the model under: `serving.served_model_name`, else the model id (vLLM's
        own default for `--served-model-name`)."""
        return self.serving.served_model_name or self.model.id

    @property
    def head(self) -> Node:
        return next(n for n in self.nodes if n.role == "head")

    @property
    def instance(self) -> str:
        """This cluster's reconciler, as its containers' instance label and its lease on the head name it: the
        head's SSH address (one head, one reconciler; node names are only this file's)."""
        return f"{self.head.ssh.host}:{self.head.ssh.port}"

    def weights_root(self, node: str) -> str:
        """The directory whose tree is the model on `node`: the model dir (plain) or models--ORG--NAME (hf-cache).
        What the probe lists, a copy writes, and retention records and removes as one."""
        path = self.model.path_on(node)
        if self.model.layout == "plain":
            return path
        return posixpath.join(path, "models--" + self.model.id.replace("/", "--"))

    @property
    def serving_containers(self) -> set[tuple[str, str]]:
        """(node, container name) of every deployment's ranks: what of this cluster's may run, and where."""
        return {(n.name, v.serving.container_name) for v in self.views() for n in v.serving_nodes}

    @property
    def api_node(self) -> Node:
        """The node that runs the deployment's rank 0 and its API: the head when the deployment spans it, else its
        first node (an embeddings server on the worker alone). Its health is asked there, on 127.0.0.1."""
        return self.serving_nodes[0]

    @property
    def image_sources(self) -> list[str]:
        return self.serving.image_sources or [self.head.name]

    @property
    def source_node(self) -> str:
        return self.model.source or self.head.name

    @property
    def serving_nodes(self) -> list[Node]:
        """Head first, then workers: the rank order of the launch."""
        if self.serving.nodes is not None:
            chosen = [self.node(n) for n in self.serving.nodes]
        else:
            need, chosen = self.serving.tensor_parallel_size * self.serving.pipeline_parallel_size, []
            for node in [self.head] + [n for n in self.nodes if n.role == "worker"]:
                if sum(n.gpus for n in chosen) >= need:
                    break
                chosen.append(node)
        return sorted(chosen, key=lambda n: n.role != "head")
