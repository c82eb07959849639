"""Session fixture for end-to-end tests: the real testbed (network namespaces, sshd, dockerd), up once.

``testbed`` brings it up in the ``seed`` scenario at the start of the session and down at the end, also when
a test fails or the session is interrupted. ``seed_testbed`` additionally resets it to ``seed`` before the
test (fast: no teardown), for tests that inject faults. ``ssh`` opens strict-host-key SSH connections exactly
as a client of the testbed should (the worker through the head as jump host).

Set SPARK_TESTBED_KEEP=1 to leave the testbed up after the session (to poke at it by hand).
"""
from __future__ import annotations

import os

import pytest

from testbed import api


@pytest.fixture(scope="session")
def testbed():
    if os.geteuid() != 0:
        pytest.fail("e2e tests need root (network namespaces, mounts, daemons); see docs/testbed.md")
    # One testbed per machine (fixed addresses and namespace names): concurrent sessions (a benchmark, a second
    # pytest) wait for each other here instead of tearing each other's nodes down.
    import fcntl

    guard = open("/run/spark-testbed.lock", "a")  # noqa: SIM115 - released when the session ends
    fcntl.flock(guard, fcntl.LOCK_EX)
    try:
        tb = api.up(nodes=2, scenario="seed")
        yield tb
    finally:
        try:
            if os.environ.get("SPARK_TESTBED_KEEP") != "1":
                left = api.down()
                assert not left, f"down left behind: {left}"
        finally:
            guard.close()


@pytest.fixture
def seed_testbed(testbed):
    """The testbed, reset to the seed scenario before the test."""
    return testbed.reset("seed")


@pytest.fixture
def ssh(testbed):
    """``ssh(node)`` -> an open fabric.Connection as ``spark``, strict host keys, worker via the head."""
    import fabric
    import paramiko

    opened: list = []

    def connect(node: str, known_hosts=None, timeout: float = 5):
        def conn(host: str, gateway=None):
            c = fabric.Connection(host, user="spark", port=22, gateway=gateway, connect_timeout=timeout,
                                  connect_kwargs={"key_filename": str(testbed.identity_file),
                                                  "look_for_keys": False, "allow_agent": False})
            keys = c.client.get_host_keys()
            keys.clear()                     # only the testbed's known_hosts counts, nothing from ~/.ssh
            c.client.load_host_keys(str(known_hosts or testbed.known_hosts))
            c.client.set_missing_host_key_policy(paramiko.RejectPolicy())
            opened.append(c)
            return c

        n = testbed.node(node)
        if n.index == 0:
            c = conn(n.ssh_host)
        else:
            c = conn(n.ssh_host, gateway=conn(testbed.head.ssh_host))
        c.open()
        return c

    yield connect
    for c in reversed(opened):
        c.close()
