"""Staging on the internet node (issue 32, finding 4), planned from the recorded seed: a fresh head holds neither
the model nor the image. The plan downloads and pulls on the head, stops nothing while the start cannot happen,
and, once both are there, copies to the worker while the GLM co-tenant still serves, then stops it, then starts."""

from __future__ import annotations

import json
import re
import shlex

import pytest

from reconciler.core import spec
from reconciler.core.observed import Observed, Weights
from reconciler.core.planning import plan
from reconciler.core.simulate import apply_plan
from reconciler.edge.facts.weights import hub_size

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


def test_once_staged_from_nothing_of_ours_the_copies_run_before_glm_stops_and_the_start_after(seed):
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
    {"siblings": [{"rfilename": "a", "size": True}]},  # JSON's true is no size (Python's bool is an int)
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


# ------------------------------------------------------------------------------------ the steps' commands


def _download(seed, free: int, hub: dict, *, token_scope: str = "internet", hf_exit: int = 0):
    """The download step driven from recorded answers (tests/unit/step_driver.py): the Hub's size answer, the
    fetch's output (`bytes N` lines) and exit. Returns the driver, the fetch's command line and the step's body."""
    from reconciler.core.observed import WeightFile, Weights
    from reconciler.edge.manifest import Listing
    from reconciler.edge.ssh import Result
    from reconciler.edge.steps.actions import Given
    from reconciler.edge.steps.staging import download, download_argv
    from tests.unit.step_cases.staging import bounds
    from tests.unit.step_driver import Driver, Raw

    desired, observed = seed
    data = desired.model_dump(mode="json")
    data["serving"]["secrets"] = {**data["serving"]["secrets"], "HF_TOKEN": token_scope}
    desired = spec.Desired.model_validate(data).with_secrets({"VLLM_API_KEY": "k", "HF_TOKEN": "hf_secret"})
    fresh = _fresh_head(desired, observed)
    node = fresh.node(HEAD).model_copy(update={"disk_free": {"weights": free, "image": free}})
    fresh = fresh.model_copy(update={"nodes": {**fresh.nodes, HEAD: node}})
    step = next(s for s in plan(desired, fresh).steps if s.kind == "download")
    given = Given(desired, fresh)
    fetch = f"{HEAD} " + shlex.join(download_argv(given, step))
    model = desired.model
    whole = Listing(Weights(root=desired.weights_root(HEAD), present=True, files=[
        WeightFile(path=f"refs/{model.revision}", size=40), WeightFile(path=f"snapshots/{'1' * 40}/config.json",
                                                                       size=2)]), {})
    _, _, ready = bounds(HEAD, desired.weights_root(HEAD))
    driver = Driver(facts={f"{HEAD} hub-size {model.id}@{model.revision}": [Raw(json.dumps(hub))],
                           f"{HEAD} weights": [whole]},
                    results={**ready, fetch: [Result("", "hf: command not found" if hf_exit else "", hf_exit)]},
                    outputs={fetch: [b"bytes 1024\nbytes 4096\n"]})
    return driver, fetch, lambda: download(given, step)


HUB = {"sha": "1" * 40, "siblings": [{"rfilename": "model.safetensors", "size": 3 << 30}]}


def test_the_download_refuses_before_fetching_when_the_disk_cannot_hold_it(seed):
    from reconciler.edge.steps import StepBlocked

    driver, _, body = _download(seed, free=(3 << 30) + (512 << 20), hub=HUB)  # the tree fits, not with the margin
    error = driver.drive(body())
    assert isinstance(error, StepBlocked) and re.search(r"needs 4\.0 GiB free .* only 3\.5 GiB", str(error))
    assert [line.split()[0] for line in driver.transcript] == ["read"], "only the Hub was asked: nothing downloaded"


def test_the_download_runs_hf_with_the_token_on_stdin_only(seed):
    from reconciler.edge.facts.weights import hub_size_fact

    driver, fetch, body = _download(seed, free=8 << 30, hub=HUB)
    assert driver.drive(body()) is None
    desired, _ = seed
    model = desired.model
    from tests.unit.step_cases.staging import bounds

    starts, stops, _ = bounds(HEAD, desired.weights_root(HEAD))
    assert driver.transcript == [f"read {HEAD} hub-size {model.id}@{model.revision}", "report download.start",
                                 *starts, f"run {fetch}", "report download.progress", *stops,
                                 f"read {HEAD} weights", "report download.done"]
    assert driver.stdin[fetch] == b"hf_secret\n" and "hf_secret" not in fetch
    assert not [k for k, v in driver.stdin.items() if k != fetch and v], "only the fetch is sent the token"
    assert shlex.split(fetch)[-5:] == [model.id, "--revision", model.revision, "--cache-dir", model.path_on(HEAD)]
    # the size query: the token in the script on sh's stdin, handed to curl by the printf builtin (`-H @-`)
    (section, line) = hub_size_fact(model.id, model.revision, "hf_secret", 30).lines
    assert line.startswith("printf %s 'Authorization: Bearer hf_secret\n' | curl -fsS --max-time 30 -H @- ")
    assert line.count("hf_secret") == 1


def test_the_download_reports_its_bytes_of_the_hubs_size(seed):
    from tests.unit.loop.test_progress import _reports

    driver, _, body = _download(seed, free=8 << 30, hub=HUB)
    events: list = []
    assert driver.drive(_reports(body(), events)) is None
    assert [(r.event, r.fields.get("bytes_done"), r.fields["bytes_total"]) for r in events] == [
        ("download.start", None, 3 << 30), ("download.progress", 4096, 3 << 30), ("download.done", None, 3 << 30)]


def test_a_token_scoped_to_the_head_is_not_the_downloads(seed):
    from reconciler.edge.facts.weights import hub_size_fact

    driver, fetch, body = _download(seed, free=8 << 30, hub=HUB, token_scope="head")
    assert driver.drive(body()) is None
    assert driver.stdin[fetch] == b"\n" and not [v for k, v in driver.stdin.items() if k != fetch and v]
    desired, _ = seed
    (_, line) = hub_size_fact(desired.model.id, desired.model.revision, None, 30).lines
    assert line.startswith("printf %s 'Accept: application/json\n' | curl ")


def test_no_hf_on_the_source_says_how_to_install_it(seed):
    from reconciler.edge.steps import StepFailed

    driver, _, body = _download(seed, free=8 << 30, hub=HUB, hf_exit=127)
    error = driver.drive(body())
    assert isinstance(error, StepFailed) and "pipx install huggingface_hub" in str(error)
    assert "after 4096 bytes" in str(error)


def test_with_our_generation_running_a_cotenant_stops_at_once(seed):
    """A co-tenant beside a generation of ours competes with it for unified memory: it goes at once, copies or
    not (a serving change that needs the worker's copy refreshed)."""
    from reconciler.core.observed import Container

    desired, observed = seed
    ours = apply_plan(desired, observed, plan(desired, observed))  # converged: our generation runs
    ours = ours.model_copy(update={"nodes": {**ours.nodes, WORKER: ours.node(WORKER).model_copy(update={
        "weights": None, "containers": [*ours.node(WORKER).containers,
                                        Container(name="intruder", id="i", image="x", state="running")]})}})
    steps = plan(desired, ours).steps
    stop = next(s for s in steps if s.id == f"stop-container/{WORKER}/intruder")
    assert stop.after == () and f"weights/{WORKER}" in {s.id for s in steps}
