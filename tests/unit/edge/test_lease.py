"""One actor per cluster (issue 16, finding 6; issue 31, finding 10): the real lease companion, run by the real `sh`
with flock, timeout and cat, in a HOME of its own standing in for the head (tests/unit/local_head.py). Only the SSH
hop is left out (tests/e2e/test_daemon.py has `apply` refused by a running daemon over the testbed's SSH).
The clock steps and the two daemons of one path are in tests/unit/loop/test_clock_steps.py."""

from __future__ import annotations

import shutil

import pytest
from hypothesis import given
from hypothesis import strategies as st

from reconciler.edge import lease
from reconciler.edge.lease import Holder, Lease, LeaseHeld, held
from tests.unit.local_head import LocalHead, hang_up


@pytest.fixture
def head(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    local = LocalHead(home)
    yield local
    hang_up(local)


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
    daemon.acquire()  # taking it again is keeping it
    assert daemon.holding
    daemon.release()
    copy.acquire()
    assert (head.home / ".spark-reconciler").stat().st_mode & 0o077 == 0


def test_the_daemon_systemd_restarts_takes_the_lease_back_once_its_predecessor_is_gone(desired, head):
    """The predecessor died: its connection closed, sshd ended its companion's stdin, the kernel dropped the lock.
    No TTL to wait for; and apply on the same file is refused by the new daemon."""
    before = Lease(desired, head, Holder.of("daemon", "/etc/c.yaml"))
    before.acquire()
    head.companions[-1].hang_up()  # the old process's end, as sshd sees it
    after = Lease(desired, head, Holder.of("daemon", "/etc/c.yaml"))
    after.acquire()
    with pytest.raises(LeaseHeld):
        Lease(desired, head, Holder.of("apply", "/etc/c.yaml")).acquire()


def test_a_holder_killed_outright_frees_the_lock_with_its_process(desired, head):
    Lease(desired, head, Holder("gone", "a daemon that died")).acquire()
    head.companions[-1].kill()  # SIGKILL to the companion's group: no cleanup of its own
    Lease(desired, head, Holder("next", "the next actor")).acquire()


def test_a_one_shot_command_holds_it_while_it_runs_and_gives_it_back(desired, head):
    with held(desired, head, Holder.of("apply", "/etc/c.yaml")), pytest.raises(LeaseHeld, match="held by apply"):
        Lease(desired, head, Holder.of("daemon", "/etc/c.yaml")).acquire()
    Lease(desired, head, Holder.of("daemon", "/etc/c.yaml")).acquire()


def test_a_lost_lease_is_seen_without_a_round_trip_and_taken_back_when_free(desired, head):
    mine = Lease(desired, head, Holder("me", "me"))
    assert mine.renew_if_due() is None and mine.holding
    companion = head.companions[-1]
    assert mine.renew_if_due() is None and head.companions[-1] is companion, "ours still: nothing started"
    companion.kill()  # the lock went away under us (the head's sshd dropped the session)
    them = Lease(desired, head, Holder("them", "them"))
    them.acquire()
    assert "held by them" in (mine.renew_if_due() or "") and not mine.holding
    them.release()
    assert mine.renew_if_due() is None and mine.holding


def test_a_head_without_flock_is_a_refusal_that_says_why(desired, tmp_path):
    home = tmp_path / "bare"
    home.mkdir()
    tools = tmp_path / "no-flock"
    tools.mkdir()
    for tool in ("sh", "timeout", "mkdir", "cat", "sed", "head", "mv", "rm"):
        (tools / tool).symlink_to(shutil.which(tool))
    bare = LocalHead(home)
    bare.path = str(tools)  # a head without flock: never "held", never ours
    with pytest.raises(LeaseHeld, match="ended without an answer"):
        Lease(desired, bare, Holder("me", "me")).acquire()


@given(st.one_of(st.none(), st.text(max_size=300)))
def test_any_answer_from_the_head_is_a_decision_never_a_crash(text):
    answer = lease.parse(text)
    assert answer is None or (isinstance(answer, str) and "\n" not in answer)
    if answer is None:
        assert text is not None and text.strip() == "ok"


def test_a_renumbered_head_is_the_same_lease_beside_the_same_cluster_id(desired, head):
    """The head reached at another address (issue 29, finding 7): the same machine, so the same lock under the SSH
    user's home. The controller releases the lease when `Desired.instance` changes (loop/controller.py) and takes
    it back at once; nobody else may take it meanwhile from under a lease still held. The cluster id lives in the
    same directory."""
    from reconciler.core import spec
    from reconciler.edge.facts.base import sealed, split_sections
    from reconciler.edge.facts.host import identity_script, parse_identity

    moved = spec.Desired.model_validate(desired.model_dump() | {"nodes": [
        n.model_copy(update={"ssh": n.ssh.model_copy(update={"host": "head-a.local"})}) if n.role == "head" else n
        for n in desired.nodes]})
    assert moved.instance != desired.instance
    holder = Holder.of("daemon", "/etc/spark-reconciler/cluster.yaml")
    script = sealed(identity_script(desired.instance))
    made = parse_identity(split_sections(head.run_script(script.script, 30).stdout, script.nonce).get("identity"))
    before = Lease(desired, head, holder)
    before.acquire()
    with pytest.raises(LeaseHeld):
        Lease(moved, head, Holder.of("apply", "/home/me/cluster.yaml")).acquire()
    before.release()
    after = Lease(moved, head, holder)
    after.acquire()
    assert after.holding and (head.home / ".spark-reconciler" / "lease").read_text().splitlines()[0] == holder.token
    script = sealed(identity_script(moved.instance))
    again = parse_identity(split_sections(head.run_script(script.script, 30).stdout, script.nonce).get("identity"))
    assert made is not None and again == made, "the lease beside it changes nothing of the cluster id"
