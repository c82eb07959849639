"""The daemon's local HTTP listener: /metrics (Prometheus), /status (JSON for `reconciler status`), /healthz.

Bound to policy.listen, 127.0.0.1 by default: the status shows node names, paths and errors, and nothing here
needs to be reachable from another machine unless the operator says so.

Any local user can still connect, so the listener is bounded (issue 16): ThreadingHTTPServer gave every connection
its own thread and no timeout (300 idle half-requests held 302 threads), and printed each error as a traceback over
many journal lines. Here one thread accepts connections and collects their request heads without blocking; only a
complete head goes to a fixed pool of WORKERS threads, which answer with a TIMEOUT on every socket operation. An
idle connection costs a file descriptor, never a thread: it is closed when it has not sent its head within TIMEOUT,
or, the oldest first, when MAX_PENDING are waiting, so a scrape still gets through. A bug answering is one JSON log
line; what clients get wrong (timeouts, resets, bad requests) is counted into one summary line a second at most.
"""

from __future__ import annotations

import io
import json
import selectors
import socket
import sys
import threading
import time
import traceback
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from reconciler import log
from reconciler.metrics import REGISTRY
from reconciler.text import printable

WORKERS = 4          # threads answering requests: a scrape takes milliseconds
TIMEOUT = 5.0        # seconds for a client to send its request head, and for each send of the answer
BACKLOG = 64         # connections the kernel queues before they are accepted
MAX_PENDING = 64     # accepted connections still sending their head; past this the oldest is closed
MAX_QUEUED = 32      # complete requests waiting for or in a worker; past this a new one is closed unanswered
MAX_HEAD = 8192      # bytes of request line and headers (a scrape sends about 200)


class Listener(HTTPServer):
    """HTTPServer whose serve_forever is a selector loop: accept, read heads, hand complete ones to the pool."""

    request_queue_size = BACKLOG

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler], family: socket.AddressFamily):
        self.address_family = family
        super().__init__(address, handler)
        self.socket.setblocking(False)
        self.pool = ThreadPoolExecutor(WORKERS, thread_name_prefix="http")
        self.queued = threading.BoundedSemaphore(MAX_QUEUED)
        self.dropped: Counter[str] = Counter()
        self.lock = threading.Lock()
        self.log = log.get("reconciler.server")
        self._stop = threading.Event()
        self._stopped = threading.Event()

    def serve_forever(self, poll_interval: float = 0.5) -> None:
        pending: dict[socket.socket, tuple[float, bytearray, tuple]] = {}   # in accept order: oldest first
        reported = 0.0
        with selectors.DefaultSelector() as sel:
            sel.register(self.socket, selectors.EVENT_READ)
            try:
                while not self._stop.is_set():
                    for key, _ in sel.select(poll_interval):
                        if key.fileobj is self.socket:
                            self._accept(sel, pending)
                        else:
                            self._read(sel, pending, key.fileobj)  # type: ignore[arg-type]
                    now = time.monotonic()
                    for conn in [c for c, (deadline, _, _) in pending.items() if deadline < now]:
                        self._drop(sel, pending, conn, "timeout")
                    if self.dropped and now - reported >= 1:
                        reported = now
                        with self.lock:
                            counts, self.dropped = dict(self.dropped), Counter()
                        self.log.warning("http.client_problems", **counts)
            finally:
                for conn in pending:
                    conn.close()
                self._stopped.set()

    def _accept(self, sel: selectors.BaseSelector, pending: dict) -> None:
        """Every connection the kernel has queued (a burst beyond BACKLOG would wait for a SYN retry, 1 s)."""
        while True:
            try:
                conn, address = self.socket.accept()
            except BlockingIOError:
                return
            except OSError:   # gone before accepted, or out of file descriptors: wait a little, do not spin
                self._stop.wait(0.05)
                return
            conn.setblocking(False)
            sel.register(conn, selectors.EVENT_READ)
            pending[conn] = (time.monotonic() + TIMEOUT, bytearray(), address)
            if len(pending) > MAX_PENDING:
                self._drop(sel, pending, next(iter(pending)), "evicted")

    def _read(self, sel: selectors.BaseSelector, pending: dict, conn: socket.socket) -> None:
        if conn not in pending:   # evicted by an accept earlier in the same round
            return
        try:
            chunk = conn.recv(MAX_HEAD)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            chunk = b""
        _, head, address = pending[conn]
        head += chunk
        if not chunk:
            self._drop(sel, pending, conn, None)   # the client closed (or reset) its end: nothing to say
        elif b"\r\n\r\n" in head or b"\n\n" in head:
            sel.unregister(conn)
            del pending[conn]
            if self.queued.acquire(blocking=False):
                self.pool.submit(self._answer, conn, bytes(head), address)
            else:
                self.count("busy")
                conn.close()
        elif len(head) > MAX_HEAD:
            self._drop(sel, pending, conn, "too_large")

    def _drop(self, sel: selectors.BaseSelector, pending: dict, conn: socket.socket, why: str | None) -> None:
        sel.unregister(conn)
        del pending[conn]
        conn.close()
        if why:
            self.count(why)

    def count(self, why: str) -> None:
        with self.lock:
            self.dropped[why] += 1

    def _answer(self, conn: socket.socket, head: bytes, address: tuple) -> None:
        """In a worker: what socketserver's process_request_thread does, with the head already read."""
        try:
            self.finish_request((conn, head), address)  # type: ignore[arg-type]
        except OSError:   # the client went away or stopped reading (TIMEOUT): counted, not logged one by one
            self.count("client_error")
        except Exception:  # noqa: BLE001 - a bug answering (status() raised): one line, then the next request
            self.handle_error(conn, address)
        finally:
            self.queued.release()
            self.shutdown_request(conn)

    def handle_error(self, request: object, client_address: object) -> None:
        """One JSON line with the exception and where it was raised, instead of socketserver's traceback."""
        exc = sys.exc_info()[1]
        frame = traceback.extract_tb(exc.__traceback__)[-1] if exc and exc.__traceback__ else None
        self.log.error("http.error", error=printable(f"{type(exc).__name__}: {exc}"),
                       where=f"{Path(frame.filename).name}:{frame.lineno}" if frame else None)

    def shutdown(self) -> None:
        """Stop serve_forever and wait for it (within poll_interval), like socketserver's."""
        self._stop.set()
        self._stopped.wait()

    def server_close(self) -> None:
        super().server_close()
        self.pool.shutdown(wait=False, cancel_futures=True)


def serve(listen: str, status: Callable[[], dict]) -> Listener:
    """Listen on `listen` (HOST:PORT, IPv6 as [::1]:PORT) in a thread of its own; `.shutdown()` then
    `.server_close()` stop it."""
    host, _, port = listen.rpartition(":")
    host = host.strip("[]")

    class Handler(BaseHTTPRequestHandler):
        timeout = TIMEOUT

        def setup(self) -> None:
            """The request is (socket, head): the listener read the head already; the answer goes to the socket."""
            self.request, head = self.request
            super().setup()
            self.rfile.close()
            self.rfile = io.BytesIO(head)

        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0]
            if path == "/metrics":
                body, kind = generate_latest(REGISTRY), CONTENT_TYPE_LATEST
            elif path == "/status":
                body, kind = json.dumps(status(), indent=1).encode(), "application/json"
            elif path == "/healthz":
                body, kind = b"ok\n", "text/plain"
            else:
                self.send_error(404)
                return
            self.send_response(200)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:  # scrapes every 15 s would flood the journal
            pass

        def log_error(self, *args) -> None:  # a bad request line, a 404, a send past TIMEOUT: counted
            server.count("bad_request")

    server = Listener((host, int(port)), Handler, socket.AF_INET6 if ":" in host else socket.AF_INET)
    threading.Thread(target=server.serve_forever, name="http", daemon=True).start()
    return server
