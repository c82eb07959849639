"""The `reconciler` command as an operator runs it: the installed console script, in a subprocess.

Exit codes are a contract (docs/cli.md): validate 0/2; plan 0 no changes, 1 changes pending, 2 invalid; apply 0
converged, 1 not converged, 2 invalid; observe 0, 3 unreachable node; status 0 converged, 1 not.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

INVALID = Path(__file__).parents[1] / "invalid"


def run(script: str, *args: str | Path, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([script, *map(str, args)], capture_output=True, text=True, timeout=60, cwd=cwd, check=False)


def assert_no_traceback(result: subprocess.CompletedProcess[str]) -> None:
    assert "Traceback" not in result.stderr, result.stderr


# ---------------------------------------------------------------------------------------------- validate


def test_validate_cluster_yaml_exits_0(console_script, cluster_yaml):
    result = run(console_script, "validate", cluster_yaml)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"{cluster_yaml}: valid"
    assert result.stderr == ""


def test_validate_relative_path_from_the_repo(console_script, repo):
    result = run(console_script, "validate", "desired-state/cluster.yaml", cwd=repo)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "desired-state/cluster.yaml: valid"


@pytest.mark.parametrize("name", ["two-heads", "jump-cycle", "tp-exceeds-gpus", "image-injection", "duplicate-yaml-key",
                                  "invalid-utf8", "unknown-top-level-key", "top-level-list", "reserved-extra-arg",
                                  "second-document"])
def test_validate_invalid_corpus_file_exits_3_with_its_line(console_script, name):
    path = INVALID / f"{name}.yaml"
    expect = path.read_bytes().split(b"\n", 1)[0].decode().removeprefix("# expect: ")
    where, _, rest = expect.partition(": ")
    result = run(console_script, "validate", path)
    assert result.returncode == 3, (result.stdout, result.stderr)
    assert result.stdout == ""
    assert_no_traceback(result)
    lines = result.stderr.splitlines()
    # rest is "path: substring" or a path-less "substring"; the rendered line always starts FILE:LINE:COL:
    field, sep, substring = rest.partition(": ")
    if sep and " " not in field:
        hits = [l for l in lines if l.startswith(f"{path}:{where}: {field}: ") and substring in l]
    else:
        hits = [l for l in lines if l.startswith(f"{path}:{where}: ") and rest in l]
    assert hits, result.stderr


def test_validate_prints_every_error_one_per_line(console_script, tmp_path, base_yaml):
    bad = tmp_path / "bad.yaml"
    bad.write_text(base_yaml.replace("port: 8000", "port: 0")
                   .replace("resync_interval: 30s", "resync_interval: 30")
                   .replace("listen: 127.0.0.1:9464", "listen: nowhere"))
    result = run(console_script, "validate", bad)
    assert result.returncode == 3
    assert result.stderr.splitlines() == [
        f"{bad}:26:9: serving.port: must be greater than or equal to 1",
        f"{bad}:36:20: policy.resync_interval: 30 is not a duration; write it like 30s, 5m, 1h30m or 250ms",
        f"{bad}:37:11: policy.listen: 'nowhere' is not a valid HOST:PORT (an IP address or localhost, port "
        "1-65535; IPv6 as [::1]:9464)",
    ]


@pytest.mark.parametrize("target,message", [("missing.yaml", "no such file"), (".", "is a directory, not a file")])
def test_validate_unreadable_targets_exit_3(console_script, tmp_path, target, message):
    path = tmp_path / target
    result = run(console_script, "validate", path)
    assert result.returncode == 3
    assert result.stderr.strip() == f"{path}:1:1: {message}"


def test_validate_with_unknown_yaml_tag_exits_3_without_traceback(console_script, tmp_path, base_yaml):
    """An unknown tag was once a crash (exit 1, traceback) instead of exit 3 (see test_loader)."""
    bad = tmp_path / "tag.yaml"
    bad.write_text(base_yaml.replace("port: 8000", "port: !custom 8000"))
    result = run(console_script, "validate", bad)
    assert_no_traceback(result)
    assert result.returncode == 3
    assert result.stderr.startswith(f"{bad}:26:9: ")


def test_validate_without_argument_is_a_usage_error_exit_1_as_terraform(console_script):
    """click's own 2 would read as "changes pending" to a script that follows Terraform's codes."""
    result = run(console_script, "validate")
    assert result.returncode == 1
    assert "Missing argument" in result.stderr


# ---------------------------------------------------------------------------------------------- schema, help


def test_schema_prints_the_json_schema(console_script):
    result = run(console_script, "schema")
    assert result.returncode == 0, result.stderr
    schema = json.loads(result.stdout)
    assert "nodes" in schema["properties"]
    assert set(schema["required"]) == {"nodes"} and {"model", "serving", "deployments"} <= set(schema["properties"])
    assert schema.get("additionalProperties") is False
    assert {"Node", "Serving", "Policy", "CoTenants"} <= set(schema["$defs"])


def test_help_and_version(console_script):
    result = run(console_script, "--help")
    assert result.returncode == 0
    for command in ("validate", "schema", "plan", "observe", "apply", "run", "status"):
        assert command in result.stdout
    version = run(console_script, "--version")
    assert version.returncode == 0 and version.stdout.startswith("reconciler, version ")


# ---------------------------------------------------------------------------------------------- plan


@pytest.fixture(scope="module")
def seed_plan(console_script, cluster_yaml, seed_snapshot) -> tuple[subprocess.CompletedProcess[str], dict]:
    result = run(console_script, "plan", cluster_yaml, "--observed", seed_snapshot, "--json")
    return result, json.loads(result.stdout)


def test_plan_on_the_seed_exits_2_with_changes(seed_plan):
    result, out = seed_plan
    assert result.returncode == 2, result.stderr
    assert out["changes"] is True
    assert isinstance(out["drift"], list) and out["drift"]
    assert isinstance(out["steps"], list) and out["steps"]


def test_plan_json_shape(seed_plan):
    _, out = seed_plan
    for d in out["drift"]:
        assert {"node", "kind", "resource", "expected", "observed"} <= set(d), d
        assert all(isinstance(d[k], str) for k in ("node", "kind", "resource", "expected", "observed"))
    ids = [s["id"] for s in out["steps"]]
    assert len(ids) == len(set(ids)), "step ids must be unique"
    for s in out["steps"]:
        assert {"id", "kind", "node", "reason", "after"} <= set(s), s
        assert isinstance(s["after"], list) and s["reason"]
        assert s["node"] in ("spark-1a32", "spark-5be3")


def test_plan_drift_on_the_seed(seed_plan):
    _, out = seed_plan
    by = {(d["node"], d["kind"], d["resource"]) for d in out["drift"]}
    assert ("spark-1a32", "co-tenant", "container/vllm_node") in by
    assert not any("vllm_embeddings" in r or "reranker" in r for _, _, r in by)
    kinds_on_worker = {k for n, k, _ in by if n == "spark-5be3"}
    assert {"link", "rdma", "image", "weights", "serving"} <= kinds_on_worker


def test_plan_steps_on_the_seed(seed_plan):
    _, out = seed_plan
    steps = out["steps"]
    ids = [s["id"] for s in steps]
    assert set(ids) == {
        "stop-container/spark-1a32/vllm_node", "link/spark-5be3", "image/spark-5be3", "weights/spark-5be3",
        "start-serving/spark-5be3", "start-serving/spark-1a32", "await-health/spark-1a32"}
    # never stops an allowed co-tenant
    assert not any(s["kind"] == "stop-container" and ("vllm_embeddings" in s["id"] or "reranker" in s["id"])
                   for s in steps)


def test_plan_step_order(seed_plan):
    _, out = seed_plan
    steps = out["steps"]
    index = {s["id"]: i for i, s in enumerate(steps)}
    kinds = [s["kind"] for s in steps]

    def positions(kind: str, node: str | None = None) -> list[int]:
        return [i for i, s in enumerate(steps) if s["kind"] == kind and (node is None or s["node"] == node)]

    assert positions("link") and max(positions("link")) < min(positions("weights"))
    prereqs = positions("weights") + positions("image")
    # the GLM co-tenant serves on through the copies, and is stopped before the start it makes room for
    assert prereqs and max(prereqs) < min(positions("stop-container")) < min(positions("start-serving"))
    assert max(positions("start-serving", "spark-5be3")) < min(positions("start-serving", "spark-1a32"))
    assert kinds[-1] == "await-health" and kinds.count("await-health") == 1
    # `after` only names earlier steps, and encodes the same order
    for s in steps:
        for dep in s["after"]:
            assert dep in index and index[dep] < index[s["id"]], (s["id"], dep)
    assert "link/spark-5be3" in steps[index["weights/spark-5be3"]]["after"]
    head_start = steps[index["start-serving/spark-1a32"]]["after"]
    assert "start-serving/spark-5be3" in head_start
    worker_start = steps[index["start-serving/spark-5be3"]]["after"]
    assert {"weights/spark-5be3", "image/spark-5be3", "stop-container/spark-1a32/vllm_node"} <= set(worker_start)
    assert steps[-1]["after"] == ["start-serving/spark-1a32"]


def test_plan_is_deterministic(console_script, cluster_yaml, seed_snapshot, seed_plan):
    result, _ = seed_plan
    again = run(console_script, "plan", cluster_yaml, "--observed", seed_snapshot, "--json")
    assert again.returncode == 2 and again.stdout == result.stdout


def test_plan_text_output(console_script, cluster_yaml, seed_snapshot):
    result = run(console_script, "plan", cluster_yaml, "--observed", seed_snapshot)
    assert result.returncode == 2, result.stderr
    assert "stop-container/spark-1a32/vllm_node" in result.stdout
    assert result.stdout.index("Drift:") < result.stdout.index("Steps")


def test_plan_with_invalid_desired_state_exits_3(console_script, seed_snapshot):
    path = INVALID / "two-heads.yaml"
    result = run(console_script, "plan", path, "--observed", seed_snapshot, "--json")
    assert result.returncode == 3
    assert result.stdout == ""
    assert f"{path}:12:11: nodes[1].role:" in result.stderr


@pytest.mark.parametrize("content", [b"{not json", b'{"nodes": {"x": {"reachable": "maybe"}}}', b'[]',
                                     b'{"version": "other/v9", "nodes": {}}', b"\xff\xfe"])
def test_plan_with_a_bad_snapshot_exits_3(console_script, cluster_yaml, tmp_path, content):
    snapshot = tmp_path / "snap.json"
    snapshot.write_bytes(content)
    result = run(console_script, "plan", cluster_yaml, "--observed", snapshot, "--json")
    assert result.returncode == 3, (result.stdout, result.stderr)
    assert_no_traceback(result)
    assert result.stdout == ""
    assert f"{snapshot}: not an observed-state snapshot" in result.stderr


def test_plan_with_a_missing_snapshot_is_a_usage_error_exit_1(console_script, cluster_yaml, tmp_path):
    result = run(console_script, "plan", cluster_yaml, "--observed", tmp_path / "nope.json")
    assert result.returncode == 1
    assert "does not exist" in result.stderr


# ---------------------------------------------------------------------------------------------- status


def test_status_without_a_daemon_exits_5_and_says_where_it_looked(console_script):
    from testbed.proc import free_port

    url = f"http://127.0.0.1:{free_port()}"  # a loopback port nobody listens on
    result = run(console_script, "status", "--url", url)
    assert result.returncode == 5
    assert f"cannot reach the daemon at {url}" in result.stderr


@pytest.mark.parametrize("command", ["validate", "plan", "observe"])
def test_every_command_taking_a_file_exits_3_on_an_invalid_one_before_touching_the_network(console_script, command):
    path = INVALID / "jump-cycle.yaml"
    result = run(console_script, command, path)
    assert result.returncode == 3
    assert result.stdout == ""
    assert f"{path}:7:13: nodes[0].ssh.jump: jump hosts form a cycle" in result.stderr
