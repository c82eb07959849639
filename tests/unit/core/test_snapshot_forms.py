"""A snapshot of the single form read for a file of several deployments (issue 52, item 10): `plan --observed`
with what `observe --json` wrote for a file of one. Each deployment takes a node's tree only where the tree is
its own (the root its model puts there), never the one tree listed for every deployment.

Facts: the recorded four-node cluster (tests/unit/fixtures/probe-4-nodes.json) serving `tiny-moe`; the file adds
`dense` (testorg/tiny-dense, another tree) on the head."""

from __future__ import annotations

import json

from reconciler.core import spec
from reconciler.core.drift import diff
from tests.unit.recorded import load, observe


def _with_dense() -> spec.Desired:
    one = load()
    data = one.model_dump(mode="json")
    big = {"name": "big", "model": data.pop("model"), "serving": data.pop("serving")}
    dense = {"name": "dense", "model": {**big["model"], "id": "testorg/tiny-dense", "revision": "main"},
             "serving": {**big["serving"], "container_name": "vllm_dense", "port": 8003, "nodes": ["head"],
                         "tensor_parallel_size": 1, "gpu_memory_utilization": 0.05, "served_model_name": "dense"}}
    return spec.Desired.model_validate({**data, "deployments": [big, dense]})


def _roots(desired: spec.Desired) -> dict[str, dict[str, str]]:
    return {v.deployment.name: {n.name: v.weights_root(n.name) for n in v.nodes} for v in desired.views()}


def test_each_deployment_takes_only_its_own_tree_from_a_single_form_snapshot():
    desired = _with_dense()
    single = observe(load())
    tree = single.node("head").weights
    assert tree is not None and tree.root.endswith("models--testorg--tiny-moe"), "the premise: one tree listed"
    spread = single.by_deployment(_roots(desired))
    assert spread.view("big").node("head").weights == tree
    assert spread.view("dense").node("head").weights is None, "another model's tree is not this one's"
    said = [d for d in diff(desired, spread) if d.kind == "weights" and d.deployment == "dense"]
    assert said and "missing" in said[0].observed, said
    assert not [d for d in diff(desired, single) if d.kind == "weights" and d.deployment == "dense"], (
        "the premise: read as it was, the one tree passed for dense's own")


def test_a_snapshot_with_per_deployment_facts_or_a_file_of_one_is_left_as_it_is():
    single = observe(load())
    assert single.by_deployment(_roots(load())) is single
    desired = _with_dense()
    spread = single.by_deployment(_roots(desired))
    assert spread.by_deployment(_roots(desired)) is spread


def test_plan_observed_reads_a_single_form_snapshot_per_deployment(console_script, tmp_path):
    """The command itself: the file of two deployments, the snapshot a file of one wrote. `dense`'s tree is not
    on the head, so its weights are missing there (never `tiny-moe`'s tree taken for it)."""
    import yaml

    from tests.unit.cli.test_cli import run

    path = tmp_path / "several.yaml"
    path.write_text(yaml.safe_dump(_with_dense().model_dump(mode="json"), sort_keys=False, explicit_end=True))
    snapshot = tmp_path / "single.json"
    snapshot.write_text(observe(load()).model_dump_json())
    result = run(console_script, "plan", path, "--observed", snapshot, "--json")
    assert result.returncode == 2, (result.stdout, result.stderr)
    drift = json.loads(result.stdout)["drift"]
    dense = [d for d in drift if d["kind"] == "weights" and d.get("deployment") == "dense"]
    assert dense and "missing" in dense[0]["observed"], drift
