"""Issue 20 end to end: what an operator reads on the Grafana dashboard, panel by panel.

A real Prometheus (Debian's package) scrapes the daemon on the testbed (job `spark-reconciler`) and vLLM on the
head's serving port (job `vllm`), the two jobs of docs/operations.md. Every target of every panel of
monitoring/grafana/dashboard.json is run through Prometheus's HTTP API with the template variables set as Grafana
sets them (instant targets with /api/v1/query, range targets with /api/v1/query_range over the test's window, the
last point being what the panel shows for "now"), and each value goes through the panel's own value mappings and
thresholds (tests/e2e/grafana.py models Grafana's rules) to the text and colour a person sees:

* converged: every query returns data (except the held-steps panel, which says "no held steps") and nothing is red;
* a step held (the head's vLLM crashes at every start): StepsHeld is red for that node, the held-steps panel shows
  HELD in red, Converged, Ready and the phase are not green, and every empty panel says why (its noValue).

Modelled on tests/e2e/test_prometheus.py; its own Prometheus because it needs a second scrape job.
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
import warnings
from pathlib import Path

import pytest
import yaml

from testbed.proc import free_port, wait_for
from tests.e2e import grafana
from tests.e2e.daemon import Daemon
from tests.e2e.test_daemon import write_desired

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "monitoring" / "grafana" / "dashboard.json"
SCRAPE_SECONDS = 1
# Grafana's $__rate_interval: max($__interval + scrape interval, 4 x scrape interval); $__interval is the step, 1s
RATE_INTERVAL = f"{4 * SCRAPE_SECONDS}s"
LOW_MEMORY_BYTES = 8 * 2**30  # the red band of "Memory available per node" (ReconcilerLowMemory)
# Empty on a converged cluster, and saying so with their noValue.
EMPTY_WHEN_CONVERGED = {"Held steps", "Operation progress", "Operation progress over time", "Operation rate",
                        "Cold-start stage", "Cold start: allowance used"}
GOOD_WHEN_TRUE = {"Reachable", "DockerReachable", "FabricLinkUp", "WeightsInSync", "ImageInSync", "ServingRunning"}


class Prometheus:
    """A local Prometheus scraping every second, its targets given by file_sd (one file per job)."""

    JOBS = ("spark-reconciler", "vllm")

    def __init__(self, workdir: Path):
        binary = shutil.which("prometheus")
        assert binary, "prometheus is installed by `make test` (Debian package prometheus)"
        workdir.mkdir(parents=True, exist_ok=True)
        self.workdir, self.port = workdir, free_port()
        self.api = f"http://127.0.0.1:{self.port}/api/v1"
        self.targets = {job: workdir / f"{job}.json" for job in self.JOBS}
        for path in self.targets.values():
            path.write_text("[]")
        (workdir / "prometheus.yml").write_text(yaml.safe_dump({
            "global": {"scrape_interval": f"{SCRAPE_SECONDS}s", "evaluation_interval": f"{SCRAPE_SECONDS}s"},
            "scrape_configs": [{"job_name": job, "file_sd_configs": [{"files": [str(path)], "refresh_interval": "1s"}]}
                               for job, path in self.targets.items()],
        }))
        self._log = open(workdir / "prometheus.log", "wb")  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen([binary, f"--config.file={workdir / 'prometheus.yml'}",
                                      f"--storage.tsdb.path={workdir / 'data'}",
                                      f"--web.listen-address=127.0.0.1:{self.port}"],
                                     stdout=self._log, stderr=subprocess.STDOUT)
        wait_for(self._answers, 30, "prometheus to answer")

    def _answers(self) -> bool:
        try:
            self.get("status/runtimeinfo")
            return True
        except OSError:
            return False

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log.close()

    def scrape(self, job: str, target: str) -> None:
        self.targets[job].write_text(json.dumps([{"targets": [target]}]))

    def get(self, path: str, **params) -> dict:
        url = f"{self.api}/{path}" + (f"?{urllib.parse.urlencode(params)}" if params else "")
        with urllib.request.urlopen(url, timeout=10) as r:
            doc = json.loads(r.read())
        assert doc["status"] == "success", doc
        return doc["data"]

    def instant(self, expr: str, at: float | None = None) -> list[tuple[dict[str, str], float]]:
        data = self.get("query", query=expr, time=f"{at if at is not None else time.time():.3f}")
        if data["resultType"] == "scalar":
            return [({}, float(data["result"][1]))]
        return [(r["metric"], float(r["value"][1])) for r in data["result"]]

    def range(self, expr: str, start: float, end: float, step: float = SCRAPE_SECONDS):
        data = self.get("query_range", query=expr, start=f"{start:.3f}", end=f"{end:.3f}", step=str(step))
        return [(r["metric"], [float(v) for _, v in r["values"]]) for r in data["result"]]

    def has(self, expr: str) -> bool:
        return bool(self.instant(expr))


@pytest.fixture
def prometheus(tmp_path):
    prom = Prometheus(tmp_path / "prometheus")
    yield prom
    prom.close()


# --------------------------------------------------------------------------------------------------- helpers

def dashboard_as_seen(prom: Prometheus, start: float, end: float,
                      nodes: list[str] | None = None) -> dict[str, grafana.Panel]:
    """Every panel as Grafana would draw it for the window [start, end], $node = All (None) or the given nodes.
    The window starts on the step grid that ends at `end`, so a range query's last point is `end` itself, the
    instant the instant queries see (else it could be up to a step older and miss a change just scraped)."""
    start = end - math.floor((end - start) / SCRAPE_SECONDS) * SCRAPE_SECONDS
    dashboard = json.loads(DASHBOARD.read_text())
    variables = {"node": grafana.regex_value(nodes), "deployment": grafana.regex_value(None),
                 "datasource": "prometheus-e2e",
                 "__rate_interval": RATE_INTERVAL, "__interval": f"{SCRAPE_SECONDS}s",
                 "__range": f"{max(1, math.ceil(end - start))}s"}
    seen = grafana.render_all(dashboard, variables, lambda e: prom.instant(e, end),
                              lambda e: prom.range(e, start, end))
    titles = [p.title for p in seen]
    assert len(titles) == len(set(titles)), f"panel titles must be unique to be named: {titles}"
    return {p.title: p for p in seen}


def start_daemon_scraped(tb, desired: Path, state: Path, prom: Prometheus) -> tuple[Daemon, float]:
    """Point Prometheus at the daemon's listener and at vLLM on the head's serving port, then start the daemon (so
    the range queries see the whole story from the first reconcile)."""
    doc = yaml.safe_load(desired.read_text())
    daemon = Daemon(desired, state)
    prom.scrape("spark-reconciler", daemon.url.removeprefix("http://"))
    prom.scrape("vllm", f"{tb.head.ssh_host}:{doc['serving']['port']}")
    start = time.time()
    daemon.start()
    return daemon, start


def steady(prom: Prometheus, selector: str) -> bool:
    """The 0/1 gauge `selector` has been 1 in every scrape of the last rate window, with enough scrapes for a rate."""
    window = f"{4 * SCRAPE_SECONDS + 1}s"
    return prom.has(f"min_over_time({selector}[{window}]) == 1") and \
        prom.has(f"count_over_time({selector}[{window}]) >= 4")


def node_names(desired: Path) -> list[str]:
    return [n["name"] for n in yaml.safe_load(desired.read_text())["nodes"]]


def red_now(panel: grafana.Panel) -> list[grafana.Series]:
    """Series that show red for "now". A time series line has a colour of its own (palette, or fixed: the red
    `error` line of "Reconciles by result"): red there means a red line off zero, or a value in a red threshold
    band."""
    out = []
    for s in panel.series:
        if panel.type == "timeseries":
            off_zero = s.value is not None and not math.isnan(s.value) and s.value != 0
            if (grafana.is_red(s.colour) and off_zero) or grafana.is_red(s.region):
                out.append(s)
        elif grafana.is_red(s.colour):
            out.append(s)
    return out


def describe(panels: dict[str, grafana.Panel]) -> str:
    return "\n".join(f"{p.title}: " + (", ".join(f"{s.name}={s.text}({s.colour})" for s in p.series)
                                       or f"empty -> {p.shown_when_empty}") for p in panels.values())


# ------------------------------------------------------------------------------------ what a person must read

def assert_converged_view(panels: dict[str, grafana.Panel], nodes: list[str]) -> None:
    story = describe(panels)
    empty = {p.title: p.empty for p in panels.values() if p.empty and p.title not in EMPTY_WHEN_CONVERGED}
    assert not empty, f"queries without a result on a converged cluster: {empty}\n{story}"
    for title in EMPTY_WHEN_CONVERGED:
        if not panels[title].series:
            assert panels[title].no_value, f"{title} is empty and does not say why"

    red = {p.title: [(s.name, s.text, s.value) for s in red_now(p)] for p in panels.values() if red_now(p)}
    memory = red.pop("Memory available per node", [])
    for name, _, value in memory:  # the machine itself may have less than 8 GiB free: the band is right then
        assert value is not None and value < LOW_MEMORY_BYTES, (name, value)
        warnings.warn(f"this machine has only {value / 2**30:.1f} GiB MemAvailable: {name} is in the red band",
                      stacklevel=2)
    empty_red = [p.title for p in panels.values() if p.shown_when_empty and grafana.is_red(p.shown_when_empty.colour)]
    assert not red and not empty_red, f"red on a converged cluster: {red} {empty_red}\n{story}"

    [phase] = panels["Phase"].series
    assert phase.name == "Converged" and grafana.is_green(phase.colour), story
    for title, name, text in (("Converged", "converged", "Yes"), ("Desired state valid", "valid", "Valid"),
                              ("Serving healthy", "default", "Healthy")):  # named by its deployment
        shown = panels[title].named(name)
        assert shown.text == text and grafana.is_green(shown.colour), (title, shown)
    since = panels["Since last converged"].named("since converged")
    assert since.value is not None and 0 <= since.value < 900 and grafana.is_green(since.colour), since
    conditions = panels["Node conditions"]
    for node in nodes:
        for type_ in GOOD_WHEN_TRUE:
            shown = conditions.named(f"{node} {type_}")
            assert shown.text == "True" and grafana.is_green(shown.colour), shown
        held = conditions.named(f"{node} StepsHeld")
        assert held.text == "False" and grafana.is_green(held.colour), held
    by_type = {(s.labels.get("node", ""), s.labels["type"]): s for s in panels["Current conditions"].series}
    assert by_type[("", "Ready")].text == "True" and grafana.is_green(by_type[("", "Ready")].colour)
    idle = by_type[("", "Progressing")]  # idle is normal: neutral, never red
    assert idle.text == "False" and not grafana.is_red(idle.colour), idle
    answering = by_type[(nodes[0], "ServingBusy")]  # the head's vLLM not at capacity: neutral, like idle
    assert answering.text == "False" and not grafana.is_red(answering.colour), answering
    assert all(grafana.is_green(s.colour) for (_, type_), s in by_type.items()
               if type_ not in ("Progressing", "ServingBusy")), story
    for s in panels["Node reachable and fabric link"].series:
        assert s.text == "up" and grafana.is_green(s.colour), s
    for s in panels["Weight-sync progress"].series:
        assert s.value == 1 and grafana.is_green(s.colour), s
    assert {s.text for s in panels["Serving health"].series} == {"healthy"}
    for title in ("vLLM requests running / waiting", "vLLM KV cache usage", "vLLM token throughput"):
        assert panels[title].series and not panels[title].empty, f"{title}: the `vllm` job scrapes nothing"


def assert_one_node_view(panels: dict[str, grafana.Panel], node: str) -> None:
    """$node = one node: its rows, and the cluster-wide ones (resync/file/signal events, Ready & co.)."""
    assert "resync" in {s.labels.get("source") for s in panels["Events by source"].series}, describe(panels)
    assert {s.labels.get("node", "") for s in panels["Node conditions"].series} == {node}
    assert {s.labels.get("node", "") for s in panels["Current conditions"].series} == {node, ""}


def assert_held_view(panels: dict[str, grafana.Panel], nodes: list[str], held: set[str]) -> None:
    story = describe(panels)
    assert held, "no node with a held step"
    silent = [p.title for p in panels.values() if p.empty and not p.no_value]
    assert not silent, f"empty panels that do not say why: {silent}\n{story}"

    conditions = panels["Node conditions"]
    for node in nodes:
        shown = conditions.named(f"{node} StepsHeld")
        if node in held:
            assert shown.text == "True" and grafana.is_red(shown.colour), (shown, story)
            holds = [s for s in panels["Held steps"].where(node=node) if s.value == 1]
            assert holds, f"no HELD row for {node}\n{story}"
            assert all(s.text == "HELD" and grafana.is_red(s.colour) for s in holds), holds
        else:
            assert shown.text == "False" and grafana.is_green(shown.colour), shown

    converged = panels["Converged"].named("converged")
    assert converged.text == "No" and grafana.is_red(converged.colour), converged
    [ready] = [s for s in panels["Current conditions"].series
               if s.labels.get("node", "") == "" and s.labels["type"] == "Ready"]
    assert ready.text == "False" and grafana.is_red(ready.colour), ready
    [phase] = panels["Phase"].series
    assert phase.name == "Blocked" and grafana.is_red(phase.colour), phase
    serving = panels["Serving healthy"].named("default")  # the testbed's file has one deployment, `default`
    assert serving.text == "Unhealthy" and grafana.is_red(serving.colour), serving

    since = panels["Since last converged"]  # never converged since this start: no value, not 57 years in red
    assert not since.series and since.shown_when_empty is not None, story
    assert since.shown_when_empty.text == "not yet converged since start", since.shown_when_empty
    assert not grafana.is_red(since.shown_when_empty.colour), since.shown_when_empty


# ----------------------------------------------------------------------------------------------------- tests

def test_a_converged_cluster_every_panel_has_data_and_nothing_is_red(seed_testbed, tmp_path, prometheus):
    prom, tb = prometheus, seed_testbed
    desired = write_desired(tmp_path / "cluster.yaml", lambda d: d["policy"].update(resync_interval="1s"))
    nodes = node_names(desired)
    daemon, start = start_daemon_scraped(tb, desired, tmp_path / "state", prom)
    try:
        daemon.wait_phase("Converged", timeout=120)
        wait_for(lambda: steady(prom, 'reconciler_converged{job="spark-reconciler"}'), 30,
                   "Prometheus to have scraped the converged daemon for a whole rate window")
        wait_for(lambda: steady(prom, 'up{job="vllm"}'), 60, "Prometheus to scrape vLLM on the head's serving port")
        end = time.time()
        assert_converged_view(dashboard_as_seen(prom, start, end), nodes)
        worker = [n for n in nodes if n != nodes[0]][0]
        assert_one_node_view(dashboard_as_seen(prom, start, end, nodes=[worker]), worker)
    finally:
        daemon.close()


def test_a_held_step_is_red_where_it_is_held_and_nothing_reads_converged(seed_testbed, tmp_path, prometheus):
    def held_quickly(d):
        d["policy"]["resync_interval"] = "1s"
        d["policy"]["retries"] = {"attempts": 1, "backoff_initial": "1s", "backoff_max": "1h", "hold_after": 3}
        d["policy"]["on_failed_change"] = "hold"  # the holds are the subject: a failed first start is not undone

    def held_nodes() -> set[str]:
        return {c["node"] for c in (daemon.status() or {}).get("conditions", [])
                if c["type"] == "StepsHeld" and c["status"] == "True"}

    prom, tb = prometheus, seed_testbed
    tb.fault("crash-serving", "head")  # the head's vLLM exits at every start: the serving chain ends up held
    try:
        desired = write_desired(tmp_path / "cluster.yaml", held_quickly)
        daemon, start = start_daemon_scraped(tb, desired, tmp_path / "state", prom)
        try:
            first = wait_for(held_nodes, 120, "a held step (StepsHeld=True)")
            wait_for(lambda: all(prom.has(f'reconciler_condition{{node="{n}", type="StepsHeld", status="True"}} == 1')
                                   for n in first) and steady(prom, "reconciler_step_hold"), 30,
                       "Prometheus to have scraped the hold for a whole rate window")
            end = time.time()
            panels = dashboard_as_seen(prom, start, end)
            # what the panels must show, from the same Prometheus at the same instant (another node's step may
            # have been held meanwhile)
            held = {labels["node"] for labels, _ in prom.instant(
                'reconciler_condition{type="StepsHeld", status="True"} == 1', end)}
            assert held >= first, (held, first)
            assert_held_view(panels, node_names(desired), held)
        finally:
            daemon.close()
    finally:
        tb.fault("crash-serving", "head", clear=True)
