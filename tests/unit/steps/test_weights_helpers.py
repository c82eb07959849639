"""The weights step's pure helpers pinned case by case (issue 34: mutation survivors of
reconciler/edge/steps/weights.py), and what the step's actions carry beyond the transcript of its step cases
(tests/unit/step_cases/weights.py): each rsync run's deadline, supervision and progress, the reports' payloads, the
ledger's `started` line. Expected values come from rsync's own rule (util1.c `unsafe_symlink`, 3.4), from the
recorded tree's sizes, and from the exact words the operator reads."""

from __future__ import annotations

from typing import Any

import pytest

from reconciler.core.observed import WeightFile, Weights
from reconciler.edge.manifest import Listing
from reconciler.edge.ssh import Result
from reconciler.edge.steps.actions import Action, Given, Report, Run
from reconciler.edge.steps.weights import (
    StreamMeter,
    _files_to_copy,
    _groups,
    _plan,
    _rsync_argv,
    _stream_groups,
    inside_tree,
    links_to_make,
    refusal,
    rsync_keeps_link,
    sync_weights,
)
from tests.unit.step_cases.weights import (
    DST,
    FRESH,
    HEAD,
    HELPERS,
    SRC,
    STEP,
    WORKER,
    _daemon,
    _observed,
    _policy,
    recorded,
    rsync,
)
from tests.unit.step_driver import Driver, Raw

# -- rsync_keeps_link: rsync 3.4's unsafe_symlink, one situation each -------------------------------------------


@pytest.mark.parametrize(("path", "value", "kept"), [
    # a run of leading `../` with doubled slashes is one climb each: two levels deep, two climbs stay inside
    ("a/b/link", "..//../x", True),
    # `..` after a name (once the leading climbs are skipped) is unsafe, whatever the link's depth
    ("a/b/c/link", "../X/../y", False),
    ("a/b/link", "../a/../x", False),
    # a `..` among the link's own directories resets its margin to the top: nothing left to climb
    ("a/b/../link", "../x", False),
    # `.` adds no depth: a link at `./link` sits at the top
    ("./link", "../x", False),
    # a link named `..` counts from the top as well
    ("a/..", "../x", False),
    ("a/..", "x", True),
    # each `..` climbs exactly one level
    ("a/b/link", "../../x", True),
    ("a/b/link", "../../../x", False),
])
def test_rsync_keeps_a_link_exactly_where_its_text_stays_inside(path: str, value: str, kept: bool) -> None:
    """Links kept as links are made by the reconciler from this answer: one kept wrongly climbs out of the tree,
    one refused wrongly is copied as a file (or refuses the tree)."""
    assert rsync_keeps_link(path, value) is kept


# -- inside_tree ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("path", "inside"), [
    ("blobs/abc", True),
    ("a\nb", False),     # a newline would split the removal's output lines
    ("a\0b", False),     # a NUL ends the argument early on the node
    ("a//b", False),     # an empty component
    ("a/", False),
    ("/etc/passwd", False),
    ("", False),
    ("a/../b", False),
    ("./a", False),
])
def test_inside_tree_by_its_text(path: str, inside: bool) -> None:
    """Repair removes only paths this accepts: each rejected spelling could name something outside, or
    something else than the listing meant."""
    assert inside_tree(path) is inside


# -- links_to_make ----------------------------------------------------------------------------------------------


def _w(*files: WeightFile, root: str = DST, **kw: Any) -> Weights:
    return Weights(root=root, present=True, files=list(files), **kw)


def test_links_made_are_those_kept_by_rsync_and_named_inside_the_tree() -> None:
    """A link whose own path is not inside the tree (`./x`) is never made, though its value would be kept; a
    link neither kept nor copied (absolute, broken) is never made either: the reconciler plants no link it did
    not check."""
    weights = _w(WeightFile(path="snap/model", size=10, link_target="../blobs/b"),
                 WeightFile(path="blobs/b", size=10),
                 WeightFile(path="./x", size=None, link_target="y"),
                 WeightFile(path="snap/abs", size=None, link_target="/etc/passwd"),
                 WeightFile(path="snap/out", size=5, link_target="/srv/store/blob"))
    assert links_to_make(weights) == [("snap/model", "../blobs/b")]


# -- refusal: the exact words ----------------------------------------------------------------------------------


def _stuck(n: int) -> Weights:
    return _w(*(WeightFile(path=f"l{i:02}", size=None, link_target=f"/gone/{i:02}") for i in range(n)),
              root="/m")


@pytest.mark.parametrize(("stuck", "more"), [(12, "; and 2 more"), (10, "")])
def test_refusal_names_ten_stuck_links_and_counts_the_rest(stuck: int, more: str) -> None:
    """The operator reads which links to fix: the first ten, then how many more (nothing more for exactly ten)."""
    shown = "; ".join(f"l{i:02} -> /gone/{i:02}" for i in range(10))
    assert refusal(_stuck(stuck), "head") == (
        f"the weights tree on head at /m has {stuck} link(s) that rsync would not keep (absolute, or climbing out of "
        f"the tree) and that do not land on a file inside it: {shown}{more}. Refusing to sync: make them relative "
        "links inside the tree, or replace them with the files")


# -- _groups, _files_to_copy, _stream_groups -------------------------------------------------------------------


def test_groups_largest_first_each_to_the_lightest_group_so_far() -> None:
    """Greedy by size, largest first: 9 to one group, 5 and then 4 to the other (lighter each time), then 3 to
    the 9 (9 against 9: the group that reached it first)."""
    assert sorted(_groups([("c3", 3), ("a9", 9), ("b5", 5), ("d4", 4)], 2)) == [["a9", "c3"], ["b5", "d4"]]


def test_groups_one_stream_keeps_every_file_in_one_run() -> None:
    assert _groups([("a", 3), ("b", 2), ("c", 1)], 1) == [["a", "b", "c"]]


def test_groups_ties_go_to_the_group_that_reached_the_lightest_total_first() -> None:
    """Four equal files on three streams: the fourth joins the group filled first (`z`), not the one whose names
    sort first: the run lists, and so the commands the step cases pin, depend on sizes and order only."""
    result = _groups([("z", 1), ("y", 1), ("x", 1), ("w", 1)], 3)
    assert sorted(result) == [["w", "z"], ["x"], ["y"]]


def test_groups_ascending_names_do_not_decide_the_order() -> None:
    """Sizes, not names, decide: `a` (1) and `b` (1) share, `c` (2) alone."""
    assert sorted(_groups([("a", 1), ("b", 1), ("c", 2)], 2)) == [["a", "b"], ["c"]]


def test_an_empty_file_moves_no_bytes() -> None:
    """A 0-byte file is listed, at 0 bytes: the copy's total is the real bytes to move."""
    expected = _w(WeightFile(path="empty", size=0), WeightFile(path="data", size=7))
    assert _files_to_copy(expected, Weights(root=DST, present=False)) == [("empty", 0), ("data", 7)]


def test_stream_groups_a_copied_link_alone_gets_a_run_read_at_its_file() -> None:
    """A link copied as a file is sent as the file the listing resolved it to (issue 53: never the link again),
    in an ordinary run: there are no runs of links any more."""
    expected = _w(WeightFile(path="snap/x", size=4, link_target="/store/ab/x"))
    copied = {"snap/x"}
    todo = _files_to_copy(expected, Weights(root=DST, present=False), copied)
    plan = _plan(Listing(expected, {}, "/m", {"snap/x": ("/store", "ab/x")}), todo, copied)
    assert (plan.sends, plan.pins, plan.moves) == ({"10/x": 4}, {10: ("/store", "ab")}, [("10/x", "snap/x")])
    assert _stream_groups(plan.sends, 2) == [["10/x"]]


def test_stream_groups_empty_files_ride_with_the_last_data_run() -> None:
    """An empty file is no stream of its own; a 1-byte file is data like any other."""
    assert _stream_groups({"10/a": 5, "10/b": 1, "10/e": 0}, 2) == [["10/a"], ["10/b", "10/e"]]


def test_stream_groups_only_empty_files_one_run() -> None:
    assert _stream_groups({"10/e": 0, "10/f": 0}, 4) == [["10/e", "10/f"]]


def test_stream_groups_nothing_to_send_no_run() -> None:
    assert _stream_groups({}, 4) == []


# -- _rsync_argv ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("limit", "kib"), [(1000, 1), (2048, 2), (3000, 2), (5 * 1024 * 1024, 5120)])
def test_bandwidth_limit_in_whole_kib_at_least_one(limit: int, kib: int) -> None:
    """rsync's --bwlimit is in KiB/s; below 1 KiB/s it would mean no limit (0), so at least 1."""
    argv = _rsync_argv(_policy(recorded(), bandwidth_limit=limit), HEAD, WORKER, None)
    assert [a for a in argv if a.startswith("--bwlimit")] == [f"--bwlimit={kib}"]


def test_no_stream_follows_a_link() -> None:
    """Issue 53: --copy-links read each checked link again, after any swap. Every run now reads only the
    directories `links_helper send` holds (below /proc/self/fd/) into the target's staging directory."""
    argv = _rsync_argv(recorded(), HEAD, WORKER, "list")
    assert not {"--copy-links", "-L", "--copy-unsafe-links", "-k", "--copy-dirlinks", "-l", "-a"} & set(argv)
    assert argv[-2:] == ("/proc/self/fd/", "spark@10.232.0.11:" + DST + "/.rsync-partial/staged/")


# -- StreamMeter -----------------------------------------------------------------------------------------------


def test_meter_sums_each_streams_last_progress() -> None:
    meter = StreamMeter(WORKER, 10_000, 2)
    assert meter.feed(0, b"no progress here\n") is None
    assert meter.feed(0, b"  1,000  10%  1.00MB/s\r  2,000  20%\r  3,000  30%\r") == Report(
        "weights.progress", {"node": WORKER, "bytes_done": 3000, "bytes_total": 10_000})
    assert meter.feed(1, b"  500   5%\r  700   7%\r") == Report(
        "weights.progress", {"node": WORKER, "bytes_done": 3700, "bytes_total": 10_000})


def test_meter_never_says_more_than_the_total() -> None:
    meter = StreamMeter(WORKER, 100, 1)
    assert meter.feed(0, b"  150  100%\r") == Report(
        "weights.progress", {"node": WORKER, "bytes_done": 100, "bytes_total": 100})


# -- the step's actions beyond the transcript ----------------------------------------------------------------


class _Recording(Driver):
    """The step cases' driver, keeping every action (those inside a Parallel too) and each progress report."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.actions: list[Action] = []
        self.progress: list[Report] = []

    def do(self, action: Action) -> object:
        if not isinstance(action, Run):
            self.actions.append(action)
        return super().do(action)

    def run(self, action: Run) -> Any:
        self.actions.append(action)
        if action.on_output is not None:
            for chunk in self.outputs.get("progress", ()):
                if (report := action.on_output(chunk)) is not None:
                    self.progress.append(report)
        return super().run(action)


def _whole_copy() -> _Recording:
    driver = _Recording(FRESH, {**HELPERS, **_daemon()}, outputs={"progress": [b"  1,024  0%\r"]})
    error = driver.drive(sync_weights(Given(recorded(), _observed(), 1), STEP))
    assert error is None, repr(error)
    return driver


#: The recorded tree's regular files (11 blobs and refs/main): what a fresh copy moves; with its 11 links, the
#: 23 files of its manifest.
TOTAL = 517 + 72 + 16777680 + 16777752 + 84 + 199 + 16777568 + 1237 + 116 + 16777568 + 70 + 40


def test_the_copy_reports_its_start_and_end_with_their_numbers() -> None:
    reports = [a for a in _whole_copy().actions if isinstance(a, Report)]
    assert [r for r in reports if r.event in ("weights.start", "weights.done")] == [
        Report("weights.start", {"node": WORKER, "bytes_total": TOTAL, "files": 12, "streams": 4}),
        Report("weights.done", {"node": WORKER, "bytes_total": TOTAL, "files": 23})]


def test_each_rsync_is_supervised_bounded_and_metered() -> None:
    """The rsyncs run long (ended on shutdown, SIGTERM when the channel closes), on the bulk connection, under the
    copy's deadline, and their progress lines become the copy's progress report for the target."""
    driver = _whole_copy()
    runs = [a for a in driver.actions if isinstance(a, Run) and "rsync" in a.argv]
    assert [(r.timeout, r.long, r.bulk) for r in runs] == [(43200.0, True, True)] * 4
    assert driver.progress[0] == Report("weights.progress",
                                        {"node": WORKER, "bytes_done": 1024, "bytes_total": TOTAL})
    assert len(driver.progress) == 4


def test_the_sync_is_bounded_by_the_copy_deadline() -> None:
    driver = _whole_copy()
    (sync,) = [a for a in driver.actions if isinstance(a, Run) and a.argv[:2] == ("sync", "-f")]
    assert sync.timeout == 43200.0


def test_the_started_line_says_no_digest_yet() -> None:
    """`started` lines carry `-` as their detail: the ledger's readers tell a begun copy from a finished one."""
    driver = _whole_copy()
    ledgers = [a for a in driver.actions if isinstance(a, Run) and a.argv == ("sh", "-s")]
    assert ledgers[0].stdin.split(b"\n", 1)[0] == f"set -- {WORKER} 10.231.0.2:22 started weights {DST} -".encode()


def test_a_full_disk_counts_the_links_copied_as_files_still_missing() -> None:
    """The bytes still to copy include a link copied as the file it points to (here a hub blob-store link, 100
    bytes), not only the regular files: the operator sizes the disk from this number."""
    def listing(root: str, *files: WeightFile) -> Listing:
        return Listing(Weights(root=root, present=bool(files), files=list(files)), {}, root,
                       {f.path: ("/store", "b") for f in files if f.link_target})

    source = listing(SRC, WeightFile(path="blobs/a", size=5),
                     WeightFile(path="snap/model", size=100, link_target="../../../../store/b"))
    driver = Driver({f"{HEAD} weights": [source], f"{WORKER} weights": [listing(DST), listing(DST)],
                     f"{WORKER} df {DST}": [Raw("    Avail\n1")]},
                    {**HELPERS, **_daemon(2), rsync(0).removeprefix("run "): [Result("", "No space left", 11)]})
    error = driver.drive(sync_weights(Given(recorded(), _observed(), 1), STEP))
    assert "105 bytes still to copy, 1 bytes available" in str(error), repr(error)


def test_a_link_whose_value_is_dot_dot_is_kept_when_its_directory_is_one_deep():
    """rsync 3.4's `unsafe_symlink()` (util1.c): a value's `..` climbs one directory of the link's own depth, the
    last component as well as the others; `a/l -> ..` lands on the tree's top (kept), `l -> ..` above it (not)."""
    assert rsync_keeps_link("a/l", "..") is True
    assert rsync_keeps_link("a/l", "../x") is True
    assert rsync_keeps_link("l", "..") is False
