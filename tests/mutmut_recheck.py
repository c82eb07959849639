"""Re-judge mutmut's survivors in code that runs at import time, with the mutant written to disk.

    python -m tests.mutmut_recheck [MUTANTS_DIR]

mutmut 3 switches a mutant on inside the function, at call time, in a process that has already imported the
code, and it runs only the tests its stats pass saw calling that function. A function that runs once while the
module is imported (a pydantic schema hook, a validator factory such as `spec.at_least`, a class's `__init__`
called at class creation) is therefore never run mutated, and its stats name only the first test that happened
to import the module: every such mutant "survives" whatever the tests do (the same false survivors are described
in cdeust/Cortex#269, fixed there the same way in #286). Here each of them is written into a copy of the tree in
place of the original function, and the whole unit suite judges it, collection included; `make mutation` runs
this after mutmut and docs/testing.md reports the result as its own line.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from tests.named_mutants import REPO, Mutant, run

PROFILE = """
import sys
seen = set()
def tracer(frame, event, arg):
    if event == "call" and "/reconciler/" in frame.f_code.co_filename:
        seen.add(frame.f_code.co_filename.rsplit("/reconciler/", 1)[1] + ":" + frame.f_code.co_qualname)
sys.setprofile(tracer)
import reconciler.cli
sys.setprofile(None)
print("\\n".join(sorted(seen)))
"""


def import_time_functions() -> set[str]:
    """`file.py:Qual.name` of every function of `reconciler` that runs while the CLI's modules are imported."""
    out = subprocess.run([sys.executable, "-c", PROFILE], cwd=REPO, capture_output=True, text=True, check=True)
    return set(out.stdout.split())


def qualname(mangled: str) -> str:
    """mutmut's `x_func` / `xǁClassǁmethod` -> `func` / `Class.method`."""
    name = mangled.rsplit(".", 1)[-1]
    return ".".join(name.split("ǁ")[1:]) if name.startswith("xǁ") else name[2:]


def _functions(source: str) -> dict[str, ast.FunctionDef]:
    out: dict[str, ast.FunctionDef] = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                out[prefix + child.name] = child  # type: ignore[assignment]
            elif isinstance(child, ast.ClassDef):
                visit(child, prefix + child.name + ".")
    visit(ast.parse(source), "")
    return out


def _segment(source: str, node: ast.FunctionDef) -> str:
    lines = source.splitlines(keepends=True)
    return "".join(lines[node.lineno - 1:node.end_lineno])


def mutant_on_disk(mutants: Path, file: str, key: str) -> Mutant:
    """The survivor as a textual mutant of the pristine file: the original function's text -> mutmut's mutated
    function, renamed back and indented like the original."""
    pristine = (REPO / "reconciler" / file).read_text()
    mutated = (mutants / "reconciler" / file).read_text()
    fn_name = key.rsplit(".", 1)[-1]
    original = _functions(pristine)[qualname(key.rsplit("__mutmut_", 1)[0])]
    by_name = {q.rsplit(".", 1)[-1]: n for q, n in _functions(mutated).items()}
    mutant = by_name[fn_name]
    before = _segment(pristine, original)
    body = textwrap.dedent(_segment(mutated, mutant)).replace(f"def {fn_name}(", f"def {original.name}(", 1)
    after = textwrap.indent(body, " " * original.col_offset)
    return Mutant(key, file, before, after, ("tests/unit",))


def survivors(mutants: Path) -> list[tuple[str, str]]:
    out = []
    for meta in sorted((mutants / "reconciler").glob("*.py.meta")):
        codes = json.loads(meta.read_text())["exit_code_by_key"]
        out += [(meta.name[:-5], key) for key, code in sorted(codes.items()) if code == 0]
    return out


def main() -> int:
    mutants = Path(sys.argv[1]) if len(sys.argv) > 1 else REPO / "mutants"
    at_import = import_time_functions()
    env = {**os.environ, "MUTANT_UNDER_TEST": "recheck"}  # the examples of a mutation run (tests/unit/examples.py)
    killed = survived = 0
    for file, key in survivors(mutants):
        if f"{file}:{qualname(key.rsplit('__mutmut_', 1)[0])}" not in at_import:
            continue
        dead, by = run(mutant_on_disk(mutants, file, key), "-x", env=env)
        killed += dead
        survived += not dead
        print(f"{'killed' if dead else 'SURVIVED'}: {key}" + (f" by {by[0]}" if by else ""), flush=True)
    print(f"import-time survivors re-judged on disk: {killed} killed, {survived} survived")
    return 0


if __name__ == "__main__":
    sys.exit(main())
