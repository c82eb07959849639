"""The GPU stack of a GB10 (DGX Spark) from the public record (issue 52, item 10): until now the parser was tested
on an H200's recordings only. What a GB10 prints, a driver updated without a reboot, and a real /etc/dgx-release
are quoted in fixtures/nvidia-smi/ and fixtures/dgx-release-*.txt, each with its source in
fixtures/nvidia-smi/README.md ("GB10, from the public record").

The probe's own script runs for real where it can (test_probe_scripts_run's `LocalNode`: the real `sh`, `grep`,
`uname`, a stand-in `nvidia-smi` answering only the probe's exact query, the script's one mention of
/etc/dgx-release pointed at the recorded file); its output goes to the probe's parser. The probe's exact query
answered on a GB10 is not in the public record: its line is assembled from the recorded `nvidia-smi` table of a
Spark (the product name of its row, the driver of its banner) in the `name, driver` form the H200 recording shows.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from reconciler.core.observed import GpuStack
from reconciler.edge.facts.base import ProbeError, Section
from reconciler.edge.facts.gpu import gpu_script, parse_gpu_stack
from tests.unit.edge.test_probe_fragments import LocalNode
from tests.unit.edge.test_probe_scripts_run import NVIDIA_SMI_ARGV, _local, _pointed, _tool, sections

FIXTURES = Path(__file__).parents[1] / "fixtures"
SMI = FIXTURES / "nvidia-smi"
SPARK_RELEASE = FIXTURES / "dgx-release-spark.txt"               # DGX OS 7.2.3, one OTA update: 7.3.1
HISTORY_RELEASE = FIXTURES / "dgx-release-dgx-a100-ota-history.txt"  # DGX OS 5.0.0, five OTA updates to 5.5.1
MISMATCH = "Failed to initialize NVML: Driver/library version mismatch"


@pytest.fixture
def node(tmp_path):
    return _local(tmp_path / "node")


def _quoted(name: str) -> str:
    return (SMI / name).read_text()


def _serial(release: Path) -> str:
    """The DGX_SERIAL_NUMBER value of a recorded file (masked by its author: still a value that must not leave)."""
    [value] = re.findall(r'^DGX_SERIAL_NUMBER="(.*)"$', release.read_text(), re.MULTILINE)
    return value


def _gb10_line() -> str:
    """`NVIDIA GB10, 580.95.05`: the row's product name and the banner's driver of the recorded Spark table."""
    table = _quoted("gb10-nvidia-smi.txt")
    [driver] = re.findall(r"Driver Version: (\S+)", table)
    [name] = re.findall(r"^\|\s+0\s+(.+?)\s{2,}On\s+\|", table, re.MULTILINE)
    return f"{name}, {driver}\n"


def _run(node: LocalNode, release: Path, stdout: str, rc: int) -> tuple[GpuStack | None, dict[str, Section]]:
    _tool(node, "nvidia-smi")
    _tool(node, "nvidia-container-runtime-hook")
    node.answer({"tool": "nvidia-smi", "argv": NVIDIA_SMI_ARGV, "stdout": stdout, "rc": rc})
    found = sections(node, _pointed(gpu_script(), "/etc/dgx-release", release))
    assert node.calls("nvidia-smi") == [["nvidia-smi", *NVIDIA_SMI_ARGV]]
    return parse_gpu_stack(found.get("gpu"), found.get("gpu_hook"), found.get("os")), found


def _os_section(release: Path) -> Section:
    """The `os` section as if the whole file were read (no grep): the parser alone must still pick the release."""
    return Section(f"6.17.0-1014-nvidia\n{release.read_text()}", 0)


# -- what a GB10 answers ------------------------------------------------------------------------------------------

def test_a_spark_answers_with_its_name_its_driver_and_its_last_ota_release(node):
    """Run for real: the GB10's name and 580.95.05 from the recorded table; DGX OS is the OTA update's 7.3.1, not
    the image's 7.2.3 that comes first in the file; the serial number stays on the node."""
    stack, found = _run(node, SPARK_RELEASE, _gb10_line(), 0)
    assert stack == GpuStack(gpu="NVIDIA GB10", driver="580.95.05", hook=True, kernel=os.uname().release,
                             dgx_os="7.3.1")
    assert found["os"] == Section(f'{os.uname().release}\nDGX_SWBUILD_VERSION="7.2.3"\nDGX_OTA_VERSION="7.3.1"', 0)
    serial = _serial(SPARK_RELEASE)
    assert all(serial not in s.body and "SERIAL" not in s.body for s in found.values())
    assert serial not in stack.model_dump_json()


def test_the_last_of_several_ota_updates_is_the_release_now(node):
    """Run for real on a file of five appended OTA blocks: the release is the last one (5.5.1), not the image's
    5.0.0 nor the first update's 5.0.5; no OTA date and no serial number leaves the node."""
    stack, found = _run(node, HISTORY_RELEASE, _gb10_line(), 0)
    assert stack is not None and stack.dgx_os == "5.5.1"
    assert found["os"].body.splitlines()[1:] == [
        'DGX_SWBUILD_VERSION="5.0.0"', 'DGX_OTA_VERSION="5.0.5"', 'DGX_OTA_VERSION="5.1.1"',
        'DGX_OTA_VERSION="5.2.0"', 'DGX_OTA_VERSION="5.3.1"', 'DGX_OTA_VERSION="5.5.1"']
    assert "DATE" not in found["os"].body and _serial(HISTORY_RELEASE) not in found["os"].body


@pytest.mark.parametrize(("release", "dgx_os"), [(SPARK_RELEASE, "7.3.1"), (HISTORY_RELEASE, "5.5.1")])
def test_the_parser_reads_only_the_version_keys_of_a_whole_file(release, dgx_os):
    """Without the grep (a whole file in the section) the release is still the last DGX_OTA_VERSION: never the
    last line's OTA date, the serial number or the platform's name."""
    stack = parse_gpu_stack(Section(_gb10_line(), 0), None, _os_section(release))
    assert stack is not None and stack.dgx_os == dgx_os
    assert _serial(release) not in stack.model_dump_json()


# -- a driver updated without a reboot -----------------------------------------------------------------------------

def test_a_driver_updated_without_a_reboot_is_its_first_line_and_exit_status(node):
    """Run for real: the recorded failure (both lines on stdout, exit 18); the error is NVML's first line, never
    the library's version read as the driver; the DGX OS release is still read."""
    *body, status = _quoted("nvml-mismatch-exit18.txt").splitlines()
    stack, _ = _run(node, SPARK_RELEASE, "\n".join(body) + "\n", int(status.removeprefix("exit=")))
    assert stack == GpuStack(error=MISMATCH, status=18, hook=True, kernel=os.uname().release, dgx_os="7.3.1")


def test_the_580_branchs_mismatch_reads_the_same():
    """The 580 driver's words (`NVML library version: 580.178` second), with NVML's status for them
    (NVML_ERROR_LIB_RM_VERSION_MISMATCH, 18): no GPU, no driver, the first line."""
    stack = parse_gpu_stack(Section(_quoted("nvml-mismatch-580.txt"), 18), None, _os_section(SPARK_RELEASE))
    assert stack is not None
    assert (stack.gpu, stack.driver, stack.error, stack.status) == (None, None, MISMATCH, 18)


# -- a GB10's memory fields ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["gb10-q-memory-noheader-nounits.txt", "gb10-q-memory-header.txt"])
def test_a_gb10s_memory_fields_are_odd_output_not_a_driver(name):
    """What a query with memory fields answers on a GB10 (`[N/A]` each) is not the probe's `name, driver_version`:
    odd output, never a driver `[N/A]` or a GPU named `0, NVIDIA GB10, ...`."""
    with pytest.raises(ProbeError, match="gpu"):
        parse_gpu_stack(Section(_quoted(name), 0), None, None)
