"""Talk to the `ray` stand-in head (the 'GCS'): find its address like `ray.init(address='auto')` does."""

from __future__ import annotations

import os

from common import JsonObject, LineConn, connect

NO_CLUSTER = (
    "ConnectionError: Could not find any running Ray instance. Please specify the one to connect to by setting "
    "`--address` flag or `RAY_ADDRESS` environment variable."
)


class RayError(Exception):
    pass


def ray_tmpdir() -> str:
    return os.environ.get("RAY_TMPDIR") or "/tmp/ray"


def cluster_file() -> str:
    return os.path.join(ray_tmpdir(), "ray_current_cluster")


def find_address(address: str | None = None) -> tuple[str, int]:
    addr = address or os.environ.get("RAY_ADDRESS") or "auto"
    if addr == "auto":
        try:
            with open(cluster_file()) as f:
                addr = f.read().strip()
        except OSError:
            raise RayError(NO_CLUSTER) from None
    addr = addr.removeprefix("ray://")
    host, _, port = addr.rpartition(":")
    try:
        return host.strip("[]"), int(port)
    except ValueError:
        raise RayError(f"ValueError: invalid Ray address {addr!r}") from None


def ray_request(msg: JsonObject, address: str | None = None, timeout: float = 5.0) -> JsonObject:
    host, port = find_address(address)
    try:
        sock = connect(host, port, timeout=min(timeout, 5.0))
    except OSError as e:
        raise RayError(
            f"ConnectionError: Failed to connect to GCS at address {host}:{port} within {int(timeout)} seconds "
            f"({e.strerror or e}). " + NO_CLUSTER.split(". ", 1)[0] + "."
        ) from None
    conn = LineConn(sock)
    try:
        conn.send(msg)
        try:
            reply = conn.recv(timeout)
        except TimeoutError:
            reply = None
        if reply is None:
            raise RayError(f"ConnectionError: GCS at {host}:{port} closed the connection")
        if reply.get("op") == "error":
            raise RayError(reply.get("error", "error"))
        return reply
    finally:
        conn.close()
