"""`reconciler doctor`'s judgement: every node prerequisite as a named check, from facts the edge read (kubeadm's
preflight as the model). Pure: no I/O, no clock; the same facts always give the same checks.

Each check is ok, warn or fail, says what it saw (the observed values, never a secret's value) and, when it is not
ok, the exact fix: the command, the user that runs it and the node it runs on. `fail`: `reconciler apply` cannot
converge until it is fixed; `warn`: it can, or `apply` itself will do it (a pull, a download, the fabric port), or
it cannot be checked yet and the message says when it can.

The facts come from one batched read-only script per node (`reconciler.edge.doctor`), made of the probe's own
fragments where the probe already reads a fact (docker, disk, GPU stack, image, weights, the fabric ports), so
doctor and the daemon never disagree on what a node said; and from the reconciler's host (its trusted files, the
environment file systemd gives the daemon).
"""

from __future__ import annotations

import posixpath
import re
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from reconciler.core import envfile
from reconciler.core.budget import gib
from reconciler.core.drift import (
    DISK_MARGIN,
    disk_needs,
    image_holder,
    image_puller,
    same_filesystem,
    short_of,
    source_problem,
)
from reconciler.core.observed import Link, NodeObservation, Observed
from reconciler.core.spec import Desired, Node
from reconciler.core.text import printable

Status = Literal["ok", "warn", "fail"]
#: Where a local check runs and its fix is made: the machine running `reconciler` (the head, for the daemon).
HERE = "the reconciler's host"
#: The sudoers file `reconciler sudoers` means (docs/operations.md).
SUDOERS_FILE = "/etc/sudoers.d/spark-reconciler"
#: Clock skew against the head, in seconds: above WARN a node's time sync is not working (NTP keeps Sparks within
#: milliseconds, and timesyncd/chrony step only an unsynced clock); above FAIL the node's timestamps (docker's
#: StartedAt, which the health watch turns into a container's age on the head's clock; the copy ledger's times that
#: retention orders copies by; its log lines) are off by more than a reconcile cycle (policy.resync_interval, 30 s
#: by default), so the order of events across nodes is wrong where the operator reads it.
CLOCK_WARN = 1.0
CLOCK_FAIL = 30.0
RSYNC_MIN = (3, 1, 0)  # steps/rsyncd_helper.MIN_VERSION: `--dparam`, `munge symlinks`, refusing options by name

#: The Debian/Ubuntu (DGX OS) package of each binary a node needs, for the fix.
PACKAGES = {"timeout": "coreutils", "df": "coreutils", "dd": "coreutils", "sync": "coreutils", "find": "findutils",
            "curl": "curl", "ip": "iproute2", "ping": "iputils-ping", "flock": "util-linux", "awk": "mawk",
            "rsync": "rsync", "python3": "python3", "ssh": "openssh-client", "bash": "bash", "sudo": "sudo",
            "docker": "docker-ce"}


@dataclass(frozen=True)
class Fix:
    """The exact fix: `command`, run by `user` on `node` (a node's name, or HERE)."""

    command: str
    user: str
    node: str

    def __str__(self) -> str:
        return f"on {self.node}, as {self.user}: {self.command}"

    def as_dict(self) -> dict[str, str]:
        return {"command": self.command, "user": self.user, "node": self.node}


@dataclass(frozen=True)
class Check:
    name: str
    node: str
    status: Status
    message: str
    fix: Fix | None = None

    def as_dict(self) -> dict[str, object]:
        return {"name": self.name, "node": self.node, "status": self.status, "message": self.message,
                "fix": self.fix.as_dict() if self.fix else None}


# -- facts -------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class SudoAnswer:
    """`sudo -n -l ARGV` on the node: its exit status and first line."""

    argv: tuple[str, ...]
    rc: int
    said: str = ""


@dataclass(frozen=True)
class HopAnswer:
    """The fabric hop from this node to `target`: ssh's exit status and last words; `no_carrier`: not tried, this
    node's fabric port has no carrier."""

    target: str
    rc: int
    said: str = ""
    no_carrier: bool = False


@dataclass(frozen=True)
class UnitMemory:
    """One systemd unit's memory bounds as `systemctl show` says them: `loaded` (LoadState=loaded, else the unit
    does not exist here), `state` (its ActiveState as systemd prints it: `active`, `inactive`, `failed`, ...),
    MemoryHigh= and MemoryMax= in bytes (None: `infinity`, no bound)."""

    unit: str
    loaded: bool
    state: str
    high: int | None = None
    max: int | None = None

    @property
    def runs(self) -> bool:
        """Loaded and running (or starting, or reloading): the daemon the node's engine is now. A unit that is
        installed but stopped (`inactive`, `failed`, `deactivating`) is not the engine that runs."""
        return self.loaded and self.state in RUNNING


@dataclass(frozen=True)
class DaemonMemory:
    """docker.service and containerd.service (DAEMON_UNITS), and the filesystem type of /sys/fs/cgroup
    (`hierarchy`: `cgroup2fs` is the unified hierarchy, where MemoryHigh= is enforced; None: not read)."""

    units: tuple[UnitMemory, ...]
    hierarchy: str | None = None


@dataclass(frozen=True)
class HubEntry:
    """One directory or file of the source's hub that someone besides the SSH user may change: `area` `hub` (the
    hub directory itself, `.`), `tree` (the model's tree, `models--ORG--NAME` or the plain model dir) or `store`
    (the hub's shared blob store, `HUB/blobs`), `path` relative to it; or `above`, a directory above the hub (its
    real path), `path` absolute. `uid` its owner, `mode` its permission bits."""

    area: Literal["above", "hub", "tree", "store"]
    path: str
    uid: int
    mode: int


@dataclass(frozen=True)
class HubFacts:
    """Who may change the hub the weights are copied from (issue 53: whoever can write it, or the blob store, can
    swap the tree, the hub or the store for a link before the copy lists it). `exists` False: no hub yet (`apply`
    makes it).
    `uid` the SSH user's; `above` every directory above the hub's real path; `loose` the hub's, tree's and store's
    entries not the SSH user's or writable by group or others (`parse_hub` keeps the first HUB_SHOWN per area;
    `counts`: area -> (such entries, of them not the SSH user's)); `tree`, `store`: each is there."""

    exists: bool
    uid: int | None = None
    above: tuple[HubEntry, ...] = ()
    loose: tuple[HubEntry, ...] = ()
    counts: Mapping[str, tuple[int, int]] = field(default_factory=dict)
    tree: bool = False
    store: bool = False


@dataclass(frozen=True)
class NodeFacts:
    """What doctor read of one node. `error`/`error_kind`: no session (host key, login, path); `probe_error`: the
    node answered, its output did not parse. `observation` is built by the probe's own parsers (docker, disk, GPU
    stack, image, weights, fabric ports)."""

    name: str
    error: str | None = None
    error_kind: Literal["host-key", "auth", "unreachable"] | None = None
    probe_error: str | None = None
    observation: NodeObservation | None = None
    clock_offset: float | None = None  # the node's clock minus the reconciler's when the script was sent, seconds
    binaries: Mapping[str, str | None] = field(default_factory=dict)  # name -> path found on the PATH, or None
    rsync_version: str | None = None
    rsync_munged: bool = False  # /rsyncd-munged exists (the helper then refuses to run)
    sudo: tuple[SudoAnswer, ...] = ()
    sudoers_line: str = ""
    uid: int | None = None
    groups: tuple[str, ...] | None = None
    runtimes: tuple[str, ...] | None = None  # docker info's Runtimes; None: not read
    hops: tuple[HopAnswer, ...] = ()
    default_target: str | None = None  # `systemctl get-default`; None: not read (no systemd)
    display: tuple[str, ...] | None = None  # the display servers running (Xorg, gnome-shell); None: not read
    daemon_memory: DaemonMemory | None = None  # docker's and containerd's memory bounds; None: not read (no systemd)
    hub: HubFacts | None = None  # the model source's hub: who may change it; None: not read (not the source)


@dataclass(frozen=True)
class EnvFile:
    """The environment file systemd gives the daemon (EnvironmentFile=): its owner and mode, and the names it sets
    to a non-empty value (never a value). `error`: why it could not be stat'ed or read."""

    path: str
    exists: bool = True
    uid: int | None = None
    mode: int | None = None
    names: frozenset[str] | None = None  # None: not readable by this user
    error: str | None = None


@dataclass(frozen=True)
class FileProblem:
    """A trusted local file anyone but root or the reconciler's user may change (or read, for a key)."""

    text: str
    fix: str


@dataclass(frozen=True)
class LocalFacts:
    user: str  # the reconciler's user, who runs the local fixes
    file_problems: tuple[FileProblem, ...] = ()
    env: EnvFile | None = None
    desired_path: str = "FILE"


# -- what each node needs ----------------------------------------------------------------------------------------

def needed_binaries(desired: Desired, node: Node) -> dict[str, str]:
    """The commands the probe and the steps run on `node`, each with what needs it (edge/facts/, edge/steps/):
    what doctor looks for on the node's PATH."""
    need = {"timeout": "every command runs under it", "curl": "the probe (docker API, serving API)",
            "docker": "the containers", "ip": "the fabric ports (probe, link step)",
            "ping": "the link step's MTU check", "find": "the weights listing", "df": "free disk"}
    if node.role == "head":
        need["flock"] = "the cluster's lease"
    if node.name == desired.api_node.name:  # where the API runs: the head, or a deployment's first node
        need["awk"] = "who holds the serving port"
    need["sudo"] = "the root commands of `reconciler sudoers`"  # the link step's, at least
    targets = _copy_targets(desired)
    if targets and node.name == desired.source_node:
        need["rsync"] = "the weights' copy (the sending end)"
        if desired.policy.weights.drop_behind:
            need["python3"] = "the copy's page-cache bound"
        if desired.policy.weights.transport == "ssh":
            need["ssh"] = "the weights' copy over ssh"
    if node.name in targets:
        need["rsync"] = "the weights' copy (the receiving end)"
        need["python3"] = "the fabric rsync daemon and the tree's links"
    if node.name in desired.image_sources and any(t != node.name for t in _serving(desired)):
        need |= {"bash": "the image copy (pipefail)", "dd": "the image copy's progress",
                 "ssh": "the image copy over the fabric"}
    return need


def wants_hf(desired: Desired, facts: Mapping[str, NodeFacts]) -> bool:
    """`hf` is needed on the source when it has internet and lacks the weights: `apply` downloads them there."""
    source = desired.source_node
    obs = facts[source].observation if source in facts else None
    return desired.node(source).internet and obs is not None and source_problem(desired, obs.weights) is not None


def hop_pairs(desired: Desired) -> list[tuple[str, str]]:
    """(source, target) of every node-to-node ssh hop over the fabric: the image copy from each image source to
    the other serving nodes, and the weights' copy with `policy.weights.transport: ssh`."""
    pairs = [(s, t) for s in desired.image_sources for t in _serving(desired) if t != s]
    if desired.policy.weights.transport == "ssh":
        pairs += [(desired.source_node, t) for t in _copy_targets(desired)]
    return list(dict.fromkeys(pairs))


def _serving(desired: Desired) -> list[str]:
    return [n.name for n in desired.serving_nodes]


def _copy_targets(desired: Desired) -> list[str]:
    return [n for n in _serving(desired) if n != desired.source_node]


# -- the checks --------------------------------------------------------------------------------------------------

def checks(desired: Desired, facts: Mapping[str, NodeFacts], local: LocalFacts) -> list[Check]:
    """Every check, node by node in file order, then the reconciler's host."""
    out: list[Check] = []
    observed = Observed(nodes={n.name: _observation(facts.get(n.name), n.name) for n in desired.nodes})
    for node in desired.nodes:
        f = facts.get(node.name) or NodeFacts(node.name, error="not read", error_kind="unreachable")
        out.append(ssh_check(desired, node, f, local))
        if f.error is not None:
            continue
        if f.probe_error is not None or f.observation is None:
            out.append(Check("probe", node.name, "fail", printable(f"the node's answer did not parse: "
                                                                   f"{f.probe_error or 'no output'}")))
            continue
        out += _node_checks(desired, node, f, facts, observed, local)
    out.append(image_check(desired, observed))
    out += [files_check(local), secrets_check(desired, local)]
    return out


def _node_checks(desired: Desired, node: Node, f: NodeFacts, facts: Mapping[str, NodeFacts], observed: Observed,
                 local: LocalFacts) -> list[Check]:
    out = [clock_check(desired, node, f, facts.get(desired.head.name)), sudo_check(node, f),
           docker_check(node, f), binaries_check(desired, node, f)]
    if node.name in _copy_targets(desired):
        out.append(rsync_check(node, f))
    if node.name == desired.source_node and wants_hf(desired, facts):
        out.append(hf_check(desired, node, f))
    if desired.serving.docker.gpus is not None and node.name in _serving(desired):
        out.append(gpu_check(node, f))
    if node.name == desired.source_node:
        out.append(weights_check(desired, node, f, local))
        out.append(hub_check(desired, node, f))
    if node.name in _serving(desired):
        out.append(disk_check(desired, node, observed))
        out.append(desktop_check(node, f))
    out.append(daemon_memory_check(desired, node, f))
    out += [hop_check(desired, source, target, facts)
            for source, target in hop_pairs(desired) if source == node.name]
    return [c for c in out if c is not None]


def _observation(f: NodeFacts | None, name: str) -> NodeObservation:
    if f is None or f.observation is None or f.error is not None:
        return NodeObservation(name=name, reachable=False, error=(f.error if f else None) or "not read")
    return f.observation


def ssh_check(desired: Desired, node: Node, f: NodeFacts, local: LocalFacts) -> Check:
    ssh = node.ssh
    where = f"{ssh.user}@{ssh.host}:{ssh.port}" + (f" via {ssh.jump}" if ssh.jump else "")
    if f.error is None:
        return Check("ssh", node.name, "ok", f"{where}: host key verified against {ssh.known_hosts}, logged in")
    message = printable(f"{where}: {f.error}")
    if f.error_kind == "host-key":
        scan_on = ssh.jump or HERE
        return Check("ssh", node.name, "fail", message, Fix(
            f"ssh-keyscan -p {ssh.port} {ssh.host} | ssh-keygen -lf -  # compare with `ssh-keygen -lf "
            f"/etc/ssh/ssh_host_ed25519_key.pub` on {node.name}'s console; only if it matches: ssh-keyscan -p "
            f"{ssh.port} -t ed25519 {ssh.host} >> {ssh.known_hosts}"
            + (f" (run where {ssh.host} is reachable; the file lives on {HERE})" if ssh.jump else ""),
            local.user if scan_on == HERE else ssh.user, scan_on))
    if f.error_kind == "auth":
        key = f"{ssh.identity_file}.pub" if ssh.identity_file else "~/.ssh/id_ed25519.pub"
        jump = desired.node(ssh.jump).ssh if ssh.jump else None
        hop = f"-o ProxyJump={jump.user}@{jump.host}:{jump.port} " if jump else ""
        return Check("ssh", node.name, "fail", message,
                     Fix(f"ssh-copy-id -i {key} {hop}-p {ssh.port} {ssh.user}@{ssh.host}", local.user, HERE))
    return Check("ssh", node.name, "fail", message,
                 Fix("systemctl status ssh  # is the node up and sshd running? then its address and the path "
                     f"({'through ' + ssh.jump if ssh.jump else 'from ' + HERE})", "root", node.name))


def clock_check(desired: Desired, node: Node, f: NodeFacts, head: NodeFacts | None) -> Check | None:
    """The node's clock against the head's, both read in the same probe (the reconciler's own clock cancels out)."""
    if node.role == "head":
        return None
    if head is None or head.clock_offset is None or head.error is not None:
        return Check("clock", node.name, "warn", "the head's clock was not read: skew not measured")
    if f.clock_offset is None:
        return Check("clock", node.name, "warn", "`date +%s.%N` gave no time: skew not measured",
                     Fix("date +%s.%N", node.ssh.user, node.name))
    skew = f.clock_offset - head.clock_offset
    said = f"{abs(skew):.1f} s {'ahead of' if skew > 0 else 'behind'} {desired.head.name}"
    if abs(skew) <= CLOCK_WARN:
        return Check("clock", node.name, "ok", f"{said} (within {CLOCK_WARN:g} s)")
    fix = Fix("timedatectl set-ntp true && timedatectl timesync-status  # or chronyc makestep with chrony",
              "root", node.name)
    if abs(skew) <= CLOCK_FAIL:
        return Check("clock", node.name, "warn", f"{said}: time sync is not keeping it (over {CLOCK_WARN:g} s)", fix)
    return Check("clock", node.name, "fail", f"{said}: over {CLOCK_FAIL:g} s, its timestamps (container ages, "
                 "the copy ledger, logs) are off by more than a reconcile cycle", fix)


def sudo_check(node: Node, f: NodeFacts) -> Check | None:
    if not f.sudo:
        return None
    refused = [a for a in f.sudo if a.rc != 0]
    if not refused:
        return Check("sudo", node.name, "ok", f"`sudo -n` allows all {len(f.sudo)} commands of `reconciler "
                                              "sudoers` without a password")
    first = refused[0]
    said = f" (sudo: {first.said})" if first.said else ""
    return Check("sudo", node.name, "fail", printable(
        f"`sudo -n` refuses {len(refused)} of {len(f.sudo)} commands, first `{' '.join(first.argv)}` "
        f"(exit {first.rc}){said}"),
        Fix(f"echo {shlex.quote(f.sudoers_line)} | EDITOR='tee' visudo -f {SUDOERS_FILE}", "root", node.name))


def docker_check(node: Node, f: NodeFacts) -> Check:
    obs = f.observation
    assert obs is not None
    user = node.ssh.user
    member = f.uid == 0 or (f.groups is not None and "docker" in f.groups)
    if obs.docker_reachable:
        note = "" if member else f" ({user} is not in the docker group, yet the socket answers)"
        return Check("docker", node.name, "ok", f"the engine answers on its socket{note}")
    error = printable((obs.docker_error or "no answer")[-300:])
    if not member:
        return Check("docker", node.name, "fail", f"{user} is not in the docker group "
                     f"(groups: {' '.join(f.groups or ()) or 'unknown'}); docker: {error}",
                     Fix(f"usermod -aG docker {user}  # then restart the reconciler: a session keeps the groups "
                         "it logged in with", "root", node.name))
    return Check("docker", node.name, "fail", f"the engine does not answer: {error}",
                 Fix("systemctl start docker && systemctl status docker", "root", node.name))


def binaries_check(desired: Desired, node: Node, f: NodeFacts) -> Check:
    need = needed_binaries(desired, node)
    missing = [b for b in need if f.binaries.get(b) is None]
    if not missing:
        return Check("binaries", node.name, "ok", f"on the PATH: {', '.join(need)}")
    what = "; ".join(f"{b} ({need[b]})" for b in missing)
    packages = " ".join(dict.fromkeys(PACKAGES.get(b, b) for b in missing))
    return Check("binaries", node.name, "fail", f"not on {node.ssh.user}'s PATH over ssh: {what}",
                 Fix(f"apt-get install -y {packages}", "root", node.name))


def rsync_check(node: Node, f: NodeFacts) -> Check | None:
    """The receiving end's rsync can be confined (steps/rsyncd_helper.py: >= 3.1.0, no /rsyncd-munged)."""
    if f.binaries.get("rsync") is None:
        return None  # binaries says so
    version = _version(f.rsync_version or "")
    fix = Fix("apt-get install -y rsync  # 3.1.0 or newer", "root", node.name)
    if version is None:
        return Check("rsync", node.name, "fail", printable(f"`rsync --version` said {f.rsync_version!r}"), fix)
    shown = ".".join(map(str, version))
    if version < RSYNC_MIN:
        return Check("rsync", node.name, "fail", f"rsync {shown} is older than 3.1.0: the fabric rsync daemon "
                     "cannot be confined", fix)
    if f.rsync_munged:
        return Check("rsync", node.name, "fail", f"rsync {shown}, but /rsyncd-munged exists: munged links could "
                     "be followed there, so the copy refuses to run", Fix("rm -rf /rsyncd-munged", "root", node.name))
    return Check("rsync", node.name, "ok", f"rsync {shown} (>= 3.1.0)")


def _version(line: str) -> tuple[int, ...] | None:
    found = re.search(r"version\s+v?(\d+)\.(\d+)(?:\.(\d+))?", line)
    return tuple(int(p) for p in found.groups() if p is not None) if found else None


def hf_check(desired: Desired, node: Node, f: NodeFacts) -> Check:
    if f.binaries.get("hf") is not None:
        return Check("hf", node.name, "ok", f"`hf` at {f.binaries['hf']}: the download step can run")
    return Check("hf", node.name, "fail", f"no `hf` on {node.ssh.user}'s PATH over ssh or in ~/.local/bin: `apply` "
                 "downloads "
                 f"{desired.model.id} there with `hf download`",
                 Fix("pipx install huggingface_hub  # or: python3 -m pip install --user huggingface_hub (either puts "
                     "`hf` in ~/.local/bin, where the download step looks too)", node.ssh.user, node.name))


def gpu_check(node: Node, f: NodeFacts) -> Check:
    obs = f.observation
    assert obs is not None
    stack = obs.gpu_stack
    reboot = Fix("systemctl reboot  # once the running generation can be spared", "root", node.name)
    if stack is None:
        return Check("gpu", node.name, "warn", "the GPU stack was not read")
    if stack.error is not None:
        # nvidia-smi missing: the driver's user space is gone. On DGX OS it comes back through the OS's own update
        # (signed modules); a driver package installed by hand builds DKMS modules that Secure Boot refuses until a
        # MOK is enrolled at the console, which a remote owner cannot do (issue 52).
        fix = (Fix("apt-get update && apt-get full-upgrade  # DGX OS's own update restores the driver, signed; "
                   "not a hand-installed nvidia-driver package (Secure Boot would need a MOK enrolled at the "
                   "console)", "root", node.name)
               if stack.status == 127 else reboot)
        return Check("gpu", node.name, "fail", printable(f"nvidia-smi exited {stack.status}: {stack.error}"), fix)
    if not stack.hook:
        return Check("gpu", node.name, "fail", "no nvidia-container-runtime-hook on the PATH: every `docker run "
                     "--gpus` fails", Fix("apt-get install -y nvidia-container-toolkit && systemctl restart docker",
                                          "root", node.name))
    seen = f"{stack.gpu}, driver {stack.driver}, container hook on the PATH"
    if f.runtimes is not None and "nvidia" not in f.runtimes:
        return Check("gpu", node.name, "warn", f"{seen}; docker has no `nvidia` runtime registered (runtimes: "
                     f"{', '.join(f.runtimes) or 'none'}): `--gpus` works through the hook, but the toolkit was not "
                     "configured for docker as DGX OS does",
                     Fix("nvidia-ctk runtime configure --runtime=docker && systemctl restart docker", "root",
                         node.name))
    return Check("gpu", node.name, "ok", seen + ("; docker's `nvidia` runtime registered" if f.runtimes else ""))


def weights_check(desired: Desired, node: Node, f: NodeFacts, local: LocalFacts) -> Check:
    obs = f.observation
    assert obs is not None
    model = desired.model
    problem = source_problem(desired, obs.weights)
    if problem is None:
        assert obs.weights is not None
        return Check("weights", node.name, "ok", f"{model.id}: {len(obs.weights.files)} files, "
                     f"{gib(obs.weights.total_bytes)} in {obs.weights.root}")
    fetch = f"hf download {model.id} --revision {model.revision}"
    if node.internet:
        return Check("weights", node.name, "warn", f"{model.id}: {problem}: `reconciler apply` downloads them "
                     f"there first ({fetch})", Fix(f"reconciler apply {local.desired_path}", local.user, HERE))
    cache = f" --cache-dir {model.path_on(node.name)}" if model.layout == "hf-cache" else \
        f" --local-dir {model.path_on(node.name)}"
    return Check("weights", node.name, "fail", f"{model.id}: {problem}, and {node.name} has no internet in the "
                 "file: put them there", Fix(f"{fetch}{cache}  # where the Hub is reachable, then copy the tree to "
                                             f"{model.path_on(node.name)}", node.ssh.user, node.name))


#: The areas of the source's hub `hub_check` judges, as its message names them.
_AREAS = {"hub": "the hub", "tree": "the model's tree", "store": "the hub's shared blob store"}


def _above_problem(entry: HubEntry, uid: int) -> str | None:
    """Why a directory above the hub lets someone else replace it (the rule `trusted_files` applies locally, as
    sshd's StrictModes): owned by another than root or the SSH user, or writable by group or others without
    being a root-owned sticky directory (/tmp)."""
    if entry.uid not in (0, uid):
        return f"{entry.path} above it is uid {entry.uid}'s"
    if entry.mode & 0o022 and not (entry.mode & 0o1000 and entry.uid == 0):
        return f"{entry.path} above it is mode {entry.mode:04o}"
    return None


def hub_check(desired: Desired, node: Node, f: NodeFacts) -> Check | None:
    """The source's hub (the model path, the model's tree, the hub's shared blob store `HUB/blobs`) and every
    directory above it changeable by the SSH user alone: owned by it, no group or other write (issue 53). Whoever
    else can write there (a co-tenant container that mounts the cache read-write, a group-writable shared cache)
    can swap the tree, the hub or the store for a link before the copy lists it, which the listing then takes for
    the model (finding A: a swap after the listing sends nothing and fails the copy). A warn: the copy still runs,
    and checks every link and re-checks each directory and file it reads. None when the hub was not read (not the
    source)."""
    hub, user = f.hub, node.ssh.user
    if hub is None:
        return None
    path = desired.model.path_on(node.name)
    if not hub.exists:
        return Check("hub", node.name, "warn", f"{path} is not there yet: who may change it is checked once "
                     "`reconciler apply` has made it")
    if hub.uid is None:
        return Check("hub", node.name, "warn", f"{path}: {user} cannot enter it, so who may change it was not "
                     f"judged (the `weights` check says what {user} can read)")
    said = [why for e in hub.above if (why := _above_problem(e, hub.uid)) is not None]
    said += [why for area, words in _AREAS.items() if (why := _loose_area(hub, area, words, user)) is not None]
    parts = [p for p in ("the hub", "the model's tree" if hub.tree else "",
                         "its shared blob store" if hub.store else "") if p]
    if not said:
        return Check("hub", node.name, "ok", f"{path}: {', '.join(parts)} and every directory above: {user}'s "
                     "alone to change (no other owner, no group or other write)")
    return Check("hub", node.name, "warn", printable(
        f"{path}: {'; '.join(said)}: whoever else can write there can swap a file of the model for a link to "
        f"{user}'s key before the copy lists it"), _hub_fix(desired, node, hub))


def _loose_area(hub: HubFacts, area: str, words: str, user: str) -> str | None:
    """What in one area of the hub (`_AREAS`) someone besides `user` may change: how many entries, not `user`'s
    or writable by group or others, and the first of them; None when nothing there is."""
    total, foreign = hub.counts.get(area, (0, 0))
    if not total:
        return None
    first = next((e for e in hub.loose if e.area == area), None)
    seen = "" if first is None else \
        f"{'uid ' + str(first.uid) + ', ' if first.uid != hub.uid else ''}mode {first.mode:04o}"
    if area == "hub":
        what = f"not {user}'s" if foreign else "writable by group or others"
        return f"the hub itself is {what}" + (f" ({seen})" if seen else "")
    kinds = [f"{foreign} not {user}'s" if foreign else "",
             f"{total - foreign} writable by group or others" if total > foreign else ""]
    return (f"{total} entr{'y' if total == 1 else 'ies'} of {words} ({', '.join(k for k in kinds if k)}"
            + (f"; first {first.path}: {seen})" if first is not None else ")"))


def _hub_fix(desired: Desired, node: Node, hub: HubFacts) -> Fix:
    """The exact commands: `chown` (root) where an entry is not the SSH user's, `chmod go-w` where group or others
    may write, the hub itself alone, the tree and the store recursively; a directory above the hub made
    `go-w` (root). One above it owned by someone else is not chowned away from its owner: the model is moved."""
    user, path = node.ssh.user, desired.model.path_on(node.name)
    where = {"hub": path, "tree": desired.weights_root(node.name),
             "store": posixpath.join(path, "blobs")}
    recursive = {"hub": "", "tree": "-R ", "store": "-R "}
    commands: list[str] = []
    root = False
    for area in ("hub", "tree", "store"):
        total, foreign = hub.counts.get(area, (0, 0))
        if foreign:
            commands.append(f"chown {recursive[area]}{user} {shlex.quote(where[area])}")
            root = True
        if total:
            commands.append(f"chmod {recursive[area]}go-w {shlex.quote(where[area])}")
    moved = False
    for entry in hub.above:
        if entry.uid not in (0, hub.uid):
            moved = True
        elif _above_problem(entry, hub.uid or 0) is not None:
            commands.append(f"chmod go-w {shlex.quote(entry.path)}")
            root = root or entry.uid == 0
    command = " && ".join(commands)
    if moved:
        command += (("  # and " if command else "") + f"move the model below a directory only root and {user} own, "
                    "then point model.path there")
    return Fix(command, "root" if root else user, node.name)


def image_check(desired: Desired, observed: Observed) -> Check:
    """The serving image on an image source: present, or `apply` pulls it on the first source with internet (one
    verdict, shown on the first source)."""
    image = desired.serving.image
    node = desired.node(desired.image_sources[0])
    holder = image_holder(desired, observed)
    if holder is not None:
        got = observed.node(holder).images[image]
        size = "" if got.size is None else f", {gib(got.size)}" if got.size >= 2**30 else f", {got.size >> 20} MiB"
        return Check("image", node.name, "ok", f"{image} present on {holder} ({got.id[:19]}{size})")
    puller = image_puller(desired, observed)
    if puller is not None:
        return Check("image", node.name, "warn", f"{image} is on no image source: `reconciler apply` pulls it on "
                     f"{puller} (`docker pull {image}`)")
    return Check("image", node.name, "fail", f"{image} is on no reachable image source "
                 f"({', '.join(desired.image_sources)}), none with internet in the file",
                 Fix(f"docker pull {image}  # where a registry is reachable; else `docker save` it elsewhere and "
                     "`docker load` it here", node.ssh.user, node.name))


def disk_check(desired: Desired, node: Node, observed: Observed) -> Check:
    """Room for what `apply` copies here: the weights' missing bytes and the image, summed where both go to one
    filesystem, plus the drift's margin (`drift.shortfall`: one judgement for doctor, the plan and the steps)."""
    obs = observed.node(node.name)
    free = obs.disk_free
    if not free:
        return Check("disk", node.name, "warn", "df did not answer for the model path or docker's data root")
    needs = disk_needs(desired, observed, node.name)
    short = [(where, why) for where in needs if (why := short_of(obs, where, needs)) is not None]
    if not short:
        return Check("disk", node.name, "ok", _disk_seen(obs, needs))
    where, why = short[0]
    path = desired.model.path_on(node.name) if where == "weights" else "docker's data root"
    target = desired.model.path_on(node.name) if where == "weights" else "/var/lib/docker"
    return Check("disk", node.name, "fail", f"{where} ({path}): {why}",
                 Fix(f"df -h {target}; du -xsh {target}/* | sort -h  # remove what is not needed, or let "
                     "policy.retention.prune remove older copies", "root", node.name))


#: What DGX OS boots into by default: the desktop (Xorg and gnome-shell on the GB10, in the unified memory the
#: ranks need); a serving node is better without it.
GRAPHICAL = "graphical.target"


def desktop_check(node: Node, f: NodeFacts) -> Check | None:
    """A serving node that boots into the desktop: DGX OS runs Xorg and gnome-shell on the GB10 by default, in the
    one pool of memory the ranks share, outside anything the budget reserves (issue 52). A warn: `apply` converges
    all the same, with less room than policy.memory_margin assumes. What costs memory is the desktop that runs: a
    graphical default with no display server running (a container or a headless install whose display manager
    never starts) is said, not warned. None when systemd did not say (not DGX OS)."""
    if f.default_target is None:
        return None
    if f.default_target != GRAPHICAL:
        return Check("desktop", node.name, "ok", f"boots into {f.default_target}")
    if f.display is not None and not f.display:
        return Check("desktop", node.name, "ok", "boots into graphical.target, but no display server runs now")
    running = f" ({', '.join(f.display)} running)" if f.display else ""
    return Check("desktop", node.name, "warn",
                 f"boots into graphical.target{running}: Xorg and gnome-shell hold unified memory on the GB10 the "
                 "serving ranks share, beside what policy.memory_margin keeps for the OS",
                 Fix("sudo systemctl set-default multi-user.target && sudo systemctl isolate multi-user.target "
                     "(or reboot)", node.ssh.user, node.name))


#: The units whose memory holds the page cache of `docker pull`, `docker save` and `docker load`: dockerd and
#: containerd read and write the image's bytes, not anything the reconciler runs (docs/operations.md, "Page cache
#: of image copies"); the kernel charges a page to the cgroup that first touched it, so that cache is theirs
#: (moby/moby#40006: docker.service's memory.stat holding tens of GB of cache).
DAEMON_UNITS = ("docker.service", "containerd.service")
#: The ActiveStates (systemctl show's ActiveState) of a unit whose daemon runs: `reloading` runs, `activating` is
#: starting, its processes already in the unit's cgroup; any other (`inactive`, `failed`, `deactivating`, ...) is
#: not, or no longer, the engine that runs (tests/unit/fixtures/systemctl/ holds each, recorded).
RUNNING = frozenset({"active", "reloading", "activating"})
#: The bound doctor's fix sets, as docs/operations.md always said: far above what the two daemons hold themselves
#: (their heap is some hundred MB), so MemoryHigh= only ever reclaims their page cache; a throttle above it, never
#: a kill (systemd.resource-control(5): MemoryMax= is the one that invokes the OOM killer).
DAEMON_MEMORY_HIGH = "4G"
#: `stat -fc %T /sys/fs/cgroup/` on the unified (v2) hierarchy (coreutils names the cgroup2 magic so); the legacy
#: and hybrid layouts mount a tmpfs there.
UNIFIED = "cgroup2fs"


def daemon_memory_check(desired: Desired, node: Node, f: NodeFacts) -> Check | None:
    """docker.service and containerd.service bounded (MemoryHigh= or MemoryMax=) on a node that serves or is an
    image source: on a GB10 the page cache of a pull or an image copy (`docker save | ssh … docker load`) fills
    the one pool of memory the serving ranks share, and the weights' drop-behind cannot reach it (issue 52). A warn:
    `apply` works all the same. On the legacy cgroup hierarchy MemoryHigh= is not enforced (systemd.resource-
    control(5), "Unified and Legacy Control Group Hierarchies"); MemoryMax= is (as MemoryLimit=). None when
    systemd did not answer (a node without it, a container: not DGX OS) or the node neither serves nor sources.

    Only a unit that runs is judged (UnitMemory.runs: loaded, and `active`, `reloading` or `activating`): a unit
    installed but stopped is not the engine the node uses. When neither runs (neither exists, or both are stopped)
    the engine runs some other way: a snap, rootless, or its own dockerd outside systemd, as on the testbed, whose
    host keeps the distro's docker.service stopped. That is said, status ok, not warned, as the desktop check says
    a graphical default with no display server running: a warning is for what the owner can act on, and here
    doctor cannot see where the engine's page cache is charged nor name a fix, so a warning could never be
    cleared (the owner of a snap docker still bounds it where it runs, docs/operations.md). Ok rather than no
    check, so that the output says the bounds were not judged, and why."""
    seen = f.daemon_memory
    if seen is None or (node.name not in _serving(desired) and node.name not in desired.image_sources):
        return None
    idle = {u.unit: f"{u.unit} {u.state}" if u.loaded else f"no {u.unit} here" for u in seen.units if not u.runs}
    running = [u for u in seen.units if u.runs]
    if not running:
        return _engine_elsewhere(node, seen, idle)
    legacy = seen.hierarchy is not None and seen.hierarchy != UNIFIED
    said, unbound = _unit_bounds(running, legacy)
    note = (f" ({idle['containerd.service']}: dockerd then runs its own, inside docker.service)"
            if "containerd.service" in idle else
            f" ({idle['docker.service']}: dockerd runs some other way, not judged)" if idle else "")
    if not unbound:
        return Check("docker-mem", node.name, "ok", f"{'; '.join(said)}{note}: the page cache of pulls and image "
                     "copies is reclaimed above it")
    return _unbounded(node, seen, said, unbound, legacy, note)


def _engine_elsewhere(node: Node, seen: DaemonMemory, idle: dict[str, str]) -> Check:
    """Neither unit runs: the engine runs some other way, whose page cache doctor cannot judge (said, ok)."""
    where = ("is a systemd unit here" if not any(u.loaded for u in seen.units) else
             f"runs now ({', '.join(idle.values())})")
    return Check("docker-mem", node.name, "ok", f"neither {' nor '.join(DAEMON_UNITS)} {where}: the engine "
                 "runs some other way (a snap, rootless, its own dockerd outside systemd), so the page cache of "
                 "its pulls and image copies is not judged")


def _unit_bounds(running: list[UnitMemory], legacy: bool) -> tuple[list[str], list[UnitMemory]]:
    """The running units' enforced bounds in words, and the units without one (MemoryHigh= does not count on the
    legacy hierarchy, where it is not enforced)."""
    said, unbound = [], []
    for u in running:
        limits = [f"{name} {gib(v)}" for name, v in (("MemoryHigh", u.high), ("MemoryMax", u.max))
                  if v is not None and not (legacy and name == "MemoryHigh")]
        if limits:
            said.append(f"{u.unit} {', '.join(limits)}")
        else:
            unbound.append(u)
    return said, unbound


def _unbounded(node: Node, seen: DaemonMemory, said: list[str], unbound: list[UnitMemory], legacy: bool,
               note: str) -> Check:
    """The warning for running units without an enforced bound, with the commands that bound them (and, on the
    legacy hierarchy, the one that boots the unified)."""
    names = ", ".join(u.unit for u in unbound)
    bound = " && ".join(f"sudo systemctl set-property {u.unit} MemoryHigh={DAEMON_MEMORY_HIGH}" for u in unbound
                        if u.high is None)
    if legacy:
        ignored = [f"{u.unit} MemoryHigh {gib(u.high)}" for u in unbound if u.high is not None]
        return Check("docker-mem", node.name, "warn", f"/sys/fs/cgroup is {seen.hierarchy}, not {UNIFIED}: on the "
                     "legacy cgroup hierarchy MemoryHigh= is not enforced"
                     + (f" ({', '.join(ignored)}: ignored)" if ignored else "")
                     + f", so {names} leave{'s' if len(unbound) == 1 else ''} the page cache of pulls and image "
                     "copies unbounded in the memory the serving ranks share",
                     Fix("grep -o 'systemd.unified_cgroup_hierarchy=[^ ]*' /proc/cmdline  # =0 (or none, on an "
                         "older release) boots the legacy hierarchy: put systemd.unified_cgroup_hierarchy=1 in "
                         "GRUB_CMDLINE_LINUX of /etc/default/grub instead, update-grub and reboot into the unified "
                         "one (DGX OS's default)" + (f"; then {bound}" if bound else ""),
                         "root", node.name))
    return Check("docker-mem", node.name, "warn", f"{names}: no MemoryHigh or MemoryMax, so the page cache of "
                 "`docker pull` and of image copies (`docker save | docker load`) grows unbounded in the unified "
                 "memory the serving ranks share" + (f" ({'; '.join(said)})" if said else "") + note,
                 Fix(bound, "root", node.name))


def _disk_seen(obs: NodeObservation, needs: Mapping[str, int]) -> str:
    """Free and needed room, one part per filesystem: `weights: 100.0 GiB free, 4.0 GiB needed; image: ...`, or
    `weights and image (one filesystem, /dev/nvme0n1p2): ...` where both are on one (`drift.same_filesystem`)."""
    free = obs.disk_free or {}
    parts: list[str] = []
    said: set[str] = set()
    for where in ("weights", "image"):
        if where not in free or where in said:
            continue
        rows = [w for w in ("weights", "image") if w in same_filesystem(obs, where)]
        said.update(rows)
        label = where if len(rows) == 1 else f"{' and '.join(rows)} (one filesystem, {(obs.disk_fs or {})[where]})"
        wanted = [needs[w] for w in rows if w in needs]
        parts.append(f"{label}: {gib(min(free[w] for w in rows))} free"
                     + (f", {gib(sum(wanted) + DISK_MARGIN)} needed" if wanted else ""))
    return "; ".join(parts)


def _port_state(node: Node, link: Link | None) -> str | None:
    """Why the node's first fabric port cannot carry the hop now, or None (`Link.up`, its address)."""
    if link is None or not link.exists:
        return "no such interface"
    if not link.admin_up:
        return "down"
    if str(node.fabric.address) not in link.addresses:
        return f"no address {node.fabric.address}"
    if not link.carrier:
        return "no carrier"
    return None if link.up else f"operstate {link.operstate}"


def hop_check(desired: Desired, source: str, target: str, facts: Mapping[str, NodeFacts]) -> Check | None:
    """The source's ssh user reaches the target's fabric address non-interactively with the target's verified host
    key: what the image copy (`docker save | ssh TARGET docker load`) runs."""
    answer = next((h for h in facts[source].hops if h.target == target), None)
    if answer is None:
        return None
    t = desired.node(target)
    name = f"hop/{target}"
    address = f"{t.ssh.user}@{t.fabric.address.ip}"
    if answer.rc == 0 and not answer.no_carrier:
        return Check(name, source, "ok", f"{desired.node(source).ssh.user} on {source} reaches {address} over the "
                     "fabric (BatchMode, strict host key)")
    down = _fabric_down(desired, source, target, facts)
    if answer.no_carrier or down:
        which = "; ".join(down) or f"{source}'s {desired.node(source).fabric.interface}: no carrier"
        return Check(name, source, "warn", f"cannot be checked until `reconciler apply` brings the fabric port up "
                     f"({which})")
    said = printable(answer.said.strip()[-300:] or f"ssh exited {answer.rc}")
    user = desired.node(source).ssh.user
    return Check(name, source, "fail", f"{user} on {source} cannot ssh to {address} over the fabric: {said}",
                 _hop_fix(desired, source, target, said))


def _fabric_down(desired: Desired, source: str, target: str, facts: Mapping[str, NodeFacts]) -> list[str]:
    """Why the source's or the target's first fabric port cannot carry the hop now, one line per port that
    cannot (`_port_state`)."""
    seen = {n: facts[n].observation for n in (source, target) if n in facts}
    states = [(n, _port_state(desired.node(n), obs.fabric)) for n, obs in seen.items() if obs is not None]
    return [f"{n}'s {desired.node(n).fabric.interface}: {why}" for n, why in states if why is not None]


def _hop_fix(desired: Desired, source: str, target: str, said: str) -> Fix:
    """The fix for a hop that failed, by what ssh said: the source's key not authorized on the target, another
    host on the target's fabric address, or sshd not reachable there."""
    t = desired.node(target)
    if "Permission denied" in said:
        return Fix(f"ssh-keygen -y -f ~/.ssh/id_ed25519  # (ssh-keygen -t ed25519 first if there is none) then add "
                   f"that line to ~{t.ssh.user}/.ssh/authorized_keys on {target}", desired.node(source).ssh.user,
                   source)
    if "Host key verification failed" in said:
        return Fix(f"ip -br addr | grep {t.fabric.address.ip}  # the fabric address must be {target}'s own: another "
                   "host answers there", "root", target)
    return Fix(f"ss -ltn 'sport = :{t.ssh.port}'  # sshd must listen on {t.fabric.address.ip} "
               "(ListenAddress) and no firewall drop the fabric", "root", target)


def files_check(local: LocalFacts) -> Check:
    if not local.file_problems:
        return Check("files", HERE, "ok", "the desired-state file, identity files and known_hosts: changeable only "
                                          "by root or the reconciler's user; keys readable by their owner alone")
    first = local.file_problems[0]
    more = f" (and {len(local.file_problems) - 1} more: {'; '.join(p.text for p in local.file_problems[1:])})" \
        if len(local.file_problems) > 1 else ""
    return Check("files", HERE, "fail", printable(first.text + more),
                 Fix(" && ".join(dict.fromkeys(p.fix for p in local.file_problems)), "root", HERE))


def secrets_check(desired: Desired, local: LocalFacts) -> Check:
    """The names of serving.secrets set in the environment file systemd gives the daemon: root's, readable by the
    daemon's group (mode 0640: every command reads it as that user, `--env-file`), by nobody else."""
    wanted = list(desired.serving.secrets)
    env = local.env
    if not wanted:
        return Check("secrets", HERE, "ok", "serving.secrets declares none")
    if env is None:
        return Check("secrets", HERE, "warn", "no environment file given")
    path = env.path
    install = Fix(f"install -m 0640 -o root -g {local.user} /dev/null {path}", "root", HERE)
    if not env.exists:
        return Check("secrets", HERE, "fail", f"{path} does not exist; the daemon would lack "
                     f"{', '.join(wanted)}", install)
    if env.uid is not None and env.mode is not None and (env.uid != 0 or env.mode & 0o037):
        return Check("secrets", HERE, "fail", f"{path} is owned by uid {env.uid}, mode {env.mode:04o}: it must be "
                     f"root's, mode 0640 or 0600 (it holds the secrets; {local.user}'s group may read it)",
                     Fix(f"chown root:{local.user} {path} && chmod 0640 {path}", "root", HERE))
    if env.names is None:
        return Check("secrets", HERE, "warn", f"{path} cannot be read as {local.user} "
                     f"({env.error or 'permission denied'}): the names were not checked",
                     Fix(f"reconciler doctor {local.desired_path} --env-file {path}", "root", HERE))
    missing = [n for n in wanted if n not in env.names]
    if not missing:
        return Check("secrets", HERE, "ok", f"{path} sets {', '.join(wanted)} (values not shown)")
    adds = " && ".join(f"systemd-ask-password {n}: | sed 's/^/{n}=/' >> {path}" for n in missing)
    return Check("secrets", HERE, "fail", f"{path} does not set {', '.join(missing)} (declared in serving.secrets)",
                 Fix(f"{adds}  # then systemctl reload spark-reconciler", "root", HERE))


def env_file_names(text: str) -> frozenset[str]:
    """The names an EnvironmentFile sets to a non-empty value, read as systemd reads it (core.envfile); only the
    names leave this function: the values are never kept."""
    return envfile.names(text)


# -- the report --------------------------------------------------------------------------------------------------

def exit_code(found: list[Check]) -> int:
    """0 every check ok or warn, 1 a check failed."""
    return 1 if any(c.status == "fail" for c in found) else 0


def report_text(found: list[Check]) -> str:
    width = max((len(c.node) for c in found), default=4)
    lines = []
    for c in found:
        lines.append(f"[{c.status.upper():<4}] {c.node:<{width}}  {c.name:<12} {printable(c.message)}")
        if c.fix is not None:
            lines.append(f"{'':<7} {'':<{width}}  {'':<12} fix {printable(str(c.fix))}")
    counts = {s: sum(1 for c in found if c.status == s) for s in ("ok", "warn", "fail")}
    lines.append(f"{counts['ok']} ok, {counts['warn']} warn, {counts['fail']} fail")
    return "\n".join(lines) + "\n"


def report_json(found: list[Check]) -> dict[str, object]:
    return {"checks": [c.as_dict() for c in found],
            "summary": {s: sum(1 for c in found if c.status == s) for s in ("ok", "warn", "fail")}}
