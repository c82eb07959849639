"""What the daemon process runs, named in one list (controller-runtime's runnable groups, kopf's reactor tasks).

Each `Runnable` is a name, a start and a stop. The daemon adds every one of them to its `Runnables`, starts them
in the order it added them and stops them in the reverse order: the pieces started last (the loop's helpers, the
listener) end first, the ones everything rests on (the sessions, the lease) last. So `daemon.runnables.names()`
says what the process runs, and the shutdown reaches into nobody's internals: it stops the list.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass


def _no_start() -> None:
    return None


def _no_stop(_seconds: float, _ended: bool) -> bool:
    return True


@dataclass(frozen=True)
class Runnable:
    """One thing the process runs: `start` once, `stop` at the shutdown, told the seconds left of its deadline and
    whether everything stopped before it really ended (the lease is given back only then); it returns whether what
    it stopped ended (operations cancelled but still running say False). A thread that ends with the daemon's stop
    event needs no stop."""

    name: str
    start: Callable[[], None] = _no_start
    stop: Callable[[float, bool], bool] = _no_stop


class Runnables:
    """The named list: `add` in start order, `start` all in that order, `stop` all in the reverse one."""

    def __init__(self) -> None:
        self._all: list[Runnable] = []
        self._started: list[Runnable] = []

    def add(self, runnable: Runnable) -> Runnable:
        if runnable.name in self.names():
            raise ValueError(f"{runnable.name} is in the list already")
        self._all.append(runnable)
        return runnable

    def names(self) -> list[str]:
        return [r.name for r in self._all]

    def start(self) -> None:
        for runnable in self._all:
            if runnable not in self._started:
                runnable.start()
                self._started.append(runnable)

    def stop(self, deadline: float, clock: Callable[[], float] = time.monotonic) -> bool:
        """Stop what was started, last started first, within `deadline` seconds in all; True when everything ended.
        Each stop learns whether all the ones before it ended (`ended`)."""
        end, ended = clock() + deadline, True
        while self._started:
            runnable = self._started.pop()
            ended = runnable.stop(max(0.0, end - clock()), ended) and ended
        return ended
