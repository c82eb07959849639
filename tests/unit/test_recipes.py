"""Recipes (reconciler/files/recipes, reconciler.core.recipes) and `reconciler init` (issue 35, item 4).

The oracles are independent of the recipe files: `ORACLE` is written from the public sources each recipe cites
(docs/research/recipes.md), the reserved flags from vLLM's and the spec's documented meaning, the plan from the
recorded seed snapshot. `init` runs as the installed console script, and its file is judged by `validate`.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from reconciler import files
from reconciler.core import recipes, spec
from reconciler.core.observed import Observed
from reconciler.core.planning import Plan, plan
from tests.unit.conftest import BASE_YAML, REPO

RECIPES = recipes.catalogue(files.recipes())
MODELS = "/home/spark/.cache/huggingface/hub"
#: A standard pair (head-a, worker-b), and the seed's two Sparks as desired-state/cluster.yaml declares them.
PAIR = yaml.safe_load(BASE_YAML)["nodes"]
SEED_NODES = yaml.safe_load((REPO / "desired-state" / "cluster.yaml").read_text())["nodes"]

#: What the public record says of each recipe: model id, tensor parallel size, memory fraction, flag sequences its
#: extra_args must hold, and the sources its header must cite (repo@commit path, or the thread / model card).
ORACLE: dict[str, dict[str, Any]] = {
    "qwen3.5-122b-fp8": {
        "model": "Qwen/Qwen3.5-122B-A10B-FP8", "tp": 2, "gmu": 0.7, "max_model_len": 262144, "launcher": "ray",
        "flags": ["--kv-cache-dtype fp8", "--enable-expert-parallel"],
        "env": {"VLLM_FLASHINFER_MOE_BACKEND": "latency"},
        "cites": ["eugr/spark-vllm-docker@8c6eb1f6cfb7701f07fdcddc9bf27288b82247ce recipes/qwen3.5-122b-fp8.yaml",
                  "https://huggingface.co/Qwen/Qwen3.5-122B-A10B-FP8"]},
    "glm-4.7-flash": {
        "model": "GadflyII/GLM-4.7-Flash-NVFP4", "tp": 1, "gmu": 0.7, "max_model_len": 202752,
        "flags": ["--tool-call-parser glm47", "--reasoning-parser glm45"],
        "cites": ["sonusflow/spark-vllm-docker@30f16f1d4e8db252d4cd95f88588d39d291f87fc recipes/glm-4.7-flash-awq.yaml",
                  "https://huggingface.co/GadflyII/GLM-4.7-Flash-NVFP4"]},
    "gpt-oss-120b": {
        "model": "openai/gpt-oss-120b", "tp": 1, "gmu": 0.7,
        "flags": ["--tool-call-parser openai", "--reasoning-parser openai_gptoss", "--quantization mxfp4"],
        "env": {"VLLM_USE_FLASHINFER_MOE_MXFP4_MXFP8": "1"},
        "cites": ["eugr/spark-vllm-docker@9a40b2907dfa9da694b12c575cff1b12f50033cb recipes/openai-gpt-oss-120b.yaml",
                  "https://huggingface.co/openai/gpt-oss-120b"]},
    "bge-m3": {
        "model": "BAAI/bge-m3", "tp": 1, "gmu": 0.05, "max_model_len": 8192, "flags": ["--runner pooling"],
        "cites": ["d9628102/ai-agent-os docs/gx10-known-issues.md",
                  "thebroadercollective/spark-vllm-docker@07a8cb328cf8d1512e4c821d1ffe2476982a7aa3 "
                  "recipes/km-embed-text.yaml", "https://huggingface.co/BAAI/bge-m3"]},
    "bge-reranker-v2-m3": {
        "model": "BAAI/bge-reranker-v2-m3", "tp": 1, "gmu": 0.08, "max_model_len": 8192,
        "flags": ["--runner pooling --convert classify"],
        "cites": ["thebroadercollective/spark-vllm-docker@07a8cb328cf8d1512e4c821d1ffe2476982a7aa3 "
                  "recipes/km-rerank.yaml", "https://huggingface.co/BAAI/bge-reranker-v2-m3"]},
}
#: Flags the reconciler sets from the file's own fields (or, for --task, that vLLM >= 0.10.1 refuses): never in a
#: recipe's extra_args.
NOT_IN_EXTRA_ARGS = ("--tensor-parallel-size", "-tp", "--pipeline-parallel-size", "--port", "--host", "--model",
                     "--served-model-name", "--gpu-memory-utilization", "--max-model-len", "--master-port",
                     "--distributed-executor-backend", "--trust-remote-code", "--api-key", "--task")
#: The owner's mix on the seed: the TP-2 model over both Sparks, embeddings and reranker beside it on the head.
SEED_MIX = ("qwen3.5-122b-fp8", "bge-m3", "bge-reranker-v2-m3")


def document(*picks: str, nodes: list[dict[str, Any]] = PAIR, known: dict[str, recipes.Recipe] = RECIPES
             ) -> dict[str, Any]:
    return recipes.compose(known, [recipes.Pick.of(p) for p in picks], nodes, MODELS)


def as_text(doc: dict[str, Any]) -> str:
    return yaml.safe_dump(doc, sort_keys=False) + "...\n"


def composed(*picks: str, nodes: list[dict[str, Any]] = PAIR) -> spec.Desired:
    return spec.loads(as_text(document(*picks, nodes=nodes)), "<composed>")


def refusals(*picks: str, nodes: list[dict[str, Any]] = PAIR) -> list[str]:
    try:
        spec.loads(as_text(document(*picks, nodes=nodes)), "<composed>")
    except spec.InvalidDesiredState as exc:
        return exc.lines()
    return []


def seed(seed_snapshot: Path) -> Observed:
    return Observed.model_validate(json.loads(seed_snapshot.read_text()))


def extra(recipe: str) -> str:
    return " ".join(RECIPES[recipe].serving.get("extra_args", []))


# ---------------------------------------------------------------------------------------------- the recipes


def test_every_packaged_recipe_has_its_oracle_row_and_the_root_link_points_at_the_package():
    assert set(RECIPES) == set(ORACLE)
    link = REPO / "recipes"
    assert link.is_symlink() and link.resolve() == (REPO / "reconciler" / "files" / "recipes").resolve()
    assert '"recipes/*.yaml"' in (REPO / "pyproject.toml").read_text()


@pytest.mark.parametrize("name", sorted(ORACLE))
def test_a_recipe_says_what_the_public_record_says(name):
    recipe, want = RECIPES[name], ORACLE[name]
    serving = recipe.serving
    assert recipe.fragment["model"]["id"] == want["model"]
    assert (recipe.gpus, serving["gpu_memory_utilization"]) == (want["tp"], want["gmu"])
    assert serving.get("max_model_len") == want.get("max_model_len")
    assert serving.get("launcher", "native") == want.get("launcher", "native")
    assert serving.get("env", {}) == want.get("env", serving.get("env", {}))
    for flags in want["flags"]:
        assert flags in extra(name), f"{name}: {flags!r} not in extra_args {extra(name)!r}"


@pytest.mark.parametrize("name", sorted(ORACLE))
def test_a_recipe_cites_its_sources_in_its_header_and_says_what_it_is(name):
    recipe = RECIPES[name]
    for source in ORACLE[name]["cites"]:
        assert source in " ".join(recipe.header.split()), f"{name} does not cite {source}"
    assert recipe.description and recipe.description == recipe.header.splitlines()[0]
    assert "image_id" in recipe.header, f"{name}: the header should say the owner may pin serving.image_id"


@pytest.mark.parametrize("name", sorted(ORACLE))
def test_no_recipe_sets_a_flag_the_reconciler_sets_itself(name):
    args = RECIPES[name].serving.get("extra_args", [])
    assert not [a for a in args if a.split("=", 1)[0].replace("_", "-") in NOT_IN_EXTRA_ARGS]


def test_the_pooling_recipes_run_the_pooling_runner_and_the_generators_do_not():
    pooling = {name for name in RECIPES if "--runner pooling" in extra(name)}
    assert pooling == {"bge-m3", "bge-reranker-v2-m3"}
    assert "--convert classify" in extra("bge-reranker-v2-m3") and "--convert" not in extra("bge-m3")


@pytest.mark.parametrize("name", sorted(ORACLE))
def test_a_recipe_alone_validates_on_a_pair(name):
    desired = composed(name)
    (one,) = desired.deployments
    assert one.name == RECIPES[name].fragment["name"]
    assert one.serving.container_name == "vllm_" + one.name.replace("-", "_")
    assert one.model.path == MODELS and one.serving.port == 8000
    spans = [n.name for n in desired.serving_nodes]
    assert spans == (["head-a", "worker-b"] if ORACLE[name]["tp"] == 2 else ["head-a"])


@pytest.mark.parametrize("name", sorted(ORACLE))
def test_a_recipe_alone_on_the_seed_nodes_plans_against_the_recorded_seed(name, seed_snapshot):
    desired = composed(name, nodes=SEED_NODES)
    for view in desired.views():
        assert isinstance(plan(view, seed(seed_snapshot)), Plan)


@pytest.mark.parametrize(("text", "why"), [
    ("name: x\nmodel: {id: a/b}\nserving: {image: i}\n", "starts with a comment line"),
    ("# x\nname: x\nmodel: {id: a/b, path: /srv/m}\nserving: {image: i}\n", "model.path is the operator's"),
    ("# x\nname: x\nmodel: {id: a/b}\nserving: {image: i, port: 8001}\n", "serving.port is init's"),
    ("# x\nname: x\nmodel: {id: a/b}\nserving: {image: i, nodes: [a]}\n", "serving.nodes is init's"),
    ("# x\nname: x\nmodel: {id: a/b}\n", "holds exactly name, model, serving"),
    ("# x\n[unclosed\n", "not YAML"),
])
def test_a_recipe_that_places_itself_or_says_nothing_of_itself_is_refused(text, why):
    with pytest.raises(recipes.RecipeError, match=why):
        recipes.parse("x", text)


# ---------------------------------------------------------------------------------------------- compositions


def test_the_seed_owners_mix_composes_and_fits_the_head(seed_snapshot):
    desired = composed(*SEED_MIX, nodes=SEED_NODES)
    by_name = {d.name: d.serving for d in desired.deployments}
    assert len({s.port for s in by_name.values()}) == 3
    assert len({s.container_name for s in by_name.values()}) == 3
    on_head = [d for d in desired.deployments if "spark-1a32" in [n.name for n in desired.view(d.name).serving_nodes]]
    assert len(on_head) == 3
    assert sum(d.serving.gpu_memory_utilization for d in on_head) == pytest.approx(0.83)
    on_worker = [d.name for d in desired.deployments
                 if "spark-5be3" in [n.name for n in desired.view(d.name).serving_nodes]]
    assert on_worker == [RECIPES["qwen3.5-122b-fp8"].fragment["name"]]
    for view in desired.views():
        assert isinstance(plan(view, seed(seed_snapshot)), Plan)


def test_a_mix_that_over_commits_a_node_is_refused_with_the_numbers():
    lines = refusals("qwen3.5-122b-fp8", "gpt-oss-120b")
    assert len(lines) == 1, lines
    assert "over-committed" in lines[0] and "0.7 + gpt-oss-120b 0.7 = 1.4" in lines[0] and "head-a" in lines[0]


def test_the_same_recipe_twice_gets_a_name_a_container_and_a_port_of_its_own():
    desired = composed("bge-m3", "bge-m3")
    assert desired.deployment_names == ["bge-m3", "bge-m3-2"]
    assert [d.serving.container_name for d in desired.deployments] == ["vllm_bge_m3", "vllm_bge_m3_2"]
    assert [d.serving.port for d in desired.deployments] == [8000, 8001]


def test_deployments_sharing_nodes_get_rendezvous_and_ray_ports_of_their_own():
    native = recipes.parse("tp2", "# a TP-2 model, native launcher\nname: tp2\nmodel: {id: a/b}\n"
                                  "serving: {image: i, tensor_parallel_size: 2, gpu_memory_utilization: 0.1}\n")
    known = {**RECIPES, "tp2": native}
    doc = document("tp2", "tp2", "qwen3.5-122b-fp8", known=known)
    servings = [d["serving"] for d in doc["deployments"]]
    assert [s.get("master_port") for s in servings] == [29501, 29502, None]
    assert [s.get("ray_port") for s in servings] == [None, None, 6381]
    assert [s["port"] for s in servings] == [8000, 8001, 8002]
    assert spec.loads(as_text(doc)).deployment_names == ["tp2", "tp2-2", "qwen35-122b-fp8"]


def test_an_unknown_recipe_is_named_with_the_list_of_recipes():
    with pytest.raises(recipes.UnknownRecipe) as caught:
        document("bge-m3", "nope", "gone")
    assert caught.value.names == ["nope", "gone"] and caught.value.known == sorted(RECIPES)


def test_a_recipe_placed_on_a_node_runs_there_and_a_tp2_recipe_cannot_be():
    assert document("bge-m3@head")["deployments"][0]["serving"]["nodes"] == ["head-a"]
    assert document("bge-m3@worker-b")["deployments"][0]["serving"]["nodes"] == ["worker-b"]
    assert document("bge-m3@worker")["deployments"][0]["serving"]["nodes"] == ["worker-b"]
    with pytest.raises(recipes.RecipeError, match="spans 2 GPUs"):
        document("qwen3.5-122b-fp8@worker")
    with pytest.raises(recipes.RecipeError, match="no node 'spark-x'"):
        document("bge-m3@spark-x")
    with pytest.raises(recipes.RecipeError, match="add a --worker"):
        document("qwen3.5-122b-fp8", nodes=PAIR[:1])


def test_a_worker_only_placement_validates_with_its_api_on_the_worker():
    """The seed owner's worker ran embeddings of its own: `bge-m3@worker` is a deployment on the worker alone,
    whose rank 0 and API run there (`Desired.api_node`)."""
    assert refusals("bge-m3@worker") == []
    d = spec.Desired.model_validate(document("qwen3.5-122b-fp8", "bge-m3@worker"))
    assert d.view("bge-m3").api_node.name == "worker-b" and d.view("qwen35-122b-fp8").api_node.role == "head"


# ---------------------------------------------------------------------------------------------- reconciler init


def run(script: str, *args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([script, *map(str, args)], capture_output=True, text=True, timeout=60, check=False)


def validate_problems(script: str, path: Path) -> tuple[int, list[str]]:
    result = run(script, "validate", "--skip-secrets", path)
    assert "Traceback" not in result.stderr
    return result.returncode, [line for line in result.stderr.splitlines() if line.strip()]


def test_init_lists_the_recipes_with_a_line_each(console_script):
    for args in (("init", "--list"), ("init",)):
        result = run(console_script, *args)
        assert result.returncode == 0, result.stderr
        lines = result.stdout.splitlines()
        assert [line.split()[0] for line in lines] == sorted(RECIPES)
        assert all(RECIPES[line.split()[0]].description in line for line in lines)


@pytest.mark.parametrize("name", sorted(ORACLE))
def test_init_writes_one_recipe_as_a_file_validate_takes(console_script, tmp_path, name):
    out = tmp_path / "cluster.yaml"
    result = run(console_script, "init", "--recipe", name, "--head", "10.1.230.180", "--worker", "192.168.200.13",
                 "-o", out)
    assert result.returncode == 0, result.stderr
    text = out.read_text()
    assert text.endswith("\n...\n") and "# GUESS:" in text
    assert validate_problems(console_script, out) == (0, [])
    desired = spec.load(out)
    assert desired.deployment_names == [RECIPES[name].fragment["name"]]
    worker = desired.nodes[1]
    assert (worker.ssh.jump, worker.internet, worker.fabric.interface) == (desired.head.name, False, "enp1s0f1np1")


def test_init_writes_the_seed_mix_as_the_spec_takes_it(console_script, tmp_path):
    out = tmp_path / "cluster.yaml"
    picks = [arg for name in SEED_MIX for arg in ("--recipe", name)]
    result = run(console_script, "init", *picks, "--head", "spark-1a32", "--worker", "spark-5be3", "--models-path",
                 "/srv/models/hub", "-o", out)
    assert result.returncode == 0, result.stderr
    desired = spec.load(out)
    assert [n.name for n in desired.nodes] == ["spark-1a32", "spark-5be3"]
    assert len(desired.deployments) == 3 and {d.model.path for d in desired.deployments} == {"/srv/models/hub"}
    for name in SEED_MIX:
        assert f"recipes/{name}.yaml" in out.read_text()
    # `validate` judges it as the daemon takes it: the mix is served as written
    code, lines = validate_problems(console_script, out)
    assert (code, lines) == (0, []), lines


def test_init_refuses_an_over_committed_node_and_writes_nothing(console_script, tmp_path):
    out = tmp_path / "cluster.yaml"
    result = run(console_script, "init", "--recipe", "qwen3.5-122b-fp8", "--recipe", "gpt-oss-120b", "--head", "h",
                 "--worker", "w", "-o", out)
    assert result.returncode == 3 and not out.exists()
    assert "over-committed" in result.stderr and "= 1.4" in result.stderr and "nothing written" in result.stderr


def test_init_writes_a_worker_only_placement(console_script, tmp_path):
    out = tmp_path / "cluster.yaml"
    result = run(console_script, "init", "--recipe", "bge-m3@worker", "--head", "h", "--worker", "w", "-o", out)
    assert result.returncode == 0, result.stderr
    d = spec.load(out)
    assert [n.name for n in d.view("bge-m3").serving_nodes] == [d.api_node.name] and d.api_node.role == "worker"


def test_init_names_an_unknown_recipe_and_lists_the_recipes(console_script, tmp_path):
    out = tmp_path / "cluster.yaml"
    result = run(console_script, "init", "--recipe", "nope", "--head", "h", "-o", out)
    assert result.returncode == 1 and not out.exists()
    assert "'nope'" in result.stderr and all(name in result.stderr for name in RECIPES)


def test_init_without_a_head_is_a_usage_error(console_script):
    result = run(console_script, "init", "--recipe", "bge-m3")
    assert result.returncode == 1 and "--head" in result.stderr and not result.stdout
