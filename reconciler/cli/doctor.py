"""`doctor`: every node's prerequisites checked over the daemon's own SSH (reconciler/edge/doctor.py), judged by
reconciler/core/preflight.py; nothing changed."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from reconciler.cli.common import ENVIRONMENT_FILE, load_or_exit
from reconciler.core.exits import Exit
from reconciler.core.text import printable


@click.command()
@click.argument("file", type=click.Path(dir_okay=True, path_type=str))
@click.option("--json", "as_json", is_flag=True, help="Machine-readable checks (docs/cli.md).")
@click.option("--env-file", type=click.Path(dir_okay=False, path_type=Path),
              default=ENVIRONMENT_FILE, show_default=True,
              help="The environment file systemd gives the daemon (EnvironmentFile=): serving.secrets' names.")
@click.option("--daemon-user", default=None,
              help="The user the daemon runs as (systemd User=), whose files are judged. [default: this user; as "
                   "root, spark, the shipped unit's]")
def doctor(file: str, as_json: bool, env_file: Path, daemon_user: str | None) -> None:
    """Check every node's prerequisites over the daemon's own SSH (kubeadm preflight): each check ok, warn or
    fail with what it saw and the exact fix. Changes nothing. Exit 0 all ok or warn, 1 a check failed, 3 invalid."""
    from reconciler.core.preflight import exit_code, report_json, report_text
    from reconciler.edge.doctor import doctor as run_checks

    desired = load_or_exit(file)  # secrets come from --env-file, and loose file modes are checks, not refusals
    try:
        found = run_checks(desired, file, env_file, daemon_user)
    except KeyError:
        click.echo(printable(f"doctor: no user {daemon_user!r} on this host (--daemon-user)"), err=True)
        sys.exit(Exit.ERROR)
    if as_json:
        click.echo(json.dumps(report_json(found), indent=2))
    else:
        click.echo(report_text(found), nl=False)
    sys.exit(exit_code(found))
