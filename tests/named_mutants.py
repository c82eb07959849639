"""The mutants of record: the single-point mutations of the core that once survived the unit tests (issue 17).

    python -m tests.named_mutants [--only NAME]

Each is a behaviour users rely on, broken in one place. For each, the core is copied to a temporary tree, the one
textual change is applied (it must match exactly once, so an edit of the core cannot make a mutant vanish
silently), and the unit tests named for it run against the copy; the mutant must make them fail. Prints which
tests killed each one; exit 1 if any survives. `make mutation` runs this before mutmut's full run.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PROPS = "tests/unit/core/test_core_properties.py"
LAUNCH = "tests/unit/core/test_launch_properties.py"


@dataclass(frozen=True)
class Mutant:
    name: str
    file: str
    before: str
    after: str
    tests: tuple[str, ...]


MUTANTS = [
    Mutant("a changed spec hash is never acted on", "core/drift.py",
           'elif c.labels.get(LABEL_SPEC_HASH) != spec.spec_hash:',
           'elif c.labels.get(LABEL_SPEC_HASH) == "never":', (PROPS,)),
    Mutant("an MTU-only mismatch is not drift", "core/drift.py",
           "    if link.mtu != mtu:\n", "    if link.mtu != mtu and not link.addresses:\n", (PROPS,)),
    Mutant("a wrong-size shard counts as in sync", "core/drift.py",
           "elif got.size != f.size or (f.sha256", "elif (f.sha256", (PROPS,)),
    Mutant("the Ray head start loses its dependency on weights and image", "core/planning.py",
           '"start the Ray head first", stopped,', '"start the Ray head first", (),', (PROPS,)),
    Mutant("every node takes the head's interface name", "core/vllm.py",
           "    iface = node.fabric.interface\n", "    iface = desired.head.fabric.interface\n", (LAUNCH,)),
    Mutant("env is not in the spec hash", "core/vllm.py",
           "self.docker_flags, sorted(self.env.items()),", "self.docker_flags,", (LAUNCH,)),
    Mutant("a node with a dead docker engine is treated as usable", "core/drift.py",
           "    if not obs.docker_reachable:\n        return [Drift(",
           "    if False:\n        return [Drift(", (PROPS,)),
    Mutant("await-health while a serving node is unreachable", "core/planning.py",
           "    if unseen := [n.name for n in desired.serving_nodes if n.name in down]:",
           "    if unseen := []:", (PROPS, "tests/unit/loop/test_health_escalation.py")),
    Mutant("another cluster's containers are ours (the instance label ignored)", "core/observed.py",
           '    return whose(labels, owner.names) in ("ours", "unlabelled")',
           "    return is_managed(labels)", (PROPS,)),
]


# seconds: the unit tests a mutant is judged by take under a minute each on the 2 cores (MUTANT_HANG to change)
HANG = float(os.environ.get("MUTANT_HANG", "300"))


def run(m: Mutant, *pytest_args: str, env: dict[str, str] | None = None) -> tuple[bool, list[str]]:
    """(killed, the failing tests) for one mutant. A mutant that breaks collection (an import-time error) fails
    the suite too: it is killed by the test files that could not be collected, or by the conftest that could not
    import the package (pytest's exit 4)."""
    with tempfile.TemporaryDirectory(prefix="mutant-") as tmp:
        tree = Path(tmp) / "repo"  # the whole source tree: the tests import `reconciler` from their rootdir
        shutil.copytree(REPO, tree, ignore=shutil.ignore_patterns(".git", ".venv", "mutants", ".hypothesis",
                                                                  "__pycache__", "*.egg-info"))
        path = tree / "reconciler" / m.file
        text = path.read_text()
        if text.count(m.before) != 1:
            raise SystemExit(f"{m.name}: `{m.before.strip()}` occurs {text.count(m.before)} times in "
                             f"reconciler/{m.file}; update the mutant of record with the code")
        path.write_text(text.replace(m.before, m.after))
        try:
            out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--tb=no",
                                  *pytest_args, *m.tests], cwd=tree, capture_output=True, text=True, check=False,
                                 env=env, timeout=HANG)
        except subprocess.TimeoutExpired:  # a mutant that makes a test loop forever is caught (mutmut's timeout)
            return True, [f"(the tests did not end within {HANG:.0f} s)"]
        failed = [line.split(" ", 1)[1].split(" - ")[0] for line in out.stdout.splitlines()
                  if line.startswith(("FAILED ", "ERROR "))]
        if out.returncode == 4 and "while loading conftest" in out.stderr + out.stdout:
            failed = ["tests/unit/conftest.py (the package does not import)"]
        return out.returncode in (1, 2, 4) and bool(failed), failed


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only")
    a = p.parse_args()
    survivors = 0
    for m in MUTANTS:
        if a.only and a.only not in m.name:
            continue
        killed, by = run(m)
        survivors += not killed
        print(f"{'killed' if killed else 'SURVIVED'}: {m.name} ({m.file})")
        for test in by:
            print(f"    by {test}")
    return 1 if survivors else 0


if __name__ == "__main__":
    sys.exit(main())
