"""A converged 4-node cluster as the probe really saw it, and the edits the world makes to it.

`fixtures/probe-4-nodes.json` holds what `probe_script` printed on each node of a converged 4-node testbed
(recorded 2026-12-06 over the daemon's own SSH sessions by `bench.sim.record`; see test_probe_recorded.py). The
case tests (test_drift_cases.py, test_plan_cases.py) start from it, change one thing the way a probe would see it
change, and compare the whole result with one written by hand.
"""

from __future__ import annotations

import json
from pathlib import Path

from reconciler.core import spec
from reconciler.core.observed import Container, Link, Observed
from reconciler.core.vllm import launch_specs
from reconciler.edge.facts.base import split_sections
from reconciler.edge.observe import parse_probe
from testbed.recordings import reseal
from tests.unit.edits import edited

FIXTURE = Path(__file__).with_name("fixtures") / "probe-4-nodes.json"
RAW = json.loads(FIXTURE.read_text())
WORKERS = ("worker1", "worker2", "worker3")
IF0, IF1 = "enp1s0f1np1", "enP2p1s0f1np1"  # the testbed's fabric port and its twin (docs/testbed.md)
WEIGHTS = "weights/testorg/tiny-moe"
IMAGE = "image/vllm-standin:latest"
SERVING = "container/vllm_serving"
REV = "1111111111111111111111111111111111111111"


def _cluster_id() -> str:
    """The head's cluster id as the recording's probe read it (its `identity` section): the label the recorded
    serving containers carry (core/ownership.py)."""
    head = RAW["outputs"]["head"]
    return head.split("@@identity\n", 1)[1].split("\n", 1)[0]


CLUSTER_ID = _cluster_id()


def load(*edits: tuple[str, str]) -> spec.Desired:
    """The recorded cluster's desired state, with each `before` replaced by `after`."""
    return spec.loads(edited(RAW["desired"], *edits), "testbed.yaml")


NONCE = "0123456789abcdef0123456789abcdef"  # the recording's markers sealed with this (testbed/recordings.py)


def parsed(desired: spec.Desired, node: str, output: str | None = None) -> object:
    """One node's recorded output (or `output`, kept unsealed like it) parsed as the probe would."""
    return parse_probe(desired, desired.node(node), reseal(RAW["outputs"][node] if output is None else output, NONCE),
                       NONCE)


def sections_of(kept: str) -> dict:
    """Output kept with plain `@@NAME`/`@@rc N` markers (a recording, or one written in a test) split as the probe
    splits its sealed output."""
    return split_sections(reseal(kept, NONCE), NONCE)


def observe(desired: spec.Desired) -> Observed:
    return Observed(nodes={n.name: parsed(desired, n.name) for n in desired.nodes})


def changed(observed: Observed, node: str, **fields: object) -> Observed:
    """`observed` with some fields of one node's observation replaced, as a probe would have seen them."""
    nodes = dict(observed.nodes)
    nodes[node] = nodes[node].model_copy(update=fields)
    return observed.model_copy(update={"nodes": nodes})


def link(observed: Observed, node: str, **fields: object) -> Link:
    fabric = observed.node(node).fabric
    assert fabric is not None
    return fabric.model_copy(update=fields)


def without(observed: Observed, node: str, container: str) -> list[Container]:
    return [c for c in observed.node(node).containers if c.name != container]


def serving_with(observed: Observed, node: str, **fields: object) -> list[Container]:
    """The node's containers, its serving container changed."""
    c = observed.node(node).container("vllm_serving")
    assert c is not None
    return [*without(observed, node, "vllm_serving"), c.model_copy(update=fields)]


def hashes(desired: spec.Desired) -> dict[str, str]:
    return {s.node: s.spec_hash for s in launch_specs(desired)}
