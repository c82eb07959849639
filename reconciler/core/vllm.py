"""The vLLM launch spec per node: docker flags, environment and argv for the native and Ray launchers.

Pure rendering from the desired state, so the plan can compare a hash of it with the label on the running
container, and the serving step can run exactly what was hashed. Interface names and addresses are taken from
each node's own fabric section, never copied from the head (asymmetric cabling is a known failure mode).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import shlex
from dataclasses import dataclass, field

from reconciler.core.fabric import RdmaAtStart
from reconciler.core.observed import (
    LABEL_GENERATION,
    LABEL_INSTANCE,
    LABEL_LAUNCH,
    LABEL_MANAGED,
    LABEL_PORTS,
    LABEL_ROLE,
    LABEL_SPEC_HASH,
    LABEL_WEIGHTS,
    MAX_LAUNCH_LABEL,
    MAX_LAUNCH_VALUE,
    Observed,
)
from reconciler.core.spec import Desired, Node, Serving
from reconciler.core.spec.models import MEMORY_OVERHEAD_PER_INSTANCE
from reconciler.core.text import printable

HF_CACHE_IN_CONTAINER = "/root/.cache/huggingface/hub"
PLAIN_MODEL_IN_CONTAINER = "/models/model"


@dataclass(frozen=True)
class LaunchSpec:
    """Everything `docker run` needs on one node, plus (Ray only) the serve command exec'd on the head."""

    node: str
    rank: int
    container_name: str
    image: str
    docker_flags: tuple[str, ...]
    env: dict[str, str]
    command: tuple[str, ...]
    serve_exec: tuple[str, ...] | None = None  # Ray launcher: `vllm serve ...` run inside the head container
    keep_local: tuple[str, ...] = ()  # Ray launcher, head: env names vLLM must not copy to the Ray workers
    #: The instance label (`core.ownership.Owner.label`: the head's cluster id, else its SSH address). Not hashed:
    #: it names the owner, not the launch, so a renumbered head restarts nothing.
    instance: str = ""
    #: The fixed TCP ports this rank listens on, with the field that sets each (the API, torch's TCPStore for
    #: the native rendezvous, Ray's GCS): a start finds them free or fails. Carried as a label, so the next
    #: plan knows which listeners are this generation's own. Not hashed: the command already says them.
    listens: tuple[tuple[str, int], ...] = ()
    weights: str = ""  # Desired.weights_root on the node, as a label (not hashed: the mount already says it)
    #: What the start sets over `env` from the node as it is then (`at_start`). Not hashed: the declared launch
    #: is what the next plan compares, so a twin port coming back restarts nothing.
    start_env: tuple[tuple[str, str], ...] = ()
    #: What the launch is rendered from (`launch_inputs`), carried as a label so the next plan can say which fields
    #: force a restart. Not hashed: the rendering it feeds already is.
    inputs: dict[str, str] = field(default_factory=dict)

    @property
    def spec_hash(self) -> str:
        body = json.dumps([self.container_name, self.image, self.docker_flags, sorted(self.env.items()),
                           self.command, self.serve_exec, *([self.keep_local] if self.keep_local else [])],
                          separators=(",", ":"))
        return hashlib.sha256(body.encode()).hexdigest()[:16]

    def run_argv(self, generation: int, env_file: str | None = None) -> list[str]:
        """`docker run` argv (without the leading `docker`); labels carry the hash for the next diff.

        With `env_file` (the serving step passes `/dev/stdin` and sends `env_file_text` on it) the docker CLI
        reads the environment from there instead of `-e K=V`, so no value (HF_TOKEN, ...) is on a command line:
        not in `ps` on the node, not in the argv of an error message. The hash covers the env either way."""
        labels = {LABEL_MANAGED: "true", LABEL_SPEC_HASH: self.spec_hash, LABEL_GENERATION: str(generation),
                  LABEL_ROLE: "head" if self.rank == 0 else "worker", LABEL_INSTANCE: self.instance,
                  LABEL_PORTS: ",".join(str(port) for _, port in self.listens), LABEL_WEIGHTS: self.weights}
        if self.inputs and (launch := launch_label(self.inputs)) is not None:  # none: a spec not made by launch_specs
            labels[LABEL_LAUNCH] = launch
        argv = ["run", "-d", "--name", self.container_name, *self.docker_flags]
        for key, value in sorted(labels.items()):
            argv += ["--label", f"{key}={value}"]
        if env_file is not None:
            argv += ["--env-file", env_file]
        else:
            for key, value in sorted(self.started_env().items()):
                argv += ["-e", f"{key}={value}"]
        return argv + [self.image, *self.command]

    def started_env(self) -> dict[str, str]:
        """The environment the container gets: the declared one, with what the start set over it."""
        return self.env | dict(self.start_env)

    def non_carry_over_json(self) -> str:
        """vLLM's `$VLLM_CONFIG_ROOT/ray_non_carry_over_env_vars.json` for the head (a JSON list of names)."""
        return json.dumps(list(self.keep_local))

    def env_file_text(self) -> str:
        """`docker run --env-file` content: one KEY=VALUE per line, taken literally (spec forbids control
        characters in values, so a value cannot start another line)."""
        return "".join(f"{key}={value}\n" for key, value in sorted(self.started_env().items()))


def _model_mount(desired: Desired, node: Node) -> tuple[list[str], str, dict[str, str]]:
    """Read-only: only the reconciler writes the weights (rsync from the source), and a compromised or buggy
    container must not change what the other nodes are checked against. With HF_HUB_OFFLINE=1 nothing is
    downloaded into the cache; the real vLLM's start and completions on the testbed run from this read-only
    mount (tests/e2e/test_real_vllm.py, docs/security.md)."""
    path = desired.model.path_on(node.name)
    if desired.model.layout == "hf-cache":
        return (["-v", f"{path}:{HF_CACHE_IN_CONTAINER}:ro"], desired.model.id,
                {"HF_HUB_CACHE": HF_CACHE_IN_CONTAINER})
    return ["-v", f"{path}:{PLAIN_MODEL_IN_CONTAINER}:ro"], PLAIN_MODEL_IN_CONTAINER, {}


# Inside the container (NGC's and vLLM's images run as root): vLLM's torch.compile cache lives in ~/.cache/vllm,
# FlashInfer's JIT in ~/.cache/flashinfer, Triton's in ~/.triton, TileLang's in ~/.tilelang (its default
# TILELANG_CACHE_DIR is ~/.tilelang/cache; the GB10 recipes of the MoE kernels TileLang compiles set exactly that);
# inductor's own defaults to /tmp, so it is moved under the vLLM one (bench/vllm_start.py measures what keeping
# them saves). With `compile_cache: home` each is the same path below the SSH user's home on the node.
_CACHES_IN_CONTAINER = {"vllm": "/root/.cache/vllm", "flashinfer": "/root/.cache/flashinfer", "triton": "/root/.triton",
                        "tilelang": "/root/.tilelang"}


def cache_dirs(desired: Desired, node: Node) -> dict[str, str]:
    """Host directory per kept compile cache on `node` (empty: none kept). The serving step creates them as the
    SSH user before `docker run`, which would otherwise create them as root, and refuses one that is a link
    (edge/steps/serving.py `CACHE_DIRS`): docker's `-v` follows it."""
    where = desired.serving.compile_cache
    if where is None:
        return {}
    if where == "home":
        home = "/root" if node.ssh.user == "root" else f"/home/{node.ssh.user}"
        return {name: home + inside.removeprefix("/root") for name, inside in _CACHES_IN_CONTAINER.items()}
    return {name: f"{where.rstrip('/')}/{name}" for name in _CACHES_IN_CONTAINER}


def _cache_mounts(desired: Desired, node: Node) -> tuple[list[str], dict[str, str]]:
    dirs = cache_dirs(desired, node)
    flags = [arg for name, host in dirs.items() for arg in ("-v", f"{host}:{_CACHES_IN_CONTAINER[name]}")]
    env = {"TORCHINDUCTOR_CACHE_DIR": f"{_CACHES_IN_CONTAINER['vllm']}/inductor"} if dirs else {}
    return flags, env


def _docker_flags(desired: Desired) -> list[str]:
    """The same on every node: the options of `serving.docker`."""
    opts = desired.serving.docker
    flags = ["--network", "host", "--restart", "no"]
    if opts.ipc:
        flags += ["--ipc", opts.ipc]
    if opts.privileged:
        flags += ["--privileged"]
    if opts.gpus:
        flags += ["--gpus", opts.gpus]
    if opts.shm_size and opts.ipc != "host":  # the host's /dev/shm has its own size; docker ignores the flag
        flags += ["--shm-size", opts.shm_size]  # with it, and podman refuses the pair
    for name, value in opts.effective_ulimits.items():
        flags += ["--ulimit", f"{name}={value}"]
    for device in opts.devices:
        flags += ["--device", device]
    for cap in opts.cap_add:
        flags += ["--cap-add", cap]
    for volume in opts.volumes:
        flags += ["-v", volume]
    return flags


def _hca(devices: list[str]) -> str:
    """NCCL_IB_HCA for these devices. `=`: exact names, as NCCL's docs advise for a list (a bare `mlx5_1` also
    matches mlx5_10..19); one device stays as it always was (no restart on upgrade)."""
    return devices[0] if len(devices) == 1 else "=" + ",".join(devices)


#: What a start tells NCCL on a fabric with RDMA devices, unless serving.env says otherwise. NCCL_NET=IB: NCCL
#: uses the IB/RoCE transport or fails, where without it a rank whose RDMA init fails (no /dev/infiniband, memlock,
#: a wrong GID) falls back to NET/Socket silently, at a quarter of the speed (NCCL docs, NCCL_NET: "make sure NCCL
#: ... doesn't automatically fall back"; timothystewart6 PR #24: IB disabled "cuts throughput ~4x"; sparkrun sets
#: it too). NCCL_DEBUG=INFO with the INIT and NET subsystems: the rank logs the transport it chose ("via NET/IB"),
#: which the health wait reads; set at the start only, so a running generation is not restarted for it.
NCCL_AT_START = {"NCCL_NET": "IB", "NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT,NET"}


def at_start(spec: LaunchSpec, rdma: RdmaAtStart) -> LaunchSpec:
    """The launch as the start runs it, given the node's fabric then (core/fabric.py `rdma_at_start`): with a
    twin down, NCCL_IB_HCA lists the ports that carry, which is what NCCL would use anyway (it skips a port that
    is not ACTIVE), so the container's environment says what the fabric is; NCCL is held to its IB transport
    (`NCCL_AT_START`) on the RoCE v2 IPv4 GID read from the port (NCCL_IB_GID_INDEX). What serving.env sets
    stays. With none carrying nothing changes: the first port's drift blocks that start."""
    declared = spec.env.get("NCCL_IB_HCA")
    if declared is None or not rdma.devices:
        return spec
    extra = {**NCCL_AT_START, **({"NCCL_IB_GID_INDEX": str(rdma.gid_index)} if rdma.gid_index is not None else {})}
    start = {k: v for k, v in extra.items() if k not in spec.env}
    if _hca(rdma.devices) != declared:
        start["NCCL_IB_HCA"] = _hca(rdma.devices)
    return dataclasses.replace(spec, start_env=tuple(sorted(start.items()))) if start else spec


def _env(desired: Desired, node: Node) -> dict[str, str]:
    head_ip = str(desired.api_node.fabric.address.ip)  # rank 0's: the rendezvous
    iface = node.fabric.interface
    env = {
        "VLLM_HOST_IP": str(node.fabric.address.ip),
        "MASTER_ADDR": head_ip,
        "NCCL_SOCKET_IFNAME": iface,
        "GLOO_SOCKET_IFNAME": iface,
        "TP_SOCKET_IFNAME": iface,
        "UCX_NET_DEVICES": iface,
        "OMPI_MCA_btl_tcp_if_include": iface,
    }
    if devices := [p.rdma_device for p in node.fabric.ports() if p.rdma_device]:
        # Both twins when declared: each is one PCIe x4 link, ~100 Gb/s (eugr docs/NETWORKING.md); a start
        # lists only those that carry then (`at_start`).
        env |= {"NCCL_IB_HCA": _hca(devices), "NCCL_IB_DISABLE": "0"}
    # Every node, not only the internet-less one: the reconciler has put the exact revision there, and vLLM
    # 0.32 still asks the Hub at start for files a snapshot lacks (hf_quant_config.json in get_config), so a Hub
    # or DNS outage crashed a head that had every file (docs/testbed.md, "What the real vLLM revealed"); and an
    # online head re-resolves `--revision main` at every start, so it could load a newer revision than the
    # worker's copy. Not for `layout: plain`: a local path and HF_HUB_OFFLINE break each other (vllm#23684).
    if desired.model.layout == "hf-cache":
        env["HF_HUB_OFFLINE"] = "1"
    if desired.serving.launcher == "ray":
        env |= {"RAY_memory_monitor_refresh_ms": "0", "RAY_NODE_IP_ADDRESS": str(node.fabric.address.ip),
                "RAY_num_prestart_python_workers": "0"}
    defaults = dict(GB10_ENV)
    if {"--enable-sleep-mode", "--enable_sleep_mode"} & set(extra_flags(desired.serving.extra_args)):
        # vLLM's sleep-mode allocator refuses expandable segments (vllm/device_allocator/cumem.py)
        defaults.pop("PYTORCH_CUDA_ALLOC_CONF")
    return env | defaults | dict(desired.serving.env) | desired.secrets_for(node)


# What eugr/spark-vllm-docker sets on every Spark (launch-cluster.sh), overridable in serving.env: unified memory
# fragments less with expandable segments (a 2x Spark report measured 6-7 GiB more free), and NCCL's own CPU
# affinity guess is wrong on GB10's big.LITTLE cores (docs/troubleshooting.md "GB10 memory defaults").
GB10_ENV = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", "NCCL_IGNORE_CPU_AFFINITY": "1"}


#: `ray start` as eugr/spark-vllm-docker's launch-cluster.sh runs it on Sparks. Ray's object store takes 30 % of
#: memory by default (Ray docs, "Memory Management": object store size), which on unified memory is taken from
#: vLLM's pool, and vLLM's tensor parallel never uses it: 1 GiB. Two CPUs keep Ray's own workers off vLLM's cores;
#: no usage stats leave an internet-less worker. The head also drops the dashboard (`--include-dashboard=false`).
RAY_OBJECT_STORE_BYTES = 1 << 30
RAY_START_FLAGS = ("--object-store-memory", str(RAY_OBJECT_STORE_BYTES), "--num-cpus", "2", "--disable-usage-stats")


def _serve_argv(desired: Desired, model_arg: str) -> list[str]:
    s = desired.serving
    argv = ["vllm", "serve", model_arg]
    if desired.model.layout == "hf-cache":
        argv += ["--revision", desired.model.revision]
    argv += ["--tensor-parallel-size", str(s.tensor_parallel_size),
             "--pipeline-parallel-size", str(s.pipeline_parallel_size),
             "--gpu-memory-utilization", f"{s.gpu_memory_utilization:g}"]
    if s.max_model_len:
        argv += ["--max-model-len", str(s.max_model_len)]
    if s.served_model_name:
        argv += ["--served-model-name", s.served_model_name]
    if desired.trust.remote_code:
        argv += ["--trust-remote-code"]
    return argv


def serve_wrapper(entrypoint: list[str]) -> tuple[str, ...]:
    """What `vllm serve` must run under inside a running container of an image with this Entrypoint. `docker
    exec` bypasses the Entrypoint, and NGC's (`/opt/nvidia/nvidia_entrypoint.sh`, which ends in `exec "$@"`) sets
    up CUDA forward compatibility first: without it FlashInfer's JIT fails with cudaErrorUnsupportedPtxVersion
    (gyliu513/langX101 PR #409). An Entrypoint that is itself a program to run rather than a wrapper (vLLM's
    own image: `vllm serve`; a bare python or ray) is not put in front of `vllm serve`."""
    if not entrypoint or entrypoint[0].rsplit("/", 1)[-1].split(".")[0] in ("vllm", "python", "python3", "ray"):
        return ()
    return tuple(entrypoint)


def extra_flags(extra_args: list[str]) -> list[str]:
    """The option names in serving.extra_args (`--x=1` -> `--x`; values and negative numbers are not options)."""
    out = []
    for arg in extra_args:
        name = arg.split("=", 1)[0]
        if name.startswith("-") and not name.lstrip("-").replace(".", "", 1).isdigit() and name not in out:
            out.append(name)
    return out


def unknown_flags(extra_args: list[str], known: list[str]) -> list[str]:
    """Flags of extra_args the image's `vllm serve` does not know. vLLM's parser takes `--a_b` for `--a-b`."""
    names = set(known)
    return [f for f in extra_flags(extra_args) if f not in names and f.replace("_", "-") not in names]


def serve_argvs(desired: Desired) -> list[tuple[str, ...]]:
    """Every `vllm serve` argv a start of `desired` runs: each native rank's command, Ray's serve exec on the head.
    All of them are judged by the image's own `--help=all` before anything stops (planning._image_refuses)."""
    argvs = []
    for spec in launch_specs(desired):
        for argv in (spec.command, spec.serve_exec or ()):
            if argv[:2] == ("vllm", "serve"):
                argvs.append(argv)
    return argvs


def parse_serve_help(text: str) -> list[str]:
    """Every option name in `vllm serve --help=all` output: argparse lists them on lines indented by two spaces,
    aliases separated by ", " before the description (`  --api-server-count N, -asc N  Text`)."""
    flags: list[str] = []
    for line in text.splitlines():
        if not line.startswith("  -"):
            continue
        spec = line.strip().split("  ", 1)[0]
        for alias in spec.split(", "):
            name = alias.split(" ", 1)[0]
            if name.startswith("-") and name not in flags:
                flags.append(name)
    return flags


def memory_for(utilization: float, total_bytes: int, margin: int,
               overhead: int = MEMORY_OVERHEAD_PER_INSTANCE) -> int:
    """What MemAvailable must cover before vLLM starts on a node of `total_bytes` unified memory: the pool it
    takes (`utilization` of the total, as vLLM sizes it), what the instance holds outside its pool (`overhead`,
    policy.memory_overhead_per_instance) and `margin` for the rest of the node. The one formula; `memory_terms`
    spells it out for a desired state, `largest_utilization` inverts it."""
    return int(utilization * total_bytes) + overhead + margin


_SI = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_IEC = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}
_HUMAN_INT = re.compile(r"(\d+(?:\.\d+)?)(Ki|Mi|Gi|Ti|[kKmMgGtT])?")


def vllm_int(text: str) -> int | None:
    """A size as vLLM's `human_readable_int` reads it (vllm/engine/arg_utils.py; later vllm/utils/argparse_utils):
    a plain integer, a lowercase suffix in powers of ten (`25.6k`), an uppercase one in powers of two (`16G`).
    Newer releases read `M`/`G` in powers of ten and `Mi`/`Gi` in powers of two: for a memory reservation the
    larger reading is taken, so the check never under-reserves whichever the image runs. None: not a size."""
    match = _HUMAN_INT.fullmatch(text.strip())
    if match is None:
        return None
    number, suffix = match.groups()
    if suffix in _SI:
        return int(float(number) * _SI[suffix])
    if "." in number:
        return None  # vLLM refuses decimals with binary suffixes and plain decimals
    return int(number) * (_IEC[suffix] if suffix else 1)


def flag_value(args: list[str] | tuple[str, ...], flag: str) -> str | None:
    """The value argparse would give `flag` in `args` (`--f V` or `--f=V`, the last one wins; vLLM takes `--f_g` for
    `--f-g`). None: not given."""
    value = None
    for i, arg in enumerate(args):
        name, eq, rest = arg.partition("=")
        if name.replace("_", "-") != flag:
            continue
        if eq:
            value = rest
        elif i + 1 < len(args):
            value = args[i + 1]
    return value


def pools(serving: Serving) -> bool:
    """A pooling model (`--runner pooling` in serving.extra_args: embeddings, a reranker), which serves vLLM's
    Pooling API and no completions (docs.vllm.ai, "Pooling Models")."""
    return flag_value(serving.extra_args, "--runner") == "pooling"


#: The name of the margin's term in `memory_terms` (a node's budget counts it once, core/budget.py).
MARGIN_TERM = "policy.memory_margin"
#: The name of the term of what a `vllm serve` holds outside its pool (once per rank: a node's budget counts it for
#: every deployment on the node).
OVERHEAD_TERM = "policy.memory_overhead_per_instance"


def memory_terms(desired: Desired, total_bytes: int, weights_bytes: int | None = None) -> list[tuple[str, int]]:
    """What a serving rank holds in a node's unified memory, term by term, as vLLM sizes it:
    - `gpu_memory_utilization` x MemTotal, its pool for weights, activations and the KV cache; except that
      `--kv-cache-memory-bytes` makes vLLM ignore gpu_memory_utilization ("kv_cache_memory_bytes (when not-None)
      ignores gpu_memory_utilization", vLLM's own `--help=all`): then the rank's share of the weights (the tree
      over tensor x pipeline parallel ranks; the whole `gpu_memory_utilization` pool when the tree's size is not
      known) plus that KV cache;
    - `--cpu-offload-gb` GiB of weights vLLM keeps in CPU memory, which on GB10 is the same memory;
    - policy.memory_overhead_per_instance: what the `vllm serve` holds outside its pool (its API server, the CUDA
      context taken before the pool is sized, CUDA graphs captured after it; none when the file sets 0);
    - policy.memory_margin for everything else on the node.
    The drift that reports too little memory, the start's preflight and the node's budget (every term but the
    margin, for each deployment on the node; the margin once) read the same terms."""
    s = desired.serving
    pool = int(s.gpu_memory_utilization * total_bytes)
    kv_text = flag_value(s.extra_args, "--kv-cache-memory-bytes")
    kv = vllm_int(kv_text) if kv_text is not None else None
    if kv is None:
        terms = [(f"gpu_memory_utilization {s.gpu_memory_utilization:g} x {total_bytes / 2**30:.1f} GiB", pool)]
    else:
        ranks = s.tensor_parallel_size * s.pipeline_parallel_size
        share = -(-weights_bytes // ranks) if weights_bytes else pool
        terms = [("the rank's share of the weights" if weights_bytes else
                  "the gpu_memory_utilization pool (the weights' size is not known)", share),
                 ("--kv-cache-memory-bytes", kv)]
    offload = flag_value(s.extra_args, "--cpu-offload-gb")
    try:
        gib = float(offload) if offload is not None else 0.0
    except ValueError:
        gib = 0.0
    if gib > 0 and gib < 2**20:  # vLLM refuses what is not a number; nothing sane is a PiB
        terms.append(("--cpu-offload-gb", int(gib * 2**30)))
    if desired.policy.memory_overhead_per_instance:
        terms.append((OVERHEAD_TERM, desired.policy.memory_overhead_per_instance))
    return terms + [(MARGIN_TERM, desired.policy.memory_margin)]


def memory_needed(desired: Desired, total_bytes: int, weights_bytes: int | None = None) -> int:
    """The sum of `memory_terms`: what MemAvailable must cover before a rank starts. Without the flags that change
    how vLLM sizes memory it is `memory_for` the file's gpu_memory_utilization, policy.memory_margin and
    policy.memory_overhead_per_instance (the formula `largest_utilization` inverts for discover)."""
    return sum(size for _, size in memory_terms(desired, total_bytes, weights_bytes))


def weights_size(desired: Desired, observed: Observed) -> int | None:
    """The model tree's size as the weights source holds it (what every rank loads a share of); None: not seen."""
    weights = observed.node(desired.source_node).weights
    return weights.total_bytes if weights is not None and weights.present else None


def memory_words(desired: Desired, total_bytes: int, weights_bytes: int | None = None) -> str:
    """`memory_terms` for a message: `a 1.0 GiB + b 2.0 GiB = 3.0 GiB`."""
    terms = memory_terms(desired, total_bytes, weights_bytes)
    return (" + ".join(f"{name} {size / 2**30:.1f} GiB" for name, size in terms)
            + f" = {sum(size for _, size in terms) / 2**30:.1f} GiB")


def largest_utilization(total_bytes: int, available_bytes: int, margin: int,
                        overhead: int = MEMORY_OVERHEAD_PER_INSTANCE) -> float:
    """The inverse of `memory_for`: the largest utilization u with `memory_for(u, total_bytes, margin, overhead)
    <= available_bytes` (0 when not even the margin and the overhead fit). `discover` guesses
    gpu_memory_utilization with it: the guess and the memory check that `memory_needed` makes read the same
    formula."""
    return max(0.0, (available_bytes - margin - overhead) / total_bytes)


def launch_specs(desired: Desired, instance: str | None = None) -> list[LaunchSpec]:
    """One spec per serving node, rank order (head = rank 0). `instance`: the label the containers are started
    with (`core.ownership.owner(...).label`, what the start step and the simulation pass); the head's SSH address
    when not given, for what only compares hashes and ports (the label is not hashed)."""
    s = desired.serving
    nodes = desired.serving_nodes
    head_ip = str(desired.api_node.fabric.address.ip)  # rank 0's: the rendezvous
    specs = []
    for rank, node in enumerate(nodes):
        mount, model_arg, _ = _model_mount(desired, node)
        caches, _ = _cache_mounts(desired, node)
        flags = tuple(_docker_flags(desired) + mount + caches)
        env = _container_env(desired, node)
        serve_exec = None
        listens = _listens(desired, rank, len(nodes))
        if s.launcher == "native":
            command = _serve_argv(desired, model_arg) + ["--host", s.host, "--port", str(s.port)]
            if len(nodes) > 1:
                command += ["--nnodes", str(len(nodes)), "--node-rank", str(rank),
                            "--master-addr", head_ip, "--master-port", str(s.master_port)]
                if rank > 0:
                    command += ["--headless"]
            command += list(s.extra_args)
        else:
            ip = str(node.fabric.address.ip)
            if rank == 0:
                command = ["ray", "start", "--block", "--head", "--port", str(s.ray_port), "--node-ip-address", ip,
                           *RAY_START_FLAGS, "--include-dashboard=false"]
                serve_exec = tuple(_serve_argv(desired, model_arg) + [
                    "--host", s.host, "--port", str(s.port), "--distributed-executor-backend", "ray",
                    *s.extra_args])
            else:
                command = ["ray", "start", "--block", f"--address={head_ip}:{s.ray_port}", "--node-ip-address", ip,
                           *RAY_START_FLAGS]
        specs.append(LaunchSpec(node=node.name, rank=rank, container_name=s.container_name, image=s.image,
                                docker_flags=flags, env=env, command=tuple(command), serve_exec=serve_exec,
                                instance=desired.instance if instance is None else instance, listens=listens,
                                weights=desired.weights_root(node.name), inputs=launch_inputs(desired, node)))
    if s.launcher == "ray":
        specs[0] = dataclasses.replace(specs[0], keep_local=_keep_local(specs))
    return specs


def _container_env(desired: Desired, node: Node) -> dict[str, str]:
    """Every variable `node`'s container gets, as declared (the model's and the caches' own, then `_env`)."""
    return _model_mount(desired, node)[2] | _cache_mounts(desired, node)[1] | _env(desired, node)


def launch_inputs(desired: Desired, node: Node) -> dict[str, str]:
    """What `node`'s launch is rendered from, as the file names it: dotted field -> short printable value (`serving.
    max_model_len` -> `32768`; this node's own fields and the head's address it points at under `nodes.NAME.`;
    a secret as `serving.secrets.NAME` -> `secret_fingerprint`, never its value; an unset field is left out).
    Equal inputs render the same launch, so when the spec hash differs the diff of the old container's inputs
    (its `LABEL_LAUNCH`) and these names every field that forces the restart (tests/unit/core/test_plan_diff.py tries
    random edits). Fields no rank reads are left out; the `vllm serve` ones are kept on a Ray worker, whose `ray
    start` does not read them, as that only shows when its own launch changed too."""
    s = desired.serving
    out = (_serving_inputs(desired, node) | _docker_inputs(desired) | _fabric_inputs(desired, node)
           | _layout_and_launcher_inputs(desired, node))
    out |= {f"serving.env.{k}": v for k, v in s.env.items()}
    out |= {f"serving.secrets.{k}": secret_fingerprint(k, v) for k, v in desired.secrets_for(node).items()}
    return {k: _short(v) for k, v in sorted(out.items()) if v != "" or k.startswith("serving.env.")}


def _serving_inputs(desired: Desired, node: Node) -> dict[str, str]:
    """`launch_inputs`' serving.*, trust.* and model.* fields every launch reads."""
    s, model = desired.serving, desired.model
    return {
        "serving.container_name": s.container_name, "serving.image": s.image, "serving.launcher": s.launcher,
        "serving.nodes": ",".join(n.name for n in desired.serving_nodes),  # the rank and the group's size
        "serving.tensor_parallel_size": str(s.tensor_parallel_size),
        "serving.pipeline_parallel_size": str(s.pipeline_parallel_size),
        "serving.gpu_memory_utilization": f"{s.gpu_memory_utilization:g}", "serving.host": s.host,
        "serving.port": str(s.port), "serving.extra_args": shlex.join(s.extra_args),
        "serving.max_model_len": str(s.max_model_len or ""), "serving.served_model_name": s.served_model_name or "",
        "trust.remote_code": _yaml(desired.trust.remote_code),
        "model.layout": model.layout, "model.path": model.path_on(node.name),
        "serving.compile_cache": s.compile_cache or "",
    }


def _docker_inputs(desired: Desired) -> dict[str, str]:
    """`launch_inputs`' serving.docker.* fields."""
    docker = desired.serving.docker
    return {
        "serving.docker.gpus": docker.gpus or "", "serving.docker.ipc": docker.ipc or "",
        "serving.docker.privileged": _yaml(docker.privileged),
        "serving.docker.shm_size": (docker.shm_size or "") if docker.ipc != "host" else "",  # ignored beside it
        "serving.docker.ulimits": " ".join(f"{k}={v}" for k, v in docker.effective_ulimits.items()),
        "serving.docker.devices": shlex.join(docker.devices), "serving.docker.cap_add": shlex.join(docker.cap_add),
        "serving.docker.volumes": shlex.join(docker.volumes),
    }


def _fabric_inputs(desired: Desired, node: Node) -> dict[str, str]:
    """`launch_inputs`' fabric fields: the node's own under `nodes.NAME.`, and the head's address it points at."""
    me, head = f"nodes.{node.name}.", f"nodes.{desired.api_node.name}."
    return {
        me + "fabric.interface": node.fabric.interface, me + "fabric.address": str(node.fabric.address.ip),
        me + "fabric.rdma_device": node.fabric.rdma_device or "",
        me + "fabric.twin.rdma_device": (node.fabric.twin.rdma_device or "") if node.fabric.twin else "",
        head + "fabric.address": str(desired.api_node.fabric.address.ip),
    }


def _layout_and_launcher_inputs(desired: Desired, node: Node) -> dict[str, str]:
    """`launch_inputs`' fields only some launches read: the cache's model id and revision, the launcher's
    rendezvous port, what a Ray head keeps local, the SSH user a compile cache in the home directory names."""
    s, model, span = desired.serving, desired.model, desired.serving_nodes
    out: dict[str, str] = {}
    if model.layout == "hf-cache":  # plain serves the mounted directory: neither is rendered
        out |= {"model.id": model.id, "model.revision": model.revision}
    if s.launcher == "native" and len(span) > 1:
        out["serving.master_port"] = str(s.master_port)
    if s.launcher == "ray":
        out["serving.ray_port"] = str(s.ray_port)
        if node.name == desired.api_node.name:  # its keep_local names what the other ranks set and it does not
            own = _container_env(desired, node)
            out["ray.env_of_other_ranks"] = ",".join(sorted({k for n in span for k in _container_env(desired, n)}
                                                            - set(own)))
    if s.compile_cache == "home":
        out[f"nodes.{node.name}.ssh.user"] = node.ssh.user
    return out


def _yaml(flag: bool) -> str:
    return "true" if flag else "false"


def secret_fingerprint(name: str, value: str) -> str:
    """What a launch label says of a secret: the first 12 hex of a sha256 of its name and value. It tells a
    rotated value from the same one and nothing more; whoever can read the label (`docker inspect` on the
    node) can read the value itself in the container's environment."""
    return hashlib.sha256(f"{name}\0{value}".encode()).hexdigest()[:12]


def _short(value: str) -> str:
    """`value` as a label holds it: printable (core/text.py), and at most MAX_LAUNCH_VALUE characters, a longer
    one cut and ended with a hash of the whole, so a change past the cut still shows."""
    shown = printable(value)
    if len(shown) <= MAX_LAUNCH_VALUE:
        return shown
    return shown[:MAX_LAUNCH_VALUE - 15] + "…#" + hashlib.sha256(value.encode()).hexdigest()[:12]


def launch_label(inputs: dict[str, str]) -> str | None:
    """`LABEL_LAUNCH`'s value: compact ASCII JSON. None (no label) when it would pass MAX_LAUNCH_LABEL (hundreds of
    serving.env entries): the next plan of such a container names its hashes only."""
    text = json.dumps(inputs, sort_keys=True, separators=(",", ":"))
    return text if len(text) <= MAX_LAUNCH_LABEL else None


def _listens(desired: Desired, rank: int, nodes: int) -> tuple[tuple[str, int], ...]:
    """The fixed ports rank `rank` listens on. Only rank 0 has any: the API (`--port`), and the rendezvous the
    workers dial, torch's TCPStore on `--master-port` (native, more than one node) or Ray's GCS (`ray start
    --head --port`). Workers listen only on ports the kernel picks."""
    s = desired.serving
    if rank > 0:
        return ()
    if s.launcher == "ray":
        return (("serving.port", s.port), ("serving.ray_port", s.ray_port))
    return (("serving.port", s.port), *((("serving.master_port", s.master_port),) if nodes > 1 else ()))


def _keep_local(specs: list[LaunchSpec]) -> tuple[str, ...]:
    """Every name we set in a serving container. vLLM's Ray executor copies the driver's (the head's) `VLLM_*`,
    `NCCL_*`, `UCX_*`, `HF_*`, `HUGGING_FACE_*` and `LMCACHE_*` to every Ray worker (vllm PR #34383), so with
    asymmetric cabling a worker got the head's NCCL_IB_HCA and interface (sparkrun #135). Each container already
    has its own node's values; none needs the head's."""
    return tuple(sorted({name for spec in specs for name in spec.env}))
