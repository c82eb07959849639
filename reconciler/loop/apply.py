"""`reconciler apply`: observe, show the plan, run it, re-observe, repeat until nothing is left (a few passes).

Several passes because the world answers late: a peer's carrier appears only once both link steps ran, and a
level-triggered reconciler simply looks again. Exit 0 only when a fresh observation shows no actionable drift.
"""

from __future__ import annotations

import contextlib
import sys
import threading

import click
from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TaskID,
    TimeRemainingColumn,
    TransferSpeedColumn,
)

from reconciler.core import planning
from reconciler.core.render import plan_text
from reconciler.core.spec import Desired
from reconciler.core.text import printable
from reconciler.edge.execute import execute
from reconciler.edge.lease import Holder, LeaseHeld, held
from reconciler.edge.observe import observe
from reconciler.edge.ssh import Sessions
from reconciler.edge.steps import StepContext


class _ProgressView:
    """A progress bar per weight sync and download in a terminal; silent otherwise (the JSON log has the numbers).
    Both report `bytes_done` of `bytes_total` (the download's total is the Hub's size of the revision)."""

    LABEL = {"weights": "weights -> {node}", "download": "download on {node}"}

    def __init__(self, console: Console):
        self.console = console
        self.bars: Progress | None = None
        self.tasks: dict[str, TaskID] = {}
        self.lock = threading.Lock()

    def __call__(self, event: str, fields: dict) -> None:
        kind, _, what = event.partition(".")
        if not self.console.is_terminal or kind not in self.LABEL:
            return
        with self.lock:
            if self.bars is None:
                self.bars = Progress("[progress.description]{task.description}", BarColumn(), DownloadColumn(),
                                     TransferSpeedColumn(), TimeRemainingColumn(), console=self.console)
                self.bars.start()
            key = f"{kind}/{fields['node']}"
            if key not in self.tasks:
                self.tasks[key] = self.bars.add_task(self.LABEL[kind].format(node=fields["node"]),
                                                     total=fields.get("bytes_total") or 1)
            done = fields.get("bytes_done", fields.get("bytes_total") if what == "done" else 0)
            self.bars.update(self.tasks[key], completed=done)

    def stop(self) -> None:
        if self.bars is not None:
            self.bars.stop()


EXIT_HELD = 4  # another actor holds the cluster's lease (reconciler.edge.lease)


def apply_once(desired: Desired, *, yes: bool, dry_run: bool, max_passes: int = 3, generation: int = 1,
               holder: Holder | None = None) -> int:
    """`holder`: who takes the cluster's lease for the run (not for a dry run, which changes nothing)."""
    sessions = Sessions(desired)
    try:
        with contextlib.ExitStack() as stack:
            if not dry_run and holder is not None:
                try:
                    stack.enter_context(held(desired, sessions, holder))
                except LeaseHeld as exc:
                    click.echo(printable(f"Nothing changed: {exc} (reconciler status; stop the daemon or wait)."),
                               err=True)
                    return EXIT_HELD
            return _apply(desired, sessions, yes=yes, dry_run=dry_run, max_passes=max_passes, generation=generation)
    finally:
        sessions.close()


def _apply(desired: Desired, sessions: Sessions, *, yes: bool, dry_run: bool, max_passes: int,
           generation: int) -> int:
    console = Console(stderr=False)
    view = _ProgressView(console)
    try:
        observed, _ = observe(desired, sessions, timeout=desired.policy.timeouts.command)
        current = planning.plan(desired, observed)
        click.echo(plan_text(current), nl=False)
        if not current.steps:
            return 1 if current.changes else 0
        if dry_run:
            return 1
        if not yes and not click.confirm("Apply these steps?", default=False):
            click.echo("Nothing changed.")
            return 1
        for _ in range(max_passes):
            ctx = StepContext(desired=desired, sessions=sessions, observed=observed, generation=generation,
                              progress=view)
            outcome = execute(current, ctx, on_event=lambda e, f: _echo(e, f))
            observed, _ = observe(desired, sessions, timeout=desired.policy.timeouts.command)
            current = planning.plan(desired, observed)
            if not outcome.ok or not current.steps:
                break
            click.echo("\nThe cluster moved on; planning again:\n" + plan_text(current), nl=False)
        view.stop()
        if current.changes:
            click.echo("\nNot converged:\n" + plan_text(current), nl=False)
            return 1
        click.echo("\nConverged: a fresh observation shows no drift.")
        return 0
    finally:
        view.stop()


def _echo(event: str, fields: dict) -> None:
    """A step's start and end, one line each; printable: step ids name containers and a step's message quotes
    what the node answered (reconciler/core/text.py)."""
    if event == "step.start":
        click.echo(printable(f"  ... {fields['step'].id}"))
    elif event == "step.end":
        r = fields["result"]
        mark = {"success": "ok", "skipped": "skipped"}.get(r.result, r.result.upper())
        click.echo(printable(f"  {mark:>7} {r.step.id} ({r.seconds:.1f}s){': ' + r.message if r.message else ''}"),
                   err=r.result not in ("success",))
        sys.stdout.flush()
