"""The seed story on the seed's own topology (issue 30, finding 7): the worker has no management port of its own
and is reached through the head over the fabric only, its first port down and its twin up (scenario
`seed-fabric`, testbed/scenarios.py). With `ssh.fallback_hosts` naming the twin's address, one `apply` reaches the
worker over the twin, repairs the first port from there and converges. Every check reads the nodes directly."""

from __future__ import annotations

import json

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
