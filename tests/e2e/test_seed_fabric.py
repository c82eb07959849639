"""The seed story on the seed's own topology (issue 30, finding 7): the worker has no management port of its own
and is reached through the head over the fabric only, its first port down and its twin up (scenario
`seed-fabric`, testbed/scenarios.py). With `ssh.fallback_hosts` naming the twin's address, one `apply` reaches the
worker over the twin, repairs the first port from there and converges. Then (issue 52, item 9) the first port,
which the worker's session arrives on once it is up, reset to 1500 by a firmware reboot: the MTU is repaired over
a session to the twin's address. Every check reads the nodes directly."""

from __future__ import annotations

import json
import time

import pytest

from tests.e2e.test_converge import containers, reconciler, variant

pytestmark = pytest.mark.e2e


@pytest.fixture
def fabric_testbed(testbed):
    yield testbed.reset("seed-fabric")
    testbed.reset("seed")  # the worker's management path back, for the tests that take the testbed as they find it


def over_the_fabric(data: dict) -> None:
    worker = next(n for n in data["nodes"] if n["name"] == "worker")
    worker["ssh"].update(host=worker["fabric"]["address"].split("/")[0],
                         fallback_hosts=[worker["fabric"]["twin"]["address"].split("/")[0]])


def port(tb, node: str, dev: str) -> dict:
    return json.loads(tb.exec(node, f"ip -j addr show dev {dev}", check=True).stdout)[0]


def test_the_seed_converges_with_the_worker_reached_over_its_twin(fabric_testbed, tmp_path):
    tb = fabric_testbed
    reach = "timeout 5 bash -c 'exec 3<>/dev/tcp/{}/22' && echo open || echo closed"
    assert tb.exec("head", reach.format(tb.workers[0].ssh_host)).stdout.strip() == "closed", \
        "the premise: no management path to the worker"
    assert tb.exec("head", reach.format("10.232.0.11")).stdout.strip() == "closed", "nor over its first port"
    assert "UP" not in port(tb, "worker", "enp1s0f1np1")["flags"]

    result = reconciler("apply", str(variant(tmp_path, over_the_fabric)), "--yes", timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Converged" in result.stdout

    first = port(tb, "worker", "enp1s0f1np1")
    assert "UP" in first["flags"] and "LOWER_UP" in first["flags"] and first["mtu"] == 9000
    assert "10.232.0.11" in [a["local"] for a in first["addr_info"]]
    assert containers(tb, "worker")["vllm_serving"]["State"]["Running"]
    body = json.dumps({"model": "tiny-moe", "prompt": "ping", "max_tokens": 2})
    answer = tb.exec("head", f"curl -s -m 30 -H 'Content-Type: application/json' -d '{body}' "
                             "http://127.0.0.1:8000/v1/completions", check=True).stdout
    assert json.loads(answer)["choices"]


def only_under_host(tb, path) -> str:
    """A known_hosts with each node's key under its `ssh.host` only (the worker's under its first port's address,
    not under its twin's): a session over the twin is accepted only because its key is checked under that entry."""
    hosts = {tb.head.ssh_host, "10.232.0.11"}
    path.write_text("".join(f"{line}\n" for line in tb.known_hosts.read_text().splitlines()
                            if line.split()[0] in hosts))
    return str(path)


def test_the_first_port_reset_to_1500_is_repaired_over_the_twin(fabric_testbed, tmp_path):
    """Issue 52, item 9: the worker reached over its own first fabric port; a firmware reboot resets its ports to
    1500 (SSH still works: TCP negotiated the MSS). The first port's MTU is set over a session to the twin's address,
    never over the session that arrives on the port (the twin's then over that session); the serving started before
    goes on, and the session keeps working."""
    tb = fabric_testbed
    known = only_under_host(tb, tmp_path / "known_hosts")

    def change(data: dict) -> None:
        over_the_fabric(data)
        for node in data["nodes"]:
            node["ssh"]["known_hosts"] = known

    desired = str(variant(tmp_path, change))
    result = reconciler("apply", desired, "--yes", timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    serving = {n: containers(tb, n)["vllm_serving"]["Id"] for n in ("head", "worker")}

    for dev in ("enp1s0f1np1", "enP2p1s0f1np1"):  # the firmware reboot resets the NIC: both of its netdevs
        tb.fault("mtu", "worker", value=1500, dev=dev)
    first = port(tb, "worker", "enp1s0f1np1")
    assert first["mtu"] == 1500 and "LOWER_UP" in first["flags"], "the premise: the port carries, at 1500"
    assert "10.232.0.11" in [a["local"] for a in first["addr_info"]], "the premise: `ssh.host` answers there"
    assert port(tb, "worker", "enP2p1s0f1np1")["mtu"] == 1500

    sshd_log = tb.node("worker").state / "sshd.log"  # the worker's sshd says where each login came from
    seen = sshd_log.stat().st_size
    started = time.monotonic()
    result = reconciler("apply", desired, "--yes", timeout=300)
    took = time.monotonic() - started
    assert result.returncode == 0, result.stdout + result.stderr
    assert "link/worker" in result.stdout and "Converged" in result.stdout, result.stdout
    logins = sshd_log.read_bytes()[seen:].decode(errors="replace")
    assert "Accepted publickey for spark from 10.232.0.10 " in logins, "the worker's session: over its first port"
    assert "Accepted publickey for spark from 10.232.1.10 " in logins, "the MTU change's: over the twin"

    for dev, address in (("enp1s0f1np1", "10.232.0.11"), ("enP2p1s0f1np1", "10.232.1.11")):
        repaired = port(tb, "worker", dev)
        assert repaired["mtu"] == 9000 and "UP" in repaired["flags"] and "LOWER_UP" in repaired["flags"], dev
        full = tb.exec("head", f"ping -c 1 -W 2 -M do -s 8972 -I {dev} {address}")
        assert full.returncode == 0, full.stdout + full.stderr
    now = {n: containers(tb, n)["vllm_serving"] for n in ("head", "worker")}
    assert {n: c["Id"] for n, c in now.items()} == serving and all(c["State"]["Running"] for c in now.values()), \
        "serving was not restarted for the repair"
    body = json.dumps({"model": "tiny-moe", "prompt": "ping", "max_tokens": 2})
    answer = tb.exec("head", f"curl -s -m 30 -H 'Content-Type: application/json' -d '{body}' "
                             "http://127.0.0.1:8000/v1/completions", check=True).stdout
    assert json.loads(answer)["choices"]
    again = reconciler("apply", desired, "--yes", timeout=120)
    assert again.returncode == 0 and "No changes" in again.stdout, again.stdout + again.stderr
    print(f"FIGURE mtu-over-the-twin: the repairing apply took {took:.1f}s")
