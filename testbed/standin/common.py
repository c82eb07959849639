"""Bits shared by the stand-in programs (vllm, ray, cotenant). Stdlib only: they run inside the minimal image."""

from __future__ import annotations

import http.server
import json
import os
import signal
import socket
import socketserver
import sys
import threading
import time
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

#: A JSON object as the stand-ins exchange them: a LineConn message, an HTTP request or response body.
JsonObject = dict[str, Any]
#: What `QuietHandler.reply` sends: JSON (an object or a list), text, or bytes as they are (None: empty).
Body = JsonObject | list[Any] | str | bytes | None


class Terminated(BaseException):
    """Raised in the main thread by SIGTERM/SIGINT (the programs are PID 1 in their containers)."""


def install_signal_handlers() -> None:
    def handler(signum: int, frame: FrameType | None) -> None:
        raise Terminated(signum)

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)


_log_lock = threading.Lock()


def log(level: str, where: str, msg: str) -> None:
    """A vLLM-style line: ``INFO 12-02 15:30:01 [api_server.py:1090] message``."""
    stamp = time.strftime("%m-%d %H:%M:%S")
    with _log_lock:
        for line in str(msg).splitlines() or [""]:
            sys.stdout.write(f"{level} {stamp} [{where}] {line}\n")
        sys.stdout.flush()


def raw(line: str) -> None:
    """A line printed as is (tracebacks, uvicorn lines)."""
    with _log_lock:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()


def raw_part(text: str) -> None:
    """Text printed as is with no newline of its own: a tqdm bar redrawn in place (`\r`)."""
    with _log_lock:
        sys.stdout.write(text)
        sys.stdout.flush()


def env_float(name: str, default: float) -> float:
    try:
        return float(os.environ.get(name, default))
    except ValueError:
        return default


def env_int(name: str, default: int) -> int:
    try:
        return int(os.environ.get(name, default))
    except ValueError:
        return default


class LineConn:
    """JSON-lines over a TCP socket, thread-safe sends, reads with a timeout."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self._send_lock = threading.Lock()
        self._buf = b""
        self.closed = False

    def send(self, obj: JsonObject) -> bool:
        data = (json.dumps(obj) + "\n").encode()
        with self._send_lock:
            try:
                self.sock.sendall(data)
                return True
            except OSError:
                self.closed = True
                return False

    def recv(self, timeout: float | None) -> JsonObject | None:
        """Next message; None on EOF/error; raises TimeoutError if nothing arrived within timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self._buf:
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError
                self.sock.settimeout(left)
            else:
                self.sock.settimeout(None)
            try:
                chunk = self.sock.recv(65536)
            except TimeoutError:
                raise TimeoutError from None
            except OSError:
                self.closed = True
                return None
            if not chunk:
                self.closed = True
                return None
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        try:
            msg: JsonObject = json.loads(line)
            return msg
        except ValueError:
            return {"op": "garbage"}

    def close(self) -> None:
        self.closed = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


def heartbeats(conn: LineConn, interval: float, peer_timeout: float) -> Iterator[JsonObject | None]:
    """Yield the peer's messages while pinging it every `interval`; yield None (and stop) once it has been
    silent for `peer_timeout` or closed the connection: how the stand-ins notice a dead peer, like NCCL/Ray do."""
    last_sent, last_heard = 0.0, time.monotonic()
    while True:
        now = time.monotonic()
        if now - last_sent >= interval:
            conn.send({"op": "ping"})
            last_sent = now
        try:
            msg = conn.recv(min(interval, peer_timeout))
        except TimeoutError:
            if time.monotonic() - last_heard <= peer_timeout:
                continue
            msg = None
        yield msg
        if msg is None:
            return
        last_heard = time.monotonic()


def listen(host: str, port: int) -> socket.socket:
    s = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        s.bind((host, port))
        s.listen(64)
    except OSError:
        s.close()
        raise
    return s


def connect(host: str, port: int, timeout: float = 2.0) -> socket.socket:
    s = socket.create_connection((host, port), timeout=timeout)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


class HTTPServer(socketserver.ThreadingMixIn, http.server.HTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    address_family = socket.AF_INET


class HTTPServer6(HTTPServer):
    address_family = socket.AF_INET6


class QuietHandler(http.server.BaseHTTPRequestHandler):
    """Uvicorn-like access lines; subclasses implement do_GET/do_POST with reply()."""

    server_version = "uvicorn"
    sys_version = ""
    protocol_version = "HTTP/1.1"
    access_log = True

    def reply(self, code: int, body: Body, ctype: str = "application/json") -> None:
        if isinstance(body, (dict, list)):
            data = json.dumps(body).encode()
        elif isinstance(body, str):
            data = body.encode()
        else:
            data = body or b""
        self.send_response(code)
        self.send_header("content-type", ctype)
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def read_json(self) -> JsonObject | None:
        n = int(self.headers.get("content-length") or 0)
        if not n:
            return {}
        try:
            doc: JsonObject = json.loads(self.rfile.read(n))
            return doc
        except ValueError:
            return None

    def log_request(self, code: int | str = "-", size: int | str = "-") -> None:
        if not self.access_log:
            return
        try:
            phrase = http.HTTPStatus(int(code)).phrase
        except (ValueError, TypeError):
            phrase = ""
        raw(f'INFO:     {self.client_address[0]}:{self.client_address[1]} - "{self.requestline}" {code} {phrase}')

    def log_message(self, format: str, *args: Any) -> None:  # the signature it overrides
        pass


def serve_http(host: str, port: int, handler_cls: type[http.server.BaseHTTPRequestHandler]) -> HTTPServer:
    """Bind and serve in a daemon thread. Raises OSError when the address is taken."""
    cls = HTTPServer6 if ":" in host else HTTPServer
    srv = cls((host, port), handler_cls)
    threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.2}, daemon=True).start()
    return srv


def sleep_until(pred: Callable[[], bool], timeout: float, step: float = 0.1) -> bool:
    """Bounded polling used by the programs themselves."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(step)
    return pred()
