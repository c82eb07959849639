"""The runbook's fenced blocks and their marks: who runs each block, where, and whether the runbook test runs it.

A block is marked in its info string (GitHub highlights by the first word and ignores the rest)::

    ```sh {user=root node=head run}

or, where the info string must stay one word (a YAML block other tests read as ```` ```yaml ````), by its first
line, a comment::

    ```yaml
    # {user=root node=both file=/etc/netplan/40-cx7.yaml} ...

Attributes: `user` (root, spark, admin: your own account with sudo, any), `node` (head, worker, both, any,
dev: the machine you develop on),
`run` (tests/e2e/test_runbook.py runs it, in order, as `user` on `node`), `skip="why"` (on the path, but the
testbed cannot run it: the test runs the equivalent its docstring lists, or nothing), `exit=N` (the status the
block ends with when all is well; default 0), `vars` (the block of example values: the test replaces them with
the testbed's), `id=NAME` (for the test to find a block).
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

USERS = {"root", "spark", "admin", "any"}
NODES = {"head", "worker", "both", "any", "dev"}
#: Languages the test can run a block in.
RUNNABLE_LANGS = {"sh", "bash"}

_FENCE = re.compile(r"^(?P<indent> {0,3})(?P<fence>`{3,}|~{3,})(?P<info>.*)$")
_MARK = re.compile(r"\{(?P<attrs>[^{}]*)\}")
_COMMENT_MARK = re.compile(r"^\s*(?:#|//|<!--)\s*\{(?P<attrs>[^{}]*)\}")
_ASSIGN = re.compile(r"^(?P<name>[A-Z_][A-Z0-9_]*)=(?P<value>\S*)")


@dataclass(frozen=True)
class Block:
    path: Path
    line: int                    # the opening fence's line, 1-based
    lang: str
    attrs: dict[str, str | bool]
    text: str                    # the body, without the fences
    marked: bool                 # a {user=... node=...} mark was found

    @property
    def user(self) -> str:
        return str(self.attrs.get("user", ""))

    @property
    def node(self) -> str:
        return str(self.attrs.get("node", ""))

    @property
    def runnable(self) -> bool:
        return self.attrs.get("run") is True

    @property
    def skip(self) -> str | None:
        value = self.attrs.get("skip")
        return None if value is None else str(value)

    @property
    def expected_exit(self) -> int:
        return int(self.attrs.get("exit", 0))

    @property
    def where(self) -> str:
        return f"{self.path.name}:{self.line}"

    def variables(self) -> dict[str, str]:
        """`NAME=value` lines of a `vars` block, in order (the value as the shell would read it)."""
        out = {}
        for line in self.text.splitlines():
            m = _ASSIGN.match(line.strip())
            if m:
                words = shlex.split(m.group("value"), comments=True)
                out[m.group("name")] = words[0] if words else ""
        return out


def _attrs(text: str) -> dict[str, str | bool]:
    out: dict[str, str | bool] = {}
    for word in shlex.split(text):
        key, eq, value = word.partition("=")
        out[key] = value if eq else True
    return out


def blocks(path: Path) -> list[Block]:
    """Every fenced block of a Markdown file, in order."""
    lines = path.read_text().splitlines()
    out: list[Block] = []
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m or (m.group("fence")[0] == "`" and "`" in m.group("info")):
            i += 1
            continue
        fence, info = m.group("fence"), m.group("info").strip()
        start = i
        body: list[str] = []
        i += 1
        while i < len(lines) and not re.match(rf"^ {{0,3}}{re.escape(fence[0])}{{{len(fence)},}}\s*$", lines[i]):
            body.append(lines[i])
            i += 1
        i += 1
        lang = info.split(None, 1)[0] if info else ""
        mark = _MARK.search(info)
        if mark is None and body:
            mark = _COMMENT_MARK.match(body[0])
        attrs = _attrs(mark.group("attrs")) if mark else {}
        out.append(Block(path, start + 1, lang, attrs, "\n".join(body) + "\n", mark is not None))
    return out


def problems(block: Block) -> list[str]:
    """What is wrong with a block's mark (empty: nothing)."""
    if not block.marked:
        return [f"{block.where}: ```{block.lang} block without a {{user=... node=...}} mark"]
    out = []
    if block.user not in USERS:
        out.append(f"{block.where}: user={block.user or '(none)'}, not one of {sorted(USERS)}")
    if block.node not in NODES:
        out.append(f"{block.where}: node={block.node or '(none)'}, not one of {sorted(NODES)}")
    if block.runnable and block.lang not in RUNNABLE_LANGS:
        out.append(f"{block.where}: marked run, but ```{block.lang} is not one of {sorted(RUNNABLE_LANGS)}")
    if block.runnable and block.skip is not None:
        out.append(f"{block.where}: marked both run and skip")
    if block.skip == "" or block.attrs.get("skip") is True:
        out.append(f"{block.where}: skip without a reason (skip=\"why\")")
    if block.runnable and (block.user == "any" or block.node in ("any", "dev")):
        out.append(f"{block.where}: a runnable block names one user and head, worker or both")
    unknown = set(block.attrs) - {"user", "node", "run", "skip", "exit", "vars", "id", "file"}
    if unknown:
        out.append(f"{block.where}: unknown attributes {sorted(unknown)}")
    return out
