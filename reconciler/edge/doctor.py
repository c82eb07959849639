"""`reconciler doctor`: ONE batched read-only script per node, over the sessions the daemon uses, read into the
facts `core.preflight` judges; and the local facts (trusted files, the daemon's environment file).

The script is made of the probe's own fragments where the probe reads a fact already (`probes`: containers and
the docker socket, image, the fabric ports, the GPU stack, free disk; `manifest`: the weights), so doctor and the
daemon read each fact one way; doctor adds what only it asks: the node's clock (first, so the reconciler's clock
cancels out between nodes), `id`, the binaries on the PATH, rsync's version, `sudo -n -l` for each exact command
of `reconciler sudoers`, docker's runtimes, systemd's default target and the display servers, docker's and
containerd's memory bounds (`systemctl show`), and the fabric hop as the image copy runs it. Sections are sealed
(`probes.sealed`), every value quoted by `ssh.quote`. Each node runs under observe's deadline (`ssh.node_deadline`);
whatever a node prints is that node's failed check, never a crash.

Read-only, but for one transient file: the hop's known_hosts (the target's verified key under its fabric address,
as the image copy writes it), in the SSH user's own 0700 `~/.spark-reconciler`, removed after the try.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import stat
import threading
import time
from pathlib import Path

from reconciler.core.observed import NodeObservation
from reconciler.core.preflight import (
    DAEMON_UNITS,
    Check,
    DaemonMemory,
    EnvFile,
    FileProblem,
    HopAnswer,
    LocalFacts,
    NodeFacts,
    SudoAnswer,
    UnitMemory,
    checks,
    env_file_names,
    hop_pairs,
    needed_binaries,
)
from reconciler.core.spec import Desired, Node
from reconciler.edge import trusted_files
from reconciler.edge.manifest import manifest_script, parse_weights
from reconciler.edge.probes import (
    ProbeError,
    Sealed,
    Section,
    containers_script,
    disk_script,
    gpu_script,
    image_script,
    link_script,
    node_output,
    parse_containers,
    parse_disk,
    parse_disk_fs,
    parse_gpu_stack,
    parse_image,
    parse_links,
    sealed,
    split_sections,
)
from reconciler.edge.ssh import (
    AuthFailed,
    HostKeyRejected,
    OutputTooLarge,
    RemoteError,
    Sessions,
    fabric_host_keys,
    hop_address,
    hop_options,
    node_deadline,
    quote,
    quote_word,
    sudo_commands,
    sudoers_line,
)

#: The hop's known_hosts on the source while doctor tries it (ssh expands the `~`), removed right after.
HOP_KNOWN_HOSTS = "~/.spark-reconciler/doctor_known_hosts_{node}"
NO_CARRIER = 250  # the hop section's status when the source's fabric port has no carrier (ssh was not tried)


def looked_for(desired: Desired, node: Node) -> list[str]:
    """The binaries doctor looks for on `node`: what it needs, and `hf` on the model source (the download step)."""
    return [*needed_binaries(desired, node), *(["hf"] if node.name == desired.source_node else [])]


def doctor_script(desired: Desired, node: Node) -> Sealed:
    """The one script for `node`: the clock first, then the probe's fragments and doctor's own sections."""
    lines = ["sec clock", "date +%s.%N; rc $?", *containers_script(),
             "sec docker_info",
             "if out=$(curl -sf --unix-socket \"$sock\" http://docker/info 2>/dev/null); then "
             "printf '%s\\n' \"$out\"; rc 0; else docker info --format '{{json .}}' 2>&1; rc $?; fi",
             "sec id", "id -u; id -nG; rc $?",
             "sec bins",
             f"for b in {' '.join(quote_word(b) for b in looked_for(desired, node))}; do "
             "if [ \"$b\" = hf ]; then p=$(PATH=\"$PATH:$HOME/.local/bin\"; command -v hf); "  # as the download step
             "else p=$(command -v \"$b\"); fi; "
             "if [ -n \"$p\" ]; then printf 'have %s %s\\n' \"$b\" \"$p\"; "
             "else printf 'missing %s\\n' \"$b\"; fi; done; rc 0",
             "sec rsync", "rsync --version 2>&1 | head -n 1; [ ! -e /rsyncd-munged ] || echo munged; rc 0",
             "sec default_target", "systemctl get-default 2>/dev/null; rc $?",
             "sec display", f"ps -eo comm= 2>/dev/null | grep -xE {quote_word(DISPLAY_SERVERS)} | sort -u; rc 0",
             *daemon_memory_script(),
             "sec sudo", *_sudo_lines(desired, node), "rc 0",
             *image_script(desired.serving.image), *link_script(node),
             *(gpu_script() if desired.serving.docker.gpus is not None else []),
             *disk_script(desired.model.path_on(node.name)), manifest_script(desired.weights_root(node.name))]
    for source, target in hop_pairs(desired):
        if source == node.name:
            lines += _hop_lines(desired, node, target)
    return sealed(lines)


def daemon_memory_script() -> list[str]:
    """The `daemon_memory` section (`parse_daemon_memory`): /sys/fs/cgroup's filesystem type (the hierarchy that
    decides whether MemoryHigh= is enforced), then docker's and containerd's bounds as systemd keeps them, and
    whether each is loaded and runs (a unit installed but stopped is not the engine the node uses)."""
    return ["sec daemon_memory",
            "printf 'cgroup %s\\n' \"$(stat -fc %T /sys/fs/cgroup/ 2>/dev/null)\"; "
            f"systemctl show -p LoadState -p ActiveState -p MemoryHigh -p MemoryMax {' '.join(DAEMON_UNITS)} "
            "2>/dev/null; rc $?"]


def _sudo_lines(desired: Desired, node: Node) -> list[str]:
    """`sudo -n -l ARGV` per exact command: sudo answers whether it would run it, without running it."""
    return [f"out=$(sudo -n -l {quote(argv)} 2>&1 </dev/null); r=$?; "
            f"printf '%s %s %s\\n' {i} \"$r\" \"$(printf '%s' \"$out\" | head -n 1)\""
            for i, argv in enumerate(sudo_commands(desired, node))]


def _hop_lines(desired: Desired, source: Node, target: str) -> list[str]:
    """The hop to `target` as the image copy runs it (`ssh.hop_options`), with `true` for `docker load`; not tried
    while the source's fabric port has no carrier (it cannot answer; `apply` brings the port up)."""
    keys = fabric_host_keys(desired, target)
    if keys is None:
        return []  # the target's own ssh check says its host key is not known
    known = HOP_KNOWN_HOSTS.format(node=target)
    path = f"$d/{known.rsplit('/', 1)[1]}"
    seconds = int(desired.node(target).ssh.connect_timeout) + 5
    carrier = f"/sys/class/net/{source.fabric.interface}/carrier"
    ssh = quote([*hop_options(desired, target, known), hop_address(desired, target), "true"])
    return [f"sec hop-{target}",
            f"if [ \"$(cat {quote_word(carrier)} 2>/dev/null)\" != 1 ]; then rc {NO_CARRIER}; else "
            f"(d=\"$HOME/.spark-reconciler\"; umask 077; mkdir -p -- \"$d\" && "
            f"printf '%s' {quote_word(keys)} > \"{path}\" || exit 70; "
            f"out=$(timeout {seconds} {ssh} 2>&1 </dev/null); r=$?; rm -f -- \"{path}\"; "
            "printf '%s\\n' \"$out\" | tail -n 3; exit $r); rc $?; fi"]


# -- parsing -----------------------------------------------------------------------------------------------------

@node_output("clock")
def parse_clock(sec: Section | None) -> float | None:
    if sec is None or sec.rc != 0 or not sec.body.strip():
        return None
    return float(sec.body.strip().splitlines()[0])


@node_output("docker_info")
def parse_runtimes(sec: Section | None) -> tuple[str, ...] | None:
    """docker info's runtime names (None: the engine did not answer)."""
    if sec is None or sec.rc != 0 or not sec.body.strip().startswith("{"):
        return None
    runtimes = json.loads(sec.body).get("Runtimes") or {}
    if not isinstance(runtimes, dict):
        raise ValueError("Runtimes is not an object")
    return tuple(sorted(str(k) for k in runtimes))


@node_output("id")
def parse_id(sec: Section | None) -> tuple[int | None, tuple[str, ...] | None]:
    if sec is None or sec.rc != 0:
        return None, None
    lines = sec.body.splitlines()
    return int(lines[0].strip()), tuple(lines[1].split()) if len(lines) > 1 else ()


@node_output("bins")
def parse_bins(sec: Section | None, wanted: list[str]) -> dict[str, str | None]:
    found: dict[str, str | None] = dict.fromkeys(wanted)
    for line in (sec.body if sec is not None else "").splitlines():
        kind, _, rest = line.partition(" ")
        name, _, path = rest.partition(" ")
        if name not in found or kind not in ("have", "missing"):
            raise ValueError(f"not a binaries line: {line[:80]!r}")
        found[name] = (path.strip() or None) if kind == "have" else None
    return found


@node_output("sudo")
def parse_sudo(sec: Section | None, commands: list[tuple[str, ...]]) -> tuple[SudoAnswer, ...]:
    answers = {}
    for line in (sec.body if sec is not None else "").splitlines():
        index, rc, said = (line.split(" ", 2) + ["", ""])[:3]
        answers[int(index)] = SudoAnswer(commands[int(index)], int(rc), said.strip()[:200])
    return tuple(answers.get(i, SudoAnswer(argv, -1, "no answer")) for i, argv in enumerate(commands))


_TARGET = re.compile(r"[A-Za-z0-9@._-]{1,128}\.target")


def parse_default_target(sec: Section | None) -> str | None:
    """`systemctl get-default`'s unit (`graphical.target`); None when systemd did not answer with one (a node
    without systemd, a container): the desktop check is then not made."""
    line = sec.body.strip().splitlines()[0].strip() if sec is not None and sec.rc == 0 and sec.body.strip() else ""
    return line if _TARGET.fullmatch(line) else None


#: The processes of a running desktop on DGX OS (GNOME on Xorg, or Wayland's Xwayland): what holds the memory.
DISPLAY_SERVERS = "Xorg|Xwayland|gnome-shell"


def parse_display(sec: Section | None) -> tuple[str, ...] | None:
    """The display servers running (`ps` names matching DISPLAY_SERVERS); None when not read."""
    if sec is None or sec.rc != 0:
        return None
    return tuple(sorted({line.strip() for line in sec.body.splitlines()
                         if line.strip() in DISPLAY_SERVERS.split("|")}))


def _limit(value: str | None) -> int | None:
    """A memory bound as `systemctl show` prints it: bytes (a `4G` or `25%` set is shown in bytes), or `infinity`
    (None: no bound). ValueError for anything else."""
    if value == "infinity":
        return None
    if value is None or not value.isdigit():
        raise ValueError(f"not a memory bound: {value!r}")
    return int(value)


def parse_daemon_memory(sec: Section | None) -> DaemonMemory | None:
    """The `daemon_memory` section: `cgroup FSTYPE` (/sys/fs/cgroup's, `cgroup2fs` on the unified hierarchy), then
    `systemctl show -p LoadState -p ActiveState -p MemoryHigh -p MemoryMax` of DAEMON_UNITS: one `Name=value`
    block per unit in the order asked, blocks parted by one empty line (systemctl-show.c's show_one; the
    recordings in tests/unit/fixtures/systemctl/). ActiveState is kept as systemd says it (`active`, `inactive`,
    `failed`, `reloading`, ...): the check judges which of those runs. None when systemd did not answer (no
    systemd: systemctl exits 1, "System has not been booted with systemd") or said something else (a block
    without its LoadState or ActiveState, a bound not in bytes): then the check is not made, as the desktop's is not."""
    if sec is None or sec.rc != 0:
        return None
    first, _, rest = sec.body.partition("\n")
    kind, _, fstype = first.partition(" ")
    blocks = [dict(line.partition("=")[::2] for line in block.splitlines() if line.strip())
              for block in re.split(r"\n\s*\n", rest.strip())]
    if kind != "cgroup" or len(blocks) != len(DAEMON_UNITS):
        return None
    try:
        units = tuple(UnitMemory(unit, props["LoadState"] == "loaded", props["ActiveState"],
                                 _limit(props.get("MemoryHigh")), _limit(props.get("MemoryMax")))
                      for unit, props in zip(DAEMON_UNITS, blocks, strict=True))
    except (KeyError, ValueError):
        return None
    return DaemonMemory(units, fstype.strip() or None)


def parse_hops(desired: Desired, node: Node, sections: dict[str, Section]) -> tuple[HopAnswer, ...]:
    out = []
    for source, target in hop_pairs(desired):
        sec = sections.get(f"hop-{target}") if source == node.name else None
        if sec is not None:
            out.append(HopAnswer(target, sec.rc, sec.body[-500:], no_carrier=sec.rc == NO_CARRIER))
    return tuple(out)


def parse_doctor(desired: Desired, node: Node, output: str, nonce: str, sent: float) -> NodeFacts:
    """One node's answer as its facts; ProbeError (naming the section) when it does not parse."""
    sections = split_sections(output, nonce)
    docker_ok, docker_error, containers = parse_containers(sections.get("containers"))
    image = parse_image(sections.get("image"))
    fabric, twin = parse_links(node, sections)
    observation = NodeObservation(
        name=node.name, reachable=True, docker_reachable=docker_ok, docker_error=docker_error,
        containers=containers, images={desired.serving.image: image} if image else {}, fabric=fabric,
        fabric_twin=twin, disk_free=parse_disk(sections.get("disk")), disk_fs=parse_disk_fs(sections.get("disk")),
        gpu_stack=parse_gpu_stack(sections.get("gpu"), sections.get("gpu_hook"), sections.get("os")),
        weights=parse_weights(desired.weights_root(node.name), sections.get("weights")))
    clock = parse_clock(sections.get("clock"))
    uid, groups = parse_id(sections.get("id"))
    rsync = sections.get("rsync")
    rsync_lines = rsync.body.splitlines() if rsync is not None else []
    return NodeFacts(
        name=node.name, observation=observation, clock_offset=None if clock is None else clock - sent,
        binaries=parse_bins(sections.get("bins"), looked_for(desired, node)),
        rsync_version=rsync_lines[0][:200] if rsync_lines else None, rsync_munged="munged" in rsync_lines[1:],
        sudo=parse_sudo(sections.get("sudo"), sudo_commands(desired, node)),
        sudoers_line=sudoers_line(desired, node), uid=uid, groups=groups,
        runtimes=parse_runtimes(sections.get("docker_info")), hops=parse_hops(desired, node, sections),
        default_target=parse_default_target(sections.get("default_target")),
        display=parse_display(sections.get("display")),
        daemon_memory=parse_daemon_memory(sections.get("daemon_memory")))


def read_node(desired: Desired, sessions: Sessions, node: Node, timeout: float) -> NodeFacts:
    """Connect (the ssh check), then run the script; the clock's reference is taken once connected, right before
    the script is sent, so a slow login does not read as skew."""
    session = sessions[node.name]
    try:
        session.transport()
        script = doctor_script(desired, node)
        sent = time.time()
        result = session.run_script(script.script, timeout=timeout)
    except HostKeyRejected as exc:
        return NodeFacts(node.name, error=exc.message, error_kind="host-key")
    except AuthFailed as exc:
        return NodeFacts(node.name, error=exc.message, error_kind="auth")
    except OutputTooLarge as exc:
        return NodeFacts(node.name, probe_error=exc.message)
    except RemoteError as exc:
        return NodeFacts(node.name, error=exc.message, error_kind="unreachable")
    try:
        return parse_doctor(desired, node, result.stdout, script.nonce, sent)
    except ProbeError as exc:
        return NodeFacts(node.name, probe_error=f"{exc} (exit {result.exit_code}: "
                                                f"{result.stderr.strip()[-200:] or 'nothing on stderr'})")


def read_nodes(desired: Desired, sessions: Sessions, timeout: float) -> dict[str, NodeFacts]:
    """Every node in parallel, each under observe's deadline for it (`ssh.node_deadline`): a node that hangs is
    that node's failed ssh check, and the others are read all the same."""
    found: dict[str, NodeFacts] = {}

    def work(node: Node) -> None:
        found[node.name] = read_node(desired, sessions, node, timeout)

    start = time.monotonic()
    threads = {n.name: threading.Thread(target=work, args=(n,), daemon=True, name=f"doctor-{n.name}")
               for n in desired.nodes}
    for thread in threads.values():
        thread.start()
    out = {}
    for node in desired.nodes:
        seconds = node_deadline(desired, node, timeout)
        threads[node.name].join(max(start + seconds - time.monotonic(), 0.0))
        out[node.name] = found.get(node.name) or NodeFacts(
            node.name, error=f"no answer within {seconds:g}s (observe's deadline for this node)",
            error_kind="unreachable")
    return out


# -- the reconciler's host ---------------------------------------------------------------------------------------

def file_fix(problem: str) -> str:
    """The command that fixes one of `trusted_files.problems` (its message names the path first)."""
    path = shlex.quote(problem.split(": ", 1)[0])
    if "chmod 600" in problem:
        return f"chmod 600 {path}"
    if "chmod go-w" in problem:
        return f"chmod go-w {path}"
    return f"chown root:root {path}"


def env_file(path: Path) -> EnvFile:
    """The environment file's owner, mode and the names it sets (never a value)."""
    try:
        st = path.stat()
    except FileNotFoundError:
        return EnvFile(str(path), exists=False)
    except OSError as exc:
        return EnvFile(str(path), exists=True, error=exc.strerror)
    try:
        names: frozenset[str] | None = env_file_names(path.read_text(errors="replace"))
        error = None
    except OSError as exc:
        names, error = None, exc.strerror
    return EnvFile(str(path), uid=st.st_uid, mode=stat.S_IMODE(st.st_mode), names=names, error=error)


def local_facts(desired: Desired, desired_path: str, env_path: Path, user: str | None = None) -> LocalFacts:
    """The reconciler's host: its trusted files as the daemon's user sees them (`trusted_files`, what the daemon
    refuses), and the environment file systemd gives it."""
    name, uid = trusted_files.daemon_user(user)
    problems = trusted_files.problems(trusted_files.trusted_paths(desired, desired_path), uid=uid)
    return LocalFacts(user=name, file_problems=tuple(FileProblem(p, file_fix(p)) for p in problems),
                      env=env_file(env_path), desired_path=desired_path)


def doctor(desired: Desired, desired_path: str, env_path: Path, user: str | None = None) -> list[Check]:
    """Every check: the nodes over the daemon's own SSH, then this host (`user`: the daemon's, `daemon_user`). A
    file of several deployments is checked for each in turn (its image, weights, tools), a check the same for
    all of them said once."""
    local = local_facts(desired, os.path.abspath(desired_path), env_path, user)
    sessions = Sessions(desired)
    found: list[Check] = []
    try:
        for view in desired.views():
            facts = read_nodes(view, sessions, timeout=view.policy.timeouts.command)
            found += checks(view, facts, local)
    finally:
        sessions.close()
    return list(dict.fromkeys(found))
