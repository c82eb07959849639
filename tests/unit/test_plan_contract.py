"""`plan --json` is "a stable, documented schema" (docs/cli.md): a plan, its drift, its steps and its blockers
render with exactly the documented keys, each carrying its own object's value. The example in docs/cli.md is the
oracle, so the code and the page cannot drift apart."""

from __future__ import annotations

import json
from pathlib import Path

from reconciler.core.drift import Drift
from reconciler.core.planning import Blocker, Plan, Step

DOC = Path(__file__).resolve().parents[2] / "docs" / "cli.md"


def documented() -> dict:
    section = DOC.read_text().split("## `plan --json`", 1)[1]
    return json.loads(section.split("```json", 1)[1].split("```", 1)[0])


def keys(doc: dict, field: str) -> set[str]:
    return set(doc[field][0])


def test_a_plan_renders_with_the_documented_keys_and_its_own_values():
    doc = documented()
    drift = Drift("n1", "link", "link/eth1/mtu", "9000", "1500", actionable=False, blocking=True)
    step = Step("start-serving", "n1", "start rank 1", after=("link/n1",), rank=1)
    plan = Plan([drift], [step], [Blocker("n2", "waits for n2")], mode="observe", trusted=("remote code",),
                ulimits=("memlock=-1",))

    out = json.loads(json.dumps(plan.as_dict()))  # what `--json` prints
    assert set(out) == set(doc)
    assert {k: out[k] for k in ("changes", "mode", "trusted", "ulimits")} == {
        "changes": True, "mode": "observe", "trusted": ["remote code"], "ulimits": ["memlock=-1"]}
    assert set(out["drift"][0]) == keys(doc, "drift")
    assert out["drift"] == [{"node": "n1", "kind": "link", "resource": "link/eth1/mtu", "expected": "9000",
                             "observed": "1500", "actionable": False, "blocking": True}]
    assert set(out["steps"][0]) == keys(doc, "steps")
    assert out["steps"] == [{"id": "start-serving/n1", "kind": "start-serving", "node": "n1",
                             "reason": "start rank 1", "after": ["link/n1"], "params": {"rank": "1"}}]
    assert set(out["blocked"][0]) == keys(doc, "blocked")
    assert out["blocked"] == [{"node": "n2", "reason": "waits for n2"}]


def test_report_only_drift_is_no_change_and_a_step_is():
    report_only = Drift("n1", "co-tenant", "container/x", "absent", "running", actionable=False)
    assert Plan([report_only], [], []).as_dict()["changes"] is False
    assert Plan([], [Step("link", "n1", "why")], []).as_dict()["changes"] is True
