"""The daemon's local HTTP listener: /metrics (Prometheus), /status (JSON for `reconciler status`), /healthz.

Bound to policy.listen, 127.0.0.1 by default: the status shows node names, paths and errors, and nothing here
needs to be reachable from another machine unless the operator says so.

Any local user can still connect, so the listener is bounded (issue 16). ThreadingHTTPServer gave every connection
its own thread and no timeout (300 idle half-requests held 302 threads) and printed each error as a traceback over
many journal lines. The app is served by waitress instead of being written here: one thread runs its event loop
and reads request heads without blocking, a fixed pool of WORKERS threads answers complete requests, an idle
connection holds a file descriptor and never a thread, and is closed after TIMEOUT (waitress's channel_timeout).
An error while answering is one JSON log line and a 500; waitress's own messages go to the same log, one line each.
"""

from __future__ import annotations

import json
import logging
import threading
import traceback
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from prometheus_client import make_wsgi_app
from waitress import wasyncore
from waitress.server import create_server

from reconciler.core.text import printable
from reconciler.edge import log
from reconciler.loop.metrics import REGISTRY

WORKERS = 4         # threads answering requests: a scrape takes milliseconds
TIMEOUT = 5         # seconds an idle or half-sent connection is kept
CONNECTIONS = 512   # open connections before waitress stops accepting more (each costs a descriptor, no thread)
BACKLOG = 64        # connections the kernel queues before they are accepted
MAX_HEAD = 8192     # bytes of request line and headers (a scrape sends about 200)

_log = log.get("reconciler.loop.server")


class _OneLine(logging.Handler):
    """waitress's stdlib log records as one structlog line each (no traceback spread over the journal)."""

    def emit(self, record: logging.LogRecord) -> None:
        kind, exc = (record.exc_info or (None, None, None))[:2]
        error = f"{kind.__name__}: {exc}" if kind else None
        _log.warning("http.server", message=printable(record.getMessage()), level=record.levelname.lower(),
                     error=printable(error) if error else None)


def _route_waitress_log() -> None:
    logger = logging.getLogger("waitress")
    if not any(isinstance(h, _OneLine) for h in logger.handlers):
        logger.addHandler(_OneLine())
    logger.propagate = False
    logger.setLevel(logging.WARNING)   # "Serving on ..." and the like are not news
    logging.getLogger("waitress.queue").setLevel(logging.ERROR)   # "Task queue depth": requests wait, as meant


def _app(status: Callable[[], dict]) -> Callable[..., Iterable[bytes]]:
    metrics = make_wsgi_app(REGISTRY)

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "")
        try:
            if path == "/metrics":
                return metrics(environ, start_response)
            if path == "/status":
                body, kind = json.dumps(status(), indent=1).encode(), "application/json"
            elif path == "/healthz":
                body, kind = b"ok\n", "text/plain"
            else:
                start_response("404 Not Found", [("Content-Type", "text/plain")])
                return [b"not found\n"]
        except Exception as exc:  # noqa: BLE001 - a bug answering (status() raised): one line, a 500, go on
            frame = traceback.extract_tb(exc.__traceback__)[-1] if exc.__traceback__ else None
            _log.error("http.error", path=printable(path), error=printable(f"{type(exc).__name__}: {exc}"),
                       where=f"{Path(frame.filename).name}:{frame.lineno}" if frame else None)
            start_response("500 Internal Server Error", [("Content-Type", "text/plain")])
            return [b"internal error\n"]
        start_response("200 OK", [("Content-Type", kind), ("Content-Length", str(len(body)))])
        return [body]

    return app


class Listener:
    """The running server: `server_address`, then `.shutdown()` and `.server_close()` as with socketserver."""

    def __init__(self, listen: str, status: Callable[[], dict]):
        _route_waitress_log()
        self._server = create_server(
            _app(status), listen=listen, threads=WORKERS, channel_timeout=TIMEOUT, cleanup_interval=1,
            connection_limit=CONNECTIONS, backlog=BACKLOG, max_request_header_size=MAX_HEAD,
            max_request_body_size=MAX_HEAD, ident="spark-reconciler", expose_tracebacks=False)
        self._thread = threading.Thread(target=self._server.run, name="http", daemon=True)
        self._thread.start()

    @property
    def server_address(self) -> tuple[str, int]:
        return self._server.effective_host, self._server.effective_port

    def shutdown(self) -> None:
        """Close every connection and the listening socket: the event loop ends with an empty map."""
        self._server.task_dispatcher.shutdown()
        wasyncore.close_all(self._server._map)
        self._thread.join(5)

    def server_close(self) -> None:
        pass  # shutdown() closed the socket already


def serve(listen: str, status: Callable[[], dict]) -> Listener:
    """Listen on `listen` (HOST:PORT, IPv6 as [::1]:PORT) in a thread of its own."""
    return Listener(listen, status)
