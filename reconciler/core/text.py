"""Text from the nodes made safe to show: the one rule for the terminal and for YAML written by `discover`.

A node is not trusted to send harmless text: container names, image references, hostnames, error messages and
condition messages all come from it. Shown raw, an escape sequence repaints or retitles the operator's terminal
(CSI `ESC[2J`, OSC `ESC]0;...BEL`), a bidi override makes a line read differently from what it holds, and a line
break (also NEL U+0085 and U+2028/U+2029, which YAML counts as line breaks) turns a YAML comment into live YAML.
"""

from __future__ import annotations


def printable(text: str) -> str:
    """`text` with every character Python does not call printable replaced by its visible escape (`\\x1b`,
    `\\u202e`, `\\U000e0001`): Unicode's Other (control C0/C1 and DEL, format such as the bidi overrides and
    zero-width characters, surrogates, private use, unassigned) and Separator except the ASCII space (line and
    paragraph separators, no-break spaces). Tab and newline are escaped too: one rule with no exceptions, and the
    result is always a single line. Backslashes are kept as they are: the escapes are for reading, not decoding."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else _escape(ord(c)) for c in text)


def _escape(code: int) -> str:
    if code < 0x100:
        return f"\\x{code:02x}"
    return f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"
