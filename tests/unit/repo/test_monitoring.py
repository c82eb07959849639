"""The monitoring files: Prometheus alert rules (and their promtool unit tests), the Grafana dashboard and
the Grafana provisioning (datasource, dashboard provider, Grafana-managed alert rules), the runbook, and the copy
commands and scrape config of docs/operations.md that must agree with them.

What the dashboard shows is checked twice: here, panel queries evaluated by promtool and mapped through the panels'
own value mappings and thresholds by tests/e2e/grafana.py (itself tested below on hand-made panel snippets); end to
end, every panel against a real Prometheus scraping the daemon (tests/e2e/test_grafana_panels.py).

promtool is required, not optional: `make test` installs it (Debian's `prometheus` package, via
testbed/install-deps.sh). Every metric name used in a query must be one `reconciler.loop.metrics.REGISTRY` exports
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

from tests.e2e import grafana

ROOT = Path(__file__).resolve().parents[3]
MON = ROOT / "monitoring"
ALERTS = MON / "alerts.yaml"
ALERT_TESTS = MON / "alerts.test.yaml"
DASHBOARD = MON / "grafana" / "dashboard.json"
PROVISIONING = MON / "grafana" / "provisioning"
DATASOURCES = PROVISIONING / "datasources" / "prometheus.yaml"
DASHBOARD_PROVIDERS = PROVISIONING / "dashboards" / "spark-reconciler.yaml"
GRAFANA_ALERTS = PROVISIONING / "alerting" / "spark-reconciler.yaml"
TROUBLESHOOTING = ROOT / "docs" / "troubleshooting.md"
OPERATIONS = ROOT / "docs" / "operations.md"
README = ROOT / "README.md"
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
    # issue 33: the progress of copies and cold starts, and the cold start's allowance
    "reconciler_operation_progress_ratio", "reconciler_operation_bytes_per_second", "reconciler_serving_start_stage",
    "reconciler_serving_started_timestamp_seconds", "reconciler_serving_health_timeout_seconds",
    # issue 35: the deployments in force, and the serving panels chosen by them
    "reconciler_deployment_info",
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
    """Series names `reconciler.loop.metrics.REGISTRY` exports (a family without samples yet still counts)."""
    from prometheus_client import CollectorRegistry

    metrics = importlib.import_module("reconciler.loop.metrics")
    registry = getattr(metrics, "REGISTRY", None)
    assert isinstance(registry, CollectorRegistry), "reconciler.loop.metrics must define REGISTRY"
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
        expr = expr.replace("$deployment", ".*")
        rules.append({"record": f"spark_reconciler:query_{i}", "expr": expr})
    path = tmp_path / "queries.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "queries", "rules": rules}]}))
    result = run_promtool("check", "rules", str(path))
    assert result.returncode == 0, result.stdout + result.stderr


# ---------------------------------------------------------------------------------------------- alert rules

EXPECTED_ALERTS = {
    "ReconcilerDriftPersists", "ReconcilerNotConverged", "ReconcilerReconcileErrors", "ReconcilerStepHeld",
    "ReconcilerDown", "ReconcilerAbsent", "ReconcilerDesiredStateInvalid", "ReconcilerNodeUnreachable",
    "ReconcilerFabricLinkDown", "ReconcilerFabricPortDegraded", "ReconcilerServingUnhealthy",
    "ReconcilerWeightsOutOfSync",
    "ReconcilerLowMemory", "ReconcilerLoopStalled", "ReconcilerGpuStackSkew",
    "ReconcilerRolledBack",  # a failed change rolled back (reconciler.loop.history)
    "ReconcilerServingWrongAnswer",  # serving.verify: the fixed prompt answered wrong (issue 52)
    "ReconcilerNcclOnSockets",  # a rank of a deployment across nodes fell back to NET/Socket (issue 52)
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
    m = re.match(r"[\s(]*\w+\s+by\s*\(([^)]*)\)", rule["expr"])
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


# The one alert without an instance, and why.
NO_INSTANCE = {"ReconcilerAbsent": "absent() fires because no target of the job exists: there is no instance"}


def test_every_alert_keeps_job_and_instance():
    """promtool compares an alert's exp_labels with the labels it fires with, exactly: so every firing case naming
    job and instance shows that its rule's expression keeps them (DriftPersists dropped both with `sum by (node,
    kind)`, issue 33). Alertmanager groups and inhibits by them (alertmanager.yaml)."""
    doc = load_yaml(ALERT_TESTS)
    checked_alerts = set()
    for group in doc["tests"]:
        for case in group.get("alert_rule_test", []):
            for alert in case.get("exp_alerts") or []:
                labels, name = set(alert["exp_labels"]), case["alertname"]
                checked_alerts.add(name)
                assert "job" in labels, (name, labels)
                assert ("instance" in labels) != (name in NO_INSTANCE), (name, labels, NO_INSTANCE.get(name))
    assert checked_alerts == {r["alert"] for r in prometheus_rules()}


def in_flight_kinds(expr: str) -> set[str]:
    [kinds] = re.findall(r'reconciler_operations_in_flight\{kind=~"([^"]+)"\}', expr)
    return set(kinds.split("|"))


def test_the_cold_start_allowance_names_the_steps_of_a_serving_start():
    """ServingUnhealthy keeps quiet while a serving start is in flight (COLD_START, alerts.yaml): the kinds are the
    serving chain's after its stop (reconciler.core.kinds.SERVING_CHAIN), so a renamed step kind breaks here, not
    silently in a page during every cold start; the dashboard's allowance panel reads the same kinds."""
    from reconciler.core.kinds import SERVING_CHAIN, STEP_KINDS

    [rule] = [r for r in prometheus_rules() if r["alert"] == "ReconcilerServingUnhealthy"]
    kinds = in_flight_kinds(rule["expr"])
    assert kinds == set(SERVING_CHAIN) - {"stop-serving"} and kinds <= set(STEP_KINDS)
    [target] = panel_titled("Cold start: allowance used")["targets"]
    assert in_flight_kinds(target["expr"]) == kinds
    assert 'reconciler_step_failures{kind="await-health"}' in rule["expr"] and "await-health" in STEP_KINDS


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
    assert not missing, f"reconciler.loop.metrics.REGISTRY does not export {sorted(missing)}"


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
    assert not unknown, f"{source} use metrics reconciler.loop.metrics does not export: {sorted(unknown)}"


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


def test_datasource_is_not_marked_default():
    """`isDefault: true` stops Grafana ("Only one datasource per organization can be marked as default") where
    another provisioned datasource is the default, and takes the default over from the user's otherwise."""
    [ds] = load_yaml(DATASOURCES)["datasources"]
    assert not ds.get("isDefault", False)


def test_datasource_file_says_what_to_change_in_a_container():
    text = DATASOURCES.read_text()
    assert "host.docker.internal" in text and "--network host" in text


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


# ------------------------------------------------------------------------ provisioning files agree (issue 20)

def datasource_uid() -> str:
    [ds] = load_yaml(DATASOURCES)["datasources"]
    return ds["uid"]


def test_the_dashboard_preselects_the_provisioned_datasource():
    """Not the default datasource any more: the dashboard's $datasource names it (by uid and name; Grafana falls
    back to the default datasource when neither exists, e.g. with your own datasource)."""
    [ds] = load_yaml(DATASOURCES)["datasources"]
    [variable] = [v for v in dashboard()["templating"]["list"] if v["name"] == "datasource"]
    assert variable["current"]["value"] == ds["uid"] and variable["current"]["text"] == ds["name"]


def test_every_grafana_rule_queries_the_provisioned_datasource():
    """A rule whose datasourceUid names no datasource fires DatasourceError; `__expr__` (server-side
    expressions: reduce, math) is Grafana's expression engine, not a datasource."""
    uid = datasource_uid()
    queries = 0
    for rule in grafana_rules():
        for d in rule["data"]:
            if "expr" in d["model"]:
                assert d["datasourceUid"] == uid, (rule["title"], d["refId"], d["datasourceUid"])
                queries += 1
            else:
                assert d["datasourceUid"] == "__expr__", (rule["title"], d["refId"], d["datasourceUid"])
    assert queries == len(grafana_rules())


def shipped(name: str) -> Path:
    """The tree's file that `reconciler print NAME` prints (reconciler/files.SHIPPED), as its monitoring/ link."""
    from reconciler import files

    return MON / Path(files.SHIPPED[name][0]).relative_to("monitoring")


def documented_sed() -> re.Match:
    text = OPERATIONS.read_text()
    m = re.search(r"reconciler print (grafana-alerting) \| sed '(s/([^/']+)/([^/']+)/)'", text)
    assert m, "docs/operations.md shows no `reconciler print grafana-alerting | sed 's/UID/YOUR_UID/'`"
    return m


def test_the_datasource_uid_is_written_once_and_the_documented_sed_retargets_every_rule():
    uid = datasource_uid()
    text = GRAFANA_ALERTS.read_text()
    assert text.count(uid) == 1, "the uid is written once (a YAML anchor the other rules refer to)"
    m = documented_sed()
    assert m.group(3) == uid, f"the documented sed replaces {m.group(3)!r}, the datasource uid is {uid!r}"
    assert shipped(m.group(1)).resolve() == GRAFANA_ALERTS.resolve()
    sed = shutil.which("sed")
    assert sed
    result = subprocess.run([sed, m.group(2).replace(m.group(4), "my-own-prometheus"), str(GRAFANA_ALERTS)],
                            capture_output=True, text=True, timeout=30, check=True)
    retargeted = yaml.safe_load(result.stdout)
    original = load_yaml(GRAFANA_ALERTS)
    rules = [r for g in retargeted["groups"] for r in g["rules"]]
    for rule, before in zip(rules, grafana_rules(), strict=True):
        for d, d0 in zip(rule["data"], before["data"], strict=True):
            assert d["datasourceUid"] == ("__expr__" if d0["datasourceUid"] == "__expr__" else "my-own-prometheus")
    # nothing else changed
    for rule in rules:
        for d in rule["data"]:
            if d["datasourceUid"] == "my-own-prometheus":
                d["datasourceUid"] = uid
    assert retargeted == original


def test_the_grafana_rules_and_the_prometheus_rules_are_the_same_alerts():
    prom = {r["alert"]: r for r in prometheus_rules()}
    graf = {r["title"]: r for r in grafana_rules()}
    assert sorted(graf) == sorted(prom)
    for name, rule in graf.items():
        data = {d["refId"]: d for d in rule["data"]}
        assert grafana_equivalent(data["A"]["model"]["expr"], data["C"]["model"]["expression"]) == \
            norm(prom[name]["expr"]), name
        assert duration_seconds(rule.get("for")) == duration_seconds(prom[name].get("for")), name
        # the same labels named in the texts (Grafana's value is $values.B, Prometheus' $value)
        for key in ("summary", "description"):
            used = set(re.findall(r"\$labels\.(\w+)", rule["annotations"][key]))
            assert used == set(re.findall(r"\$labels\.(\w+)", prom[name]["annotations"][key])), (name, key)


def test_serving_unhealthy_does_not_call_the_reconciler_vllm():
    """reconciler_serving_healthy has no label but the deployment's name: $labels.instance is the reconciler's
    address (job spark-reconciler), not vLLM's, and the texts must say so, naming the deployment (issue 35)."""
    from reconciler.loop import metrics

    assert metrics.serving_healthy._labelnames == ("deployment",)
    [prom] = [r for r in prometheus_rules() if r["alert"] == "ReconcilerServingUnhealthy"]
    [graf] = [r for r in grafana_rules() if r["title"] == "ReconcilerServingUnhealthy"]
    for ann in (prom["annotations"], graf["annotations"]):
        assert "served by {{ $labels.instance }}" not in ann["summary"]
        assert "reconciler at {{ $labels.instance }}" in ann["summary"], ann["summary"]
        assert "deployment {{ $labels.deployment }}" in ann["summary"] and "{{ $labels.deployment }}" in \
            ann["description"], ann


# ---------------------------------------------------------------------------- docs/operations.md (issue 20)

def operations_text() -> str:
    return re.sub(r"\\\n\s*", " ", OPERATIONS.read_text())  # shell line continuations joined


def installed(text: str) -> list[tuple[Path, str]]:
    """(the tree's file, where it goes) for every `reconciler print NAME | sudo install -D -m 0644 /dev/stdin DEST`."""
    return [(shipped(name).resolve(), dest) for name, dest in
            re.findall(r"\breconciler print ([\w-]+) \| sudo install -D -m 0644 /dev/stdin (\S+)", text)]


def test_docs_install_every_provisioning_file_where_grafana_reads_it():
    done = installed(operations_text())
    for src, kind in ((DATASOURCES, "datasources"), (DASHBOARD_PROVIDERS, "dashboards"),
                      (GRAFANA_ALERTS, "alerting")):
        assert any(path == src.resolve() and re.fullmatch(rf"/etc/grafana/provisioning/{kind}/[\w.-]+\.yaml", dest)
                   for path, dest in done), \
            f"docs/operations.md does not install {src.relative_to(ROOT)} into /etc/grafana/provisioning/{kind}/"


def test_the_dashboard_provider_path_is_where_the_docs_copy_the_dashboard():
    [provider] = load_yaml(DASHBOARD_PROVIDERS)["providers"]
    path = provider["options"]["path"]
    copies = [dest for src, dest in installed(operations_text()) if src == DASHBOARD.resolve()]
    assert copies, "docs/operations.md does not say where dashboard.json goes"
    for dest in copies:
        assert str(Path(dest).parent) == path and dest.endswith(".json"), (dest, path)
    # the container mounts the provider's directory (or a parent of it) where Grafana looks
    mounts = re.findall(r"-v (/\S+):(/\S+?)(?::ro)?\s", operations_text())
    assert any(path.startswith(inner) and outer == inner for outer, inner in mounts), mounts
    assert ("/etc/grafana/provisioning", "/etc/grafana/provisioning") in mounts


def docs_prometheus_config() -> dict:
    blocks = re.findall(r"```yaml\n(.*?)```", OPERATIONS.read_text(), flags=re.S)
    [block] = [b for b in blocks if "scrape_configs:" in b]
    return yaml.safe_load(block)


def test_docs_scrape_both_jobs_the_rules_and_the_panels_select():
    from reconciler.core.spec import Policy

    config = docs_prometheus_config()
    jobs = {j["job_name"]: j for j in config["scrape_configs"]}
    assert set(jobs) == {"spark-reconciler", "vllm"}
    [[reconciler_target]] = [c["targets"] for c in jobs["spark-reconciler"]["static_configs"]]
    assert reconciler_target == Policy.model_fields["listen"].default
    serving_port = load_yaml(ROOT / "desired-state" / "cluster.yaml")["serving"]["port"]
    [[vllm_target]] = [c["targets"] for c in jobs["vllm"]["static_configs"]]
    assert vllm_target.endswith(f":{serving_port}") and jobs["vllm"].get("metrics_path", "/metrics") == "/metrics"
    selected = set(re.findall(r'job="([^"]+)"', ALERTS.read_text() + DASHBOARD.read_text()))
    assert selected <= set(jobs), f"jobs selected by the rules or panels but not scraped: {selected - set(jobs)}"
    [vllm_row] = [p for p in dashboard()["panels"] if p["type"] == "row" and p["title"] == "vLLM"]
    for panel in vllm_row["panels"]:
        for t in panel["targets"]:
            for name in metric_names(t["expr"]):
                assert re.search(rf'{re.escape(name)}\{{job="vllm"\}}', t["expr"]), (panel["title"], name)


def section(text: str, heading: str) -> str:
    start = text.index(heading)
    end = re.search(r"^#{1,3} ", text[start + len(heading):], flags=re.M)
    return text[start:start + len(heading) + (end.start() if end else len(text))]


def test_docs_name_one_default_alert_path_and_say_not_to_load_both():
    alerts = section(OPERATIONS.read_text(), "### Alerts: one path")
    default = re.search(r"\*\*Default: (.*?)\*\*", alerts)
    assert default and "Prometheus" in default.group(1) and "Alertmanager" in default.group(1)
    assert "monitoring/alerts.yaml" in alerts and "promtool" in alerts and "without" in alerts  # the why
    assert re.search(r"\*\*Alternative, for sites without Alertmanager: Grafana-managed rules", alerts)
    assert re.search(r"never both", alerts, flags=re.I)
    readme = section(README.read_text(), "7. **Prometheus and Grafana.**")
    assert re.search(r"never\s+both", readme, flags=re.I) and "Alertmanager" in readme
    assert "docs/operations.md#grafana-copy-paste" in readme
    assert "grafana-copy-paste" in {github_anchor(h) for h in re.findall(r"^#+ (.+)$", OPERATIONS.read_text(),
                                                                          flags=re.M)}
    for path in (ALERTS, GRAFANA_ALERTS):
        assert re.search(r"never both", path.read_text(), flags=re.I), path


# ------------------------------------------------------------------- what the panels show (issue 20)

def panel_titled(title: str) -> dict:
    [panel] = [p for p in grafana.panels(dashboard()) if p["title"] == title]
    return panel


def promtool_eval(tmp_path: Path, input_series: list[dict], cases: list[dict]) -> None:
    """Evaluate PromQL with promtool's unit-test runner (no server): each case's exp_samples must match."""
    (tmp_path / "no-rules.yaml").write_text("groups: []\n")
    (tmp_path / "eval.yaml").write_text(yaml.safe_dump({
        "rule_files": ["no-rules.yaml"], "evaluation_interval": "1m",
        "tests": [{"interval": "1m", "input_series": input_series, "promql_expr_test": cases}]}))
    result = run_promtool("test", "rules", "eval.yaml", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr


def test_panel_titles_are_unique():
    titles = [p["title"] for p in grafana.panels(dashboard())]
    assert len(titles) == len(set(titles)), titles


def test_every_coloured_panel_states_its_colours():
    """No panel relies on Grafana's defaults (thresholds green, red from 80: a generation of 80 would be red)."""
    for panel in grafana.panels(dashboard()):
        colours = panel["type"] in ("state-timeline", "bargauge", "gauge") or (
            panel["type"] == "stat" and panel.get("options", {}).get("colorMode", "value") != "none")
        if not colours:
            continue
        defaults = panel["fieldConfig"]["defaults"]
        assert "mode" in defaults.get("color", {}), panel["title"]
        if defaults["color"]["mode"] == "thresholds":
            assert defaults.get("thresholds", {}).get("steps"), panel["title"]


# What True means for each condition type, as kubectl users read conditions (issue 20).
CONDITION_MEANING = {
    "Ready": "good", "DesiredStateValid": "good", "Reachable": "good", "Probed": "good", "DockerReachable": "good",
    "FabricLinkUp": "good", "WeightsInSync": "good", "ImageInSync": "good", "ServingRunning": "good",
    "GpuReady": "good", "GpuStackUniform": "good",
    "StepsHeld": "bad", "RolledBack": "bad", "Progressing": "working",
}
LOOK = {  # (meaning of True, status) -> (text, colour) on the dashboard
    ("good", "True"): ("True", "green"), ("good", "False"): ("False", "red"),
    ("bad", "True"): ("True", "red"), ("bad", "False"): ("False", "green"),
    ("working", "True"): ("True", "blue"), ("working", "False"): ("False", "transparent"),
}


def exported_conditions() -> dict[str, bool]:
    """Condition type -> cluster-level (node=""), as reconciler.loop.conditions computes them."""
    from reconciler.loop import conditions

    out = conditions.conditions(conditions.Snapshot(generation=1, observed_generation=1), ["n1"], [], 0.0)
    return {c["type"]: c["node"] == "" for c in out}


def test_every_condition_type_has_a_meaning_for_the_colours():
    assert set(exported_conditions()) == set(CONDITION_MEANING), "a new condition type: say what True means"


def look(meaning: str, status: str) -> tuple[str, str]:
    return ("Unknown", "orange") if status == "Unknown" else LOOK[(meaning, status)]


@pytest.mark.parametrize(("title", "column"), [("Node conditions", None), ("Current conditions", "status")])
def test_conditions_are_coloured_by_what_they_mean(tmp_path, title, column):
    """The panel's query, evaluated by promtool on every (type, status), gives the value whose mapping shows the
    status as text in the colour its meaning asks for: StepsHeld=True red, Progressing=False never red, ..."""
    panel = panel_titled(title)
    [target] = panel["targets"]
    expr = grafana.interpolate(target["expr"], {"node": grafana.ALL})
    config = grafana.field_config(panel, column or "n1 Ready", target["refId"])
    if column:
        assert grafana._colours_values(panel, config), f"{title}: the {column} cell is not coloured"
        assert grafana._value_column(panel, target["refId"]) == column
    by_look: dict[tuple[str, str], float] = {}
    for mapping in config["mappings"]:
        for key, result in mapping["options"].items():
            assert (result["text"], result["color"]) not in by_look, "two values look the same"
            by_look[(result["text"], result["color"])] = float(key)

    statuses = ("True", "False", "Unknown")
    series, cases = [], []
    types = exported_conditions()
    for type_, cluster in types.items():
        for i, status in enumerate(statuses):
            labels = (f'node="{"" if cluster else "n1"}",type="{type_}",status="{status}",'
                      'job="spark-reconciler",instance="127.0.0.1:9464"')
            series.append({"series": f"reconciler_condition{{{labels}}}",
                           "values": " ".join("1" if j == i else "0" for j in range(len(statuses)))})
    for i, status in enumerate(statuses):  # at minute i every condition has status i
        samples = []
        for type_, cluster in types.items():
            if cluster and "node!=\"\"" in target["expr"]:
                continue
            text, colour = look(CONDITION_MEANING[type_], status)
            value = by_look[(text, colour)]
            shown = grafana.display(value, config)
            assert (shown.text, shown.colour) == (text, colour), (type_, status, shown)
            samples.append({"labels": f'{{type="{type_}"}}' if cluster else f'{{node="n1", type="{type_}"}}',
                            "value": value})
        cases.append({"expr": expr, "eval_time": f"{i}m", "exp_samples": samples})
    promtool_eval(tmp_path, series, cases)


def test_since_last_converged_shows_no_value_until_the_first_convergence(tmp_path):
    panel = panel_titled("Since last converged")
    [target] = panel["targets"]
    promtool_eval(tmp_path, [{"series": 'reconciler_last_converged_timestamp_seconds{job="spark-reconciler"}',
                              "values": "0 0 60"}], [
        {"expr": target["expr"], "eval_time": "1m", "exp_samples": []},  # 0: no value, not 1970
        {"expr": target["expr"], "eval_time": "2m", "exp_samples": [{"labels": '{job="spark-reconciler"}',
                                                                      "value": 60}]},
    ])
    view = grafana.render(panel, {}, lambda e: [], lambda e: [])
    assert view.shown_when_empty == grafana.Shown("not yet converged since start", "text")
    config = grafana.field_config(panel, "since converged", "A")
    assert panel["fieldConfig"]["defaults"]["noValue"] == "not yet converged since start"
    assert [grafana.display(v, config).colour for v in (60, 900, 3599, 3600)] == ["green", "orange", "orange", "red"]


def test_events_by_source_keeps_cluster_wide_events_when_a_node_is_selected(tmp_path):
    panel = panel_titled("Events by source")
    [target] = panel["targets"]
    expr = grafana.interpolate(target["expr"], {"node": grafana.regex_value(["worker"]), "__rate_interval": "5m"})
    series = [{"series": f'reconciler_events_total{{node="{node}",source="{source}",job="spark-reconciler"}}',
               "values": f"0+{per_minute}x10"}
              for node, source, per_minute in (("", "resync", 60), ("", "file", 60), ("worker", "docker", 60),
                                               ("head", "docker", 120), ("head", "link", 60))]
    promtool_eval(tmp_path, series, [{"expr": expr, "eval_time": "10m", "exp_samples": [
        {"labels": '{source="resync"}', "value": 1}, {"labels": '{source="file"}', "value": 1},
        {"labels": '{source="docker"}', "value": 1}]}])  # the worker's docker events only; no link events


def test_panels_that_can_be_empty_say_why():
    for title in ("Since last converged", "Held steps", "Step duration by kind (p95 and mean)", "Step results",
                  "Weight-sync rate", "vLLM requests running / waiting", "vLLM KV cache usage",
                  "vLLM token throughput", *PROGRESS_PANELS):
        assert panel_titled(title)["fieldConfig"]["defaults"].get("noValue"), title


# -------------------------------------------------- progress of copies and cold starts (issue 33, item 6)

# Empty whenever nothing is copied or started (a converged cluster included), and saying so.
PROGRESS_PANELS = ("Operation progress", "Operation progress over time", "Operation rate", "Cold-start stage",
                   "Cold start: allowance used")
RATIO = "reconciler_operation_progress_ratio"


def series_of(name: str, labels: str, values: str) -> dict[str, str]:
    """A series of the reconciler at 127.0.0.1:9464 with `labels` (text, may be empty) of its own."""
    every = ",".join(x for x in (labels, 'job="spark-reconciler",instance="127.0.0.1:9464"') if x)
    return {"series": f"{name}{{{every}}}", "values": values}


def test_operation_progress_shows_each_operation_by_kind_and_node_in_the_colour_of_work(tmp_path):
    """One bar per operation (kind and node), $node choosing the nodes; in progress is blue (work, not a
    warning), done is green; the timeseries reads the same query."""
    bars, lines = panel_titled("Operation progress"), panel_titled("Operation progress over time")
    [target], [line] = bars["targets"], lines["targets"]
    assert target["expr"] == line["expr"] and target["legendFormat"] == line["legendFormat"] == "{{kind}} {{node}}"
    series = [series_of(RATIO, 'kind="weights",node="spark-b"', "0.5x5"),
              series_of(RATIO, 'kind="image",node="spark-b"', "1x5"),
              series_of(RATIO, 'kind="await-health",node="spark-a"', "0.45x5")]
    one = grafana.interpolate(target["expr"], {"node": grafana.regex_value(["spark-b"])})
    every = grafana.interpolate(target["expr"], {"node": grafana.ALL})
    promtool_eval(tmp_path, series, [
        {"expr": one, "eval_time": "2m", "exp_samples": [
            {"labels": '{kind="weights",node="spark-b"}', "value": 0.5},
            {"labels": '{kind="image",node="spark-b"}', "value": 1}]},
        {"expr": every, "eval_time": "2m", "exp_samples": [
            {"labels": '{kind="weights",node="spark-b"}', "value": 0.5},
            {"labels": '{kind="image",node="spark-b"}', "value": 1},
            {"labels": '{kind="await-health",node="spark-a"}', "value": 0.45}]}])
    config = grafana.field_config(bars, "weights spark-b", "A")
    assert [grafana.display(v, config).colour for v in (0, 0.45, 0.999, 1)] == ["blue", "blue", "blue", "green"]
    assert (config["min"], config["max"], config["unit"]) == (0, 1, "percentunit")


def test_operation_rate_shows_bytes_per_second_by_kind_and_node(tmp_path):
    panel = panel_titled("Operation rate")
    [target] = panel["targets"]
    expr = grafana.interpolate(target["expr"], {"node": grafana.ALL})
    promtool_eval(tmp_path, [series_of("reconciler_operation_bytes_per_second", 'kind="image",node="spark-b"',
                                       "0 104857600 209715200")], [
        {"expr": expr, "eval_time": "2m", "exp_samples": [{"labels": '{kind="image",node="spark-b"}',
                                                           "value": 209715200}]}])
    assert panel["fieldConfig"]["defaults"]["unit"] == "Bps"


def test_the_cold_start_stage_reads_as_the_stage_by_name(tmp_path):
    """reconciler_serving_start_stage is 1 on the current stage (reconciler.core.vllm_log.STAGES): the query turns
    it into one number per node, whose mapping shows the stage's name, each in its own colour and none red (a
    stage is never trouble by itself)."""
    from reconciler.core.vllm_log import STAGES

    panel = panel_titled("Cold-start stage")
    [target] = panel["targets"]
    expr = grafana.interpolate(target["expr"], {"node": grafana.ALL})
    series = [series_of("reconciler_serving_start_stage", f'node="spark-a",stage="{stage}"',
                        " ".join("1" if j == i else "0" for j in range(len(STAGES))))
              for i, stage in enumerate(STAGES)]
    config = grafana.field_config(panel, "spark-a", "A")
    cases, looks = [], []
    for i, stage in enumerate(STAGES):  # at minute i the start is in stage i
        [value] = [float(k) for m in config["mappings"] for k, r in m["options"].items() if r["text"] == stage]
        shown = grafana.display(value, config)
        assert shown.text == stage and not grafana.is_red(shown.colour), (stage, shown)
        looks.append(shown.colour)
        cases.append({"expr": expr, "eval_time": f"{i}m", "exp_samples": [{"labels": '{node="spark-a"}',
                                                                           "value": value}]})
    assert len(set(looks)) == len(STAGES), looks
    promtool_eval(tmp_path, series, cases)


def test_the_cold_start_allowance_is_the_share_of_health_timeout_used_while_a_start_runs(tmp_path):
    """Blue within the allowance, orange in its last quarter, red past it (where ReconcilerServingUnhealthy
    stops keeping quiet); nothing when no serving start is in flight."""
    panel = panel_titled("Cold start: allowance used")
    [target] = panel["targets"]
    expr = grafana.interpolate(target["expr"], {"deployment": grafana.ALL})
    series = [series_of("reconciler_serving_started_timestamp_seconds", 'deployment="default"', "0x15"),  # minute 0
              series_of("reconciler_serving_health_timeout_seconds", 'deployment="default"', "600x15"),
              series_of("reconciler_operations_in_flight", 'kind="await-health"', "1x12 0x3"),
              series_of("reconciler_operations_in_flight", 'kind="weights"', "1x15")]
    here = '{deployment="default",instance="127.0.0.1:9464",job="spark-reconciler"}'
    promtool_eval(tmp_path, series, [
        {"expr": expr, "eval_time": f"{minute}m", "exp_samples": [{"labels": here, "value": share}]}
        for minute, share in ((5, 0.5), (9, 0.9), (11, 1.1))] + [
        {"expr": expr, "eval_time": "14m", "exp_samples": []}])
    assert target["legendFormat"] == "{{deployment}}"
    config = grafana.field_config(panel, "default", "A")
    assert [grafana.display(v, config).colour for v in (0.5, 0.9, 1.1)] == ["blue", "orange", "red"]
    assert panel["fieldConfig"]["defaults"]["noValue"] == "no serving start in flight"


# ------------------------------------------------- the Grafana model of tests/e2e/grafana.py, on snippets

THRESHOLDS = {"mode": "absolute", "steps": [{"color": "green", "value": None}, {"color": "orange", "value": 900},
                                            {"color": "red", "value": 3600}]}


def stat(**defaults) -> dict:
    return {"id": 1, "type": "stat", "title": "t", "fieldConfig": {"defaults": defaults, "overrides": []},
            "targets": [{"refId": "A", "expr": "x", "instant": True, "range": False, "legendFormat": "{{n}}"}]}


def test_thresholds_take_the_last_step_at_or_below_the_value_and_the_base_step_is_minus_infinity():
    config = {"color": {"mode": "thresholds"}, "thresholds": THRESHOLDS}
    assert [grafana.display(v, config).colour for v in (-1e9, 0, 899.9, 900, 3599, 3600, 1e12)] == \
        ["green", "green", "green", "orange", "orange", "red", "red"]
    unsorted = {"color": {"mode": "thresholds"},
                "thresholds": {"mode": "absolute", "steps": list(reversed(THRESHOLDS["steps"]))}}
    assert grafana.display(1000, unsorted).colour == "orange"
    for nothing in (None, float("nan")):  # null and NaN take the base step
        assert grafana.display(nothing, config).colour == "green"


def test_value_mappings_come_before_thresholds():
    config = {"color": {"mode": "thresholds"}, "thresholds": THRESHOLDS, "mappings": [
        {"type": "value", "options": {"1": {"text": "Yes", "color": "blue"}, "2": {"text": "two"}}},
        {"type": "range", "options": {"from": 1000, "to": 2000, "result": {"text": "mid", "color": "purple"}}},
        {"type": "special", "options": {"match": "null", "result": {"text": "none yet", "color": "text"}}},
    ]}
    assert grafana.display(1.0, config) == grafana.Shown("Yes", "blue")  # String(1.0) is "1" in JavaScript
    assert grafana.display(2, config) == grafana.Shown("two", "green")   # text only: the colour of the threshold
    assert grafana.display(1500, config) == grafana.Shown("mid", "purple")
    assert grafana.display(2500, config) == grafana.Shown("2500", "orange")
    assert grafana.display(None, config) == grafana.Shown("none yet", "text")
    first = {"mappings": [{"type": "range", "options": {"from": 0, "to": 10, "result": {"color": "red"}}},
                          {"type": "value", "options": {"1": {"color": "green"}}}]}
    assert grafana.display(1, first).colour == "red", "the first mapping that matches wins"


def test_missing_colours_take_grafanas_defaults():
    assert grafana.display(79, grafana.field_config(stat(), "x", "A")).colour == "green"
    assert grafana.display(80, grafana.field_config(stat(), "x", "A")).colour == "red"
    assert grafana.field_config({"type": "timeseries"}, "x", "A")["color"]["mode"] == "palette-classic"
    fixed = grafana.field_config(stat(color={"mode": "fixed", "fixedColor": "purple"}), "x", "A")
    assert grafana.display(1e9, fixed).colour == "purple"


def test_overrides_apply_to_the_fields_they_match():
    panel = stat(color={"mode": "fixed", "fixedColor": "text"})
    panel["fieldConfig"]["overrides"] = [
        {"matcher": {"id": "byName", "options": "Blocked"},
         "properties": [{"id": "color", "value": {"mode": "fixed", "fixedColor": "red"}}]},
        {"matcher": {"id": "byRegexp", "options": "/Held$/"},
         "properties": [{"id": "custom.cellOptions", "value": {"type": "color-background"}}]},
        {"matcher": {"id": "byFrameRefID", "options": "B"},
         "properties": [{"id": "color", "value": {"mode": "fixed", "fixedColor": "blue"}}]},
    ]
    assert grafana.display(1, grafana.field_config(panel, "Blocked", "A")).colour == "red"
    assert grafana.display(1, grafana.field_config(panel, "Converged", "A")).colour == "text"
    assert grafana.field_config(panel, "head StepsHeld", "A")["custom"]["cellOptions"]["type"] == "color-background"
    assert grafana.display(1, grafana.field_config(panel, "Converged", "B")).colour == "blue"
    panel["fieldConfig"]["overrides"] = [{"matcher": {"id": "byValue", "options": {}}, "properties": []}]
    with pytest.raises(ValueError, match="not modelled"):
        grafana.field_config(panel, "x", "A")


def test_render_names_series_by_legend_and_says_what_an_empty_panel_shows():
    panel = stat(color={"mode": "thresholds"}, thresholds=THRESHOLDS, noValue="nothing yet")
    shown = grafana.render(panel, {}, lambda e: [({"n": "a"}, 1000.0)], lambda e: [])
    [series] = shown.series
    assert (series.name, series.text, series.colour) == ("a", "1000", "orange")
    empty = grafana.render(panel, {}, lambda e: [], lambda e: [])
    assert empty.empty == ["A"] and empty.shown_when_empty == grafana.Shown("nothing yet", "green")
    panel["options"] = {"colorMode": "none"}
    assert grafana.render(panel, {}, lambda e: [({"n": "a"}, 1.0)], lambda e: []).series[0].colour is None
    timeline = dict(stat(), type="state-timeline")
    timeline["targets"] = [{"refId": "A", "expr": "y", "range": True, "legendFormat": "{{n}}"}]
    [last] = grafana.render(timeline, {}, lambda e: [], lambda e: [({"n": "b"}, [0.0, 5.0, float("nan")])]).series
    assert last.value == 5.0, "a range query shows its last number"


def test_template_variables_are_replaced_as_grafana_does():
    variables = {"node": grafana.regex_value(None), "__rate_interval": "1m"}
    assert grafana.interpolate('rate(x{node=~"$node|"}[$__rate_interval])', variables) == \
        'rate(x{node=~".*|"}[1m])'
    assert grafana.interpolate("${node} [[node]] ${node:regex}", {"node": "a"}) == "a a a"
    assert grafana.regex_value(["worker"]) == "worker"
    assert grafana.regex_value(["a.b", "c"]) == "(a\\\\.b|c)"
    with pytest.raises(KeyError):
        grafana.interpolate("$unknown", {})


# ------------------------------------------------------ the deployment label and the info gauge (issue 35)

def per_deployment_names() -> set[str]:
    """The series with a `deployment` label: the PER_DEPLOYMENT gauges and reconciler_deployment_info."""
    from reconciler.loop import metrics

    assert all(g._labelnames == ("deployment",) for g in metrics.PER_DEPLOYMENT)
    assert metrics.deployment_info._labelnames == metrics.INFO_LABELS and metrics.INFO_LABELS[0] == "deployment"
    return {g._name for g in metrics.PER_DEPLOYMENT} | {metrics.deployment_info._name}


def test_the_deployment_variable_offers_the_deployments_in_force():
    [variable] = [v for v in dashboard()["templating"]["list"] if v["name"] == "deployment"]
    query = "label_values(reconciler_deployment_info, deployment)"
    assert variable["type"] == "query" and variable["definition"] == query and variable["query"]["query"] == query
    assert variable["multi"] is True and variable["includeAll"] is True and variable["allValue"] == grafana.ALL
    assert variable["datasource"] == {"type": "prometheus", "uid": "${datasource}"}


def test_every_query_of_a_per_deployment_series_selects_the_chosen_deployments():
    """A panel reading a serving series without `$deployment` would show every deployment whatever is chosen."""
    names = per_deployment_names()
    seen = set()
    for panel in grafana.panels(dashboard()):
        for target in panel["targets"]:
            for name in names & metric_names(target["expr"]):
                seen.add(name)
                for m in re.finditer(rf"{re.escape(name)}\b(\{{[^}}]*\}})?", target["expr"]):
                    assert m.group(1) and 'deployment=~"$deployment"' in m.group(1), (panel["title"], m.group(0))
    assert seen == names


def deployment_series(name: str, deployment: str, values: str, **labels: str) -> dict[str, str]:
    own = ",".join([f'deployment="{deployment}"', *(f'{k}="{v}"' for k, v in labels.items())])
    return series_of(name, own, values)


def test_serving_health_shows_one_row_per_chosen_deployment(tmp_path):
    """Healthy, busy (healthy + busy) and unhealthy, each deployment on its own row, named by its deployment; the
    "Serving healthy" stat the same, one value each."""
    timeline, stat_panel = panel_titled("Serving health"), panel_titled("Serving healthy")
    [line], [value] = timeline["targets"], stat_panel["targets"]
    assert line["legendFormat"] == value["legendFormat"] == "{{deployment}}"
    series = [deployment_series("reconciler_serving_healthy", "chat", "1x3"),
              deployment_series("reconciler_serving_busy", "chat", "1x3"),
              deployment_series("reconciler_serving_healthy", "embed", "0x3"),
              deployment_series("reconciler_serving_busy", "embed", "0x3")]
    here = 'instance="127.0.0.1:9464",job="spark-reconciler"'
    cases = []
    for target, both in ((line, {"chat": 2, "embed": 0}), (value, {"chat": 1, "embed": 0})):
        name = "" if target is line else ',__name__="reconciler_serving_healthy"'
        for chosen in (["chat"], ["embed"], None):
            expr = grafana.interpolate(target["expr"], {"deployment": grafana.regex_value(chosen)})
            cases.append({"expr": expr, "eval_time": "1m", "exp_samples": [
                {"labels": f'{{deployment="{d}",{here}{name}}}', "value": v} for d, v in both.items()
                if chosen is None or d in chosen]})
    promtool_eval(tmp_path, series, cases)
    config = grafana.field_config(timeline, "chat", "A")
    assert [grafana.display(v, config).text for v in (0, 1, 2)] == ["unhealthy", "healthy", "busy"]


def test_the_cold_start_allowance_is_each_deployment_s_own(tmp_path):
    """Two deployments of one reconciler, each its own start and health_timeout: the division joins on the
    deployment (on job and instance alone it would match two series on each side, an error)."""
    [target] = panel_titled("Cold start: allowance used")["targets"]
    expr = grafana.interpolate(target["expr"], {"deployment": grafana.ALL})
    series = [deployment_series("reconciler_serving_started_timestamp_seconds", "chat", "0x10"),
              deployment_series("reconciler_serving_health_timeout_seconds", "chat", "600x10"),
              deployment_series("reconciler_serving_started_timestamp_seconds", "embed", "120x10"),
              deployment_series("reconciler_serving_health_timeout_seconds", "embed", "1200x10"),
              series_of("reconciler_operations_in_flight", 'kind="await-health"', "1x10")]
    here = 'instance="127.0.0.1:9464",job="spark-reconciler"'
    promtool_eval(tmp_path, series, [{"expr": expr, "eval_time": "5m", "exp_samples": [
        {"labels": f'{{deployment="chat",{here}}}', "value": 0.5},
        {"labels": f'{{deployment="embed",{here}}}', "value": 0.15}]}])


def test_the_deployments_table_shows_each_deployment_s_model_served_name_and_endpoint(tmp_path):
    from reconciler.loop import metrics

    panel = panel_titled("Deployments")
    [target] = panel["targets"]
    assert panel["type"] == "table" and target["format"] == "table" and target["instant"] is True
    [organize] = [t["options"] for t in panel["transformations"] if t["id"] == "organize"]
    assert sorted(organize["indexByName"], key=organize["indexByName"].get) == list(metrics.INFO_LABELS)
    assert {"Time", "Value", "__name__", "job", "instance"} <= {k for k, v in organize["excludeByName"].items() if v}
    assert panel["fieldConfig"]["defaults"]["noValue"]
    info = {"model": "Qwen/Qwen3-Embedding-0.6B", "served_name": "embed", "endpoint": "http://10.0.0.1:8001/v1"}
    series = [deployment_series("reconciler_deployment_info", "embed", "1x3", **info),
              deployment_series("reconciler_deployment_info", "chat", "1x3", model="m", served_name="m",
                                endpoint="http://127.0.0.1:8000/v1")]
    expr = grafana.interpolate(target["expr"], {"deployment": grafana.regex_value(["embed"])})
    labels = ",".join(f'{k}="{v}"' for k, v in sorted({**info, "deployment": "embed", "job": "spark-reconciler",
                                                        "instance": "127.0.0.1:9464"}.items()))
    promtool_eval(tmp_path, series, [{"expr": expr, "eval_time": "1m", "exp_samples": [
        {"labels": f"reconciler_deployment_info{{{labels}}}", "value": 1}]}])


def test_the_alerts_about_serving_keep_and_name_the_deployment():
    """Every rule reading a per-deployment series keeps the label (its firing cases in alerts.test.yaml expect it,
    and promtool compares labels exactly) and names it in its summary and description."""
    names = per_deployment_names()
    serving = {r["alert"]: r for r in prometheus_rules() if names & metric_names(r["expr"])}
    assert set(serving) == {"ReconcilerServingUnhealthy"}
    for rule in serving.values():
        for key in ("summary", "description"):
            assert "{{ $labels.deployment }}" in rule["annotations"][key], (rule["alert"], key)
    fired = [alert["exp_labels"] for group in load_yaml(ALERT_TESTS)["tests"]
             for case in group.get("alert_rule_test", []) if case["alertname"] in serving
             for alert in case.get("exp_alerts") or []]
    assert fired and all("deployment" in labels for labels in fired), fired
    assert {labels["deployment"] for labels in fired} >= {"default", "embed"}  # the single form, and one of two


def test_the_documented_join_names_the_model_of_each_deployment(tmp_path):
    """docs/operations.md shows how to join on the info gauge; the query runs and adds model and endpoint."""
    blocks = re.findall(r"```promql[^\n]*\n(.*?)```", OPERATIONS.read_text(), flags=re.S)
    [join] = [b for b in blocks if "reconciler_deployment_info" in b]
    assert "group_left(model, endpoint)" in join and "on (job, instance, deployment)" in join
    series = [deployment_series("reconciler_serving_healthy", "chat", "0x3"),
              deployment_series("reconciler_serving_healthy", "embed", "1x3"),
              deployment_series("reconciler_deployment_info", "chat", "1x3", model="m", served_name="s",
                                endpoint="http://127.0.0.1:8000/v1"),
              deployment_series("reconciler_deployment_info", "embed", "1x3", model="e", served_name="e",
                                endpoint="http://127.0.0.1:8001/v1")]
    promtool_eval(tmp_path, series, [{"expr": join, "eval_time": "1m", "exp_samples": [
        {"labels": '{deployment="chat",endpoint="http://127.0.0.1:8000/v1",instance="127.0.0.1:9464",'
                   'job="spark-reconciler",model="m"}', "value": 0}]}])
