"""Issue 6 end to end: a real Prometheus (Debian's package) scrapes the daemon on the testbed; drift injected with
the daemon in observe mode makes the fabric-link and drift alerts go pending, then firing, through Prometheus's
HTTP API; the repair makes them resolve. The rules are monitoring/alerts.yaml with the `for:` shortened."""

from __future__ import annotations

import json
import shutil
import subprocess
import urllib.request
from pathlib import Path

import pytest
import yaml

from testbed.proc import free_port, wait_for
from tests.e2e.daemon import Daemon
from tests.e2e.test_daemon import write_desired

pytestmark = pytest.mark.e2e
REPO = Path(__file__).resolve().parents[2]
WATCHED = {"ReconcilerFabricLinkDown": "4s", "ReconcilerDriftPersists": "4s", "ReconcilerNotConverged": "4s"}


@pytest.fixture
def prometheus(tmp_path):
    binary = shutil.which("prometheus")
    assert binary, "prometheus is installed by `make test` (Debian package prometheus)"
    rules = yaml.safe_load((REPO / "monitoring" / "alerts.yaml").read_text())
    for group in rules["groups"]:
        group["interval"] = "1s"
        for rule in group["rules"]:
            if rule.get("alert") in WATCHED:
                rule["for"] = WATCHED[rule["alert"]]
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(rules))
    port = free_port()
    targets = tmp_path / "targets.json"
    targets.write_text("[]")
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump({
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(tmp_path / "rules.yaml")],
        "scrape_configs": [{"job_name": "spark-reconciler", "file_sd_configs": [{"files": [str(targets)],
                                                                                 "refresh_interval": "1s"}]}],
    }))
    log = open(tmp_path / "prometheus.log", "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen([binary, f"--config.file={tmp_path / 'prometheus.yml'}",
                             f"--storage.tsdb.path={tmp_path / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
                            stdout=log, stderr=subprocess.STDOUT)
    api = f"http://127.0.0.1:{port}/api/v1"

    def get(path: str) -> dict:
        with urllib.request.urlopen(f"{api}/{path}", timeout=2) as r:
            return json.loads(r.read())["data"]

    wait_for(lambda: _ok(lambda: get("status/runtimeinfo")), 30, "prometheus to answer")

    def scrape(target: str) -> None:
        targets.write_text(json.dumps([{"targets": [target]}]))

    yield get, scrape
    proc.terminate()
    proc.wait(20)
    log.close()


def _ok(call) -> bool:
    try:
        call()
        return True
    except OSError:
        return False


def alert_states(get) -> dict[tuple[str, str], str]:
    return {(a["labels"]["alertname"], a["labels"].get("node", "")): a["state"] for a in get("alerts")["alerts"]}


def test_fabric_drift_alert_goes_pending_then_firing_then_resolves(seed_testbed, tmp_path, prometheus):
    get, scrape = prometheus
    tb = seed_testbed
    desired = write_desired(tmp_path / "cluster.yaml", lambda d: d["policy"].update(resync_interval="1s"))
    daemon = Daemon(desired, tmp_path / "state").start()
    try:
        daemon.wait_phase("Converged", timeout=90)
        scrape(daemon.url.removeprefix("http://"))
        wait_for(lambda: get("targets")["activeTargets"] and
                   get("targets")["activeTargets"][0]["health"] == "up", 30, "the daemon scraped")
        assert not [k for k, s in alert_states(get).items() if k[0] in WATCHED], "nothing fires while converged"

        write_desired(desired, lambda d: d["policy"].update(resync_interval="1s", mode="observe"))
        wait_for(lambda: (daemon.status() or {}).get("generation") == 2, 10, "observe mode taken")
        tb.fault("link-down", "worker")
        key = ("ReconcilerFabricLinkDown", "worker")
        wait_for(lambda: alert_states(get).get(key) == "pending", 30, "the link alert pending")
        assert tb.exec("worker", "cat /sys/class/net/enp1s0f1np1/operstate").stdout.strip() == "down", \
            "observe mode: the reconciler reports and changes nothing"
        wait_for(lambda: alert_states(get).get(key) == "firing", 30, "the link alert firing")
        wait_for(lambda: alert_states(get).get(("ReconcilerDriftPersists", "worker")) == "firing", 30,
                   "the drift alert firing")
        link_up = get("query?query=reconciler_fabric_link_up")["result"]
        assert {r["metric"]["node"]: r["value"][1] for r in link_up}["worker"] == "0"

        write_desired(desired, lambda d: d["policy"].update(resync_interval="1s", mode="enforce"))
        wait_for(lambda: key not in alert_states(get), 60, "the link alert resolved after the repair")
        wait_for(lambda: not [k for k in alert_states(get) if k[0] in WATCHED], 60, "every drift alert resolved")
        # the drift alerts go quiet while the repair is in flight (issue 33): the phase comes after them
        daemon.wait_phase("Converged", timeout=60)
    finally:
        daemon.close()
