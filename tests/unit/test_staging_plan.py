"""Staging on the internet node (issue 32, finding 4), planned from the recorded seed: a fresh head holds neither
the model nor the image. The plan downloads and pulls on the head, stops nothing while the start cannot happen,
and, once both are there, copies to the worker while the GLM co-tenant still serves, then stops it, then starts."""

from __future__ import annotations

import json

import pytest

from reconciler.core import spec
from reconciler.core.observed import Observed, Weights
from reconciler.core.planning import plan
from reconciler.core.simulate import apply_plan
from reconciler.edge.steps.staging import hub_size

HEAD, WORKER = "spark-1a32", "spark-5be3"


@pytest.fixture
def seed(cluster_yaml, seed_snapshot) -> tuple[spec.Desired, Observed]:
    desired = spec.load(str(cluster_yaml), {"VLLM_API_KEY": "k", "HF_TOKEN": "t"})
    return desired, Observed.model_validate_json(seed_snapshot.read_bytes())


def _fresh_head(desired: spec.Desired, observed: Observed) -> Observed:
    head = observed.node(HEAD)
    bare = head.model_copy(update={"images": {k: v for k, v in head.images.items() if k != desired.serving.image},
                                   "weights": Weights(root=desired.weights_root(HEAD), present=False)})
    return observed.model_copy(update={"nodes": {**observed.nodes, HEAD: bare}})


def test_the_seed_runs_glm_the_file_does_not_allow(seed):
    desired, observed = seed
    assert [s.id for s in plan(desired, observed).steps if s.kind == "stop-container"] == [
        f"stop-container/{HEAD}/vllm_node"]


def test_a_fresh_head_stages_and_keeps_glm_serving(seed):
    desired, observed = seed
    result = plan(desired, _fresh_head(desired, observed))
    assert [s.id for s in result.steps if s.kind in ("pull-image", "download")] == [f"pull-image/{HEAD}",
                                                                                    f"download/{HEAD}"]
    assert not [s.id for s in result.steps if s.kind in ("stop-container", "stop-serving", "start-serving")]
    kept = [b.reason for b in result.blocked if b.reason.startswith("vllm_node keeps running")]
    assert len(kept) == 1 and f"download/{HEAD}" in kept[0] and f"pull-image/{HEAD}" in kept[0]
    download = next(s for s in result.steps if s.kind == "download")
    assert download.path == desired.model.path_on(HEAD)


def test_once_staged_the_copies_run_before_glm_stops_and_the_start_after(seed):
    desired, observed = seed
    fresh = _fresh_head(desired, observed)
    staged = apply_plan(desired, observed, plan(desired, fresh))  # the head as the seed had it: both there
    staged = staged.model_copy(update={"nodes": {**staged.nodes, HEAD: observed.node(HEAD)}})
    steps = plan(desired, staged).steps
    index = {s.id: i for i, s in enumerate(steps)}
    stop = steps[index[f"stop-container/{HEAD}/vllm_node"]]
    assert set(stop.after) == {f"image/{WORKER}", f"weights/{WORKER}"}
    assert all(index[a] < index[stop.id] for a in stop.after)
    starts = [s for s in steps if s.kind == "start-serving"]
    assert starts and all(stop.id in s.after for s in starts)


def test_an_offline_head_says_how_and_stages_nothing(cluster_yaml, seed_snapshot, tmp_path):
    text = cluster_yaml.read_text()
    assert text.count("internet: true") == 1
    offline = tmp_path / "cluster.yaml"
    offline.write_text(text.replace("internet: true", "internet: false"))
    desired = spec.load(offline, {"VLLM_API_KEY": "k", "HF_TOKEN": "t"})
    observed = Observed.model_validate_json(seed_snapshot.read_bytes())
    result = plan(desired, _fresh_head(desired, observed))
    assert not [s for s in result.steps if s.kind in ("pull-image", "download", "stop-container")]
    reasons = " ".join(b.reason for b in result.blocked)
    assert "`docker pull " in reasons and "`hf download " in reasons and "vllm_node keeps running" in reasons


@pytest.mark.parametrize(("payload", "total"), [
    ({"sha": "a", "siblings": [{"rfilename": "config.json", "size": 10}, {"rfilename": "m.safetensors",
                                                                          "size": 2**31}]}, 10 + 2**31),
])
def test_the_hubs_size_is_the_sum_of_its_files(payload, total):
    assert hub_size(json.dumps(payload)) == total


@pytest.mark.parametrize("payload", [
    {"siblings": [{"rfilename": "a"}]},  # asked without blobs=true: no sizes
    {"siblings": []},
    {"error": "Repository not found"},
    [1, 2],
    {"siblings": [{"rfilename": "a", "size": -1}]},
    {"siblings": [{"rfilename": "a", "size": "10"}]},
])
def test_an_answer_without_every_size_downloads_nothing(payload):
    with pytest.raises(ValueError):
        hub_size(json.dumps(payload))


def test_apply_shows_the_download_as_a_bar_of_the_hubs_size():
    import io

    from rich.console import Console

    from reconciler.loop.apply import _ProgressView

    out = io.StringIO()
    view = _ProgressView(Console(file=out, force_terminal=True, width=100))
    view("download.start", {"node": "spark-1a32", "bytes_total": 4 << 20, "model": "m", "revision": "r"})
    view("download.progress", {"node": "spark-1a32", "bytes_done": 2 << 20, "bytes_total": 4 << 20})
    view("pull.progress", {"node": "spark-1a32", "layers_done": 1, "layers_seen": 3})  # no bar: no byte total
    assert view.bars is not None
    (task,) = view.bars.tasks
    view.stop()
    assert task.description == "download on spark-1a32" and task.completed == 2 << 20 and task.total == 4 << 20
