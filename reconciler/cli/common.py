"""What several commands share: the options they take alike (`--env-file`, the nodes', the state dir's), the one
way a command loads the desired state and its secrets (exit 3 when it cannot), and the one way it writes a file
it produces. In one place, so that `plan`, `apply`, `run` and `validate` refuse exactly what the daemon refuses."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import click
from click.core import ParameterSource

from reconciler.core import spec
from reconciler.core.exits import Exit
from reconciler.core.text import printable

if TYPE_CHECKING:
    from reconciler.edge.trusted_files import Secrets

#: The shipped unit's `EnvironmentFile=` (reconciler/files/systemd/reconciler.service): where every command reads
#: the values of serving.secrets by default, so the CLI and the daemon see the same ones.
ENVIRONMENT_FILE = "/etc/spark-reconciler/environment"

#: `--state-dir` of the commands that read the daemon's history (`history`, `rollback`).
STATE_DIR_OPTION = click.option("--state-dir", type=click.Path(file_okay=False, path_type=Path),
                                default="/var/lib/spark-reconciler", show_default=True,
                                envvar="RECONCILER_STATE_DIR",
                                help="The daemon's state directory (where it keeps the history).")


def env_file_option(command: Callable[..., None]) -> Callable[..., None]:
    """`--env-file`: where the values of serving.secrets come from, for every command that reads them: systemd's
    file for the daemon (EnvironmentFile=), read as systemd reads it, over this process's environment."""
    return click.option("--env-file", type=click.Path(dir_okay=False, path_type=Path), default=ENVIRONMENT_FILE,
                        show_default=True, envvar="RECONCILER_ENV_FILE",
                        help="The values of serving.secrets (the unit's EnvironmentFile=; they win over this "
                             "shell's). The default may be absent; a file named here must exist.")(command)


def env_file_named() -> bool:
    """--env-file (or RECONCILER_ENV_FILE) given: then the file must exist; the default may be absent."""
    return click.get_current_context().get_parameter_source("env_file") != ParameterSource.DEFAULT


def secrets_or_exit(env_file: Path) -> Secrets:
    """The values of serving.secrets (`--env-file` over this process's environment), or exit 3 with why not."""
    from reconciler.edge import trusted_files

    try:
        return trusted_files.secrets_environment(env_file, env_file_named(), os.environ)
    except trusted_files.EnvironmentFileError as exc:
        click.echo(printable(str(exc)), err=True)
        sys.exit(Exit.INVALID)


def load_or_exit(path: str, env_file: Path | None = None, uid: int | None = None) -> spec.Desired:
    """The desired state, or exit 3 with every problem placed. With `env_file` (the commands that connect, and
    validate): the secrets must all be there (`--env-file`, then this process's environment), and every trusted
    file must be changeable by root or this user (`uid`: validate's daemon user) only
    (reconciler.edge.trusted_files): what the daemon demands."""
    from reconciler.edge import log, trusted_files

    desired, problems = trusted_files.load(path, None if env_file is None else secrets_or_exit(env_file), uid)
    for line in problems:
        click.echo(printable(line), err=True)
    if desired is None:
        sys.exit(Exit.INVALID)
    for value in desired.secret_values():
        log.register_secret(value)
    return desired


def nodes_options(command: Callable[..., None]) -> Callable[..., None]:
    """The options that name the nodes and how they are reached, as `discover` and `init` both take them."""
    for option in reversed((
            click.option("--worker", "workers", multiple=True, help="A worker's SSH address (repeat for each "
                                                                    "worker)."),
            click.option("--user", default="spark", show_default=True, help="SSH user on every node."),
            click.option("--known-hosts", default="/etc/spark-reconciler/known_hosts", show_default=True,
                         help="known_hosts every host key is checked against (strict; nothing is trusted on first "
                              "use)."),
            click.option("--identity", default=None, help="Private key file (default: the SSH agent / ~/.ssh "
                                                          "keys)."),
            click.option("--jump-through-head/--no-jump", default=True, show_default=True,
                         help="Reach the workers through the head (like ssh -J), as an internet-less worker is."))):
        command = option(command)
    return command


def write_output(output: Path, text: str) -> None:
    """`init -o` and `discover -o`: written as the state dir's files are (`generations.write_durably`: a new
    temporary file of an unforeseeable name beside PATH, renamed over it), so a link planted at PATH or at a
    temporary name is never written through (issue 53, finding F: once `Path.write_text`, which follows one).
    A regular file already at PATH keeps its mode (and, as root, its owner); a new one gets the umask's."""
    import stat

    from reconciler.loop.generations import write_durably

    try:
        was = os.lstat(output)
    except FileNotFoundError:
        was = None
    umask = os.umask(0o077)
    os.umask(umask)
    write_durably(output, text, like=was if was is not None and stat.S_ISREG(was.st_mode) else None,
                  mode=0o666 & ~umask)
