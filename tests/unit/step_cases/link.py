"""link: the fabric ports of one node up, at the MTU, with their address, then a don't-fragment ping to the peer.

The ports are the recorded testbed's (`ip -j addr` of worker1, tests/unit/fixtures/probe-4-nodes.json), changed the
way a node would show the change; the RDMA cases are the sample's (its ports declare RDMA devices).
"""

from __future__ import annotations

import json
from typing import Any

from reconciler.core.planning import Step
from reconciler.edge.facts.base import Section
from reconciler.edge.ssh import Result
from tests.unit.recorded import RAW, load, observe, sections_of
from tests.unit.step_cases import HEAD, WORKER, Case, Raw

W1, IF0, IF1 = "worker1", "enp1s0f1np1", "enP2p1s0f1np1"
_RECORDED = sections_of(RAW["outputs"][W1])


def _port(section: str, **change: Any) -> dict[str, Any]:
    """worker1's recorded `ip -j addr` of one port, with `change` applied (mtu, flags, operstate, addresses)."""
    info: dict[str, Any] = json.loads(_RECORDED[section].body)[0]
    if "addresses" in change:
        info["addr_info"] = [{"family": "inet", "local": a.split("/")[0], "prefixlen": int(a.split("/")[1]),
                              "scope": "global", "label": info["ifname"]} for a in change.pop("addresses")]
    return {**info, **change}


def ports(first: dict[str, Any] | None = None, twin: dict[str, Any] | None = None, rdma: str | None = None,
          rdma_twin: str | None = None) -> dict[str, Section]:
    """The links fact's sections (`facts.links.link_script`): each port's `ip -j addr` and its RDMA port's state."""
    return {"link": Section(json.dumps([first if first is not None else _port("link")]), 0),
            "rdma": Section(rdma, 0) if rdma else Section("", 2),
            "link-twin": Section(json.dumps([twin if twin is not None else _port("link-twin")]), 0),
            "rdma-twin": Section(rdma_twin, 0) if rdma_twin else Section("", 2)}


def _step(node: str = W1) -> Step:
    return Step("link", node, "test", ())


def _recorded(**kw: Any) -> dict[str, Any]:
    return {"desired": load, "observed": lambda: observe(load()), **kw}


def ping(node: str, interface: str, peer: str, size: int = 8972) -> str:
    return f"{node} ping -c 1 -W 1 -M do -s {size} -I {interface} {peer}"


UP = [f"read {W1} links", f"wait {W1} links", f"wait {ping(W1, IF0, '10.232.0.10')}"]
UP_TWIN = [f"read {W1} links", f"wait {W1} links", f"wait {ping(W1, IF1, '10.232.1.10')}"]
AT_1500 = ports(_port("link", mtu=1500))
SET_MTU = f"run {W1} sudo /usr/sbin/ip link set dev {IF0} mtu 9000"
ARRIVES_ON_IT = Raw("10.232.0.1 51022 10.232.0.11 22")
ARRIVES_ELSEWHERE = Raw("192.168.1.7 51022 192.168.1.21 22")
SAMPLE_PORTS = {"first": _port("link", addresses=["192.168.200.13/24"]),
                    "twin": _port("link-twin", addresses=["192.168.201.13/24"])}

CASES = [
    Case("link: converged ports: read, seen up, pinged; nothing changed", _step(), [*UP, *UP_TWIN],
         facts={f"{W1} links": [ports()]}, **_recorded()),
    Case("link: the head pings the first other serving node's port", _step("head"),
         ["read head links", "wait head links", f"wait {ping('head', IF0, '10.232.0.11')}",
          "read head links", "wait head links", f"wait {ping('head', IF1, '10.232.1.11')}"],
         facts={"head links": [sections_of(RAW["outputs"]["head"])]}, **_recorded()),
    Case("link: MTU 1500 after a firmware reboot, the session elsewhere: set to 9000", _step(),
         [f"read {W1} links", f"read {W1} session-address", SET_MTU, *UP[1:], *UP_TWIN],
         facts={f"{W1} links": [AT_1500, ports()], f"{W1} session-address": [ARRIVES_ELSEWHERE]}, **_recorded()),
    Case("link: sshd without $SSH_CONNECTION: the guard cannot match, the MTU is set", _step(),
         [f"read {W1} links", f"read {W1} session-address", SET_MTU, *UP[1:], *UP_TWIN],
         facts={f"{W1} links": [AT_1500, ports()], f"{W1} session-address": [Raw("")]}, **_recorded()),
    Case("link: a port down without its address: set up, address added", _step(),
         [f"read {W1} links", f"run {W1} sudo /usr/sbin/ip link set dev {IF0} up",
          f"run {W1} sudo /usr/sbin/ip addr add 10.232.0.11/24 dev {IF0}", *UP[1:], *UP_TWIN],
         facts={f"{W1} links": [ports(_port("link", flags=["BROADCAST", "MULTICAST"], operstate="DOWN",
                                            addresses=[])), ports()]}, **_recorded()),
    Case("link: a declared interface that does not exist: refused", _step(), [f"read {W1} links"],
         facts={f"{W1} links": [{**ports(), "link": Section(f'Device "{IF0}" does not exist.', 1)}]},
         raises="interface enp1s0f1np1 does not exist on worker1", **_recorded()),
    Case("link: a port that never comes up with carrier fails the step", _step(), UP[:2],
         facts={f"{W1} links": [ports(_port("link", flags=["BROADCAST", "MULTICAST", "UP"], operstate="DOWN"))]},
         raises="timed out after 30s waiting for enp1s0f1np1 on worker1 to come up with carrier", **_recorded()),
    Case("link: carrier but operstate dormant (802.1X) is not up (`Link.up`)", _step(), UP[:2],
         facts={f"{W1} links": [ports(_port("link", operstate="DORMANT"))]},
         raises="waiting for enp1s0f1np1 on worker1 to come up with carrier", **_recorded()),
    Case("link: the MTU did not take: fails naming what the port shows", _step(),
         [f"read {W1} links", f"read {W1} session-address", SET_MTU, f"wait {W1} links"],
         facts={f"{W1} links": [AT_1500], f"{W1} session-address": [ARRIVES_ELSEWHERE]},
         raises=r"enp1s0f1np1 on worker1: mtu 1500, addresses \['10.232.0.11/24'\] after the change", **_recorded()),
    Case("link: the don't-fragment ping failing is the MTU message", _step(), UP,
         facts={f"{W1} links": [ports()]},
         results={ping(W1, IF0, "10.232.0.10"): [Result("", "ping: local error: message too long, mtu=1500", 1)]},
         raises=r"timed out after 20s waiting for a don't-fragment ping of 8972 bytes from worker1 to 10.232.0.10 "
                r"over enp1s0f1np1: check the MTU on both ends \(a firmware reboot can reset one to 1500\)",
         **_recorded()),
    Case("link: a ping that answers on the second try is enough", _step(), [*UP, *UP_TWIN],
         facts={f"{W1} links": [ports()]},
         results={ping(W1, IF0, "10.232.0.10"): [Result("", "", 1), Result("1 received", "", 0)]}, **_recorded()),
    Case("link: an RDMA port is awaited ACTIVE before the ping", _step(WORKER),
         [f"read {WORKER} links", f"wait {WORKER} links", f"wait {WORKER} links",
          f"wait {ping(WORKER, IF0, '192.168.200.12')}", f"read {WORKER} links", f"wait {WORKER} links",
          f"wait {WORKER} links", f"wait {ping(WORKER, IF1, '192.168.201.12')}"],
         facts={f"{WORKER} links": [ports(**SAMPLE_PORTS, rdma="2: INIT\n5: LinkUp", rdma_twin="4: ACTIVE\n5: LinkUp"),
                                    ports(**SAMPLE_PORTS, rdma="4: ACTIVE\n5: LinkUp",
                                          rdma_twin="4: ACTIVE\n5: LinkUp")]}),
    Case("link: an RDMA port that never becomes ACTIVE fails the step", _step(WORKER),
         [f"read {WORKER} links", f"wait {WORKER} links", f"wait {WORKER} links"],
         facts={f"{WORKER} links": [ports(**SAMPLE_PORTS, rdma="2: INIT\n5: LinkUp")]},
         raises="timed out after 30s waiting for RDMA port rocep1s0f1 on spark-5be3 to become ACTIVE"),
    Case("link: the head of a one-node file has no peer: no ping", _step(HEAD),
         [f"read {HEAD} links", f"wait {HEAD} links", f"read {HEAD} links", f"wait {HEAD} links"],
         facts={f"{HEAD} links": [ports(_port("link", addresses=["192.168.200.12/24"]),
                                        _port("link-twin", addresses=["192.168.201.12/24"]))]},
         desired=lambda: _alone()),
]


def _alone() -> Any:
    """The sample with its head alone (no worker): nobody to ping."""
    from tests.unit.step_cases import sample

    d = sample()
    return d.model_copy(update={"nodes": [d.head]})


# -- the survivors of issue 34's mutation run (docs/mutation-survivors-edge.md): whom the head pings when it serves
# alone, and a peer that declares no twin.


def _head_serves_alone() -> Any:
    """The sample with the head its only serving node (the worker declared, not serving): the head still has a peer
    for its pings, the first other node of the file."""
    from tests.unit.step_cases import sample

    d = sample()
    return d.with_deployment(serving=d.serving.model_copy(update={"nodes": [HEAD],
                                                                        "tensor_parallel_size": 1}))


def _head_without_twin() -> Any:
    """The recorded testbed with the head declaring its first port only: worker1's twin has no peer port to ping."""
    d = load()
    head = d.head.model_copy(update={"fabric": d.head.fabric.model_copy(update={"twin": None})})
    return d.model_copy(update={"nodes": [head if n.name == "head" else n for n in d.nodes]})


CASES += [
    Case("link: a head serving alone pings the first other node of the file", _step(HEAD),
         [f"read {HEAD} links", f"wait {HEAD} links", f"wait {ping(HEAD, IF0, '192.168.200.13')}",
          f"read {HEAD} links", f"wait {HEAD} links", f"wait {ping(HEAD, IF1, '192.168.201.13')}"],
         facts={f"{HEAD} links": [ports(_port("link", addresses=["192.168.200.12/24"]),
                                        _port("link-twin", addresses=["192.168.201.12/24"]))]},
         desired=_head_serves_alone),
    Case("link: the peer declares no twin: the twin is brought up, not pinged", _step(), [*UP, *UP_TWIN[:2]],
         facts={f"{W1} links": [ports()]}, desired=_head_without_twin, observed=lambda: observe(load())),
]


# -- round 2 (issue 34, item 7): a worker pings the head even when the head does not serve (`_peer`: by role, not
# by the serving order, whose first other node would be another worker).


def _head_not_serving() -> Any:
    """The recorded testbed serving on worker1 and worker2 only: the head is declared (and keeps the fabric), but
    it is not the first other serving node of worker1; worker2 is."""
    d = load()
    return d.with_deployment(serving=d.serving.model_copy(update={"nodes": [W1, "worker2"]}))


CASES += [
    Case("link: a worker pings the head's port, even when the head does not serve", _step(), [*UP, *UP_TWIN],
         facts={f"{W1} links": [ports()]}, desired=_head_not_serving, observed=lambda: observe(load())),
]


# -- issue 52, item 9: the MTU of the port the node's session arrives on (the sample's worker is reached over its
# first fabric port, which a firmware reboot resets to 1500) is set over a session to the node's other declared
# port (`ssh.via`: NODE@ADDRESS); without one, only when the peer's end already runs the target MTU.

OVER_TWIN, OVER_FIRST = f"{W1}@10.232.1.11", f"{W1}@10.232.0.11"
ARRIVES_ON_TWIN = Raw("10.232.1.10 40022 10.232.1.11 22")
TWIN_DOWN = _port("link-twin", flags=["BROADCAST", "MULTICAST"], operstate="DOWN")
HEAD_AT_9000 = ports()  # the head's ports as its probe shows them (the recorded shape, MTU 9000, up)
HEAD_AT_1500 = ports(_port("link", mtu=1500))


def _set_mtu(node: str, interface: str = IF0) -> str:
    return f"run {node} sudo /usr/sbin/ip link set dev {interface} mtu 9000"


def _worker1_without_twin() -> Any:
    """The recorded testbed with worker1 declaring its first port only: no other path to it."""
    d = load()
    w1 = d.node(W1)
    w1 = w1.model_copy(update={"fabric": w1.fabric.model_copy(update={"twin": None})})
    return d.model_copy(update={"nodes": [w1 if n.name == W1 else n for n in d.nodes]})


#: The cases whose MTU change runs over `NODE@ADDRESS`: tests/unit/steps/test_link_over_twin.py runs them (and checks
#: their sudo line against the node's own), since test_step_cases.py's sudoers check looks the transcript's node
#: up in the file by name.
OVER_OTHER_PORT = [
    Case("link: the session arrives on the port at 1500: its MTU is set over a session to the twin's address",
         _step(),
         [f"read {W1} links", f"read {W1} session-address", f"read {OVER_TWIN} session-address",
          "report link.mtu-over-other-port", _set_mtu(OVER_TWIN), *UP[1:], *UP_TWIN],
         facts={f"{W1} links": [AT_1500, ports()], f"{W1} session-address": [ARRIVES_ON_IT],
                f"{OVER_TWIN} session-address": [ARRIVES_ON_TWIN]}, **_recorded()),
    Case("link: the other way round: the session arrives on the twin at 1500: set over the first port's address",
         _step(),
         [*UP, f"read {W1} links", f"read {W1} session-address", f"read {OVER_FIRST} session-address",
          "report link.mtu-over-other-port", _set_mtu(OVER_FIRST, IF1), *UP_TWIN[1:]],
         facts={f"{W1} links": [*[ports(twin=_port("link-twin", mtu=1500))] * 3, ports()],
                f"{W1} session-address": [ARRIVES_ON_TWIN],
                f"{OVER_FIRST} session-address": [ARRIVES_ON_IT]}, **_recorded()),
]

CASES += [
    Case("link: the twin down (no other path), the peer's end at 9000: set over the session itself", _step(),
         [f"read {W1} links", f"read {W1} session-address", "read head links", "report link.mtu-peer-at-target",
          SET_MTU, *UP[1:], *UP_TWIN],
         facts={f"{W1} links": [ports(_port("link", mtu=1500), TWIN_DOWN), ports(twin=TWIN_DOWN), ports()],
                f"{W1} session-address": [ARRIVES_ON_IT], "head links": [HEAD_AT_9000]}, **_recorded()),
    Case("link: the session over the twin arrives elsewhere: not taken for a path; the peer's end decides", _step(),
         [f"read {W1} links", f"read {W1} session-address", f"read {OVER_TWIN} session-address", "read head links",
          "report link.mtu-peer-at-target", SET_MTU, *UP[1:], *UP_TWIN],
         facts={f"{W1} links": [AT_1500, ports()], f"{W1} session-address": [ARRIVES_ON_IT],
                f"{OVER_TWIN} session-address": [ARRIVES_ON_IT], "head links": [HEAD_AT_9000]}, **_recorded()),
    Case("link: the MTU self-cut guard: no other path and the peer's end at 1500: refused, nothing run", _step(),
         [f"read {W1} links", f"read {W1} session-address", "read head links"],
         facts={f"{W1} links": [ports(_port("link", mtu=1500), TWIN_DOWN)], f"{W1} session-address": [ARRIVES_ON_IT],
                "head links": [HEAD_AT_1500]},
         raises=r"not changing the MTU of enp1s0f1np1 on worker1 to 9000: the reconciler's SSH session arrives on it "
                r"\(10.232.0.11\), its other port enP2p1s0f1np1 is not up with 10.232.1.11/24, and the peer's end "
                r"\(enp1s0f1np1 on head\) runs MTU 1500, not 9000; a path without jumbo frames would cut the node "
                r"off. Declare the node's twin \(`fabric.twin`\) and bring it up, set the MTU with netplan on the "
                r"node, or reach it over its management port", **_recorded()),
    Case("link: no twin declared and the peer's end down: refused", _step(),
         [f"read {W1} links", f"read {W1} session-address", "read head links"],
         facts={f"{W1} links": [AT_1500], f"{W1} session-address": [ARRIVES_ON_IT],
                "head links": [ports(_port("link", flags=["BROADCAST", "MULTICAST"], operstate="DOWN"))]},
         raises=r"arrives on it \(10.232.0.11\), it declares no twin to be reached over, and the peer's end "
                r"\(enp1s0f1np1 on head\) is not up;", desired=_worker1_without_twin,
         observed=lambda: observe(load())),
    Case("link: no twin declared, the peer's end at 9000: set over the session itself", _step(),
         [f"read {W1} links", f"read {W1} session-address", "read head links", "report link.mtu-peer-at-target",
          SET_MTU, *UP[1:]],
         facts={f"{W1} links": [AT_1500, ports()], f"{W1} session-address": [ARRIVES_ON_IT],
                "head links": [HEAD_AT_9000]}, desired=_worker1_without_twin, observed=lambda: observe(load())),
]
