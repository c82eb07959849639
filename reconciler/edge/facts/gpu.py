"""The GPU stack on a node: the GPU and its driver (`nvidia-smi`), the container runtime's hook, the kernel and
the DGX OS release (`GPU_STACK`)."""

from __future__ import annotations

import re

from reconciler.core.observed import (
    GpuStack,
)
from reconciler.edge.facts.base import Fact, Section, each_line, node_output


def gpu_script() -> list[str]:
    """The `gpu`, `gpu_hook` and `os` sections (`parse_gpu_stack`). nvidia-smi under `timeout`: a wedged driver
    can hang it, and the probe must answer within its deadline. It asks for the two fields the GPU stack needs;
    a GB10's memory fields, `[N/A]` there, are not among them (tests/unit/fixtures/nvidia-smi/README.md). Only
    the DGX OS version lines of /etc/dgx-release are read (the file also holds the serial number)."""
    return ["sec gpu",
            "if command -v nvidia-smi >/dev/null 2>&1; then timeout 10 nvidia-smi "
            "--query-gpu=name,driver_version --format=csv,noheader 2>&1; rc $?; "
            "else echo 'nvidia-smi: command not found'; rc 127; fi",
            "sec gpu_hook",
            "command -v nvidia-container-runtime-hook; rc $?",
            "sec os",
            "uname -r; grep -E '^DGX_(SWBUILD_VERSION|OTA_VERSION)=' /etc/dgx-release 2>/dev/null; rc 0"]


_DRIVER = re.compile(r"\d+(\.\d+)+")
_KERNEL = re.compile(r"[A-Za-z0-9_.+~-]{1,64}")  # 6.17.0-1014-nvidia


def parse_gpu_stack(gpu: Section | None, hook: Section | None, os_release: Section | None) -> GpuStack | None:
    """The node's GPU stack; None when the probe did not ask (no `gpu` section)."""
    if gpu is None:
        return None
    stack = GpuStack(hook=hook is not None and hook.rc == 0, **_os_release(os_release))
    lines = [line.strip() for line in gpu.body.splitlines() if line.strip()]
    if gpu.rc != 0 or not lines:
        first = lines[0] if lines else "no output"
        return stack.model_copy(update={"error": first[:200], "status": gpu.rc})
    return stack.model_copy(update=_gpu_line(lines[0]))


@node_output("gpu")
def _gpu_line(line: str) -> dict[str, str]:
    """`NVIDIA GB10, 580.95.05`: the first GPU's name and the driver (one driver serves every GPU)."""
    name, _, driver = line.rpartition(", ")
    if not name or not _DRIVER.fullmatch(driver):
        raise ValueError(f"not `name, driver_version`: {line[:80]!r}")
    return {"gpu": name, "driver": driver}


#: The /etc/dgx-release keys the DGX OS release is read from: the image's, then one per OTA update (DGX OS appends
#: a DGX_OTA_VERSION/DGX_OTA_DATE block after each, fixtures/dgx-release-*.txt); never DGX_SERIAL_NUMBER, a date.
_DGX_VERSION_KEYS = ("DGX_SWBUILD_VERSION", "DGX_OTA_VERSION")


@node_output("os")
def _os_release(sec: Section | None) -> dict[str, str | None]:
    """`uname -r`, then DGX_SWBUILD_VERSION and any DGX_OTA_VERSION lines (an OTA update appends one: the last
    is the release now). Only those two keys are read, whatever else a line says (the probe's grep keeps only
    them; a whole file read here would still give the release, never the serial number or an OTA date)."""
    lines = each_line(sec.body) if sec is not None else iter(())
    kernel = next(lines, "").strip()
    if kernel and not _KERNEL.fullmatch(kernel):
        raise ValueError(f"not a kernel release: {kernel[:60]!r}")
    last = None  # the last version line: nothing kept of the others (issue 53)
    for key, eq, value in (line.partition("=") for line in lines):
        if eq and key.strip() in _DGX_VERSION_KEYS:
            last = value
    return {"kernel": kernel, "dgx_os": last.strip().strip('"')[:40] if last is not None else None}


#: The node's GPU stack; read wherever a deployment on the node declares GPUs (`serving.docker.gpus`).
GPU_STACK: Fact[GpuStack | None] = Fact(
    "gpu", tuple(gpu_script()),
    lambda sections: parse_gpu_stack(sections.get("gpu"), sections.get("gpu_hook"), sections.get("os")))
