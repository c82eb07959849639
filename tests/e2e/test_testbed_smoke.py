"""Smoke tests of the testbed itself: what the reconciler's e2e tests rely on really holds.

Traffic goes only to the testbed's own namespaces: routing to outside addresses is checked in the routing
table (``ip route get``), never by sending a packet.
"""
from __future__ import annotations

import errno
import json
import socket
from pathlib import Path

import paramiko
import pytest
import yaml

from testbed import api
from testbed.proc import wait_for

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]


def run(conn, cmd: str, warn: bool = False):
    return conn.run(cmd, hide=True, warn=warn, in_stream=False)


def fabric_link(conn) -> dict:
    return json.loads(run(conn, "ip -j addr show dev enp1s0f1np1").stdout)[0]


def test_ssh_to_each_node_with_strict_host_keys(testbed, ssh):
    for n in testbed.nodes:
        c = ssh(n.name)
        out = run(c, 'hostname; id -un; echo "$DOCKER_HOST"; ip -br addr show dev enP7s7').stdout.split("\n")
        assert out[0] == f"spark-{n.name}"
        assert out[1] == "spark"
        assert out[2] == f"unix:///run/spark-testbed/{n.name}/docker.sock"
        assert n.mgmt_addrs[-1] in out[3] or n.mgmt_addrs[0] in out[3]


def test_wrong_host_key_is_rejected(testbed, ssh, tmp_path):
    # known_hosts that pins the head's address to the worker's host key: a strict client must refuse
    lines = testbed.known_hosts.read_text().splitlines()
    worker_key = lines[1].split(None, 1)[1]
    bad = tmp_path / "known_hosts"
    bad.write_text(f"{testbed.head.ssh_host} {worker_key}\n")
    with pytest.raises(paramiko.BadHostKeyException):
        ssh("head", known_hosts=bad)
    unknown = tmp_path / "empty"
    unknown.write_text("")
    with pytest.raises(paramiko.SSHException):
        ssh("head", known_hosts=unknown)


def test_each_node_has_its_own_docker_engine(seed_testbed, ssh):
    ids = {}
    names = {}
    images = {}
    for n in seed_testbed.nodes:
        c = ssh(n.name)
        ids[n.name] = run(c, "docker info --format '{{.ID}}'").stdout.strip()
        names[n.name] = set(run(c, "docker ps --format '{{.Names}}'").stdout.split())
        images[n.name] = set(run(c, "docker images --format '{{.Repository}}:{{.Tag}}'").stdout.split())
    assert len(set(ids.values())) == len(ids), ids
    assert names["head"] == {"vllm_node", "vllm_embeddings", "reranker"}
    assert names["worker"] == {"vllm_embeddings"}
    assert "vllm-standin:latest" in images["head"]
    assert "vllm-standin:latest" not in images["worker"]


def test_seed_weights_on_head_only(seed_testbed, ssh):
    head, worker = ssh("head"), ssh("worker")
    snap = "/srv/spark-testbed/head/models/hub/models--testorg--tiny-moe/snapshots/" + "1" * 40
    assert "model.safetensors.index.json" in run(head, f"ls {snap}").stdout
    assert run(head, "ls /srv/spark-testbed/head/models/plain").stdout.split() == [
        "testorg--tiny-dense", "testorg--tiny-moe"]
    assert run(worker, "ls -A /srv/spark-testbed/worker/models").stdout.strip() == ""
    # the worker's model root is its own filesystem, writable by spark
    assert run(worker, "stat -f -c %T /srv/spark-testbed/worker/models").stdout.strip() == "ext2/ext3"
    run(worker, "touch /srv/spark-testbed/worker/models/x && rm /srv/spark-testbed/worker/models/x")


def test_seed_fabric_link(seed_testbed, ssh):
    w = fabric_link(ssh("worker"))
    assert "UP" not in w["flags"] and w["mtu"] == 1500
    assert not [a for a in w.get("addr_info", []) if a["family"] == "inet"]
    h = fabric_link(ssh("head"))
    assert "UP" in h["flags"] and h["mtu"] == 9000
    assert [(a["local"], a["prefixlen"]) for a in h["addr_info"] if a["family"] == "inet"] == [("10.232.0.10", 24)]


def test_worker_reachable_only_through_head(testbed, ssh):
    # from the root namespace: no path to the worker (an 'unreachable' route, so it fails at once, not by timeout)
    with pytest.raises(OSError) as info:
        socket.create_connection((testbed.workers[0].ssh_host, 22), timeout=3)
    assert info.value.errno in (errno.ENETUNREACH, errno.EHOSTUNREACH), info.value
    # from the head: the worker's sshd answers (that is what the jump host uses)
    assert _banner_via_head(ssh)


def _banner_via_head(ssh) -> bool:
    ch = ssh("head").client.get_transport().open_channel("direct-tcpip", ("10.231.1.11", 22), ("127.0.0.1", 0))
    try:
        return ch.recv(64).startswith(b"SSH-2.0")
    finally:
        ch.close()


def test_worker_has_no_route_outside_the_testbed(testbed, ssh):
    w = ssh("worker")
    assert run(w, "ip route get 1.1.1.1", warn=True).exited != 0
    assert run(w, "ip route get 10.231.0.1", warn=True).exited != 0   # not even the reconciler's side
    routes = json.loads(run(w, "ip -j route show table all").stdout)
    assert not [r for r in routes if r.get("dst") == "default"], routes


def test_sudo_allows_exactly_the_listed_commands(testbed, ssh):
    w = ssh("worker")
    assert run(w, "sudo -n /usr/sbin/ip link set dev enp1s0f1np1 mtu 1500", warn=True).exited == 0
    assert run(w, "sudo -n /usr/sbin/sysctl -w vm.drop_caches=3", warn=True).exited == 0
    assert run(w, "sudo -n /usr/sbin/ip link show", warn=True).exited != 0
    assert run(w, "sudo -n true", warn=True).exited != 0
    assert run(w, "sudo -n /usr/sbin/sysctl -w vm.swappiness=1", warn=True).exited != 0


def test_link_faults_show_on_the_nodes(seed_testbed, ssh):
    tb = seed_testbed
    w, h = ssh("worker"), ssh("head")
    tb.fault("link-up", "worker")
    wait_for(lambda: fabric_link(h)["operstate"] == "UP", timeout=10, what="head carrier up")
    assert "UP" in fabric_link(w)["flags"]
    tb.fault("link-down", "worker")
    wait_for(lambda: "LOWER_UP" not in fabric_link(h)["flags"], timeout=10, what="head carrier lost")
    assert "UP" not in fabric_link(w)["flags"]
    tb.fault("mtu", "head", value=1500)
    assert fabric_link(h)["mtu"] == 1500
    tb.fault("link-flap", "head", count=2, interval=0.05)
    assert "UP" in fabric_link(h)["flags"]


def test_container_disk_and_weight_faults(seed_testbed, ssh):
    tb = seed_testbed
    w, h = ssh("worker"), ssh("head")
    pid_before = run(w, "docker inspect -f '{{.State.Pid}}' vllm_embeddings").stdout.strip()
    tb.fault("kill-container", "worker", name="vllm_embeddings")   # a crash: the restart policy brings it back
    wait_for(lambda: run(w, "docker inspect -f '{{.RestartCount}}' vllm_embeddings").stdout.strip() != "0",
             timeout=20, what="vllm_embeddings restarted")
    assert run(w, "docker inspect -f '{{.State.Pid}}' vllm_embeddings").stdout.strip() != pid_before
    tb.fault("stop-container", "head", name="reranker")
    assert run(h, "docker inspect -f '{{.State.Status}}' reranker").stdout.strip() == "exited"
    tb.fault("rogue-container", "worker", name="rogue")
    assert "rogue" in run(w, "docker ps --format '{{.Names}}'").stdout.split()

    tb.fault("fill-disk", "worker")
    avail = int(run(w, "df --output=avail -B1 /srv/spark-testbed/worker/models | tail -1").stdout)
    assert avail < 1 << 20
    assert run(w, "head -c 2000000 /dev/zero > /srv/spark-testbed/worker/models/f", warn=True).exited != 0
    run(w, "rm -f /srv/spark-testbed/worker/models/f")
    tb.fault("free-disk", "worker")
    assert int(run(w, "df --output=avail -B1 /srv/spark-testbed/worker/models | tail -1").stdout) > 1 << 30

    snap = "/srv/spark-testbed/head/models/hub/models--testorg--tiny-moe/snapshots/" + "1" * 40
    size = lambda: int(run(h, f"stat -L -c %s {snap}/model-00001-of-00004.safetensors").stdout)  # noqa: E731
    before = size()
    tb.fault("corrupt-shard", "head", mode="truncate")
    assert size() == before // 2
    tb.fault("delete-shard", "head", index=1)
    assert run(h, f"test -e {snap}/model-00002-of-00004.safetensors", warn=True).exited != 0
    tb.fault("crash-serving", "worker")
    assert run(w, "ls -A /srv/spark-testbed/worker/models").stdout.split() == [".standin-crash"]

    tb.reset("seed")    # reset repairs all of it
    assert size() == before
    assert run(h, f"test -e {snap}/model-00002-of-00004.safetensors", warn=True).exited == 0
    assert set(run(h, "docker ps --format '{{.Names}}'").stdout.split()) == {
        "vllm_node", "vllm_embeddings", "reranker"}
    assert run(w, "ls -A /srv/spark-testbed/worker/models").stdout.strip() == ""


def test_daemon_and_mgmt_faults(seed_testbed, ssh):
    tb = seed_testbed
    tb.fault("sshd-stop", "worker")
    with pytest.raises((OSError, paramiko.SSHException)):
        ssh("worker", timeout=3)
    tb.fault("sshd-start", "worker")
    assert run(ssh("worker"), "hostname").stdout.strip() == "spark-worker"

    h = ssh("head")
    tb.fault("dockerd-stop", "head")
    assert run(h, "docker info", warn=True).exited != 0
    tb.fault("dockerd-start", "head")
    assert run(h, "docker info --format '{{.ID}}'").stdout.strip()

    tb.fault("mgmt-cut", "worker")
    assert run(h, "ping -c1 -W1 10.231.1.11", warn=True).exited != 0
    tb.fault("mgmt-restore", "worker")
    wait_for(lambda: run(h, "ping -c1 -W1 10.231.1.11", warn=True).exited == 0, timeout=10,
             what="worker reachable again")
    tb.fault("mgmt-cut", "head")
    with pytest.raises(OSError):
        socket.create_connection((tb.head.ssh_host, 22), timeout=2)
    tb.fault("mgmt-restore", "head")
    socket.create_connection((tb.head.ssh_host, 22), timeout=5).close()


def test_exec_runs_as_the_ssh_user_would(testbed):
    r = testbed.exec("worker", "id -un; hostname; echo $DOCKER_HOST; docker ps --format '{{.Names}}'",
                     check=True)
    assert r.stdout.split() == ["spark", "spark-worker", "unix:///run/spark-testbed/worker/docker.sock",
                                "vllm_embeddings"]


def test_desired_state_matches_the_repo_file(testbed):
    written = yaml.safe_load(testbed.desired_state.read_text())
    assert written == yaml.safe_load((REPO / "desired-state" / "testbed.yaml").read_text())
    assert [n["ssh"]["host"] for n in written["nodes"]] == ["10.231.0.2", "10.231.1.11"]
    for n in written["nodes"]:
        assert Path(n["ssh"]["known_hosts"]).is_file() and Path(n["ssh"]["identity_file"]).is_file()


def test_up_twice_is_harmless(testbed):
    before = {n.name: api.dockerd.engine_id(n) for n in testbed.nodes}
    sshd_pids = {k: v["pid"] for k, v in api.load_pids().items()}
    api.up(nodes=2, scenario="seed")
    assert {n.name: api.dockerd.engine_id(n) for n in testbed.nodes} == before
    assert {k: v["pid"] for k, v in api.load_pids().items()} == sshd_pids


def test_down_leaves_nothing_behind(testbed):
    """Last in this file: down, check, then up again for whatever tests run after. lxcfs is killed first: a
    dead view's mount answers every stat with ENOTCONN, and `down` used to stop there (CI, stop 22)."""
    import os
    import signal
    import subprocess

    pids = api.load_pids()
    assert pids
    os.kill(pids["lxcfs"]["pid"], signal.SIGKILL)  # as when a run is killed: its mount stays, dead (ENOTCONN)
    assert api.down() == []
    assert not [ns for ns in api.net.list_netns() if ns.startswith("sb-")]
    assert not [p for p in pids.values() if api.alive(p["pid"], p.get("starttime"))]
    mounts = Path("/proc/self/mountinfo").read_text()
    assert "/srv/spark-testbed" not in mounts and "/run/spark-testbed" not in mounts
    assert not Path("/run/spark-testbed").exists() and not Path("/srv/spark-testbed").exists()
    assert subprocess.run(["ip", "link", "show", "sb-mgmt0"], capture_output=True, check=False).returncode != 0
    api.up(nodes=2, scenario="seed")
