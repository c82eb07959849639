"""The probe's shell fragments run for real, where the second mutation run (issue 34) found them unchecked: a
fragment is shell a node runs, so each test hands the sealed script to this machine's `sh -s` (as
`read_sections` does over SSH) and feeds what it printed to the probe's own parser.

The node here is test_probe_survivors' `LocalNode`: the real `sh`, `uname`, `grep`, `cat`, `df`, `timeout` and
/proc, and stand-ins that answer only the exact argv of a tool's contract for what this machine has not:
`nvidia-smi` and `nvidia-container-runtime-hook` (no NVIDIA driver), `ip` (the testbed head's links), `curl` and
`docker`. Two files only a Spark's kernel or DGX OS makes, /sys/class/infiniband and /etc/dgx-release, are made
in the test's directory and the script's one mention of the path pointed there (`_pointed`). Expectations are
written from the recordings: fixtures/discover/ (the testbed head's `ip -j addr`, a Spark's RDMA sysfs lines),
fixtures/nvidia-smi/ (a real 580 driver), fixtures/probe-4-nodes.json (the converged testbed), and from this
machine's own kernel where the fragment reads it (/proc/meminfo, `uname`, a socket this test holds).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from reconciler.core.observed import GpuStack, Link, Memory, RdmaPort
from reconciler.edge.facts.base import Section, read_sections
from reconciler.edge.facts.containers import DOCKER_SOCKET, containers_script, parse_containers
from reconciler.edge.facts.disk import disk_script, parse_disk, parse_disk_fs
from reconciler.edge.facts.gpu import gpu_script, parse_gpu_stack
from reconciler.edge.facts.host import machine_script, parse_machine
from reconciler.edge.facts.images import image_script
from reconciler.edge.facts.links import RdmaDevice, interfaces_script, link_script, parse_interfaces, parse_rdma_devices
from reconciler.edge.facts.memory import memory_script, parse_memory
from reconciler.edge.facts.ports import listen_script, parse_listening
from reconciler.edge.ssh import CommandTimeout, Result
from tests.unit.edge.test_probe_fragments import API_LIST, STAND_IN, LocalNode
from tests.unit.recorded import load

FIXTURES = Path(__file__).parents[1] / "fixtures"
IP_ADDR_HEAD = json.loads((FIXTURES / "discover" / "ip-addr-testbed-head.json").read_text())["output"]
RDMA_SYSFS = [line for line in (FIXTURES / "discover" / "rdma-sysfs-spark.txt").read_text().splitlines()
              if not line.startswith("#")]
NVIDIA_SMI_ARGV = ["--query-gpu=name,driver_version", "--format=csv,noheader"]
# /etc/dgx-release in its KEY="value" form (written here; real files, a Spark's and a DGX A100's with five OTA blocks,
# are fixtures/dgx-release-*.txt, read by test_gpu_gb10.py):
# the two lines the probe reads (docs/troubleshooting.md: DGX_SWBUILD_VERSION, then an OTA update's appended
# DGX_OTA_VERSION, the last one the release now) among lines it must leave on the node, the serial number first
DGX_RELEASE = ('DGX_NAME="DGX Spark"\nDGX_PRETTY_NAME="NVIDIA DGX Spark"\nDGX_SWBUILD_DATE="2025-09-10"\n'
               'DGX_SWBUILD_VERSION="7.2.3"\nDGX_SERIAL_NUMBER="1234567890123"\nDGX_OTA_VERSION="7.4.0"\n'
               'DGX_OTA_DATE="2025-11-10"\n')


def _local(root: Path, cwd: str | None = None) -> LocalNode:
    root.mkdir()
    return LocalNode(root, cwd)


@pytest.fixture
def node(tmp_path):
    return _local(tmp_path / "node")


def sections(node: LocalNode, lines: list[str]) -> dict[str, Section]:
    return read_sections(node, lines, timeout=60)


def _pointed(lines: list[str], path: str, here: Path) -> list[str]:
    """The fragment with its one mention of `path` (a file only a Spark has) pointed at `here`."""
    assert sum(line.count(path) for line in lines) == 1, f"the fragment names {path} once"
    return [line.replace(path, str(here)) for line in lines]


def _tool(node: LocalNode, name: str) -> None:
    """A stand-in `name` on the node's PATH (answers as test_probe_survivors' STAND_IN does)."""
    (node.bin / name).write_text(f"#!{sys.executable}\n{STAND_IN}")
    (node.bin / name).chmod(0o755)


# -- discover's interfaces and RDMA devices -----------------------------------------------------------------------

def _spark_sysfs(root: Path) -> Path:
    """/sys/class/infiniband as a Spark's kernel lays it out, from the recorded lines: one symlink per device to
    its directory, ports/1/{state,phys_state}, device/net/NETDEV."""
    devices, klass = root / "devices", root / "infiniband"
    klass.mkdir(parents=True)
    dev = None
    for line in RDMA_SYSFS:
        key, _, value = line.partition(" ")
        if key == "dev":
            dev = devices / value
            (dev / "ports" / "1").mkdir(parents=True)
            (klass / value).symlink_to(dev)
        elif key in ("state", "phys_state"):
            (dev / "ports" / "1" / key).write_text(value + "\n")
        else:
            (dev / "device" / "net" / value).mkdir(parents=True)
    return klass


def test_discover_reads_every_interface_and_every_rdma_device(node, tmp_path):
    """Run for real: `ip -j addr` answers the testbed head's recorded JSON (the loopback left out), and the four
    ConnectX-7 devices of a Spark print the recorded lines, in the shell's glob order (C locale: `P` before
    `p`)."""
    node.answer({"tool": "ip", "argv": ["-j", "addr"], "stdout": json.dumps(IP_ADDR_HEAD) + "\n"})
    found = sections(node, _pointed(interfaces_script(), "/sys/class/infiniband", _spark_sysfs(tmp_path / "sys")))
    assert parse_interfaces(found["addr"]) == [
        Link(name="enP7s7", operstate="up", admin_up=True, carrier=True, mtu=1500, addresses=["10.231.0.2/24"]),
        Link(name="enP7s8", operstate="up", admin_up=True, carrier=True, mtu=1500, addresses=["10.231.1.1/24"]),
        Link(name="enp1s0f1np1", operstate="up", admin_up=True, carrier=True, mtu=9000,
             addresses=["10.232.0.10/24"])]
    assert found["rdma_sysfs"] == Section("\n".join(RDMA_SYSFS), 0)
    down, up = RdmaPort(state="1: DOWN", phys_state="3: Disabled"), RdmaPort(state="4: ACTIVE", phys_state="5: LinkUp")
    assert parse_rdma_devices(found["rdma_sysfs"]) == [
        RdmaDevice("roceP2p1s0f0", ("enP2p1s0f0np0",), down), RdmaDevice("roceP2p1s0f1", ("enP2p1s0f1np1",), up),
        RdmaDevice("rocep1s0f0", ("enp1s0f0np0",), down), RdmaDevice("rocep1s0f1", ("enp1s0f1np1",), up)]


def test_a_node_without_rdma_devices_has_an_empty_rdma_section(node, tmp_path):
    """Run for real: an empty /sys/class/infiniband (or none: the glob stays `*`) is no device, not a device `*`;
    a device whose driver drives no netdev lists none."""
    node.answer({"tool": "ip", "argv": ["-j", "addr"], "stdout": json.dumps(IP_ADDR_HEAD[:1]) + "\n"})
    for klass in (tmp_path / "empty", tmp_path / "absent"):
        if klass.name == "empty":
            klass.mkdir()
        found = sections(node, _pointed(interfaces_script(), "/sys/class/infiniband", klass))
        assert found["rdma_sysfs"] == Section("", 0)
        assert parse_rdma_devices(found["rdma_sysfs"]) == []
        assert parse_interfaces(found["addr"]) == []
    (tmp_path / "empty" / "mlx5_0" / "ports" / "1").mkdir(parents=True)
    found = sections(node, _pointed(interfaces_script(), "/sys/class/infiniband", tmp_path / "empty"))
    assert found["rdma_sysfs"] == Section("dev mlx5_0\nstate \nphys_state ", 0)


# -- the GPU stack ------------------------------------------------------------------------------------------------

def _recorded_smi(name: str) -> tuple[str, int]:
    *body, status = (FIXTURES / "nvidia-smi" / name).read_text().splitlines()
    return "\n".join(body) + "\n", int(status.removeprefix("exit="))


def _gpu(node: LocalNode, dgx_release: Path) -> GpuStack | None:
    found = sections(node, _pointed(gpu_script(), "/etc/dgx-release", dgx_release))
    return parse_gpu_stack(found.get("gpu"), found.get("gpu_hook"), found.get("os"))


def test_the_gpu_stack_of_a_driver_that_answers(node, tmp_path):
    """Run for real: nvidia-smi's exact query answers the recorded 580 driver's line, the runtime hook is on the
    PATH, the kernel is this machine's `uname -r`, and the DGX OS release is the last OTA version; the serial
    number never leaves the node."""
    out, status = _recorded_smi("q-noheader.txt")
    _tool(node, "nvidia-smi")
    _tool(node, "nvidia-container-runtime-hook")
    node.answer({"tool": "nvidia-smi", "argv": NVIDIA_SMI_ARGV, "stdout": out, "rc": status})
    release = tmp_path / "dgx-release"
    release.write_text(DGX_RELEASE)
    assert _gpu(node, release) == GpuStack(gpu="NVIDIA H200", driver="580.159.04", hook=True,
                                           kernel=os.uname().release, dgx_os="7.4.0")
    found = sections(node, _pointed(gpu_script(), "/etc/dgx-release", release))
    assert found["os"] == Section(f'{os.uname().release}\nDGX_SWBUILD_VERSION="7.2.3"\nDGX_OTA_VERSION="7.4.0"', 0)
    assert found["gpu_hook"] == Section(str(node.bin / "nvidia-container-runtime-hook"), 0)
    assert node.calls("nvidia-smi")[0] == ["nvidia-smi", *NVIDIA_SMI_ARGV]


def test_a_driver_that_fails_keeps_its_first_line_and_status(node, tmp_path):
    """Run for real: the recorded `No devices were found` (exit 6) of the exact query; no hook, no DGX OS."""
    out, status = _recorded_smi("q-no-such-gpu.txt")
    _tool(node, "nvidia-smi")
    node.answer({"tool": "nvidia-smi", "argv": NVIDIA_SMI_ARGV, "stdout": out, "rc": status})
    assert _gpu(node, tmp_path / "no-dgx-release") == GpuStack(
        error="No devices were found", status=6, hook=False, kernel=os.uname().release, dgx_os=None)


def test_a_node_without_nvidia_smi_says_command_not_found(node, tmp_path):
    """Run for real: this machine has no NVIDIA tools (checked); the fragment says so with the shell's 127."""
    assert not any((Path(d) / "nvidia-smi").exists() for d in ("/usr/bin", "/bin"))
    assert _gpu(node, tmp_path / "no-dgx-release") == GpuStack(
        error="nvidia-smi: command not found", status=127, hook=False, kernel=os.uname().release)


# -- machine, memory, listening ports -----------------------------------------------------------------------------

def test_the_machine_is_unames(node):
    """Run for real: the kernel's machine name, as Python's os.uname() reads it from the same syscall."""
    assert parse_machine(sections(node, machine_script())["machine"]) == os.uname().machine


def _meminfo_kib(key: str) -> int:
    line = next(x for x in Path("/proc/meminfo").read_text().splitlines() if x.startswith(key + ":"))
    return int(line.split()[1])


def test_memory_is_memtotal_and_memavailable_in_bytes(node):
    """Run for real against this machine's /proc/meminfo: MemTotal exactly (it does not move), MemAvailable a
    positive part of it (it moves between two reads)."""
    memory = parse_memory(sections(node, memory_script())["meminfo"])
    assert isinstance(memory, Memory)
    assert memory.total_bytes == _meminfo_kib("MemTotal") * 1024
    assert 0 < memory.available_bytes <= memory.total_bytes


def test_listen_reads_the_port_a_socket_listens_on_and_not_its_connections(node):
    """Run for real against this machine's /proc/net/tcp: a port this test listens on is read; the ephemeral port
    of a connection to it (ESTABLISHED, not 0A) is not, nor would the parser accept its row."""
    with socket.create_server(("127.0.0.1", 0)) as server, \
            socket.create_connection(server.getsockname()) as client:
        accepted, _ = server.accept()
        with accepted:
            ports = parse_listening(sections(node, listen_script())["listen"])
        listening, connected = server.getsockname()[1], client.getsockname()[1]
    assert ports is not None and listening in ports
    assert connected not in ports


# -- the fabric ports without an RDMA device ----------------------------------------------------------------------

def test_a_port_without_an_rdma_device_has_an_rdma_section_with_status_2(node):
    """Run for real on the recorded head (its ports declare no RDMA device): `rdma` and `rdma-twin` close empty
    with status 2, as the recording has them."""
    head = load().node("head")
    node.answer({"tool": "ip", "argv": ["-j", "addr", "show", "dev", "enp1s0f1np1"], "stdout": "[]\n"},
                {"tool": "ip", "argv": ["-j", "addr", "show", "dev", "enP2p1s0f1np1"], "stdout": "[]\n"})
    found = sections(node, link_script(head))
    assert found == {"link": Section("[]", 0), "rdma": Section("", 2), "link-twin": Section("[]", 0),
                     "rdma-twin": Section("", 2)}


# -- containers over the socket; docker's data root from the CLI --------------------------------------------------

def test_the_containers_list_from_the_socket_is_the_apis(node):
    """Run for real: the Engine API's `GET /containers/json?all=1` answers the recorded list; the section is
    marked as the API's and read as such, the CLI never started."""
    node.answer({"tool": "curl", "argv": ["-sf", "--unix-socket", "/var/run/docker.sock",
                                          "http://docker/containers/json?all=1"], "stdout": json.dumps(API_LIST)})
    ok, error, found = parse_containers(sections(node, containers_script())["containers"])
    assert (ok, error) == (True, None)
    assert [c.name for c in found] == ["reranker", "vllm_embeddings", "vllm_serving"]
    assert node.calls("docker") == []


def test_without_the_socket_dockers_data_root_comes_from_docker_info(tmp_path):
    """Run for real: no socket answer, so `docker info --format '{{.DockerRootDir}}'` (the CLI's field of the
    Engine's Info) names the data root; df reads both filesystems."""
    node = _local(tmp_path / "node", cwd="/proc")
    root = tmp_path / "docker-root"
    root.mkdir()
    node.answer({"tool": "docker", "argv": ["info", "--format", "{{.DockerRootDir}}"], "stdout": f"{root}\n"})
    free = parse_disk(sections(node, [DOCKER_SOCKET, *disk_script(str(tmp_path / "models"))])["disk"])
    assert free is not None and set(free) == {"weights", "image"}
    expected = os.statvfs(tmp_path).f_bavail * os.statvfs(tmp_path).f_frsize
    assert abs(free["image"] - expected) < 1 << 28
    assert ["docker", "info", "--format", "{{.DockerRootDir}}"] in node.calls("docker")


@pytest.mark.parametrize("apart", [False, True], ids=["one filesystem", "two filesystems"])
def test_the_disk_rows_say_which_filesystem_each_is_on(tmp_path, apart):
    """Run for real (issue 52, item 10): the model path and docker's data root on this machine's one filesystem
    under the test's directory (as the hub and /var/lib/docker share the NVMe's `/` on DGX OS) read as one
    filesystem; the data root on /proc (another filesystem on every Linux) as two. The identity is df's own row:
    its device when a device node, else its mount point (`parse_disk_fs`)."""
    node = _local(tmp_path / "node", cwd="/proc")
    root = Path("/proc") if apart else tmp_path / "docker-root"
    root.mkdir(exist_ok=True)
    node.answer({"tool": "docker", "argv": ["info", "--format", "{{.DockerRootDir}}"], "stdout": f"{root}\n"})
    sec = sections(node, [DOCKER_SOCKET, *disk_script(str(tmp_path / "models"))])["disk"]
    where_on = parse_disk_fs(sec)
    assert where_on is not None and set(where_on) == {"weights", "image"}, sec
    rows = {line.split()[0]: line.split()[1:] for line in sec.body.splitlines()}
    for what, row in rows.items():
        assert where_on[what] == (row[0] if row[0].startswith("/dev/") else " ".join(row[5:]))
    assert (where_on["weights"] == where_on["image"]) is (not apart), where_on
    if apart:
        assert where_on["image"] == "/proc"


# -- the sealed script's header -----------------------------------------------------------------------------------

class LocalisedNode(LocalNode):
    """A node whose login sets a locale (an SSH client's `SendEnv LC_*`, or the user's profile)."""

    def run_script(self, script: str, timeout: float, cancel: object = None) -> Result:
        env = {"PATH": f"{self.bin}:/usr/bin:/bin", "HOME": str(self.home), "CALLS": str(self.calls_file),
               "ANSWERS": str(self.answers_file), "LC_ALL": "C.UTF-8", "LANG": "de_DE.UTF-8"}
        p = subprocess.run(["sh", "-s"], input=script.encode(), capture_output=True, env=env, timeout=timeout,
                           check=False)
        return Result(p.stdout.decode("utf-8", "replace"), p.stderr.decode("utf-8", "replace"), p.returncode)


def test_every_tool_the_script_starts_runs_in_the_c_locale(tmp_path):
    """Run for real under a login locale: the sealed script exports LC_ALL=C, so a tool it starts (nvidia-smi,
    df, grep) prints and matches the C locale's words, which the parsers read, whatever the user's locale."""
    (tmp_path / "node").mkdir()
    node = LocalisedNode(tmp_path / "node")
    found = sections(node, ["sec locale", "sh -c 'printf \"%s\\n\" \"$LC_ALL\"'; rc $?"])
    assert found == {"locale": Section("C", 0)}


# -- read_sections past its deadline ------------------------------------------------------------------------------

class EndedByTimeout:
    """A session whose command the node's `timeout` ended (exit 124 or 137): what arrived is not an answer."""

    name = "worker2"

    def __init__(self, code: int):
        self.code = code
        self.timeouts: list[float | None] = []

    def run_script(self, script: str, timeout: float | None, cancel: object = None) -> Result:
        self.timeouts.append(timeout)
        return Result("\n@@partial containers\n", "", self.code)


@pytest.mark.parametrize("code", [124, 137])
def test_a_read_the_node_ended_at_its_deadline_is_a_command_timeout(code):
    """The deadline goes to the session, and past it the step sees CommandTimeout naming the node, the sections
    it asked for and the deadline."""
    session = EndedByTimeout(code)
    with pytest.raises(CommandTimeout) as ended:
        read_sections(session, [*containers_script(), *image_script("vllm-standin:latest")], timeout=7.5)
    assert session.timeouts == [7.5]
    assert ended.value.node == "worker2"
    assert ended.value.message == "reading containers, image did not finish within 7.5s (ended on the node)"
    assert str(ended.value) == "worker2: reading containers, image did not finish within 7.5s (ended on the node)"


def test_the_deadline_reaches_the_session_of_a_read_that_finished(node):
    """Run for real: the session is given the read's deadline (not none)."""
    seen: list[float | None] = []
    run = node.run_script

    def recording(script: str, timeout: float, cancel: object = None) -> Result:
        seen.append(timeout)
        return run(script, timeout)

    node.run_script = recording
    assert read_sections(node, machine_script(), timeout=42)["machine"].rc == 0
    assert seen == [42]
