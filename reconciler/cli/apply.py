"""`apply`: one convergence without a daemon (reconciler/loop/apply.py does the work)."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from reconciler.cli.common import env_file_option, load_or_exit


@click.command()
@click.argument("file", type=click.Path(dir_okay=True, path_type=str))
@click.option("--yes", "-y", is_flag=True, help="Do not ask before changing anything.")
@click.option("--dry-run", is_flag=True, help="Show the plan and stop (exit 2 if it has changes, as plan).")
@click.option("--max-passes", default=3, show_default=True, help="Observe-plan-execute rounds before giving up.")
@env_file_option
@click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]), default="info",
              show_default=True, envvar="RECONCILER_LOG_LEVEL",
              help="The least severe level logged. Under systemd every line carries its syslog priority "
                   "(journalctl -p warning).")
def apply(file: str, yes: bool, dry_run: bool, max_passes: int, env_file: Path, log_level: str) -> None:
    """One convergence pass: observe, show the plan, execute it in order, verify. Exit 0 converged, 1 not (or an
    error), 3 invalid file or secrets, 4 held by another actor, 5 a node unreachable."""
    from reconciler.cli.plan_text import plan_text
    from reconciler.edge import log
    from reconciler.edge.lease import Holder
    from reconciler.loop.apply import apply_once

    desired = load_or_exit(file, env_file)
    log.configure(level=log_level)
    sys.exit(apply_once(desired, show=plan_text, yes=yes, dry_run=dry_run, max_passes=max_passes,
                        holder=Holder.of("apply", file)))
