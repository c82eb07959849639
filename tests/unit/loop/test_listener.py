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
import subprocess
import sys
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


def test_a_request_head_that_trickles_is_cut_at_head_time_and_scrapes_still_answer(listener, monkeypatch):
    """Issue 31, item 4: one header byte every half second resets waitress's idle timeout forever; the whole head
    now gets HEAD_TIME (here 2 s). The trickle is the attack's own pace, not a wait: the test ends when the
    listener closes the connection, or fails at DEADLINE with the head still being accepted."""
    import time

    monkeypatch.setattr(server, "HEAD_TIME", 2)
    _, port = listener()
    head = b"GET /metrics HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * 200 + b"\r\n\r\n"
    cut = None
    with socket.create_connection(("127.0.0.1", port), timeout=DEADLINE) as slow:
        slow.settimeout(0.5)
        end = time.monotonic() + DEADLINE
        for i, byte in enumerate(head):
            if time.monotonic() > end:
                break
            try:
                slow.sendall(bytes([byte]))
                if slow.recv(1) == b"":
                    cut = i
                    break
            except TimeoutError:
                continue  # nothing to read yet: the pace of the trickle
            except OSError:
                cut = i
                break
            if i == 3:  # a scrape beside the trickle answers
                assert _get(port, "/healthz") == b"ok\n"
    assert cut is not None and cut < len(head) - 1, "the listener never cut the trickling head"


def _activated(listen: str, port: int) -> subprocess.Popen:
    """The real listener behind systemd-socket-activate(1), which binds 127.0.0.1:PORT, passes it as fd 3 with
    LISTEN_PID/LISTEN_FDS (sd_listen_fds(3)) and starts the program on the first connection. It serves until
    its stdin closes (the test's end)."""
    program = ("import sys\nfrom reconciler.loop.server import serve\n"
               f"s = serve({listen!r}, lambda: {{'phase': 'Converged'}})\n"
               "print('passed' if s.passed else 'bound', flush=True)\nsys.stdin.read()\n")
    return subprocess.Popen(["systemd-socket-activate", "-l", f"127.0.0.1:{port}", sys.executable, "-c", program],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_under_socket_activation_the_daemon_serves_the_socket_systemd_bound():
    """The address is owned from boot (systemd/reconciler.socket): the daemon serves the passed socket instead of
    binding `policy.listen` itself, which a local user could have bound first."""
    from testbed.proc import wait_for

    port = _free_port()
    proc = _activated(f"127.0.0.1:{port}", port)
    try:
        wait_for(lambda: _connects(port), timeout=DEADLINE, what="systemd-socket-activate's socket")
        assert _get(port, "/healthz") == b"ok\n"
        assert proc.stdout is not None and proc.stdout.readline().strip() == "passed"
    finally:
        proc.kill()
        proc.wait(timeout=DEADLINE)


def test_a_passed_socket_on_another_address_than_policy_listen_is_a_clear_error():
    port = _free_port()
    proc = _activated("127.0.0.1:9", port)
    try:
        from testbed.proc import wait_for

        wait_for(lambda: _connects(port), timeout=DEADLINE, what="systemd-socket-activate's socket")
        with contextlib.suppress(OSError):
            _get(port, "/healthz")
        _, err = proc.communicate(timeout=DEADLINE)
    finally:
        proc.kill()
    assert f"systemd passed a socket on 127.0.0.1:{port} but policy.listen is 127.0.0.1:9" in err


def _connects(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0
