"""Recipes (reconciler/files/recipes, reconciler.core.recipes) and `reconciler init` (issue 35, item 4; issue 52,
item 3: recipes that run on the image they name).

The oracles are independent of the recipe files: `ORACLE` is written from the public sources each recipe cites
(docs/research/recipes.md, docs/recipes.md), the reserved flags from vLLM's and the spec's documented meaning, the
plan from the recorded seed snapshot, and each image's answer (`vllm serve --help=all`, Ray, the variables its vLLM
reads) from the real thing, recorded in tests/fixtures (image-answers.yaml says which recording is whose, and from
where). `init` runs as the installed console script, and its file is judged by `validate`.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from reconciler import files
from reconciler.core import recipes, spec
from reconciler.core.observed import Image, Observed, ServeFlags
from reconciler.core.planning import plan
from reconciler.core.simulate import apply_plan
from reconciler.core.vllm import parse_serve_help
from tests.unit.conftest import BASE_YAML, REPO

RECIPES = recipes.catalogue(files.recipes())
MODELS = "/home/spark/.cache/huggingface/hub"
#: A standard pair (head-a, worker-b), and the seed's two Sparks as desired-state/cluster.yaml declares them.
PAIR = yaml.safe_load(BASE_YAML)["nodes"]
SEED_NODES = yaml.safe_load((REPO / "desired-state" / "cluster.yaml").read_text())["nodes"]

#: What the public record says of each recipe: model id, tensor parallel size, memory fraction, launcher, flag
#: sequences its extra_args must hold (`--max-num-seqs` in every one), env, how far it is proven on the image it
#: names, and the sources its header must cite (repo@commit path, or the thread / model card / page).
NGC_26_05 = "nvcr.io/nvidia/vllm:26.05-py3"
ORACLE: dict[str, dict[str, Any]] = {
    "qwen3.5-122b-fp8": {
        # eugr's flags; launcher native: NGC 26.05 has no Ray (NVIDIA's playbook), spark-arena runs it without a
        # backend flag; the SM121-on-NGC backends from conselara
        "model": "Qwen/Qwen3.5-122B-A10B-FP8", "tp": 2, "gmu": 0.7, "max_model_len": 262144, "launcher": "native",
        "flags": ["--max-num-seqs 4", "--kv-cache-dtype fp8", "--enable-expert-parallel",
                  '--speculative-config {"method":"mtp","num_speculative_tokens":1}', "--language-model-only",
                  "--tool-call-parser qwen3_coder", "--reasoning-parser qwen3", "--attention-backend TRITON_ATTN",
                  "--moe-backend marlin"],
        "env": {}, "status": "unverified",
        "cites": ["eugr/spark-vllm-docker@8c6eb1f6cfb7701f07fdcddc9bf27288b82247ce recipes/qwen3.5-122b-fp8.yaml",
                  "spark-arena/recipe-registry@307578001460733fcb9335d0e84f8d3e38e40552 "
                  "experimental-recipes/eugr-vllm/qwen3.5-122b-a10b-fp8-vllm.yaml",
                  "NVIDIA/dgx-spark-playbooks@0db7c141da60870ca6ed5c99436320f4e35cd531 nvidia/vllm/README.md",
                  "https://conselara.dev/notes/vllm-dgx-spark-sm121-gotchas/",
                  "https://huggingface.co/Qwen/Qwen3.5-122B-A10B-FP8"]},
    "glm-4.7-flash": {
        # the recipe's parsers and limits; NVFP4 MoE on SM121 on NGC: Marlin, FlashInfer's FP4 MoE off (conselara)
        "model": "GadflyII/GLM-4.7-Flash-NVFP4", "tp": 1, "gmu": 0.7, "max_model_len": 202752,
        "flags": ["--tool-call-parser glm47", "--reasoning-parser glm45", "--max-num-seqs 64", "--moe-backend marlin"],
        "env": {"VLLM_USE_FLASHINFER_MOE_FP4": "0"}, "status": "unverified",
        "needs": ["vllm-project/vllm#43889"],
        "cites": ["sonusflow/spark-vllm-docker@30f16f1d4e8db252d4cd95f88588d39d291f87fc recipes/glm-4.7-flash-awq.yaml",
                  "https://huggingface.co/GadflyII/GLM-4.7-Flash-NVFP4",
                  "https://github.com/vllm-project/vllm/issues/43888", "https://github.com/vllm-project/vllm/pull/43889",
                  "https://conselara.dev/notes/vllm-dgx-spark-sm121-gotchas/"]},
    "gpt-oss-120b": {
        # eugr's parsers and quantization; its FlashInfer attention and MXFP4 MoE replaced by SM121's on NGC
        "model": "openai/gpt-oss-120b", "tp": 1, "gmu": 0.7,
        "flags": ["--max-num-seqs 4", "--tool-call-parser openai", "--reasoning-parser openai_gptoss",
                  "--quantization mxfp4", "--attention-backend TRITON_ATTN", "--moe-backend marlin"],
        "env": {}, "status": "unverified",
        "cites": ["eugr/spark-vllm-docker@9a40b2907dfa9da694b12c575cff1b12f50033cb recipes/openai-gpt-oss-120b.yaml",
                  "https://conselara.dev/notes/vllm-dgx-spark-sm121-gotchas/",
                  "https://huggingface.co/openai/gpt-oss-120b"]},
    "bge-m3": {
        # served on NGC 26.05 (vLLM 0.20.1) with --runner pooling by the GX10 record
        "model": "BAAI/bge-m3", "tp": 1, "gmu": 0.05, "max_model_len": 8192,
        "flags": ["--runner pooling", "--max-num-seqs"], "env": {}, "status": "proven",
        "cites": ["d9628102/ai-agent-os@3c5255a509e21ce8013b3b63032514ecc63bd5bf docs/gx10-known-issues.md",
                  "thebroadercollective/spark-vllm-docker@07a8cb328cf8d1512e4c821d1ffe2476982a7aa3 "
                  "recipes/km-embed-text.yaml", "https://huggingface.co/BAAI/bge-m3"]},
    "bge-reranker-v2-m3": {
        "model": "BAAI/bge-reranker-v2-m3", "tp": 1, "gmu": 0.08, "max_model_len": 8192,
        "flags": ["--runner pooling --convert classify", "--max-num-seqs"], "env": {}, "status": "unverified",
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


# ---------------------------------------------------------------------------------------------- the images' answers

FIXTURES = REPO / "tests" / "fixtures"
#: image reference -> its recorded answer: vLLM version, Ray, the recordings of its `--help=all` and its variables
ANSWERS: dict[str, dict[str, Any]] = yaml.safe_load((FIXTURES / "image-answers.yaml").read_text())


def help_text(image: str) -> str:
    return (FIXTURES / ANSWERS[image]["help"]).read_text()


def image_flags(image: str) -> list[str]:
    return parse_serve_help(help_text(image))


def image_envs(image: str) -> set[str]:
    lines = (FIXTURES / ANSWERS[image]["envs"]).read_text().splitlines()
    return {line for line in lines if line and not line.startswith("#")}


def listed_choices(text: str) -> dict[str, set[str]]:
    """The flags whose `--help=all` line lists their values (`  --runner {auto,draft,generate,pooling}`)."""
    out = {}
    for line in text.splitlines():
        if m := re.match(r"  (--[\w-]+) \{([^}]*)\}", line):
            out[m.group(1)] = set(m.group(2).split(","))
    return out


def answered(observed: Observed, node: str, image: str) -> Observed:
    """`observed` with `image` on `node` (its own id when the snapshot holds it) and the image's recorded answer for
    that id, as `observe` attaches it (reconciler/edge/image_flags.py)."""
    held = observed.node(node).images.get(image) or Image(id="sha256:" + "a" * 64, content="sha256:" + "b" * 64)
    nodes = {**observed.nodes, node: observed.node(node).model_copy(
        update={"images": {**observed.node(node).images, image: held}})}
    answer = ServeFlags(image_id=held.id, flags=image_flags(image), has_ray=ANSWERS[image]["has_ray"],
                        version=str(ANSWERS[image]["vllm"]))
    return observed.model_copy(update={"nodes": nodes, "serve_flags": answer})


def serving_problems(recipe: recipes.Recipe, seed_snapshot: Path, passes: int = 4) -> list[str]:
    """Every blocker and refusal of the plans that bring `recipe`, alone on the seed's two Sparks, from the recorded
    seed to converged, its image answering as recorded: each plan applied in the simulator until nothing is left.
    Empty when it converges without one; a plan that still has changes after `passes` says so."""
    doc = recipes.compose({recipe.name: recipe}, [recipes.Pick(recipe.name)], SEED_NODES, MODELS)
    desired = spec.loads(as_text(doc), "<composed>")
    problems: list[str] = []
    for view in desired.views():
        observed = answered(seed(seed_snapshot), view.api_node.name, view.serving.image)
        for _ in range(passes):
            step = plan(view, observed)
            problems += [f"{b.node}: {b.reason}" for b in step.blocked] + [f"refused: {r}" for r in step.refused]
            if problems or not step.changes:
                break
            observed = apply_plan(view, observed, step)
        else:
            problems.append(f"{view.name}: still changing after {passes} plans")
    return problems


def variant(name: str, text: str) -> recipes.Recipe:
    """A recipe as a test writes it: a header that says what it is and that it is unverified, then the YAML."""
    return recipes.parse(name, f"# {name}: a test's variant\n# unverified: a test's\n{text}")


def with_serving(name: str, **changes: Any) -> recipes.Recipe:
    """The recipe `name` with some of its serving fields changed."""
    fragment = {**RECIPES[name].fragment, "serving": {**RECIPES[name].serving, **changes}}
    return variant(name, yaml.safe_dump(fragment, sort_keys=False))


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
    assert serving.get("env", {}) == want["env"]
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


def test_every_recipe_names_an_image_whose_real_answer_is_recorded():
    for name, recipe in RECIPES.items():
        image = recipe.serving["image"]
        assert image in ANSWERS, f"{name}: no recorded answer of {image} in tests/fixtures/image-answers.yaml"
        answer = ANSWERS[image]
        assert f"vLLM {answer['vllm']}" in help_text(image).split("\n", 1)[0], "the recording names its version"
        assert "--headless" in image_flags(image) and len(image_flags(image)) > 300
        assert "VLLM_USE_FLASHINFER_MOE_FP4" in image_envs(image)


@pytest.mark.parametrize("name", sorted(ORACLE))
def test_a_recipe_serves_on_its_images_recorded_answer_without_a_blocker(name, seed_snapshot):
    """Composed alone on the seed's two Sparks and planned from the recorded seed to converged, its image answering
    with its real `--help=all`, Ray and version: no plan on the way has a blocker or a refusal (a flag the image's
    vLLM does not know, `launcher: ray` on an image without Ray, ...)."""
    assert serving_problems(RECIPES[name], seed_snapshot) == []


@pytest.mark.parametrize(("recipe", "why"), [
    # the flagship as it was before issue 52: launcher ray on NGC 26.05, which ships without Ray
    (lambda: with_serving("qwen3.5-122b-fp8", launcher="ray"), "has no `ray` command"),
    # eugr's --swap-space 16, which vLLM 0.20.1 no longer has
    (lambda: with_serving("bge-m3", extra_args=["--runner", "pooling", "--swap-space", "16"]),
     "--swap-space is not a flag of `vllm serve`"),
    # a flag vLLM dropped (`--task`, refused since 0.10.1), across both nodes with the native launcher
    (lambda: with_serving("qwen3.5-122b-fp8", extra_args=["--task", "embed"]), "--task is not a flag"),
])
def test_the_judge_of_a_recipe_reports_what_its_image_refuses(recipe, why, seed_snapshot):
    problems = serving_problems(recipe(), seed_snapshot)
    assert problems and any(why in p for p in problems), problems


@pytest.mark.parametrize("name", sorted(ORACLE))
def test_every_value_a_recipe_gives_a_flag_with_listed_choices_is_one_its_image_lists(name):
    image = RECIPES[name].serving["image"]
    choices = listed_choices(help_text(image))
    args = list(RECIPES[name].serving.get("extra_args", []))
    checked = 0
    for flag, value in zip(args, [*args[1:], None], strict=True):
        if flag in choices and value is not None:
            assert value in choices[flag], f"{name}: {flag} {value} is not one of {sorted(choices[flag])}"
            checked += 1
    assert checked or not {"--runner", "--tool-call-parser", "--moe-backend"} & set(args)


@pytest.mark.parametrize("name", sorted(ORACLE))
def test_every_vllm_variable_a_recipe_sets_is_one_its_vllm_reads(name):
    env = RECIPES[name].serving.get("env", {})
    unknown = [k for k in env if k.startswith("VLLM_") and k not in image_envs(RECIPES[name].serving["image"])]
    assert unknown == [], f"{name}: vLLM {ANSWERS[RECIPES[name].serving['image']]['vllm']} does not read {unknown}"


def test_what_init_knows_of_an_image_is_its_recorded_answer():
    """init reads no node: it judges a recipe's needs by `KNOWN_IMAGES`, which must say what the image answers."""
    for image, known in recipes.KNOWN_IMAGES.items():
        answer = ANSWERS[image]
        assert (known.vllm, known.has_ray) == (str(answer["vllm"]), answer["has_ray"])
        native = {"--nnodes", "--node-rank", "--master-addr", "--master-port", "--headless"} <= set(image_flags(image))
        assert (recipes.NATIVE_MULTI_NODE in known.carries) == native
    assert {r.serving["image"] for r in RECIPES.values()} <= set(recipes.KNOWN_IMAGES)


@pytest.mark.parametrize("name", sorted(ORACLE))
def test_a_recipe_says_how_far_it_is_proven_and_needs_only_what_its_image_has(name):
    recipe, want = RECIPES[name], ORACLE[name]
    assert (recipe.proven is not None, recipe.unverified is not None) == (want["status"] == "proven",
                                                                          want["status"] == "unverified")
    if recipe.proven:
        assert recipe.serving["image"] in recipe.proven, "a proven recipe names the image it was proven on"
    assert sorted(recipe.needs) == want.get("needs", [])
    lacks = recipe.lacks()
    assert len(lacks) == len(want.get("needs", [])) and all(n in " ".join(lacks) for n in want.get("needs", []))


def test_a_recipe_that_needs_what_its_image_lacks_is_told():
    ray = with_serving("qwen3.5-122b-fp8", launcher="ray").lacks()
    assert len(ray) == 1 and "ships without Ray" in ray[0] and NGC_26_05 in ray[0]
    assert with_serving("qwen3.5-122b-fp8", launcher="native").lacks() == []
    known = {NGC_26_05: recipes.KnownImage(vllm="0.10.2", has_ray=True, carries=frozenset(), source="a test")}
    old = with_serving("qwen3.5-122b-fp8", launcher="native").lacks(known)
    assert len(old) == 1 and recipes.NATIVE_MULTI_NODE in old[0] and "vLLM 0.10.2" in old[0]
    assert with_serving("qwen3.5-122b-fp8", launcher="ray").lacks(known) == []
    other = with_serving("bge-m3", image="vllm/vllm-openai:v0.20.1")
    assert other.image_known() is None and other.lacks() == []
    assert RECIPES["bge-m3"].image_known() == recipes.KNOWN_IMAGES[NGC_26_05]


@pytest.mark.parametrize(("text", "why"), [
    ("name: x\nmodel: {id: a/b}\nserving: {image: i}\n", "starts with a comment line"),
    ("# x\n# unverified: t\nname: x\nmodel: {id: a/b, path: /srv/m}\nserving: {image: i}\n",
     "model.path is the operator's"),
    ("# x\n# unverified: t\nname: x\nmodel: {id: a/b}\nserving: {image: i, port: 8001}\n", "serving.port is init's"),
    ("# x\n# unverified: t\nname: x\nmodel: {id: a/b}\nserving: {image: i, nodes: [a]}\n",
     "serving.nodes is init's"),
    ("# x\n# unverified: t\nname: x\nmodel: {id: a/b}\n", "holds exactly name, model, serving"),
    ("# x\n# unverified: t\nname: x\nmodel: {id: a/b}\nserving: {image: i}\nextra: 1\n",
     "holds exactly name, model, serving"),
    ("# x\n# unverified: t\n[unclosed\n", "not YAML"),
    # how far it is proven: said once, one way
    ("# x\nname: x\nmodel: {id: a/b}\nserving: {image: i}\n", "either `proven: "),
    ("# x\n# proven: r\n# unverified: t\nname: x\nmodel: {id: a/b}\nserving: {image: i}\n", "either `proven: "),
    ("# x\n# unverified:\nname: x\nmodel: {id: a/b}\nserving: {image: i}\n", "either `proven: "),
    # what it needs: a change, and why
    ("# x\n# unverified: t\nname: x\nmodel: {id: a/b}\nserving: {image: i}\nneeds: [vllm-project/vllm#1]\n",
     "needs maps each vLLM change"),
    ("# x\n# unverified: t\nname: x\nmodel: {id: a/b}\nserving: {image: i}\nneeds: {vllm-project/vllm#1: ''}\n",
     "needs maps each vLLM change"),
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
        assert plan(view, answered(seed(seed_snapshot), view.api_node.name, view.serving.image)).refused == ()


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
    native = variant("tp2", "name: tp2\nmodel: {id: a/b}\n"
                            "serving: {image: i, tensor_parallel_size: 2, gpu_memory_utilization: 0.05}\n")
    ray = variant("tp2-ray", "name: tp2-ray\nmodel: {id: a/b}\nserving: {image: i, launcher: ray, "
                             "tensor_parallel_size: 2, gpu_memory_utilization: 0.05}\n")
    known = {**RECIPES, "tp2": native, "tp2-ray": ray}
    doc = document("tp2", "tp2", "tp2-ray", "qwen3.5-122b-fp8", known=known)
    servings = [d["serving"] for d in doc["deployments"]]
    assert [s.get("master_port") for s in servings] == [29501, 29502, None, 29504]
    assert [s.get("ray_port") for s in servings] == [None, None, 6381, None]
    assert [s["port"] for s in servings] == [8000, 8001, 8002, 8003]
    assert spec.loads(as_text(doc)).deployment_names == ["tp2", "tp2-2", "tp2-ray", "qwen35-122b-fp8"]


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
        assert all(line.endswith("(unverified)") == (ORACLE[line.split()[0]]["status"] == "unverified")
                   for line in lines)


@pytest.mark.parametrize("name", sorted(ORACLE))
def test_init_writes_one_recipe_as_a_file_validate_takes(console_script, tmp_path, name):
    out = tmp_path / "cluster.yaml"
    result = run(console_script, "init", "--recipe", name, "--head", "10.1.230.180", "--worker", "192.168.200.13",
                 "-o", out)
    assert result.returncode == 0, result.stderr
    text = out.read_text()
    assert text.endswith("\n...\n") and "# GUESS:" in text
    assert validate_problems(console_script, out) == (0, [])
    warned = [line for line in result.stderr.splitlines() if line.startswith("init: warning: ")]
    unverified = [line for line in warned if f"recipe {name}: UNVERIFIED: " in line]
    lacking = [line for line in warned if f"recipe {name}: NEEDS WHAT ITS IMAGE LACKS: " in line]
    assert len(unverified) == (ORACLE[name]["status"] == "unverified") and unverified == [
        line for line in unverified if RECIPES[name].unverified[:60] in line]
    assert len(lacking) == len(ORACLE[name].get("needs", [])) and len(warned) == len(unverified) + len(lacking)
    assert ("# UNVERIFIED: " in text) == (ORACLE[name]["status"] == "unverified")
    assert text.count("# NEEDS WHAT ITS IMAGE LACKS: ") == len(lacking)
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


def test_init_cautions_say_what_a_recipe_lacks_and_what_init_cannot_judge():
    """What init writes above a deployment and on stderr, for recipes no shipped one is: the flagship as it was
    before issue 52 (launcher ray on NGC 26.05), and a recipe naming an image init knows nothing of."""
    from reconciler.cli.init import _init_cautions

    ray = _init_cautions(with_serving("qwen3.5-122b-fp8", launcher="ray"))
    assert [c.split(":", 1)[0] for c in ray] == ["UNVERIFIED", "NEEDS WHAT ITS IMAGE LACKS"]
    assert "ships without Ray" in ray[1] and "use launcher: native" in ray[1]
    other = _init_cautions(with_serving("bge-m3", image="vllm/vllm-openai:v0.20.1"))
    assert [c.split(":", 1)[0] for c in other] == ["UNVERIFIED", "IMAGE UNKNOWN TO INIT"]
    assert "vllm/vllm-openai:v0.20.1" in other[1] and "`reconciler plan` asks it" in other[1]
