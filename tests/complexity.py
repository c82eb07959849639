"""No function, method or closure of the package above cyclomatic complexity 15, as radon counts it (issue 54).

    python -m tests.complexity [PATH ...]     (default: reconciler)

Prints one line per function above the limit (`path:line name complexity`) and exits 1 when there is any; `make lint`
runs it. Why radon beside ruff's C901 (pyproject.toml, max-complexity 12): mccabe counts a branch per `if`, loop
and `except`, but not the boolean operators, so a function whose decisions hide in `a and b or c` chains passes
C901 however many conditions it holds; radon adds one per `and`/`or` operand and per comprehension `if`. Why a
script: `radon cc` exits 0 whatever it finds, and its letter grades (`-n`: C is 11-20) do not fall on 15. A class's
own figure (the mean of its methods) is not judged: its methods are, one by one.
"""

from __future__ import annotations

import sys
from pathlib import Path

from radon.complexity import add_inner_blocks, cc_visit
from radon.visitors import Function

#: The highest complexity a function may have.
LIMIT = 15


def offenders(paths: list[Path], limit: int = LIMIT) -> list[str]:
    """`path:line name (complexity)` of every function, method and closure above `limit` in the Python files
    under `paths`, in path and line order."""
    files = sorted(f for p in paths for f in ([p] if p.is_file() else p.rglob("*.py")))
    out = []
    for file in files:
        blocks = add_inner_blocks(cc_visit(file.read_text(encoding="utf-8")))
        out += [f"{file}:{b.lineno} {b.fullname} ({b.complexity})"
                for b in sorted(blocks, key=lambda b: b.lineno) if isinstance(b, Function) and b.complexity > limit]
    return out


def main(argv: list[str]) -> int:
    found = offenders([Path(a) for a in argv] or [Path("reconciler")])
    for line in found:
        print(line)
    if found:
        print(f"{len(found)} functions above cyclomatic complexity {LIMIT} (radon): split them", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
