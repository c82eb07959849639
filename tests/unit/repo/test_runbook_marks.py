"""Every fenced block of the runbook (docs/operations.md) and the README says who runs it and where, and the
blocks the runbook test runs (tests/e2e/test_runbook.py) are shell it can run. The marks are parsed by
tests/e2e/runbook.py, the parser the e2e test uses."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e import runbook

ROOT = Path(__file__).resolve().parents[3]
DOCS = [ROOT / "docs" / "operations.md", ROOT / "README.md"]


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_every_block_names_its_user_and_node(path):
    found = runbook.blocks(path)
    assert found, f"no fenced block in {path}"
    wrong = [problem for block in found for problem in runbook.problems(block)]
    assert not wrong, "\n".join(wrong)


def test_the_runbook_runs_from_its_values_to_a_completion():
    found = runbook.blocks(ROOT / "docs" / "operations.md")
    [values] = [b for b in found if b.attrs.get("vars")]
    names = values.variables()
    assert {"HEAD", "WORKER_MGMT", "MODEL", "IMAGE", "SRC"} <= set(names)
    runnable = [b for b in found if b.runnable]
    assert runnable and all(b.line > values.line for b in runnable), "the values come first"
    texts = [b.text for b in runnable]
    first = {word: next(i for i, t in enumerate(texts) if word in t)
             for word in ("useradd", "python3 -m venv", "ssh-keyscan", "ssh-copy-id", "reconciler discover",
                          "reconciler sudoers", "reconciler doctor", "reconciler plan", "reconciler apply",
                          "reconciler print unit", "reconciler status", "curl")}
    assert list(first) == sorted(first, key=first.__getitem__), f"out of order: {first}"
    assert "/v1/completions" in texts[-1] and "Authorization: Bearer" in texts[-1]
    for block in runnable:        # every variable a block uses is a value of the values block
        import re

        used = set(re.findall(r"\$\{?([A-Z][A-Z0-9_]*)", block.text)) - {"VLLM_API_KEY"}
        assert used <= set(names), f"{block.where}: {sorted(used - set(names))} not in the values block"


def test_the_install_matches_the_units_execstart():
    text = (ROOT / "docs" / "operations.md").read_text()
    assert "python3 -m venv /opt/spark-reconciler" in text and "python3-venv" in text
    assert "pip install -c \"$SRC/constraints.txt\"" in text
    unit = (ROOT / "reconciler" / "files" / "systemd" / "reconciler.service").read_text()
    assert "ExecStart=/opt/spark-reconciler/bin/reconciler " in unit and "\nUser=spark\n" in unit


def test_the_parser_reads_both_forms_of_mark(tmp_path):
    doc = tmp_path / "doc.md"
    doc.write_text('text\n\n```sh {user=root node=head run exit=1}\necho a\n```\n\n'
                   '```yaml\n# {user=root node=both file=/etc/x skip="no reason"}\na: 1\n```\n\n```\nbare\n```\n')
    a, b, c = runbook.blocks(doc)
    assert (a.lang, a.user, a.node, a.runnable, a.expected_exit, a.line, a.text) == \
        ("sh", "root", "head", True, 1, 3, "echo a\n")
    assert (b.lang, b.node, b.skip, b.runnable) == ("yaml", "both", "no reason", False)
    assert not c.marked and runbook.problems(c)
