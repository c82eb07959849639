"""Which network NCCL chose on a rank, judged against the fabric the file declares. Pure.

A start holds NCCL to its IB/RoCE transport where the fabric declares RDMA devices (`core.vllm.NCCL_AT_START`:
NCCL_NET=IB), so a rank whose RDMA init fails stops the start instead of serving on sockets. Sockets can still
be what runs: `serving.env` sets NCCL_NET itself (to Socket, or to a plugin's name), or the port had no carrying
RDMA device at the start. A tensor-parallel group on NET/Socket answers, at about a quarter of the speed
(timothystewart6/vllm-gb10 PR #24: IB disabled "cuts throughput ~4x"), and nothing else would say so.

What NCCL chose is in two kinds of line, both printed under the subsystems the start asks for (NCCL_DEBUG=INFO,
NCCL_DEBUG_SUBSYS=INIT,NET): one per communicator at its init, `NCCL INFO Using network NAME` (NVIDIA/nccl
`src/init.cc`: `INFO(NCCL_INIT, "Using network %s", ...)`), and one per channel that crosses the network,
`NCCL INFO Channel 00/0 : 1[0] -> 0[0] [send] via NET/NAME/0` (`src/transport/net.cc`, `sendSetup`/`recvSetup`:
`INFO(NCCL_INIT|NCCL_NET, "... via NET/%s/%d...", comm->ncclNet->name, ...)`). NAME is `IB` for NCCL's
own IB/RoCE transport, `Socket` for its TCP one, or a plugin's name: the HPC-X RDMA plugin NGC's images carry
names itself `IBext_v8`, `IBext_v10` (NVIDIA/nccl#1538; on a DGX Spark, mark-ramsey-ri/vllm-dgx-spark#1). Under
NCCL_NET=IB NCCL takes the net whose name is exactly that one (`initNet` compares the names) or fails the init
with "Error: network IB not found."; so `IB…` is RDMA, `Socket` is the fallback, and anything else is said as it
is. The recordings the tests read are those issues' own lines (tests/unit/fixtures/nccl/).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

_NAME = r"[A-Za-z0-9_.-]{1,40}"
#: The lines of a rank's log that name the network, as POSIX EREs whose one group is the name: what the node's
#: `sed` keeps of the log (edge/facts/memory.py `rank_fact`), so only names cross.
NETWORK_LINES = (rf"NCCL INFO Using network ({_NAME})", rf"NCCL INFO Channel .* via NET/({_NAME})/")

SOCKET = "Socket"


def is_network_name(name: str) -> bool:
    """A name as NCCL prints it (`NETWORK_LINES`): what the node's reading may carry, nothing else."""
    return re.fullmatch(_NAME, name) is not None


def is_rdma(name: str) -> bool:
    """NCCL's own IB/RoCE transport (`IB`) or an IB plugin (`IBext_v10`): both move the tensors over verbs."""
    return name.startswith("IB")


@dataclass(frozen=True)
class Transport:
    """One rank's network as status tells it (condition NcclTransport): `ok` False for a fallback to sockets;
    None while nothing says which network runs."""

    ok: bool | None
    reason: str
    message: str

    @property
    def socket_fallback(self) -> bool:
        return self.ok is False


def judge(networks: Sequence[str] | None, rdma_devices: Sequence[str]) -> Transport:
    """The networks a rank's log names (`networks`: None when its log was not read, empty when it names none) on a
    node whose fabric declares these RDMA devices (a node that declares none asks for sockets: nothing to judge,
    `loop.conditions.transport_results` leaves it out)."""
    if networks is None:
        return Transport(None, "NotRead", "the rank's log could not be read after it served")
    if not networks:
        return Transport(None, "NotLogged", "the rank's log names no network (`NCCL INFO Using network`, "
                         "`via NET/`): serving.env sets NCCL_DEBUG below INFO, the ranks run no NCCL (vLLM on CPU), "
                         "or `docker logs` did not answer in time")
    said = ", ".join(networks)
    if SOCKET in networks:
        return Transport(False, "SocketFallback",
                         f"NCCL chose {said} although the fabric declares {', '.join(rdma_devices)}: the tensors "
                         "cross the fabric over TCP at about a quarter of the speed (serving.env sets NCCL_NET, or "
                         "the port had no carrying RDMA device at the start)")
    if all(is_rdma(n) for n in networks):
        return Transport(True, "Rdma", f"NCCL chose {said}")
    return Transport(True, "OtherNetwork", f"NCCL chose {said}")
