"""A squatted serving port and forged sections (issue 31, HIGH 2), with the exploit itself: a real HTTP server run
as `nobody` on the serving port while vLLM is down, the probe's real API script run by a real sh and curl. Before:
the key arrived in the server's requests and a body line `@@containers` opened a forged section."""

from __future__ import annotations

import json
import os
import socket
import subprocess

import pytest

from reconciler.core.drift import diff
from reconciler.core.loader import load_file
from reconciler.core.planning import plan
from reconciler.core.spec import Desired
from reconciler.edge.facts.base import sealed, split_sections
from reconciler.edge.facts.serving import api_script, parse_serving
from testbed.proc import wait_for
from tests.unit import recorded

KEY = "sk-squat-test-0123456789"
NOBODY = 65534
# Answers every GET/POST with 200 and a body that tries to open sections of its own; prints each request's
# Authorization header (or "-") to stdout.
SERVER = r"""
import sys
from http.server import BaseHTTPRequestHandler, HTTPServer
FORGED = b'{"data": [{"id": "x"}]}\n@@containers\nAPI []\n@@rc 0\n@@meminfo\nMemTotal: 1 kB\n@@rc 0\n'
class H(BaseHTTPRequestHandler):
    def answer(self):
        print(self.path, self.headers.get("Authorization", "-"), flush=True)
        self.send_response(200); self.end_headers(); self.wfile.write(FORGED)
    do_GET = do_POST = answer
    def log_message(self, *a): pass
HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


@pytest.fixture
def desired(cluster_yaml):
    data = load_file(cluster_yaml).data
    data["serving"]["port"] = free_port()
    data["serving"]["secrets"] = {"VLLM_API_KEY": "head"}
    return Desired.model_validate(data).with_secrets({"VLLM_API_KEY": KEY})


def serve(port: int, user: int | None) -> subprocess.Popen:
    # the system python: nobody may run it (the venv lives under root's home); the server needs only the stdlib
    proc = subprocess.Popen(["/usr/bin/python3", "-c", SERVER, str(port)], stdout=subprocess.PIPE, text=True,
                            user=user, cwd="/")
    wait_for(lambda: listening(port), timeout=30, what="the squatter's listener")
    return proc


def probe(desired: Desired) -> dict:
    script = sealed(api_script(desired))
    out = subprocess.run(["sh", "-s"], input=script.script, capture_output=True, text=True, timeout=60,
                         check=True).stdout
    return split_sections(out, script.nonce)


def probe_beside(desired: Desired, user: int | None) -> tuple[dict, list[str]]:
    """The probe's API sections with a server run as `user` on the serving port, and the requests it saw."""
    server = serve(desired.serving.port, user)
    try:
        sections = probe(desired)
    finally:
        server.terminate()
        out, _ = server.communicate(timeout=30)
    return sections, out.splitlines()


def test_a_squatter_on_the_serving_port_gets_no_key_and_is_named(desired):
    sections, seen = probe_beside(desired, NOBODY)
    assert not [line for line in seen if KEY in line], seen
    assert not [line for line in seen if "/v1/" in line], "the squatter was asked for models or a completion"
    serving = parse_serving(sections.get("health"), sections.get("models"), None, sections.get("completion"),
                            sections.get("engine"), sections.get("port_owner"))
    assert serving.port_holder == NOBODY and not serving.serves("x")
    cluster = recorded.load()
    observed = recorded.changed(recorded.observe(cluster), cluster.head.name, serving=serving)
    health = [d for d in diff(cluster, observed) if d.kind == "health"]
    assert health and f"held by uid {NOBODY}" in health[0].observed and "no API key" in health[0].observed
    assert health[0].blocking and not health[0].actionable
    assert not [s for s in plan(cluster, observed).steps if s.kind in ("stop-serving", "start-serving")], \
        "nothing of ours is stopped for a port someone else holds"


def test_a_body_cannot_open_or_close_a_section(desired):
    """Our own serving (root) answering with marker lines in its bodies: they stay body lines."""
    sections, seen = probe_beside(desired, None)
    assert any(KEY in line for line in seen), "our own serving is asked, with its key"
    assert "containers" not in sections and "meminfo" not in sections
    assert "@@containers" in sections["models"].body
    assert json.loads(sections["models"].body.splitlines()[0]) == {"data": [{"id": "x"}]}


def test_the_nonce_is_fresh_and_in_no_argv(desired):
    first, second = sealed(api_script(desired)), sealed(api_script(desired))
    assert first.nonce != second.nonce and len(first.nonce) == 32
    assert first.nonce not in " ".join(api_script(desired)) and os.environ.get("SEAL") is None
