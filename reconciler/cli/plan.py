"""`plan` and `observe`: the nodes probed once (or a saved `observe --json` snapshot), and what would change or
what is there, as text (reconciler/cli/plan_text.py) or JSON; nothing changed."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click
from pydantic import ValidationError

from reconciler.cli.common import env_file_option, load_or_exit
from reconciler.cli.plan_text import plan_text
from reconciler.core import planning, spec
from reconciler.core.exits import Exit
from reconciler.core.observed import Observed


@click.command()
@click.argument("file", type=click.Path(dir_okay=True, path_type=str))
@click.option("--observed", "snapshot", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="Plan offline from a saved `observe --json` snapshot.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output (docs/cli.md).")
@env_file_option
def plan(file: str, snapshot: Path | None, as_json: bool, env_file: Path) -> None:
    """Show what changes (field by field) and the ordered steps; change nothing. Exit 0 no changes, 2 changes
    pending, 1 error, 3 invalid file or secrets, 5 a node unreachable (the plan is shown, but it cannot be whole)."""
    desired = load_or_exit(file, env_file)
    if snapshot is None:
        observed = _observe(desired)
    else:
        try:
            observed = Observed.model_validate_json(snapshot.read_bytes()).by_deployment(
                {v.deployment.name: {n.name: v.weights_root(n.name) for n in v.nodes
                                     if isinstance(v.model.path, str) or n.name in v.model.path}
                 for v in desired.views()})
        except ValidationError as exc:
            click.echo(f"{snapshot}: not an observed-state snapshot: {exc.error_count()} errors, first: "
                       f"{exc.errors()[0]['loc']}: {exc.errors()[0]['msg']}", err=True)
            sys.exit(Exit.INVALID)
    result = planning.plan(desired, observed)
    if as_json:
        click.echo(json.dumps(result.as_dict(), indent=2))
    else:
        click.echo(plan_text(result), nl=False)
    sys.exit(Exit.UNREACHABLE if observed.partial else Exit.CHANGES if result.changes else Exit.OK)


def _observe(desired: spec.Desired) -> Observed:
    from reconciler.edge.observe import observe as probe
    from reconciler.edge.ssh import Sessions

    sessions = Sessions(desired)
    try:
        observed, _ = probe(desired, sessions, timeout=desired.policy.timeouts.command)
    finally:
        sessions.close()
    return observed


@click.command()
@click.argument("file", type=click.Path(dir_okay=True, path_type=str))
@click.option("--json", "as_json", is_flag=True, help="The snapshot `plan --observed` reads.")
@env_file_option
def observe(file: str, as_json: bool, env_file: Path) -> None:
    """Probe every node once (one batched script each) and print what is there. Exit 5 if a node is unreachable."""
    desired = load_or_exit(file, env_file)
    observed = _observe(desired)
    if as_json:
        click.echo(observed.model_dump_json(indent=1))
    else:
        from reconciler.cli.plan_text import observed_text

        click.echo(observed_text(observed), nl=False)
    sys.exit(Exit.UNREACHABLE if observed.partial else Exit.OK)
