"""Which network NCCL chose on each rank (issue 52, item 7): read from the rank's own log after it served, judged
against the fabric the file declares, told as the condition NcclTransport, reconciler_nccl_socket_fallback and the
alert ReconcilerNcclOnSockets.

NCCL cannot run here (no GPU, no RDMA device): the logs are NCCL's own lines as people posted them from real runs
(fixtures/nccl/README.md names each source), fed through the probe's real fragment (`sh`, `sed`, `sort`, `uniq`
of this machine; `docker logs` answered by test_probe_survivors' stand-in with the recorded log) and its parser.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from reconciler.core.nccl import judge
from reconciler.core.observed import Container, NodeObservation, Observed
from reconciler.core.planning import Plan
from reconciler.core.spec import Desired, loads
from reconciler.edge.facts.base import Section, read_sections
from reconciler.edge.facts.memory import MAX_NETWORKS, parse_networks, rank_fact
from reconciler.loop import conditions, metrics
from reconciler.loop.conditions import RankTransport, Snapshot, transport_results
from reconciler.loop.metrics import REGISTRY
from tests.unit.conftest import REPO
from tests.unit.edge.test_probe_fragments import LocalNode

LOGS = Path(__file__).parents[1] / "fixtures" / "nccl"
SAMPLE = (REPO / "desired-state" / "cluster.yaml").read_text()
HEAD, WORKER = "spark-1a32", "spark-5be3"
NAME = "vllm_serving"


def _networks_on_a_node(tmp_path: Path, log: str) -> tuple[str, ...] | None:
    """The rank fact's real fragment run by this machine's `sh`, `docker logs vllm_serving` printing `log`."""
    root = tmp_path / f"node{len(list(tmp_path.iterdir()))}"
    root.mkdir()
    node = LocalNode(root).answer({"tool": "docker", "argv": ["logs", NAME], "stdout": log})
    fact = rank_fact(NAME)
    return fact.parse(read_sections(node, list(fact.lines), timeout=60)).networks


# What each posted log says, read by eye from the log itself (fixtures/nccl/README.md): the oracle.
@pytest.mark.parametrize(("log", "networks"), [
    ("ib-roce-dgx-h100.log", ("IB",)),
    ("ibext-plugin.log", ("IBext_v8",)),
    ("socket-dgx-a100.log", ("Socket",)),
    ("spark-ray-worker.log", ("IBext_v10",)),
])
def test_a_real_rank_log_yields_the_network_nccl_named(tmp_path, log, networks):
    assert _networks_on_a_node(tmp_path, (LOGS / log).read_text()) == networks


def test_a_log_without_nccl_lines_names_no_network_and_the_most_named_comes_first(tmp_path):
    assert _networks_on_a_node(tmp_path, "INFO 12-07 vLLM API server version 0.20.1\n") == ()
    mixed = ((LOGS / "socket-dgx-a100.log").read_text() + (LOGS / "ibext-plugin.log").read_text())
    assert _networks_on_a_node(tmp_path, mixed) == ("IBext_v8", "Socket")


def test_only_the_captured_name_leaves_the_node(tmp_path):
    """A log line is what vLLM's processes wrote: nothing of it but NCCL's network name crosses (no API key a
    request logged, no terminal escape)."""
    log = ("NCCL INFO Using network IB sk-secret-0123456789\n\x1b[31mNCCL INFO Using network Socket;rm -rf /\n"
           "Authorization: Bearer sk-secret-0123456789\n")
    node = LocalNode(tmp_path).answer({"tool": "docker", "argv": ["logs", NAME], "stdout": log})
    fact = rank_fact(NAME)
    section = read_sections(node, list(fact.lines), timeout=60)["nccl"]
    assert "sk-secret" not in section.body and "\x1b" not in section.body and "rm" not in section.body
    assert fact.parse({"nccl": section}).networks == ("IB", "Socket")


@pytest.mark.parametrize(("body", "rc", "networks"), [
    ("      3 IBext_v8\n      1 Socket\n", 0, ("IBext_v8", "Socket")),
    ("      1 Socket\n     40 IB\n", 0, ("IB", "Socket")),
    ("", 0, ()),
    ("  2 IB;rm\n  x Socket\nIB\n  1 \n", 0, ()),
    ("      1 IB\n", 1, None),
])
def test_rows_that_are_not_counted_names_are_skipped(body, rc, networks):
    assert parse_networks(Section(body, rc)) == networks
    assert parse_networks(None) is None


def test_a_node_that_sends_more_rows_than_names_exist_is_cut_at_the_bound():
    rows = "".join(f"{100 - i} Net{i}\n" for i in range(MAX_NETWORKS * 4))
    assert parse_networks(Section(rows, 0)) == tuple(f"Net{i}" for i in range(MAX_NETWORKS))


# -- the judgement ------------------------------------------------------------------------------------------------

RDMA = ["rocep1s0f1", "roceP2p1s0f1"]


@pytest.mark.parametrize(("networks", "devices", "ok", "reason"), [
    (("IB",), RDMA, True, "Rdma"),
    (("IBext_v10",), RDMA, True, "Rdma"),
    (("Socket",), RDMA, False, "SocketFallback"),
    (("IB", "Socket"), RDMA, False, "SocketFallback"),
    (("AWS Libfabric",), RDMA, True, "OtherNetwork"),
    ((), RDMA, None, "NotLogged"),
    (None, RDMA, None, "NotRead"),
])
def test_sockets_on_a_fabric_that_declares_rdma_are_a_fallback(networks, devices, ok, reason):
    found = judge(networks, devices)
    assert (found.ok, found.reason) == (ok, reason)
    assert found.socket_fallback is (ok is False)


def test_a_fallback_names_what_nccl_chose_and_the_declared_devices():
    message = judge(("Socket",), RDMA).message
    assert "NCCL chose Socket" in message and "rocep1s0f1, roceP2p1s0f1" in message and "quarter" in message


# -- status: what counts for what runs now -------------------------------------------------------------------------

def _desired(rdma: bool = True) -> Desired:
    text = SAMPLE if rdma else "\n".join(line for line in SAMPLE.splitlines() if "rdma_device:" not in line)
    return loads(text, "c.yaml")


def _observed(ids: dict[str, str | None]) -> Observed:
    return Observed(nodes={node: NodeObservation(
        name=node, reachable=True, docker_reachable=True,
        containers=[Container(name=NAME, id=cid, image="img", state="running")] if cid else [])
        for node, cid in ids.items()})


def _report(node: str, networks: list[str] | None, container: str = "c1") -> dict[str, object]:
    return {"node": node, "deployment": "default", "container": container, "networks": networks}


def test_a_reading_counts_for_the_rank_container_it_read_only():
    d = _desired()
    reports = {(HEAD, "default"): _report(HEAD, ["IB"]), (WORKER, "default"): _report(WORKER, ["Socket"])}
    found = transport_results(d, _observed({HEAD: "c1", WORKER: "c1"}), reports)
    assert [(r.node, r.transport.reason) for r in found] == [(HEAD, "Rdma"), (WORKER, "SocketFallback")]
    restarted = transport_results(d, _observed({HEAD: "c1", WORKER: "c2"}), reports)
    assert [r.node for r in restarted] == [HEAD], "a new container on the worker is not the one read"
    stopped = transport_results(d, _observed({HEAD: "c1", WORKER: None}), reports)
    assert [r.node for r in stopped] == [HEAD]
    unseen = transport_results(d, _observed({HEAD: "c1"}), reports)
    assert [r.node for r in unseen] == [HEAD, WORKER], "a node this observation did not read keeps its reading"
    assert transport_results(d, None, {}) == []


def test_a_deployment_on_one_node_has_no_network_to_judge():
    one = loads(SAMPLE.replace("tensor_parallel_size: 2", "tensor_parallel_size: 1"), "c.yaml")
    assert len(one.serving_nodes) == 1
    assert transport_results(one, None, {(HEAD, "default"): _report(HEAD, ["Socket"])}) == []


def test_without_rdma_declared_sockets_are_what_the_file_asks_for_so_nothing_is_judged():
    reports = {(WORKER, "default"): _report(WORKER, ["Socket"])}
    assert transport_results(_desired(rdma=False), None, reports) == []
    assert [r.transport.reason for r in transport_results(_desired(), None, reports)] == ["SocketFallback"]


def _conditions(ranks: list[RankTransport]) -> list[conditions.Condition]:
    snap = Snapshot(generation=2, observed_generation=2, plan=Plan([], [], []), transports=ranks)
    return conditions.conditions(snap, [HEAD, WORKER], [], 0.0)


def _of(conds: list[conditions.Condition], node: str) -> conditions.Condition | None:
    return next((c for c in conds if c["node"] == node and c["type"] == "NcclTransport"), None)


def test_the_condition_is_false_on_the_node_that_fell_back_and_nowhere_else():
    conds = _conditions([RankTransport("default", HEAD, judge(("IB",), RDMA)),
                         RankTransport("default", WORKER, judge(("Socket",), RDMA))])
    head, worker = _of(conds, HEAD), _of(conds, WORKER)
    assert head is not None and (head["status"], head["reason"]) == ("True", "Rdma")
    assert worker is not None and (worker["status"], worker["reason"]) == ("False", "SocketFallback")
    assert "NCCL chose Socket" in worker["message"]
    assert _of(_conditions([]), HEAD) is None, "no reading: no condition to tell"


def test_the_worst_rank_on_a_node_gives_its_reason():
    conds = _conditions([RankTransport("a", HEAD, judge(("IB",), RDMA)), RankTransport("b", HEAD, judge((), RDMA)),
                         RankTransport("c", HEAD, judge(("Socket",), RDMA))])
    found = _of(conds, HEAD)
    assert found is not None and found["reason"] == "SocketFallback"
    unknown = _of(_conditions([RankTransport("a", HEAD, judge(("IB",), RDMA)),
                               RankTransport("b", HEAD, judge((), RDMA))]), HEAD)
    assert unknown is not None and (unknown["status"], unknown["reason"]) == ("Unknown", "NotLogged")


def _gauge() -> dict[tuple[str, str], float]:
    return {(s.labels["node"], s.labels["deployment"]): s.value for family in REGISTRY.collect()
            if family.name == "reconciler_nccl_socket_fallback" for s in family.samples}


def test_the_gauge_has_a_series_only_for_a_known_network_and_drops_one_no_longer_judged():
    metrics.set_socket_fallback({(HEAD, "default"): False, (WORKER, "default"): True})
    assert _gauge() == {(HEAD, "default"): 0.0, (WORKER, "default"): 1.0}
    metrics.set_socket_fallback({(HEAD, "default"): False})
    assert _gauge() == {(HEAD, "default"): 0.0}
    metrics.set_socket_fallback({})
    assert _gauge() == {}


def test_the_publisher_tells_a_step_s_report_as_condition_and_gauge_until_the_container_changes(tmp_path):
    """The path a reading takes in the daemon: await-health's `serving.transport` (a step's thread) into the
    publisher, judged at each publish against what runs then."""
    from reconciler.loop.status import StatusPublisher

    d = _desired()
    publisher = StatusPublisher(tmp_path / "desired.yaml")
    publisher.roles(d)
    publisher.transport(_report(WORKER, ["Socket"]))
    publisher.transport(_report(HEAD, ["IB"]))

    def publish(ids: dict[str, str | None]) -> dict[str, conditions.Condition]:
        snap = Snapshot(generation=1, observed_generation=1, plan=Plan([], [], []), observed=_observed(ids))
        publisher.publish(snap, [HEAD, WORKER], None, 0.0)
        return {c["node"]: c for c in publisher.status["conditions"] if c["type"] == "NcclTransport"}

    found = publish({HEAD: "c1", WORKER: "c1"})
    assert (found[WORKER]["status"], found[HEAD]["status"]) == ("False", "True")
    assert _gauge() == {(HEAD, "default"): 0.0, (WORKER, "default"): 1.0}
    found = publish({HEAD: "c1", WORKER: "c2"})
    assert WORKER not in found and _gauge() == {(HEAD, "default"): 0.0}, "a new start on the worker: not read yet"
