"""`reconciler doctor`: ONE batched read-only script per node, over the sessions the daemon uses, read into the
facts `core.preflight` judges; and the local facts (trusted files, the daemon's environment file).

The script is made of the probe's own fragments where the probe reads a fact already (`facts`: containers and
the docker socket, image, the fabric ports, the GPU stack, free disk; `manifest`: the weights), so doctor and the
daemon read each fact one way; doctor adds what only it asks: the node's clock (first, so the reconciler's clock
cancels out between nodes), `id`, the binaries on the PATH, rsync's version, `sudo -n -l` for each exact command
of `reconciler sudoers`, docker's runtimes, systemd's default target and the display servers, docker's and
containerd's memory bounds (`systemctl show`), and the fabric hop as the image copy runs it. Sections are sealed
(`facts.base.sealed`), every value quoted by `ssh.quote`. Each node runs under observe's deadline (`ssh.node_deadline`);
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
from typing import Literal

from reconciler.core.observed import NodeObservation
from reconciler.core.preflight import (
    DAEMON_UNITS,
    Check,
    DaemonMemory,
    EnvFile,
    FileProblem,
    HopAnswer,
    HubEntry,
    HubFacts,
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
from reconciler.edge.facts.base import ProbeError, Sealed, Section, node_output, sealed, split_sections
from reconciler.edge.facts.containers import containers_script, parse_containers
from reconciler.edge.facts.disk import disk_script, parse_disk, parse_disk_fs
from reconciler.edge.facts.gpu import gpu_script, parse_gpu_stack
from reconciler.edge.facts.images import image_script, parse_image
from reconciler.edge.facts.links import link_script, parse_links
from reconciler.edge.manifest import MAX_DEPTH, MAX_ENTRIES, manifest_script, parse_weights, weights_store
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
             *disk_script(desired.model.path_on(node.name)), manifest_script(desired.weights_root(node.name)),
             *(hub_script(desired) if node.name == desired.source_node else [])]
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


#: Entries of each area of the source's hub that the `hub` section prints (the counts are of all of them).
HUB_SHOWN = 20
_HUB_AREAS: dict[str, Literal["hub", "tree", "store"]] = {"hub": "hub", "tree": "tree", "store": "store"}


def hub_script(desired: Desired) -> list[str]:
    """The `hub` section (`parse_hub`), on the model's source: who besides the SSH user may change the hub the
    weights are copied from (issue 53). `U` the SSH user's uid; `A` the owner, mode and path of each directory
    above the hub's real path; per area (`hub`: the hub directory itself, for an hf-cache; `tree`: the model's
    tree, as deep as the manifest walks; `store`: the hub's shared blob store, two levels as the manifest lists
    it), `T` when it is there, an `E` line for each entry (links aside: a link's own mode means nothing) not the
    SSH user's or writable by group or others, the first HUB_SHOWN of them (a name with a tab or newline as `?`),
    then `N AREA COUNT FOREIGN` (all such entries, and of them the ones not the SSH user's). Each area is entered
    with `cd -P` (a linked hub is judged where it leads, as the copy reads it) and walked with `find -P` (no link
    followed). Exit 2: no hub; 3: the SSH user cannot enter it."""
    source = desired.source_node
    hub, tree = desired.model.path_on(source), desired.weights_root(source)
    store = weights_store(tree)
    tab, nl = "\t", "\n"
    loose = '! -type l \\( ! -user "$u" -o -perm /022 \\)'
    odd = f"\\( -path {quote_word('*' + tab + '*')} -o -path {quote_word('*' + nl + '*')} \\)"

    def area(name: str, path: str, depth: int) -> str:
        entry = f"E\\t{name}\\t%U\\t%m\\t"
        count = (f'{{ n=0; f=0; while IFS= read -r l; do n=$((n+1)); case $l in "E{tab}{name}{tab}$u{tab}"*) ;; '
                 f"*) f=$((f+1));; esac; [ $n -gt {HUB_SHOWN} ] || printf '%s\\n' \"$l\"; done; "
                 f"printf 'N\\t{name}\\t%s\\t%s\\n' \"$n\" \"$f\"; }}")
        return (f"(cd -P -- {quote_word(path)} 2>/dev/null || exit 0; printf 'T\\t{name}\\n'; "
                f"find . -maxdepth {depth} {loose} \\( {odd} -printf '{entry}?\\n' -o -printf '{entry}%p\\n' \\) "
                f"2>/dev/null | head -n {MAX_ENTRIES} | {count})")

    areas = [area("tree", tree, MAX_DEPTH + 1)]
    if desired.model.layout == "hf-cache":
        areas = [area("hub", hub, 0), *areas, *([area("store", store, 2)] if store is not None else [])]
    # a subshell: its `cd`, `u` and `d` stay there
    return ["sec hub",
            f"(if [ ! -e {quote_word(hub)} ]; then rc 2; elif cd -P -- {quote_word(hub)} 2>/dev/null; then "
            "u=$(id -u); printf 'U\\t%s\\n' \"$u\"; d=$(pwd -P); while [ \"$d\" != / ]; do d=$(dirname -- \"$d\"); "
            "stat --printf 'A\\t%u\\t%a\\t%n\\n' -- \"$d\"; done; "
            f"{'; '.join(areas)}; rc 0; else rc 3; fi)"]


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


def _hub_entry(rest: str, above: bool = False) -> HubEntry:
    """An `A` line's (`UID MODE PATH`) or an `E` line's (`AREA UID MODE PATH`) words as a HubEntry; a tree's and a
    store's paths without find's `./`."""
    if above:
        owner, mode, path = rest.split("\t", 2)
        return HubEntry("above", path, int(owner), int(mode, 8))
    where, owner, mode, path = rest.split("\t", 3)
    return HubEntry(_HUB_AREAS[where], path if path in (".", "?") else path.removeprefix("./"), int(owner),
                    int(mode, 8))


@node_output("hub")
def parse_hub(sec: Section | None) -> HubFacts | None:
    """The `hub` section (`hub_script`) as HubFacts; None when not read (not the source). Every line is one the
    fragment prints, else an error (the node's `probe` check then names the section)."""
    if sec is None:
        return None
    if sec.rc in (2, 3):
        return HubFacts(exists=sec.rc == 3)
    if sec.rc != 0:
        raise ValueError(f"exit {sec.rc}")
    uid: int | None = None
    above: list[HubEntry] = []
    loose: list[HubEntry] = []
    counts: dict[str, tuple[int, int]] = {}
    present: set[str] = set()
    shown: dict[str, int] = {}  # E lines read per area: a node that prints more than HUB_SHOWN keeps the first
    for line in sec.body.splitlines():
        kind, _, rest = line.partition("\t")
        if kind == "U":
            uid = int(rest)
        elif kind in ("A", "E"):
            entry = _hub_entry(rest, above=kind == "A")
            shown[entry.area] = shown.get(entry.area, 0) + 1
            if kind == "A" and shown["above"] > 2048:  # PATH_MAX / 2: more directories than a path can hold
                raise ValueError("more directories above the hub than a path holds")
            (above if kind == "A" else loose if shown[entry.area] <= HUB_SHOWN else []).append(entry)
        elif kind == "T":
            present.add(_HUB_AREAS[rest])
        elif kind == "N":
            where, total, foreign = rest.split("\t")
            counts[_HUB_AREAS[where]] = (int(total), int(foreign))
        else:
            raise ValueError(f"not a line of the hub section: {line[:80]!r}")
    if uid is None:
        raise ValueError("no uid")
    return HubFacts(True, uid, tuple(above), tuple(loose), counts, tree="tree" in present, store="store" in present)


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
        daemon_memory=parse_daemon_memory(sections.get("daemon_memory")), hub=parse_hub(sections.get("hub")))


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
