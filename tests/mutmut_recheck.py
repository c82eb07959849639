"""The verdict on a mutmut run: every survivor classified, and those in import-time code re-judged on disk.

    python -m tests.mutmut_recheck [MUTANTS_DIR] [--no-recheck] [--rejudge] [--with=TEST_FILE,...] [--only=GLOB,...]
                                   [--json=PATH]

Prints the score and one line per survivor that is neither message wording nor re-judged killed, as markdown for
docs/testing.md. The classes:

- **killed** by the unit tests (mutmut's own verdict), or **killed on disk** (below);
- **wording**: the mutant changes only the text of a message (a string literal with a space in it) and nothing
  the program decides on; users read it, no behaviour depends on it;
- **survived**: everything else, listed one by one with the changed line.

Re-judging: mutmut 3 switches a mutant on inside the function, at call time, in a process that has already
imported the code, and it runs only the tests its stats pass saw calling that function. A function that runs once
while the module is imported (a pydantic schema hook, a validator factory such as `spec.at_least`, a class's
`__init__` called at class creation) is therefore never run mutated, and its stats name only the first test that
happened to import the module: every such mutant "survives" whatever the tests do (the same false survivors are
described in cdeust/Cortex#269 and fixed there the same way in #286). Each of them is written into a copy of the
tree in place of the original function, and the unit test files that call it or import its module judge it,
collection included. `--rejudge` does the same for every survivor that is not wording: the verdict of the tests as
they are now, when tests were added after mutmut's run (mutmut would only rerun the tests its stats know).
`--with=FILES` re-judges every survivor (not wording) by those test files only: the files added after the run
began. Every older test already had its chance in mutmut's run, so this is the same verdict in minutes, not hours.
`--only=GLOB` re-judges only the mutants whose key matches (`reconciler.edge.facts.*`: each module by the new
files that test it), and `--json=PATH` writes every mutant's verdict, so such runs can be merged.
"""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
import textwrap
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from fnmatch import fnmatch
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
# The probe's fragments are shell text sent to a node (`*_script`, `sealed`): a string with a space in it is a
# command there, never message wording.
SHELL = re.compile(r"\.x_(\w+_script|sealed)__mutmut_\d+$")
STATUS = {1: "killed", 0: "survived", 33: "no tests", 37: "type check", 36: "timeout", -24: "timeout",
          None: "not run"}


def import_time_functions() -> set[str]:
    """`file.py:Qual.name` of every function of `reconciler` that runs while the CLI's modules are imported."""
    out = subprocess.run([sys.executable, "-c", PROFILE], cwd=REPO, capture_output=True, text=True, check=True)
    return set(out.stdout.split())


def qualname(key: str) -> str:
    """mutmut's `reconciler.core.spec.x_func__mutmut_3` / `...xǁClassǁmethod__mutmut_3` -> `func` / `Class.method`."""
    name = key.rsplit("__mutmut_", 1)[0].rsplit(".", 1)[-1]
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
    return "".join(source.splitlines(keepends=True)[node.lineno - 1:node.end_lineno])


class Mutants:
    """mutmut's mutants/ tree: each mutant's function text next to the original's."""

    def __init__(self, root: Path) -> None:
        self.root = root
        # keyed by the file's path below reconciler/ (core/drift.py, core/spec/models.py)
        self.mutated = {str(p.relative_to(root / "reconciler"))[:-5]: p.with_suffix("").read_text()
                        for p in (root / "reconciler").rglob("*.py.meta")}
        self.by_name = {f: {q.rsplit(".", 1)[-1]: n for q, n in _functions(text).items()}
                        for f, text in self.mutated.items()}

    def codes(self) -> list[tuple[str, str, int | None]]:
        out = []
        for meta in sorted((self.root / "reconciler").rglob("*.py.meta")):
            codes = json.loads(meta.read_text())["exit_code_by_key"]
            file = str(meta.relative_to(self.root / "reconciler"))[:-5]
            out += [(file, key, code) for key, code in sorted(codes.items())]
        return out

    def texts(self, file: str, key: str) -> tuple[str, str]:
        """(original, mutant) function source, both dedented, as mutmut wrote them."""
        fns = self.by_name[file]
        base = key.rsplit(".", 1)[-1].rsplit("__mutmut_", 1)[0]
        return (textwrap.dedent(_segment(self.mutated[file], fns[base + "__mutmut_orig"])),
                textwrap.dedent(_segment(self.mutated[file], fns[key.rsplit(".", 1)[-1]])))

    def test_files(self, file: str, key: str) -> tuple[str, ...]:
        """The unit test files that can judge a mutant of `file`: those mutmut's stats saw calling the function,
        and every one that imports the module (tests written after the stats pass are not in them)."""
        stats = json.loads((self.root / "mutmut-stats.json").read_text())["tests_by_mangled_function_name"]
        files = {t.split("::")[0] for t in stats.get(key.rsplit("__mutmut_", 1)[0], ())}
        package, _, module = file.removesuffix(".py").removesuffix("/__init__").replace("/", ".").rpartition(".")
        uses = re.compile(rf"reconciler\.{package}\.{module}\b|from reconciler\.{package} import [^\n]*\b{module}\b")
        files |= {str(p.relative_to(REPO)) for p in (REPO / "tests" / "unit").glob("test_*.py")
                  if uses.search(p.read_text())}
        return tuple(sorted(files))

    def on_disk(self, file: str, key: str, tests: tuple[str, ...] = ()) -> Mutant:
        """The mutant as a textual change of the pristine file: the original function -> the mutated one, renamed
        back and indented like the original; judged by `tests`, or by every file that can judge it."""
        pristine = (REPO / "reconciler" / file).read_text()
        original = _functions(pristine)[qualname(key)]
        fn_name = key.rsplit(".", 1)[-1]
        body = textwrap.dedent(_segment(self.mutated[file], self.by_name[file][fn_name]))
        body = body.replace(f"def {fn_name}(", f"def {original.name}(", 1)
        return Mutant(key, file, _segment(pristine, original), textwrap.indent(body, " " * original.col_offset),
                      tests or self.test_files(file, key))


def _strings(tree: ast.AST) -> list[str]:
    return [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)]


def wording_only(original: str, mutant: str) -> bool:
    """The two functions differ only in string literals, and every changed literal is prose (has a space)."""
    a, b = ast.parse(original), ast.parse(mutant)
    for tree in (a, b):
        for n in ast.walk(tree):
            if isinstance(n, ast.FunctionDef):
                n.name = "f"
    sa, sb = _strings(a), _strings(b)
    for tree in (a, b):
        for n in ast.walk(tree):
            if isinstance(n, ast.Constant) and isinstance(n.value, str):
                n.value = ""
    if ast.dump(a) != ast.dump(b) or len(sa) != len(sb):
        return False
    changed = [(x, y) for x, y in zip(sa, sb, strict=True) if x != y]
    return bool(changed) and all(" " in x.strip() for x, _ in changed)


def changed_line(original: str, mutant: str) -> str:
    o, m = original.splitlines(), mutant.splitlines()
    for x, y in zip(o[1:], m[1:], strict=False):
        if x != y:
            return f"`{x.strip()}` -> `{y.strip()}`"
    return "(signature or length)"


def main() -> int:
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    mutants = Mutants(Path(args[0]) if args else REPO / "mutants")
    at_import = import_time_functions() if "--no-recheck" not in sys.argv else set()
    added = tuple(next((a.split("=", 1)[1].split(",") for a in sys.argv if a.startswith("--with=")), ()))
    rejudge = "--rejudge" in sys.argv or bool(added)  # every survivor, with the tests as they are now
    only = next((a.split("=", 1)[1].split(",") for a in sys.argv if a.startswith("--only=")), ["*"])  # these keys
    dump = next((Path(a.split("=", 1)[1]) for a in sys.argv if a.startswith("--json=")), None)
    env = {**os.environ, "MUTANT_UNDER_TEST": "recheck"}  # the examples of a mutation run (tests/unit/examples.py)

    def on_disk(file: str, key: str) -> str:
        tests = () if f"{file}:{qualname(key)}" in at_import or not added else added
        dead, by = run(mutants.on_disk(file, key, tests), "-x", env=env)
        status = "killed on disk" if dead else "survived"
        print(f"re-judged on disk: {key}: {status}" + (f" by {by[0]}" if by else ""), file=sys.stderr, flush=True)
        return status

    def judge(item: tuple[str, str, int | None]) -> str:
        file, key, code = item
        status = STATUS.get(code, f"exit {code}")
        if status == "timeout" and rejudge and any(fnmatch(key, g) for g in only):  # a run paused (SIGSTOP)
            return on_disk(file, key)
        if status == "survived" and code == 0:
            if wording_only(*mutants.texts(file, key)) and not SHELL.search(key):
                return "wording"
            if (rejudge and any(fnmatch(key, g) for g in only)) or f"{file}:{qualname(key)}" in at_import:
                return on_disk(file, key)
        return status

    items = mutants.codes()
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:  # each judgement is its own pytest process
        statuses = list(pool.map(judge, items))
    verdict = Counter(statuses)
    if dump is not None:  # key -> verdict, to merge runs that re-judged different modules with different files
        dump.write_text(json.dumps(dict(zip((key for _, key, _ in items), statuses, strict=True)), indent=0))
    listed = [f"| `{re.sub(r'^reconciler.', '', key)}` | {changed_line(*mutants.texts(file, key))} |"
              for (file, key, _), status in zip(items, statuses, strict=True) if status == "survived"]
    run_total = sum(n for s, n in verdict.items() if s != "not run")
    killed = verdict["killed"] + verdict["killed on disk"] + verdict["timeout"] + verdict["type check"]
    print(f"mutants: {sum(verdict.values())}, run: {run_total}; " + ", ".join(f"{s}: {n}" for s, n in
                                                                         verdict.most_common()))
    if run_total:
        print(f"killed: {killed / run_total:.1%} of those run; "
              f"{killed / max(1, run_total - verdict['wording']):.1%} leaving message wording out")
    print("\n" + by_module(items, statuses))
    print("\n| survivor | the change |\n|---|---|")
    print("\n".join(listed))
    return 0


def by_module(items: list[tuple[str, str, int | None]], statuses: list[str]) -> str:
    """The verdict per mutated module, as a markdown table: where the tests bite and where they do not."""
    rows: dict[str, Counter[str]] = {}
    for (_, key, _), status in zip(items, statuses, strict=True):
        module = re.sub(r"^reconciler\.|\.x[_ǁ].*$", "", key)
        rows.setdefault(module, Counter())[status] += 1
    out = ["| module | mutants | run | killed (+ on disk, timeout) | wording | survived | no tests | killed of those "
           "run |", "|---|---|---|---|---|---|---|---|"]
    for module, c in sorted(rows.items()):
        run_n = sum(n for s, n in c.items() if s != "not run")
        if not run_n:
            continue
        killed = c["killed"] + c["killed on disk"] + c["timeout"] + c["type check"]
        out.append(f"| `{module}` | {sum(c.values())} | {run_n} | {killed} | {c['wording']} | {c['survived']} | "
                   f"{c['no tests']} | {killed / run_n:.1%} |")
    return "\n".join(out)


if __name__ == "__main__":
    sys.exit(main())
