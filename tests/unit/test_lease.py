"""One actor per cluster (issue 16, finding 6): the real lease script, run by the real `sh` with flock and date,
in a HOME of its own, standing in for the head. Only the SSH hop is left out (tests/e2e/test_daemon.py has
`apply` refused by a running daemon over the testbed's SSH)."""

from __future__ import annotations

import subprocess

import pytest
from hypothesis import given
from hypothesis import strategies as st

from reconciler.edge import lease
from reconciler.edge.lease import Holder, Lease, LeaseHeld, held
from reconciler.edge.ssh import Result
from testbed.proc import wait_for


class LocalHead:
    """`run_script` as the SSH session does it (`sh -s`, script on stdin), on this machine, with its own HOME."""

    def __init__(self, home):
        self.home = home

    def __getitem__(self, node):
        return self

    def run_script(self, script, timeout, cancel=None):
        p = subprocess.run(["sh", "-s"], input=script, capture_output=True, text=True, timeout=timeout,
                           env={"HOME": str(self.home), "PATH": "/usr/bin:/bin"}, check=False)
        return Result(p.stdout, p.stderr, p.returncode)


@pytest.fixture
def head(tmp_path):
    return LocalHead(tmp_path)


@pytest.fixture
def desired(base_yaml):
    from reconciler.core import spec

    return spec.loads(base_yaml)


def test_a_second_actor_is_refused_and_told_who_holds(desired, head):
    daemon = Lease(desired, head, Holder.of("daemon", "/etc/spark-reconciler/cluster.yaml"))
    copy = Lease(desired, head, Holder.of("daemon", "/root/copy-of-cluster.yaml"))
    daemon.acquire()
    with pytest.raises(LeaseHeld, match=r"held by daemon pid \d+ on .* for /etc/spark-reconciler/cluster.yaml"):
        copy.acquire()
    daemon.acquire()  # renewing is taking it again
    daemon.release()
    copy.acquire()
    assert (head.home / ".spark-reconciler").stat().st_mode & 0o077 == 0


def test_the_same_daemon_restarted_takes_its_lease_back_at_once(desired, head):
    Lease(desired, head, Holder.of("daemon", "/etc/c.yaml")).acquire()
    Lease(desired, head, Holder.of("daemon", "/etc/c.yaml")).acquire()  # a new process, the same file
    with pytest.raises(LeaseHeld):
        Lease(desired, head, Holder.of("apply", "/etc/c.yaml")).acquire()  # apply on the same file: refused


def test_a_dead_holders_lease_expires(desired, head):
    Lease(desired, head, Holder("gone", "a daemon that died"), ttl=1).acquire()
    other = Lease(desired, head, Holder("next", "the next actor"))

    def taken() -> bool:
        try:
            other.acquire()
        except LeaseHeld:
            return False
        return True

    wait_for(taken, 10, "the dead holder's lease (ttl 1 s) to expire", interval=0.2)


def test_a_one_shot_command_holds_it_while_it_runs_and_gives_it_back(desired, head):
    with held(desired, head, Holder.of("apply", "/etc/c.yaml")), pytest.raises(LeaseHeld):
        Lease(desired, head, Holder.of("daemon", "/etc/c.yaml")).acquire()
    Lease(desired, head, Holder.of("daemon", "/etc/c.yaml")).acquire()


def test_the_renewal_is_rate_limited_and_a_refusal_is_reported(desired, head):
    mine = Lease(desired, head, Holder("me", "me"))
    assert mine.renew_if_due() is None and mine.holding
    before = mine.renewed_at
    assert mine.renew_if_due() is None and mine.renewed_at == before  # within RENEW_AFTER: no SSH round trip
    mine.release()
    Lease(desired, head, Holder("them", "them")).acquire()
    assert "held by them" in (mine.renew_if_due() or "") and not mine.holding


@given(st.text(max_size=300))
def test_any_answer_from_the_head_is_a_decision_never_a_crash(text):
    answer = lease.parse(text)
    assert answer is None or isinstance(answer, str)
    if answer is None:
        assert text.strip().splitlines()[-1].split("\t")[0] in ("ok", "released")


def test_a_renumbered_head_is_the_same_lease_beside_the_same_cluster_id(desired, head):
    """The head reached at another address (issue 29, finding 7): the same machine, so the same file under the SSH
    user's home and the same holder token (it names the daemon's machine and file, not the head's address). The
    controller releases the lease when `Desired.instance` changes (loop/controller.py) and takes it back at once;
    nobody else may take it meanwhile from under a lease still held. The cluster id lives in the same directory."""
    from reconciler.core import spec
    from reconciler.edge.probes import SECTION_FUNCTION, identity_script, parse_identity, split_sections

    moved = spec.Desired.model_validate(desired.model_dump() | {"nodes": [
        n.model_copy(update={"ssh": n.ssh.model_copy(update={"host": "head-a.local"})}) if n.role == "head" else n
        for n in desired.nodes]})
    assert moved.instance != desired.instance
    holder = Holder.of("daemon", "/etc/spark-reconciler/cluster.yaml")
    script = "\n".join(["export LC_ALL=C", SECTION_FUNCTION, *identity_script(desired.instance)]) + "\n"
    made = parse_identity(split_sections(head.run_script(script, 30).stdout).get("identity"))
    before = Lease(desired, head, holder)
    before.acquire()
    with pytest.raises(LeaseHeld):
        Lease(moved, head, Holder.of("apply", "/home/me/cluster.yaml")).acquire()
    before.release()
    after = Lease(moved, head, holder)
    after.acquire()
    assert after.holding and (head.home / ".spark-reconciler" / "lease").read_text().splitlines()[0] == holder.token
    again = parse_identity(split_sections(head.run_script(script.replace(desired.instance, moved.instance), 30)
                                          .stdout).get("identity"))
    assert made is not None and again == made, "the lease beside it changes nothing of the cluster id"
