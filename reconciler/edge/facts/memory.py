"""Memory on a node: MemTotal and MemAvailable (`MEMORY`, the unified memory GPU and CPU share) and, once a rank
serves, what it holds and the network NCCL chose (`rank_fact`)."""

from __future__ import annotations

import functools
from dataclasses import dataclass

from reconciler.core.nccl import NETWORK_LINES, is_network_name
from reconciler.core.observed import (
    Memory,
)
from reconciler.edge.facts.base import Fact, ProbeError, Section, each_line, node_json, node_output
from reconciler.edge.facts.containers import containers_script, parse_containers
from reconciler.edge.ssh import quote_word


def memory_script() -> list[str]:
    """The `meminfo` section: MemTotal and MemAvailable, the unified memory GPU and CPU share (`parse_memory`)."""
    return ["sec meminfo", "grep -E '^(MemTotal|MemAvailable):' /proc/meminfo; rc $?"]


@node_output("meminfo")
def parse_memory(sec: Section | None) -> Memory | None:
    if sec is None or sec.rc != 0:
        return None
    values = {}
    for line in each_line(sec.body):  # every line a number, and only the two kept (issue 53: a million other
        key, _, rest = line.partition(":")  # keys, 13 MiB, made a dict of 180 MiB)
        value = int(rest.split()[0]) * 1024
        if key in ("MemTotal", "MemAvailable"):
            values[key] = value
    return Memory(total_bytes=values["MemTotal"], available_bytes=values["MemAvailable"])


MEMORY: Fact[Memory | None] = Fact("meminfo", tuple(memory_script()),
                                   lambda sections: parse_memory(sections.get("meminfo")))


@dataclass(frozen=True)
class RankSeen:
    """A serving node once its rank answers: MemTotal and MemAvailable (`memory`, None when unread), the rank
    container's cgroup memory.current (`current`: the Docker Engine API's `memory_stats.usage`, memory.current on
    cgroup v2 and memory.usage_in_bytes on v1; None when unread), the names of the containers running on the
    node (`running`: whose reservations the budget counts there now), the rank container's id (`container`: which
    start the reading is of; None when not seen running) and the networks its log says NCCL chose (`networks`,
    `core.nccl`: None when the log was not read, empty when it names none)."""

    memory: Memory | None
    current: int | None
    running: tuple[str, ...]
    container: str | None = None
    networks: tuple[str, ...] | None = None


def parse_stats_usage(sec: Section | None) -> int | None:
    """`memory_stats.usage` of one `GET /containers/NAME/stats?stream=false` answer; None for anything else (an
    engine that did not answer, a container not running: docker then sends `"memory_stats":{}`)."""
    if sec is None or sec.rc != 0:
        return None
    try:
        usage = node_json(sec.body).get("memory_stats", {}).get("usage")
    except (ValueError, AttributeError):
        return None
    return usage if isinstance(usage, int) and not isinstance(usage, bool) and usage >= 0 else None


MAX_NETWORKS = 8  # distinct network names a rank's reading keeps: NCCL has three kinds (IB, Socket, a plugin)


def parse_networks(sec: Section | None) -> tuple[str, ...] | None:
    """The distinct networks of the node's `uniq -c` rows (`COUNT NAME`), most named first, ties by name
    (`core.nccl`); None when the section is missing or failed. A row that is not one is skipped, never a
    ProbeError: the node's `sed` prints only what `NETWORK_LINES` captured, so only a node that does not run the
    script sends anything else."""
    if sec is None or sec.rc != 0:
        return None
    counted: list[tuple[int, str]] = []
    for line in sec.body.splitlines()[:MAX_NETWORKS]:
        count, _, name = line.strip().partition(" ")
        if count.isdigit() and is_network_name(name) and name not in (n for _, n in counted):
            counted.append((int(count), name))
    return tuple(name for _, name in sorted(counted, key=lambda c: (-c[0], c[1])))


def networks_program() -> str:
    """The `sed -n -E` program that prints the network's name of each `NETWORK_LINES` line of a log, and nothing
    else (`|` delimits: the names and the patterns hold no `|`)."""
    return "; ".join(f"s|.*{line}.*|\\1|p" for line in NETWORK_LINES)


def parse_rank(container: str, sections: dict[str, Section]) -> RankSeen:
    """The reading, each part on its own: a part that does not parse is unread (None, or no running names), never
    a ProbeError. The rank already serves; what it holds is told, never a reason to fail its start."""
    try:
        memory = parse_memory(sections.get("meminfo"))
    except ProbeError:
        memory = None
    try:
        ok, _, found = parse_containers(sections.get("containers"))
    except ProbeError:
        ok, found = False, []
    running = tuple(c.name for c in found if c.running) if ok else ()
    mine = next((c.id for c in found if c.name == container and c.running), None) if ok else None
    return RankSeen(memory, parse_stats_usage(sections.get("stats")), running, mine,
                    parse_networks(sections.get("nccl")))


#: seconds `docker logs` of a rank may take on its node: a start's whole log, read once after it served
RANK_LOG_DEADLINE = 20


def rank_fact(container: str) -> Fact[RankSeen]:
    """The node of a rank that serves: /proc/meminfo, its running containers (`containers_script`), the
    container's memory from the Docker Engine API over the socket (the reading docker's own `docker stats` makes,
    the same on the cgroup v2 of DGX OS and the cgroup v1 of the testbed's engines; `one-shot`: one sample, no
    second for the CPU's rate) and the networks NCCL chose, counted on the node from the container's whole log
    (its start's: each start is a new container), so only a few short rows cross (`parse_networks`). `sed`, not
    `grep -a`: a log line is text vLLM's processes wrote, and only the captured name may leave the node."""
    url = f"http://docker/containers/{container}/stats?stream=false&one-shot=true"
    return Fact(f"rank {container}",
                (*memory_script(), *containers_script(), "sec stats",
                 f"curl -sf --max-time 10 --unix-socket \"$sock\" {quote_word(url)} 2>&1; rc $?",
                 "sec nccl",
                 f"timeout {RANK_LOG_DEADLINE} docker logs {quote_word(container)} 2>&1 | "
                 f"sed -n -E {quote_word(networks_program())} | sort | uniq -c | sort -rn | head -n {MAX_NETWORKS}; "
                 "rc 0"),
                functools.partial(parse_rank, container))
