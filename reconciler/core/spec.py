"""The desired state: what the operator declares, as frozen pydantic models.

Every string that can end up in a remote command is held to a strict pattern here, at the border, so the edge
never has to wonder whether a value is safe to quote. Rules that involve several fields (one head, no jump-host
cycles, tp x pp against the GPUs, ...) live in `consistency_problems`, which reports each problem with the exact
field path it concerns, so the loader can point at the offending line.
"""

from __future__ import annotations

import fnmatch
import hashlib
import ipaddress
import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    model_validator,
)
from pydantic_core import ErrorDetails

from reconciler.core import loader
from reconciler.core.loader import Loc

# ---------------------------------------------------------------------------------------------- safe patterns


class _pattern:
    """Annotated metadata: a strict regex with a readable message, shown as `pattern` in the JSON Schema."""

    def __init__(self, regex: str, what: str, max_len: int | None = None):
        self.regex, self.what, self.max_len = regex, what, max_len
        self.compiled = re.compile(regex)

    def check(self, value: str) -> str:
        if self.max_len is not None and len(value) > self.max_len:
            raise ValueError(f"{value!r} is longer than {self.max_len} characters ({self.what})")
        if not self.compiled.fullmatch(value):
            raise ValueError(f"{value!r} is not a valid {self.what}")
        return value

    def __get_pydantic_core_schema__(self, source, handler):
        from pydantic_core import core_schema

        return core_schema.no_info_after_validator_function(self.check, handler(source))

    def __get_pydantic_json_schema__(self, schema, handler):
        out = handler(schema)
        out["pattern"] = f"^(?:{self.regex})$"
        if self.max_len:
            out["maxLength"] = self.max_len
        return out


def _no_dotdot(value: str) -> str:
    if ".." in value.split("/"):
        raise ValueError(f"{value!r} must not contain '..'")
    return value


NodeName = Annotated[str, _pattern(r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?", "node name (lowercase letters, digits, '-')")]
ContainerName = Annotated[str, _pattern(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}", "container name ([A-Za-z0-9_.-])")]
ContainerPattern = Annotated[str, _pattern(r"[A-Za-z0-9*?\[][A-Za-z0-9_.*?\[\]!-]{0,127}",
                                           "container name or glob ([A-Za-z0-9_.-] plus * ? [ ])")]
InterfaceName = Annotated[str, _pattern(r"[A-Za-z0-9][A-Za-z0-9_.-]*", "interface name", max_len=15)]
RdmaDevice = Annotated[str, _pattern(r"[A-Za-z0-9][A-Za-z0-9_]{0,63}", "RDMA device name")]
AbsPath = Annotated[str, _pattern(r"/([A-Za-z0-9._+@-]+(/[A-Za-z0-9._+@-]+)*)?/?",
                                  "absolute path ([A-Za-z0-9._+@-] components)"), AfterValidator(_no_dotdot)]
EnvName = Annotated[str, _pattern(r"[A-Za-z_][A-Za-z0-9_]{0,127}", "environment variable name")]
ModelId = Annotated[str, _pattern(r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}/[A-Za-z0-9][A-Za-z0-9._-]{0,95}",
                                  "model id (ORG/NAME)"), AfterValidator(_no_dotdot)]
Revision = Annotated[str, _pattern(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}", "revision (branch, tag or commit)")]
ImageRef = Annotated[str, _pattern(
    r"[a-z0-9]+([._-][a-z0-9]+)*(:[0-9]{1,5})?(/[a-z0-9]+([._-][a-z0-9]+)*)*"
    r"(:[A-Za-z0-9_][A-Za-z0-9_.-]{0,127})?(@sha256:[a-f0-9]{64})?", "image reference", max_len=255)]
ImageDigest = Annotated[str, _pattern(r"sha256:[0-9a-f]{64}", "image digest (sha256: and 64 hex digits)")]
SshUser = Annotated[str, _pattern(r"[a-z_][a-z0-9_-]{0,31}", "user name")]
HostName = Annotated[str, _pattern(r"[A-Za-z0-9]([A-Za-z0-9.:-]{0,251}[A-Za-z0-9])?", "host name or address")]
ServedName = Annotated[str, _pattern(r"[A-Za-z0-9][A-Za-z0-9._/:-]{0,127}", "served model name")]
Port = Annotated[int, Field(ge=1, le=65535)]

_DURATION = re.compile(r"(?:(\d+)(ms|s|m|h|d))+")
_DURATION_PART = re.compile(r"(\d+)(ms|s|m|h|d)")
_UNIT_SECONDS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(value: Any) -> float:
    """`30s`, `5m`, `1h30m`, `250ms` -> seconds. Bare numbers are refused: `30` is ambiguous to a reader."""
    if isinstance(value, bool) or not isinstance(value, str) or not _DURATION.fullmatch(value.strip()):
        raise ValueError(f"{value!r} is not a duration; write it like 30s, 5m, 1h30m or 250ms")
    return sum(int(n) * _UNIT_SECONDS[u] for n, u in _DURATION_PART.findall(value))


def format_duration(seconds: float) -> str:
    """Seconds -> the shortest readable form that parses back to the same value (`1h30m`, `2s500ms`)."""
    millis = round(seconds * 1000)
    out, rest = "", millis
    for unit, size in (("d", 86_400_000), ("h", 3_600_000), ("m", 60_000), ("s", 1000), ("ms", 1)):
        if rest >= size:
            out += f"{rest // size}{unit}"
            rest %= size
    return out or "0s"


def at_least(floor: float, why: str) -> AfterValidator:
    """A duration's lower bound, with the reason in the message (a zero resync is a busy loop of SSH probes)."""
    def check(value: float) -> float:
        if value < floor:
            raise ValueError(f"{format_duration(value)} is below the minimum {format_duration(floor)}: {why}")
        return value
    return AfterValidator(check)


class Duration(float):
    """Seconds, written in YAML as `30s`/`5m`; keeps the readable form for `model_dump` and the schema."""

    @classmethod
    def __get_pydantic_core_schema__(cls, source, handler):
        from pydantic_core import core_schema

        return core_schema.no_info_plain_validator_function(
            lambda v: v if isinstance(v, Duration) else cls(parse_duration(v)),
            json_schema_input_schema=core_schema.str_schema(pattern=r"^(\d+(ms|s|m|h|d))+$"),
            serialization=core_schema.plain_serializer_function_ser_schema(lambda v: format_duration(v)),
        )


_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*(B|KiB|MiB|GiB|TiB|KB|MB|GB|TB)?")
_SIZE_UNIT = {None: 1, "B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40,
              "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}


def parse_size(value: Any) -> int:
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    match = _SIZE.fullmatch(str(value).strip()) if isinstance(value, str) else None
    if not match:
        raise ValueError(f"{value!r} is not a size; write it like 4GiB, 500MB or 1048576")
    return int(float(match.group(1)) * _SIZE_UNIT[match.group(2)])


ByteSize = Annotated[int, BeforeValidator(parse_size)]

_RESERVED_SERVE_FLAGS = {
    "--tensor-parallel-size": "serving.tensor_parallel_size", "-tp": "serving.tensor_parallel_size",
    "--pipeline-parallel-size": "serving.pipeline_parallel_size", "-pp": "serving.pipeline_parallel_size",
    "--nnodes": "the node list", "--node-rank": "the node list", "--master-addr": "the head's fabric address",
    "--master-port": "serving.master_port", "--headless": "the node roles", "--port": "serving.port",
    "--host": "the launcher", "--served-model-name": "serving.served_model_name",
    "--gpu-memory-utilization": "serving.gpu_memory_utilization", "--max-model-len": "serving.max_model_len",
    "--distributed-executor-backend": "serving.launcher", "--revision": "model.revision",
    "--api-key": "serving.secrets VLLM_API_KEY (a flag would put the key on every command line and in `ps`)",
    "--model": "model.id (the model is the positional argument)", "--config": "the file's own fields (a vLLM "
    "config file would set any flag, the reserved ones too)", "--trust-remote-code": "trust.remote_code",
}

# Environment the launch spec sets from other fields (reconciler.core.vllm); an override in serving.env would
# silently point NCCL, rendezvous or the Hub elsewhere. GB10's defaults (vllm.GB10_ENV) are not here: those are
# meant to be overridden.
RESERVED_ENV = {
    "VLLM_HOST_IP": "nodes[].fabric.address", "MASTER_ADDR": "the head's fabric address",
    "NCCL_SOCKET_IFNAME": "nodes[].fabric.interface", "GLOO_SOCKET_IFNAME": "nodes[].fabric.interface",
    "TP_SOCKET_IFNAME": "nodes[].fabric.interface", "UCX_NET_DEVICES": "nodes[].fabric.interface",
    "OMPI_MCA_btl_tcp_if_include": "nodes[].fabric.interface", "NCCL_IB_HCA": "nodes[].fabric.rdma_device",
    "NCCL_IB_DISABLE": "nodes[].fabric.rdma_device", "HF_HUB_OFFLINE": "model.layout (hf-cache: offline)",
    "HF_HUB_CACHE": "model.path", "TORCHINDUCTOR_CACHE_DIR": "serving.compile_cache",
    "RAY_NODE_IP_ADDRESS": "nodes[].fabric.address", "RAY_memory_monitor_refresh_ms": "serving.launcher",
    "VLLM_CONFIG_ROOT": "serving.launcher",
}
# Refused whatever the file trusts: they load code into every process of the container.
_CODE_INJECTING_ENV = {"LD_PRELOAD", "LD_AUDIT", "PYTHONSTARTUP", "PYTHONPATH", "PYTHONHOME", "BASH_ENV", "ENV"}
# Names that look like a secret: refused in serving.env (the file is copied, exported and shown), to serving.secrets.
_SECRET_NAME = re.compile(r"(TOKEN|SECRET|PASSWORD|PASSWD|API_KEY|APIKEY|CREDENTIAL|PRIVATE_KEY)", re.I)


def _env_name(value: str) -> str:
    if value in RESERVED_ENV:
        raise ValueError(f"{value} is set by the reconciler from {RESERVED_ENV[value]}")
    if value in _CODE_INJECTING_ENV:
        raise ValueError(f"{value} loads code into every process of the container; refused (docs/security.md)")
    return value


def _plain_env_name(value: str) -> str:
    if _SECRET_NAME.search(value):
        raise ValueError(f"{value} looks like a secret; declare it in serving.secrets, which takes the value from "
                         "the reconciler's environment (a value here is in every copy and export of the file)")
    return value


def _extra_arg(value: str) -> str:
    if not isinstance(value, str):
        raise ValueError("must be a string")
    if any(ord(c) < 32 or ord(c) == 127 for c in value):
        raise ValueError(f"{value!r} contains control characters")
    flag = value.split("=", 1)[0]
    canonical = flag if flag in _RESERVED_SERVE_FLAGS else flag.replace("_", "-")  # vLLM reads --a_b as --a-b
    if canonical in _RESERVED_SERVE_FLAGS:
        raise ValueError(f"{flag} is set by the reconciler; use {_RESERVED_SERVE_FLAGS[canonical]} instead")
    return value


def _env_value(value: Any) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, (int, float)):
        return str(value)
    if not isinstance(value, str):
        raise ValueError("must be a string")
    if any(ord(c) < 32 or ord(c) == 127 for c in value):
        raise ValueError("contains control characters (newlines are not allowed in environment values)")
    return value


def _listen(value: str) -> str:
    """HOST:PORT where HOST is an IP address (IPv6 in brackets) or localhost, PORT 1-65535."""
    host, sep, port = value.rpartition(":")
    ok = bool(sep) and port.isdigit() and 1 <= int(port) <= 65535
    if ok and host != "localhost":
        try:
            ipaddress.ip_address(host[1:-1] if host.startswith("[") and host.endswith("]") else host)
            ok = not (":" in host and not host.startswith("["))
        except ValueError:
            ok = False
    if not ok:
        raise ValueError(f"{value!r} is not a valid HOST:PORT (an IP address or localhost, port 1-65535; "
                         "IPv6 as [::1]:9464)")
    return value


ExtraArg = Annotated[str, AfterValidator(_extra_arg)]
ContainerEnvName = Annotated[EnvName, AfterValidator(_env_name)]
PlainEnvName = Annotated[ContainerEnvName, AfterValidator(_plain_env_name)]
EnvValue = Annotated[str, BeforeValidator(_env_value)]


class _Model(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


# ---------------------------------------------------------------------------------------------- the models


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


def _not_loopback(value: str) -> str:
    if value == "lo":
        raise ValueError("lo is the loopback interface, not a fabric port")
    return value


# Host paths no file may mount into a container or name as the model: the node's system, its secrets and the
# docker socket (root on the node without --privileged). Each refuses the path itself and everything below it.
SYSTEM_PATHS = ("/bin", "/boot", "/dev", "/etc", "/lib", "/lib32", "/lib64", "/libx32", "/proc", "/root", "/run",
                "/sbin", "/sys", "/usr", "/var/lib/docker", "/var/lib/containerd", "/var/run")


def _is_under(path: str, prefix: str) -> bool:
    path, prefix = path.rstrip("/") or "/", prefix.rstrip("/") or "/"
    return path == prefix or path.startswith(prefix + "/") or prefix == "/"


def system_path(path: str) -> str | None:
    """The system prefix `path` is (or lies under), `/` itself, or a path through a `.ssh` or `.gnupg` dir."""
    if path.rstrip("/") == "":
        return "/"
    parts = path.strip("/").split("/")
    if ".ssh" in parts or ".gnupg" in parts:
        return "a key directory"
    return next((p for p in SYSTEM_PATHS if _is_under(path, p)), None)


def _data_path(value: str) -> str:
    """A model or cache path: a dedicated directory, never the system, `/`, a top-level dir or a home itself
    (`verify --repair` deletes what does not belong below it)."""
    parts = value.strip("/").split("/")
    if (where := system_path(value)) is not None:
        raise ValueError(f"{value} is {'' if where.startswith('a ') else 'under '}{where}: not a data directory")
    if len(parts) < 2 or (parts[0] == "home" and len(parts) == 2):
        raise ValueError(f"{value} is too shallow: name the model's own directory (at least /dir/sub, not a home)")
    return value


DataPath = Annotated[AbsPath, AfterValidator(_data_path)]


class FabricPort(_Model):
    """One netdev of the fabric, with its RDMA device and address."""

    interface: Annotated[InterfaceName, AfterValidator(_not_loopback)] = Field(
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
    internet: bool = Field(True, description="False for a node that must never reach the internet. Informative: "
                                             "serving gets HF_HUB_OFFLINE=1 on every node, as the weights "
                                             "come from the reconciler, never from the Hub.")
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


Capability = Annotated[str, _pattern(r"[A-Z_]{2,32}", "capability")]
# What a serving container may have without `trust`: the RDMA devices and locked memory NCCL's RoCE transport
# needs (eugr/spark-vllm-docker's --non-privileged set), nothing that reaches the node itself.
SAFE_CAPABILITIES = ("IPC_LOCK",)
SAFE_DEVICE_PREFIX = "/dev/infiniband"


class DockerOptions(_Model):
    """`docker run` options of the serving containers. What reaches beyond the container (privileged, other
    capabilities and devices, host paths) needs the matching `trust` entry (docs/security.md)."""

    gpus: Annotated[str, _pattern(r"all|[0-9]{1,2}|device=[0-9,]{1,32}", "--gpus value")] | None = "all"
    privileged: bool = Field(False, description="Root over the node (every device, every capability). Faster "
                             "RDMA on some reports; needs trust.privileged. Without it: devices "
                             "[/dev/infiniband] and cap_add [IPC_LOCK] give NCCL its RoCE transport.")
    ipc: Literal["host", "private", "shareable"] | None = "host"
    shm_size: Annotated[str, _pattern(r"[0-9]{1,6}[bkmgBKMG]?", "--shm-size value")] | None = Field(
        "64g", description="Only with ipc private or shareable: with `ipc: host` the container uses the host's "
        "/dev/shm, docker ignores --shm-size and podman refuses it, so it is not passed.")
    ulimits: dict[Annotated[str, _pattern(r"[a-z]{1,16}", "ulimit name")],
                  Annotated[str, _pattern(r"-?[0-9]{1,12}(:-?[0-9]{1,12})?", "ulimit value")]] = Field(
        default_factory=lambda: {"nofile": "1048576:1048576", "memlock": "-1", "stack": "67108864"},
        description="Default: what NGC's containers ask for (memlock -1, stack 64 MiB) and a high nofile.")
    devices: list[AbsPath] = Field(default_factory=list, description="/dev/infiniband (and below) freely; any "
                                   "other device must be listed in trust.devices.")
    cap_add: list[Capability] = Field(default_factory=list, description="IPC_LOCK freely; any other capability "
                                      "must be listed in trust.capabilities.")
    volumes: list[Annotated[str, _pattern(r"/[A-Za-z0-9._+@/-]*:/[A-Za-z0-9._+@/-]*(:(ro|rw))?",
                                          "volume (/host:/container[:ro])"), AfterValidator(_no_dotdot)]] = Field(
        default_factory=list)


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
        "127.0.0.1", description="Address vLLM's API binds on the head (host network). Loopback by default: the "
        "API has no authentication unless serving.secrets holds VLLM_API_KEY. 0.0.0.0 to serve other machines: "
        "then with an API key or a proxy in front (docs/security.md). Nothing else: the reconciler's health checks "
        "ask 127.0.0.1 on the head, which a bind to one LAN address would not answer.")
    container_name: ContainerName = "vllm_serving"
    nodes: list[NodeName] | None = Field(None, description="Nodes the model spans (default: head first, then "
                                                           "workers in file order, as many as tp x pp needs).")
    tensor_parallel_size: int = Field(1, ge=1, le=64)
    pipeline_parallel_size: int = Field(1, ge=1, le=64)
    port: Port = 8000
    master_port: Port = 29501
    ray_port: Port = 6379
    gpu_memory_utilization: float = Field(0.8, gt=0, le=1)
    max_model_len: int | None = Field(None, ge=16, le=10_000_000)
    served_model_name: ServedName | None = None
    extra_args: list[ExtraArg] = Field(default_factory=list)
    env: dict[PlainEnvName, EnvValue] = Field(default_factory=dict, description="Plain settings for every "
        "serving container. Not secrets (see `secrets`), not what the reconciler sets itself.")
    secrets: dict[ContainerEnvName, Literal["head", "serving", "internet"]] = Field(
        default_factory=dict, description="Environment variables whose values come from the reconciler's own "
        "environment (systemd EnvironmentFile), never from this file, to the nodes that need them: `head` (the "
        "API server: VLLM_API_KEY), `serving` (every serving node), `internet` (serving nodes with internet: "
        "HF_TOKEN; the offline worker never gets it). Sent on docker's stdin, never written to a node's disk by "
        "the reconciler, exported as secretKeyRef.")
    docker: DockerOptions = Field(default_factory=DockerOptions)
    compile_cache: Literal["home"] | DataPath | None = Field(
        "home", description="Where each node keeps what vLLM compiles (torch.compile/inductor, Triton, "
        "FlashInfer), so a restart does not compile again. `home`: the SSH user's ~/.cache/vllm, "
        "~/.cache/flashinfer and ~/.triton (home = /home/USER, /root for root), as eugr's launcher mounts them; "
        "an absolute path: vllm/, flashinfer/ and triton/ below it; null: nothing kept. Created as the SSH user.")
    health_timeout: Annotated[Duration, at_least(10, "a cold start takes longer")] = Field(
        Duration(3600), description="Deadline for /health after a (cold) start.")
    unhealthy_grace: Annotated[Duration, at_least(10, "shorter restarts serving on every hiccup")] = Field(
        Duration(300), description="How long serving that has served may fail its health check (/health, the "
        "model listed, one completion) before it is restarted in order. Longer than a restart takes, so a "
        "hiccup never costs a reload; doubled after each restart that did not hold, up to 16x.")


class CoTenants(_Model):
    """Other containers on the nodes. `*` as node key applies to every node."""

    allowed: dict[NodeName | Literal["*"], list[ContainerPattern]] = Field(default_factory=dict)
    protected: dict[NodeName | Literal["*"], list[ContainerPattern]] = Field(
        default_factory=dict, description="Never stopped or touched, whatever else the file says.")
    unlisted: Literal["stop", "report"] = "stop"

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
    parallel_streams: int = Field(4, ge=1, le=32)
    transport: Literal["rsync-daemon", "ssh"] = Field(
        "rsync-daemon", description="rsync-daemon: a one-time rsync daemon on the target's fabric address, with a "
        "one-time secret (no cipher: the fabric is a dedicated cable, the bytes are public weights; "
        "docs/weights-transport.md); needs python3 on the target. ssh: rsync over ssh (aes128-gcm), slower, for "
        "a fabric you do not trust or a target without python3.")
    bandwidth_limit: ByteSize | None = Field(None, description="Per stream, bytes/s (e.g. 500MB); none: unlimited.")


class Policy(_Model):
    mode: Literal["enforce", "observe"] = "enforce"
    paused: bool = False
    resync_interval: Annotated[Duration, at_least(1, "shorter is a busy loop of SSH probes")] = Duration(30)
    timeouts: Timeouts = Field(default_factory=Timeouts)
    retries: Retries = Field(default_factory=Retries)
    weights: WeightsPolicy = Field(default_factory=WeightsPolicy)
    memory_margin: ByteSize = Field(4 * 2**30, description="MemAvailable must exceed gmu x MemTotal + this.")
    drop_caches: bool = Field(False, description="Drop the page cache before a start when memory is short.")
    listen: Annotated[str, AfterValidator(_listen)] = Field(
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
                                      "itself). System paths stay refused.")
    remote_code: bool = Field(False, description="Pass --trust-remote-code: vLLM then runs Python from the model "
                              "repository, as root in the container.")

    def granted(self) -> list[str]:
        """Each opt-in in words, for `plan` (empty: nothing beyond the default)."""
        return ([*(["privileged containers"] if self.privileged else []),
                 *(f"capability {c}" for c in self.capabilities), *(f"device {d}" for d in self.devices),
                 *(f"host path {p}" for p in self.host_paths),
                 *(["the model repository's code (--trust-remote-code)"] if self.remote_code else [])])


class Desired(_Model):
    nodes: list[Node] = Field(min_length=1)
    model: Model
    serving: Serving
    co_tenants: CoTenants = Field(default_factory=CoTenants)
    policy: Policy = Field(default_factory=Policy)
    trust: Trust = Field(default_factory=Trust)
    # The values of serving.secrets, from the reconciler's environment (with_secrets); never from the file, never
    # dumped. Compared with ==, so a rotated key is a new desired state (and a restart: the spec hash covers it).
    _secret_values: dict[str, str] = PrivateAttr(default_factory=dict)

    @model_validator(mode="after")
    def _consistent(self) -> Desired:
        problems = consistency_problems(self)
        if problems:
            raise ConsistencyError(problems)
        return self

    def with_secrets(self, environ: Mapping[str, str]) -> Desired:
        """This desired state with the values of serving.secrets taken from `environ` (the edge passes the
        process environment). Raises MissingSecrets naming each declared one that is absent or empty."""
        missing = [name for name in self.serving.secrets if not environ.get(name)]
        if missing:
            raise MissingSecrets(missing)
        out = self.model_copy()
        out._secret_values = {name: environ[name] for name in self.serving.secrets}
        return out

    def secret_names_for(self, node: Node) -> list[str]:
        """The secrets `node`'s serving container gets: `head` only on the head, `internet` only on nodes with
        internet (the offline worker never holds an HF token), `serving` on every serving node."""
        wanted = {"head": node.role == "head", "internet": node.internet, "serving": True}
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

    def node(self, name: str) -> Node:
        return next(n for n in self.nodes if n.name == name)

    @property
    def head(self) -> Node:
        return next(n for n in self.nodes if n.role == "head")

    @property
    def instance(self) -> str:
        """This cluster's reconciler, as its containers' instance label and its lease on the head name it: the
        head's SSH address (one head, one reconciler; node names are only this file's)."""
        return f"{self.head.ssh.host}:{self.head.ssh.port}"

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


KEY = "[key]"  # last element of a problem's path when the mapping key itself is wrong (pydantic's convention)


class MissingSecrets(ValueError):
    def __init__(self, names: list[str]):
        super().__init__(", ".join(names))
        self.names = names


class ConsistencyError(ValueError):
    def __init__(self, problems: list[tuple[Loc, str]]):
        super().__init__("; ".join(f"{loader.format_loc(loc[:-1] if loc[-1:] == (KEY,) else loc)}: {msg}"
                                   for loc, msg in problems))
        self.problems = problems


_Problem = tuple[Loc, str]  # a field path and what is wrong there


@dataclass(frozen=True)
class _Facts:
    """What every cross-field rule looks up: computed once per check."""

    d: Desired
    names: list[str]
    index: dict[str, int]  # node name -> position in `nodes` (the last one for a duplicate name)
    heads: list[int]  # positions of the nodes with role head

    @classmethod
    def of(cls, d: Desired) -> _Facts:
        return cls(d, [n.name for n in d.nodes], {n.name: i for i, n in enumerate(d.nodes)},
                   [i for i, n in enumerate(d.nodes) if n.role == "head"])


def _one_head(f: _Facts) -> list[_Problem]:
    if len(f.heads) == 1:
        return []
    where = ("nodes", f.heads[1], "role") if len(f.heads) > 1 else ("nodes",)
    return [(where, f"exactly one node must have role head (found {len(f.heads)})")]


def _unique_node_names(f: _Facts) -> list[_Problem]:
    return [(("nodes", i, "name"), f"duplicate node name {name!r}")
            for i, name in enumerate(f.names) if name in f.names[:i]]


def _jump_cycle_through(f: _Facts, node: Node) -> str | None:
    """The node where following `ssh.jump` from `node` comes back to a node already passed, if it does."""
    seen, cur = {node.name}, node.ssh.jump
    while cur is not None and cur in f.index:
        if cur in seen:
            return cur
        seen.add(cur)
        cur = f.d.nodes[f.index[cur]].ssh.jump
    return None


def _jump_hosts(f: _Facts) -> list[_Problem]:
    out: list[_Problem] = []
    for i, n in enumerate(f.d.nodes):
        jump, where = n.ssh.jump, ("nodes", i, "ssh", "jump")
        if jump is None:
            continue
        if jump == n.name:
            out.append((where, "a node cannot be its own jump host"))
        elif jump not in f.index:
            out.append((where, f"jump host {jump!r} is not a node (known: {', '.join(sorted(set(f.names)))})"))
        elif (cycle := _jump_cycle_through(f, n)) is not None:
            out.append((where, f"jump hosts form a cycle through {cycle!r}"))
    return out


def _one_fabric_subnet(f: _Facts) -> list[_Problem]:
    if not f.d.nodes:
        return []
    first = f.d.nodes[0]
    net0 = first.fabric.address.network
    return [(("nodes", i, "fabric", "address"),
             f"{n.fabric.address} is not in the fabric subnet {net0} of node {first.name!r}")
            for i, n in enumerate(f.d.nodes[1:], start=1) if n.fabric.address.network != net0]


def _unique_fabric_addresses(f: _Facts) -> list[_Problem]:
    addrs = [n.fabric.address.ip for n in f.d.nodes]
    return [(("nodes", i, "fabric", "address"), f"fabric address {a} is used by another node")
            for i, a in enumerate(addrs) if a in addrs[:i]]


def _twins(f: _Facts) -> list[_Problem]:
    """A twin is another netdev in another subnet (one subnet on both twins breaks routing and NCCL: eugr
    docs/NETWORKING.md), one subnet for all twins, no address used twice. Every node or none: NCCL would pair a
    twin's device with a peer's only one, across two subnets. An RDMA device on both ports or neither."""
    out: list[_Problem] = []
    declared = [n.fabric.twin is not None for n in f.d.nodes]
    if any(declared) and not all(declared):
        return [(("nodes", i, "fabric", "twin"), "declare the fabric twin on every node or on none (NCCL pairs "
                 "the devices across nodes)") for i, d in enumerate(declared) if not d]
    seen: dict[ipaddress.IPv4Address, str] = {n.fabric.address.ip: n.name for n in f.d.nodes}
    net0 = next((n.fabric.twin.address.network for n in f.d.nodes if n.fabric.twin), None)
    for i, n in enumerate(f.d.nodes):
        twin, where = n.fabric.twin, ("nodes", i, "fabric", "twin")
        if twin is None:
            continue
        if twin.interface == n.fabric.interface:
            out.append(((*where, "interface"), f"{twin.interface} is the fabric's first interface already"))
        if twin.address.network == n.fabric.address.network:
            out.append(((*where, "address"), f"{twin.address} is in the subnet of {n.fabric.interface}; "
                        "the twins need different subnets"))
        elif twin.address.network != net0:
            out.append(((*where, "address"), f"{twin.address} is not in the twins' subnet {net0}"))
        if (twin.rdma_device is None) != (n.fabric.rdma_device is None):
            out.append(((*where, "rdma_device"), "an RDMA device on both twins or on neither"))
        elif twin.rdma_device is not None and twin.rdma_device == n.fabric.rdma_device:
            out.append(((*where, "rdma_device"), f"{twin.rdma_device} is the first port's RDMA device already"))
        if twin.address.ip in seen:
            out.append(((*where, "address"), f"{twin.address.ip} is used by {seen[twin.address.ip]!r} already"))
        seen[twin.address.ip] = n.name
    return out


def _weights_source_is_a_node(f: _Facts) -> list[_Problem]:
    source = f.d.model.source
    if source is not None and source not in f.index:
        return [(("model", "source"), f"weights source {source!r} is not a node")]
    return []


def _gpus_needed(s: Serving) -> int:
    return s.tensor_parallel_size * s.pipeline_parallel_size


def _listed_serving_nodes(f: _Facts) -> list[_Problem]:
    """serving.nodes, when given: real nodes, each once, the head among them, exactly tp x pp GPUs."""
    s, d = f.d.serving, f.d
    if s.nodes is None:
        return []
    out: list[_Problem] = []
    for j, name in enumerate(s.nodes):
        if name not in f.index:
            out.append((("serving", "nodes", j), f"{name!r} is not a node"))
        elif name in s.nodes[:j]:
            out.append((("serving", "nodes", j), f"{name!r} is listed twice"))
    if f.heads and d.nodes[f.heads[0]].name not in s.nodes:
        out.append((("serving", "nodes"), "the head must be one of the serving nodes (it runs rank 0 and the API)"))
    need, span = _gpus_needed(s), sum(d.nodes[f.index[n]].gpus for n in set(s.nodes) if n in f.index)
    if span != need:
        out.append((("serving", "tensor_parallel_size"), f"tensor_parallel_size x pipeline_parallel_size = "
                                                         f"{need} but the serving nodes have {span} GPUs"))
    return out


def _default_serving_span(f: _Facts) -> list[_Problem]:
    """Without serving.nodes: the cluster has tp x pp GPUs, and whole nodes (head first) add up to exactly that."""
    s, d = f.d.serving, f.d
    if s.nodes is not None:
        return []
    need, total = _gpus_needed(s), sum(n.gpus for n in d.nodes)
    if need > total:
        return [(("serving", "tensor_parallel_size"),
                 f"tensor_parallel_size x pipeline_parallel_size = {need} exceeds the cluster's {total} GPUs")]
    if len(f.heads) == 1 and sum(n.gpus for n in d.serving_nodes) != need:
        return [(("serving", "tensor_parallel_size"),
                 f"tensor_parallel_size x pipeline_parallel_size = {need} does not match the GPUs of "
                 f"whole nodes (head first): set serving.nodes explicitly")]
    return []


def _distinct_ports(f: _Facts) -> list[_Problem]:
    s = f.d.serving
    out: list[_Problem] = []
    ports = {"port": s.port, "master_port": s.master_port, "ray_port": s.ray_port}
    for value in set(ports.values()):
        same = [k for k, v in ports.items() if v == value]
        if len(same) > 1:  # point at what the operator wrote, not at a default they never saw
            written = [k for k in same if k in s.model_fields_set] or same[1:]
            for key in written:
                others = ", ".join(f"serving.{k}" for k in same if k != key)
                out.append((("serving", key), f"port {value} is also {others}"))
    return out


def _model_path_keys_are_nodes(f: _Facts) -> list[_Problem]:
    path = f.d.model.path
    if not isinstance(path, dict):
        return []
    return [(("model", "path", key, KEY), f"{key!r} is not a node") for key in path if key not in f.index]


def _model_path_for_every_serving_node(f: _Facts) -> list[_Problem]:
    """Needs the derived serving nodes, so it runs only on an otherwise consistent file (see _RULES)."""
    path = f.d.model.path
    if not isinstance(path, dict) or len(f.heads) != 1:
        return []
    return [(("model", "path"), f"no model path for serving node {n.name!r}")
            for n in f.d.serving_nodes if n.name not in path]


def _model_path_for_the_source(f: _Facts) -> list[_Problem]:
    path, source = f.d.model.path, f.d.model.source
    if isinstance(path, dict) and source and source in f.index and source not in path:
        return [(("model", "path"), f"no model path for the source node {source!r}")]
    return []


def _co_tenant_keys_are_nodes(f: _Facts, table: str) -> list[_Problem]:
    return [(("co_tenants", table, key, KEY), f"{key!r} is not a node")
            for key in getattr(f.d.co_tenants, table) if key != "*" and key not in f.index]


def _co_tenants_spare_the_serving_container(f: _Facts, table: str) -> list[_Problem]:
    name = f.d.serving.container_name
    return [(("co_tenants", table, key, j), f"{p!r} matches the managed serving container {name!r}")
            for key, patterns in getattr(f.d.co_tenants, table).items()
            for j, p in enumerate(patterns) if fnmatch.fnmatchcase(name, p)]


def _trusted(f: _Facts) -> list[_Problem]:
    """What reaches beyond the container needs its `trust` entry; system paths are refused even then."""
    opts, trust = f.d.serving.docker, f.d.trust
    out: list[_Problem] = []
    where: Loc = ("serving", "docker")
    if opts.privileged and not trust.privileged:
        out.append(((*where, "privileged"), "a privileged container is root over the node: allow it with "
                    "trust.privileged: true"))
    out += [((*where, "cap_add", j), f"{cap} is not allowed: add it to trust.capabilities (IPC_LOCK needs nothing)")
            for j, cap in enumerate(opts.cap_add) if cap not in SAFE_CAPABILITIES and cap not in trust.capabilities]
    out += [((*where, "devices", j), f"{dev} is not allowed: add it to trust.devices ({SAFE_DEVICE_PREFIX} needs "
             "nothing)") for j, dev in enumerate(opts.devices)
            if not any(_is_under(dev, p) for p in (SAFE_DEVICE_PREFIX, *trust.devices))]
    for j, volume in enumerate(opts.volumes):
        host = volume.split(":", 1)[0]
        if (system := system_path(host)) is not None:
            out.append(((*where, "volumes", j), f"{host} is {'' if system.startswith('a ') else 'under '}{system}: "
                        "never mounted into a serving container"))
        elif not any(_is_under(host, p) for p in trust.host_paths):
            out.append(((*where, "volumes", j), f"{host} is not below a trusted host path: add its directory to "
                        "trust.host_paths"))
    out += [(("trust", "host_paths", j), f"{p} is {'' if s.startswith('a ') else 'under '}{s}: never mounted")
            for j, p in enumerate(trust.host_paths) if (s := system_path(p)) is not None]
    return out


def _image_sources_are_nodes(f: _Facts) -> list[_Problem]:
    return [(("serving", "image_sources", j), f"{name!r} is not a node")
            for j, name in enumerate(f.d.serving.image_sources or []) if name not in f.index]


def _secret_twice(f: _Facts) -> list[_Problem]:
    return [(("serving", "secrets", name, KEY), f"{name} is also in serving.env")
            for name in f.d.serving.secrets if name in f.d.serving.env]


def _co_tenants(f: _Facts) -> list[_Problem]:
    return [problem for table in ("allowed", "protected")
            for problem in _co_tenant_keys_are_nodes(f, table) + _co_tenants_spare_the_serving_container(f, table)]


# (rule, runs only when every rule before it found nothing), in the order the problems are reported.
_RULES: tuple[tuple[Callable[[_Facts], list[_Problem]], bool], ...] = (
    (_one_head, False),
    (_unique_node_names, False),
    (_jump_hosts, False),
    (_one_fabric_subnet, False),
    (_unique_fabric_addresses, False),
    (_twins, False),
    (_weights_source_is_a_node, False),
    (_listed_serving_nodes, False),
    (_default_serving_span, False),
    (_distinct_ports, False),
    (_model_path_keys_are_nodes, False),
    (_model_path_for_every_serving_node, True),
    (_model_path_for_the_source, False),
    (_co_tenants, False),
    (_trusted, False),
    (_secret_twice, False),
    (_image_sources_are_nodes, False),
)


def consistency_problems(d: Desired) -> list[_Problem]:
    """Rules across fields, each with the path it is about. Pure; returns all problems, not the first."""
    facts = _Facts.of(d)
    out: list[_Problem] = []
    for rule, only_if_consistent_so_far in _RULES:
        if not (only_if_consistent_so_far and out):
            out += rule(facts)
    return out


# ---------------------------------------------------------------------------------------------- loading


class InvalidDesiredState(Exception):
    """All problems of one file, each placed at FILE:LINE:COL."""

    def __init__(self, filename: str, problems: list[loader.Problem]):
        self.filename = filename
        self.problems = sorted(problems, key=lambda p: (p.position.line, p.position.column))
        super().__init__("\n".join(self.lines()))

    def lines(self) -> list[str]:
        return [p.render(self.filename) for p in self.problems]


def _message(err: ErrorDetails) -> str:
    kind, msg = err["type"], err["msg"]
    if kind == "missing":
        return "required field is missing"
    if kind == "extra_forbidden":
        return "unknown field (check the spelling; see `reconciler schema`)"
    if kind == "value_error":
        return msg.removeprefix("Value error, ")
    if kind == "string_type":
        return f"must be a string; quote the value ({err.get('input')!r} was read as {type(err.get('input')).__name__})"
    if kind == "literal_error":
        return msg.replace("Input should be", "must be")
    return msg.replace("Input should be", "must be")


_BRANCH_MISMATCH = {"dict_type", "string_type", "list_type", "int_type", "none_required"}


def _clean_errors(exc: ValidationError) -> list[tuple[Loc, bool, ErrorDetails]]:
    """(path, is-about-the-key, error) per problem, without pydantic's union-branch noise: for `str | dict`
    fields keep the branch that fits the input."""
    errs = []
    for err in exc.errors(include_url=False):
        at_key = KEY in err["loc"]
        loc = tuple(p for p in err["loc"] if not (isinstance(p, str) and ("[" in p or p.startswith("function-"))))
        errs.append((loc, at_key, err))
    by_loc: dict[Loc, int] = {}
    for loc, _, _ in errs:
        by_loc[loc] = by_loc.get(loc, 0) + 1
    return [(loc, at_key, err) for loc, at_key, err in errs
            if not (by_loc[loc] > 1 and err["type"] in _BRANCH_MISMATCH)]


def _place(doc: loader.Document, loc: Loc, at_key: bool) -> loader.Position:
    return doc.key_positions.get(loc, doc.position_of(loc)) if at_key else doc.position_of(loc)


def problems_from_validation(doc: loader.Document, exc: ValidationError) -> list[loader.Problem]:
    out: list[loader.Problem] = []
    for loc, at_key, err in _clean_errors(exc):
        cause = (err.get("ctx") or {}).get("error")
        if isinstance(cause, ConsistencyError):
            for sub_loc, message in cause.problems:
                key = sub_loc[-1:] == (KEY,)
                full = loc + (sub_loc[:-1] if key else sub_loc)
                out.append(loader.Problem(_place(doc, full, key), loader.format_loc(full), message))
            continue
        out.append(loader.Problem(_place(doc, loc, at_key or err["type"] == "extra_forbidden"),
                                  loader.format_loc(loc), _message(err)))
    return out


def _without(data: Any, loc: Loc) -> None:
    """Delete the value at `loc` from nested dicts/lists (used to re-check the rest of a broken file)."""
    for part in loc[:-1]:
        data = data[part]
    if isinstance(data, dict):
        data.pop(loc[-1], None)
    elif isinstance(data, list) and isinstance(loc[-1], int) and loc[-1] < len(data):
        data[loc[-1]] = None


def _cross_field_despite(doc: loader.Document, broken: list[Loc]) -> list[loader.Problem]:
    """Cross-field rules normally run only on valid fields. To still report every error at once, drop the broken
    values (fields with defaults fall back to them) and validate again; keep only the cross-field problems that
    do not touch a dropped value, so a default never produces an error the operator did not write."""
    import copy

    data = copy.deepcopy(doc.data)
    try:
        for loc in broken:
            _without(data, loc)
        Desired.model_validate(data)
        return []
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
        causes = [(e.get("ctx") or {}).get("error") for e in errors]
        consistency = [c for c in causes if isinstance(c, ConsistencyError)]
        if len(consistency) != len(causes):
            return []
        out = []
        for cause in consistency:
            for loc, message in cause.problems:
                at_key = loc[-1:] == (KEY,)  # placed at the key, as when the file has no other error
                loc = loc[:-1] if at_key else loc
                if any(loc[: len(b) - 1] == b[:-1] or b[: len(loc)] == loc for b in broken):
                    continue
                out.append(loader.Problem(_place(doc, loc, at_key), loader.format_loc(loc), message))
        return out
    except (KeyError, IndexError, TypeError):
        return []


def _unended(doc: loader.Document) -> list[loader.Problem]:
    if doc.ended:
        return []
    last = max([p.line for p in doc.value_positions.values()], default=1)
    return [loader.Problem(loader.Position(last, 1), "", "the file does not end with the line `...` (YAML's "
                           "document end marker, required as the last line: a half-written save must never "
                           "count as a desired state)")]


def parse(doc: loader.Document, filename: str) -> Desired:
    try:
        desired = Desired.model_validate(doc.data)
    except ValidationError as exc:
        problems = problems_from_validation(doc, exc)
        if not any(isinstance((e.get("ctx") or {}).get("error"), ConsistencyError) for e in exc.errors()):
            broken = [loc for loc, _, _ in _clean_errors(exc) if loc]
            problems += _cross_field_despite(doc, broken)
        raise InvalidDesiredState(filename, problems + _unended(doc)) from None
    if unended := _unended(doc):
        raise InvalidDesiredState(filename, unended)
    return desired


def load(path: str | Path, environ: Mapping[str, str] | None = None) -> Desired:
    """Load and validate a desired-state file; raise InvalidDesiredState with every problem placed. With
    `environ`, also resolve serving.secrets from it (a missing one is a problem placed at its name)."""
    filename = str(path)
    try:
        doc = loader.load_file(Path(path))
    except loader.LoadError as exc:
        raise InvalidDesiredState(filename, exc.problems) from None
    desired = parse(doc, filename)
    if environ is None:
        return desired
    try:
        return desired.with_secrets(environ)
    except MissingSecrets as exc:
        raise InvalidDesiredState(filename, [loader.Problem(
            doc.key_positions.get(("serving", "secrets", name), loader.Position(1, 1)), f"serving.secrets.{name}",
            f"{name} is not set in the reconciler's environment (systemd: EnvironmentFile=, see docs/security.md)")
            for name in exc.names]) from None


def loads(text: str | bytes, filename: str = "<string>") -> Desired:
    try:
        doc = loader.load_text(text.encode() if isinstance(text, str) else text)
    except loader.LoadError as exc:
        raise InvalidDesiredState(filename, exc.problems) from None
    return parse(doc, filename)
