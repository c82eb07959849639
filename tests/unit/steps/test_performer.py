"""What the step cases (tests/unit/step_cases/) cannot pin: the fields of the actions themselves (a report's fields,
a wait's interval, what a command is fed), the executor that turns actions into I/O (`Performer`), and the
imperative full verification of the weights (`verify_weights`, `source_hashes`, `remove_files`) against stand-in
nodes that answer with the probe's own output format and record every command with its deadline and cancel.

Issue 34, item 7: each test here kills mutants that survived `make mutation` (docs/mutation-survivors-edge.md),
by asserting the exact value an operator or a node sees, from an expectation written independently of the code.
"""

from __future__ import annotations

import hashlib
import threading
from types import SimpleNamespace
from typing import Any

import pytest

from reconciler.core.observed import Image, Link, NodeObservation, Observed, WeightFile, Weights
from reconciler.edge.facts.base import Fact, ProbeError, Section
from reconciler.edge.manifest import Listing, read_listing
from reconciler.edge.ssh import CommandFailed, Result
from reconciler.edge.steps import actions, serving
from reconciler.edge.steps import weights as step
from reconciler.edge.steps.actions import (
    Actions,
    Given,
    Performer,
    Read,
    Report,
    Run,
    Start,
    StepCancelled,
    StepFailed,
    StepTimedOut,
    Stop,
    Wait,
    run,
    wait,
)
from reconciler.edge.steps.retention import LINK_ON_THE_WAY
from testbed.recordings import answer
from tests.unit.step_cases import HEAD, no_such, reachable, sample
from tests.unit.step_cases import serving as cases
from tests.unit.step_cases import weights as wcases
from tests.unit.step_driver import Driver, Raw


class Recorder(Driver):
    """The test driver, keeping every action the step yielded (a report's fields, a wait's interval)."""

    def __init__(self, **kw: Any):
        super().__init__(**kw)
        self.actions: list[Any] = []

    def do(self, action: Any) -> object:
        self.actions.append(action)
        return super().do(action)

    def of(self, kind: type) -> list[Any]:
        return [a for a in self.actions if isinstance(a, kind)]


def returned(actions_: Any, driver: Driver) -> Any:
    """Run a generator that returns a value (a helper of a step) to its end through `driver`; its value."""
    result: Any = None
    while True:
        try:
            action = actions_.send(result)
        except StopIteration as stop:
            return stop.value
        result = driver.do(action)


# -- actions: the typed helpers ---------------------------------------------------------------------------------

def test_run_yields_exactly_the_command_asked_and_returns_its_result() -> None:
    """`run` is how every step spells a short command: each keyword reaches the Run, and the result comes back."""
    asked = run("n", "docker", "rm", "x", sudo=True, stdin=b"secret", timeout=7.0, check=False)
    action = next(asked)
    assert action == Run("n", ("docker", "rm", "x"), sudo=True, stdin=b"secret", timeout=7.0, check=False)
    assert (action.sudo, action.stdin, action.timeout, action.check) == (True, b"secret", 7.0, False)
    said = Result("out", "", 0)
    with pytest.raises(StopIteration) as stop:
        asked.send(said)
    assert stop.value.value is said


def test_run_defaults_to_a_checked_command_of_the_policy_s_deadline_not_as_root() -> None:
    action = next(run("n", "true"))
    assert (action.node, action.argv, action.sudo, action.stdin, action.timeout, action.check) == \
        ("n", ("true",), False, None, None, True)


def test_wait_defaults_poll_every_fifth_of_a_second_and_keep_nothing_in_reserve() -> None:
    fact: Fact[int] = Fact("k", ("sec k", "echo 1; rc 0"), lambda s: 1)
    action = next(wait(Read("n", fact), bool, timeout=3.0, what="w"))
    assert isinstance(action, Wait)
    assert (action.action, action.timeout, action.what, action.interval, action.reserve) == \
        (Read("n", fact), 3.0, "w", 0.2, 0.0)


# -- actions: the executor ----------------------------------------------------------------------------------------

class Clock:
    """`time.monotonic` of the executor, and a cancel whose wait advances it instead of sleeping."""

    def __init__(self, cancelled: bool = False):
        self.now, self.cancelled, self.waited = 100.0, cancelled, []

    def monotonic(self) -> float:
        return self.now

    def wait(self, interval: float) -> bool:
        self.waited.append(interval)
        self.now += interval
        return self.cancelled


class Node:
    """A node that answers each command with `Result(argv[0])` and each read with `@@k` = `body`, recording every
    call with the keywords it was given."""

    name = "n"

    def __init__(self, body: str = "1"):
        self.body = body
        self.calls: list[tuple[str, Any, dict[str, Any]]] = []
        self.closed: list[str] = []
        self.fail_line = False

    def run(self, argv: list[str], **kw: Any) -> Result:
        self.calls.append(("run", list(argv), kw))
        if kw.get("on_output") is not None:
            kw["on_output"](b"chunk")
        return Result(argv[0], "", 0)

    def run_script(self, script: str, timeout: float, cancel: Any = None) -> Result:
        self.calls.append(("read", None, {"timeout": timeout}))
        return Result(answer(script, f"@@k\n{self.body}\n@@rc 0\n"), "", 0)

    def bulk(self) -> Any:
        node = self

        class Bulk:
            def run(self, argv: list[str], **kw: Any) -> Result:
                node.calls.append(("bulk", list(argv), kw))
                return Result(argv[0], "", 0)
        return Bulk()

    def companion(self, argv: list[str], **kw: Any) -> Any:
        import contextlib
        node = self
        node.calls.append(("companion", list(argv), kw))

        class Helper:
            def line(self, timeout: float) -> str:
                node.calls.append(("line", None, {"timeout": timeout}))
                if node.fail_line:
                    raise CommandFailed("n", argv, 1, "", "no line")
                return "ready"

            def finish(self, timeout: float) -> Result:
                node.calls.append(("finish", None, {"timeout": timeout}))
                return Result("", "", 0)

            def end(self, timeout: float) -> Result:
                node.calls.append(("end", None, {"timeout": timeout}))
                return Result("", "", 5)

        @contextlib.contextmanager
        def held() -> Any:
            try:
                yield Helper()
            finally:
                node.closed.append(argv[0])
        return held()


def _performer(node: Node, remaining: float = 600.0, cancel: Any = None,
               events: list[tuple[str, dict[str, Any]]] | None = None) -> Performer:
    return Performer(lambda name: node, 60, lambda: remaining, cancel or threading.Event(),  # type: ignore[arg-type]
                     lambda event, fields: (events if events is not None else []).append((event, fields)))


def _do(performer: Performer, *steps: Any) -> list[Any]:
    """Perform the actions one after the other in one step; what each was answered."""
    got: list[Any] = []

    def body() -> Actions:
        for action in steps:
            got.append((yield action))
    performer.perform(body())
    return got


@pytest.mark.parametrize("own,remaining,deadline", [
    (None, 600.0, 60.0),  # the policy's command timeout
    (5.0, 600.0, 5.0),  # its own
    (900.0, 600.0, 600.0),  # never past the step's
    (None, 0.2, 1.0),  # never below one second
])
def test_a_command_s_deadline_is_its_own_capped_by_the_step_s(own: float | None, remaining: float,
                                                                deadline: float) -> None:
    node = Node()
    _do(_performer(node, remaining), Run("n", ("x",), timeout=own))
    assert node.calls[0][2]["timeout"] == deadline


def test_a_command_gets_exactly_its_flags_and_only_a_long_one_the_cancel() -> None:
    node = Node()
    cancel = threading.Event()
    said = _do(_performer(node, cancel=cancel), Run("n", ("short",), sudo=True, stdin=b"in", check=False),
               Run("n", ("long",), long=True), Run("n", ("bulk",), bulk=True))
    assert [r.stdout for r in said] == ["short", "long", "bulk"]
    (_, _, short), (_, _, long_), (where, argv, bulk) = node.calls
    assert {k: short[k] for k in ("sudo", "stdin", "check", "on_output", "cancel", "supervised")} == \
        {"sudo": True, "stdin": b"in", "check": False, "on_output": None, "cancel": None, "supervised": False}
    assert (long_["cancel"], long_["supervised"], long_["sudo"], long_["stdin"], long_["check"]) == \
        (cancel, True, False, None, True)
    assert (where, argv) == ("bulk", ["bulk"]), "a bulk command runs on the node's second connection"


def test_a_command_s_output_reports_only_what_its_feed_returns() -> None:
    node = Node()
    events: list[tuple[str, dict[str, Any]]] = []
    _do(_performer(node, events=events), Run("n", ("quiet",), on_output=lambda chunk: None),
        Run("n", ("loud",), on_output=lambda chunk: Report("tick", {"bytes": len(chunk)})), Report("done", {"a": 1}))
    assert events == [("tick", {"bytes": 5}), ("done", {"a": 1})]


def test_a_read_is_the_fact_s_parse_under_the_command_deadline_and_a_bad_parse_fails_the_step() -> None:
    node = Node("41")
    fact: Fact[int] = Fact("k", ("sec k", "echo; rc 0"), lambda s: int(s["k"].body) + 1)
    assert _do(_performer(node, remaining=30.0), Read("n", fact)) == [42]
    assert node.calls == [("read", None, {"timeout": 30.0})]

    def bad(sections: dict[str, Section]) -> int:
        raise ProbeError("k: not a number")
    caught: list[str] = []

    def body() -> Actions:
        try:
            yield Read("n", Fact("k", ("sec k", "echo; rc 0"), bad))
        except StepFailed as exc:
            caught.append(str(exc))
    _performer(Node("x")).perform(body())
    assert caught == ["n: k: not a number"]


def _waiting(clock: Clock, monkeypatch: pytest.MonkeyPatch, action: Wait, remaining: float) -> tuple[Node, Any]:
    monkeypatch.setattr(actions, "time", SimpleNamespace(monotonic=clock.monotonic))
    node = Node()
    caught: list[BaseException] = []

    def body() -> Actions:
        try:
            yield action
        except StepFailed as exc:
            caught.append(exc)
    _performer(node, remaining, cancel=clock).perform(body())
    return node, caught[0] if caught else None


def test_a_wait_reads_until_its_deadline_inclusive_then_says_what_it_waited_for(monkeypatch) -> None:
    """Its timeout is its own, capped by the step's remaining time less its reserve; the read at the deadline is
    the last one (the clock is the executor's, advanced by each interval)."""
    clock = Clock()
    node, error = _waiting(clock, monkeypatch, Wait(Run("n", ("probe",)), lambda r: False, timeout=10.0,
                                                    what="the thing", interval=1.0, reserve=5.0), remaining=8.0)
    assert isinstance(error, StepTimedOut) and str(error) == "timed out after 3s waiting for the thing"
    assert len(node.calls) == 4 and clock.waited == [1.0, 1.0, 1.0], "reads at 0, 1, 2 and 3 s"


def test_a_wait_with_no_time_left_reads_once_and_times_out_before_any_cancel(monkeypatch) -> None:
    """Past its deadline a wait says it timed out, even when a cancel came meanwhile: the step's own end, not a
    shutdown's."""
    clock = Clock(cancelled=True)
    node, error = _waiting(clock, monkeypatch, Wait(Run("n", ("probe",)), lambda r: False, timeout=10.0,
                                                    what="memory", reserve=70.0), remaining=60.0)
    assert type(error) is StepTimedOut and str(error) == "timed out after 0s waiting for memory"
    assert len(node.calls) == 1 and clock.waited == []


def test_a_cancelled_wait_says_what_it_waited_for(monkeypatch) -> None:
    clock = Clock(cancelled=True)
    node, error = _waiting(clock, monkeypatch, Wait(Run("n", ("probe",)), lambda r: False, timeout=10.0,
                                                    what="health", interval=2.0), remaining=60.0)
    assert type(error) is StepCancelled and str(error) == "cancelled while waiting for health"
    assert clock.waited == [2.0]


def test_a_wait_met_returns_the_value_that_met_it(monkeypatch) -> None:
    clock = Clock()
    monkeypatch.setattr(actions, "time", SimpleNamespace(monotonic=clock.monotonic))
    node = Node()
    got = _do(_performer(node, cancel=clock), Wait(Run("n", ("yes",)), lambda r: r.stdout == "yes", 5.0, "y"))
    assert got[0].stdout == "yes" and len(node.calls) == 1


def test_a_helper_lives_as_long_as_asked_within_the_step_and_is_stopped_as_asked() -> None:
    node = Node()
    helper, other, third = Start("n", ("bound",), stdin=b"in", timeout=30.0), Start("n", ("daemon",)), \
        Start("n", ("third",), timeout=900.0)
    said = _do(_performer(node, remaining=120.0), helper, other, third, Stop(helper, "finish"), Stop(other, "end"),
               Stop(third, "close"))
    assert [s if s is None or isinstance(s, str) else s.exit_code for s in said] == \
        ["ready", "ready", "ready", 0, 5, None]
    opened = [(argv, kw) for what, argv, kw in node.calls if what == "companion"]
    assert opened == [(["bound"], {"timeout": 30.0, "stdin": b"in", "open_timeout": 60.0}),
                      (["daemon"], {"timeout": 120.0, "stdin": b"", "open_timeout": 60.0}),
                      (["third"], {"timeout": 120.0, "stdin": b"", "open_timeout": 60.0})]
    assert [(what, kw) for what, _, kw in node.calls if what in ("line", "finish", "end")] == \
        [("line", {"timeout": 60.0})] * 3 + [("finish", {"timeout": 60.0}), ("end", {"timeout": 60.0})]
    assert node.closed == ["bound", "daemon", "third"], "each closed by its Stop, in the order stopped"


def test_a_helper_that_says_nothing_is_closed_and_its_error_reaches_the_step() -> None:
    node = Node()
    node.fail_line = True
    caught: list[int] = []

    def body() -> Actions:
        try:
            yield Start("n", ("bound",))
        except CommandFailed as exc:
            caught.append(exc.exit_code)
            caught.append(len(node.closed))
    _performer(node).perform(body())
    assert caught == [1, 1] and node.closed == ["bound"], "closed at once, and only once"


# -- serving: what the transcript does not show -----------------------------------------------------------------

def _start_given(observed: Observed | None = None) -> Given:
    return Given(sample(), observed or reachable(), 1)


def test_a_refused_sync_and_drop_say_the_node_and_the_first_200_characters_of_why() -> None:
    why = "sudo: " + "x" * 300
    driver = Recorder(facts={f"{HEAD} meminfo": [cases.meminfo(110)]},
                      results={cases.DROP[0][4:]: [Result("", "sync: " + "y" * 300, 1)],
                               cases.DROP[1][4:]: [Result("", why, 1)]})
    assert driver.drive(serving.memory_preflight(_start_given(), HEAD, False)) is None
    sync_said = f"`sync -f /home/spark/.cache/huggingface/hub` exited 1: sync: {'y' * 300}"[:200]
    drop_said = f"`/usr/sbin/sysctl -w vm.drop_caches=3` exited 1: {why}"[:200]
    assert [(r.event, r.fields) for r in driver.of(Report)] == [
        ("serving.sync-skipped", {"node": HEAD, "error": sync_said}),
        ("serving.drop-caches-refused", {"node": HEAD, "error": drop_said})]
    assert len(sync_said) == len(drop_said) == 200


def test_the_settle_after_a_stop_polls_meminfo_every_two_seconds_for_90_keeping_70_for_the_start() -> None:
    driver = Recorder(facts={f"{HEAD} meminfo": [cases.meminfo(60), cases.meminfo(110)]})
    assert driver.drive(serving.memory_preflight(_start_given(), HEAD, True)) is None
    (settle,) = driver.of(Wait)
    assert (settle.action, settle.timeout, settle.interval, settle.reserve, settle.what) == \
        (Read(HEAD, settle.action.fact), 90.0, 2.0, 70.0, "memory")


TWIN_DOWN = Observed(nodes={
    HEAD: NodeObservation(name=HEAD, reachable=True, docker_reachable=True,
                          fabric=Link(name="enp1s0f1np1", operstate="up", admin_up=True, carrier=True),
                          fabric_twin=Link(name="enP2p1s0f1np1", operstate="down", admin_up=True),
                          images={sample().serving.image: Image(id="sha256:" + "1" * 64,
                                                                content="sha256:" + "2" * 64)}),
    cases.WORKER: NodeObservation(name=cases.WORKER, reachable=True)})


def test_a_start_feeds_docker_the_environment_of_the_ports_that_carry_and_notes_its_uses() -> None:
    """With the fabric's twin down, NCCL_IB_HCA names only the port that carries (at_start); the env reaches
    `docker run` on its stdin only; the ledger's `served` lines name the weights and the image's content, with no
    detail ("-")."""
    given = _start_given(TWIN_DOWN)
    driver = Recorder(facts={f"{HEAD} container {cases.NAME}": [no_such(cases.NAME), cases.ours()],
                             **cases.ENOUGH})
    assert driver.drive(serving.start_serving(given, cases._start())) is None
    docker = next(key for key in driver.stdin if key.startswith(f"{HEAD} docker run "))
    env = driver.stdin[docker].decode().splitlines()
    assert "NCCL_IB_HCA=rocep1s0f1" in env and "VLLM_API_KEY=sk-unit-tests-0123456789" in env
    assert all("sk-unit-tests" not in line for line in driver.transcript)
    ledger = driver.stdin[f"{HEAD} sh -s"].decode().split("\n", 1)[0]
    assert ledger == (f"set -- {HEAD} {cases.INSTANCE} served weights "
                      "/home/spark/.cache/huggingface/hub/models--Qwen--Qwen3.5-122B-A10B-FP8 - "
                      f"served image sha256:{'2' * 64} -")


def test_the_health_wait_reports_its_node_and_stage_and_polls_every_second() -> None:
    driver = Recorder(facts={**cases.RUNNING, **cases.READINGS, f"head start {cases.NAME}": [cases.head()]})
    given = Given(cases.load(), cases.observe(cases.load()), 1)
    assert driver.drive(serving.await_health(given, cases._health())) is None
    assert [(r.event, r.fields) for r in driver.of(Report)
            if r.event not in ("serving.memory", "serving.transport")] == [
        ("serving.stage", {"node": "head", "stage": "waiting", "percent": None, "line": ""}),
        ("serving.done", {"node": "head", "stage": "serving", "percent": None, "line": ""})]
    (poll,) = driver.of(Wait)
    assert (poll.interval, poll.timeout, poll.what) == (
        1.0, 120.0, "http://127.0.0.1:8000/health on head, 'tiny-moe' in /v1/models and one completion")


def test_the_ray_launch_polls_ray_status_every_half_second_for_two_minutes() -> None:
    driver = Recorder(facts={f"{HEAD} ray {cases.NAME}": [cases.RAY_JOINED],
                             f"{HEAD} vllm-serve {cases.NAME}": [Raw("1")]})
    assert driver.drive(serving.launch_model(Given(cases._ray(), reachable(), 1), cases._launch())) is None
    (joined,) = driver.of(Wait)
    assert (joined.interval, joined.timeout, joined.what) == (0.5, 120.0, "2 nodes in `ray status`")


# -- weights: the pure parts --------------------------------------------------------------------------------------

H1, H2 = "1" * 64, "2" * 64


def test_sha256sum_output_is_read_line_by_line_skipping_what_it_escapes() -> None:
    """`sha256sum` prints `HEX  ./PATH`; an escaped name (a backslash first) and anything shorter than a digest, two
    spaces and a one-character name are skipped, and the lines after them still read."""
    out = "\n".join([
        f"{H1}  a",  # 67 characters, the shortest line naming a file (not from a `./` list: the name as it is)
        "sha256sum: ./gone: No such file or directory",  # shorter: skipped
        f"\\{H2}  ./new\\nline",  # escaped: skipped
        f"{H2}  ./blobs/b",
    ])
    assert step._sha256_lines(out) == {"a": H1, "blobs/b": H2}
    assert len(f"{H1}  a") == 67


def test_the_source_hash_cache_file_is_named_by_the_first_16_hex_of_the_root_s_sha256() -> None:
    """The name is the cache's key across upgrades: a changed name re-hashes every model on the next verify (as
    the move out of ~/.cache did once: issue 53, finding M)."""
    root = wcases.SRC
    assert step._cache_path(root) == ".spark-reconciler/sha256-" + \
        hashlib.sha256(root.encode()).hexdigest()[:16] + ".tsv"
    assert step._cache_path("/models/qwen") == ".spark-reconciler/sha256-0f533a2aad0304a5.tsv"


def _weights(unsafe: list[str], count: int) -> Weights:
    return Weights(root="/m", present=True, unsafe=unsafe, unsafe_count=count)


def test_links_leading_out_are_named_with_how_many_more_there_are() -> None:
    said = step.refusal(_weights(["a -> /x", "b -> /y"], 3), "n")
    assert said is not None and "has 3 link(s) leading out of it: a -> /x; b -> /y; and 1 more. Refusing" in said
    said = step.refusal(_weights(["a -> /x", "b -> /y"], 2), "n")
    assert said is not None and "leading out of it: a -> /x; b -> /y. Refusing" in said


def test_links_that_land_nowhere_inside_are_named_the_first_few_with_how_many_more() -> None:
    """Absolute links to nothing in the tree (size unknown): rsync would neither keep them nor copy them as files;
    the refusal names the first UNSAFE_SHOWN and counts the rest."""
    broken = [WeightFile(path=f"snap/l{i}", size=None, mtime=1.0, link_target=f"/gone/{i}") for i in range(12)]
    said = step.refusal(Weights(root="/m", present=True, files=broken), "n")
    named = "; ".join(f"snap/l{i} -> /gone/{i}" for i in range(10))
    assert said == ("the weights tree on n at /m has 12 link(s) that rsync would not keep (absolute, or climbing out "
                    f"of the tree) and that do not land on a file inside it: {named}; and 2 more. Refusing to sync: "
                    "make them relative links inside the tree, or replace them with the files")


def test_the_stream_meter_reports_the_bytes_all_streams_moved_never_past_the_total() -> None:
    meter = step.StreamMeter("worker1", 3_000_000, 2)
    assert meter.feed(0, b"sending incremental file list\n") is None
    first = meter.feed(0, b"      1,048,576  34%   10.00MB/s    0:00:01\r      2,000,000  66%")
    assert first == Report("weights.progress", {"node": "worker1", "bytes_done": 2_000_000, "bytes_total": 3_000_000})
    second = meter.feed(1, b"  1,500,000  99%")
    assert second is not None and second.fields["bytes_done"] == 3_000_000


def test_a_link_copied_as_a_file_is_read_at_its_file_even_when_no_regular_file_moves() -> None:
    """Issue 53: the link is never read again; the file the listing resolved it to is (held as directory 10, the
    directory numbers counted over the whole listing, so the same on a resumed copy)."""
    expected = Weights(root="/m", present=True, files=[
        WeightFile(path="blobs/a", size=10, mtime=1.0),
        WeightFile(path="snap/l", size=5, mtime=1.0, link_target="/m/blobs/a")])
    listing = Listing(expected, {}, "/m", {"snap/l": ("/m", "blobs/a")})
    plan = step._plan(listing, [("snap/l", 5)], {"snap/l"})
    assert (plan.sends, plan.pins, plan.moves) == ({"10/a": 5}, {10: ("/m", "blobs")}, [("10/a", "snap/l")])
    assert step._stream_groups(plan.sends, 4) == [["10/a"]]


def test_no_links_to_make_runs_nothing() -> None:
    assert list(step.make_links("worker1", "/m", [])) == []


def test_a_full_disk_counts_the_links_copied_as_files_still_missing_and_says_when_df_is_silent() -> None:
    """From the target's files (not the sender's count): the regular files and the links copied as files that it
    lacks; the free space as df says it, `unknown` when it does not."""
    link = "snapshots/1111111111111111111111111111111111111111/copied.json"
    blob = next(p for p in wcases.SMALL if p.startswith("blobs/e35d"))
    body = wcases.tree(wcases.SRC, extra=(f"E\t{link}\tl\t60\t1796526002.4\t{wcases.SRC}/{blob}",)).body
    expected = read_listing(wcases.SRC, Section(body, 0)).weights
    copied = step.links_to_copy(expected)
    assert copied == {link}
    full = CommandFailed("head", ["rsync"], 11, "", "write failed: No space left on device (28)")
    given = Given(wcases.recorded(), wcases._observed())
    for df, free in ((Raw("    Avail\n1048576"), "1048576"), (Raw("", 1), "unknown")):
        driver = Driver(facts={f"worker1 df {wcases.DST}": [df],
                               "worker1 weights": [wcases.tree(without=(wcases.SHARDS[0],))]})
        said = returned(step._explain_failure(given, "worker1", full, expected, copied), driver)
        assert said == (f"worker1: no space left on the filesystem of {wcases.DST}: {16777680 + 517} bytes still "
                        f"to copy, {free} bytes available; partial data kept in .rsync-partial for resume")


# -- weights: full verification against stand-in nodes ------------------------------------------------------------

HASH = ('cd "$1" && if command -v ionice >/dev/null 2>&1; then set -- ionice -c 3; else set --; fi; '
        'exec nice -n 19 "$@" xargs -0 -r sha256sum --')
CAT = 'cat "$HOME/$1" 2>/dev/null || true'
WRITE = 'umask 077 && mkdir -p "$HOME/$(dirname "$1")" && cat > "$HOME/$1.tmp" && mv -f "$HOME/$1.tmp" "$HOME/$1"'


class Tree:
    """A node holding a model tree: its listing (the probe's lines), the sha256 of each file, its hash cache.
    Records each command as (argv, timeout, cancel, stdin), and each listing as ("listing", timeout)."""

    name = "n"

    def __init__(self, listing: str, hashes: dict[str, str] | None = None, cache: str = "",
                 remove_exit: int = 0):
        self.listing, self.hashes, self.cache, self.remove_exit = listing, hashes or {}, cache, remove_exit
        self.calls: list[tuple[Any, ...]] = []
        self.written: str | None = None

    def run_script(self, script: str, timeout: float, cancel: Any = None) -> Result:
        self.calls.append(("listing", timeout))
        return Result(answer(script, f"@@weights\n{self.listing}\n@@rc 0\n"), "", 0)

    def run(self, argv: list[str], *, timeout: float, stdin: bytes | None = None, cancel: Any = None,
            **kw: Any) -> Result:
        self.calls.append((list(argv), timeout, cancel, stdin))
        script = argv[2]
        if script == HASH:
            asked = [p.removeprefix("./") for p in (stdin or b"").decode().split("\0") if p]
            return Result("".join(f"{self.hashes.get(p, H1)}  ./{p}\n" for p in asked), "", 0)
        if script == CAT:
            return Result(self.cache, "", 0)
        if script == WRITE:
            self.written = (stdin or b"").decode()
            return Result("", "", 0)
        assert script == step._REMOVE, argv
        if self.remove_exit:
            raise CommandFailed("n", argv, self.remove_exit, "", "no")
        return Result("".join(f"{p}\n" for p in argv[5:]), "", 0)

    def commands(self) -> list[str]:
        return ["listing" if call[0] == "listing" else {HASH: "hash", CAT: "cat", WRITE: "write"}.get(
            call[0][2], "remove") for call in self.calls]


FILES = sorted([*wcases.SHARDS, *wcases.SMALL])  # the recorded tree's regular files
EXTRA = "E\tblobs/extra\tf\t5\t1796526002.4000000000\t"
CACHE = step._cache_path(wcases.SRC)


def _nodes(target: Tree, source: Tree) -> dict[str, Tree]:
    return {"worker1": target, "head": source}


def test_verify_compares_every_regular_file_s_sha256_under_the_deadline_and_cancel_given() -> None:
    """One shard flipped on the target, one file the source lacks: named, nothing removed without `repair`; every
    command under the verify's deadline, the long hashes under its cancel, the source listed once."""
    target = Tree(wcases.tree(wcases.DST, extra=(EXTRA,)).body, {wcases.SHARDS[0]: H2})
    source = Tree(wcases.tree(wcases.SRC).body)
    cancel = threading.Event()
    found = step.verify_weights(wcases.recorded(), _nodes(target, source), "worker1", timeout=77.0,  # type: ignore[arg-type]
                                cancel=cancel)
    assert found == step.Verification(node="worker1", source="head", checked=len(FILES) + 1,
                                      mismatched=(wcases.SHARDS[0],), extra=("blobs/extra",),
                                      hashed_on_source=len(FILES), repaired=(), problem=None)
    assert target.commands() == ["listing", "hash"] and source.commands() == ["listing", "cat", "hash", "write"]
    assert target.calls[0] == ("listing", 77.0) and source.calls[0] == ("listing", 77.0)
    assert target.calls[1][:3] == (["sh", "-c", HASH, "sh", wcases.DST], 77.0, cancel)
    assert target.calls[1][3] == b"".join(f"./{p}".encode() + b"\0" for p in sorted([*FILES, "blobs/extra"]))
    assert source.calls[1][:3] == (["sh", "-c", CAT, "sh", CACHE], 77.0, None)
    assert source.calls[2][:3] == (["sh", "-c", HASH, "sh", wcases.SRC], 77.0, cancel)
    assert source.calls[3][:3] == (["sh", "-c", WRITE, "sh", CACHE], 77.0, None)
    assert found.message() == (f"worker1: 1 of {len(FILES) + 1} files differ from head (sha256): "
                               f"{wcases.SHARDS[0]}")


def test_verify_by_default_allows_an_hour_repairs_nothing_and_cancels_nothing() -> None:
    target = Tree(wcases.tree(wcases.DST).body, {wcases.SHARDS[0]: H2})
    source = Tree(wcases.tree(wcases.SRC).body)
    found = step.verify_weights(wcases.recorded(), _nodes(target, source), "worker1")  # type: ignore[arg-type]
    assert found.mismatched == (wcases.SHARDS[0],) and found.repaired == () and not found.ok
    assert "remove" not in target.commands()
    timeouts = [c[1] for node in (target, source) for c in node.calls]
    assert timeouts == [3600] * len(timeouts) and all(c[2] is None for c in target.calls[1:] + source.calls[1:])


def test_a_verified_copy_says_how_many_files_match() -> None:
    target, source = Tree(wcases.tree(wcases.DST).body), Tree(wcases.tree(wcases.SRC).body)
    found = step.verify_weights(wcases.recorded(), _nodes(target, source), "worker1", repair=True)  # type: ignore[arg-type]
    assert found.ok and found.mismatched == () and found.repaired == () and "remove" not in target.commands()
    assert found.message() == f"worker1: {len(FILES)} files match head (sha256)"


def test_a_repair_removes_the_differing_files_under_the_deadline_and_every_problem_is_said() -> None:
    """A target listed only in part and a source with a link leading out: both said, in that order, beside the
    files repaired."""
    target = Tree(wcases.tree(wcases.DST, ended=False).body, {wcases.SHARDS[1]: H2})
    source = Tree(wcases.tree(wcases.SRC, extra=(f"E\t{wcases.OUT}",)).body)
    found = step.verify_weights(wcases.recorded(), _nodes(target, source), "worker1", repair=True,  # type: ignore[arg-type]
                                timeout=50.0)
    assert found.repaired == (wcases.SHARDS[1],) and found.mismatched == (wcases.SHARDS[1],)
    removal = target.calls[-1]
    assert removal[:2] == (["sh", "-c", step._REMOVE, "sh", wcases.DST, wcases.SHARDS[1]], 50.0)
    assert found.problem == ("worker1: the listing ended early; head: links leading out of the tree: "
                             "snapshots/1111111111111111111111111111111111111111/leak.json -> "
                             "/home/spark/.ssh/id_ed25519 (outside the tree: /home/spark/.ssh/id_ed25519)")
    assert found.message().endswith(f": {wcases.SHARDS[1]}; {found.problem}")


def test_a_verify_names_ten_differing_files_at_most_and_a_problem_alone_is_no_match() -> None:
    """The message stays one line however much differs; a tree not fully listed is never `ok`, even when every
    file it did list matches."""
    everything = Tree(wcases.tree(wcases.DST).body, dict.fromkeys(FILES, H2))
    found = step.verify_weights(wcases.recorded(), _nodes(everything, Tree(wcases.tree(wcases.SRC).body)),  # type: ignore[arg-type]
                                "worker1")
    assert found.message() == "worker1: 12 of 12 files differ from head (sha256): " + ", ".join(FILES[:10])
    partial = Tree(wcases.tree(wcases.DST, ended=False).body)
    found = step.verify_weights(wcases.recorded(), _nodes(partial, Tree(wcases.tree(wcases.SRC).body)),  # type: ignore[arg-type]
                                "worker1")
    assert found.mismatched == () and not found.ok
    assert found.message() == "worker1: 0 of 12 files differ from head (sha256); worker1: the listing ended early"


def _stats() -> dict[str, tuple[int, str]]:
    return read_listing(wcases.SRC, Section(wcases.tree(wcases.SRC).body, 0)).resolved


def test_the_source_hashes_only_what_its_cache_does_not_hold_and_rewrites_the_cache() -> None:
    """The cache answers (path, size, mtime) that did not change; a changed or malformed line is hashed again; an
    entry for another target's path stays; one for a path gone from the tree goes."""
    stats = _stats() | {"blobs/a b": (3, "1796526002.5")}
    small = wcases.SMALL
    (s0, m0), (s1, m1), (s2, m2), (s3, m3), (s4, m4) = (stats[p] for p in small[:5])
    cache = "\n".join([
        f"{small[0]}\t{s0}\t{m0}\t{'c' * 64}",  # still valid: answered from the cache
        f"{small[1]}\t{s1}\t{m1}\t{'d' * 64}",  # valid, not asked for: kept
        f"{small[2]}\t{s2}\t1.0\t{'e' * 64}",  # changed since: hashed again
        f"{small[3]}\t{s3}\t{m3}\t{'f' * 63}",  # not a digest: hashed again
        f"{small[4]}\t{s4}\t{m4}\t{'a' * 64}\tmore",  # five fields: hashed again
        f"blobs/x\tbig\t{m4}\t{'a' * 64}",  # not a size
        "only\tthree\tfields",
        f"blobs/gone\t1\t1.0\t{'b' * 64}",  # no longer in the tree: dropped
        f"blobs/a b\t3\t1796526002.5\t{'9' * 64}",  # a name with a space: valid
    ]) + "\n"
    node = Tree("", {small[2]: H2}, cache=cache)
    cancel = threading.Event()
    asked = [small[0], small[2], small[3], small[4], "blobs/a b", "snapshots/unresolved"]
    hashes, hashed = step.source_hashes(node, wcases.SRC, asked, 40.0, cancel, stats=stats)  # type: ignore[arg-type]
    assert hashes == {small[0]: "c" * 64, small[2]: H2, small[3]: H1, small[4]: H1, "blobs/a b": "9" * 64}
    assert hashed == 3
    assert node.commands() == ["cat", "hash", "write"], "the stats given: no listing"
    assert node.calls[1][1:] == (40.0, cancel, f"./{small[2]}\0./{small[3]}\0./{small[4]}\0".encode())
    assert node.calls[2][1] == 40.0
    assert node.written == "".join(sorted([
        f"blobs/a b\t3\t1796526002.5\t{'9' * 64}\n", f"{small[0]}\t{s0}\t{m0}\t{'c' * 64}\n",
        f"{small[1]}\t{s1}\t{m1}\t{'d' * 64}\n", f"{small[2]}\t{s2}\t{m2}\t{H2}\n", f"{small[3]}\t{s3}\t{m3}\t{H1}\n",
        f"{small[4]}\t{s4}\t{m4}\t{H1}\n"]))


def test_the_source_lists_its_tree_itself_when_not_given_it() -> None:
    node = Tree(wcases.tree(wcases.SRC).body, {wcases.SMALL[0]: H2})
    hashes, hashed = step.source_hashes(node, wcases.SRC, [wcases.SMALL[0]], 25.0)  # type: ignore[arg-type]
    assert (hashes, hashed) == ({wcases.SMALL[0]: H2}, 1)
    assert node.calls[0] == ("listing", 25.0) and node.commands() == ["listing", "cat", "hash", "write"]
    assert node.calls[2][2] is None, "no cancel given"


def test_a_source_whose_cache_answers_everything_hashes_nothing() -> None:
    stats = _stats()
    size, mtime = stats[wcases.SMALL[0]]
    node = Tree("", cache=f"{wcases.SMALL[0]}\t{size}\t{mtime}\t{H2}\n")
    assert step.source_hashes(node, wcases.SRC, [wcases.SMALL[0]], 9.0, stats=stats) == \
        ({wcases.SMALL[0]: H2}, 0)  # type: ignore[arg-type]
    assert node.commands() == ["cat", "write"]


def test_remove_files_runs_one_command_for_the_paths_inside_and_none_for_none() -> None:
    node = Tree("")
    assert step.remove_files(node, "/m/tree/", ["a/b", "../x", "/etc/passwd"], 12.0) == ("a/b",)  # type: ignore[arg-type]
    assert node.calls == [(["sh", "-c", step._REMOVE, "sh", "/m/tree", "a/b"], 12.0, None, None)]
    assert step.remove_files(node, "/m", ["../x", ""], 12.0) == ()  # type: ignore[arg-type]
    assert len(node.calls) == 1


def test_a_removal_that_fails_otherwise_than_by_a_link_on_the_way_is_raised() -> None:
    assert step.remove_files(Tree("", remove_exit=LINK_ON_THE_WAY), "/m", ["a"], 5.0) is None  # type: ignore[arg-type]
    with pytest.raises(CommandFailed):
        step.remove_files(Tree("", remove_exit=1), "/m", ["a"], 5.0)  # type: ignore[arg-type]
