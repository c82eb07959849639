"""Every remote command has a deadline on both ends; one channel's failure is that channel's alone.

Against the testbed's real sshd, which keeps OpenSSH's default MaxSessions (10) like a stock DGX OS:
- a command the head gave up on does not live on on the node (closing an SSH channel does not stop a process that
  never writes; coreutils `timeout` on the node does);
- more concurrent commands than sshd allows channels on one connection queue for a free channel instead of being
  refused;
- when sshd does refuse a channel (the cap lifted for the test), that command fails with ChannelRefused and the
  connection, with every sibling channel on it, lives on.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from reconciler.core import spec
from reconciler.edge import ssh as remote
from reconciler.edge.ssh import ChannelRefused, CommandTimeout, Sessions
from testbed.proc import wait_for

pytestmark = pytest.mark.e2e

MARK = "spark-reconciler-deadline-probe"


@pytest.fixture
def worker(testbed):
    sessions = Sessions(spec.load(testbed.desired_state))
    yield sessions["worker"]
    sessions.close()
    testbed.exec("worker", f"pkill -f {MARK} || true", user="root")


def leftovers(tb) -> list[str]:
    """The test's shell (its command line names MARK) and its child `sleep 317`, if either still runs."""
    out = tb.exec("worker", f"pgrep -af 'sleep 317|{MARK}' || true").stdout
    return [line for line in out.splitlines() if "pgrep" not in line]


def test_a_command_past_its_deadline_is_ended_on_the_node_too(worker, testbed):
    with pytest.raises(CommandTimeout, match="did not finish within 2s"):
        worker.run(["sh", "-c", f"sleep 317; echo {MARK}"], timeout=2)
    t = time.monotonic()
    wait_for(lambda: leftovers(testbed) == [], 10, "the node to end the command by itself")
    print(f"FIGURE remote-deadline: nothing left on the node {time.monotonic() - t:.1f}s after CommandTimeout")
    assert worker.run(["true"], timeout=10).ok, "the session is still usable"


def test_more_concurrent_commands_than_sshd_allows_channels_queue_instead_of_failing(worker):
    n = remote.MAX_CHANNELS + 5
    with ThreadPoolExecutor(n) as pool:
        results = list(pool.map(lambda i: worker.run(["sh", "-c", f"sleep 1; echo {i}"], timeout=30), range(n)))
    assert [r.stdout.strip() for r in results] == [str(i) for i in range(n)]


def test_a_refused_channel_fails_that_command_only(worker, monkeypatch):
    monkeypatch.setattr(worker, "_channels", threading.BoundedSemaphore(40))  # no cap: let sshd refuse
    transport = worker.transport()

    def hold(_i: int):
        try:
            return worker.run(["sh", "-c", "sleep 3; echo held"], timeout=30)
        except ChannelRefused as exc:
            return exc

    with ThreadPoolExecutor(14) as pool:
        outcomes = list(pool.map(hold, range(14)))
    refused = [o for o in outcomes if isinstance(o, ChannelRefused)]
    done = [o for o in outcomes if not isinstance(o, ChannelRefused)]
    assert refused, "sshd (MaxSessions 10) refused some of 14 concurrent channels"
    assert done and all(r.stdout.strip() == "held" for r in done), "the others finished on the same connection"
    assert worker.transport() is transport, "the connection was not closed"
    assert worker.run(["echo", "after"], timeout=10).stdout.strip() == "after"
