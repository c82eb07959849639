"""Every exit code of the table (reconciler.core.exits, docs/cli.md), pinned by running the installed command the
way a script or a CI job does: Terraform's 0 / 1 / 2 for plan, and one code per other outcome in every command.

Before issue 33 `plan` said 1 for "changes pending" and 2 for "invalid", a crash also exited 1 (so a CI job read a
crash as "changes pending"), and "held" and "the head is unreachable" shared 4.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
from click.testing import CliRunner

from reconciler.cli import main
from reconciler.core.exits import MEANING, Exit
from testbed.proc import free_port

REPO = Path(__file__).resolve().parents[3]
INVALID = Path(__file__).parents[1] / "invalid"


def run(script: str, *args: str | Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([script, *map(str, args)], capture_output=True, text=True, timeout=120, check=False,
                          env=env)


def test_the_codes_are_terraforms_and_distinct():
    assert (Exit.OK, Exit.ERROR, Exit.CHANGES) == (0, 1, 2)
    assert len({int(e) for e in Exit}) == len(Exit) and set(MEANING) == set(Exit)


def test_docs_cli_has_the_table():
    """docs/cli.md's table says what MEANING says, code by code (a script author reads the page)."""
    text = (REPO / "docs" / "cli.md").read_text()
    rows = dict(re.findall(r"^\| `(\d)` \| \w+ \| (.+?) \|$", text, re.M))
    assert rows == {str(int(code)): words for code, words in MEANING.items()}


# -- plan: 0 no changes, 2 changes pending, 3 invalid, 5 unreachable, 1 anything else ---------------------------

def _converged_snapshot(tmp_path: Path, cluster_yaml: Path, seed_snapshot: Path) -> Path:
    from reconciler.core import spec
    from tests.unit.conftest import converged_in_simulator

    desired = spec.load(cluster_yaml, {"VLLM_API_KEY": "sk-unit-tests-0123456789"})
    path = tmp_path / "converged.json"
    path.write_text(converged_in_simulator(desired, seed_snapshot).model_dump_json())
    return path


def test_plan_exits_0_without_changes_and_2_with(console_script, cluster_yaml, seed_snapshot, tmp_path):
    assert run(console_script, "plan", cluster_yaml, "--observed", seed_snapshot).returncode == Exit.CHANGES
    quiet = run(console_script, "plan", cluster_yaml, "--observed",
                _converged_snapshot(tmp_path, cluster_yaml, seed_snapshot))
    assert quiet.returncode == Exit.OK, quiet.stdout + quiet.stderr


def test_plan_exits_5_when_a_node_is_unreachable_even_with_changes(console_script, cluster_yaml, seed_snapshot,
                                                                  tmp_path):
    doc = json.loads(seed_snapshot.read_text())
    worker = next(name for name in doc["nodes"] if name != next(iter(doc["nodes"])))
    doc["nodes"][worker] = {"name": worker, "reachable": False, "error": "connect: Connection refused"}
    snapshot = tmp_path / "unreachable.json"
    snapshot.write_text(json.dumps(doc))
    result = run(console_script, "plan", cluster_yaml, "--observed", snapshot)
    assert result.returncode == Exit.UNREACHABLE, result.stdout + result.stderr
    assert result.stdout  # the plan is still shown


def test_a_crash_exits_1_never_2(monkeypatch, cluster_yaml, seed_snapshot):
    from reconciler.core import planning

    def boom(*_a, **_k):
        raise RuntimeError("a bug")

    monkeypatch.setattr(planning, "plan", boom)
    result = CliRunner().invoke(main, ["plan", str(cluster_yaml), "--observed", str(seed_snapshot)])
    assert result.exit_code == Exit.ERROR and isinstance(result.exception, RuntimeError)


@pytest.mark.parametrize("argv", [["plan", "--nope"], ["validate"], ["apply", "--max-passes", "many", "x.yaml"],
                                  ["nonesuch"]])
def test_usage_errors_exit_1_as_terraforms_do(console_script, argv):
    result = run(console_script, *argv)
    assert result.returncode == Exit.ERROR, result.stderr
    assert "Usage:" in result.stderr or "No such command" in result.stderr


@pytest.mark.parametrize("command", ["validate", "plan", "observe", "apply", "verify", "export", "sudoers", "doctor"])
def test_an_invalid_file_exits_3_in_every_command(console_script, command):
    result = run(console_script, command, INVALID / "two-heads.yaml")
    assert result.returncode == Exit.INVALID, result.stdout + result.stderr
    assert "exactly one node must have role head" in result.stderr


# -- unreachable and held: 5 and 4, never confused ---------------------------------------------------------------

def _unreachable_cluster(tmp_path: Path, base_yaml: str) -> Path:
    known_hosts = tmp_path / "known_hosts"
    known_hosts.write_text("")
    port = free_port()  # a loopback port nobody listens on: connection refused at once
    text = (base_yaml.replace("host: 10.0.0.1", f"host: 127.0.0.1\n      port: {port}\n"
                                                f"      known_hosts: {known_hosts}")
            .replace("jump: head-a", f"jump: head-a\n      known_hosts: {known_hosts}"))
    path = tmp_path / "cluster.yaml"
    path.write_text(text)
    return path


@pytest.mark.parametrize("argv", [["observe"], ["apply", "--yes"], ["plan"], ["verify", "--repair"], ["verify"]])
def test_an_unreachable_head_exits_5(console_script, tmp_path, base_yaml, argv):
    """`apply` against an unreachable head once said "held" (4) and "stop the daemon or wait": nobody holds it."""
    path = _unreachable_cluster(tmp_path, base_yaml)
    no_daemon = ["--url", f"http://127.0.0.1:{free_port()}"] if argv[0] == "verify" else []
    result = run(console_script, argv[0], path, *argv[1:], *no_daemon)
    assert result.returncode == Exit.UNREACHABLE, result.stdout + result.stderr
    assert "stop the daemon" not in result.stderr


def test_a_held_lease_exits_4(monkeypatch, cluster_yaml):
    from reconciler.edge import lease, log
    from reconciler.loop import apply

    def taken(*_a, **_k):
        raise lease.LeaseHeld("the cluster is held by daemon pid 7 on head")

    monkeypatch.setattr(apply, "held", taken)
    monkeypatch.setattr(log, "configure", lambda **_k: None)  # the process-wide log stays as the suite set it
    monkeypatch.setattr(apply, "Sessions", lambda desired: type("S", (), {"close": lambda self: None})())
    result = CliRunner().invoke(main, ["apply", "--yes", str(cluster_yaml)])
    assert result.exit_code == Exit.HELD, result.output
    assert "held by daemon pid 7" in result.output


# -- secrets: validate checks them, from --env-file over the shell ----------------------------------------------

def _env(**values: str) -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if k not in ("VLLM_API_KEY", "RECONCILER_ENV_FILE")} | values


def test_validate_checks_every_named_secret(console_script, cluster_yaml, tmp_path):
    missing = run(console_script, "validate", cluster_yaml, "--env-file", tmp_path / "none", env=_env())
    assert missing.returncode == Exit.INVALID and "none: No such file" in missing.stderr
    default_missing = run(console_script, "validate", cluster_yaml, env=_env())
    assert default_missing.returncode == Exit.INVALID
    assert "serving.secrets.VLLM_API_KEY: VLLM_API_KEY is not set in" in default_missing.stderr
    env_file = tmp_path / "environment"
    env_file.write_text("# the unit's\nVLLM_API_KEY='sk-from-the-file'\n")
    env_file.chmod(0o640)
    ok = run(console_script, "validate", cluster_yaml, "--env-file", env_file, env=_env())
    assert ok.returncode == Exit.OK, ok.stderr
    assert run(console_script, "validate", cluster_yaml, "--skip-secrets", env=_env()).returncode == Exit.OK


def test_an_environment_file_others_may_read_is_refused(console_script, cluster_yaml, tmp_path):
    env_file = tmp_path / "environment"
    env_file.write_text("VLLM_API_KEY=sk-do-not-print-me\n")
    env_file.chmod(0o644)
    result = run(console_script, "validate", cluster_yaml, "--env-file", env_file, env=_env())
    assert result.returncode == Exit.INVALID and "readable by others" in result.stderr
    assert "sk-do-not-print-me" not in result.stdout + result.stderr


def test_the_file_wins_over_the_shell_as_systemd_sets_it(tmp_path):
    """The runbook's plan once proposed a restart on both nodes because the caller's shell had another value."""
    from reconciler.edge.trusted_files import secrets_environment

    env_file = tmp_path / "environment"
    env_file.write_text('VLLM_API_KEY="sk-daemon"\nHF_TOKEN=\n')
    env_file.chmod(0o600)
    got = secrets_environment(env_file, True, {"VLLM_API_KEY": "sk-stale-shell", "PATH": "/bin"})
    assert got.environ["VLLM_API_KEY"] == "sk-daemon" and got.environ["PATH"] == "/bin"
    assert got.environ["HF_TOKEN"] == ""  # set empty in the file: unset for with_secrets, as systemd gives it


def test_validate_as_root_judges_the_files_as_the_daemons_user_sees_them(console_script, tmp_path, base_yaml):
    """The runbook validates as root: the daemon's key is its user's (spark), which root's own check refused
    ("owned by uid 1001, not root or the reconciler's user (uid 0)"): validate judges as the daemon's user."""
    import os
    import pwd

    assert os.geteuid() == 0, "make test runs as root (the testbed needs it)"
    nobody = pwd.getpwnam("nobody")
    key = tmp_path / "id_ed25519"
    key.write_text("a key\n")
    key.chmod(0o600)
    os.chown(key, nobody.pw_uid, nobody.pw_gid)
    known_hosts = tmp_path / "known_hosts"
    known_hosts.write_text("")
    path = tmp_path / "cluster.yaml"
    path.write_text(base_yaml.replace("host: 10.0.0.1", f"host: 10.0.0.1\n      identity_file: {key}\n"
                                                          f"      known_hosts: {known_hosts}"))
    judged_as_nobody = run(console_script, "validate", path, "--daemon-user", "nobody")
    assert judged_as_nobody.returncode == Exit.OK, judged_as_nobody.stderr
    judged_as_root = run(console_script, "validate", path, "--daemon-user", "root")
    assert judged_as_root.returncode == Exit.INVALID
    assert f"{key}: the file is owned by uid {nobody.pw_uid}, not root or the reconciler's user (uid 0)" in \
        judged_as_root.stderr
    assert run(console_script, "validate", path, "--daemon-user", "no-such-user-here").returncode == Exit.ERROR
