"""The copy ledger: what this cluster copied to a node, kept on that node, so retention removes only that.

A line is appended to the SSH user's `~/.spark-reconciler/copies` (the 0700 directory of the lease) after every
verified copy (`copied`), before every serving start with a copy (`served`: the last use orders what a rollback
needs), and after every removal (`removed`). Appending is one `printf >>` of one short line: O_APPEND keeps
concurrent writers' lines whole, and a line cut short by a crash does not parse and is skipped, which can only
keep a copy longer, never remove one. It lives on the node because the node is what it describes: a copy made by
`reconciler apply` from a laptop and one made by the daemon are recorded in the same place, and a node that is
reinstalled loses its ledger together with what it recorded. Each line names the node (as the file does): a
home shared between nodes (NFS, or the testbed's one filesystem) holds one ledger for all, and each node reads
only its own lines; a node renamed in the file leaves its old lines to no one, which only keeps those copies.
A line's key is a claim, not a fact: whoever can write the file can name any absolute path in it, so retention
acts only on a key where the file keeps its models (`core.retention.out_of_reach`), whatever its digest says.

    copied	worker	weights	/models/qwen	1764000000	10.0.0.1:22	<tree digest>
    copied	worker	image	sha256:<content>	1764000000	10.0.0.1:22	sha256:<id on the node>
    served	worker	weights	/models/qwen	1764000100	10.0.0.1:22	-
    removed	worker	image	sha256:<content>	1764000200	10.0.0.1:22	-
"""

from __future__ import annotations

import re

from reconciler.core.observed import CopyRecord
from reconciler.edge.facts.base import Fact, Section, node_output
from reconciler.edge.ssh import quote

LEDGER = ".spark-reconciler/copies"  # under the SSH user's home, beside the lease
MAX_LINES = 5000  # the newest lines the probe reads: years of model changes

_KEY = {"weights": re.compile(r"/[A-Za-z0-9._+@/-]{0,4095}"), "image": re.compile(r"sha256:[0-9a-f]{64}")}
_DETAIL = {"weights": re.compile(r"[0-9a-f]{64}"), "image": re.compile(r"sha256:[0-9a-f]{64}")}
_AT = re.compile(r"[0-9]{1,12}")  # the node's clock in seconds (str.isdigit would take "²", which int() refuses)
_BY = re.compile(r"[A-Za-z0-9._:%\[\]-]{1,300}")
# started: a copy into a tree that did not exist began (a copy resumed later is still this cluster's);
# released: kept, and no longer retention's to remove
_ACTIONS = ("started", "copied", "served", "removed", "released")
_NODE = re.compile(r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?")  # spec's NodeName


def ledger_script() -> list[str]:
    """The `copies` section: the newest MAX_LINES lines of the ledger (none yet: empty)."""
    return ["sec copies", f'tail -n {MAX_LINES} "$HOME/{LEDGER}" 2>/dev/null; rc 0']


def _newest(body: str) -> list[str]:
    """The section's last MAX_LINES lines, what the node's `tail -n` lets through; what comes before them is never
    split into lines. A node that runs no `tail` sent 240,000 lines (27 MiB, under both of the command's caps): as
    many records, a 383 MiB peak (issue 53)."""
    end = len(body)
    while end and body[end - 1] == "\n":
        end -= 1
    start = end
    for _ in range(MAX_LINES):
        start = body.rfind("\n", 0, start)
        if start < 0:
            break
    return body[start + 1:end].splitlines()[-MAX_LINES:]


def _line(raw: str, node: str) -> tuple[str, str, str, int, str, str] | None:
    """One ledger line of `node`, or None when it is another node's or does not parse (cut short, edited by
    hand): skipped, never guessed."""
    fields = raw.split("\t")
    if len(fields) != 7 or fields[1] != node:
        return None
    action, _, kind, key, at, by, detail = fields
    if action not in _ACTIONS or kind not in _KEY or not _KEY[kind].fullmatch(key) or not _AT.fullmatch(at) \
            or not _BY.fullmatch(by) or ".." in key.split("/"):
        return None
    if action == "copied" and not _DETAIL[kind].fullmatch(detail):
        return None
    return action, kind, key, int(at), by, detail


@node_output("copies")
def parse_copies(sec: Section | None, node: str) -> list[CopyRecord] | None:
    """`node`'s lines of the ledger folded per (kind, key): what is copied and not removed since, with its last
    use."""
    if sec is None:
        return None
    records: dict[tuple[str, str], CopyRecord] = {}
    for raw in _newest(sec.body):
        if (line := _line(raw, node)) is None:
            continue
        action, kind, key, at, by, detail = line
        known = records.get((kind, key))
        if action == "started":
            continue
        if action in ("removed", "released"):
            records.pop((kind, key), None)
        elif action == "copied":
            records[(kind, key)] = CopyRecord(kind=kind, key=key, detail=detail, by=by,
                                              copied_at=at, used_at=max(at, known.used_at if known else 0))
        elif known is not None:
            records[(kind, key)] = known.model_copy(update={"used_at": max(at, known.used_at)})
    return sorted(records.values(), key=lambda r: (r.kind, r.key))


def started(sec: Section | None, node: str, by: str) -> set[str]:
    """The weights trees whose copy `by` began on `node` into a tree that did not exist: a copy interrupted and
    resumed later (rsync keeps its partial data) is still this cluster's."""
    if sec is None:
        return set()
    out = set()
    for raw in _newest(sec.body):
        line = _line(raw, node)
        if line is not None and line[0] == "started" and line[1] == "weights" and line[4] == by:
            out.add(line[2])
    return out


Entry = tuple[str, str, str, str]  # action, kind, key, detail ("-" unless `copied`)


def _valid(node: str, by: str, entry: Entry) -> bool:
    action, kind, key, detail = entry
    return (action in _ACTIONS and bool(_NODE.fullmatch(node)) and kind in _KEY and bool(_KEY[kind].fullmatch(key))
            and bool(_BY.fullmatch(by)) and (action != "copied" or bool(_DETAIL[kind].fullmatch(detail))))


def append(node: str, by: str, entries: list[Entry]) -> tuple[tuple[str, ...], bytes]:
    """The one command that appends lines, as (argv, stdin): a script fed to `sh -s`, stamped with the node's clock
    (the ledger's times are only ever compared on that node). Every value is checked here, the one writer, so
    nothing that would not parse back is written: ValueError otherwise."""
    if bad := [e for e in entries if not _valid(node, by, e)]:
        raise ValueError(f"not a ledger line: {node!r} {by!r} {bad[0][:3]!r}")
    script = ('umask 077; d="$HOME/.spark-reconciler"; mkdir -p "$d" || exit 70; now=$(date +%s); node=$1 by=$2; '
              'shift 2; while [ $# -ge 4 ]; do '
              'printf \'%s\\t%s\\t%s\\t%s\\t%s\\t%s\\t%s\\n\' "$1" "$node" "$2" "$3" "$now" "$by" "$4"; shift 4; '
              f'done >> "$HOME/{LEDGER}"')
    args = quote([node, by, *(word for entry in entries for word in entry)])
    return ("sh", "-s"), f"set -- {args}\n{script}\n".encode()


def copies_fact(node: str) -> Fact[list[CopyRecord] | None]:
    """`node`'s ledger as it is now (`ledger_script`, `parse_copies`): what a step re-reads before it removes."""
    return Fact("copies", tuple(ledger_script()), lambda sections: parse_copies(sections.get("copies"), node))


def started_fact(node: str, by: str) -> Fact[set[str]]:
    """The weights trees whose copy `by` began on `node` (its `started` lines: `started`): the weights step's read
    of the ledger, as `copies_fact` is retention's."""
    return Fact("copies", tuple(ledger_script()),
                lambda sections: started(sections.get("copies"), node, by))
