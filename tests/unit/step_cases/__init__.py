"""Data-driven cases of every step (reconciler/edge/steps/), one per case, in the manner of pyinfra's
`tests/operations/*/*.json`: the step, the facts its re-reads see (recorded node output, parsed by the fact's own
parser), and the exact commands it must run, or the refusal it must end with. tests/unit/steps/test_step_cases.py runs
them all through tests/unit/step_driver.py.

A module per step family (containers.py, link.py, ...) holds a `CASES` list; `ALL` joins them.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

from reconciler.core.observed import NodeObservation, Observed
from reconciler.core.planning import Step
from reconciler.core.spec import Desired
from reconciler.edge.ssh import Result
from tests.unit.step_driver import Raw

HEAD, WORKER = "spark-1a32", "spark-5be3"  # the sample's nodes (desired-state/cluster.yaml)


@cache
def sample() -> Desired:
    """The sample desired state (desired-state/cluster.yaml), with the unit tests' secret in the environment."""
    from reconciler.core.spec import load
    from tests.unit.conftest import REPO

    return load(REPO / "desired-state" / "cluster.yaml", environ={"VLLM_API_KEY": "sk-unit-tests-0123456789"})


@dataclass(frozen=True)
class Case:
    """One step case: `step` run over `facts` (and `results` for the commands that answer something) must run
    exactly `commands`, then end with nothing raised or with `raises` (a regex of the message, and `error` its
    type's name)."""

    name: str
    step: Step
    commands: Sequence[str]
    facts: Mapping[str, Sequence[object]] = field(default_factory=dict)
    results: Mapping[str, Sequence[Result]] = field(default_factory=dict)
    raises: str | None = None
    error: str = "StepFailed"
    timeouts: Mapping[str, float | None] = field(default_factory=dict)  # "NODE ARGV" -> its own deadline
    desired: Callable[[], Desired] = sample
    observed: Callable[[], Observed] = lambda: reachable()
    generation: int = 1

    def __str__(self) -> str:
        return self.name


#: A node's host key as the reconciler's known_hosts holds it (the image and weights hops check it strictly).
HOST_KEY = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOZ9kXyYF4Qw1pW0Wm4g0eQyVY3b0kq1o0rVq7mZ2h1a"


def with_known_hosts(desired: Desired) -> Desired:
    """`desired` with every node's `ssh.known_hosts` a file of its own that holds each node's key (`HOST_KEY`):
    what the hop between two nodes reads to pin the target's key."""
    known = Path(tempfile.mkdtemp(prefix="step-cases-")) / "known_hosts"
    known.write_text("".join(f"{n.ssh.host} {HOST_KEY}\n" for n in desired.nodes))
    nodes = [n.model_copy(update={"ssh": n.ssh.model_copy(update={"known_hosts": str(known)})})
             for n in desired.nodes]
    return desired.model_copy(update={"nodes": nodes})


def reachable(*names: str) -> Observed:
    """An observation in which the nodes answered and told nothing else (no cluster id: the head's ssh host:port
    names the cluster)."""
    return Observed(nodes={n: NodeObservation(name=n, reachable=True) for n in names or (HEAD, WORKER)})


def inspected(name: str, state: str = "running", labels: Mapping[str, str] | None = None,
              exit_code: int = 0) -> Raw:
    """`docker inspect --format` of one container (`facts.containers.container_fact`), as a node prints it."""
    return Raw(json.dumps({"name": f"/{name}", "id": "c0ffee" * 10 + "0123", "image": "img:1", "image_id": "sha256:ab",
                           "state": state, "labels": dict(labels or {}), "started_at": "2026-12-06T10:00:00Z",
                           "mounts": [], "exit_code": exit_code}))


def no_such(name: str) -> Raw:
    return Raw(f"Error: No such container: {name}", 1)


def all_cases() -> list[Case]:
    from tests.unit.step_cases import containers, images, link, retention, serving, staging, weights

    return [*containers.CASES, *images.CASES, *link.CASES, *retention.CASES, *serving.CASES, *staging.CASES,
            *weights.CASES]
