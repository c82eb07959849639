"""Issue 33, item 4 end to end: the weekly full verify succeeds beside the running daemon, on the testbed.

The verify unit's `ExecStart=` is read from the shipped unit file (as the runbook test reads the daemon's) and run as
written, in a mount namespace of the test's own (tests/e2e/test_runbook.py's `Node`: /etc, /opt, /var/lib overlaid,
the host's files untouched) that holds what a head installed by the runbook has at those paths:
/etc/spark-reconciler/cluster.yaml, /opt/spark-reconciler/bin/reconciler (this venv's command) and the daemon's state
dir /var/lib/spark-reconciler with its status key. The daemon runs there too, as the daemon's unit runs it.
Substitution: both run as root, not as the units' `User=spark` (the venv's interpreter and the testbed's SSH key
are root's); one user for both, as the units have it, so the key the verify reads is its own user's.

Before issue 33 the same command exited 4 ("held by daemon pid N"): a repair needs the lease the daemon holds.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from reconciler.edge.daemon_client import PROOF_HEADER, request_proof
from testbed.proc import wait_for
from tests.e2e.daemon import CLI, Daemon
from tests.e2e.test_reliability import assert_nothing_lost, converged, step_starts, write_desired
from tests.e2e.test_runbook import Node

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
UNIT = REPO / "reconciler" / "files" / "systemd" / "reconciler-verify.service"
STATE = "/var/lib/spark-reconciler"
#: The environment systemd gives both units (and the test's PYTHONPATH, when it tests another tree than the venv's).
ENV = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "HOME": "/root", "LANG": "C.UTF-8",
       **{k: v for k, v in os.environ.items() if k == "PYTHONPATH"}}


def exec_start() -> list[str]:
    line = next(x for x in UNIT.read_text().splitlines() if x.startswith("ExecStart="))
    return shlex.split(line.partition("=")[2])


class HeadDaemon(Daemon):
    """`reconciler run` as the daemon's unit runs it, in the head's mount namespace (its notify socket and log on
    the host, in `host_dir`)."""

    def __init__(self, head: Node, host_dir: Path) -> None:
        super().__init__(Path("/etc/spark-reconciler/cluster.yaml"), host_dir)
        self.head = head

    def start(self) -> HeadDaemon:
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            ["nsenter", "-t", str(self.head.holder.pid), "-m", "--", "env", "-i",
             *(f"{k}={v}" for k, v in ENV.items()), f"NOTIFY_SOCKET={self.notify_path}", CLI, "run",
             str(self.desired), "--state-dir", STATE, "--log-format", "json"],
            stdout=self._log, stderr=subprocess.STDOUT)
        return self


@pytest.fixture
def head(seed_testbed, tmp_path):
    """A converged, serving testbed and a daemon on its head's paths."""
    tb = seed_testbed.reset("converged")
    node = Node("head", tb.head.netns, tmp_path / "ns")
    d = HeadDaemon(node, tmp_path / "daemon")
    desired = write_desired(tmp_path / "cluster.yaml", listen=f"127.0.0.1:{d.port}")
    node.sh(f"install -d -m 0755 /etc/spark-reconciler /opt/spark-reconciler/bin && install -d -m 0700 {STATE} && "
            f"install -m 0644 {desired} /etc/spark-reconciler/cluster.yaml && "
            f"ln -s {CLI} /opt/spark-reconciler/bin/reconciler")
    d.start()
    try:
        converged(d, 120)
        yield tb, node, d
    finally:
        d.close()
        node.close()


def run_unit(node: Node, *, without_key: bool = False) -> subprocess.CompletedProcess:
    """The unit's ExecStart as written; `without_key`: in a namespace where the state dir is not the daemon's (what
    a user who cannot read the key has)."""
    argv = ["env", "-i", *(f"{k}={v}" for k, v in ENV.items()), *exec_start()]
    if without_key:
        argv = ["unshare", "--mount", "sh", "-c", f'mount -t tmpfs none {STATE} && exec "$@"', "sh", *argv]
    return subprocess.run(["nsenter", "-t", str(node.holder.pid), "-m", "--", *argv], capture_output=True,
                          text=True, timeout=600, check=False)


def requests_of(d: Daemon) -> list[dict]:
    return (d.status() or {}).get("verifyRequests", [])


def post(url: str, body: bytes, headers: dict) -> int:
    request = urllib.request.Request(url, data=body, method="POST", headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code


def test_the_weekly_verify_succeeds_beside_the_daemon_and_repairs_through_it(head):
    from testbed import faults

    tb, node, d = head
    assert exec_start()[1:] == ["verify", "/etc/spark-reconciler/cluster.yaml", "--repair"]
    clean = run_unit(node)
    assert clean.returncode == 0, (clean.stdout, clean.stderr)
    assert "accepted by the daemon" in clean.stderr and "verifying here" not in clean.stderr, clean.stderr
    assert "files match" in clean.stdout
    first = requests_of(d)[-1]
    assert first["state"] == "done" and first["repair"] is True
    assert [r["outcome"] for r in first["results"]] == ["match"]

    shard = faults._shard(tb.layout, "worker", "testorg/tiny-moe", "hf-cache", 1)
    st = shard.stat()
    tb.fault("corrupt-shard", "worker", mode="flip", index=1)
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))  # same size, same mtime: only a full verify sees it
    since, syncs = time.time(), len(step_starts(d, "weights"))
    found = run_unit(node)
    assert found.returncode == 2, (found.stdout, found.stderr)
    assert f"blobs/{shard.name}" in found.stdout
    result = requests_of(d)[-1]["results"][0]
    assert result["outcome"] == "differ" and result["repaired"] == [f"blobs/{shard.name}"]
    assert any(e.get("event") == "verify.start" and e.get("repair") for e in d.log_events()), "the daemon ran it"
    wait_for(lambda: len(step_starts(d, "weights")) > syncs, 30, "the daemon's re-sync of the removed file")
    converged(d, 90, since=since)
    assert run_unit(node).returncode == 0, "the week after: all match again"
    assert_nothing_lost(tb, d)


def test_a_request_without_the_daemons_key_is_refused(head):
    _tb, node, d = head
    before = len(requests_of(d))
    refused = run_unit(node, without_key=True)
    assert refused.returncode == 1, (refused.stdout, refused.stderr)
    assert "status key" in refused.stderr and "cannot be read" in refused.stderr
    assert len(requests_of(d)) == before, "nothing was asked"

    def challenge() -> str:
        request = urllib.request.Request(f"{d.url}/verify/challenge", data=b"", method="POST")
        with urllib.request.urlopen(request, timeout=5) as response:
            return json.loads(response.read())["challenge"]

    body = json.dumps({"challenge": challenge(), "file": "/etc/spark-reconciler/cluster.yaml", "repair": True,
                       "node": None}).encode()
    assert post(f"{d.url}/verify", body, {}) == 401, "no proof"
    key = node.sh(f"cat {STATE}/status.key").strip().encode()
    body = json.dumps({"challenge": challenge(), "file": "/etc/spark-reconciler/cluster.yaml", "repair": False,
                       "node": None}).encode()
    proven = {PROOF_HEADER: request_proof(key, body)}
    assert post(f"{d.url}/verify", body, proven) == 202
    assert post(f"{d.url}/verify", body, proven) == 401, "the same request again: its challenge is spent"
    assert len(requests_of(d)) == before + 1
    wait_for(lambda: requests_of(d)[-1]["state"] == "done", 120, "the accepted verify's end")
    assert sum(1 for e in d.log_events() if e.get("event") == "verify.refused") == 2
