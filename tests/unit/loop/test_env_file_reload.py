"""The daemon reads the secrets from its environment file at every load (`run --env-file`, issue 33 item 3): a key
rotated in the file is a new generation at the next reload (SIGHUP, `systemctl reload`), as `plan` run from a shell
sees it, and a name the file lacks keeps the last good generation, saying where it was looked for."""

from __future__ import annotations

import shutil
import threading
from pathlib import Path

from reconciler.edge.trusted_files import secrets_environment
from reconciler.loop.controller import Controller
from reconciler.loop.triggers import ReconcileRequests
from tests.unit.controllers import make_controller

REPO = Path(__file__).resolve().parents[3]


def _controller(tmp_path: Path) -> tuple[Controller, Path]:
    desired = tmp_path / "cluster.yaml"
    shutil.copy(REPO / "desired-state" / "cluster.yaml", desired)  # declares serving.secrets VLLM_API_KEY
    (tmp_path / "state").mkdir()
    env = tmp_path / "environment"
    secrets = lambda: secrets_environment(env, True, {})  # noqa: E731 - the shell's VLLM_API_KEY plays no part
    return make_controller(desired, tmp_path / "state", ReconcileRequests(), threading.Event(), events=False,
                      sessions_factory=_NoSessions, secrets=secrets), env


class _NoSessions:
    """Nothing is reached: this test is about what the file and the environment file give."""

    def __init__(self, desired) -> None:
        self.desired = desired

    def update(self, desired) -> None:
        self.desired = desired

    def close(self) -> None:
        pass


def _write(env: Path, text: str) -> None:
    env.write_text(text)
    env.chmod(0o640)


def test_a_key_rotated_in_the_file_is_a_new_generation_at_the_next_reload(tmp_path):
    controller, env = _controller(tmp_path)
    _write(env, "VLLM_API_KEY=sk-first\n")
    assert controller.reload() and controller.store.generation == 1
    assert controller.desired.secret("VLLM_API_KEY") == "sk-first"
    assert not controller.reload(), "the same file and values: nothing new"
    _write(env, "# rotated\nVLLM_API_KEY='sk-second'\n")
    assert controller.reload() and controller.store.generation == 2
    assert controller.desired.secret("VLLM_API_KEY") == "sk-second"


def test_a_name_the_file_lacks_keeps_the_last_good_generation_and_says_where(tmp_path):
    controller, env = _controller(tmp_path)
    _write(env, "VLLM_API_KEY=sk-first\n")
    assert controller.reload()
    _write(env, "HF_TOKEN=hf_other\n")
    assert not controller.reload()
    assert controller.desired.secret("VLLM_API_KEY") == "sk-first" and controller.store.generation == 1
    assert f"VLLM_API_KEY is not set in {env} or this process's environment" in controller.file_error
    env.chmod(0o644)
    assert not controller.reload() and "readable by others" in controller.file_error
