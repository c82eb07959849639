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


class FakeHead:
    """The source's SSH session: answers the Hub size query with `hub`, runs nothing else; records what was sent."""

    def __init__(self, hub: dict, hf_exit: int = 0):
        self.hub, self.hf_exit = hub, hf_exit
        self.calls: list[tuple[list[str], bytes | None]] = []

    def run(self, argv, *, timeout, stdin=None, check=True, on_output=None, cancel=None, supervised=False):
        from reconciler.edge.ssh import CommandFailed, Result

        self.calls.append((list(argv), stdin))
        if "api/models" in argv[2]:
            return Result(json.dumps(self.hub), "", 0)
        if on_output is not None:
            on_output(b"bytes 1024\nbytes 4096\n")
        if self.hf_exit:
            raise CommandFailed("head", argv, self.hf_exit, "", "hf: command not found")
        return Result("", "", 0)


def _download(seed, free: int, hub: dict, *, token_scope: str = "internet", hf_exit: int = 0):
    from reconciler.edge.steps import StepContext
    from reconciler.edge.steps.staging import download

    desired, observed = seed
    data = desired.model_dump(mode="json")
    data["serving"]["secrets"] = {**data["serving"]["secrets"], "HF_TOKEN": token_scope}
    desired = spec.Desired.model_validate(data).with_secrets({"VLLM_API_KEY": "k", "HF_TOKEN": "hf_secret"})
    fresh = _fresh_head(desired, observed)
    node = fresh.node(HEAD).model_copy(update={"disk_free": {"weights": free, "image": free}})
    fresh = fresh.model_copy(update={"nodes": {**fresh.nodes, HEAD: node}})
    head, events = FakeHead(hub, hf_exit), []
    ctx = StepContext(desired=desired, sessions={HEAD: head}, observed=fresh,  # type: ignore[arg-type]
                      progress=lambda e, f: events.append((e, f)))
    step = next(s for s in plan(desired, fresh).steps if s.kind == "download")
    return head, events, lambda: download(ctx, step)


HUB = {"sha": "1" * 40, "siblings": [{"rfilename": "model.safetensors", "size": 3 << 30}]}


def test_the_download_refuses_before_fetching_when_the_disk_cannot_hold_it(seed):
    from reconciler.edge.steps import StepBlocked

    head, _, run = _download(seed, free=(3 << 30) + (512 << 20), hub=HUB)  # the tree fits, not with the margin
    with pytest.raises(StepBlocked, match=r"needs 4\.0 GiB free .* only 3\.5 GiB"):
        run()
    assert len(head.calls) == 1, "only the Hub was asked: nothing was downloaded"


def test_the_download_runs_hf_with_the_token_on_stdin_only(seed):
    head, events, run = _download(seed, free=8 << 30, hub=HUB)
    run()
    (size_argv, size_stdin), (fetch_argv, fetch_stdin) = head.calls
    assert size_stdin == b"Authorization: Bearer hf_secret\n" and fetch_stdin == b"hf_secret\n"
    assert not any("hf_secret" in a for a in size_argv + fetch_argv)
    desired, _ = seed
    assert fetch_argv[-5:] == [desired.model.id, "--revision", desired.model.revision, "--cache-dir",
                               desired.model.path_on(HEAD)]
    assert ("download.progress", {"node": HEAD, "bytes_done": 4096, "bytes_total": 3 << 30}) in events


def test_a_token_scoped_to_the_head_is_not_the_downloads(seed):
    head, _, run = _download(seed, free=8 << 30, hub=HUB, token_scope="head")
    run()
    assert [stdin for _, stdin in head.calls] == [b"Accept: application/json\n", b"\n"]


def test_no_hf_on_the_source_says_how_to_install_it(seed):
    from reconciler.edge.steps import StepFailed

    _, _, run = _download(seed, free=8 << 30, hub=HUB, hf_exit=127)
    with pytest.raises(StepFailed, match="pipx install huggingface_hub"):
        run()


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
