"""The executor's `Parallel`, `Start` and `Stop` (reconciler/edge/steps/actions.py), against stand-in sessions:
every stream runs to its end before the first failure reaches the step (as the weights' `_run_streams` did), the
streams' progress reports never interleave, and a helper the step did not stop ends with the step however it
ends. The real rsync streams and helpers run through the same executor in test_weights_tree.py."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from reconciler.edge.ssh import CommandFailed, Result
from reconciler.edge.steps.actions import Actions, Parallel, Performer, Report, Run, Start, StepFailed, Stop


class Node:
    """Runs nothing: each argv's first word says how it ends; every stream waits at a barrier until all started."""

    def __init__(self, streams: int = 0):
        self.barrier = threading.Barrier(streams) if streams else None
        self.ended: list[str] = []
        self.closed: list[str] = []

    def run(self, argv: list[str], **kw: Any) -> Result:
        if self.barrier is not None:
            self.barrier.wait(timeout=10)  # all at once, or this breaks
        if kw["on_output"] is not None:
            for _ in range(50):
                kw["on_output"](b"x")
        self.ended.append(argv[0])
        if argv[0] == "fail":
            raise CommandFailed("n", argv, 23, "", "boom")
        return Result(argv[0], "", 0)

    @contextlib.contextmanager
    def companion(self, argv: list[str], **kw: Any) -> Iterator[Any]:
        node = self

        class Helper:
            def line(self, timeout: float) -> str:
                return "ready"

            def finish(self, timeout: float) -> Result:
                return Result("", "", 0)

            def end(self, timeout: float) -> Result:
                return Result("", "", 5)

        try:
            yield Helper()
        finally:
            node.closed.append(argv[0])


def _perform(node: Node, actions: Actions, events: list[str] | None = None) -> None:
    Performer(lambda name: node, 60, lambda: 600.0, threading.Event(),  # type: ignore[arg-type, return-value]
              lambda event, fields: (events if events is not None else []).append(event)).perform(actions)


def test_every_stream_ends_before_the_first_failure_reaches_the_step() -> None:
    node = Node(streams=3)
    seen: list[object] = []

    def step() -> Actions:
        try:
            yield Parallel((Run("n", ("ok1",)), Run("n", ("fail",)), Run("n", ("ok2",))))
        except CommandFailed as exc:
            seen.append(sorted(node.ended))
            seen.append(exc.exit_code)

    _perform(node, step())
    assert seen == [["fail", "ok1", "ok2"], 23]


def test_the_streams_results_come_back_in_their_order() -> None:
    node = Node(streams=2)
    got: list[object] = []

    def step() -> Actions:
        got.append([r.stdout for r in (yield Parallel((Run("n", ("a",)), Run("n", ("b",)))))])

    _perform(node, step())
    assert got == [["a", "b"]]


def test_the_streams_reports_are_one_at_a_time() -> None:
    """A meter shared by the streams is fed one chunk at a time (the weights' `StreamMeter` has no lock)."""
    node = Node(streams=4)
    inside = [0]
    most = [0]

    def feed(chunk: bytes) -> Report | None:
        inside[0] += 1
        most[0] = max(most[0], inside[0])
        threading.Event().wait(0.0005)
        inside[0] -= 1
        return Report("tick")

    def step() -> Actions:
        yield Parallel(tuple(Run("n", (f"s{i}",), on_output=feed) for i in range(4)))

    events: list[str] = []
    _perform(node, step(), events)
    assert most == [1] and events == ["tick"] * 200


def test_a_helper_not_stopped_ends_with_the_step_even_when_it_fails() -> None:
    node = Node()

    def step() -> Actions:
        first = yield Start("n", ("bound",))
        assert first == "ready"
        yield Start("n", ("daemon",))
        raise StepFailed("the copy failed")

    with pytest.raises(StepFailed):
        _perform(node, step())
    assert node.closed == ["daemon", "bound"], "the last started first"


def test_a_stopped_helper_gives_its_end() -> None:
    node = Node()
    said: list[object] = []

    def step() -> Actions:
        helper = Start("n", ("bound",))
        yield helper
        said.append((yield Stop(helper, "end")).exit_code)
        said.append(list(node.closed))

    _perform(node, step())
    assert said == [5, ["bound"]] and node.closed == ["bound"]
