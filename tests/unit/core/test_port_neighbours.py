"""A listener on another local address of the serving port (issue 53, MEDIUM B), with the exploit itself: real HTTP
servers, ours as root (this runner) on `127.0.0.1:P`, a local user's run as `nobody` on `[::1]:P` and `127.0.0.2:P`,
read by the probe's real scripts under a real sh, curl and mawk. Before: every LISTEN row on the port counted, so
serving read as "held by uid 65534", the health drift blocked every restart, and with vLLM down the start itself
was blocked as a port another process holds."""

from __future__ import annotations

import json
import socket
import subprocess

import pytest

from reconciler.core.drift import diff
from reconciler.core.listeners import ANY, proc_address, takes
from reconciler.core.loader import load_file
from reconciler.core.planning import plan
from reconciler.core.spec import Desired
from reconciler.edge.facts.base import Section, sealed, split_sections
from reconciler.edge.facts.ports import (
    _takes_awk,
    listen_script,
    parse_listen_addresses,
    parse_listening,
    parse_port_holder,
    parse_port_neighbours,
)
from reconciler.edge.facts.serving import api_script, parse_serving
from testbed.proc import wait_for
from tests.unit import recorded

KEY = "sk-neighbour-test-0123456789"
NOBODY = 65534
NAME = "tiny-moe"  # the recorded cluster's served name, which the plans below judge
# A stand-in vLLM API on (host, port): /health, /v1/models, a completion and the engine's counters; prints each
# request's path and Authorization header (or "-"). `v6only`: an IPv6 socket that takes no IPv4 (IPV6_V6ONLY).
SERVER = r"""
import json, socket, sys
from http.server import BaseHTTPRequestHandler, HTTPServer
host, port, name, v6only = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4] == "v6only"
METRICS = (b"vllm:num_requests_running 0\nvllm:num_requests_waiting 0\nvllm:prompt_tokens_total 1\n"
           b"vllm:generation_tokens_total 1\n")
class H(BaseHTTPRequestHandler):
    def answer(self):
        print(self.path, self.headers.get("Authorization", "-"), flush=True)
        body = {"/health": b"", "/metrics": METRICS,
                "/v1/models": json.dumps({"data": [{"id": name}]}).encode()}.get(
                    self.path, json.dumps({"choices": [{"text": "x"}]}).encode())
        self.send_response(200); self.send_header("Content-Length", str(len(body))); self.end_headers()
        self.wfile.write(body)
    do_GET = do_POST = answer
    def log_message(self, *a): pass
class S(HTTPServer):
    address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
    def server_bind(self):
        if v6only:
            self.socket.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        super().server_bind()
S((host, port), H).serve_forever()
"""


def free_port() -> int:
    """A port free on 127.0.0.1, 127.0.0.2 and ::1 alike (the kernel's pick for ::, which meets them all)."""
    with socket.socket(socket.AF_INET6) as s:
        s.bind(("::", 0))
        return s.getsockname()[1]


def answering(host: str, port: int) -> bool:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as s:
        return s.connect_ex(("::1" if host == "::" else "127.0.0.1" if host == "0.0.0.0" else host, port)) == 0


class Servers:
    """Servers started by a test, each `(host, uid)`; what each was asked, once they are stopped."""

    def __init__(self, port: int) -> None:
        self.port, self.procs, self.seen = port, {}, {}

    def start(self, host: str, user: int | None, v6only: bool = False) -> None:
        # the system python: nobody may run it (the venv lives under root's home); the server needs only the stdlib
        proc = subprocess.Popen(["/usr/bin/python3", "-c", SERVER, host, str(self.port), NAME,
                                 "v6only" if v6only else "-"], stdout=subprocess.PIPE, text=True, user=user, cwd="/")
        self.procs[(host, user)] = proc
        wait_for(lambda: proc.poll() is None and answering(host, self.port), timeout=30,
                 what=f"a listener on {host}:{self.port}")

    def stop(self, host: str, user: int | None) -> list[str]:
        proc = self.procs.pop((host, user))
        proc.terminate()
        out, _ = proc.communicate(timeout=30)
        self.seen[(host, user)] = out.splitlines()
        return self.seen[(host, user)]

    def stop_all(self) -> None:
        for host, user in list(self.procs):
            self.stop(host, user)


@pytest.fixture
def servers():
    made = Servers(free_port())
    yield made
    made.stop_all()


def desired_on(cluster_yaml, port: int, host: str) -> Desired:
    data = load_file(cluster_yaml).data
    data["serving"].update(port=port, host=host, secrets={"VLLM_API_KEY": "head"}, served_model_name=NAME)
    return Desired.model_validate(data).with_secrets({"VLLM_API_KEY": KEY})


def run(lines: list[str]) -> dict[str, Section]:
    script = sealed(lines)
    out = subprocess.run(["sh", "-s"], input=script.script, capture_output=True, text=True, timeout=60,
                         check=True).stdout
    return split_sections(out, script.nonce)


def serving_of(sections: dict[str, Section]):
    return parse_serving(sections.get("health"), sections.get("models"), None, sections.get("completion"),
                         sections.get("engine"), sections.get("port_owner"))


def test_ours_on_loopback_beside_nobody_on_other_addresses_still_serves_and_restarts(cluster_yaml, servers):
    """The finding's exploit: root on 127.0.0.1:P, `nobody` on [::1]:P and 127.0.0.2:P while it serves."""
    port = servers.port
    servers.start("127.0.0.1", None)
    servers.start("::1", NOBODY)
    servers.start("127.0.0.2", NOBODY)
    api = run(api_script(desired_on(cluster_yaml, port, "127.0.0.1")))
    listen = run(listen_script())["listen"]
    servers.stop_all()

    serving = serving_of(api)
    assert serving.port_holder is None and serving.serves(NAME), serving
    assert serving.port_neighbours == [f"uid {NOBODY} on 127.0.0.2", f"uid {NOBODY} on ::1"]
    assert any(KEY in line for line in servers.seen[("127.0.0.1", None)]), "our serving is asked, with its key"
    assert servers.seen[("::1", NOBODY)] == [] and servers.seen[("127.0.0.2", NOBODY)] == [], "nobody was asked"
    # the kernel's own rows, as the probe reads them: every listener on P, each at its address
    assert port in (parse_listening(listen) or [])
    assert (parse_listen_addresses(listen) or {})[port] == ["127.0.0.1", "127.0.0.2", "::1"]

    # the plan of the recorded cluster, its API on 127.0.0.1, with a change to roll out: what P showed is 8000's
    cluster = recorded.load(("max_model_len: 4096", "max_model_len: 8192"), ("  host: 0.0.0.0", "  host: 127.0.0.1"))
    seen = recorded.observe(cluster)
    head = seen.node("head")
    observed = recorded.changed(seen, "head", serving=serving, listening=head.listening,
                                listen_addresses={**(head.listen_addresses or {}),
                                                  8000: (parse_listen_addresses(listen) or {})[port]})
    result = plan(cluster, observed)
    assert result.blocked == [] and not [d for d in result.drift if d.kind == "health"]
    kinds = [s.kind for s in result.steps]
    assert kinds.count("stop-serving") == 4 and kinds.count("start-serving") == 4, kinds
    [said] = [d for d in diff(cluster, observed) if d.resource == "api/:8000"]
    assert said.kind == "co-tenant" and not said.actionable and not said.blocking
    assert f"uid {NOBODY} on 127.0.0.2, uid {NOBODY} on ::1" in said.observed


@pytest.mark.parametrize("host, blocked", [("127.0.0.1", False), ("0.0.0.0", True)])
def test_with_vllm_down_only_a_listener_in_the_way_holds_the_start(servers, host, blocked):
    """`nobody` on [::1]:P and 127.0.0.2:P, nothing of ours running: a start on 127.0.0.1 goes on; one on 0.0.0.0
    would meet 127.0.0.2 (the kernel refuses the bind), so it is held, as every listener was before."""
    servers.start("::1", NOBODY)
    servers.start("127.0.0.2", NOBODY)
    addresses = (parse_listen_addresses(run(listen_script())["listen"]) or {})[servers.port]
    assert addresses == ["127.0.0.2", "::1"]
    cluster = recorded.load(("  host: 0.0.0.0", f"  host: {host}"))
    observed = recorded.observe(cluster)
    for node in ("head", *recorded.WORKERS):
        observed = recorded.changed(observed, node, containers=recorded.without(observed, node, "vllm_serving"))
    head = observed.node("head")
    listening = [p for p in head.listening or [] if p != 29501]  # the master port: gone with the ranks
    observed = recorded.changed(observed, "head", listening=listening,
                                listen_addresses={**(head.listen_addresses or {}), 8000: addresses})
    result = plan(cluster, observed)
    if blocked:
        [held] = result.blocked
        assert held.reason.startswith("port 8000 (serving.port) on head is held by a process the reconciler did "
                                      "not start"), held
    else:
        assert result.blocked == [] and "start-serving/head" in [s.id for s in result.steps]


def test_a_v6only_wildcard_beside_ours_is_elsewhere_but_alone_it_is_in_the_way(cluster_yaml, servers):
    """`nobody` on [::]:P with IPV6_V6ONLY beside root on 127.0.0.1:P: the kernel refuses a dual-stack `::` there,
    so that socket takes no IPv4 and is named, not counted. Alone, /proc cannot say IPV6_V6ONLY: it counts."""
    desired = desired_on(cluster_yaml, servers.port, "127.0.0.1")
    servers.start("127.0.0.1", None)
    servers.start("::", NOBODY, v6only=True)
    beside = serving_of(run(api_script(desired)))
    servers.stop("127.0.0.1", None)
    alone = serving_of(run(api_script(desired)))
    assert beside.serves(NAME) and beside.port_neighbours == [f"uid {NOBODY} on ::"]
    assert alone.port_holder == NOBODY and not alone.serves(NAME)
    assert servers.stop("::", NOBODY) == [], "nobody was asked"


def test_ours_on_every_address_beside_nobody_on_ipv6_loopback(cluster_yaml, servers):
    """serving.host 0.0.0.0: an IPv4 wildcard leaves [::1] free to bind; that listener is named, not counted."""
    servers.start("0.0.0.0", None)
    servers.start("::1", NOBODY)
    serving = serving_of(run(api_script(desired_on(cluster_yaml, servers.port, "0.0.0.0"))))
    assert serving.serves(NAME) and serving.port_neighbours == [f"uid {NOBODY} on ::1"]


# -- the rule, in Python and in awk -------------------------------------------------------------------------------

ADDRESSES = {  # as /proc/net/tcp{,6} prints them on a little-endian host (read from real sockets, above)
    "0100007F": "127.0.0.1", "00000000": "0.0.0.0", "0200007F": "127.0.0.2", "0A00E80A": "10.232.0.10",
    "0" * 32: "::", "00000000000000000000000001000000": "::1",
    "0000000000000000FFFF00000100007F": "::ffff:127.0.0.1", "0000000000000000FFFF000000000000": "::ffff:0.0.0.0",
    "0000000000000000FFFF00000300007F": "::ffff:127.0.0.3", "000080FE00000000FF5400005F3412FE": "fe80::54ff:fe12:345f",
}
IN_THE_WAY = {
    "127.0.0.1": {"127.0.0.1", "0.0.0.0", "::", "::ffff:127.0.0.1", "::ffff:0.0.0.0"},
    "0.0.0.0": {"127.0.0.1", "0.0.0.0", "127.0.0.2", "10.232.0.10", "::", "::ffff:127.0.0.1", "::ffff:0.0.0.0",
                "::ffff:127.0.0.3"},
}


def test_proc_addresses_read_as_text():
    assert {hexa: proc_address(hexa) for hexa in ADDRESSES} == ADDRESSES
    for odd in ("0100007", "", "0100007G", "0" * 31):
        with pytest.raises(ValueError):
            proc_address(odd)


@pytest.mark.parametrize("host", ["127.0.0.1", "0.0.0.0"])
def test_the_rule_says_which_addresses_are_in_the_way(host):
    assert {text for text in ADDRESSES.values() if takes(text, host)} == IN_THE_WAY[host]
    assert all(takes(text, ANY) for text in ADDRESSES.values()), "a bind on every address meets every listener"
    assert takes("not an address", host), "unknown counts"


@pytest.mark.parametrize("host", ["127.0.0.1", "0.0.0.0"])
def test_the_probes_awk_and_the_rule_agree(host):
    """The node's awk (mawk here, as on DGX OS) judges /proc's spelling as `takes` judges the text."""
    program = f'{{ a = $1; c = "-"; if ({_takes_awk(host)}) c = "+"; print c, a }}'
    out = subprocess.run(["awk", program], input="\n".join(ADDRESSES), capture_output=True, text=True,
                         timeout=30, check=True).stdout
    assert {ADDRESSES[a] for c, a in (line.split() for line in out.splitlines()) if c == "+"} == IN_THE_WAY[host]


def test_the_port_owner_section_old_and_odd():
    """A recording from before the rows (the owners alone) reads as it did; odd rows name nothing and fail
    nothing."""
    assert parse_port_holder(Section("0 \n", 0)) is None and parse_port_neighbours(Section("0 \n", 0)) == []
    assert parse_port_holder(Section("1000 \n", 0)) == 1000
    odd = Section("0 \n+ 0 0100007F\n- 65534 0200007F\n- x 0200007F\n- 1 zz\n- ² 0200007F\n-\n" + "- 7 00000000\n" * 3,
                  0)
    assert parse_port_holder(odd) is None
    assert parse_port_neighbours(odd) == ["uid 65534 on 127.0.0.2", "uid 7 on 0.0.0.0"]
    many = Section("0 \n" + "".join(f"- {uid} 0200007F\n" for uid in range(1000, 1020)), 0)
    assert len(parse_port_neighbours(many)) == 8
    assert json.loads(serving_of({"port_owner": odd}).model_dump_json())["port_neighbours"] == \
        ["uid 65534 on 127.0.0.2", "uid 7 on 0.0.0.0"]
