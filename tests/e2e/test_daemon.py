"""Issue 5 end to end: `reconciler run` on the testbed: READY, edits, invalid edits, push events, holds, single
instance, SIGTERM during a weight sync and resume. Resync is set to an hour where only events may explain a fix."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import yaml

from reconciler.loop.daemon import SHUTDOWN_DEADLINE
from testbed.proc import wait_for
from tests.e2e.daemon import CLI, SHUTDOWN_SLACK, Daemon, holds_for

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
DESIRED = REPO / "desired-state" / "testbed.yaml"


def write_desired(path: Path, change=None) -> Path:
    data = yaml.safe_load(DESIRED.read_text())
    data["policy"]["resync_interval"] = "1h"
    if change:
        change(data)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(yaml.safe_dump(data, sort_keys=False, explicit_end=True))
    tmp.replace(path)  # saved by rename, as editors do
    return path


@pytest.fixture
def daemon(seed_testbed, tmp_path):
    desired = write_desired(tmp_path / "cluster.yaml")
    d = Daemon(desired, tmp_path / "state").start()
    yield d
    d.close()


def served(tb) -> list[str]:
    body = tb.exec("head", "curl -s -m 2 http://127.0.0.1:8000/v1/models").stdout
    try:
        return [m["id"] for m in json.loads(body)["data"]]
    except (ValueError, KeyError):
        return []


def test_daemon_converges_the_seed_and_reports_ready(daemon):
    doc = daemon.wait_phase("Converged", timeout=90)
    assert doc["generation"] == doc["observedGeneration"] == 1
    assert any(m.startswith("READY=1") for m in daemon.messages())
    assert any("STATUS=Converged" in m for m in daemon.messages())
    ready = next(c for c in doc["conditions"] if c["node"] == "" and c["type"] == "Ready")
    assert ready["status"] == "True" and ready["observedGeneration"] == 1
    assert daemon.metric("reconciler_converged") == 1
    import urllib.request

    from reconciler.loop import metrics

    with urllib.request.urlopen(f"{daemon.url}/metrics", timeout=2) as response:
        exposition = response.read().decode()
    for family in metrics.REGISTRY.collect():
        assert f"# HELP {family.name}" in exposition and f"# TYPE {family.name}" in exposition, family.name
    assert 'reconciler_node_reachable{node="worker"} 1.0' in exposition
    status = subprocess.run([CLI, "status", "--wide", "--url", daemon.url, "--state-dir", str(daemon.state_dir)],
                            capture_output=True, text=True, check=False)
    assert status.returncode == 0 and "phase Converged" in status.stdout and "FabricLinkUp" in status.stdout
    assert "not verified" not in status.stderr and "without the proof" not in status.stderr, status.stderr
    # issue 16: one actuator per cluster. A copy of the file (or the same one) cannot act beside the daemon.
    copy = daemon.desired.with_name("copy-of-cluster.yaml")
    copy.write_text(daemon.desired.read_text())
    for argv in (["apply", "--yes", str(copy)], ["apply", "--yes", str(daemon.desired)],
                 ["verify", "--repair", str(copy)]):
        refused = subprocess.run([CLI, *argv], capture_output=True, text=True, check=False, timeout=60)
        assert refused.returncode == 4, (argv, refused.stdout, refused.stderr)
        assert f"held by daemon pid {daemon.proc.pid}" in refused.stderr, refused.stderr


def test_edits_converge_without_restart_and_invalid_edits_change_nothing(daemon, seed_testbed):
    daemon.wait_phase("Converged", timeout=90)
    pid = daemon.proc.pid
    steps_before = daemon.metric("reconciler_steps_total")

    daemon.desired.write_text(daemon.desired.read_text().replace("port: 8000", "port: 80000"))
    invalid = wait_for(lambda: (lambda c: c if c and c["status"] == "False" else None)(
        daemon.condition("", "DesiredStateValid")), 10, "DesiredStateValid=False")
    assert f"{daemon.desired}:" in invalid["message"] and "serving.port" in invalid["message"]
    line_col = invalid["message"].split(":")[1:3]
    assert all(part.isdigit() for part in line_col), invalid["message"]
    doc = daemon.status()
    assert doc["phase"] == "Invalid" and doc["generation"] == 1
    assert daemon.metric("reconciler_desired_state_valid") == 0
    assert daemon.metric("reconciler_steps_total") == steps_before, "an invalid edit triggers no step"

    def dense(d):
        d["model"]["id"] = "testorg/tiny-dense"
        d["model"]["revision"] = "2" * 40
        d["serving"]["served_model_name"] = "tiny-dense"

    write_desired(daemon.desired, dense)
    wait_for(lambda: (daemon.status() or {}).get("generation") == 2, 10, "generation 2")
    daemon.wait_phase("Converged", timeout=90)
    assert served(seed_testbed) == ["tiny-dense"]
    assert daemon.proc.pid == pid and daemon.proc.poll() is None
    assert daemon.status()["observedGeneration"] == 2


def _repaired(tb, fault: str, old_serving: str):
    if fault == "rogue-container":
        return tb.docker("worker", "inspect", "--format", "{{.State.Status}}", "rogue").stdout.strip() == "exited"
    if fault == "link-down":
        return "UP" in json.loads(tb.exec("worker", "ip -j link show dev enp1s0f1np1").stdout)[0]["flags"]
    now = tb.docker("worker", "inspect", "--format", "{{.Id}} {{.State.Running}}", "vllm_serving",
                    check=False).stdout.split()
    return len(now) == 2 and now[0] != old_serving and now[1] == "true" and served(tb) == ["tiny-moe"]


@pytest.mark.parametrize("fault", ["kill-serving", "link-down", "rogue-container"])
def test_push_events_detect_and_repair_drift_long_before_the_resync(daemon, seed_testbed, fault):
    daemon.wait_phase("Converged", timeout=90)
    tb = seed_testbed
    old_serving = tb.docker("worker", "inspect", "--format", "{{.Id}}", "vllm_serving").stdout.strip()
    events = daemon.metric("reconciler_events_total", node="worker")
    if fault == "kill-serving":
        tb.fault("kill-container", "worker", name="vllm_serving")
    elif fault == "link-down":
        tb.fault("link-down", "worker")
    else:
        tb.fault("rogue-container", "worker", name="rogue")
    wait_for(lambda: daemon.metric("reconciler_events_total", node="worker") > events, 10,
               "an event from the worker's stream")
    # the deadline is far below the 1h resync: only the push path explains a repair within it
    wait_for(lambda: _repaired(tb, fault, old_serving), 60, f"the {fault} repair")
    daemon.wait_phase("Converged", timeout=30)
    assert served(tb) == ["tiny-moe"]


def test_a_failed_first_deploy_brings_glm_back_answering(seed_testbed, tmp_path):
    """Issue 52, item 2, the seed story: the head serves GLM (`vllm_node`) and the daemon's first generation stops
    it to make room; that start then fails (the serving stand-in exits at start-up, as an NCCL error or a kernel
    bug would, past every preflight). With nothing that served before, the daemon goes back to what ran before
    it: the failed ranks stopped, GLM started again, the very container it stopped, answering on its port; the
    generation is held (RolledBack, "to: the co-tenants as found") until the file changes."""
    tb = seed_testbed
    glm_id = tb.docker("head", "inspect", "--format", "{{.Id}}", "vllm_node").stdout.strip()
    tb.fault("crash-serving", "head")
    desired = write_desired(tmp_path / "cluster.yaml")
    d = Daemon(desired, tmp_path / "state").start()
    try:
        rolled = wait_for(lambda: (s := d.status()) and s["phase"] == "RolledBack" and s, 240,
                          "the failed first generation rolled back to the co-tenants as found")
        assert rolled["rollback"]["generation"] == 1 and rolled["rollback"]["to"] == 0, rolled["rollback"]
        cond = next(c for c in rolled["conditions"] if c["node"] == "" and c["type"] == "RolledBack")
        assert cond["status"] == "True" and "to: the co-tenants as found" in cond["message"], cond
        assert served(tb) == ["glm-4.5-air"], "GLM answers on the head's port again"
        now = tb.docker("head", "inspect", "--format", "{{.Id}} {{.State.Running}}", "vllm_node").stdout.split()
        assert now == [glm_id, "true"], "the very container the reconciler stopped, started again"
        running = tb.docker("head", "ps", "--format", "{{.Names}}").stdout.split()
        assert "vllm_serving" not in running, "the failed rank is stopped"
        assert d.metric("reconciler_rolled_back") == 1
        history = subprocess.run([CLI, "history", str(desired), "--state-dir", str(d.state_dir), "--json"],
                                 capture_output=True, text=True, check=False, timeout=60)
        entry = json.loads(history.stdout)["entries"][0]
        assert entry["outcome"] == "rolled back to the co-tenants as found", entry
        assert ["head", "vllm_node", glm_id] in entry["stopped"], entry
    finally:
        d.close()
        tb.fault("crash-serving", "head", clear=True)


def test_a_step_that_keeps_failing_is_held_not_hammered(seed_testbed, tmp_path):
    def quick_hold(d):
        d["policy"]["retries"] = {"attempts": 1, "backoff_initial": "1s", "backoff_max": "1h", "hold_after": 3}
        d["policy"]["on_failed_change"] = "hold"  # the holds are the subject: a first failure is not rolled back

    tb = seed_testbed
    tb.fault("crash-serving", "head")
    desired = write_desired(tmp_path / "cluster.yaml", quick_hold)
    d = Daemon(desired, tmp_path / "state").start()
    try:
        held = wait_for(lambda: (lambda c: c if c and c["status"] == "True" else None)(
            d.condition("head", "StepsHeld")), 60, "the head's start held")
        doc = d.status()
        assert doc["phase"] == "Blocked" and doc["held"]
        assert "CUDA" in held["message"] or "exit" in held["message"], held["message"]
        def starts() -> float:
            return sum(d.metric("reconciler_steps_total", kind="start-serving", result=r)
                       for r in ("success", "failed"))

        attempts = starts()
        # a tight loop would run dozens of starts in this window; a hold runs none
        holds_for(lambda: starts() == attempts, 3.0, "no start attempts while held")
        failed = sum(d.metric("reconciler_steps_total", kind=k, result="failed")
                     for k in ("start-serving", "await-health"))
        assert failed == 3, f"exactly hold_after=3 failed attempts, then the hold: {failed}"
        assert sum(d.metric("reconciler_step_hold", node=n) for n in ("head", "worker")) >= 1
    finally:
        d.close()
        tb.fault("crash-serving", "head", clear=True)


def test_second_daemon_on_the_same_file_is_refused(daemon):
    daemon.wait_phase("Converged", timeout=90)
    second = subprocess.run([CLI, "run", str(daemon.desired), "--state-dir", str(daemon.state_dir),
                             "--listen", "127.0.0.1:0"], capture_output=True, text=True, timeout=30, check=False)
    assert second.returncode == 1
    assert "already runs" in second.stderr and str(daemon.desired) in second.stderr


def _regular_files(tb, node: str, root: str) -> dict[str, int]:
    out = tb.exec(node, f"cd {root} 2>/dev/null && find . -type f ! -path '*/.rsync-partial/*' -printf '%P %s\\n'")
    return {line.rsplit(" ", 1)[0]: int(line.rsplit(" ", 1)[1]) for line in out.stdout.splitlines() if line}


def test_sigterm_during_a_weight_sync_exits_cleanly_and_the_next_start_resumes(seed_testbed, tmp_path):
    def slow_sync(d):
        d["policy"]["weights"] = {"parallel_streams": 1, "bandwidth_limit": "4MB"}

    tb = seed_testbed
    src = "/srv/spark-testbed/head/models/hub/models--testorg--tiny-moe"
    dst = "/srv/spark-testbed/worker/models/hub/models--testorg--tiny-moe"
    full = _regular_files(tb, "head", src)
    desired = write_desired(tmp_path / "cluster.yaml", slow_sync)
    first = Daemon(desired, tmp_path / "state").start()
    try:
        wait_for(lambda: any(e.get("event") == "step.start" and e.get("kind") == "weights"
                               for e in first.log_events()), 60, "the weight sync to start")
        wait_for(lambda: any(p.startswith("blobs/") and full.get(p) == size
                               for p, size in _regular_files(tb, "worker", dst).items()), 60, "a first complete blob")
        assert first.stop(timeout=SHUTDOWN_DEADLINE + SHUTDOWN_SLACK) == 0, "SIGTERM ends the daemon mid-sync"
        assert any(m.startswith("STOPPING=1") for m in first.messages())
    finally:
        first.close()
    assert not tb.docker("worker", "ps", "-q", "--filter", "name=vllm_serving").stdout.strip()
    # rsync's receiver notices the closed connection a moment later and moves its temp file (.NAME.XXXXXX)
    # into .rsync-partial for the resume
    wait_for(lambda: not any(Path(p).name.startswith(".") for p in _regular_files(tb, "worker", dst)), 15,
               "the interrupted temp file moved into .rsync-partial")
    kept = _regular_files(tb, "worker", dst)
    assert kept and all(full.get(p) == size for p, size in kept.items()), \
        "no file under its final name is half-written"
    assert sum(kept.values()) < sum(full.values()), "interrupted mid-sync"

    write_desired(desired)  # no bandwidth limit now
    second = Daemon(desired, tmp_path / "state2").start()
    try:
        second.wait_phase("Converged", timeout=120)
        totals = [e["bytes_total"] for e in second.log_events() if e.get("event") == "weights.start"]
        assert totals and totals[0] <= sum(full.values()) - sum(kept.values()), \
            ("resumed: only what was missing is copied", totals, sum(full.values()), sum(kept.values()))
    finally:
        second.close()
    assert _regular_files(tb, "worker", dst) == full
