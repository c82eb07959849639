"""An environment file read as systemd reads `EnvironmentFile=`, so the CLI sees exactly what the daemon gets.

systemd's parser (src/basic/env-file.c, `parse_env_file_internal`, as of v252, Debian 12's) is a small state
machine, followed here: a line is `KEY=VALUE`; blank lines and lines starting with `#` or `;` are skipped; space
around the key and before the value is dropped, and trailing space of an unquoted value too; a value may be
'single quoted' (literal) or "double quoted" (a backslash before one of " \\ ` $ or a newline escapes it, before
anything else it stays), and quoted and unquoted runs concatenate; an unquoted backslash takes the next character
literally, and before a newline continues the line. A key that is not a valid environment name is dropped. A
`KEY=` line sets KEY to the empty string (which `Desired.with_secrets` treats as unset).
"""

from __future__ import annotations

import re

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_DOUBLE_QUOTE_ESCAPES = '"\\`$'


def parse(text: str) -> dict[str, str]:
    """Every `KEY=VALUE` the file sets, the last one winning (as systemd pushes them in order)."""
    out: dict[str, str] = {}
    i, n = 0, len(text)
    while i < n:
        line_end = text.find("\n", i)
        line_end = n if line_end < 0 else line_end
        head = text[i:line_end].lstrip()
        if not head or head[0] in "#;" or "=" not in head:
            i = line_end + 1
            continue
        start = i + (len(text[i:line_end]) - len(head))
        eq = text.index("=", start)
        key = text[start:eq].strip()
        value, i = _value(text, eq + 1)
        if _NAME.fullmatch(key):
            out[key] = value
    return out


def _value(text: str, i: int) -> tuple[str, int]:
    """The value starting at `i` (after the `=`), and where the next line starts. systemd's states: before a
    value (spaces skipped; a quote opens a quoted run), in an unquoted run (quotes are literal there), in a quote."""
    n = len(text)
    parts: list[str] = []
    unquoted = False  # inside an unquoted run, whose trailing spaces are dropped at the line's end
    while i < n and text[i] != "\n":
        c = text[i]
        if not unquoted and c in " \t":
            i += 1
        elif not unquoted and c in "'\"":
            i, literal = _quoted(text, i + 1, c)
            parts.append(literal)
        elif c == "\\":
            if i + 1 < n and text[i + 1] != "\n":
                parts.append(text[i + 1])
            unquoted, i = True, i + 2
        else:
            parts.append(c)
            unquoted, i = True, i + 1
    value = "".join(parts)
    return (value.rstrip(" \t") if unquoted else value), i + 1


def _quoted(text: str, i: int, quote: str) -> tuple[int, str]:
    """A quoted run starting after its opening quote: (index after the closing quote, its content). An unclosed
    quote runs to the end of the file, as in systemd."""
    n, out = len(text), []
    while i < n and text[i] != quote:
        if quote == '"' and text[i] == "\\" and i + 1 < n:
            nxt = text[i + 1]
            if nxt in _DOUBLE_QUOTE_ESCAPES:
                out.append(nxt)
            elif nxt != "\n":
                out.append("\\" + nxt)
            i += 2
            continue
        out.append(text[i])
        i += 1
    return i + 1, "".join(out)


def names(text: str) -> frozenset[str]:
    """The names a file sets to a non-empty value (what doctor may show: never a value)."""
    return frozenset(key for key, value in parse(text).items() if value)
