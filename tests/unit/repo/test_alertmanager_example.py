"""The shipped Alertmanager example (monitoring/alertmanager.yaml, `reconciler print alertmanager`), issue 33:
one cause, one page where the alerts meet.

Checked three ways: `amtool check-config` accepts it and routes critical alerts to the pager only; every matcher
names alerts alerts.yaml defines and labels those alerts carry (by their promtool cases); and a real Alertmanager
(Debian's prometheus-alertmanager, on loopback) given the alerts of the issue's outages mutes what each cause
explains and nothing of another reconciler.

amtool and Alertmanager are required like promtool: Debian's `prometheus-alertmanager` package
(testbed/install-deps.sh).
"""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import subprocess
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from reconciler.core.drift import DRIFT_KINDS
from testbed import proc as harness
from testbed.proc import free_port, wait_for
from tests.unit.repo.test_monitoring import ALERT_TESTS, MON, load_yaml, prometheus_rules, shipped

ALERTMANAGER = MON / "alertmanager.yaml"
HERE, OTHER = "127.0.0.1:9464", "10.0.0.9:9464"  # this reconciler's instance, another one's


def tool(name: str) -> str:
    path = shutil.which(name) or (f"/usr/bin/{name}" if Path(f"/usr/bin/{name}").exists() else None)
    assert path, f"{name} not found: install Debian's `prometheus-alertmanager` package (testbed/install-deps.sh)"
    return path


def amtool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([tool("amtool"), *args], capture_output=True, text=True, timeout=60, check=False)


def config() -> dict:
    return load_yaml(ALERTMANAGER)


def test_reconciler_print_alertmanager_is_this_file():
    assert shipped("alertmanager").resolve() == ALERTMANAGER.resolve()


def test_amtool_accepts_it():
    result = amtool("check-config", str(ALERTMANAGER))
    assert result.returncode == 0 and "SUCCESS" in result.stdout, result.stdout + result.stderr
    assert f"{len(config()['inhibit_rules'])} inhibit rules" in result.stdout
    assert "level=warn" not in result.stderr, "a matcher the UTF-8 parser of Alertmanager >= 0.27 would not take"


@pytest.mark.parametrize(("severity", "receiver"), [("critical", "spark-reconciler-pager"),
                                                    ("warning", "spark-reconciler-tickets")])
def test_only_critical_alerts_page(severity, receiver):
    result = amtool("config", "routes", "test", f"--config.file={ALERTMANAGER}", "alertname=ReconcilerDown",
                    f"severity={severity}", "job=spark-reconciler", f"instance={HERE}")
    assert result.returncode == 0 and result.stdout.strip() == receiver, result.stdout + result.stderr


# ------------------------------------------------------------------------------- the matchers name real things

MATCHER = re.compile(r'^\s*(\w+)\s*(=~|!~|!=|=)\s*"(.*)"\s*$')


def alert_labels() -> dict[str, set[str]]:
    """Alert name -> the labels it fires with: its promtool cases' exp_labels (promtool compares them exactly)."""
    out: dict[str, set[str]] = {}
    for group in load_yaml(ALERT_TESTS)["tests"]:
        for case in group.get("alert_rule_test", []):
            for alert in case.get("exp_alerts") or []:
                out.setdefault(case["alertname"], {"alertname"}).update(alert["exp_labels"])
    return out


def selected(matchers: list[str]) -> set[str]:
    """The alerts of alerts.yaml the matchers select by name."""
    names = {r["alert"] for r in prometheus_rules()}
    for text in matchers:
        m = MATCHER.match(text)
        assert m, f"not a double-quoted matcher: {text!r}"
        label, op, value = m.groups()
        if label == "alertname":
            test = {"=": lambda n, v=value: n == v, "!=": lambda n, v=value: n != v,
                    "=~": lambda n, v=value: re.fullmatch(v, n) is not None,
                    "!~": lambda n, v=value: re.fullmatch(v, n) is None}[op]
            names = {n for n in names if test(n)}
    return names


@pytest.mark.parametrize("rule", config()["inhibit_rules"], ids=lambda r: str(r["source_matchers"]))
def test_every_inhibit_rule_names_real_alerts_and_their_labels(rule):
    labels = alert_labels()
    sources, targets = selected(rule["source_matchers"]), selected(rule["target_matchers"])
    assert sources and targets, rule
    assert not sources & targets, "an alert on both sides is never muted by its peers (Alertmanager's docs)"
    for text in rule["target_matchers"] + rule["source_matchers"]:
        label, op, value = MATCHER.match(text).groups()
        for name in (targets if text in rule["target_matchers"] else sources):
            assert label in labels[name], (name, label)
        if label == "alertname" and not value.endswith(".+"):  # each alternative is an alert, not a typo
            assert set(value.split("|")) <= {r["alert"] for r in prometheus_rules()}, value
        if label == "kind":
            assert set(value.split("|")) <= set(DRIFT_KINDS), value
    for label in rule["equal"]:
        for name in sources | targets:
            assert label in labels[name], f"{name} has no {label}: `equal` would compare it as empty"


def test_the_route_groups_by_labels_every_alert_carries():
    labels = alert_labels()
    for label in config()["route"]["group_by"]:
        assert all(label in have for name, have in labels.items() if name != "ReconcilerAbsent"), label


# ------------------------------------------------------------------------ a real Alertmanager mutes the causes


def post(base: str, alerts: list[dict[str, str]]) -> None:
    body = json.dumps([{"labels": a} for a in alerts]).encode()
    request = urllib.request.Request(f"{base}/api/v2/alerts", data=body, method="POST",
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=10) as response:
        assert response.status == 200


def settled(base: str, expected: set[tuple[str, ...]], posted: int) -> dict[tuple[str, ...], str]:
    """The alerts' states once Alertmanager has judged every posted one: its inhibitor works beside the API, so
    right after a POST an alert it is about to mute can still read active. Waits (30 s at most) for every alert to
    be listed and the active ones to be `expected`; the last answer either way, for the caller's assert."""
    last: dict[tuple[str, ...], str] = {}

    def judged() -> bool:
        nonlocal last
        last = states(base)
        return len(last) == posted and {k for k, state in last.items() if state == "active"} == expected

    with contextlib.suppress(harness.TestbedError):  # not settled in time: the assert that follows says how it stands
        wait_for(judged, timeout=30, what="Alertmanager's judgement of the posted alerts")
    return last


def states(base: str) -> dict[tuple[str, ...], str]:
    """(alertname, instance, node, kind) -> active or suppressed, as the API reports it now."""
    with urllib.request.urlopen(f"{base}/api/v2/alerts", timeout=10) as response:
        alerts = json.load(response)
    return {tuple(a["labels"].get(k, "") for k in ("alertname", "instance", "node", "kind")): a["status"]["state"]
            for a in alerts}


@pytest.fixture
def alertmanager(tmp_path) -> Iterator[str]:
    """The example loaded by Debian's Alertmanager on a loopback port, without clustering."""
    port = free_port()
    log = (tmp_path / "alertmanager.log").open("w")
    proc = subprocess.Popen([tool("prometheus-alertmanager"), f"--config.file={ALERTMANAGER}",
                             f"--storage.path={tmp_path / 'data'}", f"--web.listen-address=127.0.0.1:{port}",
                             "--cluster.listen-address="], stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        assert proc.poll() is None, (tmp_path / "alertmanager.log").read_text()
        with urllib.request.urlopen(f"{base}/-/ready", timeout=2) as response:
            return response.status == 200
    try:
        wait_for(ready, timeout=30, what="Alertmanager ready")
        yield base
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()


def alert(name: str, severity: str, instance: str = HERE, **labels: str) -> dict[str, str]:
    return {"alertname": name, "severity": severity, "job": "spark-reconciler", "instance": instance, **labels}


def test_each_cause_mutes_what_it_explains_and_nothing_of_another_reconciler(alertmanager):
    """The alerts the rules before issue 33 fired for an unreachable head (6, 3 critical), a stuck daemon's and a
    down serving's, all at once and for two reconcilers: only the causes stay active."""
    posted = [
        # the unreachable head, as the old rules raised it
        alert("ReconcilerNodeUnreachable", "critical", node="spark-a"),
        alert("ReconcilerNodeUnreachable", "critical", node="spark-b"),
        alert("ReconcilerServingUnhealthy", "critical"),
        alert("ReconcilerDriftPersists", "warning", node="spark-a", kind="unreachable"),
        alert("ReconcilerDriftPersists", "warning", node="spark-b", kind="unreachable"),
        alert("ReconcilerNotConverged", "warning"),
        alert("ReconcilerFabricLinkDown", "critical", node="spark-b"),
        # another reconciler: its serving is down, with the drift it explains and one it does not
        alert("ReconcilerServingUnhealthy", "critical", OTHER),
        alert("ReconcilerDriftPersists", "warning", OTHER, node="spark-a", kind="health"),
        alert("ReconcilerDriftPersists", "warning", OTHER, node="spark-b", kind="co-tenant"),
        alert("ReconcilerNotConverged", "warning", OTHER),
    ]
    post(alertmanager, posted)
    expected = {("ReconcilerNodeUnreachable", HERE, "spark-a", ""), ("ReconcilerNodeUnreachable", HERE, "spark-b", ""),
                ("ReconcilerServingUnhealthy", OTHER, "", ""),
                ("ReconcilerDriftPersists", OTHER, "spark-b", "co-tenant")}
    seen = settled(alertmanager, expected, len(posted))
    assert {k for k, state in seen.items() if state == "active"} == expected and len(seen) == len(posted), seen
    # one page for this reconciler: both unreachable nodes in one notification (grouped by alertname and instance)
    pages = wait_for(lambda: paging(alertmanager), timeout=30, what="the pager's groups")
    assert pages == {("ReconcilerNodeUnreachable", HERE): 2, ("ReconcilerServingUnhealthy", OTHER): 1}, pages


def paging(base: str) -> dict[tuple[str, str], int]:
    """(alertname, instance) of each group the pager receiver notifies -> its active alerts; {} until every
    posted alert is in a group."""
    with urllib.request.urlopen(f"{base}/api/v2/alerts/groups", timeout=10) as response:
        groups = json.load(response)
    if sum(len(g["alerts"]) for g in groups) < 11:
        return {}
    return {(g["labels"]["alertname"], g["labels"]["instance"]): active
            for g in groups if g["receiver"]["name"] == "spark-reconciler-pager"
            and (active := sum(a["status"]["state"] == "active" for a in g["alerts"]))}


def test_a_stopped_or_stuck_daemon_mutes_everything_of_its_reconciler(alertmanager):
    posted = [
        alert("ReconcilerDown", "critical"),
        alert("ReconcilerStepHeld", "critical", node="spark-b", kind="weights"),
        alert("ReconcilerServingUnhealthy", "critical"),
        alert("ReconcilerLoopStalled", "critical", OTHER),
        alert("ReconcilerLowMemory", "warning", OTHER, node="spark-a"),
    ]
    post(alertmanager, posted)
    expected = {("ReconcilerDown", HERE, "", ""), ("ReconcilerLoopStalled", OTHER, "", "")}
    seen = settled(alertmanager, expected, len(posted))
    assert {k for k, state in seen.items() if state == "active"} == expected and len(seen) == len(posted), seen


def test_the_operations_guide_installs_and_checks_it():
    """docs/operations.md, "Alerts: one path": where the example goes and the amtool check (issue 33)."""
    from tests.unit.repo.test_monitoring import OPERATIONS, section

    alerts = section(OPERATIONS.read_text(), "### Alerts: one path")
    assert "reconciler print alertmanager" in alerts and "amtool check-config" in alerts
    assert "inhibit" in alerts and "unless" in alerts  # both halves of one cause, one page
