"""`reconciler status` drawn as kubectl draws a resource: a summary line, then NODES, CONDITIONS (with their age),
OPERATIONS (with their progress) and BLOCKERS, each a borderless table fitted to the terminal's width.

Pure: the daemon's /status document (reconciler/loop/status.py, docs/cli.md), the width and the moment in, text
out; reconciler/edge/status_client.py fetches the document and status_screen.py asks the terminal. rich lays the
tables out at the width given, so no line is wider than the terminal: the default form keeps one line per row and
ends a cell that does not fit with an ellipsis; `wide` (kubectl's `describe`) shows every condition and wraps long
messages at word boundaries. Every value is a rich `Text` of `printable` text, never markup: messages come from the
nodes and hold `[/rank0]`, escape sequences and line breaks (tests/unit/edge/test_hostile_text.py).

The renderer is the one reader of the document's shape: a document it cannot read raises (KeyError, TypeError,
ValueError...), and status_screen.py says the answer is not a status document.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from io import StringIO
from typing import Any

from rich.cells import cell_len
from rich.console import Console
from rich.padding import Padding
from rich.table import Table
from rich.text import Text

from reconciler.core.text import printable

#: A JSON object of the /status document, as the daemon sent it: read field by field, trusted in nothing.
Doc = dict[str, Any]

#: Conditions whose True is the news (a step held, vLLM's queue full, a failed change rolled back); for every other
#: one, a status but True is.
TRUE_IS_NEWS = frozenset({"StepsHeld", "ServingBusy", "RolledBack"})

#: NODES: column -> the condition it summarizes and the word for its good status (else the condition's reason).
NODE_COLUMNS = (("GPU", "GpuReady", "ok"), ("FABRIC", "FabricLinkUp", "up"), ("WEIGHTS", "WeightsInSync", "in sync"),
                ("IMAGE", "ImageInSync", "in sync"), ("SERVING", "ServingRunning", "running"))

#: NODES says a condition's reason in a word, the column naming what (a reason not here is shown as it is).
SHORT = {"Unreachable": "no", "ProbeFailed": "probe failed", "DockerUnreachable": "no docker",
         "NotObserved": "not yet", "LinkDrift": "drift", "PortDegraded": "degraded", "WeightsDrift": "drift",
         "ImageDrift": "drift", "ServingDrift": "drift", "GpuStackFailing": "failing"}

GAP = 2  # spaces between columns (kubectl uses 3; two keep one more column inside 80)
INDENT = 4  # a message under its row (the wide form)


def human_duration(seconds: float) -> str:
    """A duration as kubectl prints an AGE (k8s.io/apimachinery/pkg/util/duration.HumanDuration): two or three
    significant figures, `45s`, `5m30s`, `12m`, `3h`, `2d5h`, `400d`; up to a second in the future is `0s` (two
    clocks), more is `<invalid>`."""
    whole = int(seconds)  # towards zero, as Go's int(d.Seconds())
    if whole < -1:
        return "<invalid>"
    if whole < 120:
        return f"{max(whole, 0)}s"
    minutes = whole // 60
    if minutes < 10:
        return _pair(minutes, "m", whole % 60, "s")
    if minutes < 180:
        return f"{minutes}m"
    hours = minutes // 60
    if hours < 8:
        return _pair(hours, "h", minutes % 60, "m")
    return _days(hours)


def _days(hours: int) -> str:
    days, years = hours // 24, hours // (24 * 365)
    if hours < 48:
        return f"{hours}h"
    if hours < 24 * 8:
        return _pair(days, "d", hours % 24, "h")
    if hours < 24 * 365 * 2:
        return f"{days}d"
    if hours < 24 * 365 * 8:
        return _pair(years, "y", days % 365, "d")
    return f"{years}y"


def _pair(big: int, big_unit: str, small: int, small_unit: str) -> str:
    return f"{big}{big_unit}{small}{small_unit}" if small else f"{big}{big_unit}"


def since(timestamp: str | None, now: float) -> str:
    """The age of an RFC 3339 time (a condition's lastTransitionTime); `-` when the document has none."""
    if timestamp is None:
        return "-"
    return human_duration(now - datetime.fromisoformat(str(timestamp)).timestamp())


def size(count: float) -> str:
    """Bytes in binary units, as `du -h` and the operators' dashboards count them: `512 B`, `64.0 MiB`."""
    value = float(count)
    if abs(value) < 1024:
        return f"{value:.0f} B"
    for unit in ("KiB", "MiB", "GiB"):
        value /= 1024
        if abs(value) < 1024:
            return f"{value:.1f} {unit}"
    return f"{value / 1024:.1f} TiB"


def progress(op: Doc) -> str:
    """An operation's progress: bytes of the total, the percentage, the rate and the time left (the weight sync,
    the image copy); the stage, percent and detail a cold start reports (vLLM's own loading line); `-` when the
    step says nothing."""
    done, total, rate = op.get("bytesDone") or 0, op.get("bytesTotal"), op.get("bytesPerSecond")
    parts = []
    if total:
        parts.append(f"{size(done)} of {size(total)} ({100 * done / total:.0f}%)")
    elif done:
        parts.append(size(done))
    if rate:
        parts.append(f"{size(rate)}/s")
        if total and total > done:
            parts.append(f"~{human_duration((total - done) / rate)} left")
    stage, percent, detail = op.get("stage"), op.get("percent"), op.get("detail")
    if stage or percent is not None:
        parts.append(" ".join(str(p) for p in (stage, None if percent is None else f"{float(percent):.0f}%") if p))
    if detail:
        parts.append(str(detail))
    return ", ".join(parts) or "-"


def lines_of(value: object) -> list[str]:
    """A value's lines, each printable (a held step's message carries vLLM's log, one line per line)."""
    return [printable(line) for line in str(value).splitlines()] or [""]


@dataclass(frozen=True)
class Column:
    header: str
    flexible: bool = False  # takes the width left; the one column that wraps (wide) or shrinks first


class View:
    """One rendering: the console at the width asked, the form (compact or wide), the moment ages count to."""

    def __init__(self, width: int, now: float, wide: bool) -> None:
        self.out = StringIO()
        self.console = Console(file=self.out, width=width, height=10_000, force_terminal=False, color_system=None,
                               highlight=False, emoji=False, markup=False, legacy_windows=False, no_color=True)
        self.now, self.wide = now, wide

    def text(self, value: object) -> Text:
        """A message: all its lines in the wide form; its first line, marked `…` when more follow, in the
        compact one."""
        lines = lines_of(value)
        if self.wide or len(lines) == 1:
            return Text("\n".join(lines))
        return Text(f"{lines[0]} …")

    def table(self, title: str, columns: tuple[Column, ...], rows: Sequence[Sequence[object]]) -> None:
        """A borderless table under its title, one line per row. The flexible column (a message, a progress)
        takes the width the others leave and ends with `…` where it does not fit; in the wide form it is written
        under its row instead, indented and wrapped at word boundaries, as `kubectl describe` writes messages."""
        if not rows:
            return
        under = self.wide and columns[-1].flexible  # the flexible column is always the last one
        shown = columns[:-1] if under else columns
        table = Table(box=None, show_edge=False, pad_edge=False, padding=(0, GAP, 0, 0), collapse_padding=True,
                      expand=any(c.flexible for c in shown), show_header=True, header_style=None)
        for c in shown:
            table.add_column(c.header, ratio=1 if c.flexible else None, no_wrap=True, overflow="ellipsis")
        for row in rows:
            table.add_row(*(self.text(v) if c.flexible else Text(printable(str(v))) for c, v in zip(shown, row)))
        self.console.print()
        self.console.print(Text(title))
        if not under:
            self.console.print(table)
            return
        header, *lines = self.console.render_lines(table, self.console.options, pad=False)
        self.console.print(Text("".join(s.text for s in header)))
        for line, row in zip(lines, rows, strict=True):
            self.console.print(Text("".join(s.text for s in line)))
            if row[-1] not in ("", "-", None):
                self.console.print(Padding(self.text(row[-1]), (0, 0, 0, INDENT)), overflow="fold")

    def lines(self, words: list[str]) -> None:
        """Short `key value` items packed into lines of the width, never split across two (one longer than the
        width is wrapped at its own spaces)."""
        width, line = self.console.width, ""
        for item in (printable(w) for w in words):
            if line and cell_len(line) + 3 + cell_len(item) > width:
                self.console.print(Text(line))
                line = ""
            line = f"{line}   {item}" if line else item
        if line:
            self.console.print(Text(line))

    def rendered(self) -> str:
        return "".join(f"{line.rstrip()}\n" for line in self.out.getvalue().splitlines())


def status_text(doc: Doc, width: int, now: float, wide: bool = False) -> str:
    """`reconciler status` for the /status document `doc`, no line wider than `width`, ages counted to `now`
    (unix time). `wide`: every condition and every line of every message, wrapped at word boundaries."""
    view = View(width, now, wide)
    conditions = [condition(c) for c in doc.get("conditions", [])]
    view.lines(summary(doc, now))
    if doc.get("stateError"):
        view.lines([f"state dir not writable: {doc['stateError']}"])
    nodes_table(view, doc, conditions)
    conditions_table(view, conditions)
    view.table("OPERATIONS", (Column("STEP"), Column("STATE"), Column("AGE"), Column("DEADLINE"),
                              Column("PROGRESS", flexible=True)),
               [operation_row(o) for o in doc.get("operations") or []]
               + [verify_row(r, now) for r in doc.get("verifyRequests") or [] if r["state"] == "pending"])
    view.table("BLOCKERS", (Column("NODE"), Column("WHAT"), Column("WHY", flexible=True)), blockers(doc))
    last_error(view, doc)
    return view.rendered()


def operation_row(op: Doc) -> tuple[str, ...]:
    return (op["step"], op["state"], human_duration(float(op["seconds"])),
            f"in {human_duration(float(op['deadlineIn']))}", progress(op))


def verify_row(request: Doc, now: float) -> tuple[str, ...]:
    """A verify asked of the daemon that waits for its turn (a low-priority operation): since when, and why."""
    todo = ", ".join(map(str, request.get("todo") or []))
    why = request.get("waiting") or "waiting for its turn"
    return (f"verify/{todo or '-'}", "waiting", human_duration(now - float(request["requested"])), "-",
            f"{why} (request {request['id']})")


def condition(c: Doc) -> Doc:
    """A condition's fields, all read here: one without them is not a status document."""
    return {"node": c["node"], "type": c["type"], "status": c["status"], "reason": c["reason"],
            "message": c["message"], "lastTransitionTime": c.get("lastTransitionTime")}


def summary(doc: Doc, now: float) -> list[str]:
    """The header's items: phase, generations, when it last converged and last reconciled, the file, vLLM."""
    items = [f"phase {doc['phase']}"]
    if doc.get("generation") is not None:
        items.append(f"generation {doc['generation']} (observed {doc.get('observedGeneration')})")
    if "lastConverged" in doc:
        converged = doc["lastConverged"]
        items.append(f"converged {human_duration(now - float(converged))} ago" if converged else "converged never")
    if doc.get("time") is not None:
        items.append(f"reconciled {human_duration(now - float(doc['time']))} ago")
    mode = (doc.get("lastPlan") or {}).get("mode")
    if mode and mode != "enforce":
        items.append(f"mode {mode}")
    image = doc.get("image")
    if image:
        version = image.get("vllm_version") or ("asking the image" if image.get("pending") else "unknown")
        items.append(f"vLLM {version}")
    if doc.get("file"):
        items.append(f"file {doc['file']}")
    return items


def nodes_table(view: View, doc: Doc, conditions: list[Doc]) -> None:
    """One row per node: reachable (or why not), memory (short, as the plan's memory drift says), then each
    summarized condition's good word or its reason."""
    by = {(c["node"], c["type"]): c for c in conditions}
    short = {d["node"]: d["observed"] for d in doc.get("drift") or [] if d.get("kind") == "memory"}
    view.table("NODES", (Column("NODE"), Column("REACHABLE"), Column("MEMORY"),
                         *(Column(header) for header, _, _ in NODE_COLUMNS)),
               [node_row(node, by, short) for node in dict.fromkeys(c["node"] for c in conditions if c["node"])])


def node_row(node: str, by: dict[tuple[str, str], Doc], short: dict[str, str]) -> tuple[str, ...]:
    reached = by.get((node, "Reachable"))
    down = next((c for t in ("Reachable", "Probed", "DockerReachable")
                 if (c := by.get((node, t))) and c["status"] != "True"), None)
    if reached is None or down is not None:
        reachable, memory = ("-", "-") if down is None else (_short(down["reason"]), "unknown")
    else:
        reachable, memory = "yes", (f"short: {short[node]}" if node in short else "ok")
    serving = word(by.get((node, "ServingRunning")), "running")
    if (busy := by.get((node, "ServingBusy"))) and busy["status"] == "True":
        serving += ", busy"
    return (node, reachable, memory, *(word(by.get((node, t)), good) for _, t, good in NODE_COLUMNS[:-1]), serving)


def word(condition: Doc | None, good: str) -> str:
    if condition is None:
        return "-"
    status = condition["status"]
    if status == "True":
        return good
    return "unknown" if status == "Unknown" else _short(condition["reason"])


def _short(reason: str) -> str:
    return SHORT.get(reason, reason)


def is_news(condition: Doc) -> bool:
    """A node condition worth a row in the compact form: not as it should be (or True where True is the news)."""
    status: str = condition["status"]
    return (status == "True") == (condition["type"] in TRUE_IS_NEWS)


def conditions_table(view: View, conditions: list[Doc]) -> None:
    """The cluster's conditions, then the nodes' (compact: only those not as they should be, and how many are)."""
    shown = [c for c in conditions if view.wide or not c["node"] or is_news(c)]
    view.table("CONDITIONS", (Column("NODE"), Column("TYPE"), Column("STATUS"), Column("AGE"), Column("REASON"),
                              Column("MESSAGE", flexible=True)),
               [(c["node"] or "-", c["type"], c["status"], since(c.get("lastTransitionTime"), view.now), c["reason"],
                 c["message"] or "-") for c in shown])
    if hidden := len(conditions) - len(shown):
        view.lines([f"({hidden} more node conditions as they should be: --wide shows every one)"])


def blockers(doc: Doc) -> list[tuple[str, str, str]]:
    """What keeps the cluster from converging, as the document holds it: the plan's blockers, the steps in a
    hold (with their last error) and the drift only the operator can fix (a node unreachable, memory short)."""
    plan = doc.get("lastPlan") or {}
    rows = [(b["node"], "plan", b["reason"]) for b in plan.get("blocked") or []]
    rows += [(_node_of(step), f"held {step}", message) for step, message in (doc.get("held") or {}).items()]
    rows += [(d["node"], str(d["resource"]), f"expected {d['expected']}, observed {d['observed']}")
             for d in doc.get("drift") or [] if d.get("blocking")]
    return rows


def _node_of(step_id: str) -> str:
    """A step id's node (`kind/node[/...]`, reconciler.core.planning.Step.id); the whole id when it has none."""
    parts = str(step_id).split("/")
    return parts[1] if len(parts) > 1 else str(step_id)


def last_error(view: View, doc: Doc) -> None:
    """The last error under its title, indented like a message (a line of it cannot pass for a row), unless it
    is a held step's (BLOCKERS shows that one already)."""
    error = doc.get("lastError")
    held = {f"{step}: {message}" for step, message in (doc.get("held") or {}).items()}
    if error and error not in held:
        view.console.print()
        view.console.print(Text("LAST ERROR"))
        view.console.print(Padding(view.text(error), (0, 0, 0, INDENT)), overflow="fold")
