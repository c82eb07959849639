"""`reconciler doctor` on docker's and containerd's memory bounds (issue 52, item 6): on a GB10 the page cache of
`docker pull` and of image copies (`docker save | ssh … docker load`) is charged to dockerd's and containerd's
cgroups and fills the one pool of memory the serving ranks share; the weights' drop-behind cannot reach it.
Doctor reads `systemctl show -p LoadState -p ActiveState -p MemoryHigh -p MemoryMax docker.service
containerd.service` and the cgroup hierarchy, and warns (apply works all the same) on a node that serves or sources
images where either runs unbounded, with the `systemctl set-property` fix. A unit installed but stopped is not
judged: it is not the engine the node uses (the testbed's host keeps the distro's docker.service stopped, its nodes
run dockerd outside systemd). The parser is fed the real output recorded in
tests/unit/fixtures/systemctl/ (README.md there says how), the fragment runs under the real `sh` and `stat`."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from reconciler.core import preflight
from reconciler.core.preflight import DaemonMemory, Fix, UnitMemory
from reconciler.edge import doctor as edge_doctor
from reconciler.edge.facts.base import Section, read_sections
from tests.unit.edge.test_doctor import DESIRED, HEAD, LOCAL, WORKER, WORKER_ANSWER, _answer, _facts, one, run
from tests.unit.edge.test_probe_fragments import STAND_IN, LocalNode

SYSTEMCTL = Path(__file__).parents[1] / "fixtures" / "systemctl"
G4 = 4 * 2**30
ARGV = ["show", "-p", "LoadState", "-p", "ActiveState", "-p", "MemoryHigh", "-p", "MemoryMax", "docker.service",
        "containerd.service"]
SET = "sudo systemctl set-property {} MemoryHigh=4G"


def recorded(name: str) -> tuple[str, int]:
    """A recording's output and exit status (the file's last line is `exit=N`)."""
    body, _, status = (SYSTEMCTL / name).read_text().rpartition("exit=")
    return body, int(status)


def section(name: str, hierarchy: str = "cgroup2fs") -> Section:
    """The `daemon_memory` section as the node prints it: the `cgroup` line, then the recorded `systemctl show`."""
    body, status = recorded(name)
    return Section(f"cgroup {hierarchy}\n{body}".strip("\n"), status)


def units(docker: UnitMemory | None, containerd: UnitMemory | None, hierarchy: str = "cgroup2fs") -> DaemonMemory:
    """None: the unit does not exist (as systemd shows one: LoadState=not-found, ActiveState=inactive)."""
    return DaemonMemory((docker or UnitMemory("docker.service", False, "inactive"),
                         containerd or UnitMemory("containerd.service", False, "inactive")), hierarchy)


def docker(state: str = "active", high: int | None = None, max: int | None = None) -> UnitMemory:
    return UnitMemory("docker.service", True, state, high, max)


def containerd(state: str = "active", high: int | None = None, max: int | None = None) -> UnitMemory:
    return UnitMemory("containerd.service", True, state, high, max)


def without_active_state(name: str) -> str:
    return "".join(line for line in recorded(name)[0].splitlines(keepends=True) if not line.startswith("ActiveState="))


# -- the fact, from the real output --------------------------------------------------------------------------------

@pytest.mark.parametrize(("name", "expected"), [
    ("show-unbounded.txt", units(docker(), containerd())),
    ("show-docker-bounded.txt", units(docker(high=G4), containerd())),
    ("show-bounded.txt", units(docker(high=G4), containerd(high=G4))),
    ("show-max-percent.txt", units(docker(high=G4), containerd(max=6319042560))),
    ("show-no-containerd.txt", units(docker(high=G4), None)),
    ("show-neither.txt", units(None, None)),
    ("show-stopped.txt", units(docker("inactive"), containerd("inactive"))),
    ("show-docker-stopped.txt", units(docker("inactive"), containerd(high=G4))),
    ("show-stopping.txt", units(docker("failed"), containerd("deactivating"))),
    ("show-starting.txt", units(docker("reloading"), containerd("activating"))),
])
def test_systemctl_show_as_systemd_prints_it(name, expected):
    assert edge_doctor.parse_daemon_memory(section(name)) == expected


def test_only_active_state_tells_a_running_unit_from_a_stopped_one():
    """show-stopped.txt (the testbed's host: the distro's units installed, stopped) and show-unbounded.txt differ in
    their ActiveState lines only: a parser or a check that did not read ActiveState could not tell them apart."""
    assert without_active_state("show-stopped.txt") == without_active_state("show-unbounded.txt")
    assert [u.runs for u in units(docker(), containerd()).units] == [True, True]
    assert not any(u.runs for u in edge_doctor.parse_daemon_memory(section("show-stopped.txt")).units)
    assert [u.runs for u in edge_doctor.parse_daemon_memory(section("show-starting.txt")).units] == [True, True]
    assert [u.runs for u in edge_doctor.parse_daemon_memory(section("show-stopping.txt")).units] == [False, False]
    assert not UnitMemory("docker.service", False, "active").runs, "not loaded: whatever its state, not judged"


def test_no_systemd_no_answer_and_odd_output_are_not_read():
    """Without systemd as PID 1 systemctl exits 1 (its complaint, recorded, goes to /dev/null in the script): no
    check, as for the desktop. Output systemd does not print is not guessed at."""
    body, status = recorded("not-booted.txt")
    assert status == 1 and "System has not been booted with systemd" in body
    assert edge_doctor.parse_daemon_memory(Section("cgroup tmpfs", status)) is None
    assert edge_doctor.parse_daemon_memory(None) is None
    body, _ = recorded("show-bounded.txt")
    for odd in (body.replace("4294967296", "4G", 1), body.replace("\n\n", "\n"), body.replace("LoadState", "Load"),
                without_active_state("show-bounded.txt"), "no cgroup line\n" + body):
        text = odd if odd.startswith("no cgroup") else f"cgroup cgroup2fs\n{odd}"
        assert edge_doctor.parse_daemon_memory(Section(text.strip("\n"), 0)) is None, odd
    assert edge_doctor.parse_daemon_memory(section("show-bounded.txt", "")).hierarchy is None  # stat said nothing


def _local(tmp_path: Path, answer: dict | None) -> LocalNode:
    node = LocalNode(tmp_path)
    if answer is not None:
        (node.bin / "systemctl").write_text(f"#!{sys.executable}\n{STAND_IN}")
        (node.bin / "systemctl").chmod(0o755)
        node.answer(answer)
    return node


def test_the_fragment_runs_under_sh_with_this_machines_stat(tmp_path):
    """Run for real: the node's `sh`, `stat` of this machine's /sys/fs/cgroup, and a `systemctl` stand-in that
    answers the exact argv with the recorded output."""
    body, _ = recorded("show-docker-bounded.txt")
    node = _local(tmp_path, {"tool": "systemctl", "argv": ARGV, "stdout": body})
    sec = read_sections(node, edge_doctor.daemon_memory_script(), timeout=60)["daemon_memory"]
    fstype = subprocess.run(["stat", "-fc", "%T", "/sys/fs/cgroup/"], capture_output=True, text=True,
                            check=False).stdout.strip()
    assert edge_doctor.parse_daemon_memory(sec) == units(docker(high=G4), containerd(), fstype or None)
    assert node.calls("systemctl") == [["systemctl", *ARGV]]


def test_the_fragment_on_a_node_without_systemd(tmp_path):
    """Run for real: systemctl exits 1 with systemd's own words on stderr (recorded): the section reads None."""
    body, status = recorded("not-booted.txt")
    node = _local(tmp_path, {"tool": "systemctl", "argv": ARGV, "stderr": body, "rc": status})
    sec = read_sections(node, edge_doctor.daemon_memory_script(), timeout=60)["daemon_memory"]
    assert sec.rc == 1 and "System has not been booted" not in sec.body
    assert edge_doctor.parse_daemon_memory(sec) is None


def test_doctor_reads_the_section_into_the_nodes_facts():
    assert "\n".join(edge_doctor.daemon_memory_script()) in edge_doctor.doctor_script(DESIRED, WORKER).script
    body, _ = recorded("show-unbounded.txt")
    answer = {**WORKER_ANSWER, "daemon_memory": (f"cgroup cgroup2fs\n{body.strip()}", 0)}
    facts = edge_doctor.parse_doctor(DESIRED, WORKER, _answer("n", answer), "n", sent=0.0)
    assert facts.daemon_memory == units(docker(), containerd())
    assert edge_doctor.parse_doctor(DESIRED, WORKER, _answer("n", WORKER_ANSWER), "n", sent=0.0).daemon_memory is None


# -- the check -----------------------------------------------------------------------------------------------------

def check(memory: DaemonMemory | None, node=WORKER):
    found = run(**{node.role: _facts(node, daemon_memory=memory)})
    hits = [c for c in found if c.name == "docker-mem" and c.node == node.name]
    return hits[0] if hits else None


def test_both_bounded_is_ok_and_says_the_bounds():
    c = check(edge_doctor.parse_daemon_memory(section("show-bounded.txt")))
    assert c is not None and c.status == "ok" and c.fix is None
    assert c.message == ("docker.service MemoryHigh 4.0 GiB; containerd.service MemoryHigh 4.0 GiB: the page cache "
                         "of pulls and image copies is reclaimed above it")
    c = check(edge_doctor.parse_daemon_memory(section("show-max-percent.txt")))
    assert c is not None and c.status == "ok" and "containerd.service MemoryMax 5.9 GiB" in c.message


def test_both_unbounded_warns_with_the_set_property_commands():
    c = check(edge_doctor.parse_daemon_memory(section("show-unbounded.txt")))
    assert c is not None and c.status == "warn"
    assert c.message.startswith("docker.service, containerd.service: no MemoryHigh or MemoryMax, so the page cache "
                                "of `docker pull` and of image copies")
    assert c.fix == Fix(f"{SET.format('docker.service')} && {SET.format('containerd.service')}", "root", "worker")


def test_one_unbounded_warns_with_its_own_command_only():
    c = check(edge_doctor.parse_daemon_memory(section("show-docker-bounded.txt")))
    assert c is not None and c.status == "warn"
    assert c.message.startswith("containerd.service: no MemoryHigh or MemoryMax")
    assert "(docker.service MemoryHigh 4.0 GiB)" in c.message
    assert c.fix == Fix(SET.format("containerd.service"), "root", "worker")


def test_no_containerd_unit_is_docker_alone():
    """An engine without containerd.service starts its own containerd, a child in docker.service's cgroup."""
    c = check(edge_doctor.parse_daemon_memory(section("show-no-containerd.txt")))
    assert c is not None and c.status == "ok"
    assert "docker.service MemoryHigh 4.0 GiB (no containerd.service here" in c.message


NOT_JUDGED = ("the engine runs some other way (a snap, rootless, its own dockerd outside systemd), so the page cache "
              "of its pulls and image copies is not judged")


def test_neither_unit_is_said_not_warned():
    """No unit to judge and no fix to name: said (ok), so that doctor's output tells the bounds were not judged."""
    c = check(edge_doctor.parse_daemon_memory(section("show-neither.txt")))
    assert c is not None and c.status == "ok" and c.fix is None
    assert c.message == f"neither docker.service nor containerd.service is a systemd unit here: {NOT_JUDGED}"


def test_installed_but_stopped_units_are_not_the_engine_and_give_no_warning():
    """The testbed's host (and CI's, when PID 1 is systemd): the distro's docker.service and containerd.service are
    loaded and stopped, unbounded, while each node runs its own dockerd outside systemd."""
    stopped = edge_doctor.parse_daemon_memory(section("show-stopped.txt"))
    c = check(stopped)
    assert c is not None and c.status == "ok" and c.fix is None
    assert c.message == ("neither docker.service nor containerd.service runs now (docker.service inactive, "
                         f"containerd.service inactive): {NOT_JUDGED}")
    found = run(head=_facts(HEAD, daemon_memory=stopped), worker=_facts(WORKER, daemon_memory=stopped))
    assert [c.status for c in found if c.name == "docker-mem"] == ["ok", "ok"]
    c = check(edge_doctor.parse_daemon_memory(section("show-stopping.txt")))
    assert c is not None and c.status == "ok" and c.fix is None
    assert "runs now (docker.service failed, containerd.service deactivating)" in c.message
    c = check(edge_doctor.parse_daemon_memory(section("show-stopped.txt", "tmpfs")))
    assert c is not None and c.status == "ok", "nothing runs: the hierarchy is not judged either"


def test_reloading_and_activating_units_run_and_are_judged():
    c = check(edge_doctor.parse_daemon_memory(section("show-starting.txt")))
    assert c is not None and c.status == "warn"
    assert c.message.startswith("docker.service, containerd.service: no MemoryHigh or MemoryMax")
    assert c.fix == Fix(f"{SET.format('docker.service')} && {SET.format('containerd.service')}", "root", "worker")


def test_a_stopped_docker_service_beside_a_running_containerd_judges_containerd_alone():
    c = check(edge_doctor.parse_daemon_memory(section("show-docker-stopped.txt")))
    assert c is not None and c.status == "ok"
    assert c.message == ("containerd.service MemoryHigh 4.0 GiB (docker.service inactive: dockerd runs some other "
                         "way, not judged): the page cache of pulls and image copies is reclaimed above it")
    c = check(units(docker("inactive"), containerd()))
    assert c is not None and c.status == "warn" and c.fix == Fix(SET.format("containerd.service"), "root", "worker")
    assert "(docker.service inactive: dockerd runs some other way, not judged)" in c.message


def test_a_stopped_containerd_service_beside_a_running_docker_judges_docker_alone():
    c = check(units(docker(), containerd("failed", G4)))
    assert c is not None and c.status == "warn" and c.fix == Fix(SET.format("docker.service"), "root", "worker")
    assert c.message.startswith("docker.service: no MemoryHigh or MemoryMax")
    assert c.message.endswith("(containerd.service failed: dockerd then runs its own, inside docker.service)")


def test_the_legacy_hierarchy_does_not_enforce_memory_high():
    """systemd.resource-control(5): MemoryHigh= is effective only on the unified hierarchy; MemoryMax= is
    translated to MemoryLimit= there. The fix is the unified hierarchy, DGX OS's default."""
    c = check(edge_doctor.parse_daemon_memory(section("show-bounded.txt", "tmpfs")))
    assert c is not None and c.status == "warn"
    assert c.message.startswith("/sys/fs/cgroup is tmpfs, not cgroup2fs: on the legacy cgroup hierarchy MemoryHigh= "
                                "is not enforced (docker.service MemoryHigh 4.0 GiB, containerd.service MemoryHigh "
                                "4.0 GiB: ignored)")
    assert c.fix is not None and c.fix.user == "root"
    assert c.fix.command.startswith("grep -o 'systemd.unified_cgroup_hierarchy=[^ ]*' /proc/cmdline")
    assert "set-property" not in c.fix.command  # both are set; they take effect once the hierarchy is unified
    c = check(edge_doctor.parse_daemon_memory(section("show-unbounded.txt", "tmpfs")))
    assert c is not None and c.fix is not None
    assert c.fix.command.endswith(f"; then {SET.format('docker.service')} && {SET.format('containerd.service')}")
    c = check(units(docker(max=8 * 2**30), containerd(max=8 * 2**30), "tmpfs"))
    assert c is not None and c.status == "ok" and "docker.service MemoryMax 8.0 GiB" in c.message


def test_only_nodes_that_serve_or_source_images_and_have_systemd_are_checked():
    assert "docker-mem" not in [c.name for c in run()], "no systemd answered: no check"
    unbounded = edge_doctor.parse_daemon_memory(section("show-unbounded.txt"))
    alone = DESIRED.with_deployment(serving=DESIRED.serving.model_copy(
        update={"nodes": ["head"], "tensor_parallel_size": 1}))
    found = preflight.checks(alone, {"head": _facts(HEAD, daemon_memory=unbounded),
                                     "worker": _facts(WORKER, daemon_memory=unbounded)}, LOCAL)
    assert [c.node for c in found if c.name == "docker-mem"] == ["head"]
    found = run(head=_facts(HEAD, daemon_memory=unbounded), worker=_facts(WORKER, daemon_memory=unbounded))
    assert one(found, "docker-mem", "head").status == "warn"
    assert preflight.exit_code(found) == 0, "a warning: apply works all the same"


def test_containerd_alone_is_judged_and_the_missing_engine_unit_said():
    c = check(units(None, containerd(high=G4)))
    assert c is not None and c.status == "ok"
    assert c.message.startswith("containerd.service MemoryHigh 4.0 GiB (no docker.service here: dockerd runs some "
                                "other way, not judged)")
