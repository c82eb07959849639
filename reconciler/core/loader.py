"""Read a desired-state YAML file into plain Python data while remembering where every value came from.

Why not `yaml.safe_load`: it forgets positions, silently keeps the last of two duplicate keys and happily expands
an alias bomb into gigabytes. Here PyYAML only *composes* the node graph (which carries line/column marks); this
module builds the Python values itself, so it can refuse duplicates, cap the expanded size and hand
`reconciler.core.spec` a map from field path to position for its error messages.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

MAX_BYTES = 1024 * 1024
MAX_EXPANDED_NODES = 20_000
MAX_DEPTH = 64

Loc = tuple[str | int, ...]

# libyaml when present (it depends on the PyYAML build): composing is then ~10x faster.
_BaseLoader: Any = yaml.CSafeLoader if yaml.__with_libyaml__ else yaml.SafeLoader


@dataclass(frozen=True)
class Position:
    line: int  # 1-based
    column: int  # 1-based


@dataclass(frozen=True)
class Problem:
    """One thing wrong with the file, already placed: rendered as `FILE:LINE:COL: path: message`."""

    position: Position
    path: str
    message: str

    def render(self, filename: str) -> str:
        where = f"{filename}:{self.position.line}:{self.position.column}"
        return f"{where}: {self.path}: {self.message}" if self.path else f"{where}: {self.message}"


@dataclass
class Document:
    """The file's data plus where each value (and each mapping key) sits in the text."""

    data: Any
    ended: bool = True  # the text's last significant line is YAML's document end marker `...`
    text: str = ""  # the text itself, as read: a generation's history keeps it, comments and all
    value_positions: dict[Loc, Position] = field(default_factory=dict)
    key_positions: dict[Loc, Position] = field(default_factory=dict)

    def position_of(self, loc: Loc) -> Position:
        """Best position for an error at `loc`: the value itself, else its key, else the nearest parent."""
        for cut in range(len(loc), -1, -1):
            prefix = loc[:cut]
            if prefix in self.value_positions and cut == len(loc):
                return self.value_positions[prefix]
            if prefix in self.key_positions:
                return self.key_positions[prefix]
            if prefix in self.value_positions:
                return self.value_positions[prefix]
        return Position(1, 1)


class LoadError(Exception):
    """The file could not become data at all (too big, not UTF-8, not YAML, not a mapping, ...)."""

    def __init__(self, problems: list[Problem]):
        super().__init__("; ".join(p.message for p in problems))
        self.problems = problems


def _pos(mark: yaml.Mark) -> Position:
    return Position(mark.line + 1, mark.column + 1)


def _fail(mark: yaml.Mark | None, message: str, path: str = "") -> LoadError:
    return LoadError([Problem(_pos(mark) if mark else Position(1, 1), path, message)])


def format_loc(loc: Loc) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


_TIMESTAMP = "tag:yaml.org,2002:timestamp"
_PLAIN_TAGS = {f"tag:yaml.org,2002:{t}" for t in ("map", "seq", "str", "int", "float", "bool", "null")}


class _Builder:
    """Turns a composed node graph into dicts/lists/scalars, with a budget against alias expansion."""

    def __init__(self) -> None:
        self.doc = Document(data=None)
        self.budget = MAX_EXPANDED_NODES
        self._scalars = _BaseLoader("")

    def build(self, node: yaml.Node, loc: Loc) -> Any:
        if len(loc) > MAX_DEPTH:
            raise _fail(node.start_mark, f"nested deeper than {MAX_DEPTH} levels (a recursive alias?)",
                        format_loc(loc[:MAX_DEPTH]))
        self.budget -= 1
        if self.budget < 0:
            raise _fail(node.start_mark, f"document expands to more than {MAX_EXPANDED_NODES} values "
                        "(anchors/aliases used as a bomb?)", format_loc(loc))
        self.doc.value_positions.setdefault(loc, _pos(node.start_mark))
        if node.tag == _TIMESTAMP:
            return node.value  # a date-like scalar stays text; the model decides what it means
        if node.tag not in _PLAIN_TAGS:
            raise _fail(node.start_mark, f"YAML tag {node.tag!r} is not allowed in a desired state",
                        format_loc(loc))
        if isinstance(node, yaml.MappingNode):
            return self._mapping(node, loc)
        if isinstance(node, yaml.SequenceNode):
            return [self.build(item, loc + (i,)) for i, item in enumerate(node.value)]
        return self._scalar(node, loc)

    def _scalar(self, node: yaml.Node, loc: Loc) -> Any:
        """A plain scalar as PyYAML's safe constructors read it. An explicit tag on text it does not fit
        (`!!int abc`, `!!bool maybe`, `!!float x`) makes those constructors raise ValueError or KeyError, not a
        YAMLError (yaml/constructor.py: construct_yaml_int/float/bool); each is the file's error, placed."""
        try:
            return self._scalars.construct_object(node, deep=True)
        except (yaml.YAMLError, ValueError, KeyError) as exc:
            problem = exc.problem if isinstance(exc, yaml.MarkedYAMLError) else None  # !!map abc: "expected a ..."
            why = problem or f"{node.value!r} does not read as !!{node.tag.rsplit(':', 1)[-1]}"
            raise _fail(node.start_mark, f"invalid value: {why}", format_loc(loc)) from None

    def _mapping(self, node: yaml.MappingNode, loc: Loc) -> dict[str, Any]:
        if node.tag == "tag:yaml.org,2002:merge" or any(k.tag == "tag:yaml.org,2002:merge" for k, _ in node.value):
            raise _fail(node.start_mark, "merge keys (<<) are not supported; write the values out", format_loc(loc))
        out: dict[str, Any] = {}
        for key_node, value_node in node.value:
            if not isinstance(key_node, yaml.ScalarNode):
                raise _fail(key_node.start_mark, "mapping keys must be plain scalars", format_loc(loc))
            if key_node.tag == _TIMESTAMP:
                key = key_node.value  # a date-like key stays text, as a date-like value does
            elif key_node.tag in _PLAIN_TAGS:
                key = self._scalar(key_node, loc)
            else:  # an unknown tag: yaml would raise ConstructorError out of the loader (found by the fuzz test)
                raise _fail(key_node.start_mark, f"YAML tag {key_node.tag!r} is not allowed in a desired state",
                            format_loc(loc))
            key = str(key) if not isinstance(key, str) else key
            child = loc + (key,)
            if key in out:
                first = self.doc.key_positions[child]
                raise _fail(key_node.start_mark,
                            f"duplicate key {key!r} (first defined at line {first.line}, column {first.column})",
                            format_loc(child))
            self.doc.key_positions[child] = _pos(key_node.start_mark)
            out[key] = self.build(value_node, child)
        return out


def load_text(text: bytes) -> Document:
    """Parse bytes into a Document; every failure is a LoadError with a position."""
    if len(text) > MAX_BYTES:
        raise _fail(None, f"file is larger than the {MAX_BYTES}-byte (1 MiB) limit for a desired state")
    try:
        decoded = text.decode("utf-8")
    except UnicodeDecodeError as exc:
        before = text[: exc.start]
        line = before.count(b"\n") + 1
        column = exc.start - (before.rfind(b"\n") + 1) + 1
        problem = Problem(Position(line, column), "", f"not valid UTF-8 (byte 0x{text[exc.start]:02x})")
        raise LoadError([problem]) from None
    try:
        nodes = list(yaml.compose_all(decoded, Loader=_BaseLoader))
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        raise _fail(mark, f"invalid YAML: {exc.problem or exc.context}") from None
    except yaml.YAMLError as exc:
        raise _fail(None, f"invalid YAML: {exc}") from None
    if len(nodes) > 1:
        raise _fail(nodes[1].start_mark, "only one YAML document is allowed (found a second '---')")
    if not nodes or nodes[0] is None:
        raise _fail(None, "the file is empty; a desired state is a mapping with nodes, model, serving, ...")
    root = nodes[0]
    if not isinstance(root, yaml.MappingNode):
        raise _fail(root.start_mark, "the top level must be a mapping (key: value), not a "
                    + ("list" if isinstance(root, yaml.SequenceNode) else "scalar"))
    builder = _Builder()
    builder.doc.data = builder.build(root, ())
    builder.doc.ended = ends_with_marker(decoded)
    builder.doc.text = decoded
    return builder.doc


_END_MARKER = re.compile(r"\.\.\.(?:[ \t]+#.*)?[ \t]*")
_INSIGNIFICANT = re.compile(r"[ \t]*(?:#.*)?")


def ends_with_marker(text: str) -> bool:
    """Whether the last line that is neither blank nor a comment is `...`, YAML's document end marker.

    Why: a save that dies half-way (disk full, a crash, a dropped scp) leaves a prefix of the file, and a prefix
    of a YAML mapping is very often a valid, different, desired state (issue 16: 1,826 of the sample's 5,545
    byte-prefixes validated, some more destructive than the whole). The marker is the file's last line, so no
    proper prefix of the content has it: a prefix is refused, whatever it would have meant. At column 0 `...`
    always ends the document (it cannot hide inside a scalar), and a second document after it is refused, so
    the text check needs no parser."""
    for line in reversed(text.splitlines()):
        if _END_MARKER.fullmatch(line):
            return True
        if not _INSIGNIFICANT.fullmatch(line):
            return False
    return False


def load_file(path: Path) -> Document:
    """Read with a size cap before reading everything (a 100 MB file must not be slurped)."""
    try:
        with open(path, "rb") as handle:
            text = handle.read(MAX_BYTES + 1)
    except IsADirectoryError:
        raise _fail(None, "is a directory, not a file") from None
    except FileNotFoundError:
        raise _fail(None, "no such file") from None
    except PermissionError:
        raise _fail(None, "permission denied") from None
    except OSError as exc:
        raise _fail(None, f"cannot read: {exc.strerror or exc}") from None
    return load_text(text)
