"""Recipes: one deployment each, as Spark owners run it in the public record, and the file `reconciler init` composes
from them (docs/recipes.md).

Why recipes: the flags that make a model serve well on a GB10 (the parsers, the KV cache dtype, the runner of an
embeddings model, a memory fraction that leaves room for a neighbour) are found in other people's repositories
and issues, not in vLLM's defaults. A recipe keeps them with their sources and the reason for each, in a comment
header; a file of several deployments is then a list of names, placed and given ports here.

A recipe is a deployment fragment (`name`, `model` without `path`, `serving`) with nothing that depends on the
cluster: where it runs (`serving.nodes`), its container name and its ports are `compose`'s, the model's path is the
operator's (`init --models-path`). Pure: the texts come in (reconciler.files reads them), a document goes out, and
`reconciler.core.spec` judges it like any file (the budget rule across deployments among its rules).

A recipe also says how far it is proven: its header has a `proven:` line (the record that served it on the image it
names) or an `unverified:` line (why not), and `init` prints the second. What it needs of its image beyond its
flags (Ray for `launcher: ray`, vLLM's native multi-node, a vLLM fix named in its `needs:`) is checked against what
the image is known to provide (`KNOWN_IMAGES`, from its publisher's record): init reads no node, so it cannot ask
the image itself as `plan` does (reconciler/edge/image_flags.py).
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import yaml

#: What a recipe holds: one deployment, as the desired state's `deployments:` list spells it.
RECIPE_KEYS = ("name", "model", "serving")
#: What it may hold besides, of its own and never composed: the vLLM changes it needs of its image, each with why
#: (`vllm-project/vllm#N: why`), checked against `KNOWN_IMAGES`.
NEEDS = "needs"
#: The header lines that say how far a recipe is proven: exactly one of them (and its indented continuation).
PROVEN, UNVERIFIED = "proven:", "unverified:"
#: vLLM's native multi-node flags (--nnodes, --node-rank, --master-addr, --headless), which the native launcher
#: renders across nodes: vllm-project/vllm PR #23691 (core/planning.NATIVE_MULTI_NODE_FLAGS).
NATIVE_MULTI_NODE = "vllm-project/vllm#23691"
#: What depends on the cluster, so `compose` sets it and a recipe may not: the placement, the names and ports
#: that must differ between deployments sharing a node, the path of the operator's model store.
PLACED_SERVING_KEYS = ("nodes", "container_name", "port", "master_port", "ray_port")
#: The first deployment's ports (the Serving defaults); the n-th deployment gets each plus n, so no two
#: deployments ever share one, whichever nodes they share.
FIRST_API_PORT, FIRST_MASTER_PORT, FIRST_RAY_PORT = 8000, 29501, 6379


class RecipeError(ValueError):
    """A recipe that cannot be read or placed: the message says which and why."""


@dataclass(frozen=True)
class KnownImage:
    """What an image a recipe names is known to provide, from its publisher's record: the vLLM it ships, whether
    it has Ray, the vLLM changes it is known to carry."""

    vllm: str
    has_ray: bool
    carries: frozenset[str]
    source: str


#: The images the recipes name, as their publishers describe them. A recipe's needs are checked against these;
#: an image not listed cannot be judged by init (`plan` asks it). tests/unit/core/test_recipes.py holds each entry to
#: the image's recorded answer (tests/fixtures/image-answers.yaml).
KNOWN_IMAGES: dict[str, KnownImage] = {
    "nvcr.io/nvidia/vllm:26.05-py3": KnownImage(
        vllm="0.20.1", has_ray=False, carries=frozenset({NATIVE_MULTI_NODE}),
        source="NVIDIA's vLLM Release 26.05 notes (vLLM 0.20.1); NVIDIA/dgx-spark-playbooks nvidia/vllm/README.md: "
               "\"The 26.05-py3 NGC image ships without ray\""),
}


class UnknownRecipe(RecipeError):
    def __init__(self, names: list[str], known: list[str]):
        self.names, self.known = names, known
        super().__init__(f"no recipe {', '.join(map(repr, names))}; the recipes: {', '.join(known)}")


@dataclass(frozen=True)
class Recipe:
    """A recipe file read: its name (the file's, what `--recipe` names), its one-line description (the header's
    first line), the whole comment header (its sources and why each value) and the deployment fragment."""

    name: str
    description: str
    header: str
    fragment: Mapping[str, Any]
    needs: Mapping[str, str] = field(default_factory=dict)

    @property
    def proven(self) -> str | None:
        """The header's `proven:` paragraph: the record that served this recipe on the image it names."""
        return _paragraph(self.header, PROVEN)

    @property
    def unverified(self) -> str | None:
        """The header's `unverified:` paragraph: why no record shows this recipe serving on the image it names."""
        return _paragraph(self.header, UNVERIFIED)

    def requires(self) -> dict[str, str]:
        """What it needs of its image beyond flags, each with why: Ray for `launcher: ray`, vLLM's native
        multi-node when the native launcher spans nodes, and its own `needs:`."""
        launcher = self.serving.get("launcher", "native")
        out = {"ray": "serving.launcher is ray (`ray start` runs in the image)"} if launcher == "ray" else {}
        if launcher == "native" and self.gpus > 1:
            out[NATIVE_MULTI_NODE] = "the native launcher runs one rank per node with --nnodes/--headless"
        return out | dict(self.needs)

    def image_known(self, images: Mapping[str, KnownImage] | None = None) -> KnownImage | None:
        """What its image (`serving.image`) is known to provide, by `images` (default `KNOWN_IMAGES`); None: not
        described there, so not judged here (`plan` asks the image itself)."""
        return (KNOWN_IMAGES if images is None else images).get(str(self.serving.get("image", "")))

    def lacks(self, images: Mapping[str, KnownImage] | None = None) -> list[str]:
        """What it needs that its image is known not to provide, or not known to, in words; empty when the image is
        known to provide all of it, or is not described (`image_known`)."""
        image = str(self.serving.get("image", ""))
        known = self.image_known(images)
        if known is None:
            return []
        out = []
        for need, why in self.requires().items():
            if need == "ray" and not known.has_ray:
                out.append(f"{why}, but {image} ships without Ray ({known.source}): use launcher: native, or an "
                           "image with Ray")
            elif need != "ray" and need not in known.carries:
                out.append(f"it needs {need} ({why}), which {image} (vLLM {known.vllm}) is not known to carry")
        return out

    @property
    def serving(self) -> Mapping[str, Any]:
        serving: Mapping[str, Any] = self.fragment["serving"]
        return serving

    @property
    def gpus(self) -> int:
        """The GPUs it spans (tp x pp), so the nodes it takes: a Spark has one."""
        return int(self.serving.get("tensor_parallel_size", 1)) * int(self.serving.get("pipeline_parallel_size", 1))

    @property
    def memory_fraction(self) -> float:
        return float(self.serving.get("gpu_memory_utilization", 0.8))

    def summary(self) -> str:
        """One line for `reconciler init --list`: what it takes of the cluster, and what it is."""
        share = f"tp {self.gpus}, {self.memory_fraction:g} of {'each' if self.gpus > 1 else 'its'} node"
        return f"{self.name:<20} {share:<24} {self.description}" + (" (unverified)" if self.unverified else "")


def _header(text: str) -> list[str]:
    lines = []
    for line in text.splitlines():
        if not line.startswith("#"):
            break
        lines.append(line[1:].removeprefix(" "))
    return lines


def _paragraph(header: str, key: str) -> str | None:
    """The header line starting with `key`, joined with the indented lines that continue it; None without one."""
    lines = header.splitlines()
    for i, line in enumerate(lines):
        if line.startswith(key):
            rest = [more.strip() for more in itertools.takewhile(lambda m: m.startswith(" "), lines[i + 1:])]
            return " ".join([line[len(key):].strip(), *rest]).strip()
    return None


def _status_problems(header: str) -> list[str]:
    said = [key for key in (PROVEN, UNVERIFIED) if _paragraph(header, key)]
    return [] if len(said) == 1 else [f"its header says either `{PROVEN} <the record that served it on its image>` "
                                      f"or `{UNVERIFIED} <why not>`, once"]


def _needs_problems(needs: object) -> list[str]:
    if isinstance(needs, dict) and all(isinstance(k, str) and isinstance(v, str) and v for k, v in needs.items()):
        return []
    return [f"{NEEDS} maps each vLLM change it needs (`vllm-project/vllm#N`) to why"]


def _fragment_problems(data: object) -> list[str]:
    if not isinstance(data, dict) or not set(RECIPE_KEYS) <= set(data) <= {*RECIPE_KEYS, NEEDS}:
        return [f"holds exactly {', '.join(RECIPE_KEYS)} (one deployment), and may say what it {NEEDS}"]
    if not isinstance(data["model"], dict) or not isinstance(data["serving"], dict):
        return ["model and serving are mappings"]
    out = ["model.path is the operator's (init --models-path)"] if "path" in data["model"] else []
    return out + [f"serving.{key} is init's (it places the deployments)" for key in PLACED_SERVING_KEYS
                  if key in data["serving"]]


def parse(name: str, text: str) -> Recipe:
    """The recipe `name` from its file's text; RecipeError when it is not one deployment free of placement, or has
    no header to say what it is and how far it is proven."""
    header = _header(text)
    problems = [] if header and header[0].strip() else ["starts with a comment line saying what it serves"]
    problems += _status_problems("\n".join(header))
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise RecipeError(f"recipe {name}: not YAML: {exc}") from None
    problems += _fragment_problems(data)
    if isinstance(data, dict) and NEEDS in data:
        problems += _needs_problems(data[NEEDS])
    if problems:
        raise RecipeError(f"recipe {name}: " + "; ".join(problems))
    fragment = {key: data[key] for key in RECIPE_KEYS}
    return Recipe(name, header[0].strip(), "\n".join(header), fragment, dict(data.get(NEEDS, {})))


def catalogue(texts: Mapping[str, str]) -> dict[str, Recipe]:
    """Every recipe of `texts` (name -> text, as reconciler.files.recipes gives them) read."""
    return {name: parse(name, text) for name, text in texts.items()}


@dataclass(frozen=True)
class Pick:
    """One `--recipe NAME[@NODE]`: the recipe, and the node it was asked to run on (default: head first)."""

    recipe: str
    node: str | None = None

    @classmethod
    def of(cls, text: str) -> Pick:
        recipe, _, node = text.partition("@")
        return cls(recipe, node or None)

    def __str__(self) -> str:
        return self.recipe + (f"@{self.node}" if self.node else "")


def _gpus(node: Mapping[str, Any]) -> int:
    return int(node.get("gpus", 1))


def _head_first(nodes: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    return sorted(nodes, key=lambda n: n["role"] != "head")


def _node_for(pick: Pick, where: str, nodes: Sequence[Mapping[str, Any]]) -> Mapping[str, Any]:
    """The node `@where` names: a node's name, or its role when one node has it (`@head`, `@worker` of a pair)."""
    named = [n for n in nodes if n["name"] == where] or [n for n in nodes if n["role"] == where]
    if len(named) != 1:
        names = ", ".join(n["name"] for n in nodes)
        raise RecipeError(f"{pick}: no node {where!r} (the nodes: {names}; or `head`, or `worker` when there is "
                          "one worker)")
    return named[0]


def _span(recipe: Recipe, pick: Pick, nodes: Sequence[Mapping[str, Any]]) -> list[str]:
    """The nodes the pick runs on, head first: the one `@NODE` names, else whole nodes from the head on, as many as
    its tensor x pipeline parallel size takes (a TP-2 recipe takes both Sparks, a single-node one the head)."""
    if pick.node is not None:
        node = _node_for(pick, pick.node, nodes)
        if _gpus(node) != recipe.gpus:
            raise RecipeError(f"{pick}: the recipe spans {recipe.gpus} GPUs (tensor_parallel_size x "
                              f"pipeline_parallel_size) and {node['name']} has {_gpus(node)}: place it without @")
        return [node["name"]]
    chosen: list[str] = []
    have = 0
    for node in _head_first(nodes):
        if have >= recipe.gpus:
            break
        chosen.append(node["name"])
        have += _gpus(node)
    if have != recipe.gpus:
        raise RecipeError(f"{pick}: the recipe spans {recipe.gpus} GPUs (tensor_parallel_size x "
                          f"pipeline_parallel_size) and whole nodes from the head on give {have}: "
                          + ("add a --worker" if have < recipe.gpus else "give every node its GPUs"))
    return chosen


def container_name(deployment: str) -> str:
    """Its own container name: how the reconciler finds a deployment's rank on a node (`vllm_` + the name)."""
    return "vllm_" + deployment.replace("-", "_")


def _unique(name: str, taken: set[str]) -> str:
    """The recipe's deployment name, or with `-2`, `-3`, ... when an earlier pick took it (the same recipe on
    another node: bge-m3 on the head and on the worker, as the seed ran it)."""
    out, k = name, 2
    while out in taken:
        out, k = f"{name}-{k}", k + 1
    return out


def _placed(serving: Mapping[str, Any], index: int, span: list[str], name: str) -> dict[str, Any]:
    """What `compose` adds to a recipe's serving: its nodes, container and ports, the ports only those it binds
    (the API; torch's rendezvous when native ranks span nodes; Ray's GCS with the Ray launcher), each unique to
    this deployment."""
    launcher = serving.get("launcher", "native")
    placed: dict[str, Any] = {"container_name": container_name(name), "nodes": span, "port": FIRST_API_PORT + index}
    if launcher == "native" and len(span) > 1:
        placed["master_port"] = FIRST_MASTER_PORT + index
    if launcher == "ray":
        placed["ray_port"] = FIRST_RAY_PORT + index
    return placed


def deployment(recipe: Recipe, index: int, span: list[str], name: str, models_path: str) -> dict[str, Any]:
    """The recipe as the `index`-th deployment of a file: named `name`, on `span`, its model under `models_path`."""
    fragment = copy.deepcopy(dict(recipe.fragment))
    serving = fragment["serving"]
    return {"name": name, "model": {**fragment["model"], "path": models_path},
            "serving": {**serving, **_placed(serving, index, span, name)}}


def compose(recipes: Mapping[str, Recipe], picks: Sequence[Pick], nodes: Sequence[Mapping[str, Any]],
            models_path: str) -> dict[str, Any]:
    """The desired-state document of `nodes` (as given: plain mappings, or discover's commented ones) serving one
    deployment per pick, in the order picked. UnknownRecipe names every pick that is not a recipe; RecipeError
    says why a pick cannot be placed. Not validated: the caller hands the result to the spec, whose rules judge
    what no single recipe can, such as the memory fractions of a node adding up past 1."""
    unknown = [p.recipe for p in picks if p.recipe not in recipes]
    if unknown:
        raise UnknownRecipe(unknown, sorted(recipes))
    taken: set[str] = set()
    deployments = []
    for index, pick in enumerate(picks):
        recipe = recipes[pick.recipe]
        name = _unique(str(recipe.fragment["name"]), taken)
        taken.add(name)
        deployments.append(deployment(recipe, index, _span(recipe, pick, nodes), name, models_path))
    return {"nodes": list(nodes), "deployments": deployments}
