"""A step as data: the exact commands it will run and the facts it re-reads first, one action at a time.

A step is a generator over `Given` (the desired state, the observation its plan was made from, the generation):
it yields an action and is sent the action's result back, and it never touches a node. `perform` is the one
executor that does, through `Session.run` and the probe's fragments. So each step is tested as pyinfra tests an
operation (its `tests/operations/*/*.json`: the facts it sees, the commands it must yield): recorded facts in, the
exact commands and refusals out (tests/unit/step_cases/), with no session, no thread and no clock.

The actions, and what the step is sent back for each:

- `Read(node, fact)`: a probe fragment and its parser (`facts.base.Fact`) -> the parsed fact;
- `Run(node, argv, ...)`: one command through `Session.run` -> its `Result` (a failure with `check` raises
  `RemoteError` into the step, which may catch it);
- `Wait(read_or_run, until, timeout, what)`: the read (or command) again until `until(result)` holds -> that
  result; past its deadline or on a shutdown `StepFailed` is raised into the step;
- `Report(event, fields)`: a progress event (`apply`'s view, /status, the logs) -> None;
- `Parallel(runs)`: commands at once (the weights' streams) -> their results, or the first error once all ended;
- `Start(node, argv, stdin)`: a helper beside the next actions (`Session.companion`) -> its first line;
  `Stop(start, how)`: its end -> its result (a helper not stopped ends with the step).

Deadlines are data too: a `Run`'s or `Wait`'s own timeout is capped by what is left of the step's, which only the
executor knows (`StepContext.remaining`); a `Wait` may keep `reserve` seconds of the step for what follows it.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar, cast

from reconciler.core.observed import Observed
from reconciler.core.ownership import Owner, owner
from reconciler.core.spec import Desired
from reconciler.edge.facts.base import Fact, ProbeError
from reconciler.edge.ssh import Companion, RemoteError, Result, Session

T = TypeVar("T")


class StepFailed(Exception):
    """A step ran and did not reach its goal; the message is what an operator needs to act."""

    transient = False


class StepTimedOut(StepFailed):
    """A wait passed its deadline (the step's own, or the wait's)."""


class StepCancelled(StepFailed):
    """A wait was ended by a cancel (a shutdown, or a new generation that makes the step wrong): never a
    deferral, never the world's answer."""


class StepBlocked(StepFailed):
    """A precondition does not hold (memory short, a foreign container holds the name): nothing was changed."""


class StepDeferred(StepBlocked):
    """A precondition the world is about to meet by itself has not been met yet within the step's wait (GB10
    returns a stopped generation's memory with a lag): nothing was changed, the next reconcile tries again, and it
    is no failure, so it never counts toward backoff and holds."""


@dataclass(frozen=True)
class Given:
    """What a step knows before it reads anything: the file, the observation its plan was made from (whose
    containers and copies are this cluster's is judged from it, as the plan judged it), and the generation."""

    desired: Desired
    observed: Observed
    generation: int = 0

    @property
    def owner(self) -> Owner:
        return owner(self.desired, self.observed)


@dataclass(frozen=True)
class Read:
    """Read one fact on one node with the probe's own fragment and parser."""

    node: str
    fact: Fact[Any]


@dataclass(frozen=True)
class Run:
    """One command on one node, exactly as `Session.run` runs it. `timeout` None: the policy's command timeout.
    `stdin` is compared but never shown (it carries the serving's secrets). `on_output` sees stdout as it arrives
    and may return a progress Report; `long` commands also end on a shutdown (`cancel`) and get `supervised`
    (SIGTERM when the channel closes); `bulk` runs them on the node's second connection (`Session.bulk`)."""

    node: str
    argv: tuple[str, ...]
    sudo: bool = False
    stdin: bytes | None = field(default=None, repr=False)
    timeout: float | None = None
    check: bool = True
    long: bool = False
    bulk: bool = False
    on_output: Callable[[bytes], Report | None] | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class Wait:
    """Repeat a read (or a command) every `interval` s until `until` holds of its result, at most `timeout` s
    (capped by the step's deadline less `reserve`). `what` names the awaited state in the failure."""

    action: Read | Run
    until: Callable[[Any], bool] = field(compare=False, repr=False)
    timeout: float
    what: str
    interval: float = 0.2
    reserve: float = 0.0


@dataclass(frozen=True)
class Report:
    """A progress event, as `StepContext.progress` takes it."""

    event: str
    fields: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Parallel:
    """Commands run at once, each in its own thread (the weights' rsync streams) -> their `Result`s in order. Every
    one runs to its end (a failed stream does not stop the others, which keep their partial data for the resume);
    then the first error, by the order they ended in, is raised into the step. Their `on_output` reports are
    serialised, so a meter shared by the streams needs no lock."""

    runs: tuple[Run, ...]


@dataclass(frozen=True)
class Start:
    """A helper command beside the step's next actions (`Session.companion`: the fabric's rsync daemon, the page-
    cache bound): fed `stdin`, then its stdin stays open as its lifeline -> its first line of stdout (None: it
    ended without one). Bounded on the node at `timeout` (capped by the step's deadline). The action itself is the
    handle a `Stop` names; one the step does not stop is closed when the step ends, however it ends."""

    node: str
    argv: tuple[str, ...]
    stdin: bytes = field(default=b"", repr=False)
    timeout: float | None = None


@dataclass(frozen=True)
class Stop:
    """End a started helper -> its `Result` (exit -1: still running), or None for `close`. `finish`: let it end by
    itself within the command timeout, then close its stdin (`Companion.finish`); `end`: close its stdin at once
    and wait for it (`Companion.end`); `close`: close its channel without waiting, which ends it."""

    helper: Start
    how: Literal["finish", "end", "close"]


Action = Read | Run | Wait | Report | Parallel | Start | Stop
#: A step's body: yields actions, is sent their results, returns nothing (it raises StepFailed when it cannot).
Actions = Generator[Action, Any, None]


def read(node: str, fact: Fact[T]) -> Generator[Action, Any, T]:
    """`value = yield from read(node, fact)`: the typed way to yield a Read."""
    return cast(T, (yield Read(node, fact)))


def run(node: str, *argv: str, sudo: bool = False, stdin: bytes | None = None, timeout: float | None = None,
        check: bool = True) -> Generator[Action, Any, Result]:
    """`result = yield from run(node, "docker", "rm", name)`: the typed way to yield a short Run."""
    return cast(Result, (yield Run(node, tuple(argv), sudo=sudo, stdin=stdin, timeout=timeout, check=check)))


def wait(action: Read | Run, until: Callable[[Any], bool], *, timeout: float, what: str, interval: float = 0.2,
         reserve: float = 0.0) -> Generator[Action, Any, Any]:
    """`seen = yield from wait(Read(node, fact), lambda v: ..., timeout=30, what="...")`."""
    return (yield Wait(action, until, timeout, what, interval, reserve))


# -- the executor ---------------------------------------------------------------------------------------------


def advance(actions: Actions, do: Callable[[Action], Any]) -> None:
    """Run a step to its end: each action done by `do`, its result sent back, a node's error (`RemoteError`) or a
    failed wait or read (`StepFailed`) raised into the step where it yielded. The executor and the test driver
    (tests/unit/step_driver.py) both run steps through this loop, each with its own `do`."""
    result: Any = None
    error: RemoteError | StepFailed | None = None
    while True:
        try:
            action = actions.throw(error) if error is not None else actions.send(result)
        except StopIteration:
            return
        result, error = None, None
        try:
            result = do(action)
        except (RemoteError, StepFailed) as exc:
            error = exc


class Performer:
    """Runs one step's actions on the nodes: the only code that turns an action into I/O. Errors of a node
    (`RemoteError`; a fact that does not parse is the step's `StepFailed`) are raised into the step, which may
    catch them; what it does not catch ends the step as before."""

    def __init__(self, sessions: Callable[[str], Session], command_timeout: float, remaining: Callable[[], float],
                 cancel: threading.Event, progress: Callable[[str, dict[str, Any]], None]):
        self.sessions, self.command_timeout, self.remaining = sessions, command_timeout, remaining
        self.cancel, self.progress = cancel, progress
        self._helpers: dict[Start, tuple[contextlib.ExitStack, Companion]] = {}
        self._reporting = threading.Lock()

    def perform(self, actions: Actions) -> None:
        try:
            advance(actions, self.do)
        finally:  # helpers the step did not stop end with it, the last started first
            while self._helpers:
                self._helpers.popitem()[1][0].close()

    def do(self, action: Action) -> Any:
        if isinstance(action, Report):
            self.progress(action.event, action.fields)
            return None
        if isinstance(action, Read):
            return self._read(action)
        if isinstance(action, Run):
            return self._run(action)
        if isinstance(action, Parallel):
            return self._parallel(action)
        if isinstance(action, Start):
            return self._start(action)
        if isinstance(action, Stop):
            return self._stop(action)
        return self._wait(action)

    def _cap(self, seconds: float | None) -> float:
        """A command's deadline: its own (or the command timeout), never past the step's, never below one."""
        return max(1.0, min(self.command_timeout if seconds is None else seconds, self.remaining()))

    def _read(self, action: Read) -> Any:
        try:
            return action.fact.read(self.sessions(action.node), self._cap(None))
        except ProbeError as exc:
            raise StepFailed(f"{action.node}: {exc}") from None

    def _run(self, action: Run) -> Result:
        session = self.sessions(action.node)
        if action.bulk:
            session = session.bulk()
        on_output = None
        if action.on_output is not None:
            feed = action.on_output

            def on_output(chunk: bytes) -> None:
                with self._reporting:
                    if (report := feed(chunk)) is not None:
                        self.progress(report.event, report.fields)
        return session.run(list(action.argv), timeout=self._cap(action.timeout), sudo=action.sudo,
                           stdin=action.stdin, check=action.check, on_output=on_output,
                           cancel=self.cancel if action.long else None, supervised=action.long)

    def _wait(self, action: Wait) -> Any:
        timeout = max(0.0, min(action.timeout, self.remaining() - action.reserve))
        deadline = time.monotonic() + timeout
        while True:
            value = self.do(action.action)
            if action.until(value):
                return value
            if time.monotonic() >= deadline:
                raise StepTimedOut(f"timed out after {timeout:g}s waiting for {action.what}")
            if self.cancel.wait(action.interval):
                raise StepCancelled(f"cancelled while waiting for {action.what}")

    def _parallel(self, action: Parallel) -> list[Result]:
        results: list[Result | None] = [None] * len(action.runs)
        errors: list[BaseException] = []

        def one(index: int, run: Run) -> None:
            try:
                results[index] = self._run(run)
            except BaseException as exc:  # noqa: BLE001 - raised in the step's thread once all ended
                errors.append(exc)

        threads = [threading.Thread(target=one, args=(i, r), daemon=True) for i, r in enumerate(action.runs)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if errors:
            raise errors[0]
        return cast(list[Result], results)

    def _start(self, action: Start) -> str | None:
        lifetime = self.remaining() if action.timeout is None else min(action.timeout, self.remaining())
        stack = contextlib.ExitStack()
        companion = stack.enter_context(self.sessions(action.node).companion(
            list(action.argv), timeout=max(1.0, lifetime), stdin=action.stdin, open_timeout=self._cap(None)))
        self._helpers[action] = stack, companion
        try:
            return companion.line(self._cap(None))
        except BaseException:
            self._helpers.pop(action)[0].close()
            raise

    def _stop(self, action: Stop) -> Result | None:
        stack, companion = self._helpers.pop(action.helper)
        with stack:
            if action.how == "finish":
                return companion.finish(self._cap(None))
            if action.how == "end":
                return companion.end(self._cap(None))
            return None
