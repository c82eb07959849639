"""`reconciler discover`: read what is on the nodes and write a commented starter desired state.

Why it exists: the desired state names interfaces, RDMA devices, addresses, model paths and images that an
operator would otherwise copy by hand from `ip addr`, `ibdev2netdev` and `docker images` on every node. discover
reads them once, over the same strict-host-key SSH sessions as everything else, and writes a file in which every
value it inferred rather than read carries a `# GUESS:` comment. The result must pass `spec.loads`; the operator
reviews the guesses before the first `apply`.

Three steps, one module each:

- `facts`: one batched, read-only script per node and the pure parsers of what it prints (`NodeFacts`), sharing
  the probe's fragments and parsers (`reconciler.edge.facts`) wherever both read the same fact;
- `guess`: the inferences (which port is the fabric, which address, which model, image, memory share), each with
  the reason the file shows;
- `render`: the YAML document, built with ruamel.yaml, comments attached to the values they explain.

This module opens the sessions and runs the script (the CLI's `reconciler discover` calls `sessions_for`,
`probe`, `render`); the names below are the package's interface.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from reconciler.core import spec
from reconciler.edge.discover.facts import (
    SCRIPT_LINES,
    Iface,
    ModelDir,
    NodeFacts,
    RdmaLink,
    RunningContainer,
    facts_from_sections,
    parse_commands,
    parse_ibdev2netdev,
    parse_images,
    parse_ip_addr,
    parse_meminfo,
    parse_models,
    parse_rdma_sysfs,
    running_containers,
)
from reconciler.edge.discover.guess import FabricGuess, guess_fabric, holds_serving_port, next_free_address
from reconciler.edge.discover.render import ModelChoice, render
from reconciler.edge.facts.base import read_sections
from reconciler.edge.ssh import Session

__all__ = ["FabricGuess", "Iface", "ModelChoice", "ModelDir", "NodeFacts", "RdmaLink", "RunningContainer",
           "guess_fabric", "holds_serving_port", "next_free_address", "parse_commands", "parse_ibdev2netdev",
           "parse_images", "parse_ip_addr", "parse_meminfo", "parse_models",
           "parse_rdma_sysfs", "probe", "render", "running_containers", "sessions_for"]

def sessions_for(head: str, workers: list[str], *, user: str, known_hosts: str, identity: str | None,
                 jump: bool, port: int = 22) -> list[Session]:
    """A session per host, head first; the workers through the head's session when `jump`. Raises pydantic's
    ValidationError on a host, user or path the spec would refuse."""

    def ssh(host: str, via: str | None) -> spec.Ssh:
        return spec.Ssh(host=host, user=user, port=port, jump=via, known_hosts=known_hosts, identity_file=identity)

    head_session = Session("head", ssh(head, None))
    sessions = [head_session]
    for i, worker in enumerate(workers, start=1):
        sessions.append(Session(f"worker{i}", ssh(worker, "head" if jump else None),
                                gateway=head_session if jump else None))
    return sessions


def probe(sessions: list[Session], timeout: float = 60) -> list[NodeFacts]:
    """Run the script once per session, in parallel (head first in the result); raises RemoteError on SSH
    problems."""

    def read(session: Session) -> NodeFacts:
        return facts_from_sections(session.ssh.host, read_sections(session, SCRIPT_LINES, timeout))

    with ThreadPoolExecutor(max_workers=min(8, len(sessions))) as pool:
        return list(pool.map(read, sessions))
