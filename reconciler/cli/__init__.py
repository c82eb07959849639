"""The `reconciler` command. Names and exit codes are a contract (docs/cli.md); keep them stable.

Exit codes, the same in every command (reconciler.core.exits): 0 nothing to do / converged / valid, 1 an error of
any kind, 2 changes pending or differences (plan, apply --dry-run, verify, status: like terraform
-detailed-exitcode), 3 the file or its secrets invalid, 4 held by another actor, 5 a node (status: the daemon)
unreachable.

This module is the group (`main`, the console script's entry point) and its list of commands; each command lives
in the module of its job: offline (validate, schema, print, sudoers, export: no node read), plan (plan, observe),
verify, apply, run (the daemon), history (history, rollback), status (+ status_screen, status_view: the daemon's
/status on the terminal), discover, init, doctor; common holds what several of them share. A command imports the
edge and the loop (and rich's live display) inside its function, as it always did: `reconciler --help` loads
neither, and each command only what it runs.
"""

from __future__ import annotations

import sys
from typing import Any

import click

from reconciler.cli import apply, discover, doctor, history, init, offline, plan, run, status, verify
from reconciler.core.exits import Exit


class _Commands(click.Group):
    """click exits 2 on a bad option, which a script reading Terraform's codes takes for "changes pending":
    every click error exits 1 here, as Terraform's do; what a command exits with itself passes through."""

    def main(self, *args: Any, **kwargs: Any) -> Any:
        kwargs["standalone_mode"] = False  # exceptions come here, and the codes below are ours
        try:
            return super().main(*args, **kwargs)
        except click.ClickException as exc:
            exc.show()
            sys.exit(Exit.ERROR)
        except click.Abort:
            click.echo("Aborted!", err=True)
            sys.exit(Exit.ERROR)


def _version(ctx: click.Context, _param: click.Parameter, value: bool) -> None:
    """`reconciler --version`: `reconciler, version 0.1.0 (git 6a88048)` (click's words, which scripts already
    match, and the revision as reconciler._revision finds it)."""
    if not value or ctx.resilient_parsing:
        return
    from importlib.metadata import PackageNotFoundError, version

    from reconciler._revision import revision

    try:
        number = version("spark-reconciler")
    except PackageNotFoundError:
        number = "unknown"
    click.echo(f"reconciler, version {number} (git {revision()})")
    ctx.exit()


@click.group(cls=_Commands, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--version", is_flag=True, expose_value=False, is_eager=True, callback=_version,
              help="Show the version and the git revision it was built from, and exit.")
def main() -> None:
    """Keep a multi-node vLLM deployment on DGX Sparks exactly as declared in a desired-state file."""


#: Every command of `reconciler` (click lists them by name in `--help`, whatever the order here).
COMMANDS: tuple[click.Command, ...] = (
    offline.validate, offline.schema, offline.print_file, offline.sudoers, offline.export,
    plan.plan, plan.observe, verify.verify, apply.apply, run.run, history.history, history.rollback,
    status.status, discover.discover, init.init, doctor.doctor,
)
for _command in COMMANDS:
    main.add_command(_command)

__all__ = ["COMMANDS", "main"]
