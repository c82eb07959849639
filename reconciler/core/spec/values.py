"""The scalar types a field of the desired state can have: each string held to a strict pattern, durations, sizes.

Every string that can end up in a remote command is held to a strict pattern here, at the border, so the edge
never has to wonder whether a value is safe to quote. A type here judges one value alone; whatever needs another
field to judge it is a rule in `rules.py`.
"""

from __future__ import annotations

import ipaddress
import re
from typing import Annotated, Any

from pydantic import AfterValidator, BeforeValidator, Field, GetCoreSchemaHandler, GetJsonSchemaHandler
from pydantic.json_schema import JsonSchemaValue
from pydantic_core import core_schema

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

    def __get_pydantic_core_schema__(self, source: Any, handler: GetCoreSchemaHandler) -> core_schema.CoreSchema:
        return core_schema.no_info_after_validator_function(self.check, handler(source))

    def __get_pydantic_json_schema__(self, schema: core_schema.CoreSchema,
                                     handler: GetJsonSchemaHandler) -> JsonSchemaValue:
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
DeploymentName = Annotated[str, _pattern(r"[a-z0-9]([a-z0-9-]{0,38}[a-z0-9])?", "deployment name (lowercase "
                                          "letters, digits, '-'; a Kubernetes name and a Prometheus label value)")]
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

# The values of `docker run` options (serving.docker): each reaches the command line as it is written.
DockerGpus = Annotated[str, _pattern(r"all|[0-9]{1,2}|device=[0-9,]{1,32}", "--gpus value")]
DockerShmSize = Annotated[str, _pattern(r"[0-9]{1,6}[bkmgBKMG]?", "--shm-size value")]
UlimitName = Annotated[str, _pattern(r"[a-z]{1,16}", "ulimit name")]
UlimitValue = Annotated[str, _pattern(r"-?[0-9]{1,12}(:-?[0-9]{1,12})?", "ulimit value")]
DockerVolume = Annotated[str, _pattern(r"/[A-Za-z0-9._+@/-]*:/[A-Za-z0-9._+@/-]*(:(ro|rw))?",
                                       "volume (/host:/container[:ro])"), AfterValidator(_no_dotdot)]
Capability = Annotated[str, _pattern(r"[A-Z_]{2,32}", "capability")]


def _not_loopback(value: str) -> str:
    if value == "lo":
        raise ValueError("lo is the loopback interface, not a fabric port")
    return value


FabricInterface = Annotated[InterfaceName, AfterValidator(_not_loopback)]

# ---------------------------------------------------------------------------------------------- durations

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
    def __get_pydantic_core_schema__(cls, source: Any, handler: GetCoreSchemaHandler) -> core_schema.CoreSchema:
        return core_schema.no_info_plain_validator_function(
            lambda v: v if isinstance(v, Duration) else cls(parse_duration(v)),
            json_schema_input_schema=core_schema.str_schema(pattern=r"^(\d+(ms|s|m|h|d))+$"),
            serialization=core_schema.plain_serializer_function_ser_schema(lambda v: format_duration(v)),
        )


# ---------------------------------------------------------------------------------------------- sizes

_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*(B|KiB|MiB|GiB|TiB|KB|MB|GB|TB)?")
_SIZE_OR_SHORT = re.compile(r"(\d+(?:\.\d+)?)\s*(B|KiB|MiB|GiB|TiB|KB|MB|GB|TB|K|M|G|T)?")
_SIZE_UNIT = {None: 1, "B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40,
              "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def parse_size(value: Any, *, short_units: bool = False) -> int:
    """`4GiB`, `500MB`, `1048576` -> bytes: KiB..TiB binary, KB..TB decimal. `short_units` also takes K, M, G, T
    alone, binary as `truncate -s` and docker read them: for the testbed's command line (`--worker-disk 6G`). A
    desired-state file never does: there `4G` would leave its reader guessing which of the two it means."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    pattern = _SIZE_OR_SHORT if short_units else _SIZE
    match = pattern.fullmatch(str(value).strip()) if isinstance(value, str) else None
    if not match:
        example = "6G, 4GiB, 500MB or 1048576" if short_units else "4GiB, 500MB or 1048576"
        raise ValueError(f"{value!r} is not a size; write it like {example}")
    return int(float(match.group(1)) * _SIZE_UNIT[match.group(2)])


# A number of bytes, written `4GiB`, `500MB` or as the number. Not pydantic's `ByteSize`, another parser: that one
# reads `4G` and `4gb` too, both as 4 * 10**9.
SizeInBytes = Annotated[int, BeforeValidator(parse_size)]

# ---------------------------------------------------------------------------------------------- serving.env and
# serving.extra_args: what the reconciler sets itself is refused here, so a file can never override it by accident.

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
    "RAY_num_prestart_python_workers": "serving.launcher",
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


def has_control_characters(value: str) -> bool:
    """Whether `value` holds a C0 control character or DEL. Environment values reach the node as the lines of
    docker's `--env-file` (`LaunchSpec.env_file_text`), which docker reads line by line: a newline inside a value
    would start a variable of its own there (`LD_PRELOAD=...`), past every check of the names. The one test of it
    for serving.env, serving.extra_args and the values of serving.secrets."""
    return any(ord(c) < 32 or ord(c) == 127 for c in value)


def _extra_arg(value: str) -> str:
    """After pydantic's str check. vLLM reads `--a_b` as `--a-b`, and no reserved flag has a `_`."""
    if has_control_characters(value):
        raise ValueError(f"{value!r} contains control characters")
    flag = value.split("=", 1)[0]
    canonical = flag.replace("_", "-")
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
    if has_control_characters(value):
        raise ValueError("contains control characters (newlines are not allowed in environment values)")
    return value


ExtraArg = Annotated[str, AfterValidator(_extra_arg)]
ContainerEnvName = Annotated[EnvName, AfterValidator(_env_name)]
PlainEnvName = Annotated[ContainerEnvName, AfterValidator(_plain_env_name)]
EnvValue = Annotated[str, BeforeValidator(_env_value)]

# ---------------------------------------------------------------------------------------------- listen address


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


Listen = Annotated[str, AfterValidator(_listen)]

# ---------------------------------------------------------------------------------------------- host paths

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


def _held_system_path(path: str) -> str | None:
    """What `path` holds of the refused: a system path strictly below it (`/var` holds /var/lib/docker and
    /var/run, so mounting it mounts them), or a home's key directories (`/home`, `/home/USER` hold `.ssh` and
    `.gnupg`). A path refused as itself is `system_path`'s; `/` is both."""
    below = next((p for p in SYSTEM_PATHS if _is_under(p, path) and p.rstrip("/") != path.rstrip("/")), None)
    if below is not None:
        return below
    parts = path.strip("/").split("/")
    return "a home's key directories (.ssh, .gnupg)" if parts[0] == "home" and len(parts) <= 2 else None


def mount_refusal(path: str) -> str | None:
    """Why a host path may never be mounted into a serving container, whatever `trust` says, or None: it is a
    system path or below one, it passes through a key directory, or it holds one of those (a mount gives the
    container everything below its path). The one judgement for serving.docker.volumes, trust.host_paths and
    the model and cache directories."""
    if (where := system_path(path)) is not None:
        return f"{path} is {'' if where.startswith('a ') else 'under '}{where}"
    if (held := _held_system_path(path)) is not None:
        return f"{path} holds {held}"
    return None


def _data_path(value: str) -> str:
    """A model or cache path: a dedicated directory, never the system, `/`, a top-level dir or a home itself
    (`verify --repair` deletes what does not belong below it), nor a directory holding what is refused (the
    model is mounted into every serving container)."""
    parts = value.strip("/").split("/")
    if system_path(value) is None and (len(parts) < 2 or (parts[0] == "home" and len(parts) == 2)):
        raise ValueError(f"{value} is too shallow: name the model's own directory (at least /dir/sub, not a home)")
    if (refusal := mount_refusal(value)) is not None:
        raise ValueError(f"{refusal}: not a data directory")
    return value


DataPath = Annotated[AbsPath, AfterValidator(_data_path)]
