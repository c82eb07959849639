"""`run`: the daemon (reconciler/loop/daemon.py), as systemd starts it."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import click

from reconciler.cli.common import env_file_named, env_file_option


@click.command()
@click.argument("file", type=click.Path(dir_okay=True, path_type=Path))
@click.option("--state-dir", type=click.Path(file_okay=False, path_type=Path), default="/var/lib/spark-reconciler",
              show_default=True, envvar="RECONCILER_STATE_DIR", help="Lock, generation counter.")
@click.option("--listen", default=None, help="HOST:PORT for /metrics and /status (default: policy.listen).")
@click.option("--no-events", is_flag=True, help="Resync only: no docker/link event streams.")
@click.option("--log-format", type=click.Choice(["auto", "json", "console"]), default="auto", show_default=True)
@click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]), default="info",
              show_default=True, envvar="RECONCILER_LOG_LEVEL",
              help="The least severe level logged. Under systemd every line carries its syslog priority "
                   "(journalctl -p warning).")
@env_file_option
def run(file: Path, state_dir: Path, listen: str | None, no_events: bool, log_format: str, log_level: str,
        env_file: Path) -> None:
    """The daemon: keep the cluster converged until SIGTERM (systemd: Type=notify). The secrets are read from
    --env-file at every load, so a rotated key is an edit of that file and a reload (SIGHUP)."""
    from reconciler.edge import log, trusted_files
    from reconciler.loop.daemon import AlreadyRunning, Daemon

    explicit = env_file_named()
    log.configure(json_lines=None if log_format == "auto" else log_format == "json", level=log_level)
    daemon = Daemon(file, state_dir, listen=listen, events=not no_events,
                    secrets=lambda: trusted_files.secrets_environment(env_file, explicit, os.environ))
    daemon.install_signals()
    try:
        code = daemon.run()
        # Exit now: a worker thread stuck in a TCP connect to a dead node must not hold the interpreter's
        # shutdown past systemd's TimeoutStopSec (everything that matters was closed or flushed above).
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    except AlreadyRunning as exc:
        click.echo(f"reconciler run: {exc}", err=True)
        sys.exit(1)
    except OSError as exc:
        click.echo(f"reconciler run: {exc}", err=True)
        sys.exit(1)
