"""`status`: the running daemon's /status, proven (reconciler/edge/status_client.py) and drawn at the terminal's
width, once or under --watch (status_screen.py, status_view.py: imported when the command runs, so no other
command loads rich or urllib)."""

from __future__ import annotations

import sys
from pathlib import Path

import click


@click.command()
@click.option("--url", default="http://127.0.0.1:9464", show_default=True, envvar="RECONCILER_URL",
              help="The daemon's listener (policy.listen).")
@click.option("--json", "as_json", is_flag=True,
              help="The raw /status document (with --watch: one document per line, each time it is asked).")
@click.option("--state-dir", type=click.Path(file_okay=False, path_type=Path), default="/var/lib/spark-reconciler",
              show_default=True, help="The daemon's state directory: its status key proves who answered.")
@click.option("--wide", is_flag=True,
              help="Every condition, each message whole under its row (like kubectl describe).")
@click.option("--watch", "-w", is_flag=True,
              help="Ask again every --interval and redraw in place until Ctrl-C (like kubectl get -w).")
@click.option("--interval", type=click.FloatRange(min=0.5), default=2.0, show_default=True,
              help="Seconds between two answers under --watch.")
def status(url: str, as_json: bool, state_dir: Path, wide: bool, watch: bool, interval: float) -> None:
    """The running daemon's phase, nodes, conditions, operations in flight and blockers, at the terminal's width.
    Exit 0 converged, 2 not converged, 1 an answer not provably from the daemon that keeps --state-dir (or not a
    status document), 5 no daemon answering; under --watch, the last frame's."""
    from reconciler.cli.status_screen import show

    sys.exit(show(url, state_dir, as_json=as_json, wide=wide, watch=watch, interval=interval))
