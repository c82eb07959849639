"""What a deployment's nodes hold once it serves (issue 52, item 4): await-health reads each rank's node (MemTotal,
MemAvailable, the rank container's cgroup memory.current, the running containers) and reports it; the status
publisher judges it against the budget into /status (`memory`) and `reconciler_memory_overshoot_bytes`, so an owner
tunes policy.memory_overhead_per_instance and policy.memory_margin from the node's own numbers; `doctor` warns
when a serving node boots into the desktop (DGX OS runs Xorg and gnome-shell on the GB10 by default).

The overshoot's oracle is written out here by hand from the recording's numbers (an 8 GiB node, gmu 0.05), never
`core.budget` asked twice. Node output is the recording's (tests/unit/fixtures/probe-4-nodes.json) or the
documented shape of the Docker Engine API's stats (tests/unit/step_cases/serving.py `STATS_V1`, docs.docker.com
"Get container stats based on resource usage"); no docker engine ran where this was written (a cgroup v1 sandbox
without /var/run/docker.sock, and the testbed's engines are not to be touched).
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from typing import Any

import pytest

from reconciler.core.spec import Desired
from reconciler.core.vllm import launch_specs
from reconciler.edge.facts.base import Fact, Section, sealed
from reconciler.edge.facts.memory import RankSeen, parse_rank, parse_stats_usage, rank_fact
from reconciler.edge.ssh import Cancelled, CommandTimeout
from reconciler.edge.steps.actions import Action, Given, Read, Report, advance
from reconciler.edge.steps.serving import rank_readings
from reconciler.loop import metrics
from reconciler.loop.status import StatusPublisher
from tests.unit.recorded import RAW, load, observe, sections_of
from tests.unit.step_cases.serving import STATS_V1, rank_memory

GIB, MIB = 2**30, 2**20
NODE_TOTAL = 8388608 * 1024  # the recording's /proc/meminfo on every node (lxcfs: the node's 8 GiB budget)
OVERHEAD = 256 * MIB


def _overhead(d: Desired, size: int = OVERHEAD) -> Desired:
    return d.model_copy(update={"policy": d.policy.model_copy(update={"memory_overhead_per_instance": size})})


# -- the reading -----------------------------------------------------------------------------------------------

# cgroup v2's shape (DGX OS): the same `usage` (memory.current), `inactive_file` among the stats, no max_usage
STATS_V2 = ('{"read":"2026-12-06T10:02:11Z","memory_stats":{"usage":12884901888,"stats":{"anon":11811160064,'
            '"file":1073741824,"inactive_file":805306368,"active_file":268435456},"limit":130596065280}}')


@pytest.mark.parametrize(("body", "rc", "usage"), [
    (STATS_V1, 0, 592801792), (STATS_V2, 0, 12884901888),
    ('{"read":"0001-01-01T00:00:00Z","memory_stats":{}}', 0, None),  # a container that is not running
    ('{"memory_stats":{"usage":true}}', 0, None), ('{"memory_stats":{"usage":-1}}', 0, None),
    ('{"memory_stats":[]}', 0, None), ("[]", 0, None), ("curl: (7) Couldn't connect to server", 7, None),
    ('{"message":"No such container: vllm_serving"}', 22, None), ("\x1b[31m\xff", 0, None)])
def test_the_containers_memory_is_docker_s_usage_or_unread(body, rc, usage):
    assert parse_stats_usage(Section(body, rc)) == usage
    assert parse_stats_usage(None) is None


def test_a_recorded_node_reads_into_its_memory_its_running_containers_and_the_rank_s_usage():
    got = parse_rank("vllm_serving", rank_memory("worker1"))
    assert got.memory is not None and got.memory.total_bytes == NODE_TOTAL
    assert got.memory.available_bytes == 7910612 * 1024 and got.current == 592801792
    assert "vllm_serving" in got.running and "vllm_embeddings" in got.running


def test_no_part_of_the_reading_fails_it():
    """The rank serves: what does not parse is unread, never a ProbeError (a failed step)."""
    assert parse_rank("vllm_serving", {}) == RankSeen(None, None, ())
    assert parse_rank("vllm_serving", {"meminfo": Section("MemTotal: many", 0), "containers": Section("API [{", 0),
                              "stats": Section("{", 0)}) == RankSeen(None, None, ())


def test_the_fact_asks_the_engine_for_one_sample_of_the_rank_beside_meminfo_and_the_containers():
    fact = rank_fact("vllm_embed")
    script = "\n".join(fact.lines)
    assert fact.key == "rank vllm_embed"
    assert [line.split(" ", 1)[1] for line in fact.lines if line.startswith("sec ")] == [
        "meminfo", "containers", "stats", "nccl"]
    assert ("curl -sf --max-time 10 --unix-socket \"$sock\" "
            "'http://docker/containers/vllm_embed/stats?stream=false&one-shot=true'") in script
    checked = subprocess.run(["sh", "-n"], input=sealed(list(fact.lines)).script, text=True, capture_output=True,
                             check=False)
    assert checked.returncode == 0, checked.stderr


# -- await-health's readings -------------------------------------------------------------------------------------

Said = list[tuple[str, Any]]


def _drive(given: Given, fail: dict[str, Exception] | None = None) -> tuple[Said, BaseException | None]:
    """`rank_readings` over the recording's nodes; `fail`: the error a node's read raises into the step."""
    said: Said = []

    def do(action: Action) -> object:
        if isinstance(action, Report):
            said.append((action.event, action.fields))
            return None
        assert isinstance(action, Read) and isinstance(action.fact, Fact)
        said.append(("read", action.node))
        if fail and action.node in fail:
            raise fail[action.node]
        return action.fact.parse(rank_memory(action.node))

    try:
        advance(rank_readings(given, launch_specs(given.desired)), do)
    except Exception as exc:  # noqa: BLE001 - the step's end is the result
        return said, exc
    return said, None


def test_each_rank_s_node_is_read_and_reported_with_what_the_publisher_needs():
    d = load()
    said, error = _drive(Given(d, observe(d)))
    assert error is None
    assert [e for e, _ in said] == ["read", "serving.memory", "serving.transport"] * 4
    fields = dict(said[1][1])
    running = fields.pop("running")
    assert fields == {"node": "head", "deployment": "default", "container": "vllm_serving", "total": NODE_TOTAL,
                      "available": 7883264 * 1024, "current": 592801792, "weights": 67112903}
    assert "vllm_serving" in running and "reranker" in running


def test_a_node_that_does_not_answer_is_said_and_the_others_are_read():
    d = load()
    said, error = _drive(Given(d, observe(d)), {"worker2": CommandTimeout("worker2", "no answer within 10s")})
    assert error is None
    assert [(e, f["node"] if isinstance(f, dict) else f) for e, f in said] == [
        ("read", "head"), ("serving.memory", "head"), ("serving.transport", "head"), ("read", "worker1"),
        ("serving.memory", "worker1"), ("serving.transport", "worker1"), ("read", "worker2"),
        ("serving.memory-unread", "worker2"), ("read", "worker3"), ("serving.memory", "worker3"),
        ("serving.transport", "worker3")]
    assert said[7][1]["error"] == "worker2: no answer within 10s"


def test_a_cancel_ends_the_step():
    d = load()
    _, error = _drive(Given(d, observe(d)), {"worker1": Cancelled("worker1", "shutdown")})
    assert isinstance(error, Cancelled)


# -- the publisher: /status and the gauges -------------------------------------------------------------------------

def _value(name: str, node: str, deployment: str = "default") -> float | None:
    return metrics.REGISTRY.get_sample_value(name, {"node": node, "deployment": deployment})


@pytest.fixture
def publisher(tmp_path) -> Iterator[StatusPublisher]:
    p = StatusPublisher(tmp_path / "cluster.yaml")
    yield p
    p._readings.clear()
    p._judge_memory()


def _reading(node: str, available: int, current: int | None = 592801792, **more: object) -> dict[str, object]:
    return {"node": node, "deployment": "default", "container": "vllm_serving", "total": NODE_TOTAL,
            "available": available, "current": current, "running": ["vllm_serving", "vllm_embeddings"],
            "weights": 67112903, **more}


def test_a_reading_is_judged_by_hand_into_status_and_the_gauges(publisher):
    """worker1 once the stand-in served: 8 GiB, 1.5 GiB available. Reserved: the pool (0.05 x 8 GiB) and the
    overhead (256 MiB); the node held 6.5 GiB, so 6.5 GiB - 0.4 GiB - 0.25 GiB beyond them, the margin (1 GiB) long
    gone."""
    d = _overhead(load())
    publisher.roles(d)
    publisher.memory(_reading("worker1", 3 * GIB // 2), now=1765000000.0)
    reserved = int(0.05 * NODE_TOTAL) + OVERHEAD
    beyond = NODE_TOTAL - 3 * GIB // 2 - reserved
    [seen] = publisher.status["memory"]
    assert seen["overshoot"] == beyond and seen["marginLeft"] == GIB - beyond and seen["margin"] == GIB
    assert seen["reserved"] == {"default (gpu_memory_utilization 0.05 x 8.0 GiB, policy.memory_overhead_per_instance)":
                                reserved}
    assert seen["memoryCurrent"] == 592801792 and seen["time"] == 1765000000.0 and seen["node"] == "worker1"
    assert _value("reconciler_memory_overshoot_bytes", "worker1") == beyond
    assert _value("reconciler_serving_memory_current_bytes", "worker1") == 592801792
    assert metrics.REGISTRY.get_sample_value("reconciler_memory_margin_bytes") == GIB


def test_a_reading_made_before_the_file_is_known_is_judged_once_it_is(publisher):
    publisher.memory(_reading("head", 15 * GIB // 2), now=1.0)
    assert publisher.status["memory"] == []
    publisher.roles(_overhead(load()))
    [seen] = publisher.status["memory"]
    assert seen["overshoot"] == NODE_TOTAL - 15 * GIB // 2 - int(0.05 * NODE_TOTAL) - OVERHEAD < 0, \
        "0.5 GiB held, 0.65 GiB reserved: less than the reservations"


def test_the_reading_is_in_the_published_status_and_leaves_with_its_deployment(publisher):
    """A published status carries the readings; a file in which the deployment no longer spans the node drops the
    reading and its series (an unread /proc/meminfo has no overshoot, and no series)."""
    from reconciler.loop.conditions import Snapshot

    d = _overhead(load())
    publisher.roles(d)
    publisher.memory(_reading("worker3", 2 * GIB), now=2.0)
    publisher.memory(_reading("worker2", None, current=None), now=3.0)
    publisher.publish(Snapshot(generation=1, observed_generation=1), [n.name for n in d.nodes], None, 4.0)
    assert [(m["node"], m["overshoot"] is None) for m in publisher.status["memory"]] == [("worker2", True),
                                                                                        ("worker3", False)]
    assert _value("reconciler_memory_overshoot_bytes", "worker2") is None
    assert _value("reconciler_serving_memory_current_bytes", "worker2") is None
    fewer = d.model_copy(update={"nodes": d.nodes[:3]})  # worker3 leaves the file: the deployment spans three
    publisher.roles(fewer)
    assert [m["node"] for m in publisher.status["memory"]] == ["worker2"]
    assert _value("reconciler_memory_overshoot_bytes", "worker3") is None


def test_the_recording_is_what_the_step_cases_read():
    """The step cases' node output is the recording's own (the same meminfo and containers sections)."""
    seen = sections_of(RAW["outputs"]["worker3"])
    assert rank_memory("worker3")["meminfo"] == seen["meminfo"]


def test_the_dashboard_plots_the_overshoot_of_the_chosen_nodes_and_deployments_against_the_margin():
    import json
    from pathlib import Path

    board = json.loads((Path(__file__).resolve().parents[3] / "monitoring" / "grafana" / "dashboard.json").read_text())
    [panel] = [p for p in board["panels"] if p.get("title") == "Memory beyond the budget"]
    assert [t["expr"] for t in panel["targets"]] == [
        'reconciler_memory_overshoot_bytes{node=~"$node", deployment=~"$deployment"}', "reconciler_memory_margin_bytes"]
    assert panel["fieldConfig"]["defaults"]["unit"] == "bytes" and panel["fieldConfig"]["defaults"]["noValue"]
