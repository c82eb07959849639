"""The monitoring files: Prometheus alert rules (and their promtool unit tests), the Grafana dashboard and
the Grafana provisioning (datasource, dashboard provider, Grafana-managed alert rules), and the runbook.

promtool is required, not optional: `make test` installs it (Debian's `prometheus` package, via
testbed/install-deps.sh). Every metric name used in a query must be one `reconciler.metrics.REGISTRY` exports
(except `up` and vLLM's own `vllm:` metrics), so a renamed metric breaks here, not silently on a dashboard.
"""

from __future__ import annotations

import importlib
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
MON = ROOT / "monitoring"
ALERTS = MON / "alerts.yaml"
ALERT_TESTS = MON / "alerts.test.yaml"
DASHBOARD = MON / "grafana" / "dashboard.json"
PROVISIONING = MON / "grafana" / "provisioning"
DATASOURCES = PROVISIONING / "datasources" / "prometheus.yaml"
DASHBOARD_PROVIDERS = PROVISIONING / "dashboards" / "spark-reconciler.yaml"
GRAFANA_ALERTS = PROVISIONING / "alerting" / "spark-reconciler.yaml"
TROUBLESHOOTING = ROOT / "docs" / "troubleshooting.md"
RUNBOOK_PREFIX = "https://github.com/spark-reconciler/spark-reconciler/blob/main/docs/troubleshooting.md#"

LOW_MEMORY_BYTES = 8 * 2**30  # the ReconcilerLowMemory threshold, documented in alerts.yaml and the runbook

# The metrics issue 6 names (exported series names).
ISSUE_METRICS = {
    "reconciler_drift", "reconciler_converged", "reconciler_phase", "reconciler_condition",
    "reconciler_reconcile_duration_seconds_bucket", "reconciler_reconcile_duration_seconds_sum",
    "reconciler_reconcile_duration_seconds_count", "reconciler_reconciles_total", "reconciler_steps_total",
    "reconciler_step_duration_seconds_bucket", "reconciler_step_duration_seconds_sum",
    "reconciler_step_duration_seconds_count", "reconciler_step_hold", "reconciler_node_reachable",
    "reconciler_observe_duration_seconds_bucket", "reconciler_observe_duration_seconds_sum",
    "reconciler_observe_duration_seconds_count", "reconciler_desired_state_valid",
    "reconciler_desired_state_generation", "reconciler_observed_generation",
    "reconciler_last_converged_timestamp_seconds", "reconciler_fabric_link_up",
    "reconciler_memory_available_bytes",
    "reconciler_weights_bytes", "reconciler_weights_sync_bytes_total", "reconciler_serving_healthy",
    "reconciler_events_total", "reconciler_build_info",
}
# What the dashboard must show (issue 6: phase, drift, conditions, durations, weight sync, serving, events).
DASHBOARD_MUST_USE = {
    "reconciler_phase", "reconciler_converged", "reconciler_drift", "reconciler_condition",
    "reconciler_reconcile_duration_seconds_bucket", "reconciler_step_duration_seconds_bucket",
    "reconciler_steps_total", "reconciler_step_hold", "reconciler_weights_bytes",
    "reconciler_weights_sync_bytes_total", "reconciler_serving_healthy", "reconciler_memory_available_bytes",
    "reconciler_events_total", "vllm:num_requests_running", "vllm:num_requests_waiting",
    "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
}


# -------------------------------------------------------------------------------------------------- helpers

def promtool() -> str:
    path = shutil.which("promtool") or ("/usr/bin/promtool" if Path("/usr/bin/promtool").exists() else None)
    assert path, ("promtool not found: install Debian's `prometheus` package "
                  "(make test / testbed/install-deps.sh do)")
    return path


def run_promtool(*args: str, cwd: Path = MON) -> subprocess.CompletedProcess:
    return subprocess.run([promtool(), *args], cwd=cwd, capture_output=True, text=True, timeout=120, check=False)


def load_yaml(path: Path):
    return yaml.safe_load(path.read_text())


def prometheus_rules() -> list[dict]:
    doc = load_yaml(ALERTS)
    [group] = [g for g in doc["groups"] if g["name"] == "spark-reconciler"]
    return [r for r in group["rules"] if "alert" in r]


def grafana_rules() -> list[dict]:
    doc = load_yaml(GRAFANA_ALERTS)
    return [r for g in doc["groups"] for r in g["rules"]]


def all_panels(panels: list[dict]) -> list[dict]:
    """Every panel, including those nested in (collapsed) rows."""
    out = []
    for p in panels:
        out.append(p)
        out += all_panels(p.get("panels", []))
    return out


_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless",
             "offset", "inf", "nan", "Inf", "NaN", "atan2", "start", "end"}


def metric_names(expr: str) -> set[str]:
    """Metric names a PromQL expression selects (enough of PromQL for our queries; no parser needed)."""
    e = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # string literals (label values, Grafana variables)
    e = re.sub(r"'(?:[^'\\]|\\.)*'", "''", e)
    e = re.sub(r"`[^`]*`", "``", e)
    e = re.sub(r"\{[^{}]*\}", " ", e)  # label matchers
    e = re.sub(r"\[[^\]]*\]", " ", e)  # ranges and subqueries
    e = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", e)  # label lists
    names = set()
    for m in re.finditer(r"(?<![\w:$.])([A-Za-z_:][\w:]*)\s*(\()?", e):
        name, call = m.group(1), m.group(2)
        if not call and name not in _KEYWORDS:
            names.add(name)
    return names


def exported_metric_names() -> set[str]:
    """Series names `reconciler.metrics.REGISTRY` exports (a family without samples yet still counts)."""
    from prometheus_client import CollectorRegistry

    metrics = importlib.import_module("reconciler.metrics")
    registry = getattr(metrics, "REGISTRY", None)
    assert isinstance(registry, CollectorRegistry), "reconciler.metrics must define REGISTRY"
    suffixes = {
        "counter": ["_total", "_created"],
        "histogram": ["_bucket", "_sum", "_count", "_created"],
        "gaugehistogram": ["_bucket", "_gsum", "_gcount"],
        "summary": ["", "_sum", "_count", "_created"],
        "info": ["_info"],
        "gauge": [""], "unknown": [""], "untyped": [""], "stateset": [""], "enum": [""],
    }
    names: set[str] = set()
    for family in registry.collect():
        names.update(family.name + s for s in suffixes.get(family.type, [""]))
        names.update(sample.name for sample in family.samples)
    return names


def checked(names: set[str]) -> set[str]:
    return {n for n in names if n != "up" and not n.startswith("vllm:")}


def github_anchor(heading: str) -> str:
    """GitHub's heading anchor: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"`([^`]*)`", r"\1", heading.strip()).lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def troubleshooting_anchors() -> set[str]:
    anchors, fenced = set(), False
    for line in TROUBLESHOOTING.read_text().splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced and (m := re.match(r"#{1,6}\s+(.+?)\s*#*\s*$", line)):
            anchors.add(github_anchor(m.group(1)))
    return anchors


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def dashboard_exprs() -> list[str]:
    d = dashboard()
    exprs = [t["expr"] for p in all_panels(d["panels"]) for t in p.get("targets", []) if "expr" in t]
    for var in d.get("templating", {}).get("list", []):
        if var.get("type") == "query":
            q = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
            m = re.fullmatch(r"\s*label_values\((.*),\s*\w+\s*\)\s*", q)
            exprs.append(m.group(1) if m else q)
    return exprs


def grafana_query_exprs() -> list[str]:
    return [d["model"]["expr"] for r in grafana_rules() for d in r["data"] if "expr" in d.get("model", {})]


def norm(expr: str) -> str:
    return re.sub(r"\s+", " ", expr).strip()


def duration_seconds(value: str | None) -> int:
    if not value:
        return 0
    units = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}
    total = 0.0
    for number, unit in re.findall(r"(\d+)(ms|s|m|h|d|w)", value):
        total += int(number) * units[unit]
    return int(total)


# ------------------------------------------------------------------------------------------------- promtool

def test_promtool_check_rules():
    result = run_promtool("check", "rules", ALERTS.name)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_promtool_test_rules():
    result = run_promtool("test", "rules", ALERT_TESTS.name)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_every_query_is_valid_promql(tmp_path):
    """promtool parses every dashboard and Grafana-rule query (as recording rules, Grafana variables set)."""
    exprs = dashboard_exprs() + grafana_query_exprs()
    rules = []
    for i, expr in enumerate(exprs):
        expr = expr.replace("$__rate_interval", "5m").replace("$__interval", "1m").replace("$node", ".*")
        rules.append({"record": f"spark_reconciler:query_{i}", "expr": expr})
    path = tmp_path / "queries.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "queries", "rules": rules}]}))
    result = run_promtool("check", "rules", str(path))
    assert result.returncode == 0, result.stdout + result.stderr


# ---------------------------------------------------------------------------------------------- alert rules

EXPECTED_ALERTS = {
    "ReconcilerDriftPersists", "ReconcilerNotConverged", "ReconcilerReconcileErrors", "ReconcilerStepHeld",
    "ReconcilerDown", "ReconcilerAbsent", "ReconcilerDesiredStateInvalid", "ReconcilerNodeUnreachable",
    "ReconcilerFabricLinkDown", "ReconcilerServingUnhealthy", "ReconcilerWeightsOutOfSync",
    "ReconcilerLowMemory",
}


def test_the_alerts_of_issue_6_exist():
    names = [r["alert"] for r in prometheus_rules()]
    assert len(names) == len(set(names)), "duplicate alert names"
    assert set(names) == EXPECTED_ALERTS


@pytest.mark.parametrize("rule", prometheus_rules(), ids=lambda r: r["alert"])
def test_alert_has_severity_summary_description_and_runbook(rule):
    assert rule.get("labels", {}).get("severity") in {"critical", "warning"}
    ann = rule.get("annotations", {})
    assert ann.get("summary", "").strip(), "summary missing"
    assert ann.get("description", "").strip(), "description missing"
    url = ann.get("runbook_url", "")
    assert url.startswith(RUNBOOK_PREFIX), url
    anchor = url[len(RUNBOOK_PREFIX):]
    assert anchor in troubleshooting_anchors(), f"no heading for #{anchor} in docs/troubleshooting.md"


@pytest.mark.parametrize("rule", prometheus_rules(), ids=lambda r: r["alert"])
def test_alert_descriptions_use_only_labels_the_expression_keeps(rule):
    """`sum by (node, kind)` keeps only node and kind; a template reading another label would render empty."""
    m = re.match(r"\s*\w+\s+by\s*\(([^)]*)\)", rule["expr"])
    if not m:
        return
    kept = {x.strip() for x in m.group(1).split(",")}
    used = set(re.findall(r"\$labels\.(\w+)", " ".join(rule["annotations"].values())))
    assert used <= kept, f"{rule['alert']} templates {used - kept}, which `by ({m.group(1)})` drops"


def test_every_alert_has_firing_and_non_firing_unit_tests():
    doc = load_yaml(ALERT_TESTS)
    assert ALERTS.name in doc["rule_files"]
    firing, quiet = set(), set()
    for group in doc["tests"]:
        for case in group.get("alert_rule_test", []):
            (firing if case.get("exp_alerts") else quiet).add(case["alertname"])
    names = {r["alert"] for r in prometheus_rules()}
    assert names - firing == set(), f"alerts without a firing test: {sorted(names - firing)}"
    assert names - quiet == set(), f"alerts without a non-firing test: {sorted(names - quiet)}"


def test_low_memory_threshold_is_the_documented_constant():
    [rule] = [r for r in prometheus_rules() if r["alert"] == "ReconcilerLowMemory"]
    assert norm(rule["expr"]) == f"reconciler_memory_available_bytes < {LOW_MEMORY_BYTES}"
    assert f"LOW_MEMORY_BYTES = {LOW_MEMORY_BYTES}" in ALERTS.read_text()
    assert str(LOW_MEMORY_BYTES) in TROUBLESHOOTING.read_text()


def test_weights_rule_matches_synced_to_expected_per_node():
    [rule] = [r for r in prometheus_rules() if r["alert"] == "ReconcilerWeightsOutOfSync"]
    assert "ignoring(state)" in rule["expr"].replace(" (", "(")


# --------------------------------------------------------------------------------------------- metric names

def test_registry_exports_the_metrics_of_issue_6():
    missing = ISSUE_METRICS - exported_metric_names()
    assert not missing, f"reconciler.metrics.REGISTRY does not export {sorted(missing)}"


def test_metric_name_extraction():
    quantile = 'histogram_quantile(0.95, sum by (le, kind) (rate(a_bucket{node=~"$node"}[$__rate_interval])))'
    assert metric_names(quantile) == {"a_bucket"}
    assert metric_names('x{state="synced"} < bool ignoring(state) y{state="expected"}') == {"x", "y"}
    assert metric_names("time() - last_ts") == {"last_ts"}
    assert metric_names('absent(up{job="j"})') == {"up"}
    assert metric_names("max by (i) (vllm:kv_cache_usage_perc or vllm:gpu_cache_usage_perc)") == \
        {"vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"}
    assert metric_names("sum(rate(c_total[5m])) by (node) / 8589934592") == {"c_total"}


@pytest.mark.parametrize("source", ["dashboard", "prometheus rules", "grafana rules"])
def test_every_metric_used_exists_in_reconciler_metrics(source):
    exprs = {"dashboard": dashboard_exprs,
             "prometheus rules": lambda: [r["expr"] for r in prometheus_rules()],
             "grafana rules": grafana_query_exprs}[source]()
    assert exprs
    used = set().union(*(metric_names(e) for e in exprs))
    unknown = checked(used) - exported_metric_names()
    assert not unknown, f"{source} use metrics reconciler.metrics does not export: {sorted(unknown)}"


# ------------------------------------------------------------------------------------------------ dashboard

def test_dashboard_structure():
    d = dashboard()
    assert d["uid"] == "spark-reconciler" and d["title"] == "spark-reconciler"
    assert isinstance(d["schemaVersion"], int)
    variables = {v["name"]: v for v in d["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    for panel in all_panels(d["panels"]):
        assert isinstance(panel.get("id"), int) and panel.get("type") and panel.get("title"), panel
        pos = panel["gridPos"]
        assert pos["x"] >= 0 and pos["w"] > 0 and pos["x"] + pos["w"] <= 24 and pos["h"] > 0, panel["title"]
        if panel["type"] == "row":
            assert "panels" in panel
            continue
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        assert panel["targets"], panel["title"]
        refs = [t["refId"] for t in panel["targets"]]
        assert len(refs) == len(set(refs)), panel["title"]
        for t in panel["targets"]:
            assert t["expr"].strip() and t["datasource"]["uid"] == "${datasource}", panel["title"]


def test_dashboard_panel_ids_are_unique_including_rows():
    ids = [p["id"] for p in all_panels(dashboard()["panels"])]
    assert len(ids) == len(set(ids)), sorted(i for i in ids if ids.count(i) > 1)


def test_dashboard_shows_what_issue_6_asks_for():
    d = dashboard()
    used = set().union(*(metric_names(e) for e in dashboard_exprs()))
    assert DASHBOARD_MUST_USE - used == set()
    assert used & {"vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"}
    exprs = " ".join(dashboard_exprs())
    assert "histogram_quantile(0.5," in exprs and "histogram_quantile(0.95," in exprs
    assert "rate(reconciler_weights_sync_bytes_total" in exprs
    [vllm_row] = [p for p in d["panels"] if p["type"] == "row" and p["title"] == "vLLM"]
    assert vllm_row["collapsed"] is True and vllm_row["panels"]
    assert all(n.startswith("vllm:") for p in vllm_row["panels"] for t in p["targets"]
               for n in metric_names(t["expr"]))


# --------------------------------------------------------------------------------------------- provisioning

def test_datasource_provisioning():
    doc = load_yaml(DATASOURCES)
    assert doc["apiVersion"] == 1
    [ds] = doc["datasources"]
    assert ds["type"] == "prometheus" and ds["url"] == "http://127.0.0.1:9090" and ds["uid"]


def test_dashboard_provisioning():
    doc = load_yaml(DASHBOARD_PROVIDERS)
    assert doc["apiVersion"] == 1
    [provider] = doc["providers"]
    assert provider["type"] == "file"
    assert provider["options"]["path"] == "/var/lib/grafana/dashboards/spark-reconciler"


def grafana_equivalent(a_expr: str, condition: str) -> str:
    """The Prometheus expression a Grafana rule (A = query, C = math on B = last(A)) stands for."""
    comparison = norm(condition.replace("$B", ""))
    if " bool " in a_expr and comparison == "== 1":  # A already compares (0/1); C selects the true ones
        return norm(a_expr.replace(" bool ", " "))
    if a_expr.strip().startswith("absent(") and comparison == "> 0":  # absent() is 1 or nothing
        return norm(a_expr)
    return norm(f"{a_expr} {comparison}")


def test_grafana_alert_rules_are_equivalent_to_the_prometheus_rules():
    doc = load_yaml(GRAFANA_ALERTS)
    assert doc["apiVersion"] == 1 and doc["groups"]
    ds_uid = load_yaml(DATASOURCES)["datasources"][0]["uid"]
    prom = {r["alert"]: r for r in prometheus_rules()}
    rules = grafana_rules()
    assert sorted(r["title"] for r in rules) == sorted(prom)
    uids = [r["uid"] for r in rules]
    assert len(uids) == len(set(uids)) and all(0 < len(u) <= 40 for u in uids)
    for group in doc["groups"]:
        assert group["name"] and group["folder"] and group["interval"]
    for rule in rules:
        p = prom[rule["title"]]
        data = {d["refId"]: d for d in rule["data"]}
        assert set(data) == {"A", "B", "C"} and rule["condition"] == "C", rule["title"]
        a, b, c = data["A"], data["B"], data["C"]
        assert a["datasourceUid"] == ds_uid and a["model"]["refId"] == "A"
        assert b["datasourceUid"] == "__expr__" and b["model"]["type"] == "reduce"
        assert b["model"]["expression"] == "A"
        assert c["datasourceUid"] == "__expr__" and c["model"]["type"] == "math"
        assert "$B" in c["model"]["expression"]
        equivalent = grafana_equivalent(a["model"]["expr"], c["model"]["expression"])
        assert equivalent == norm(p["expr"]), rule["title"]
        assert duration_seconds(rule.get("for")) == duration_seconds(p.get("for")), rule["title"]
        assert rule["labels"]["severity"] == p["labels"]["severity"], rule["title"]
        ann = rule["annotations"]
        assert ann["summary"] == p["annotations"]["summary"], rule["title"]
        assert ann["runbook_url"] == p["annotations"]["runbook_url"], rule["title"]
        assert ann.get("description", "").strip(), rule["title"]
        # Grafana's $value is a text listing every refId; templates must read $values.B instead.
        assert not re.search(r"\$value\b(?!s)", " ".join(ann.values())), rule["title"]


def test_troubleshooting_internal_links_resolve():
    links = set(re.findall(r"\]\(#([^)]+)\)", TROUBLESHOOTING.read_text()))
    assert links and links - troubleshooting_anchors() == set()
