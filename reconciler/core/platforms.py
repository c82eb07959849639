"""A node's machine (`uname -m`) against an image's platform (its inspect object's `Os`/`Architecture`).

The kernel and the image spec name the same CPU differently (the kernel's `aarch64` is the OCI `arm64`, `x86_64`
is `amd64`), so the machine is normalized as containerd/platforms does (database.go, `normalizeArch`) before the
two are compared. An image of another platform starts nowhere: every rank exits with `exec format error`, which
NVIDIA's vLLM playbook lists as "Container startup fails | Missing ARM64 image" (docs/troubleshooting.md). Saying
so before anything stops keeps the running generation serving (issue 29)."""

from __future__ import annotations

#: uname -m -> the OCI architecture (containerd/platforms database.go, normalizeArch), for the machines a Spark
#: cluster may hold: the GB10's Grace cores report aarch64; an x86 head or a workstation reports x86_64.
_OCI_ARCH = {"aarch64": "arm64", "arm64": "arm64", "armv8l": "arm64", "x86_64": "amd64", "x86-64": "amd64",
             "amd64": "amd64", "i386": "386", "i686": "386", "armv7l": "arm", "armhf": "arm"}


def machine_platform(machine: str) -> str:
    """`linux/ARCH` for a node's `uname -m` (an unknown machine name stands for itself: ppc64le, s390x, riscv64
    are the same word in both namings)."""
    return "linux/" + _OCI_ARCH.get(machine, machine)


def image_platform(os: str, architecture: str, variant: str = "") -> str:
    """`OS/ARCH[/VARIANT]` as docker prints an image's platform; "" when the inspect object did not say."""
    if not os or not architecture:
        return ""
    return "/".join(p for p in (os, architecture, variant) if p)


def runs_on(image: str, machine: str | None) -> bool:
    """Whether an image of platform `image` runs on a node whose `uname -m` is `machine`: OS and architecture
    equal (the variant only splits 32-bit arm, which no Spark runs). True when either is not known (an older
    snapshot, an image store that does not say): the other checks still judge the image."""
    if not image or not machine:
        return True
    return image.split("/")[:2] == machine_platform(machine).split("/")[:2]
