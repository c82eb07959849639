"""`history` and `rollback`: the generations of a file the daemon kept (reconciler/loop/history.py), read, and one
of them written back over the file."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from reconciler.cli.common import STATE_DIR_OPTION, env_file_option, secrets_or_exit
from reconciler.core.exits import Exit
from reconciler.core.text import printable


@click.command()
@click.argument("file", type=click.Path(dir_okay=False, path_type=Path))
@STATE_DIR_OPTION
@click.option("--json", "as_json", is_flag=True, help="The entries and the rollback hold as JSON.")
def history(file: Path, state_dir: Path, as_json: bool) -> None:
    """The generations of FILE the daemon kept: when each was taken, when it first served, how it ended (docs/
    operations.md "History and rollback"). Exit 1 when none is kept."""
    from reconciler.loop import history as kept

    try:
        found = kept.read(state_dir, file, daemon=False)
    except (OSError, ValueError) as exc:
        click.echo(printable(f"reconciler history: cannot read the history in {state_dir}: {exc}"), err=True)
        sys.exit(Exit.ERROR)
    click.echo(found.to_json() if as_json else found.table())
    sys.exit(Exit.OK if found.entries else Exit.ERROR)


@click.command()
@click.argument("file", type=click.Path(dir_okay=False, exists=True, path_type=Path))
@click.argument("generation", type=click.IntRange(min=1), required=False)
@STATE_DIR_OPTION
@env_file_option
@click.option("--daemon-user", default=None,
              help="The user the daemon runs as (systemd User=), whose files are judged. [default: this user; as "
                   "root, spark, the shipped unit's]")
def rollback(file: Path, generation: int | None, state_dir: Path, env_file: Path, daemon_user: str | None) -> None:
    """Write a kept generation's text back over FILE (default: the one the daemon rolled back to, else the newest
    that served before the newest), atomically, after a copy of what FILE held: the file stays the truth, and the
    daemon takes it as a new generation. The text is validated first (as `validate` does); nothing is written
    when it is not valid today."""
    import time

    from reconciler.edge import trusted_files
    from reconciler.loop import history as kept

    try:
        _user, uid = trusted_files.daemon_user(daemon_user)
    except KeyError:
        click.echo(printable(f"reconciler rollback: no user {daemon_user!r} on this host (--daemon-user)"), err=True)
        sys.exit(Exit.ERROR)
    try:
        entry = kept.rollback_target(kept.read(state_dir, file, daemon=False), generation)
    except (OSError, ValueError) as exc:
        click.echo(printable(f"reconciler rollback: {exc}"), err=True)
        sys.exit(Exit.ERROR)
    text = kept.text_of(state_dir, file, entry.generation)
    if text is None:
        click.echo(f"reconciler rollback: the text of generation {entry.generation} is not kept in "
                   f"{kept.directory(state_dir, file)}", err=True)
        sys.exit(Exit.ERROR)
    kept_at = kept.directory(state_dir, file) / f"{entry.generation}.yaml"
    _, problems = trusted_files.load_text(text, file, secrets_or_exit(env_file), kept_at, uid)
    if problems:
        click.echo(f"reconciler rollback: generation {entry.generation} is not valid today; nothing written:\n"
                   + "\n".join(problems), err=True)
        sys.exit(Exit.INVALID)
    try:
        copy = kept.write_back(file, text, time.time())
    except OSError as exc:
        click.echo(printable(f"reconciler rollback: cannot write {file}: {exc}; nothing changed"), err=True)
        sys.exit(Exit.ERROR)
    click.echo(f"{file}: generation {entry.generation} written back (what it held is in {copy}); the daemon takes "
               "it as a new generation")
