"""`reconciler status` believes only the bytes the daemon sent (issue 53, LOW G), with the exploit itself: a relay on
`[::1]:PORT` that asks the real listener, keeps its proof and changes the document. Before: the proof was HMAC(key,
challenge) inside the document, so the relay's "Converged" passed (exit 0) while the daemon said Blocked."""

from __future__ import annotations

import json
import socket
import subprocess
import threading
import urllib.request
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from reconciler.core.exits import Exit
from reconciler.edge.status_client import PROOF_HEADER, StatusError, fetch, status_proof
from reconciler.loop.server import make_status_key, serve

BLOCKED = {"phase": "Blocked", "generation": 3, "observedGeneration": 3, "conditions": [
    {"node": "", "type": "Ready", "status": "False", "reason": "Blocked", "message": "1 drifted resources"}]}


class _V6(ThreadingHTTPServer):
    address_family = socket.AF_INET6


@pytest.fixture
def daemon(tmp_path) -> Iterator[tuple[str, bytes]]:
    """The daemon's real listener (its status Blocked) with its status key in `tmp_path`: (url, key)."""
    key = make_status_key(tmp_path)
    assert key is not None
    server = serve("127.0.0.1:0", lambda: BLOCKED, key=key)
    yield f"http://127.0.0.1:{server.server_address[1]}", key
    server.shutdown()


@pytest.fixture
def relay() -> Iterator[Callable[[str, Callable[[bytes], bytes]], str]]:
    """`relay(upstream, change)`: a listener on [::1] that forwards each GET to `upstream` and answers with
    `change(body)` and every `X-Reconciler-*` header the upstream sent; yields its URL."""
    servers: list[ThreadingHTTPServer] = []

    def start(upstream: str, change: Callable[[bytes], bytes]) -> str:
        class Relay(BaseHTTPRequestHandler):
            def do_GET(self):
                with urllib.request.urlopen(upstream + self.path, timeout=10) as answer:
                    body = change(answer.read())
                    kept = [(k, v) for k, v in answer.headers.items() if k.lower().startswith("x-reconciler-")]
                self.send_response(200)
                for name, value in [("Content-Type", "application/json"), *kept]:
                    self.send_header(name, value)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        server = _V6(("::1", 0), Relay)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return f"http://[::1]:{server.server_address[1]}"

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


def converged(body: bytes) -> bytes:
    """The daemon's document, all of it kept (its proof too, wherever it is), said Converged."""
    doc = json.loads(body)
    doc["phase"] = "Converged"
    doc["conditions"][0].update(status="True", reason="Converged", message="")
    return json.dumps(doc, indent=1).encode()


def test_a_relay_that_changes_the_document_is_refused(daemon, relay, tmp_path, console_script):
    url, key = daemon
    forged = relay(url, converged)
    with pytest.raises(StatusError) as refused:
        fetch(forged, key, tmp_path)
    assert refused.value.code == Exit.ERROR
    assert f"{forged}/status answered without the proof of the daemon that keeps {tmp_path}" in refused.value.message
    cli = subprocess.run([console_script, "status", "--url", forged, "--state-dir", str(tmp_path)],
                         capture_output=True, text=True, timeout=60, check=False)
    assert cli.returncode == 1 and cli.stdout == "" and "without the proof" in cli.stderr, cli


def test_the_daemons_own_answer_passes_directly_and_through_a_faithful_relay(daemon, relay, tmp_path,
                                                                              console_script):
    url, key = daemon
    for where in (url, relay(url, lambda body: body)):
        assert fetch(where, key, tmp_path)["phase"] == "Blocked"
        cli = subprocess.run([console_script, "status", "--url", where, "--state-dir", str(tmp_path)],
                             capture_output=True, text=True, timeout=60, check=False)
        assert cli.returncode == Exit.CHANGES and "phase Blocked" in cli.stdout and cli.stderr == "", cli


def test_the_proof_is_of_the_challenge_and_the_bytes_in_a_header(daemon):
    """What the listener sends: the body as it is (no proof inside it), and the header proving it."""
    url, key = daemon
    with urllib.request.urlopen(f"{url}/status?challenge={'ab' * 16}", timeout=10) as answer:
        body, proof = answer.read(), answer.headers[PROOF_HEADER]
    assert "proof" not in json.loads(body)
    assert proof == status_proof(key, "ab" * 16, body)
    assert proof not in (status_proof(key, "ab" * 16, body + b" "), status_proof(key, "cd" * 16, body))
    with urllib.request.urlopen(f"{url}/status", timeout=10) as answer:
        assert PROOF_HEADER not in answer.headers, "no challenge, no proof"


def test_an_answer_replayed_for_another_challenge_is_refused(daemon, tmp_path):
    """A relay that keeps one genuine answer (body and proof) and serves it for every later challenge."""
    url, key = daemon
    with urllib.request.urlopen(f"{url}/status?challenge={'ab' * 16}", timeout=10) as answer:
        kept_body, kept_proof = answer.read(), answer.headers[PROOF_HEADER]

    class Replay(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.send_header(PROOF_HEADER, kept_proof)
            self.send_header("Content-Length", str(len(kept_body)))
            self.end_headers()
            self.wfile.write(kept_body)

        def log_message(self, *args):
            pass

    server = _V6(("::1", 0), Replay)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with pytest.raises(StatusError) as refused:
            fetch(f"http://[::1]:{server.server_address[1]}", key, tmp_path)
    finally:
        server.shutdown()
        server.server_close()
    assert refused.value.code == Exit.ERROR and "without the proof" in refused.value.message
