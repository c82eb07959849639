"""`verify`: the full weight verification, asked of the running daemon (reconciler/edge/daemon_client.py), else run
here over this command's own SSH sessions (reconciler/edge/verify.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import click

from reconciler.cli.common import env_file_option, load_or_exit
from reconciler.core.exits import Exit
from reconciler.core.text import printable


@click.command()
@click.argument("file", type=click.Path(dir_okay=True, path_type=str))
@click.option("--node", "only", default=None,
              help="Verify this node only (default: every serving node but the source).")
@click.option("--repair", is_flag=True, help="Remove differing files so the next reconcile re-syncs exactly them.")
@click.option("--json", "as_json", is_flag=True, help="The per-node results (docs/cli.md).")
@click.option("--url", default=None, envvar="RECONCILER_URL",
              help="The running daemon's listener.  [default: http://POLICY.LISTEN of FILE]")
@click.option("--state-dir", type=click.Path(file_okay=False, path_type=Path), default="/var/lib/spark-reconciler",
              show_default=True, envvar="RECONCILER_STATE_DIR",
              help="The daemon's state directory: its status key authenticates the request.")
@click.option("--wait", type=click.FloatRange(min=0), default=6 * 3600, show_default=True,
              help="Seconds to wait for the daemon's result.")
@env_file_option
def verify(file: str, only: str | None, repair: bool, as_json: bool, url: str | None, state_dir: Path, wait: float,
           env_file: Path) -> None:
    """Full weight verification: sha256 of every file on the targets against the source (cached by size and
    mtime on the source). Catches what size checks cannot, such as flipped bytes. With the daemon running, the
    daemon runs it beside its loop, under its lease (only its user and root may ask: its status key); else it runs
    here. Exit 0 all match, 1 an error, 2 files differ (removed with --repair: the daemon copies them again), 3
    invalid, 4 held by another actor, 5 a node or the daemon unreachable."""
    from reconciler.edge import daemon_client as client
    from reconciler.edge.verify import targets

    desired = load_or_exit(file)  # the daemon has the secrets: here only policy.listen is read
    if len(desired.deployments) > 1:
        click.echo("verify: a verify compares one model's copies with its source: a file of several deployments "
                   "is not verified yet", err=True)
        sys.exit(Exit.ERROR)
    if only is not None and only not in targets(desired):
        click.echo(printable(f"verify: --node {only} is not a node to verify: the serving nodes but the source "
                             f"({desired.source_node}) are: {', '.join(targets(desired)) or 'none'}"), err=True)
        sys.exit(Exit.ERROR)

    def say(line: str) -> None:
        click.echo(printable(line), err=True)

    try:
        results = client.verify_by_daemon(url or f"http://{desired.policy.listen}", state_dir, file, repair=repair,
                                          only=only, wait=wait, say=say)
    except (client.NoDaemon, client.Declined) as exc:
        say(f"verifying here: {exc}")
        results = _verify_here(file, only, repair, env_file)
    except client.Failed as exc:
        say(exc.message)
        sys.exit(exc.code)
    if as_json:
        click.echo(json.dumps(results, indent=2))
    else:
        for r in results:
            click.echo(printable(str(r.get("message"))))
    sys.exit(client.exit_code(results))


def _verify_here(file: str, only: str | None, repair: bool, env_file: Path) -> list[dict[str, Any]]:
    """`verify` without a daemon: this command's own SSH sessions, the cluster's lease to repair (exit 4 when
    another actor holds it), the secrets from --env-file."""
    from reconciler.edge.lease import Holder, LeaseHeld, LeaseUnreachable
    from reconciler.edge.verify import verify_here

    desired = load_or_exit(file, env_file)
    try:
        return verify_here(desired, Holder.of("verify-repair", file), only, repair)
    except LeaseUnreachable as exc:
        click.echo(printable(f"Nothing repaired: {exc}."), err=True)
        sys.exit(Exit.UNREACHABLE)
    except LeaseHeld as exc:
        click.echo(printable(f"Nothing repaired: {exc}."), err=True)
        sys.exit(Exit.HELD)
