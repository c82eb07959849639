"""`reconciler apply`: observe, show the plan, run it, re-observe, repeat until nothing is left (a few passes).

Several passes because the world answers late: a peer's carrier appears only once both link steps ran, and a
level-triggered reconciler simply looks again. Exit 0 only when a fresh observation shows no actionable drift.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import click
from rich.console import Console
from rich.filesize import decimal
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    ProgressColumn,
    Task,
    TaskID,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)
from rich.table import Column
from rich.text import Text

from reconciler.core import planning
from reconciler.core.exits import Exit
from reconciler.core.kinds import START_KINDS
from reconciler.core.observed import Observed, ServeFlags
from reconciler.core.planning import Plan
from reconciler.core.spec import Desired
from reconciler.core.text import printable
from reconciler.edge.execute import Outcome, execute
from reconciler.edge.image_flags import FLAGS_DEADLINE, ask_serve_flags
from reconciler.edge.lease import Holder, LeaseHeld, LeaseUnreachable, held
from reconciler.edge.observe import flags_pending, observe, with_flags
from reconciler.edge.ssh import Sessions
from reconciler.edge.steps import StepContext
from reconciler.loop.operations import FlagsQuery


@dataclass(frozen=True)
class _Report:
    """One thing moving, as the view shows it: bytes of a total (`unit` "bytes"; `estimate`: the total is the
    image's size, which its archive outgrows by a few percent), or a cold start's percent of its current stage's
    line (`unit` "%"; None when that line has no number) with the line as `detail`."""

    key: str
    label: str
    done: int | None
    total: int | None
    unit: str
    stage: str = ""
    detail: str = ""
    finished: bool = False
    estimate: bool = False


def _report(event: str, fields: dict[str, Any]) -> _Report | None:
    """A step's progress event as a report; None for the events the view does not show."""
    family, _, what = event.partition(".")
    node = fields.get("node", "")
    if family in _BYTES and what in ("start", "progress", "done"):
        total = fields.get("bytes_total")
        done = fields.get("bytes_done", total if what == "done" else 0)
        return _Report(f"{family}/{node}", _BYTES[family].format(node=node), done, total, "bytes",
                       finished=what == "done", estimate=family == "image")
    if family == "serving" and what in ("stage", "progress", "done"):
        return _Report(f"start/{node}", f"cold start on {node}", fields.get("percent"), 100, "%",
                       stage=fields.get("stage") or "", detail=fields.get("line") or "", finished=what == "done")
    return None


_BYTES = {"weights": "weights -> {node}", "download": "download on {node}", "image": "image -> {node}"}


class _Amount(ProgressColumn):
    """Bytes, speed and time left for a copy; the stage and vLLM's own line for a cold start."""

    def __init__(self) -> None:
        super().__init__(table_column=Column(no_wrap=True, overflow="ellipsis", ratio=1))  # the width left over
        self.size, self.speed, self.left = DownloadColumn(), TransferSpeedColumn(), TimeRemainingColumn()

    def render(self, task: Task) -> Text:
        if task.fields.get("unit") == "%":
            return Text(printable(f"{task.fields['stage']}  {task.fields['detail']}"), no_wrap=True,
                        overflow="ellipsis")
        return Text.assemble(self.size.render(task), " ", self.speed.render(task), " ", self.left.render(task))


class _ProgressView:
    """What moves while `apply` runs: each copy (weights, download, image: bytes of their total, rate, time left)
    and the cold start (vLLM's stage, its percent and its last meaningful line). In a terminal, a rich bar each;
    otherwise (CI, a pipe, a journal) a plain line when one appears, changes stage or ends, and every `EVERY`
    seconds in between, as Terraform's "Still creating..." does."""

    EVERY = 10.0

    def __init__(self, console: Console, clock: Callable[[], float] = time.monotonic):
        self.console, self.clock = console, clock
        self.bars: Progress | None = None
        self.tasks: dict[str, TaskID] = {}
        self.said: dict[str, tuple[float, str]] = {}  # key -> (when, stage) of the last plain line
        self.first: dict[str, tuple[float, int]] = {}  # key -> (when, bytes) of the first report: the rate's start
        self.lock = threading.Lock()

    def __call__(self, event: str, fields: dict[str, Any]) -> None:
        report = _report(event, fields)
        if report is None:
            return
        with self.lock:
            if self.console.is_terminal:
                self._bar(report)
            else:
                self._line(report)

    def _bar(self, r: _Report) -> None:
        if self.bars is None:
            self.bars = Progress(TextColumn("{task.description}", markup=False), BarColumn(bar_width=24), _Amount(),
                                 console=self.console, expand=True)
            self.bars.start()
        done = r.total if r.finished and r.total else r.done
        total = r.total if done is not None else None  # no number: a pulsing bar
        if r.key not in self.tasks:  # the fields first: the bar may be drawn before the update
            self.tasks[r.key] = self.bars.add_task(r.label, total=total, unit=r.unit, stage=r.stage, detail=r.detail)
        self.bars.update(self.tasks[r.key], completed=done or 0, total=total, unit=r.unit, stage=r.stage,
                         detail=r.detail)

    def _line(self, r: _Report) -> None:
        now = self.clock()
        if r.unit == "bytes" and r.done is not None:
            self.first.setdefault(r.key, (now, r.done))
        when, stage = self.said.get(r.key, (None, None))
        said = (when is None or stage != r.stage or now - when >= self.EVERY
                or r.finished and r.unit == "bytes")  # a cold start that already said "serving" ends unsaid
        if not said:
            return
        self.said[r.key] = (now, r.stage)
        click.echo(printable(f"  {r.label}: {self._words(r, now)}"))

    def _words(self, r: _Report, now: float) -> str:
        if r.unit == "%":
            percent = f" {r.done}%" if r.done is not None else ""
            return f"{r.stage}{percent}" + (f" ({r.detail})" if r.detail else "")
        done = r.done or 0
        of = f" of {'~' if r.estimate else ''}{decimal(r.total)} ({min(100, 100 * done // r.total)}%)" \
            if r.total else ""
        words = decimal(done) + of
        since, at_first = self.first.get(r.key, (now, done))
        if now > since and done > at_first:
            words += f" at {decimal(round((done - at_first) / (now - since)))}/s"
        return words + (", done" if r.finished else "")

    def stop(self) -> None:
        if self.bars is not None:
            self.bars.stop()


def apply_once(desired: Desired, *, show: Callable[[Plan], str], yes: bool, dry_run: bool, max_passes: int = 3,
               generation: int = 1, holder: Holder | None = None) -> int:
    """`show`: the plan as the operator reads it (reconciler/cli/plan_text.py; given, as the loop imports no CLI).
    `holder`: who takes the cluster's lease for the run (not for a dry run, which changes nothing). Returns the
    exit code (reconciler.core.exits): 0 converged, 1 not, 2 changes pending (dry run), 4 held, 5 unreachable."""
    sessions = Sessions(desired)
    try:
        with contextlib.ExitStack() as stack:
            if not dry_run and holder is not None:
                try:
                    stack.enter_context(held(desired, sessions, holder))
                except LeaseUnreachable as exc:
                    click.echo(printable(f"Nothing changed: {exc}."), err=True)
                    return Exit.UNREACHABLE
                except LeaseHeld as exc:
                    click.echo(printable(f"Nothing changed: {exc} (reconciler status; stop the daemon or wait)."),
                               err=True)
                    return Exit.HELD
            return _apply(desired, sessions, show=show, yes=yes, dry_run=dry_run, max_passes=max_passes,
                          generation=generation)
    finally:
        sessions.close()


def _apply(desired: Desired, sessions: Sessions, *, show: Callable[[Plan], str], yes: bool, dry_run: bool,
           max_passes: int, generation: int) -> int:
    console = Console(stderr=False)
    view = _ProgressView(console)
    image = _ImageQuestion(desired, sessions)
    try:
        observed = image.attach(_probe(desired, sessions))
        current = planning.plan(desired, observed)
        if flags_pending(observed) and (dry_run or not yes or not current.steps):
            observed = image.answered(observed)  # what is shown or confirmed is the whole plan, the start judged
            current = planning.plan(desired, observed)
        click.echo(show(current), nl=False)
        if dry_run or not current.steps:
            return _outcome(observed, current, dry_run)
        if not yes and not click.confirm("Apply these steps?", default=False):
            click.echo("Nothing changed.")
            return Exit.ERROR
        passes = max_passes + flags_pending(observed)  # a pass that only waited for the image's answer is free
        outcome = Outcome()
        for _ in range(passes):
            ctx = StepContext(desired=desired, sessions=sessions, observed=observed, generation=generation,
                              progress=view)
            outcome = execute(current, ctx, on_event=lambda e, f: _echo(e, f))
            observed = image.answered(image.attach(_probe(desired, sessions)))
            current = planning.plan(desired, observed)
            if not outcome.ok or not current.steps:
                break
            click.echo("\nThe cluster moved on; planning again:\n" + show(current), nl=False)
        view.stop()
        failed = _failed_start(outcome)
        if current.changes:
            click.echo("\nNot converged:\n" + show(current), nl=False)
        elif failed is not None:  # what a start checked (serving.verify's answer) no observation shows again
            click.echo(f"\nNot converged: {failed}")
            return Exit.UNREACHABLE if observed.partial else Exit.ERROR
        else:
            click.echo("\nConverged: a fresh observation shows no drift.")
        return _outcome(observed, current, dry_run=False)
    finally:
        view.stop()


def _failed_start(outcome: Outcome) -> str | None:
    """The last pass's failed start, in one line, or None. A fresh observation may show a cluster as declared right
    after its start failed a check the probe does not repeat (`serving.verify`: the answer to the fixed prompt),
    so a failed start is never called converged."""
    failed = next((r for r in outcome.results if r.result == "failed" and r.step.kind in START_KINDS), None)
    if failed is None:
        return None
    return printable(f"{failed.step.id} failed: {(failed.message or '').splitlines()[0] if failed.message else ''}")


def _probe(desired: Desired, sessions: Sessions) -> Observed:
    observed, _ = observe(desired, sessions, timeout=desired.policy.timeouts.command, ask_flags=False)
    return observed


class _ImageQuestion:
    """The serving image's answer to `apply` (its `vllm serve --help=all` and Ray), asked as the daemon asks,
    beside the work (`FlagsQuery`), but only where a plan would start serving. With `--yes` and other steps to
    run (the seed's image and weights copies, the link), those run while the image is asked, which imports torch
    (~26 s on the testbed), instead of after it; the start, held while the answer is pending, comes in the next
    pass (bench/downtime.py, the seed row). A plan shown for confirmation, or a dry run's, waits for the answer:
    what a person confirms includes the start, judged."""

    def __init__(self, desired: Desired, sessions: Sessions):
        self._about: dict[str, Desired] = {}  # image id -> the deployment whose image it is
        self._answer = threading.Event()
        self._query = FlagsQuery(lambda holder, image_id: ask_serve_flags(self._about[image_id], sessions, holder,
                                                                          image_id),
                                 on_answer=self._answer.set)
        self.desired = desired

    def _flags_of(self, view: Desired, wanted: tuple[str, str]) -> ServeFlags | None:
        self._about[wanted[1]] = view
        return self._query.get(wanted)

    def attach(self, observed: Observed) -> Observed:
        """`observed` with the answer at hand (pending while asked) where a plan of it would start serving."""
        return with_flags(self.desired, observed, self._flags_of)

    def answered(self, observed: Observed) -> Observed:
        """`observed` once no answer it holds is pending (each question ends by its own deadline)."""
        deadline = time.monotonic() + FLAGS_DEADLINE + 30
        while flags_pending(observed) and time.monotonic() < deadline:
            self._answer.wait(max(0.0, deadline - time.monotonic()))
            self._answer.clear()
            observed = self.attach(observed)
        return observed


def _outcome(observed: Observed, current: Plan, dry_run: bool) -> Exit:
    """A node unreachable first (the plan could not be whole), then: a dry run's changes are pending (2, as
    `plan`), a real run's are not converged (1)."""
    if observed.partial:
        return Exit.UNREACHABLE
    if not current.changes:
        return Exit.OK
    return Exit.CHANGES if dry_run else Exit.ERROR


def _echo(event: str, fields: dict[str, Any]) -> None:
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
