"""What every fact stands on: the `Fact` type (a shell fragment beside its parser), the sealed sections a
fragment prints (`sec NAME` ... `rc N`), the script they are joined into, and the one error a parser of node
output raises (`ProbeError`, via `node_output`).

Each fragment prints sections and each section fails on its own, so a dead docker engine still leaves the link
and memory observed. Every interpolated value is validated by spec and quoted by `ssh.quote`; every parser goes
through `node_output`, so odd bytes are one node's ProbeError, never a crash.
"""

from __future__ import annotations

import functools
import json
import re
import secrets
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any, Generic, ParamSpec, TypeVar

from reconciler.edge.ssh import ENDED_BY_TIMEOUT, CommandTimeout, Session, quote_word

P = ParamSpec("P")
R = TypeVar("R")


class ProbeError(Exception):
    """Output from a node that does not parse: the one error a parser of node output raises. It makes that node
    ProbeFailed (a per-node condition; its steps wait); it never ends a reconcile for the other nodes."""


def node_output(what: str) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """Decorate a parser of node output: whatever the bytes (missing fields, garbage, nesting, odd names), it
    returns a model or raises ProbeError naming `what` and why. Node output is untrusted input, so a parser bug or
    a hostile node is one node's condition, never a crash of the loop."""
    def wrap(parse: Callable[P, R]) -> Callable[P, R]:
        @functools.wraps(parse)
        def guarded(*args: P.args, **kwargs: P.kwargs) -> R:
            try:
                return parse(*args, **kwargs)
            except ProbeError:
                raise
            except Exception as exc:  # noqa: BLE001 - see the docstring: one typed error for any node bytes
                raise ProbeError(f"{what}: {type(exc).__name__}: {str(exc)[:200]}") from None
        return guarded
    return wrap


#: JSON values one document of node output may hold (`node_json`). `json.loads` builds the whole document, and a
#: value costs the daemon 30 to 90 bytes however few bytes spell it: 28.6 MiB of `{},` in the `containers` section
#: (under both of the command's caps) peaked at 724 MiB, above the unit's MemoryMax=512M (issue 53). The docker
#: API's list of a node's containers holds ~150 values per container; at the cap a document costs under 90 MiB.
MAX_JSON_VALUES = 1_000_000


def node_json(text: str, start: int = 0) -> Any:
    """`json.loads(text[start:])` of node output, refused (ValueError) past MAX_JSON_VALUES values before anything
    is built, not even the slice: counted from above by the characters that open or follow one (`[{,:`)."""
    if sum(text.count(c, start) for c in "[{,:") >= MAX_JSON_VALUES:
        raise ValueError(f"more than {MAX_JSON_VALUES} JSON values")
    try:
        return json.loads(text[start:] if start else text)
    except RecursionError:  # nested deeper than the interpreter's stack
        raise ValueError("JSON nested too deep") from None


@dataclass
class Section:
    body: str
    rc: int


# Sections are sealed: each marker line is `@@NONCE NAME` or `@@NONCE rc N`, the nonce fresh for each script and
# known only to the head and the shell reading the script on its stdin (in no argv, no file: `printf` is a builtin).
# Much of a section's body comes from elsewhere: the serving port's HTTP answers (whoever listens there), `ray
# status`, docker's JSON, file names. With a fixed `@@name`, a local user who bound the serving port while vLLM was
# down forged the head's containers, weights, links and memory (issue 31); without the nonce no line can close a
# section or open another.
# A section's name takes the prefix `$PFX` (`NAME/` while one deployment's fact runs, in a file of several:
# `Fact.prefix`; empty otherwise), so each deployment's `weights`, `health`, ... are its own.
SECTION_FUNCTION = ("sec() { printf '\\n%s %s%s\\n' \"$SEAL\" \"${PFX:-}\" \"$1\"; }; "
                    "rc() { printf '\\n%s rc %s\\n' \"$SEAL\" \"$1\"; }")


@dataclass(frozen=True)
class Sealed:
    """A script of fragments and the nonce its section markers carry."""

    script: str
    nonce: str

    def __repr__(self) -> str:  # the script may carry the API key's header
        return f"Sealed(nonce={self.nonce[:4]}...)"


def sealed(lines: list[str]) -> Sealed:
    """The fragments as one script for `sh -s`, its markers sealed with a fresh nonce."""
    nonce = secrets.token_hex(16)
    return Sealed("\n".join([f"SEAL=@@{nonce}", "export LC_ALL=C", SECTION_FUNCTION, *lines]) + "\n", nonce)


#: Where `str.splitlines` ends a line, besides "\n".
_LINE_BREAKS = re.compile("\r\n|[\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029]")
_LINE_END = re.compile("\r\n|[\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029]")
_NEWLINES = re.compile("\n*")


def each_line(text: str) -> Iterator[str]:
    """`text.splitlines()` one line at a time: a parser that stops at a bound never splits the rest (issue 53)."""
    start = 0
    for end in _LINE_END.finditer(text):
        yield text[start:end.start()]
        start = end.end()
    if start < len(text):
        yield text[start:]


def _stripped(text: str, start: int, end: int) -> str:
    """`text[start:end].strip("\n")`, copied once."""
    lead = _NEWLINES.match(text, start, end)
    start = lead.end() if lead else start
    while end > start and text[end - 1] == "\n":
        end -= 1
    return text[start:end]


@node_output("probe output")
def split_sections(output: str, nonce: str) -> dict[str, Section]:
    """The sections of a sealed script's output: only a line starting with `@@NONCE ` is a marker. The output's
    lines are `output.splitlines()`, and a body is its lines joined by "\\n"; each body is one slice of the output,
    never a list of its lines: a million 31-byte lines (30 MiB, under both of the command's caps) made a million
    strings and peaked at 123 MiB (issue 53), now at about the output's own size."""
    text = _LINE_BREAKS.sub("\n", output) if _LINE_BREAKS.search(output) else output
    marker = re.compile(f"^{re.escape(f'@@{nonce} ')}(.*)$", re.MULTILINE)
    sections: dict[str, Section] = {}
    name: str | None = None
    start = 0  # where the open section's body begins
    for line in marker.finditer(text):
        word = line[1].strip()
        if word.startswith("rc ") and name is not None:
            sections[name] = Section(_stripped(text, start, line.start()), int(word[3:].strip() or 1))
            name = None
        elif not word.startswith("rc "):
            name, start = word, line.end() + 1
    return sections


def read_sections(session: Session, lines: list[str], timeout: float) -> dict[str, Section]:
    """Run fragments on a node outside the probe (a step re-reading one fact right before it acts). Past the
    deadline this is CommandTimeout, as for any command a step runs (the probe instead reads what did arrive)."""
    script = sealed(lines)
    result = session.run_script(script.script, timeout=timeout)
    if result.exit_code in ENDED_BY_TIMEOUT:
        raise CommandTimeout(session.name, f"reading {', '.join(_section_names(lines))} did not finish within "
                                           f"{timeout:g}s (ended on the node)")
    return split_sections(result.stdout, script.nonce)


def _section_names(lines: list[str]) -> list[str]:
    return [line.split(" ", 1)[1] for line in lines if line.startswith("sec ")]


@dataclass(frozen=True)
class Fact(Generic[R]):
    """One fact of a node: its shell fragment (`lines`, printing sections) beside its parser (`parse`, those
    sections to a model), named by `key` (`container vllm`, the name the step cases in tests/unit/step_cases/
    give its recorded answer). The one kind of read there is: the probe (`observe`) joins a list of facts into
    one script and parses each fact's sections with its parser; a step re-reads one fact right before it acts
    (`read`), with the same fragment and parser; so a step and the plan can never read a node differently.

    `prefix` is the deployment's, for a fact one deployment of a file of several reads (its image, weights, API):
    its sections are then named `PREFIX` + name on the node (`SECTION_FUNCTION`'s `$PFX`), so each deployment's
    `weights` is its own, and its parser sees them under their plain names. Empty: the node's own facts, and every
    fact of a file of one deployment (its sections keep their plain names: the recorded probes read as before)."""

    key: str
    lines: tuple[str, ...] = field(repr=False)
    parse: Callable[[dict[str, Section]], R] = field(repr=False, compare=False)
    prefix: str = ""

    def under(self, prefix: str) -> Fact[R]:
        """This fact as read for the deployment whose sections take `prefix` (`NAME/`; "" for none)."""
        return replace(self, prefix=prefix)

    @property
    def script(self) -> tuple[str, ...]:
        """The fragment as it runs: under its prefix (set before it, cleared after) when it has one."""
        return (f"PFX={quote_word(self.prefix)}", *self.lines, "PFX=") if self.prefix else self.lines

    def value(self, sections: dict[str, Section]) -> R:
        """The fact parsed from a script's sections (its own: those under its prefix, the prefix taken off)."""
        if not self.prefix:
            return self.parse(sections)
        size = len(self.prefix)
        return self.parse({name[size:]: sec for name, sec in sections.items() if name.startswith(self.prefix)})

    def read(self, session: Session, timeout: float) -> R:
        """Run the fact's fragment on its own (a step's re-read right before it acts) and parse it."""
        return self.value(read_sections(session, list(self.script), timeout))
