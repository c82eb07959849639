"""What the step cases and tests/unit/steps/test_performer.py leave open about the executor's edges: the step's
remaining time (`StepContext.remaining`), the report a ledger line that could not be written gives (`note`), the
threads the weights' streams run in, a helper's lifetime when the step has under two seconds left, and the fields
and messages of the page-cache bound (`drop_behind`) and the one-time rsync daemon (`rsyncd`): what the operator
reads when a helper fails, which addresses count as strangers, how long the daemon's secret is.

Issue 34, item 7 (second round): each test kills mutants that survived `make mutation`, by asserting the exact value
an operator or a node sees, from an expectation written independently of the code.
"""

from __future__ import annotations

import base64
import threading
from types import SimpleNamespace
from typing import Any

import pytest

from reconciler.edge import steps
from reconciler.edge.ssh import Result
from reconciler.edge.steps import StepContext, drop_behind, rsyncd
from reconciler.edge.steps.actions import Given, Parallel, Report, Run, Start, StepFailed, Stop
from tests.unit.step_cases import reachable, sample
from tests.unit.step_cases import weights as wcases
from tests.unit.steps.test_performer import Node, _do, _performer


def drive(actions: Any, *answers: Any) -> tuple[list[Any], Any]:
    """Run a step's generator to its end, sending `answers` in order: the actions it yielded, and what it returned
    (or the StepFailed it raised)."""
    seen: list[Any] = []
    pending = list(answers)
    result: Any = None
    while True:
        try:
            action = actions.send(result)
        except StopIteration as stop:
            return seen, stop.value
        except StepFailed as exc:
            return seen, exc
        seen.append(action)
        result = pending.pop(0) if pending else None


def _given() -> Given:
    return Given(sample(), reachable(), 1)


# -- StepContext.remaining -----------------------------------------------------------------------------------------

def _context(monkeypatch: pytest.MonkeyPatch, left: float) -> StepContext:
    monkeypatch.setattr(steps, "time", SimpleNamespace(monotonic=lambda: 1000.0))
    return StepContext(desired=sample(), sessions={}, observed=reachable(), deadline=1000.0 + left)  # type: ignore[arg-type]


@pytest.mark.parametrize("left,cap,expected", [
    (1.5, None, 1.5),  # what is left, even under two seconds
    (0.25, None, 1.0),  # never below one second
    (-30.0, None, 1.0),  # past the deadline: still one second for the command that says so
    (500.0, 20.0, 20.0),  # a command's own timeout caps it
    (15.0, 20.0, 15.0),  # the step's own end caps the command's timeout
    (500.0, None, 500.0),
])
def test_a_step_s_remaining_time_is_what_is_left_of_its_deadline_capped_by_a_command_s_own(
        monkeypatch: pytest.MonkeyPatch, left: float, cap: float | None, expected: float) -> None:
    """A command is given what is left of its step (never below one second) or its own timeout, the smaller."""
    context = _context(monkeypatch, left)
    assert context.remaining(cap) == expected
    assert context.remaining() == max(1.0, left)


# -- note: a ledger line that could not be written -------------------------------------------------------------------

def test_a_ledger_line_that_could_not_be_written_is_reported_with_the_node_the_entries_and_why() -> None:
    """The copy stands; the operator reads which lines (action, kind, key: the detail is the copy's own) on which
    node, and the node's own words for why."""
    entries = [("copied", "weights", "/srv/models/hub/models--testorg--tiny-moe", "0123456789abcdef" * 4),
               ("served", "image", "sha256:" + "a" * 64, "-")]
    seen, done = drive(steps.note(_given(), "head", *entries), Result("", "sh: disk full\n", 1), None)
    assert done is None
    assert isinstance(seen[0], Run) and seen[0].argv == ("sh", "-s")
    assert seen[1:] == [Report("ledger.unwritten", {
        "node": "head",
        "entries": [("copied", "weights", "/srv/models/hub/models--testorg--tiny-moe"),
                    ("served", "image", "sha256:" + "a" * 64)],
        "error": "exit 1: sh: disk full"})]


def test_a_ledger_line_written_reports_nothing() -> None:
    seen, _ = drive(steps.note(_given(), "head", ("served", "image", "sha256:" + "b" * 64, "-")), Result("", "", 0))
    assert [type(a) for a in seen] == [Run]


# -- the executor: the streams' threads, a helper's lifetime near the step's end --------------------------------------

def test_the_streams_run_in_daemon_threads_so_a_hung_one_never_holds_the_process_s_exit() -> None:
    """A stream stuck in a node's read must not keep the reconciler alive past a shutdown (systemd's stop)."""
    daemonic: list[bool] = []

    class Streams(Node):
        def run(self, argv: list[str], **kw: Any) -> Result:
            daemonic.append(threading.current_thread().daemon)
            return Result(argv[0], "", 0)

    said = _do(_performer(Streams()), Parallel((Run("n", ("a",)), Run("n", ("b",)))))
    assert [r.stdout for r in said[0]] == ["a", "b"]
    assert daemonic == [True, True]


def test_a_helper_started_with_under_two_seconds_left_lives_exactly_that_long() -> None:
    """Its bound on the node is what is left of the step (never below one second), not a rounded-up two."""
    node = Node()
    _do(_performer(node, remaining=1.5), Start("n", ("bound",)), Start("n", ("daemon",), timeout=1.25),
        Start("n", ("last",), timeout=0.5))
    assert [kw["timeout"] for what, _, kw in node.calls if what == "companion"] == [1.5, 1.25, 1.0]
    assert [kw["timeout"] for what, _, kw in node.calls if what == "line"] == [1.5, 1.5, 1.5]


def test_a_command_and_a_read_near_the_step_s_end_get_what_is_left_not_two_seconds() -> None:
    node = Node()
    _do(_performer(node, remaining=1.5), Run("n", ("x",)), Run("n", ("y",), timeout=1.2))
    assert [kw["timeout"] for _, _, kw in node.calls] == [1.5, 1.2]


# -- drop_behind: the page-cache bound --------------------------------------------------------------------------------

BOUND = Start("worker1", ("python3", "-c", "<helper>", "/srv/models/x", "43200"))


def test_a_bound_that_ended_badly_reports_its_node_exit_and_the_last_300_characters_of_its_stderr() -> None:
    stderr = "  " + "".join(f"{i:03d}," for i in range(100)) + "\n"  # 400 characters, each position different
    seen, _ = drive(drop_behind.end_bound(BOUND), Result("", stderr, 3))
    assert seen == [Stop(BOUND, "end"), Report("weights.drop-behind-ended", {
        "node": "worker1", "exit": 3, "stderr": stderr.strip()[100:]})]
    assert len(seen[1].fields["stderr"]) == 300 and seen[1].fields["stderr"].startswith("025,")


def test_a_bound_that_ended_well_says_nothing() -> None:
    seen, _ = drive(drop_behind.end_bound(BOUND), Result("", "warning\n", 0))
    assert seen == [Stop(BOUND, "end")]


def test_a_bound_that_printed_nothing_says_so_and_how_to_do_without_it() -> None:
    given = Given(wcases.recorded(), reachable(), 1)
    seen, failed = drive(drop_behind.start_bound(given, "worker1", "/srv/x"), None, Result("", "", 127))
    assert [type(a) for a in seen] == [Start, Stop] and seen[1] == Stop(seen[0], "finish")
    assert str(failed) == ("the page-cache bound for the copy could not start on worker1 (exit 127): no output; it "
                           "needs python3 there (or set policy.weights.drop_behind: false)")


def test_a_bound_that_could_not_start_says_the_last_400_characters_of_why() -> None:
    given = Given(wcases.recorded(), reachable(), 1)
    why = "".join(f"{i:04d};" for i in range(100))  # 500 characters
    _, failed = drive(drop_behind.start_bound(given, "worker1", "/srv/x"), "oops", Result("", why + "\n", 1))
    assert str(failed) == (f"the page-cache bound for the copy could not start on worker1 (exit 1): {why[100:]}; "
                           "it needs python3 there (or set policy.weights.drop_behind: false)")
    assert why[100:].startswith("0020;")


# -- rsyncd: the one-time daemon --------------------------------------------------------------------------------------

def test_port_one_is_a_port() -> None:
    """Every port from 1 to 65535 is one the kernel may give; 0 is none."""
    assert (rsyncd._port("port 1"), rsyncd._port("port 65535"), rsyncd._port("port 0")) == (1, 65535, None)


def _daemon(first: str | None, said: Result | None = None) -> tuple[list[Any], Any]:
    given = Given(wcases.recorded(), reachable(), 1)
    return drive(rsyncd.start_daemon(given, wcases.HEAD, wcases.WORKER, wcases.DST, 2), first, said)


def test_the_daemon_s_secret_is_256_random_bits_made_for_this_step_alone() -> None:
    seen, (helper, door) = _daemon("port 40000")
    assert seen == [helper] and helper.stdin == f"{door.secret}\n".encode()
    assert len(door.secret) == 43 and len(base64.urlsafe_b64decode(door.secret + "=")) == 32
    assert door.secret != _daemon("port 40000")[1][1].secret


def test_a_daemon_that_printed_nothing_says_so() -> None:
    seen, failed = _daemon(None, Result("", "", 2))
    assert seen[1] == Stop(seen[0], "finish")
    assert str(failed) == f"the rsync daemon on {wcases.WORKER} did not start (exit 2): no output"


def test_a_daemon_that_could_not_start_says_the_last_600_characters_of_why() -> None:
    why = "".join(f"{i:05d}|" for i in range(120))  # 720 characters
    _, failed = _daemon("Traceback", Result("", why, 1))
    assert str(failed) == f"the rsync daemon on {wcases.WORKER} did not start (exit 1): {why[120:]}"
    assert why[120:].startswith("00020|")


DAEMON = Start("worker1", ("python3", "-c", "<helper>"))


def test_a_daemon_that_ended_badly_fails_the_copy_with_the_last_800_characters_of_why() -> None:
    why = "".join(f"{i:07d}|" for i in range(110))  # 880 characters
    seen, failed = drive(rsyncd.confirm(DAEMON), Result("", why, 4))
    assert seen == [Stop(DAEMON, "finish")]
    assert str(failed) == f"the rsync daemon on worker1 ended with exit 4: {why[80:]}"
    assert why[80:].startswith("0000010|")


def test_strangers_who_knocked_are_reported_by_count_and_the_first_ten_addresses() -> None:
    """Every refused connection counts; the addresses are said once each, sorted, at most ten (one log line)."""
    knocks = [f"10.232.0.{n}" for n in (31, 30, 39, 38, 37, 36, 35, 34, 33, 32, 40, 41, 30)]
    stderr = "".join(f"refused a connection from {a} ({i + 1} refused)\n" for i, a in enumerate(knocks))
    seen, failed = drive(rsyncd.confirm(DAEMON), Result("", stderr, 0))
    assert failed is None
    assert seen == [Stop(DAEMON, "finish"), Report("weights.refused", {
        "node": "worker1", "connections": 13, "from": [f"10.232.0.{n}" for n in range(30, 40)]})]


def test_a_daemon_that_refused_no_one_says_nothing_more() -> None:
    seen, _ = drive(rsyncd.confirm(DAEMON), Result("", "2026/12/06 [81] connect from 10.232.0.10\n", 0))
    assert seen == [Stop(DAEMON, "finish")]


def test_only_the_helper_s_own_refusal_lines_with_a_dotted_ipv4_address_count() -> None:
    said = "\n".join([
        "refused a connection from 10.0.0.9",  # five words: the count is optional
        "refused a connection from ",  # no address at all
        "accepted a connection from 10.0.0.7 (1 accepted)",  # not a refusal
        "refused a connection from 1234 (2 refused)",  # digits, not a dotted address
        "refused a connection from 100.100.100.100 (3 refused)",  # the longest dotted address: 15 characters
        "refused a connection from 1000.100.100.100 (4 refused)",  # 16 characters: no IPv4 address
        "refused a connection from 10.0.0.x (5 refused)",
    ])
    assert rsyncd.refused_from(said) == ["10.0.0.9", "100.100.100.100"]
