"""The probe is a list of facts (issue 54): `observe.probe_facts` names what a node's probe reads, one script is
those facts joined, and one reading parses each of them. A file of one deployment goes through the same list as
a file of several (its deployment's facts with no section prefix), so a fact cannot be left out of one of them
alone: until issue 54 a mutant that dropped the GPU fragment from the script of a file of one survived every test.
"""

from __future__ import annotations

from typing import Any

import pytest

from reconciler.core import spec
from reconciler.edge.facts.gpu import GPU_STACK
from reconciler.edge.observe import parse_probe, probe_facts, probe_script
from testbed.recordings import reseal
from tests.unit.core.test_deployments_plan import _two
from tests.unit.edge.test_deployments_probe import _per_deployment
from tests.unit.recorded import NONCE, RAW, load

#: What every node's probe reads of the node itself, with GPUs declared and a retention that prunes.
NODE_FACTS = {"docker", "links", "machine", "listen", "gpu", "memory", "copies"}

#: The GPU stack as a GB10 node answers (fixtures/nvidia-smi), in the recording's plain markers.
GPU_SECTIONS = ("@@gpu\nNVIDIA GB10, 580.95.05\n@@rc 0\n@@gpu_hook\n/usr/bin/nvidia-container-runtime-hook\n@@rc 0\n"
                "@@os\n6.17.0-1014-nvidia\nDGX_SWBUILD_VERSION=\"7.2.3\"\n@@rc 0\n")


def _declaring(desired: spec.Desired) -> spec.Desired:
    """`desired` with every deployment's serving containers given GPUs and a retention that prunes."""
    data: dict[str, Any] = desired.model_dump(mode="json")
    for deployment in data.get("deployments") or [data]:
        deployment["serving"]["docker"]["gpus"] = "all"
    data["policy"]["retention"]["prune"] = True
    return spec.Desired.model_validate(data)


FILES = {"one deployment": lambda: _declaring(load()), "several deployments": lambda: _declaring(_two())}


@pytest.mark.parametrize("which", FILES)
def test_the_probe_reads_the_gpu_stack_and_every_other_fact_of_each_node(which):
    desired = FILES[which]()
    for node in desired.nodes:
        probe = probe_facts(desired, node)
        head = {"identity"} if node.role == "head" else set()
        assert set(probe.node) == NODE_FACTS | head, node.name
        assert probe.node["gpu"] is GPU_STACK
        assert set(probe.deployments) == set(desired.deployment_names)
        for view in desired.views():
            api = {"serving"} if node.name == view.api_node.name else set()
            assert set(probe.deployments[view.deployment.name]) == {"image", "disk", "weights"} | api


@pytest.mark.parametrize("which", FILES)
def test_every_fact_of_the_probe_list_is_in_the_script(which):
    desired = FILES[which]()
    for node in desired.nodes:
        script = "\n" + probe_script(desired, node).script
        for fact in probe_facts(desired, node).facts():  # its lines, whole and in order (one may hold a newline)
            assert "\n" + "\n".join(fact.script) + "\n" in script, f"{node.name}: {fact.key} is not in the script"


@pytest.mark.parametrize("which", FILES)
def test_the_gpu_stack_is_read_from_the_probe_of_every_file(which):
    desired = FILES[which]()
    kept = RAW["outputs"]["head"]
    if len(desired.deployments) > 1:
        kept = _per_deployment(kept, tuple(desired.deployment_names))
    seen = parse_probe(desired, desired.node("head"), reseal(kept + "\n" + GPU_SECTIONS, NONCE), NONCE)
    assert seen.gpu_stack is not None and (seen.gpu_stack.gpu, seen.gpu_stack.driver) == ("NVIDIA GB10", "580.95.05")
    assert seen.gpu_stack.hook and seen.gpu_stack.dgx_os == "7.2.3"


def test_without_gpus_declared_the_probe_does_not_ask():
    desired = load()
    assert desired.serving.docker.gpus is None
    assert "gpu" not in probe_facts(desired, desired.node("head")).node
    assert "sec gpu" not in probe_script(desired, desired.node("head")).script
