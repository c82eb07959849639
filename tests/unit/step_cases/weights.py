"""weights: the model tree copied head -> worker1 over the fabric, from the manifests the testbed's probe really
printed (tests/unit/fixtures/probe-4-nodes.json: the tiny-moe hf-cache tree, four 16 MB shards behind snapshot
links). Its re-checks (the source's tree present and safe, the target's differing and safe), the copy (the
target's receiving helper, page-cache bounds on both ends, the one-time rsync daemon or the ssh hop, one rsync per
stream on the bulk connection, all at once, each run by `links_helper send` from the directories it holds), the
files moved into place as they arrive and the links made by the reconciler, `sync -f` and the manifests compared,
the ledger's lines; and each failure with what it says. The real rsync, daemon and helpers run in
tests/unit/steps/test_weights_tree.py and tests/unit/steps/test_weights_swap.py."""

from __future__ import annotations

import shlex
from collections.abc import Callable
from dataclasses import replace
from functools import cache

from reconciler.core.observed import NodeObservation, Observed
from reconciler.core.planning import Step
from reconciler.core.spec import Desired
from reconciler.edge.ssh import Result
from tests.unit.recorded import RAW, load, sections_of
from tests.unit.step_cases import Case, with_known_hosts
from tests.unit.step_driver import Raw

HEAD, WORKER = "head", "worker1"
SRC = "/srv/spark-testbed/head/models/hub/models--testorg--tiny-moe"
DST = "/srv/spark-testbed/worker1/models/hub/models--testorg--tiny-moe"
LIST = "ce91d70d695b"  # the first 12 hex of sha256(DST): a stream's file list is named by the tree it fills
LISTED = sections_of(RAW["outputs"][HEAD])["weights"].body  # the head's tree as its probe printed it
SHARDS = sorted(line.split("\t")[1] for line in LISTED.splitlines()
                if line.startswith("E\tblobs/") and int(line.split("\t")[3]) > 1_000_000)
SMALL = sorted(line.split("\t")[1] for line in LISTED.splitlines()
               if line.startswith("E\t") and line.split("\t")[2] == "f" and int(line.split("\t")[3]) < 1_000_000)
SECRET_LINE = "port 40000\n"  # the daemon helper's first line: the port the kernel gave it


def tree(root: str = DST, *, without: tuple[str, ...] = (), extra: tuple[str, ...] = (), ended: bool = True) -> Raw:
    """The recorded tree as it would be listed at `root`, some entries left out, some lines added (and without
    its end line: a walk `head` cut short)."""
    lines = [line.replace(SRC, root) for line in LISTED.splitlines()
             if not any(line.startswith(f"E\t{path}\t") for path in without)]
    return Raw("\n".join([*lines[:-1], *extra, *(lines[-1:] if ended else [])]))


ABSENT = Raw("", 2)  # no such directory: `manifest_script` says rc 2


def _observed() -> Observed:
    return Observed(nodes={n: NodeObservation(name=n, reachable=True) for n in (HEAD, WORKER, "worker2", "worker3")})


def _policy(desired: Desired, **weights: object) -> Desired:
    policy = desired.policy.model_copy(update={"weights": desired.policy.weights.model_copy(update=weights)})
    return desired.model_copy(update={"policy": policy})


@cache
def recorded() -> Desired:
    return load()


@cache
def over_ssh() -> Desired:
    """The ssh transport, with the reconciler's known_hosts holding the nodes' keys (the hop's strict key)."""
    return _policy(with_known_hosts(recorded()), transport="ssh")


@cache
def unbounded() -> Desired:
    return _policy(recorded(), drop_behind=False)


def _start(node: str, *argv: str) -> str:
    return f"{node} " + shlex.join(["python3", "-c", *argv])


BOUND_SRC = _start(HEAD, "<drop_behind_helper.py>", SRC, "43200")
BOUND_DST = _start(WORKER, "<drop_behind_helper.py>", DST, "43200")


def daemon(streams: int) -> str:
    return _start(WORKER, "<rsyncd_helper.py>", "10.232.0.11", "10.232.0.10", str(streams), DST, "43200")


#: The hop's ssh as rsync's `-e` (no configuration but these, strict keys against the target's own file).
HOP = ("ssh -F /dev/null -o GlobalKnownHostsFile=/dev/null -o IdentitiesOnly=yes -p 22 -o BatchMode=yes -o "
       "StrictHostKeyChecking=yes -o 'UserKnownHostsFile=~/.ssh/spark-reconciler_fabric_known_hosts_worker1' -o "
       "ConnectTimeout=10 -o ServerAliveInterval=15 -o ServerAliveCountMax=3 -o Compression=no -c "
       "aes128-gcm@openssh.com")


def upload(index: int) -> str:
    return (f"run {HEAD} sh -c 'umask 077 && mkdir -p \"$HOME/${{0%/*}}\" && cat > \"$HOME/$0\"' "
            f".spark-reconciler/rsync-{WORKER}-{LIST}-{index}.list")


def rsync(index: int, ssh: bool = False) -> str:
    """One stream's rsync as the source runs it (spelled out: the options are the safety properties), by
    `links_helper send` (issue 53: it holds what the listing checked; rsync reads that, never a link)."""
    words = ["python3", "-c", "<links_helper.py>", "send", f".spark-reconciler/rsync-{WORKER}-{LIST}-{index}.list",
             "rsync", "--recursive", "--times", "--perms", "--partial-dir=.rsync-partial", "--info=progress2",
             "--no-inc-recursive", "--timeout=60"]
    if ssh:
        words += ["-e", HOP]
    else:
        words += ["--password-file=-", "--address=10.232.0.10"]
    words += [f"--files-from=.spark-reconciler/rsync-{WORKER}-{LIST}-{index}.from", "--from0", "/proc/self/fd/",
              f"spark@10.232.0.11:{DST}/.rsync-partial/staged/" if ssh
              else "rsync://fabric@10.232.0.11:40000/models/.rsync-partial/staged/"]
    return f"run {HEAD} {shlex.join(words)}"


LINKS = f"run {WORKER} python3 -c '<links_helper.py>' {DST}"
RECEIVE = _start(WORKER, "<links_helper.py>", "receive", DST, "43200")
STAGE = f"start {RECEIVE}"  # the staging directory made, then each file moved into place as it arrives
PLACE = f"stop end {RECEIVE}"  # its last look: every file arrived and is at its path
LEDGER = f"run {WORKER} sh -s"
READS = [f"read {HEAD} weights", f"read {WORKER} weights"]
HELPERS = {f"start {BOUND_SRC}": [Result("ready\n", "", 0)], f"start {BOUND_DST}": [Result("ready\n", "", 0)],
           f"start {RECEIVE}": [Result("ready\nplaced 12\n", "", 0)]}


def _streams(n: int, ssh: bool = False) -> list[str]:
    return [*(upload(i) for i in range(n)), f"parallel {n}", *(rsync(i, ssh) for i in range(n))]


def copied(n: int = 4, *, fresh: bool = True) -> list[str]:
    """A whole copy of `n` streams over the daemon, both ends bounded."""
    return [*READS, *([LEDGER] if fresh else []), STAGE, "report weights.start",
            f"start {BOUND_SRC}", f"start {BOUND_DST}", f"start {daemon(n)}", *_streams(n),
            f"stop finish {daemon(n)}", PLACE, LINKS, f"run {WORKER} sync -f {DST}", f"read {WORKER} weights",
            f"stop end {BOUND_DST}", f"stop end {BOUND_SRC}", "report weights.done",
            *([] if fresh else [f"read {WORKER} copies"]), LEDGER]


STEP = Step("weights", WORKER, "missing", (), source=HEAD)
BY = "10.231.0.2:22"  # this cluster's label in the ledger: the recorded head's ssh host:port (no cluster id read)
OUT = "snapshots/1111111111111111111111111111111111111111/leak.json\tl\t11\t1796526002.4\t/home/spark/.ssh/id_ed25519"


def _case(name: str, commands: list[str], facts: dict[str, list[object]], *,
          results: dict[str, list[Result]] | None = None, raises: str | None = None,
          desired: Callable[[], Desired] = recorded) -> Case:
    return Case(name, STEP, commands, facts=facts, results={**HELPERS, **(results or {})}, raises=raises,
                desired=desired, observed=_observed)


STARTED = Result(SECRET_LINE, "", 0)  # the daemon's whole run: its port, then a good end


def _daemon(n: int = 4, said: Result = STARTED) -> dict[str, list[Result]]:
    return {f"start {daemon(n)}": [said]}


FRESH = {f"{HEAD} weights": [tree(SRC)], f"{WORKER} weights": [ABSENT, tree()]}
NO_SPACE = Result("", "rsync: [receiver] write failed on \"blobs/2c25\": No space left on device (28)", 11)

CASES = [
    _case("the target holds the same tree: nothing copied", READS,
          {f"{HEAD} weights": [tree(SRC)], f"{WORKER} weights": [tree()]}),
    _case("the target lacks the tree: the whole copy, begun and recorded in the ledger", copied(),
          FRESH, results=_daemon()),
    _case("a copy resumed: only the missing shard moves, recorded as ours by its `started` line",
          copied(1, fresh=False),
          {f"{HEAD} weights": [tree(SRC)], f"{WORKER} weights": [tree(without=(SHARDS[0],)), tree()],
           f"{WORKER} copies": [{DST}]}, results=_daemon(1)),
    _case("a tree someone else began, topped up: not recorded as ours", copied(1, fresh=False)[:-1],
          {f"{HEAD} weights": [tree(SRC)], f"{WORKER} weights": [tree(without=(SHARDS[0],)), tree()],
           f"{WORKER} copies": [set()]}, results=_daemon(1)),
    _case("the source lost its tree: refused", READS[:1], {f"{HEAD} weights": [ABSENT]},
          raises=f"the weights are not present on the source head at {SRC}"),
    _case("a source tree with a link leading out: refused, naming it", READS[:1],
          {f"{HEAD} weights": [tree(SRC, extra=(f"E\t{OUT}",))]},
          raises="has 1 link\\(s\\) leading out of it: snapshots/.*/leak.json -> /home/spark/.ssh/id_ed25519 "
                 "\\(outside the tree: /home/spark/.ssh/id_ed25519\\). Refusing to sync"),
    _case("a partial listing of the source: refused", READS[:1],
          {f"{HEAD} weights": [tree(SRC, ended=False)]},
          raises="not fully listed \\(the listing ended early\\): refusing to sync from a partial view"),
    _case("a target tree with a link leading out: no copy into it", READS,
          {f"{HEAD} weights": [tree(SRC)], f"{WORKER} weights": [tree(without=(SHARDS[0],),
                                                                       extra=(f"E\t{OUT}",))]},
          raises="leading out of it.*\\(a copy into it could be led out of the tree\\)"),
    _case("over ssh: the target's key trusted on the source, rsync over the hop",
          [*READS, LEDGER, STAGE, "report weights.start", f"start {BOUND_SRC}",
           f"start {BOUND_DST}",
           f"run {HEAD} sh -c 'umask 077 && mkdir -p \"$HOME/.ssh\" && cat > \"$HOME/.ssh/$0\"' "
           f"spark-reconciler_fabric_known_hosts_{WORKER}", *_streams(4, ssh=True), PLACE, LINKS,
           f"run {WORKER} sync -f {DST}", f"read {WORKER} weights", f"stop end {BOUND_DST}",
           f"stop end {BOUND_SRC}", "report weights.done", LEDGER], FRESH, desired=over_ssh),
    _case("no page-cache bound asked: no helper beside the copy",
          [line for line in copied() if "drop_behind" not in line], FRESH, results=_daemon(), desired=unbounded),
    _case("the target's disk fills: the daemon closed, what is missing and what is free said",
          [*copied()[:copied().index(f"stop finish {daemon(4)}")], f"stop close {daemon(4)}",
           f"read {WORKER} df {DST}", f"read {WORKER} weights"],
          {**FRESH, f"{WORKER} df {DST}": [Raw("    Avail\n1048576")],
           f"{WORKER} weights": [ABSENT, tree(without=(SHARDS[0], SHARDS[1]))]},
          results={**_daemon(), rsync(0).removeprefix("run "): [NO_SPACE]},
          raises="worker1: no space left on the filesystem of .*: 33555248 bytes still to copy, 1048576 bytes "
                 "available; partial data kept in .rsync-partial for resume"),
    _case("a failed stream fails the copy once all ended, with rsync's words",
          [*copied()[:copied().index(f"stop finish {daemon(4)}")], f"stop close {daemon(4)}"], FRESH,
          results={**_daemon(), rsync(2).removeprefix("run "): [Result("", "rsync error: some files could not be "
                                                                              "transferred (code 23)", 23)]},
          raises="rsync to worker1 failed \\(exit 23\\): rsync error: some files could not be transferred"),
    _case("the rsync daemon does not start: nothing copied",
          [*copied()[:copied().index(f"start {daemon(4)}") + 1], f"stop finish {daemon(4)}"], FRESH,
          results=_daemon(said=Result("", "rsync 3.0.9 cannot be confined (needs 3.1.0)", 3)),
          raises="the rsync daemon on worker1 did not start \\(exit 3\\): rsync 3.0.9 cannot be confined"),
    _case("the daemon ended badly although the clients succeeded: failed",
          copied()[:copied().index(f"stop finish {daemon(4)}") + 1], FRESH,
          results=_daemon(said=Result(SECRET_LINE, "daemon 2 exited 12", 1)),
          raises="the rsync daemon on worker1 ended with exit 1: daemon 2 exited 12"),
    _case("a stranger knocked at the daemon: refused there, said here, the copy stands",
          [*(c := copied())[:c.index(PLACE)], "report weights.refused", *c[c.index(PLACE):]], FRESH,
          results=_daemon(said=Result(SECRET_LINE, "refused a connection from 10.232.0.99 (1 refused)\n", 0))),
    _case("the page-cache bound cannot start on the target: no copy",
          [*copied()[:copied().index(f"start {BOUND_DST}") + 1], f"stop finish {BOUND_DST}"], FRESH,
          results={f"start {BOUND_DST}": [Result("", "python3: not found", 127)]},
          raises="the page-cache bound for the copy could not start on worker1 \\(exit 127\\): python3: not "
                 "found; it needs python3 there"),
    _case("a bound that ended badly is said, the copy stands",
          [*(c := copied())[:c.index("report weights.done")], "report weights.drop-behind-ended",
           *c[c.index("report weights.done"):]], FRESH,
          results={**_daemon(), f"start {BOUND_SRC}": [Result("ready\n", "posix_fadvise: EBADF", 1)]}),
    _case("the links cannot be made: failed", copied()[:copied().index(LINKS) + 1], FRESH,
          results={**_daemon(), LINKS.removeprefix("run "): [Result("", "snapshots/x -> y: a directory is there",
                                                                    1)]},
          raises="making the model's links on worker1 failed \\(exit 1\\): snapshots/x -> y: a directory"),
    _case("after rsync the target still differs: failed",
          copied()[:copied().index(f"read {WORKER} weights", 2) + 1],
          {f"{HEAD} weights": [tree(SRC)], f"{WORKER} weights": [ABSENT, tree(without=(SHARDS[3],))]},
          results=_daemon(), raises="after rsync, the weights on worker1 still differ from head"),
    _case("after rsync a link leading out is in the target's tree: failed",
          copied()[:copied().index(f"read {WORKER} weights", 2) + 1],
          {f"{HEAD} weights": [tree(SRC)], f"{WORKER} weights": [ABSENT, tree(extra=(f"E\t{OUT}",))]},
          results=_daemon(), raises="holds link\\(s\\) leading out of it, not made by the reconciler"),
    _case("a copy resumed: its `started` line read from the ledger as the node wrote it", copied(1, fresh=False),
          {f"{HEAD} weights": [tree(SRC)], f"{WORKER} weights": [tree(without=(SHARDS[0],)), tree()],
           f"{WORKER} copies": [Raw(f"copied\t{WORKER}\tweights\t/elsewhere\t1764000000\t{BY}\t{'0' * 64}\n"
                                    f"started\t{WORKER}\tweights\t{DST}\t1764000000\t{BY}\t-\n")]},
          results=_daemon(1)),
    _case("a `started` line of another node, or of another cluster, does not make the copy ours",
          copied(1, fresh=False)[:-1],
          {f"{HEAD} weights": [tree(SRC)], f"{WORKER} weights": [tree(without=(SHARDS[0],)), tree()],
           f"{WORKER} copies": [Raw(f"started\tworker2\tweights\t{DST}\t1764000000\t{BY}\t-\n"
                                    f"started\t{WORKER}\tweights\t{DST}\t1764000000\t10.9.9.9:22\t-\n")]},
          results=_daemon(1)),
    _case("a failed stream says the last 800 characters of rsync's words",
          [*copied()[:copied().index(f"stop finish {daemon(4)}")], f"stop close {daemon(4)}"], FRESH,
          results={**_daemon(), rsync(1).removeprefix("run "): [Result("", "y" + "x" * 800, 23)]},
          raises="rsync to worker1 failed \\(exit 23\\): x{800}$"),
    _case("policy.weights.bandwidth_limit: each stream capped, in KiB/s",
          [line.replace("--address=10.232.0.10", "--address=10.232.0.10 --bwlimit=512000") for line in copied()],
          FRESH, results=_daemon(), desired=lambda: _policy(recorded(), bandwidth_limit=500 * 2**20)),
    _case("over ssh, a failed stream fails the copy: no daemon to close",
          [*READS, LEDGER, STAGE, "report weights.start", f"start {BOUND_SRC}",
           f"start {BOUND_DST}",
           f"run {HEAD} sh -c 'umask 077 && mkdir -p \"$HOME/.ssh\" && cat > \"$HOME/.ssh/$0\"' "
           f"spark-reconciler_fabric_known_hosts_{WORKER}", *_streams(4, ssh=True)], FRESH, desired=over_ssh,
          results={rsync(3, ssh=True).removeprefix("run "): [Result("", "rsync: connection unexpectedly closed", 12)]},
          raises="rsync to worker1 failed \\(exit 12\\): rsync: connection unexpectedly closed$"),
]

CASES += [
    _case("a partial listing of the source: the refusal names the source and its tree", READS[:1],
          {f"{HEAD} weights": [tree(SRC, ended=False)]},
          raises=f"^the weights tree on head at {SRC} is not fully listed"),
    _case("a target tree with a link leading out: the refusal names the target and its tree", READS,
          {f"{HEAD} weights": [tree(SRC)], f"{WORKER} weights": [tree(without=(SHARDS[0],),
                                                                       extra=(f"E\t{OUT}",))]},
          raises=f"^the weights tree on worker1 at {DST} has 1 link"),
    _case("after rsync the target's listing ends early: failed, saying it is not fully listed",
          copied()[:copied().index(f"read {WORKER} weights", 2) + 1],
          {f"{HEAD} weights": [tree(SRC)], f"{WORKER} weights": [ABSENT, tree(ended=False)]},
          results=_daemon(), raises=f"^after rsync, the weights tree on worker1 at {DST} is not fully listed "
                                    "\\(the listing ended early\\)$"),
    _case("the links cannot be made: the last 800 characters of the helper's words",
          copied()[:copied().index(LINKS) + 1], FRESH,
          results={**_daemon(), LINKS.removeprefix("run "): [Result("", "y" + "z" * 800, 1)]},
          raises="failed \\(exit 1\\): z{800}$"),
    replace(_case("the copy's `sync -f` is bounded by the copy's own deadline", copied(), FRESH,
                  results=_daemon()), timeouts={f"{WORKER} sync -f {DST}": 43200.0}),
    _case("the target's staging directory cannot be made (a link on its way): nothing copied",
          [*READS, LEDGER, STAGE, f"stop finish {RECEIVE}"], FRESH,
          results={f"start {RECEIVE}": [Result("", f"{DST}/.rsync-partial/staged: [Errno 40] Too many levels of "
                                                   "symbolic links (a link or a file on the way? remove it)", 1)]},
          raises=f"the copy's staging directory {DST}/.rsync-partial/staged on worker1 could not be made \\(exit "
                 "1\\): .*Too many levels of symbolic links"),
    _case("the source's tree changed after the check (issue 53): the daemon closed, the change named",
          [*copied()[:copied().index(f"stop finish {daemon(4)}")], f"stop close {daemon(4)}"], FRESH,
          results={**_daemon(), rsync(1).removeprefix("run "): [Result(
              "", f"{SRC}/blobs/x: no longer a regular file (a link now?) though the listing checked one\n", 65)]},
          raises="the source's tree changed after it was checked, so what changed was not sent to worker1 .*"
                 "blobs/x: no longer a regular file"),
    _case("a file that did not arrive: the copy fails naming it, before any link is made",
          copied()[:copied().index(PLACE) + 1], FRESH,
          results={**_daemon(), f"start {RECEIVE}": [Result(
              "ready\nplaced 11\n", "blobs/x (copied as .rsync-partial/staged/10/x): it did not arrive\n", 1)]},
          raises="moving the copied files into place on worker1 failed \\(exit 1\\): blobs/x .*it did not arrive"),
]
