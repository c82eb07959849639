"""The daemon's local HTTP listener: /metrics (Prometheus), /status (JSON for `reconciler status`), /healthz.

Bound to policy.listen, 127.0.0.1 by default: the status shows node names, paths and errors, and nothing here
needs to be reachable from another machine unless the operator says so.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from reconciler.metrics import REGISTRY


def serve(listen: str, status: Callable[[], dict]) -> ThreadingHTTPServer:
    host, _, port = listen.rpartition(":")
    host = host.strip("[]")

    class Handler(BaseHTTPRequestHandler):
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

    server_class = ThreadingHTTPServer
    if ":" in host:
        import socket

        class V6(ThreadingHTTPServer):
            address_family = socket.AF_INET6

        server_class = V6
    server = server_class((host, int(port)), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="http", daemon=True).start()
    return server
