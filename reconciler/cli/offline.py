"""The commands that read no node: `validate` (the file as the daemon would take it), `schema`, `print` (a shipped
file), `sudoers` and `export` (what the file implies, for sudo and for Kubernetes)."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path

import click

from reconciler.cli.common import env_file_option, load_or_exit
from reconciler.core import spec
from reconciler.core.exits import Exit
from reconciler.core.export import lws_yaml
from reconciler.core.text import printable


@click.command()
@click.argument("file", type=click.Path(dir_okay=True, path_type=str))
@env_file_option
@click.option("--skip-secrets", is_flag=True,
              help="Judge the file alone: not its secrets nor the modes of the files it trusts (a file checked "
                   "away from the head, in CI).")
@click.option("--daemon-user", default=None,
              help="The user the daemon runs as (systemd User=), whose files are judged. [default: this user; as "
                   "root, spark, the shipped unit's]")
def validate(file: str, env_file: Path, skip_secrets: bool, daemon_user: str | None) -> None:
    """Check FILE as the daemon would take it: the file (every error as FILE:LINE:COL: field.path: message),
    every secret it names (--env-file, then the environment; never a value shown) and the modes of the files it
    trusts, as the daemon's user sees them. Exit 0 valid, 3 not: `validate && systemctl reload` never feeds the
    daemon what it would refuse."""
    from reconciler.edge.trusted_files import daemon_user as resolve

    try:
        _user, uid = resolve(daemon_user)
    except KeyError:
        click.echo(printable(f"validate: no user {daemon_user!r} on this host (--daemon-user)"), err=True)
        sys.exit(Exit.ERROR)
    load_or_exit(file, None if skip_secrets else env_file, uid)
    click.echo(f"{file}: valid")


@click.command()
@click.option("--markdown", is_flag=True, help="The reference in docs/desired-state.md instead of JSON Schema.")
def schema(markdown: bool) -> None:
    """Print the JSON Schema of the desired state (for editors)."""
    if markdown:
        from reconciler.core.docgen import markdown as render

        click.echo(render(), nl=False)
        return
    click.echo(json.dumps(spec.json_schema(), indent=2))


@click.command(name="print")
@click.argument("name", required=False)
def print_file(name: str | None) -> None:
    """Print a shipped file (systemd unit, alert rules, dashboard, sample, ...) to stdout, e.g.
    `reconciler print unit | sudo tee /etc/systemd/system/spark-reconciler.service`. Without NAME: the names."""
    from reconciler import files

    if name is None:
        for key, (_path, what) in files.SHIPPED.items():
            click.echo(f"{key:<20} {what}")
        return
    if name not in files.SHIPPED:
        click.echo(printable(f"print: no file named {name!r}; one of: {', '.join(files.SHIPPED)}"), err=True)
        sys.exit(Exit.ERROR)
    click.echo(files.read(name), nl=False)


@click.command()
@click.argument("file", type=click.Path(dir_okay=True, path_type=str))
def sudoers(file: str) -> None:
    """Print the exact sudoers lines every node needs for FILE (per interface, nothing wider)."""
    from reconciler.edge.ssh import sudoers_snippet

    click.echo(sudoers_snippet(load_or_exit(file)), nl=False)


#: `export --format`: each format and its renderer. The option's choices are this table's keys, so a format is
#: never offered without the renderer that reads it (the option was once accepted and ignored).
EXPORT_FORMATS: dict[str, Callable[[spec.Desired, str | None], str]] = {"lws": lws_yaml}


@click.command()
@click.argument("file", type=click.Path(dir_okay=True, path_type=str))
@click.option("--format", "fmt", type=click.Choice(sorted(EXPORT_FORMATS)), default="lws", show_default=True,
              help="lws: a LeaderWorkerSet (leaderworkerset.x-k8s.io/v1) for Kubernetes.")
@click.option("--name", default=None, help="metadata.name (default: the served model name, DNS-safe).")
def export(file: str, fmt: str, name: str | None) -> None:
    """Print the equivalent Kubernetes manifest of FILE's serving (the bridge to LWS; see docs/scaling.md)."""
    desired = load_or_exit(file)
    click.echo(EXPORT_FORMATS[fmt](desired, name), nl=False)
