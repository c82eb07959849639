"""Issue 33, finding 7: `reconciler status` drawn as kubectl draws a resource, at any width.

It was rendered at a fixed width of 140 and wrapped line by line (unreadable at 80), messages were cut at 160
characters mid-word, and it showed no age, no last-transition time and no blocker. The documents are real ones,
recorded from a daemon on the testbed (tests/unit/fixtures/status/record_status.py says how); the moment the ages
count to is fixed, so every age is exact.
"""

from __future__ import annotations

import copy
import json
import re
from datetime import datetime
from pathlib import Path

import pytest
from rich.cells import cell_len

from reconciler.cli.status_view import human_duration, status_text
from tests.unit.edge.test_hostile_text import HOSTILE, assert_terminal_safe

FIXTURES = Path(__file__).parents[1] / "fixtures" / "status"
NAMES = ("status-copying", "status-syncing", "status-held")
WIDTHS = (80, 200)


def fixture(name: str) -> dict:
    return json.loads((FIXTURES / f"{name}.json").read_text())


def unix(rfc3339: str) -> float:
    return datetime.fromisoformat(rfc3339).timestamp()


def row(text: str, *cells: str) -> str:
    """The one line of `text` holding these cells in this order, separated by column gaps."""
    found = [line for line in text.splitlines() if re.search(r"\s+".join(map(re.escape, cells)), line)]
    assert len(found) == 1, (cells, text)
    return found[0]


def words(text: str) -> set[str]:
    return set(text.split())


def section(text: str, title: str) -> str:
    """The lines of one section: from its title to the next blank line."""
    lines = text.splitlines()
    start = lines.index(title)
    end = next((i for i in range(start, len(lines)) if not lines[i]), len(lines))
    return "\n".join(lines[start:end])


# ------------------------------------------------------------------------------------------------ the width

@pytest.mark.parametrize("wide", [False, True], ids=["compact", "wide"])
@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("name", NAMES)
def test_no_line_is_wider_than_the_width(name, width, wide):
    doc = fixture(name)
    text = status_text(doc, width, doc["time"] + 30, wide)
    assert max(cell_len(line) for line in text.splitlines()) <= width, text
    for title in ("NODES", "CONDITIONS"):
        assert title in text.splitlines()
    assert f"phase {doc['phase']}" in text
    assert row(text, "head", "yes") and row(text, "worker", "yes")


def test_at_80_columns_a_long_message_ends_with_an_ellipsis_and_at_200_it_is_whole():
    doc = fixture("status-copying")
    message = next(c["message"] for c in doc["conditions"] if (c["node"], c["type"]) == ("worker", "WeightsInSync"))
    narrow = row(status_text(doc, 80, doc["time"]), "worker", "WeightsInSync", "False")
    assert narrow.endswith("…") and len(narrow) == 80
    shown = narrow.split("WeightsDrift", 1)[1].strip().removesuffix("…")
    assert len(shown) > 10 and message.startswith(shown)
    assert row(status_text(doc, 200, doc["time"]), "worker", "WeightsInSync", "False").endswith(message)


@pytest.mark.parametrize("width", WIDTHS)
def test_the_wide_form_wraps_every_message_at_word_boundaries(width):
    """Every word of every message and blocker, vLLM's log included, is there whole: nothing cut mid-word."""
    doc = fixture("status-held")
    text = status_text(doc, width, doc["time"], wide=True)
    said = [c["message"] for c in doc["conditions"]] + list(doc["held"].values())
    missing = [w for message in said for w in message.split() if w not in words(text)]
    assert not missing, missing
    assert "EngineCore failed to start." in text  # the last line of the held step's log, under its row


def test_the_compact_form_shows_the_first_line_of_a_log_and_says_there_is_more():
    doc = fixture("status-held")
    text = status_text(doc, 200, doc["time"])
    assert row(text, "head", "held await-health/head").endswith(
        "vllm_serving on head is exited (exit 1) while waiting for health: …")
    assert "EngineCore" not in text


# ------------------------------------------------------------------------------------------------ ages

@pytest.mark.parametrize("seconds,age", [(45, "45s"), (12 * 60, "12m"), (3 * 3600, "3h"), (2 * 86400, "2d")])
def test_a_condition_s_age_counts_from_its_last_transition(seconds, age):
    doc = fixture("status-held")
    ready = next(c for c in doc["conditions"] if c["type"] == "Ready")
    serving = next(c for c in doc["conditions"] if (c["node"], c["type"]) == ("head", "ServingRunning"))
    assert ready["lastTransitionTime"] != serving["lastTransitionTime"]  # two ages in one document
    now = unix(ready["lastTransitionTime"]) + seconds
    text = status_text(doc, 80, now)
    assert row(text, "-", "Ready", "False", age, "Blocked")
    later = human_duration(now - unix(serving["lastTransitionTime"]))
    assert later != age and row(text, "head", "ServingRunning", "False", later, "ServingDrift")


@pytest.mark.parametrize("seconds,shown", [
    (0, "0s"), (-1.5, "0s"), (-2, "<invalid>"), (59.9, "59s"), (119, "119s"), (120, "2m"), (150, "2m30s"),
    (599, "9m59s"), (600, "10m"), (179 * 60, "179m"), (3 * 3600, "3h"), (3 * 3600 + 600, "3h10m"),
    (8 * 3600 + 600, "8h"), (47 * 3600, "47h"), (48 * 3600, "2d"), (53 * 3600, "2d5h"), (8 * 86400, "8d"),
    (400 * 86400, "400d"), (730 * 86400, "2y"), (740 * 86400, "2y10d"), (9 * 365 * 86400 + 86400, "9y"),
])
def test_durations_read_as_kubectl_prints_them(seconds, shown):
    """k8s.io/apimachinery/pkg/util/duration.HumanDuration's cases."""
    assert human_duration(seconds) == shown


def test_the_header_says_when_it_last_converged_and_reconciled():
    doc = fixture("status-syncing")
    assert "converged" not in status_text(doc, 80, doc["time"])  # a daemon that does not say: nothing invented
    text = status_text({**doc, "lastConverged": doc["time"] - 3 * 3600}, 80, doc["time"] + 45)
    assert "converged 3h ago" in text and "reconciled 45s ago" in text
    assert "converged never" in status_text({**doc, "lastConverged": 0}, 80, doc["time"])


# ------------------------------------------------------------------------------------------------ operations

def test_an_operation_shows_its_bytes_total_rate_and_time_left():
    doc = fixture("status-syncing")
    op = doc["operations"][0]
    text = status_text(doc, 200, doc["time"])
    left = human_duration((op["bytesTotal"] - op["bytesDone"]) / op["bytesPerSecond"])
    assert row(text, "weights/worker", "running", "7s", "in 11h",
               f"24.5 MiB of 64.0 MiB (38%), 3.3 MiB/s, ~{left} left")


def test_a_cold_start_shows_vllm_s_own_progress():
    doc = fixture("status-syncing")
    doc["operations"] = [{"step": "await-health/head", "kind": "await-health", "node": "head", "state": "running",
                          "seconds": 312.4, "deadlineIn": 887.6, "bytesDone": 0, "bytesTotal": None,
                          "bytesPerSecond": None, "stage": "loading-weights", "percent": 45,
                          "detail": "Loading safetensors checkpoint shards: 45% Completed | 3/7"}]
    for width in WIDTHS:
        text = status_text(doc, width, doc["time"])
        assert row(text, "await-health/head", "running", "5m12s", "in 14m", "loading-weights 45%")
    assert row(status_text(doc, 200, doc["time"]), "await-health/head").endswith(
        "loading-weights 45%, Loading safetensors checkpoint shards: 45% Completed | 3/7")


def test_a_verify_asked_of_the_daemon_shows_while_it_waits_and_while_it_runs():
    """reconciler/loop/verify.py: a request waits for its turn (`verifyRequests`), then runs as an operation."""
    doc = fixture("status-syncing")
    waiting = {"id": "7f3a", "state": "pending", "repair": False, "node": None, "requested": doc["time"] - 90,
               "finished": None, "running": None, "waiting": "a weight sync to worker is in flight",
               "todo": ["head", "worker"], "results": []}
    done = {**waiting, "id": "1b2c", "state": "done", "finished": doc["time"] - 3600, "waiting": None, "todo": []}
    text = status_text({**doc, "verifyRequests": [done, waiting]}, 200, doc["time"])
    assert row(text, "verify/head, worker", "waiting", "90s", "-",
               "a weight sync to worker is in flight (request 7f3a)")
    assert "1b2c" not in text
    running = {"step": "verify/worker", "kind": "verify", "node": "worker", "state": "running", "seconds": 65.2,
               "deadlineIn": 3534.8, "bytesDone": 0, "bytesTotal": None, "bytesPerSecond": None, "request": "7f3a",
               "repair": False}
    doc = {**doc, "operations": [running], "verifyRequests": [{**waiting, "state": "running", "running": "worker"}]}
    assert row(status_text(doc, 80, doc["time"]), "verify/worker", "running", "65s", "in 58m", "-")


# ------------------------------------------------------------------------------------------------ blockers

def test_blockers_are_the_plan_s_the_holds_and_the_drift_only_the_operator_fixes():
    doc = copy.deepcopy(fixture("status-copying"))
    doc["held"] = {"link/worker": "ip: RTNETLINK answers: Operation not permitted"}
    doc["drift"].append({"node": "worker", "kind": "memory", "resource": "memory/worker",
                         "expected": ">= 100.0 GiB available", "observed": "3.1 GiB available of 119.7 GiB",
                         "actionable": False, "blocking": True})
    text = status_text(doc, 200, doc["time"])
    blockers = section(text, "BLOCKERS")
    for b in doc["lastPlan"]["blocked"]:
        assert row(blockers, b["node"], "plan", b["reason"][:40])
    assert row(blockers, "worker", "held link/worker", "ip: RTNETLINK answers: Operation not permitted")
    assert row(blockers, "worker", "memory/worker",
               "expected >= 100.0 GiB available, observed 3.1 GiB available of 119.7 GiB")
    assert row(section(text, "NODES"), "worker", "yes", "short: 3.1 GiB available of 119.7 GiB")


def test_an_unreachable_node_is_said_in_its_row_and_as_a_blocker():
    doc = copy.deepcopy(fixture("status-held"))
    for c in doc["conditions"]:
        if c["node"] == "worker" and c["type"] != "StepsHeld":
            c.update(status="Unknown", reason="NodeUnreachable", message="")
    next(c for c in doc["conditions"] if (c["node"], c["type"]) == ("worker", "Reachable")).update(
        status="False", reason="Unreachable", message="timed out")
    doc["drift"].append({"node": "worker", "kind": "unreachable", "resource": "node/worker",
                         "expected": "reachable over SSH", "observed": "timed out", "actionable": False,
                         "blocking": True})
    text = status_text(doc, 80, doc["time"])
    assert row(section(text, "NODES"), "worker", "no", "unknown", "unknown", "unknown")
    assert row(section(text, "BLOCKERS"), "worker", "node/worker", "expected reachable over SSH, observed timed out")
    assert row(section(text, "CONDITIONS"), "worker", "Reachable", "False")


# ------------------------------------------------------------------------------------------------ the rest

def test_the_compact_form_lists_the_conditions_not_as_they_should_be_and_counts_the_others():
    doc = fixture("status-held")
    compact, wide = status_text(doc, 80, doc["time"]), status_text(doc, 80, doc["time"], wide=True)
    node_conditions = [c for c in doc["conditions"] if c["node"]]
    assert row(compact, "head", "StepsHeld", "True")  # True is the news for a hold
    assert "ServingBusy" not in compact and "ServingBusy" in wide  # False is as it should be for a full queue
    hidden = sum(1 for c in node_conditions if c["type"] not in compact)
    assert hidden and f"({len(node_conditions) - 2} more node conditions as they should be" in compact
    assert all(row(wide, c["node"], c["type"]) for c in node_conditions)


@pytest.mark.parametrize("wide", [False, True], ids=["compact", "wide"])
def test_text_from_the_nodes_is_shown_literally_and_cannot_pass_for_a_row(wide):
    doc = {"phase": "Degraded\x1b[2J", "generation": 3, "observedGeneration": 2, "lastError": HOSTILE,
           "conditions": [{"node": "head", "type": "ServingRunning", "status": "False", "reason": "Crashed[b]",
                           "message": HOSTILE, "lastTransitionTime": "2026-12-06T11:42:05Z"}],
           "operations": [{"step": "stop-container/head/[/x]\x1b[2J", "state": "running", "seconds": 3,
                           "deadlineIn": 10}]}
    text = status_text(doc, 80, 0, wide)
    assert_terminal_safe(text)
    assert "[/rank0]" in text and "Crashed[b]" in text and "\\x1b]0;pwned\\x07" in text and "[/x]\\x1b[2J" in text
    if wide:  # the message's own lines are shown as lines, each indented under its row
        assert "    mode: enforce" in text.splitlines()


@pytest.mark.parametrize("doc,error", [
    ({"phase": "Converged", "conditions": [{"type": "Ready"}]}, KeyError),
    ({"phase": "Converging", "conditions": ["x"]}, TypeError),
    ({"phase": "Converged", "operations": [{"step": "s", "state": "r", "seconds": "x", "deadlineIn": 1}]}, ValueError),
    ({"phase": "Converged", "conditions": [{"node": "", "type": "Ready", "status": "True", "reason": "Converged",
                                            "message": "", "lastTransitionTime": "yesterday"}]}, ValueError),
])
def test_a_document_it_cannot_read_raises(doc, error):
    """The client turns these into "did not answer a reconciler status document" (exit 1)."""
    with pytest.raises(error):
        status_text(doc, 80, 0)


def test_a_rollback_is_the_news_and_its_absence_is_not():
    """RolledBack=True says what runs instead of the file and what to do, in the cluster's conditions (listed
    whole, as Ready and DesiredStateValid are); False says the file is in force."""
    doc = fixture("status-held")
    quiet = {**doc, "conditions": [*doc["conditions"], {
        "node": "", "type": "RolledBack", "status": "False", "reason": "FileInForce", "message": "",
        "lastTransitionTime": "2026-12-02T15:41:18Z"}]}
    assert "FileInForce" in row(status_text(quiet, 200, doc["time"]), "RolledBack", "False")
    news = {**doc, "phase": "RolledBack", "conditions": [*doc["conditions"], {
        "node": "", "type": "RolledBack", "status": "True", "reason": "FailedChange",
        "message": "generation 3 never served (await-health/head: exited); generation 2 is served in its place",
        "lastTransitionTime": "2026-12-02T15:41:18Z"}]}
    shown = status_text(news, 200, doc["time"])
    assert "FailedChange" in row(shown, "RolledBack", "True") and "generation 2 is served" in shown
