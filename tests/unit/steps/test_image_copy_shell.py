"""The image copy's shell, run for real with stand-in `docker` and `ssh` (the real ones need a daemon and a
peer: tests/e2e covers those): bytes flow save -> dd -> ssh -> load, dd's count reaches the step's progress,
and a failure at either end fails the copy (pipefail; dash would report only the last stage)."""

from __future__ import annotations

import os
import subprocess

import pytest

from reconciler.core.loader import load_file
from reconciler.core.observed import Observed
from reconciler.core.spec import Desired
from reconciler.edge.steps.actions import Given
from reconciler.edge.steps.images import ByteCount, copy_argv

DOCKER = """#!/bin/sh
case "$1" in
  save) [ -n "$SAVE_FAILS" ] && { echo "Error response from daemon: no such image" >&2; exit 1; }
        head -c 9000000 /dev/zero ;;
  load) n=$(wc -c); echo "Loaded image: $n bytes" ;;
esac
"""
SSH = """#!/bin/sh
# the last argument is the remote command, as sshd would run it: sh -c on the target
eval "cmd=\\${$#}"
exec sh -c "$cmd"
"""


@pytest.fixture
def stubs(tmp_path):
    for name, text in (("docker", DOCKER), ("ssh", SSH)):
        (tmp_path / name).write_text(text)
        (tmp_path / name).chmod(0o755)
    return {"PATH": f"{tmp_path}:{os.environ['PATH']}"}


def _argv(cluster_yaml) -> list[str]:
    desired = Desired.model_validate(load_file(cluster_yaml).data)
    worker = next(n.name for n in desired.nodes if n.role == "worker")
    return list(copy_argv(Given(desired, Observed(nodes={})), desired.serving.image, worker, 60))


def test_bytes_flow_to_the_load_and_are_counted(cluster_yaml, stubs):
    done = subprocess.run(_argv(cluster_yaml), env=stubs, capture_output=True, timeout=30, check=False)
    assert done.returncode == 0, done.stderr
    count = ByteCount()
    count.feed(done.stdout)
    assert count.done == 9_000_000
    assert b"Loaded image: 9000000 bytes" in done.stderr, "docker load's answer goes to stderr, not the count"


def test_a_failed_save_fails_the_copy(cluster_yaml, stubs):
    done = subprocess.run(_argv(cluster_yaml), env=stubs | {"SAVE_FAILS": "1"}, capture_output=True, timeout=30,
                          check=False)
    assert done.returncode != 0 and b"no such image" in done.stderr


def test_the_load_is_bounded_on_the_target_too(cluster_yaml):
    remote = _argv(cluster_yaml)[-1]
    assert remote.startswith("timeout -k ") and remote.endswith("docker load")


def test_the_count_survives_chunks_split_anywhere():
    report = (b"104857600 bytes (105 MB, 100 MiB) copied, 1 s, 105 MB/s\r"
              b"209715200 bytes (210 MB, 200 MiB) copied, 2 s, 105 MB/s\r"
              b"50+0 records in\n50+0 records out\n209715200 bytes (210 MB, 200 MiB) copied, 2.0 s, 105 MB/s\n")
    for cut in range(1, len(report)):
        count = ByteCount()
        grew = [count.feed(report[:cut]), count.feed(report[cut:])]
        assert count.done == 209715200 and any(grew), cut
    count = ByteCount()
    seen = []
    for byte in report:
        if count.feed(bytes([byte])):
            seen.append(count.done)
    assert seen == [104857600, 209715200], "one byte at a time: whole records only, never backwards"
