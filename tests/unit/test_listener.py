"""Issue 16, finding 8: the daemon's HTTP listener under hostile local clients (loopback traffic only).

ThreadingHTTPServer gave every connection a thread and no timeout: 200 idle half-requests held 200 threads, and an
error answering printed a multi-line traceback. Now (waitress) idle connections hold no thread, a scrape still
answers beside them, and what goes wrong is one JSON log line.
"""

from __future__ import annotations

import contextlib
import io
import json
import socket
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest
import structlog

from reconciler.edge import log
from reconciler.loop import server
from reconciler.loop.server import serve

DEADLINE = 30.0


def _get(port: int, path: str) -> bytes:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=DEADLINE) as answer:
        return answer.read()


@pytest.fixture
def listener():
    started: list = []

    def start(status=lambda: {"phase": "Converged"}):
        started.append(serve("127.0.0.1:0", status))
        return started[-1], started[-1].server_address[1]

    yield start
    for s in started:
        s.shutdown()
        s.server_close()


@contextlib.contextmanager
def stderr_text() -> Iterator[io.StringIO]:
    """What the daemon's log (JSON lines) and anything else (a traceback) write to stderr, in the test's body: pytest
    sets its own sys.stderr again between a fixture's set-up and the test."""
    saved = structlog.get_config()
    with contextlib.redirect_stderr(io.StringIO()) as err:
        log.configure(json_lines=True)
        try:
            yield err
        finally:
            structlog.configure(**saved)


def test_idle_half_requests_hold_no_threads_and_scrapes_still_answer(listener):
    baseline = threading.active_count()
    _, port = listener()
    idle = []
    try:
        for _ in range(200):
            conn = socket.create_connection(("127.0.0.1", port), timeout=DEADLINE)
            conn.sendall(b"GET /healthz HTTP/1.1\r\nHost: loc")   # half a request head, never finished
            idle.append(conn)
        # accepted in order: once these answer, every idle connection above was accepted (and, in the old
        # listener, had its own thread)
        assert _get(port, "/healthz") == b"ok\n"
        assert json.loads(_get(port, "/status")) == {"phase": "Converged"}
        threads = threading.active_count()
    finally:
        for conn in idle:
            conn.close()
    # the accepting thread, a pool of 4 workers, slack: a bound that does not grow with the connections
    assert threads <= baseline + 8, f"{threads} threads with 200 idle connections"


def test_an_error_answering_is_one_json_line_without_traceback(listener):
    def status() -> dict:
        raise RuntimeError("controller state\nunreadable")

    _, port = listener(status)
    with stderr_text() as err, pytest.raises((urllib.error.URLError, ConnectionError)):   # closed unanswered
        _get(port, "/status")
    text = err.getvalue()
    assert "Traceback" not in text
    lines = text.splitlines()
    assert len(lines) == 1, text
    entry = json.loads(lines[0])
    assert entry["event"] == "http.error" and entry["error"] == "RuntimeError: controller state\\x0aunreadable"
    assert entry["where"].startswith("test_listener.py:")
    assert _get(port, "/healthz") == b"ok\n", "the worker serves the next request"


def test_a_half_request_is_closed_after_the_timeout_without_a_traceback(listener, monkeypatch):
    monkeypatch.setattr(server, "TIMEOUT", 1)   # the old listener had none: recv waited DEADLINE, then failed
    _, port = listener()
    with stderr_text() as err, socket.create_connection(("127.0.0.1", port), timeout=DEADLINE) as conn:
        conn.sendall(b"GET /status HT")
        assert conn.recv(100) == b"", "the listener closed the connection unanswered"
    assert "Traceback" not in err.getvalue()
