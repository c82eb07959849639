"""A testbed node's GPU stack, answering as a DGX Spark's does: an `nvidia-smi` stand-in on the node's PATH (what
the reconciler's probe runs over SSH) and an `nvidia-container-runtime-hook` stand-in on its dockerd's PATH.

moby registers its `nvidia` device driver, which `docker run --gpus` selects, only when dockerd finds
`nvidia-container-runtime-hook` on its PATH at start, and runs it as each such container's OCI prestart hook
(moby daemon/nvidia_linux.go: `exec.LookPath(nvidiaHook)` in `init`, `setNvidiaGPUs` adds the hook). With the
stand-in there, `--gpus all` is accepted as on a Spark, and desired-state/testbed.yaml asks for it like the sample.

`set_state` switches both to what a real node does after a driver update without a reboot (`mismatch`: "Failed
to initialize NVML: Driver/library version mismatch", NVML's return 18), with the driver not loaded (`no-driver`,
9), or with nvidia-smi hanging on a wedged driver (`hung`). The hook then fails every `--gpus` start the way the
NVIDIA container toolkit's does ("nvidia-container-cli: initialization error: ..."), while running containers go
on, as they do on a real node. The GPU's name and driver are the seed's Sparks' (NVIDIA GB10, 580.95.05).
"""

from __future__ import annotations

from pathlib import Path

from .layout import Node

STATES = ("ok", "mismatch", "no-driver", "hung")
GPU = "NVIDIA GB10"
DRIVER = "580.95.05"

_NVIDIA_SMI = """#!/bin/sh
# testbed stand-in for nvidia-smi on a DGX Spark (testbed/gpu.py); state: {state}
read -r state driver < {state}
case "$state" in
  mismatch) echo "Failed to initialize NVML: Driver/library version mismatch"
            echo "NVML library version: 580.126"; exit 18 ;;
  no-driver) echo "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. Make sure that the \
latest NVIDIA driver is installed and running."; echo; exit 9 ;;
  hung) exec sleep 600 ;;
esac
for a in "$@"; do
  case "$a" in
    -L) echo "GPU 0: {gpu} (UUID: GPU-00000000-0000-0000-0000-000000000000)"; exit 0 ;;
    --query-gpu=name,driver_version) echo "{gpu}, $driver"; exit 0 ;;
  esac
done
echo "the testbed's nvidia-smi answers -L and --query-gpu=name,driver_version --format=csv,noheader" >&2
exit 2
"""

_HOOK = """#!/bin/sh
# testbed stand-in for the NVIDIA container toolkit's OCI prestart hook (testbed/gpu.py): runc passes the
# container's state on stdin; a failure here fails `docker run --gpus` as the real hook's does
cat >/dev/null
read -r state driver < {state}
case "$state" in
  ok) exit 0 ;;
  mismatch) echo "nvidia-container-cli: initialization error: nvml error: driver/library version mismatch" >&2 ;;
  *) echo "nvidia-container-cli: initialization error: driver error: failed to process request" >&2 ;;
esac
exit 1
"""


def bin_dir(node: Node) -> Path:
    """Put first on the node's PATH (its sshd sessions) and on its dockerd's."""
    return node.state / "gpu" / "bin"


def _state_file(node: Node) -> Path:
    return node.state / "gpu" / "state"


def install(node: Node) -> None:
    """Write both stand-ins (idempotent) and put the node's GPU back to `ok`."""
    d = bin_dir(node)
    d.mkdir(parents=True, exist_ok=True)
    for parent in (d.parent, d):
        parent.chmod(0o755)
    for name, text in (("nvidia-smi", _NVIDIA_SMI), ("nvidia-container-runtime-hook", _HOOK)):
        f = d / name
        f.write_text(text.format(state=_state_file(node), gpu=GPU))
        f.chmod(0o755)
    set_state(node, "ok")


def set_state(node: Node, state: str, driver: str = DRIVER) -> str:
    if state not in STATES:
        raise ValueError(f"gpu state must be one of {STATES}, not {state!r}")
    f = _state_file(node)
    f.write_text(f"{state} {driver}\n")
    f.chmod(0o644)
    return f"{node.name}: GPU {state} (driver {driver})"
