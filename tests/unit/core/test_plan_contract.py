"""`plan --json` is "a stable, documented schema" (docs/cli.md): a plan, its drift, its steps and its blockers
render with exactly the documented keys, each carrying its own object's value. The example in docs/cli.md is the
oracle, so the code and the page cannot drift apart."""

from __future__ import annotations

import json
from pathlib import Path

from reconciler.core.drift import Drift, FieldChange
from reconciler.core.planning import Blocker, Downtime, Plan, Step

DOC = Path(__file__).resolve().parents[3] / "docs" / "cli.md"


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


def test_a_serving_restart_renders_its_field_changes_and_outage_with_the_documented_keys():
    doc = documented()
    changes = (FieldChange("serving.max_model_len", "32768", "65536"),
               FieldChange("serving.secrets.VLLM_API_KEY", "0123456789ab", "ba9876543210"))
    drift = Drift("n1", "serving", "container/vllm_serving", "spec b", "spec a (...)", container="vllm_serving",
                  changes=changes)
    out = json.loads(json.dumps(Plan([drift], [], [], downtime=Downtime(("n1", "n2"), ("n2",), 600.0)).as_dict()))
    assert set(out["field_changes"][0]) == keys(doc, "field_changes")
    assert out["field_changes"] == [
        {"node": "n1", "field": "serving.max_model_len", "old": "32768", "new": "65536", "secret": False,
         "action": "changed"},
        {"node": "n1", "field": "serving.secrets.VLLM_API_KEY", "old": None, "new": None, "secret": True,
         "action": "changed"}]  # a secret's fingerprints stay in the label
    assert set(out["downtime"]) == set(doc["downtime"])
    assert out["downtime"] == {"nodes": ["n1", "n2"], "restart_with": ["n2"], "health_timeout_seconds": 600.0}
    assert Plan([], [], []).as_dict()["downtime"] is None
