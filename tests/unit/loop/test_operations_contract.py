"""Round 2 of issue 34, item 7: the survivors below the core the step cases cannot reach (a ledger line refused
before any command, a node gone mid-write, a pull's output cut inside a character) and the tracker's contract with
its executor and its threads (reconciler/loop/operations.py). Each expectation comes from the contract the
docstrings state (`write_ledger`: None, else why not; `Layers`: the layers docker printed; `Operations.join`:
False at the deadline), not from the code.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest

from reconciler.core.planning import Plan, Step
from reconciler.edge.execute import Outcome
from reconciler.edge.ssh import Result
from reconciler.edge.ssh.errors import RemoteError
from reconciler.edge.steps.actions import Given, Run
from reconciler.edge.steps.retention import write_ledger
from reconciler.edge.steps.staging import Layers
from reconciler.loop.operations import Operations
from tests.unit.loop.test_operations import Ctx
from tests.unit.recorded import load, observe

W1 = "worker1"


def _given() -> Given:
    return Given(load(), observe(load()), 1)


def _returned(gen: Any, answer: Any = None, throw: BaseException | None = None) -> tuple[list[Any], Any]:
    """Drive a step helper: every action it yields, and the value it returns. `throw` is raised into its first
    command (what the performer does when the node cannot run it); otherwise each command gets `answer`."""
    yielded: list[Any] = []
    try:
        action = next(gen)
        while True:
            yielded.append(action)
            action = gen.throw(throw) if throw is not None else gen.send(answer)
    except StopIteration as stop:
        return yielded, stop.value


# ------------------------------------------------------------------------------------------------ write_ledger

def test_a_ledger_line_that_would_not_parse_back_is_refused_before_any_command_and_says_why() -> None:
    """`ledger.append` checks every value (here a relative weights key): nothing is run, and the reason is the
    check's own words, which `note` reports and `_write` puts in the step's failure."""
    yielded, why = _returned(write_ledger(_given(), W1, ("removed", "weights", "relative/models--a--b", "-")))
    assert yielded == []
    assert why is not None and why.startswith(f"not a ledger line: '{W1}'"), why
    assert "relative/models--a--b" in why


def test_a_node_that_cannot_run_the_ledger_write_is_the_reason_not_a_crash() -> None:
    """The session failing under the write (the node gone) is returned as why the ledger was not written."""
    entry = ("removed", "weights", "/srv/spark-testbed/worker1/old/hub/models--testorg--old-moe", "-")
    yielded, why = _returned(write_ledger(_given(), W1, entry), throw=RemoteError(W1, "connection reset by peer"))
    assert [(a.node, a.argv, a.check) for a in yielded if isinstance(a, Run)] == [(W1, ("sh", "-s"), False)]
    assert why == f"{W1}: connection reset by peer"


def test_a_ledger_write_that_exits_zero_is_written() -> None:
    entry = ("removed", "weights", "/srv/spark-testbed/worker1/old/hub/models--testorg--old-moe", "-")
    _, why = _returned(write_ledger(_given(), W1, entry), answer=Result("", "", 0))
    assert why is None


# ------------------------------------------------------------------------------------------------ Layers

def test_a_pull_chunk_cut_inside_a_character_still_counts_its_layers() -> None:
    """SSH hands output over in chunks of bytes, which may split a UTF-8 character (a registry's message, a
    progress bar): the broken bytes are replaced, never an error that would end the pull's reporting."""
    layers = Layers()
    assert layers.feed(b"abcdef012345: Pulling fs layer\n0123456789ab: Pull complete\n\xe2\x94") is True
    assert layers.feed(b"\x80 \xff\n") is False
    assert (layers.seen, layers.done) == ({"abcdef012345", "0123456789ab"}, {"0123456789ab"})


# ------------------------------------------------------------------------------------------------ Operations

def test_a_batch_is_handed_to_the_executor_as_an_enforce_plan_of_just_its_steps() -> None:
    """The tracker runs admitted steps only: the executor gets them as a plan of their own, enforcing, with no
    drift and no blockers of its own to report."""
    plans: list[Plan] = []
    ended = threading.Event()

    def run(plan: Plan, ctx: Any, on_event: Any, skip: Any, cancel_of: Any) -> Outcome:
        plans.append(plan)
        return Outcome([])

    steps = [Step("link", "h", "down"), Step("image", "h", "copy")]
    ops = Operations(on_end=ended.set, clock=lambda: 1000.0, run=run)
    ops.launch(steps, Ctx(), on_event=lambda name, fields: None)
    assert ended.wait(10) and ops.join(10)
    assert plans == [Plan([], steps, [], "enforce")]


class _Stuck:
    """A batch thread that does not end: what `join` is asked to wait for, and how long it was told to."""

    def __init__(self) -> None:
        self.waits: list[float | None] = []

    def join(self, timeout: float | None = None) -> None:
        self.waits.append(timeout)

    def is_alive(self) -> bool:
        return True


@pytest.mark.parametrize("count", [1, 3])
def test_a_join_at_its_deadline_waits_no_further_for_any_batch(count: int) -> None:
    """`join(0)` (the shutdown's deadline already spent) asks each still-running batch for nothing more than the
    time left, none, and says that one still runs."""
    ops = Operations(on_end=lambda: None)
    stuck = [_Stuck() for _ in range(count)]
    ops._threads = stuck  # type: ignore[assignment]  # the batches in flight, as launch records them
    assert ops.join(0.0) is False
    assert [t.waits for t in stuck] == [[0.0]] * count
