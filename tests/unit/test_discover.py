"""discover's address guess for a node without an address in the fabric subnet: the next free host address,
wrapping around, and a clear "no free address" (not an endless loop) when the subnet is full."""

from __future__ import annotations

import ipaddress

from reconciler.edge.discover import next_free_address


def _next(ref: str, *taken: str) -> str | None:
    iface = ipaddress.IPv4Interface(ref)
    used = {iface.ip, *(ipaddress.IPv4Address(t) for t in taken)}
    free = next_free_address(iface, int(iface.ip), used)
    return None if free is None else str(ipaddress.IPv4Address(free))


def test_the_next_free_host_above_the_reference():
    assert _next("192.168.200.12/24") == "192.168.200.13"
    assert _next("192.168.200.12/24", "192.168.200.13") == "192.168.200.14"


def test_wraps_around_below_the_reference_never_the_broadcast():
    assert _next("10.0.0.254/24") == "10.0.0.1"


def test_a_full_subnet_has_no_free_address():
    assert _next("10.0.0.1/30", "10.0.0.2") is None
    assert _next("10.0.0.1/31", "10.0.0.0") is None


def test_a_head_that_cannot_lock_memory_gets_a_starter_without_memlock():
    """The defaults ask for memlock=-1; a head whose hard limit is finite would refuse every start with it
    (docker: "setrlimit ... operation not permitted"), so the starter removes it, and keeps it where it can be had."""
    from reconciler.core.spec.models import DockerOptions
    from reconciler.edge.discover.facts import NodeFacts
    from reconciler.edge.discover.render import _docker

    def effective(**facts):
        ulimits = dict(_docker(NodeFacts(host="h", **facts))["ulimits"])
        return DockerOptions(ulimits=ulimits).effective_ulimits

    limited = effective(nofile_hard=20000, memlock_unlimited=False)
    assert "memlock" not in limited and limited["nofile"] == "20000:20000"
    assert effective(nofile_hard=None, memlock_unlimited=True)["memlock"] == "-1"
