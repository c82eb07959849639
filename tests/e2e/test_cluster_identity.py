"""Issue 29, finding 7 end to end: the head renumbered (DHCP gave it another address) keeps its serving.

The cluster used to be named by the head's SSH `host:port`: after a renumbering both running containers read as
"another reconciler's container ... holds the name" and nothing moved until someone removed them by hand. Now the
head keeps the cluster's id in `~/.spark-reconciler/cluster-id` (made by the head's probe on the first converge),
the containers are labelled with it, and the same machine under another address is the same cluster: nothing is
restarted, and the running generation answers completions all along.

The testbed's head sshd listens on 0.0.0.0:22 in its namespace (testbed/sshd.py), but from the root namespace,
where the reconciler runs, only the head's management address 10.231.0.2 is routed (10.231.1.1 faces the workers,
and the testbed supernets are `unreachable` in the root namespace: testbed/net.py). So the test renumbers the head
as DHCP would: it adds 10.231.0.3/24 to the head's management port (the root's sb-mgmt0 is on that /24), points
`ssh.host` there with a known_hosts entry for the same host key, and removes the address at the end.
"""

from __future__ import annotations

import json
import threading

import pytest
import yaml

from testbed import net
from testbed.layout import MGMT_IFACE
from tests.e2e.test_converge import DESIRED, containers, reconciler, variant

pytestmark = pytest.mark.e2e

NEW_ADDRESS = "10.231.0.3"  # on the head's management /24, unused by the testbed (root .1, head .2)


def _completion(tb) -> str | None:
    """None when the head's API answered one completion with a choice; else what went wrong."""
    body = json.dumps({"model": "tiny-moe", "prompt": "ping", "max_tokens": 1})
    done = tb.exec("head", f"curl -s -m 5 -w '\\n%{{http_code}}' -H 'Content-Type: application/json' -d '{body}' "
                           "http://127.0.0.1:8000/v1/completions")
    answer, _, code = done.stdout.strip().rpartition("\n")
    if code != "200":
        return f"HTTP {code or 'none'} (curl exit {done.returncode})"
    return None if json.loads(answer).get("choices") else "no choices"


class Completions:
    """Completions through the head's API back to back, beside the test, until stopped: every answer is kept."""

    def __init__(self, tb):
        self.tb, self.results = tb, []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="completions", daemon=True)

    def _run(self) -> None:
        while not self.stop.is_set():
            self.results.append(_completion(self.tb))

    def __enter__(self) -> Completions:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join(30)


def _serving(tb) -> dict[str, tuple[str, str, str]]:
    """Per node: the serving container's id, start time and instance label."""
    out = {}
    for n in ("head", "worker"):
        info = containers(tb, n)["vllm_serving"]
        assert info["State"]["Running"], n
        out[n] = (info["Id"], info["State"]["StartedAt"], info["Config"]["Labels"]["spark-reconciler.instance"])
    return out


def test_a_renumbered_head_keeps_its_serving(seed_testbed, tmp_path):
    tb = seed_testbed
    result = reconciler("apply", str(DESIRED), "--yes")
    assert result.returncode == 0, result.stdout + result.stderr
    lines = tb.exec("head", "cat ~/.spark-reconciler/cluster-id", check=True).stdout.splitlines()
    cluster_id = lines[0]
    before = _serving(tb)
    assert {label for _, _, label in before.values()} == {cluster_id}, "labelled with the head's id, not its address"
    assert _completion(tb) is None

    head_line = next(line for line in tb.known_hosts.read_text().splitlines() if line.startswith("10.231.0.2 "))
    known_hosts = tmp_path / "known_hosts"
    known_hosts.write_text(tb.known_hosts.read_text() + head_line.replace("10.231.0.2 ", f"{NEW_ADDRESS} ", 1)
                           + "\n")
    known_hosts.chmod(0o644)

    def renumber(data: dict) -> None:
        for node in data["nodes"]:
            node["ssh"]["known_hosts"] = str(known_hosts)
            if node["role"] == "head":
                node["ssh"]["host"] = NEW_ADDRESS

    renumbered = variant(tmp_path, renumber)
    net.ip("addr", "add", f"{NEW_ADDRESS}/24", "dev", MGMT_IFACE, ns=tb.head.netns)
    try:
        with Completions(tb) as answers:
            planned = reconciler("plan", str(renumbered), "--json")
            assert planned.returncode == 0, planned.stdout + planned.stderr  # 0: no changes
            assert json.loads(planned.stdout)["steps"] == [], planned.stdout
            applied = reconciler("apply", str(renumbered), "--yes")
            out = applied.stdout + applied.stderr
            assert applied.returncode == 0, out
            assert "another reconciler" not in out, out
            observed = reconciler("observe", str(renumbered), "--json")
            assert observed.returncode == 0, observed.stdout + observed.stderr
        snapshot = tmp_path / "observed.json"
        snapshot.write_text(observed.stdout)
        assert json.loads(observed.stdout)["nodes"]["head"]["identity"]["id"] == cluster_id
        offline = reconciler("plan", str(renumbered), "--observed", str(snapshot))
        assert offline.returncode == 0, offline.stdout + offline.stderr  # the snapshot plans as the live state
        assert _serving(tb) == before, "no container was restarted (same ids, same start times)"
        assert answers.results and all(r is None for r in answers.results), answers.results
        assert tb.exec("head", "cat ~/.spark-reconciler/cluster-id", check=True).stdout.splitlines() == lines, \
            "the id file is made once and never rewritten"
    finally:
        net.ip("addr", "del", f"{NEW_ADDRESS}/24", "dev", MGMT_IFACE, ns=tb.head.netns, check=False)
    assert yaml.safe_load(renumbered.read_text())["nodes"][0]["ssh"]["host"] == NEW_ADDRESS
