"""`discover`: read the nodes (one read-only script each, reconciler/edge/discover/) and write a commented starter
desired state."""

from __future__ import annotations

import sys
from pathlib import Path

import click
from pydantic import ValidationError

from reconciler.cli.common import nodes_options, write_output
from reconciler.core import spec
from reconciler.core.exits import Exit
from reconciler.core.text import printable


@click.command()
@click.option("--head", "head", required=True, help="The head's SSH address (it runs rank 0 and the API).")
@nodes_options
@click.option("--output", "-o", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Write the desired state here (default: stdout).")
@click.option("--port", default=22, show_default=True, help="SSH port.")
@click.option("--model", default=None, metavar="ORG/NAME",
              help="The model to serve (default: the largest in a node's Hugging Face cache). Need not be on the "
                   "head yet: `apply` downloads it there.")
@click.option("--revision", default=None, help="The model's revision, a commit hash to pin (default: the cache's "
                                                 "refs/main, else main).")
@click.option("--image", default=None, help="The serving image (default: the largest *vllm* image on the head). "
                                            "Need not be on the head yet: `apply` pulls it there.")
@click.option("--api-key-secret", is_flag=True,
              help="Declare serving.secrets VLLM_API_KEY (value from the daemon's environment, never the file).")
def discover(head: str, workers: tuple[str, ...], user: str, known_hosts: str, identity: str | None,
             jump_through_head: bool, output: Path | None, port: int, model: str | None, revision: str | None,
             image: str | None, api_key_secret: bool) -> None:
    """Read the nodes (one read-only script each) and write a commented starter desired state.

    Every inferred value is marked `# GUESS:`; what --model, --revision, --image and --api-key-secret name is
    written as given. Exit 0 when the result validates, 3 when it does not (it is written anyway, with the
    problems printed), 5 when a node cannot be reached, 1 a bad address or another error."""
    from reconciler.edge import discover as disc
    from reconciler.edge.ssh import RemoteError

    known_hosts = str(Path(known_hosts).resolve())
    identity = str(Path(identity).resolve()) if identity else None
    try:
        sessions = disc.sessions_for(head, list(workers), user=user, known_hosts=known_hosts, identity=identity,
                                     jump=jump_through_head, port=port)
    except ValidationError as exc:
        click.echo(f"discover: {exc.errors()[0]['loc']}: {exc.errors()[0]['msg']}", err=True)
        sys.exit(Exit.ERROR)
    try:
        facts = disc.probe(sessions)
    except RemoteError as exc:
        click.echo(printable(f"discover: {exc}"), err=True)
        sys.exit(Exit.UNREACHABLE)
    finally:
        for s in reversed(sessions):
            s.close()
    text = disc.render(facts, user=user, known_hosts=known_hosts, identity=identity, jump=jump_through_head,
                       asked=disc.ModelChoice(model, revision, image, api_key_secret))
    if output is None:
        click.echo(text, nl=False)
    else:
        write_output(output, text)
        click.echo(f"wrote {output} ({text.count('# GUESS:')} guesses to review)", err=True)
    try:
        spec.loads(text, filename=str(output or "<discovered>"))
    except spec.InvalidDesiredState as exc:
        for line in exc.lines():
            click.echo(line, err=True)
        sys.exit(Exit.INVALID)
