"""`reconciler status` on the operator's screen: the daemon's answer (fetched and proven by
reconciler/edge/status_client.py) judged to be a status document and drawn at the terminal's width
(status_view.py), once, or under `--watch` asked again and redrawn until Ctrl-C or SIGTERM, as `kubectl get -w` and
`watch` do.

Exit codes (reconciler/core/exits.py): 0 converged, 2 not converged (any other phase), 1 an answer that is not
the daemon's status (not provably from the daemon of the state dir, not a status document, not JSON), 5 nobody
answered (connection refused, timed out). Under `--watch`, the code of the last frame drawn.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TextIO

from rich.console import Console, Group
from rich.live import Live
from rich.text import Text

from reconciler.cli.status_view import human_duration, status_text
from reconciler.core.exits import Exit
from reconciler.core.text import printable
from reconciler.edge.status_client import StatusError, fetch, read_key, status_url

DEFAULT_WIDTH = 80  # not a terminal and no COLUMNS: what a pipe, a log or a CI job gets


def render(where: str, doc: object, width: int, now: float, wide: bool = False) -> str:
    """The status as text, or StatusError (ERROR) saying the answer is not a status document: whatever listens
    there (an older or newer daemon, another program on the port) may answer any JSON. The renderer is the one
    reader of the document's shape, so a document it cannot read is not one; `--json` is judged the same way."""
    if not (isinstance(doc, dict) and isinstance(doc.get("phase"), str)):
        why = "no phase"
    elif _deeper_than(doc, MAX_DEPTH):
        why = f"nested deeper than {MAX_DEPTH}"
    else:
        try:
            return status_text(doc, width, now, wide)
        except (KeyError, TypeError, AttributeError, ValueError, IndexError, OverflowError) as exc:
            why = f"{type(exc).__name__}: {exc}"
    raise StatusError(f"{where} did not answer a reconciler status document ({why}); is it this cluster's daemon "
                      "(policy.listen)? docs/cli.md shows the document", Exit.ERROR)


#: Levels a status document may nest (its own reach 5). JSON parses up to ~995, but a field that deep once crashed
#: the renderer, and `--watch --json` writing it back, with a RecursionError (issue 53, found by fuzzing).
MAX_DEPTH = 32


def _deeper_than(doc: object, levels: int) -> bool:
    """Whether `doc` nests lists or objects more than `levels` deep (walked without recursion)."""
    stack = [(doc, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict | list):
            if depth > levels:
                return True
            stack.extend((child, depth + 1) for child in (node.values() if isinstance(node, dict) else node))
    return False


def code_of(doc: dict[str, Any]) -> Exit:
    return Exit.OK if doc.get("phase") == "Converged" else Exit.CHANGES


def terminal_width(stream: TextIO) -> int:
    """The terminal's width as rich measures it (and follows when it changes); not a terminal: COLUMNS, else 80,
    never the width of a terminal the output is not going to."""
    if stream.isatty():
        return Console(file=stream).width
    columns = os.environ.get("COLUMNS", "")
    return int(columns) if columns.isdigit() and int(columns) > 0 else DEFAULT_WIDTH


def show(url: str, state_dir: Path, *, as_json: bool = False, wide: bool = False, watch: bool = False,
         interval: float = 2.0) -> int:
    """`reconciler status`: the exit code (module docstring)."""
    key, unverified = read_key(state_dir)
    if unverified:
        print(printable(unverified), file=sys.stderr)
    if watch:
        return Watch(url, key, state_dir, wide=wide, as_json=as_json).run(interval)
    try:
        doc = fetch(url, key, state_dir)
        text = render(status_url(url), doc, terminal_width(sys.stdout), time.time(), wide)
    except StatusError as exc:
        print(printable(exc.message), file=sys.stderr)
        return exc.code
    assert isinstance(doc, dict)  # render() read it
    sys.stdout.write(f"{json.dumps(doc, indent=2)}\n" if as_json else text)
    return code_of(doc)


class Watch:
    """`--watch`: a frame per interval, redrawn in place on a terminal (rich's Live, at the terminal's width of
    the moment) or appended elsewhere; with `--json`, one document per line. A daemon that stops answering is
    said in the frame, above its last answer, and asked again at the next interval."""

    def __init__(self, url: str, key: bytes | None, state_dir: Path, *, wide: bool, as_json: bool) -> None:
        self.url, self.key, self.state_dir, self.wide, self.as_json = url, key, state_dir, wide, as_json
        self.last: tuple[dict[str, Any], float] | None = None  # the last good answer and when it came
        self.code = Exit.UNREACHABLE  # until a frame says otherwise

    def run(self, interval: float) -> int:
        tty = sys.stdout.isatty() and not self.as_json
        console = Console(highlight=False, markup=False, emoji=False,
                          width=None if tty else terminal_width(sys.stdout))
        screen = Live(console=console, auto_refresh=False, redirect_stderr=False,
                      vertical_overflow="ellipsis") if tty else None
        with contextlib.suppress(KeyboardInterrupt), sigterm_interrupts(), screen or contextlib.nullcontext():
            while True:
                due = time.monotonic() + interval
                self.draw(screen, console, interval)
                time.sleep(max(0.0, due - time.monotonic()))
        return self.code

    def draw(self, screen: Live | None, console: Console, interval: float) -> None:
        if self.as_json:
            self.json_line()
        elif screen is not None:  # redrawn in place, at the width of the moment (a resized terminal follows)
            screen.update(self.frame(interval, console.width), refresh=True)
        else:
            console.print(self.frame(interval, console.width), Text(""))

    def ask(self, width: int, now: float) -> str:
        """One answer, rendered; remembered as the last good one. StatusError when there is none."""
        doc = fetch(self.url, self.key, self.state_dir)
        text = render(status_url(self.url), doc, width, now, self.wide)
        assert isinstance(doc, dict)  # render() read it
        self.last, self.code = (doc, now), code_of(doc)
        return text

    def frame(self, interval: float, width: int) -> Group:
        now = time.time()
        head = Text(printable(f"every {interval:g}s: reconciler status {self.url}   "
                              f"{time.strftime('%H:%M:%S', time.localtime(now))}   Ctrl-C stops"),
                    no_wrap=True, overflow="ellipsis")
        try:
            return Group(head, Text(""), Text(self.ask(width, now)))
        except StatusError as exc:
            self.code = exc.code
            said = Text(printable(f"{exc.message} (asking again every {interval:g}s)"), overflow="fold")
            if self.last is None:
                return Group(head, Text(""), said)
            doc, when = self.last
            before = render(status_url(self.url), doc, width, now, self.wide)
            return Group(head, Text(""), said, Text(""),
                         Text(f"its last answer, {human_duration(now - when)} ago:"), Text(""), Text(before))

    def json_line(self) -> None:
        """`--watch --json`: each answer as one line of JSON (jq reads the stream); why not, on stderr."""
        try:
            self.ask(DEFAULT_WIDTH, time.time())
        except StatusError as exc:
            self.code = exc.code
            print(printable(exc.message), file=sys.stderr, flush=True)
            return
        assert self.last is not None
        print(json.dumps(self.last[0]), flush=True)


@contextlib.contextmanager
def sigterm_interrupts() -> Iterator[None]:
    """SIGTERM ends the watch as Ctrl-C does (the terminal's cursor restored, the last frame kept)."""
    def interrupt(_signum: int, _frame: object) -> None:
        raise KeyboardInterrupt

    before = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)
