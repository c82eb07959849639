"""The serving image's CUDA against each node's driver, judged before anything stops.

An image built on CUDA 13.x runs on any driver of the 13 family's floor or later: "applications compiled with a
CUDA Toolkit release from within a CUDA major release family can run, with limited feature-set, on systems having
at least the minimum required driver version" (NVIDIA, CUDA Compatibility, "Minor Version Compatibility", table
1: CUDA 13.x >= 580, 12.x >= 525, 11.x >= 450). Below the floor nothing of the image's CUDA runs: the start would
fail after the old generation stopped, so it blocks. Between the floor and the driver the toolkit shipped with
(the image's `CUDA_DRIVER_VERSION`, which NGC images set) it runs in minor-version compatibility, where code that
needs the newer driver fails: PTX JIT of PTX newer than the driver ("the limited feature-set"), the weak spot for
kernels compiled at start. That is a warning, not a blocker: NVIDIA's own DGX Spark vLLM playbook runs NGC 26.05
(CUDA 13.2) on the 580 branch every public GB10 `nvidia-smi` shows (580.95.05 ... 580.178.04 on DGX OS 7.6.0).

Pure: the image's answer (`ServeFlags`: its CUDA_VERSION, CUDA_DRIVER_VERSION, NVIDIA_REQUIRE_CUDA) and a
driver version in, a verdict out.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

#: The minimum driver branch per CUDA major (CUDA Compatibility, "Minor Version Compatibility", table 1).
DRIVER_FLOOR = {13: 580, 12: 525, 11: 450}

_VERSION = re.compile(r"^(\d+)(?:\.(\d+))?(?:\.(\d+))?")
_REQUIRE = re.compile(r"(?:^|\s)cuda>=(\d+)(?:\.(\d+))?")


def version_tuple(text: str | None) -> tuple[int, ...] | None:
    """`580.95.05` -> (580, 95, 5); None for anything that does not start with a number."""
    m = _VERSION.match((text or "").strip())
    return tuple(int(g) for g in m.groups() if g is not None) if m else None


def cuda_major(cuda_version: str | None, require_cuda: str | None) -> int | None:
    """The image's CUDA major: its `CUDA_VERSION` (`13.2.1.006`), else the `cuda>=X.Y` of NVIDIA_REQUIRE_CUDA (the
    requirement nvidia-container-cli checks at start)."""
    if (v := version_tuple(cuda_version)) is not None:
        return v[0]
    m = _REQUIRE.search(require_cuda or "")
    return int(m.group(1)) if m else None


@dataclass(frozen=True)
class Verdict:
    """`blocking`: nothing of the image's CUDA runs on this driver; otherwise a warning (`why` says which)."""

    blocking: bool
    why: str


def judge(driver: str | None, cuda_version: str | None, cuda_driver: str | None,
          require_cuda: str | None) -> Verdict | None:
    """The node's `driver` against the image; None when they agree, or when either side did not say (an image
    without CUDA's variables, a node whose nvidia-smi failed: that has its own drift)."""
    have = version_tuple(driver)
    major = cuda_major(cuda_version, require_cuda)
    if have is None or major is None:
        return None
    floor = DRIVER_FLOOR.get(major)
    cuda = cuda_version or f"{major}.x"
    if floor is not None and have[0] < floor:
        return Verdict(True, f"driver {driver} is below CUDA {major}'s floor ({floor}): nothing of the image's CUDA "
                             f"{cuda} runs on it (NVIDIA, CUDA Compatibility: CUDA {major}.x needs >= {floor}); "
                             f"update the driver to the {floor} branch or later, or serve an image built on an "
                             "older CUDA")
    shipped = version_tuple(cuda_driver)
    if shipped is not None and have < shipped:
        return Verdict(False, f"driver {driver} is older than the {cuda_driver} the image's CUDA {cuda} shipped with: "
                              "it runs in minor-version compatibility, where PTX newer than the driver cannot be "
                              "JIT-compiled (a kernel built at start may fail); NVIDIA's DGX Spark playbook runs "
                              "this way on the 580 branch")
    return None
