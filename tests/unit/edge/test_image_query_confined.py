"""The serving image's flags are asked from a confined container (issue 53, H): `plan` and `observe` run it, so it
runs by the image id the probe saw (not by a tag that may name another image by then), with no network, a
read-only root and a `/tmp` tmpfs, no capability, no new privileges, bounded pids and memory, as `nobody` where the
image allows, and under a deadline on the node that removes the container itself.

The real vLLM 0.32.0 CPU build answered `vllm serve --help=all` as uid 65534 with only /tmp writable, HOME absent
and HF_HOME unreadable, byte for byte the recorded fixture (traced: its only writes were a tempfile probe and
torch's `/tmp/torchinductor_nobody`); on a private dockerd 20.10.24 the exact argv ran by id as 65534 with no
capability, NoNewPrivs, a read-only root and the bounds, and a container ignoring SIGTERM was removed at its
deadline (docs/security.md "Containers"). The e2e check with the testbed's images is the lead's.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from reconciler.core.loader import load_file
from reconciler.core.spec import Desired
from reconciler.core.vllm import parse_serve_help
from reconciler.edge import image_flags
from reconciler.edge.image_flags import bounded_query, query_argv

REPO = Path(__file__).resolve().parents[3]
HELP_0201 = REPO / "tests" / "fixtures" / "vllm-0.20.1-serve-help-all.txt"
IMAGE_ID = "sha256:" + "4" * 64


@pytest.fixture
def desired(cluster_yaml) -> Desired:
    return Desired.model_validate(load_file(cluster_yaml).data)


def _recorded_answer() -> str:
    help_text = "".join(line for line in HELP_0201.read_text().splitlines(keepends=True) if not line.startswith("#"))
    return f"@@ray no\n@@version 0.20.1\n@@env CUDA_VERSION=13.2.1.006\n{help_text}"


class _Node:
    """A session that answers each run with the next of `answers` (stdout, stderr, exit code)."""

    def __init__(self, *answers: tuple[str, str, int]) -> None:
        self.answers = list(answers)
        self.runs: list[tuple[list[str], float]] = []

    def run(self, argv, timeout, check):
        self.runs.append((list(argv), timeout))
        stdout, stderr, code = self.answers.pop(0)
        return SimpleNamespace(stdout=stdout, stderr=stderr, exit_code=code)


def _docker(argv: list[str]) -> list[str]:
    """The `docker run` argv inside the deadline wrapper (`bounded_query`)."""
    return argv[argv.index("sh", 1) + 1:]


def test_the_question_container_argv_is_exact():
    assert query_argv(IMAGE_ID, "spark-reconciler-query-0123456789abcdef") == [
        "docker", "run", "--rm", "--name", "spark-reconciler-query-0123456789abcdef",
        "--label", "spark-reconciler.query=serve-flags", "--network", "none",
        "--read-only", "--tmpfs", "/tmp:rw,noexec,nosuid,nodev,size=512m", "--env", "HOME=/tmp",
        "--cap-drop", "ALL", "--security-opt", "no-new-privileges",
        "--pids-limit", "512", "--memory", "4g", "--memory-swap", "4g", "--user", "65534:65534",
        "--entrypoint", "sh", IMAGE_ID, "-c", image_flags._ASK_IMAGE]
    as_image = query_argv(IMAGE_ID, "n", user=None)
    assert "--user" not in as_image and as_image[as_image.index("--entrypoint") - 1] == "4g"


def test_the_image_is_run_by_the_id_the_probe_saw_not_by_its_tag(desired):
    node = _Node((_recorded_answer(), "", 0))
    answer = image_flags.ask_serve_flags(desired, {desired.head.name: node}, desired.head.name,  # type: ignore[dict-item]
                                         IMAGE_ID)
    argv, timeout = node.runs[0]
    docker = _docker(argv)
    name = docker[docker.index("--name") + 1]
    assert name.startswith("spark-reconciler-query-") and len(name) == len("spark-reconciler-query-") + 16
    assert docker == query_argv(IMAGE_ID, name)
    assert desired.serving.image not in " ".join(argv) and docker[docker.index("--entrypoint") + 2] == IMAGE_ID
    assert argv == bounded_query(docker, name, 160) and timeout == image_flags.FLAGS_DEADLINE
    assert answer.error is None and answer.image_id == IMAGE_ID


def test_the_parse_of_a_recorded_answer_is_unchanged(desired):
    """vLLM 0.20.1's recorded `--help=all` (NGC 26.05's vLLM) reads as it did before the confinement."""
    node = _Node((_recorded_answer(), "", 0))
    answer = image_flags.ask_serve_flags(desired, {desired.head.name: node}, desired.head.name,  # type: ignore[dict-item]
                                         IMAGE_ID)
    assert answer.flags == parse_serve_help(HELP_0201.read_text()) and len(answer.flags) > 300
    assert (answer.has_ray, answer.version, answer.cuda_version) == (False, "0.20.1", "13.2.1.006")


@pytest.mark.parametrize("odd", ["vllm-standin:latest", "--privileged", "sha256:" + "A" * 64, "sha256:12ab", ""])
def test_a_node_that_names_no_image_id_runs_nothing(desired, odd):
    """The id is the node's word (its engine's inspect): anything but `sha256:` and 64 hex digits is not run, so
    it can neither name a tag nor be read by docker as an option."""
    node = _Node()
    answer = image_flags.ask_serve_flags(desired, {desired.head.name: node}, desired.head.name,  # type: ignore[dict-item]
                                         odd)
    assert node.runs == [] and answer.flags == [] and "not an image id" in (answer.error or "")


def test_an_image_nobody_cannot_read_is_asked_as_its_own_user_confined_all_the_same(desired):
    denied = ("", "PermissionError: [Errno 13] Permission denied: '/root/.local/lib/python3.12'", 1)
    node = _Node(denied, (_recorded_answer(), "", 0))
    answer = image_flags.ask_serve_flags(desired, {desired.head.name: node}, desired.head.name,  # type: ignore[dict-item]
                                         IMAGE_ID)
    first, second = (_docker(argv) for argv, _ in node.runs)
    assert first[first.index("--user") + 1] == "65534:65534" and "--user" not in second
    name = second[second.index("--name") + 1]
    assert second == query_argv(IMAGE_ID, name, user=None)
    assert answer.error is None and answer.flags


def test_any_other_failure_as_nobody_is_the_answer(desired):
    node = _Node(("", "exec /usr/bin/sh: exec format error", 255))
    answer = image_flags.ask_serve_flags(desired, {desired.head.name: node}, desired.head.name,  # type: ignore[dict-item]
                                         IMAGE_ID)
    assert len(node.runs) == 1 and answer.error == "exit 255, no flags listed: exec /usr/bin/sh: exec format error"


def test_an_answer_ended_by_the_deadline_says_so(desired, monkeypatch):
    monkeypatch.setattr(image_flags, "REMOVAL_ALLOWANCE", int(image_flags.FLAGS_DEADLINE) - 1)  # a 1 s deadline
    node = _Node(("@@ray no\n", "", 124))
    answer = image_flags.ask_serve_flags(desired, {desired.head.name: node}, desired.head.name,  # type: ignore[dict-item]
                                         IMAGE_ID)
    assert answer.error == "no answer within 1s (the question container was removed)"
    assert bounded_query(["docker"], "n", 1)[2].startswith("timeout -k 5 1 ")


# -- the deadline on the node, run for real under sh ----------------------------------------------------------

_FAKE_DOCKER = """#!/bin/sh
# `docker run ...`: the client ends on SIGTERM; the container is not in its process group (containerd's shim holds
# it), ignores SIGTERM and outlives it; `docker rm -f NAME` is recorded and ends it.
if [ "$1" = run ]; then
    setsid sh -c 'trap "" TERM; echo $$ > "$0/container.pid"; while :; do sleep 0.1; done' "$RECORD" &
    echo "@@ray no"
    wait
elif [ "$1" = rm ]; then
    echo "$*" >> "$RECORD/rm.txt"
    kill -9 "$(cat "$RECORD/container.pid")"
fi
"""


def _fake_node(tmp_path: Path, script: str) -> dict[str, str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "docker").write_text(script)
    (bin_dir / "docker").chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "RECORD": str(tmp_path)}


def test_a_question_past_its_deadline_is_ended_and_its_container_removed(tmp_path):
    env = _fake_node(tmp_path, _FAKE_DOCKER)
    name = "spark-reconciler-query-00000000000000aa"
    res = subprocess.run(bounded_query(["docker", "run", "--name", name], name, 1), capture_output=True,
                         text=True, env=env, timeout=60, check=False)
    assert res.returncode in (124, 137) and res.stdout == "@@ray no\n"
    assert (tmp_path / "rm.txt").read_text() == f"rm -f {name}\n"
    pid = int((tmp_path / "container.pid").read_text())
    for _ in range(50):
        if not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]:
            break
        time.sleep(0.1)
    else:
        pytest.fail("the container outlived its deadline")


def test_a_question_that_answers_in_time_removes_nothing(tmp_path):
    env = _fake_node(tmp_path, f"#!{sys.executable}\nimport sys\nprint('@@version 0.20.1')\nsys.exit(3)\n")
    res = subprocess.run(bounded_query(["docker", "run"], "n", 30), capture_output=True, text=True, env=env,
                         timeout=60, check=False)
    assert (res.returncode, res.stdout) == (3, "@@version 0.20.1\n") and not (tmp_path / "rm.txt").exists()
