"""Every serving node loads the same revision: served offline from the synced cache, and only when the source's
cache resolves `model.revision` the way huggingface_hub does offline (`refs/<revision>` for a branch or tag,
`snapshots/<commit>/` for a commit; huggingface_hub file_download.py)."""

from __future__ import annotations

import json

import pytest

from reconciler.core.drift import diff
from reconciler.core.loader import load_file
from reconciler.core.observed import Observed
from reconciler.core.planning import plan
from reconciler.core.spec import Desired
from reconciler.core.vllm import launch_specs

REV = "0f6e4b1a9d3c2b5a8e7f6d5c4b3a29181716151a"  # the seed snapshot's commit (tests/fixtures)


def _setup(cluster_yaml, seed_snapshot, **model) -> tuple[Desired, Observed]:
    data = load_file(cluster_yaml).data
    data["model"].update(model)
    return Desired.model_validate(data), Observed.model_validate(json.loads(seed_snapshot.read_text()))


@pytest.mark.parametrize("revision", ["main", REV])
def test_a_revision_the_source_cache_resolves_is_copied(cluster_yaml, seed_snapshot, revision):
    desired, observed = _setup(cluster_yaml, seed_snapshot, revision=revision)
    assert not [d for d in diff(desired, observed) if d.kind == "weights" and d.blocking]
    assert any(s.kind == "weights" for s in plan(desired, observed).steps)


@pytest.mark.parametrize("revision", ["v2.0", "1" * 40, REV[:7]])
def test_a_revision_the_source_cache_lacks_is_downloaded_before_any_copy_or_start(cluster_yaml, seed_snapshot,
                                                                                   revision):
    desired, observed = _setup(cluster_yaml, seed_snapshot, revision=revision)
    weights = [d for d in diff(desired, observed) if d.kind == "weights"]
    assert len(weights) == 1 and weights[0].node == desired.source_node and weights[0].actionable
    assert f"neither refs/{revision} nor snapshots/{revision}/" in weights[0].observed
    assert f"--revision {revision}" in weights[0].observed
    steps = plan(desired, observed).steps
    assert [s.id for s in steps if s.kind == "download"] == [f"download/{desired.source_node}"]
    assert not [s for s in steps if s.kind in ("weights", "start-serving")]


def test_a_revision_an_offline_source_lacks_blocks_copy_and_start(cluster_yaml, seed_snapshot):
    desired, observed = _setup(cluster_yaml, seed_snapshot, revision="v2.0")
    data = desired.model_dump(mode="json")
    data["nodes"] = [{**n, "internet": False} for n in data["nodes"]]
    desired = Desired.model_validate(data)
    blocking = [d for d in diff(desired, observed) if d.kind == "weights" and d.blocking]
    assert len(blocking) == 1 and blocking[0].node == desired.source_node and not blocking[0].actionable
    assert "--revision v2.0" in blocking[0].observed and "no internet" in blocking[0].observed
    assert not [s for s in plan(desired, observed).steps if s.kind in ("download", "weights", "start-serving")]


def test_hf_hub_offline_only_where_the_cache_is_served(cluster_yaml, seed_snapshot):
    cached, _ = _setup(cluster_yaml, seed_snapshot)
    plain, _ = _setup(cluster_yaml, seed_snapshot, layout="plain", path="/models/qwen")
    assert all(s.env["HF_HUB_OFFLINE"] == "1" for s in launch_specs(cached))
    assert all("HF_HUB_OFFLINE" not in s.env for s in launch_specs(plain)), "vllm#23684: a local path breaks"
    assert not [d for d in diff(plain, _) if d.kind == "weights" and d.blocking]


def test_a_source_serving_alone_is_checked_too_and_reported_once(cluster_yaml, seed_snapshot):
    data = load_file(cluster_yaml).data
    data["model"]["revision"] = "v9"
    data["serving"] |= {"nodes": [data["nodes"][0]["name"]], "tensor_parallel_size": 1}
    desired = Desired.model_validate(data)
    observed = Observed.model_validate(json.loads(seed_snapshot.read_text()))
    weights = [d for d in diff(desired, observed) if d.kind == "weights"]
    assert len(weights) == 1 and weights[0].node == desired.source_node
    steps = plan(desired, observed).steps
    assert [s.kind for s in steps if s.kind in ("download", "start-serving")] == ["download"]
