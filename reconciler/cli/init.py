"""`init`: a desired state composed from recipes (docs/recipes.md) without reading a node: the nodes drafted as
discover drafts them, from their addresses alone, each guess marked."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from reconciler.cli.common import nodes_options, write_output
from reconciler.core import spec
from reconciler.core.exits import Exit
from reconciler.core.text import printable

if TYPE_CHECKING:
    from ruamel.yaml.comments import CommentedMap

    from reconciler.core.recipes import Recipe
    from reconciler.edge.discover.guess import NodeDraft
    from reconciler.edge.discover.render import SshChoice


#: The RDMA device of a Spark's outer QSFP port's first half (ibdev2netdev: rocep1s0f1 ==> enp1s0f1np1), which
#: discover's fallback interface `enp1s0f1np1` belongs to.
SPARK_RDMA_DEVICE = "rocep1s0f1"
INIT_HEADER = ("Desired state written by `reconciler init` from recipes (docs/recipes.md); no node was read.\n"
               "Review every `# GUESS:` line (`reconciler discover` reads the nodes' real ports and addresses),\n"
               "then: reconciler validate FILE && reconciler plan FILE.\n"
               "Keep the end marker `...` the last line: a half-written save is then refused.")
_UNREAD_FABRIC = ("init reads no node: the Spark's outer QSFP port assumed (NVIDIA's connect-two-sparks; its twin "
                  "enP2p1s0f1np1 may be declared too, in another subnet)")


def _hostname(host: str) -> str:
    """The name a node is drafted under: the host given when it is a name, none for an address (discover then
    names the nodes head, worker1, ...)."""
    import ipaddress

    try:
        ipaddress.ip_address(host)
    except ValueError:
        return host
    return ""


def _unread_node(draft: NodeDraft, is_head: bool, head_name: str, choice: SshChoice) -> CommentedMap:
    """discover's entry of a node (its ssh and fabric sections), for a node init has not read: the Spark's
    defaults in place of what discover reads, each said to be a guess."""
    from dataclasses import replace

    from ruamel.yaml.comments import CommentedMap

    from reconciler.edge.discover.render import _above, _eol, _fabric, _ssh, quoted

    spark = replace(draft, fabric=replace(draft.fabric, rdma_device=SPARK_RDMA_DEVICE, notes=[_UNREAD_FABRIC]))
    entry = CommentedMap([("name", quoted(draft.name)), ("role", "head" if is_head else "worker")])
    _eol(entry, "name", "as --head/--worker name it" if draft.facts.hostname else "GUESS: given as an address: "
                        "rename it freely")
    entry["ssh"] = _ssh(draft, is_head, head_name, choice)
    entry["fabric"], notes = _fabric(spark)
    _above(entry, "fabric", notes, indent=4)
    _eol(entry["fabric"], "rdma_device", "GUESS: that port's RDMA device on a Spark")
    _eol(entry["fabric"], "address", "GUESS: NVIDIA's netplan example subnet; yours may differ")
    _eol(entry["fabric"], "mtu", "the Spark recipes' value (set by the link step)")
    entry["internet"] = is_head
    _eol(entry, "internet", "GUESS: the head downloads the weights and pulls the image" if is_head else
         "GUESS: internet-less, as the seed's worker: weights and image come from the head")
    entry["gpus"] = 1
    _eol(entry, "gpus", "GUESS: a DGX Spark has one GB10")
    return entry


def _unread_nodes(hosts: list[str], choice: SshChoice) -> tuple[list[NodeDraft], list[CommentedMap]]:
    """The nodes as discover drafts them (names, fabric ports and addresses in one subnet), from the addresses
    alone: the head first."""
    from reconciler.edge.discover.facts import NodeFacts
    from reconciler.edge.discover.guess import draft_nodes

    drafts = draft_nodes([NodeFacts(host=host, hostname=_hostname(host)) for host in hosts])
    return drafts, [_unread_node(d, i == 0, drafts[0].name, choice) for i, d in enumerate(drafts)]


def _commented(value: Any) -> Any:
    """A composed deployment as YAML nodes of its own: every string double-quoted (a flag such as `on` or `no`
    stays a string for any YAML reader), lists of values on one line."""
    from ruamel.yaml.comments import CommentedMap, CommentedSeq

    from reconciler.edge.discover.render import _flow, quoted

    if isinstance(value, dict):
        return CommentedMap((key, _commented(item)) for key, item in value.items())
    if isinstance(value, list):
        return _flow(CommentedSeq(_commented(item) for item in value))
    return quoted(value) if isinstance(value, str) else value


def _init_text(document: dict[str, Any], used: list[Recipe], drafts: list[NodeDraft]) -> str:
    """The file: the drafted nodes, each deployment under a comment naming its recipe (whose header says where
    every value comes from), discover's co-tenants and policy sections."""
    from ruamel.yaml.comments import CommentedMap, CommentedSeq

    from reconciler.core.recipes import FIRST_API_PORT
    from reconciler.edge.discover.render import _above, _co_tenants, _dump, _policy

    out = CommentedMap()
    out.yaml_set_start_comment(INIT_HEADER)
    out["nodes"] = CommentedSeq(document["nodes"])
    out["deployments"] = deployments = CommentedSeq(_commented(d) for d in document["deployments"])
    for i, recipe in enumerate(used):
        about = [f"recipe {recipe.name}: {recipe.description}",
                 f"its sources and why each value: the header of recipes/{recipe.name}.yaml (reconciler/files/recipes)",
                 *_init_cautions(recipe)]
        deployments.yaml_set_comment_before_after_key(i, before="\n".join(["", *about] if i else about), indent=2)
    out["co_tenants"] = _co_tenants(drafts, FIRST_API_PORT)
    out["policy"] = _policy()
    for section in ("deployments", "co_tenants", "policy"):
        _above(out, section, [], indent=0, blank=True)
    return "\n".join(map(printable, _dump(out).split("\n")))


def _init_cautions(recipe: Recipe) -> list[str]:
    """What to know before serving `recipe` on the image it names: that no record shows it serving there (its
    header's `unverified:`), and what it needs that the image is not known to provide (`Recipe.lacks`)."""
    out = [f"UNVERIFIED: {recipe.unverified}"] if recipe.unverified else []
    if recipe.image_known() is None:
        out.append(f"IMAGE UNKNOWN TO INIT: {recipe.serving.get('image')} is not one whose Ray and vLLM init knows; "
                   "`reconciler plan` asks it before anything starts")
    return out + [f"NEEDS WHAT ITS IMAGE LACKS: {lack}" for lack in recipe.lacks()]


def _init_warnings(used: list[Recipe]) -> None:
    """Each picked recipe's cautions on stderr, once per recipe: they do not stop the file (its fields are valid;
    `plan` judges the image itself before anything starts), but an operator should not learn them from a failed
    start."""
    for recipe in {r.name: r for r in used}.values():
        for caution in _init_cautions(recipe):
            click.echo(printable(f"init: warning: recipe {recipe.name}: {caution}"), err=True)


def _refused(exc: spec.InvalidDesiredState) -> None:
    """Why the composition is not a valid file, then exit 3: nothing is written."""
    for problem in exc.problems:
        click.echo(printable(f"init: {problem.path}: {problem.message}"), err=True)
    click.echo("init: nothing written", err=True)
    sys.exit(Exit.INVALID)


@click.command()
@click.option("--recipe", "picks", multiple=True, metavar="NAME[@NODE]",
              help="A recipe to serve, one deployment each (repeat; `--list` names them). @NODE runs a single-node "
                   "recipe on that node (its name, or `head`, or `worker` when there is one); by default a recipe "
                   "takes whole nodes from the head on, as many as its tensor parallel size.")
@click.option("--list", "list_only", is_flag=True, help="List the recipes, one line each (also without --recipe).")
@click.option("--head", default=None, help="The head's SSH address (it runs rank 0 and the API).")
@nodes_options
@click.option("--models-path", default=None,
              help="The Hugging Face hub directory of every node, where the models are.  "
                   "[default: /home/USER/.cache/huggingface/hub]")
@click.option("--output", "-o", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Write the desired state here (default: stdout).")
def init(picks: tuple[str, ...], list_only: bool, head: str | None, workers: tuple[str, ...], user: str,
         known_hosts: str, identity: str | None, jump_through_head: bool, models_path: str | None,
         output: Path | None) -> None:
    """Write a desired state that serves recipes (docs/recipes.md): the nodes drafted as discover drafts them,
    but from their addresses alone (every guess marked `# GUESS:`), one deployment per --recipe, each with its own
    container name and ports. The file is judged as `validate` judges it before anything is written. A recipe
    no record shows serving on its image (`unverified:`), or that needs what its image is not known to provide
    (Ray, a vLLM fix), is said on stderr and in the file, and written all the same. Exit 0 written, 3 not a valid
    file (e.g. a node's memory fractions add up past 1; nothing written), 1 an unknown recipe, a recipe that
    cannot be placed or a missing --head."""
    from reconciler import files
    from reconciler.core import recipes
    from reconciler.edge.discover.render import SshChoice

    known = recipes.catalogue(files.recipes())
    if list_only or not picks:
        for recipe in known.values():
            click.echo(recipe.summary())
        return
    if head is None:
        click.echo("init: --head is required with --recipe (the head's SSH address)", err=True)
        sys.exit(Exit.ERROR)
    choice = SshChoice(user, str(Path(known_hosts).resolve()), str(Path(identity).resolve()) if identity else None,
                       jump_through_head)
    drafts, nodes = _unread_nodes([head, *workers], choice)
    chosen = [recipes.Pick.of(p) for p in picks]
    try:
        document = recipes.compose(known, chosen, nodes, models_path or f"/home/{user}/.cache/huggingface/hub")
    except recipes.RecipeError as exc:
        click.echo(printable(f"init: {exc}"), err=True)
        sys.exit(Exit.ERROR)
    used = [known[p.recipe] for p in chosen]
    text = _init_text(document, used, drafts)
    try:
        spec.loads(text, filename=str(output or "<init>"))
    except spec.InvalidDesiredState as exc:
        _refused(exc)
    _init_warnings(used)
    if output is None:
        click.echo(text, nl=False)
    else:
        write_output(output, text)
        click.echo(f"wrote {output}: {len(chosen)} deployments, {text.count('# GUESS:')} guesses to review", err=True)
