"""The testbed's API: ``up``, ``down``, ``status``, ``exec``, ``reset``, ``fault``; the CLI and pytest use these.

Run as root. ``up`` writes everything a client needs into the state directory (/run/spark-testbed, or
$SPARK_TESTBED_STATE): the SSH key ``id_ed25519``, ``known_hosts`` and a ready ``testbed.yaml`` desired state.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypedDict, Unpack

from reconciler.core.spec import parse_size

from . import dockerd, faults, gpu, hub, memory, net, scenarios, sshd, storage
from .layout import MODELS, SERVED_MODEL, SSH_USER, SUDOERS, Layout, Node, layout, state_dir
from .proc import TestbedError, alive, load_pids, run, stop_pid

DEFAULT_WEIGHTS = "64M"
REQUIRED = ("ip", "nsenter", "setpriv", "unshare", "mkfs.ext4", "containerd", "dockerd", "docker", "runc",
            "ssh-keygen", "visudo", "fallocate")


class TestbedConfig(TypedDict):
    """What `up` records in the state directory's testbed.json: the shape the testbed was brought up in."""

    nodes: int
    weights_size: int
    head_disk: int
    worker_disk: int
    scenario: str
    made_run_sshd: bool


class SizeOptions(TypedDict, total=False):
    """The sizes `up` takes (a number of bytes or "64M"), for the wrappers that pass them through."""

    weights_size: str | int
    worker_disk: str | int | None
    node_memory: str | int


class UpOptions(SizeOptions, total=False):
    """All the keyword arguments of `up`."""

    nodes: int
    scenario: str


class TestbedStatus(TypedDict, total=False):
    """`status()`: whether the testbed is up; if so its scenario and each node's daemons, fabric and containers;
    if not, what a clean `down` would have removed."""

    up: bool
    leftovers: list[str]
    scenario: str
    state_dir: str
    nodes: dict[str, dict[str, object]]


#: The keyword arguments of a fault (count, interval, value, name, clear, ...); None means "the default".
FaultArg = str | int | float | bool | None


def _config_file() -> Path:
    return state_dir() / "testbed.json"


def _load_config() -> TestbedConfig | None:
    try:
        config: TestbedConfig = json.loads(_config_file().read_text())
        return config
    except (OSError, ValueError):
        return None


def current_layout() -> Layout:
    cfg = _load_config()
    return layout(cfg["nodes"] if cfg else 2)


def _preflight() -> None:
    if os.geteuid() != 0:
        raise TestbedError("the testbed needs root (network namespaces, mounts, daemons)")
    missing = [c for c in REQUIRED if shutil.which(c, path="/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:"
                                                          "/sbin:/bin") is None]
    if Path("/usr/sbin/sshd").exists() is False:
        missing.append("sshd")
    if missing:
        raise TestbedError(f"missing {', '.join(missing)}: run `bash testbed/install-deps.sh` first")


def up(nodes: int = 2, scenario: str = "seed", weights_size: str | int = DEFAULT_WEIGHTS,
       worker_disk: str | int | None = None, node_memory: str | int = memory.DEFAULT_NODE_MEMORY) -> Testbed:
    """Bring the testbed up (or, if it is already up with the same node count, just apply *scenario*)."""
    _preflight()
    lay = layout(nodes)
    wsize = parse_size(weights_size, short_units=True)
    cfg = _load_config()
    if cfg and cfg["nodes"] != nodes:
        raise TestbedError(f"a {cfg['nodes']}-node testbed is up; run `python -m testbed down` first")
    st = state_dir()
    st.mkdir(mode=0o755, parents=True, exist_ok=True)
    st.chmod(0o755)       # sshd's StrictModes checks every directory above AuthorizedKeysFile
    made_run_sshd = cfg["made_run_sshd"] if cfg else not Path("/run/sshd").exists()
    # the head holds 2 models x 2 layouts; a worker (at most) the served model in one layout
    head_disk = max(4 << 30, 5 * wsize + (512 << 20))
    wdisk = parse_size(worker_disk, short_units=True) if worker_disk else max(2 << 30, 2 * wsize + (256 << 20))
    new_cfg: TestbedConfig = {"nodes": nodes, "weights_size": wsize, "head_disk": head_disk, "worker_disk": wdisk,
                              "scenario": scenario, "made_run_sshd": made_run_sshd}
    _config_file().write_text(json.dumps(new_cfg, indent=1))
    for n in lay.nodes:
        n.state.mkdir(mode=0o755, exist_ok=True)
        gpu.install(n)               # before sshd and dockerd: both find the stand-ins on their PATH at start

    net.setup(lay)
    sshd.ensure_user()
    sshd.ensure_sudoers()
    sshd.ensure_client_key()
    sshd.ensure_node_key()
    sshd.write_netns_etc(lay)
    storage.setup_shared_root()
    for n in lay.nodes:
        storage.setup_node(n, head_disk if n.index == 0 else wdisk)
    new_view = memory.setup(lay, parse_size(node_memory, short_units=True))
    for n in lay.nodes:              # after the mounts: each sshd gets its own mount namespace
        if new_view:
            sshd.stop(n)             # its namespace holds the old view's mount (dead, when lxcfs was killed)
        sshd.start(n)
    sshd.write_known_hosts(lay)
    for n in lay.nodes:
        dockerd.start(n)
        memory.start_device_memory(n)
    scenarios.apply(lay, scenario, wsize)
    write_desired_states(lay)
    return Testbed(lay)


def reset(scenario: str = "seed") -> Testbed:
    """Back to *scenario* without a teardown: restarts stopped daemons, restores links, removes containers."""
    cfg = _load_config()
    if not cfg:
        raise TestbedError("the testbed is not up")
    lay = layout(cfg["nodes"])
    scenarios.apply(lay, scenario, cfg["weights_size"])
    write_desired_states(lay)
    cfg["scenario"] = scenario
    _config_file().write_text(json.dumps(cfg, indent=1))
    return Testbed(lay)


def down() -> list[str]:
    """Stop every process the testbed started, delete its namespaces, mounts and files. Returns leftovers
    (empty when clean)."""
    _preflight()
    cfg = _load_config()
    lay = layout(cfg["nodes"] if cfg else 2)
    for n in lay.nodes:
        sshd.stop(n)
    for n in lay.nodes:
        try:
            dockerd.stop(n, containerd=True)
        except TestbedError:
            pass
    for e in load_pids().values():               # anything else recorded
        stop_pid(e["pid"], e.get("starttime"))
    for ns in net.list_netns():                   # sessions, shims and containers left in a node's namespace
        if ns.startswith("sb-"):
            for pid in run(["ip", "netns", "pids", ns], check=False).stdout.split():
                stop_pid(int(pid), timeout=5)
    for n in lay.nodes:
        dockerd.kill_cgroup(n)
    memory.teardown(lay)
    storage.teardown()
    net.teardown(lay)
    sshd.remove_netns_etc()
    SUDOERS.unlink(missing_ok=True)     # the user stays (harmless); its root rights do not
    if cfg and cfg["made_run_sshd"] and Path("/run/sshd").is_dir() and not _sshd_running_elsewhere():
        shutil.rmtree("/run/sshd", ignore_errors=True)
    shutil.rmtree(state_dir(), ignore_errors=True)
    return leftovers()


def _sshd_running_elsewhere() -> bool:
    return subprocess.run(["pgrep", "-x", "sshd"], capture_output=True, check=False).returncode == 0


def leftovers() -> list[str]:
    """What a clean ``down`` must not leave: sb-* namespaces, live recorded pids, mounts, the root veth."""
    out = [f"netns {ns}" for ns in net.list_netns() if ns.startswith("sb-")]
    out += [f"pid {e['pid']} ({name})" for name, e in load_pids().items() if alive(e["pid"], e.get("starttime"))]
    out += [f"mount {m}" for m in storage.mounts()]
    if net.link_exists("sb-mgmt0"):
        out.append("link sb-mgmt0")
    if state_dir().exists():
        out.append(f"dir {state_dir()}")
    return out


def status() -> TestbedStatus:
    cfg = _load_config()
    if not cfg:
        return {"up": False, "leftovers": leftovers()}
    lay = layout(cfg["nodes"])
    nodes: dict[str, dict[str, object]] = {}
    for n in lay.nodes:
        info: dict[str, object] = {
            "netns": n.netns in net.list_netns(), "sshd": sshd.running(n), "dockerd": dockerd.running(n),
            "ssh": f"{SSH_USER}@{n.ssh_host}" + ("" if n.index == 0 else f" via {lay.head.ssh_host}")}
        if info["netns"]:
            try:
                fab = net.link(n.netns, "enp1s0f1np1")
                info["fabric"] = {"state": fab.get("operstate"), "mtu": fab.get("mtu"),
                                  "addr": [f"{a['local']}/{a['prefixlen']}" for a in fab.get("addr_info", [])
                                           if a.get("family") == "inet"]}
            except TestbedError:
                info["fabric"] = None
        if info["dockerd"]:
            try:
                info["containers"] = {c["Names"]: c["State"] for c in dockerd.containers(n)}
            except TestbedError as e:
                info["containers"] = str(e)
        try:
            info["model_disk_free"] = storage.free_bytes(n)
        except OSError:
            pass
        nodes[n.name] = info
    return {"up": True, "scenario": cfg["scenario"], "state_dir": str(state_dir()), "nodes": nodes}


def exec_(node: str, cmd: str | list[str], *, user: str = SSH_USER, check: bool = False, timeout: float = 120,
          input: str | None = None) -> subprocess.CompletedProcess[str]:
    """Run *cmd* on *node* as its SSH user would see it (same namespaces as the node's sshd, same
    environment), without going through SSH: works while sshd is stopped, and costs no key exchange."""
    lay = current_layout()
    n = lay.node(node)
    if isinstance(cmd, list):
        cmd = " ".join(cmd)                  # like ssh: the words are joined and run by the login shell
    env = ["env", "-i", f"HOME=/home/{user}", f"USER={user}", f"LOGNAME={user}", "SHELL=/bin/sh",
           *(f"{k}={v}" for k, v in sshd.node_env(n).items())]
    if user == "root":
        as_user = []
    else:
        as_user = ["setpriv", "--reuid", user, "--regid", user, "--init-groups", "--"]
    e = load_pids().get(f"{n.name}/sshd")
    if e and alive(e["pid"], e.get("starttime")):
        enter = ["nsenter", "-t", str(e["pid"]), "--net", "--uts", "--mount", "--"]
    else:
        enter = ["ip", "netns", "exec", n.netns]
    full = enter + as_user + env + ["/bin/sh", "-c", f"cd ~ 2>/dev/null; {cmd}"]
    p = subprocess.run(full, capture_output=True, text=True, timeout=timeout, input=input, check=False,
                       preexec_fn=lambda: memory.join(n, os.getpid()))
    if check and p.returncode != 0:
        raise TestbedError(f"{node}$ {cmd} -> exit {p.returncode}: {p.stderr.strip()[-2000:]}")
    return p


def fault(kind: str, node: str | None = None, **kwargs: FaultArg) -> str:
    if kind not in faults.FAULTS:
        raise TestbedError(f"unknown fault {kind!r}; one of: {', '.join(faults.FAULTS)}")
    lay = current_layout()
    if node is None:
        node = lay.workers[0].name
    return faults.FAULTS[kind](lay, node, **{k: v for k, v in kwargs.items() if v is not None})


# ---- desired state -------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Serving:
    """What differs between the stand-in's desired state and the real vLLM's."""

    model_id: str
    revision: str
    served_name: str
    image: str
    image_note: str
    gpu_memory_utilization: str
    health_timeout: str
    extra: tuple[str, ...] = ()


STANDIN_SERVING = Serving(SERVED_MODEL, MODELS[SERVED_MODEL], "tiny-moe", scenarios.SERVING_IMAGE,
                          "the vLLM stand-in, built locally; on the head only in seed",
                          "0.05      # the stand-in holds no GPU memory; keeps the preflight honest", "2m",
                          ('  env: {STANDIN_DEVICE_MEMORY_URL: "http://127.0.0.1:9479/", STANDIN_RUNTIME_BYTES: '
                           '"134217728"}   # free memory as GB10\'s driver says it (testbed/device_memory.py); '
                           'what a rank allocates while serving',))


def fresh_serving() -> Serving:
    """The `fresh-head` scenario's desired state: the stand-in, named as the head's registry has it
    (testbed/registry.py); no node holds it under that name, so the head has to pull it."""
    from .registry import IMAGE
    return Serving(**{**STANDIN_SERVING.__dict__, "image": IMAGE,
                      "image_note": "in the head's registry (testbed/registry.py): on no node in fresh-head"})


def write_desired_states(lay: Layout) -> None:
    """STATE/testbed.yaml (the seed story's) and STATE/testbed-fresh.yaml (`fresh-head`: the image from the head's
    registry; the model, missing on the head, from the Hub stand-in)."""
    st = state_dir()
    (st / "testbed.yaml").write_text(desired_state(lay))
    (st / "testbed-fresh.yaml").write_text(desired_state(lay, serving=fresh_serving()))


def real_serving() -> Serving:
    """The real vLLM (CPU build) serving the tiny Llama: eager mode (no torch.compile: ~50 s less per start on
    2 cores; the compile cache is measured in bench/), gpu_memory_utilization sized for vLLM's CPU backend, which
    asks gmu x MemTotal for weights + KV cache."""
    from .realvllm import image
    return Serving(image.MODEL_ID, image.MODEL_REVISION, image.SERVED_NAME, image.IMAGE,
                   "the real vLLM, CPU build (testbed/realvllm); on the head only until the reconciler copies it",
                   "0.1       # vLLM CPU: gmu x MemTotal for weights + KV cache", "5m",
                   ('  extra_args: ["--enforce-eager", "--max-num-seqs", "4"]',))


def desired_state(lay: Layout, state: Path | None = None, serving: Serving = STANDIN_SERVING) -> str:
    """The desired state for this testbed, in the core's spec shape (desired-state/testbed.yaml is n=2)."""
    st = state or state_dir()
    kh, key = st / "known_hosts", st / "id_ed25519"
    out = ["# Desired state of the local simulated cluster (python -m testbed up): the seed story's target.",
           "# Generated by testbed.api.desired_state(); addresses and paths are the testbed contract",
           "# (docs/testbed.md). Model paths are per node because all nodes share one root filesystem.",
           "nodes:"]
    for n in lay.nodes:
        out += [f"  - name: {n.name}",
                f"    role: {n.role}",
                "    ssh:",
                f"      host: {n.ssh_host}"
                + ("" if n.index == 0 else "            # reachable only from the head, as the seed's worker"),
                f"      user: {SSH_USER}"]
        if n.index:
            out.append(f"      jump: {lay.head.name}")
        out += [f"      known_hosts: {kh}",
                f"      identity_file: {key}",
                "    fabric:                        # a veth pair stands in for the RoCE cable",
                "      interface: enp1s0f1np1       # rdma_device omitted: a veth has no /sys/class/infiniband",
                f"      address: {n.fabric_addr}",
                "      mtu: 9000",
                "      twin:                        # the same QSFP port's other half, its own subnet",
                "        interface: enP2p1s0f1np1",
                f"        address: {n.twin_addr}",
                "    internet: " + ("true             # declared only: no testbed node reaches outside the testbed"
                                    if n.index == 0 else "false            # no route anywhere: weights come "
                                                         "from the head"),
                "    gpus: 1"]
    out += ["",
            "model:                             # generated on the head in both layouts; workers start without it",
            f"  id: {serving.model_id}",
            f'  revision: "{serving.revision}"',
            "  layout: hf-cache",
            f"  source: {lay.head.name}",
            "  path:"]
    out += [f"    {n.name}: {n.model_root}/hub" for n in lay.nodes]
    out += ["",
            "serving:",
            f'  image: "{serving.image}"   # {serving.image_note}',
            "  launcher: native",
            "  container_name: vllm_serving",
            f"  tensor_parallel_size: {len(lay.nodes)}",
            "  pipeline_parallel_size: 1",
            "  port: 8000",
            "  host: 0.0.0.0                   # Prometheus scrapes vLLM from outside the head, like a monitoring host",
            "  master_port: 29501",
            f"  gpu_memory_utilization: {serving.gpu_memory_utilization}",
            "  max_model_len: 4096",
            f"  served_model_name: {serving.served_name}",
            f"  health_timeout: {serving.health_timeout}",
            *serving.extra,
            "  docker:",
            "    gpus: all                       # the nvidia device driver, through the testbed's hook stand-in",
            "    privileged: false",
            "    ipc: host",
            "    shm_size: 1g",
            "    ulimits: {nofile: \"16384:16384\", memlock: null}   # this sandbox caps nofile, refuses memlock=-1",
            "",
            "co_tenants:",
            "  allowed:                          # the seed's vllm_node (GLM on :8000) is not allowed"]
    out += [f"    {n.name}: [vllm_embeddings{', reranker' if n.index == 0 else ''}]" for n in lay.nodes]
    out += ["  protected: {}",
            "  unlisted: stop",
            "",
            "policy:",
            "  mode: enforce",
            "  resync_interval: 30s",
            "  memory_margin: 1GiB",
            "  memory_overhead_per_instance: 128MiB   # the stand-in's STANDIN_RUNTIME_BYTES, beyond its pool",
            "  timeouts: {stop_grace: 5s}",
            '  listen: "127.0.0.1:9464"',
            "..."]
    return "\n".join(out) + "\n"


#: The second deployment of the seed owner's mix on the testbed: an embeddings server on the worker alone (the
#: vLLM stand-in with `--runner pooling`, the tiny MoE of the head, both copied to the internet-less worker by the
#: reconciler), on a port the seed's co-tenants (:8001, :8002) leave free.
EMBED_PORT = 8003
EMBED_NAME = "tiny-embed"


def with_embeddings(single: dict[str, Any], first: str = "moe", embed_gmu: float = 0.05) -> dict[str, Any]:
    """A desired state of the single form (as `yaml.safe_load` reads it) as the list form of two deployments: its
    own as `first`, and `embed` on the first worker alone, its rank 0 and API there: the seed owner's mix of a
    model across the nodes and a small pooling model on the worker (issue 35). What the stand-in needs of the
    device-memory stand-in is set on it."""
    data = dict(single)
    big = {"name": first, "model": data.pop("model"), "serving": data.pop("serving")}
    worker = next(n["name"] for n in data["nodes"] if n["role"] == "worker")
    model = {**big["model"], "id": SERVED_MODEL, "revision": MODELS[SERVED_MODEL]}
    serving = {**big["serving"], "image": scenarios.SERVING_IMAGE, "container_name": "vllm_embed",
               "port": EMBED_PORT, "nodes": [worker], "tensor_parallel_size": 1, "gpu_memory_utilization": embed_gmu,
               "served_model_name": EMBED_NAME, "health_timeout": "2m", "extra_args": ["--runner", "pooling"],
               "env": {"STANDIN_DEVICE_MEMORY_URL": "http://127.0.0.1:9479/", "STANDIN_RUNTIME_BYTES": "134217728"}}
    return {"nodes": data.pop("nodes"), "deployments": [big, {"name": "embed", "model": model, "serving": serving}],
            **data}


def real_vllm() -> Path:
    """Make the current scenario serve with the real vLLM: its image on the head (built once, cached), the tiny
    model as an HF cache on the head, neither on the workers (the reconciler copies both, as on real Sparks).
    Returns the desired-state file for it (STATE/testbed-real.yaml). A later `reset` puts the stand-in back."""
    from . import weights
    from .realvllm import image
    lay = current_layout()
    image.build(lay.head.docker_host)
    files = image.ensure_model()
    snapshot = weights.install_snapshot(lay.head.model_root, image.MODEL_ID, image.MODEL_REVISION, files)
    hub.publish(image.MODEL_ID, image.MODEL_REVISION, files)     # and on the head's Hub stand-in
    uid, gid = scenarios.spark_ids()
    for dirpath, dirnames, filenames in os.walk(snapshot.parent.parent):
        for name in [*dirnames, *filenames]:
            os.lchown(os.path.join(dirpath, name), uid, gid)
    for n in lay.workers:
        dockerd.docker(n, "rmi", "-f", image.IMAGE, check=False)
        dockerd.docker(n, "image", "prune", "-f", check=False)
    out = state_dir() / "testbed-real.yaml"
    out.write_text(desired_state(lay, serving=real_serving()))
    return out


#: Models beside the tiny Llama on the head: a second one that serves (a model change) and one whose start fails.
SECOND_MODEL_ID, SECOND_MODEL_REVISION = "testorg/tiny-llama-b", "5" * 40
BROKEN_MODEL_ID, BROKEN_MODEL_REVISION = "testorg/tiny-broken", "4" * 40


def extra_model(model_id: str, revision: str, architecture: str | None = None) -> tuple[str, str]:
    """Install on the head (the weights source), beside the tiny Llama, its files under another model id, so that
    a change of `model` copies and starts a model of its own. `architecture`: written into config.json instead of
    the Llama's; one vLLM's model registry does not know is refused at start ("Model architectures [...] are not
    supported for now", vllm/model_executor/models/registry.py), after the weights were copied and the old
    generation stopped: the failed change a rollback is for. Returns (model id, revision)."""
    import json as _json

    from . import weights
    from .realvllm import image
    files = dict(image.ensure_model())
    if architecture is not None:
        config = _json.loads(files["config.json"])
        config["architectures"] = [architecture]
        files["config.json"] = _json.dumps(config).encode()
    snapshot = weights.install_snapshot(current_layout().head.model_root, model_id, revision, files)
    uid, gid = scenarios.spark_ids()
    for dirpath, dirnames, filenames in os.walk(snapshot.parent.parent):
        for name in [*dirnames, *filenames]:
            os.lchown(os.path.join(dirpath, name), uid, gid)
    return model_id, revision


def broken_model() -> tuple[str, str]:
    return extra_model(BROKEN_MODEL_ID, BROKEN_MODEL_REVISION, "NoSuchForCausalLM")


# ---- a handle for tests and benchmarks -----------------------------------------------------------------------

@dataclass
class Testbed:
    layout: Layout

    @property
    def state(self) -> Path:
        return state_dir()

    @property
    def head(self) -> Node:
        return self.layout.head

    @property
    def workers(self) -> tuple[Node, ...]:
        return self.layout.workers

    @property
    def nodes(self) -> tuple[Node, ...]:
        return self.layout.nodes

    @property
    def known_hosts(self) -> Path:
        return sshd.known_hosts_file()

    @property
    def identity_file(self) -> Path:
        return sshd.identity_file()

    @property
    def desired_state(self) -> Path:
        return self.state / "testbed.yaml"

    @property
    def desired_state_fresh(self) -> Path:
        """The `fresh-head` scenario's desired state: the serving image from the head's registry."""
        return self.state / "testbed-fresh.yaml"

    def node(self, name: str) -> Node:
        return self.layout.node(name)

    def exec(self, node: str, cmd: str | list[str], *, user: str = SSH_USER, check: bool = False,
             timeout: float = 120, input: str | None = None) -> subprocess.CompletedProcess[str]:
        return exec_(node, cmd, user=user, check=check, timeout=timeout, input=input)

    def docker(self, node: str, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return dockerd.docker(self.node(node), *args, check=check)

    def fault(self, kind: str, node: str | None = None, **kw: FaultArg) -> str:
        return fault(kind, node, **kw)

    def reset(self, scenario: str = "seed") -> Testbed:
        return reset(scenario)

    def status(self) -> TestbedStatus:
        return status()

    def real_vllm(self) -> Path:
        return real_vllm()

    def broken_model(self) -> tuple[str, str]:
        return broken_model()

    def second_model(self) -> tuple[str, str]:
        return extra_model(SECOND_MODEL_ID, SECOND_MODEL_REVISION)

    def down(self) -> list[str]:
        return down()


def attach() -> Testbed:
    """A handle on the testbed that is already up."""
    if not _load_config():
        raise TestbedError("the testbed is not up")
    return Testbed(current_layout())


def timed_up(**kw: Unpack[UpOptions]) -> tuple[Testbed, float]:
    t = time.monotonic()
    tb = up(**kw)
    return tb, time.monotonic() - t


__all__ = [
    "Testbed",
    "TestbedError",
    "attach",
    "desired_state",
    "down",
    "exec_",
    "fault",
    "leftovers",
    "reset",
    "status",
    "timed_up",
    "up",
]
