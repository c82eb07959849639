"""The daemon's local HTTP listener: /metrics (Prometheus), /status (JSON for `reconciler status`), /healthz.

Bound to policy.listen, 127.0.0.1 by default: the status shows node names, paths and errors, and nothing here
needs to be reachable from another machine unless the operator says so.

Any local user can still connect, so the listener is bounded (issue 16). ThreadingHTTPServer gave every connection
its own thread and no timeout (300 idle half-requests held 302 threads) and printed each error as a traceback over
many journal lines. The app is served by waitress instead of being written here: one thread runs its event loop
and reads request heads without blocking, a fixed pool of WORKERS threads answers complete requests, an idle
connection holds a file descriptor and never a thread, and is closed after TIMEOUT (waitress's channel_timeout).
An error while answering is one JSON log line and a 500; waitress's own messages go to the same log, one line each.

Two more bounds (issue 31, item 4). A request's line and headers get HEAD_TIME in all, however they trickle:
waitress's timeout is an idle one, and 512 connections sending one header byte every 2 s kept /metrics and /status
from answering. And the socket can be owned from boot: under systemd socket activation (`ListenStream=`,
systemd/reconciler.socket) the daemon serves the socket systemd bound and passed (sd_listen_fds(3): fd 3,
LISTEN_PID, LISTEN_FDS), so no local user can bind `policy.listen` first while the daemon restarts.

One request acts (issue 33, item 4): `POST /verify` has the daemon verify the weights and, with `repair`, remove the
files that differ. Any local user can connect, so it must prove that its sender can read the daemon's status key
(the state dir, 0600: the daemon's user and root): its body carries a challenge the daemon issued (`POST
/verify/challenge`, good once and for CHALLENGE_LIFE seconds, `Challenges`), and the header `X-Reconciler-Proof`
its HMAC-SHA256 under that key (`daemon_client.request_proof`). A request without it, with another, or heard once
and sent again, is refused (401) and starts nothing. The same header on a `/status?challenge=HEX` answer proves
that answer: HMAC-SHA256 of the challenge and the very body sent (`status_client.status_proof`), so a relay on
another address of the port can change no byte of it (issue 53, G).
"""

from __future__ import annotations

import hmac
import json
import logging
import os
import re
import secrets
import socket
import threading
import time
import traceback
from collections import OrderedDict
from collections.abc import Callable, Iterable
from http import HTTPStatus
from pathlib import Path
from typing import Any

from prometheus_client import make_wsgi_app
from waitress import wasyncore
from waitress.server import create_server

from reconciler.core.text import printable
from reconciler.edge import log
from reconciler.edge.daemon_client import PROOF_HEADER, request_proof
from reconciler.edge.status_client import STATUS_KEY, status_proof
from reconciler.loop.generations import write_durably
from reconciler.loop.metrics import REGISTRY

WORKERS = 4         # threads answering requests: a scrape takes milliseconds
TIMEOUT = 5         # seconds an idle or half-sent connection is kept
CONNECTIONS = 512   # open connections before waitress stops accepting more (each costs a descriptor, no thread)
BACKLOG = 64        # connections the kernel queues before they are accepted
MAX_HEAD = 8192     # bytes of request line and headers (a scrape sends about 200)
HEAD_TIME = 10      # seconds a request's line and headers may take in all (a scrape sends them in one packet)
LISTEN_FDS_START = 3  # sd_listen_fds(3): the first passed descriptor

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


CHALLENGE = re.compile(r"challenge=([0-9a-f]{32,128})(?:&|$)")


def make_status_key(state_dir: Path) -> bytes | None:
    """A fresh status key for this daemon's life, written 0600 into the state dir; None when it cannot be (a
    read-only state dir: `status` then says it could not check whom it asked)."""
    key = secrets.token_hex(32).encode()
    try:
        write_durably(state_dir / STATUS_KEY, key.decode())
    except OSError:
        return None
    return key


#: A verify request's answer: HTTP status and JSON document (the controller's `verify_request`).
Json = dict[str, object]
VerifyHandler = Callable[[Json], tuple[int, Json]]
CHALLENGE_LIFE = 60.0  # seconds a verify challenge is good for (the command uses it at once)
CHALLENGES = 64  # outstanding verify challenges; beyond, the oldest is forgotten


class Challenges:
    """The challenges the daemon issued for verify requests, each good once and for CHALLENGE_LIFE seconds (the
    monotonic clock): a request heard on the way cannot be sent again, and no clock the operator steps matters.
    A flood of asks only forgets the oldest ones (a command whose challenge went asks again)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._issued: OrderedDict[str, float] = OrderedDict()

    def issue(self) -> str:
        challenge = secrets.token_hex(16)
        with self._lock:
            self._issued[challenge] = self._clock() + CHALLENGE_LIFE
            while len(self._issued) > CHALLENGES:
                self._issued.popitem(last=False)
        return challenge

    def take(self, challenge: object) -> bool:
        """Whether `challenge` was issued and is still good; spent either way."""
        with self._lock:
            until = self._issued.pop(challenge, None) if isinstance(challenge, str) else None
        return until is not None and self._clock() < until


def _verify(environ: dict[str, Any], key: bytes | None, challenges: Challenges,
            handler: VerifyHandler | None) -> tuple[int, Json]:
    """`POST /verify`: the handler's answer for a request proven with the status key; a refusal otherwise."""
    if handler is None or key is None:
        return 503, {"error": "this daemon takes no verify request: it has no status key (its state dir is not "
                              "writable)"}
    try:
        body = environ["wsgi.input"].read(int(environ.get("CONTENT_LENGTH") or 0))
        doc = json.loads(body)
    except (ValueError, RecursionError):
        return 400, {"error": "the body is not JSON"}
    if not isinstance(doc, dict):
        return 400, {"error": "the body is not a JSON object"}
    if not challenges.take(doc.get("challenge")):
        return _refused("unknown, expired or spent challenge (each is good once: ask /verify/challenge anew)")
    proof = environ.get("HTTP_" + PROOF_HEADER.upper().replace("-", "_"), "")
    if not hmac.compare_digest(proof.encode(), request_proof(key, body).encode()):
        return _refused(f"no proof of the daemon's status key ({PROOF_HEADER}): only its user and root may ask")
    return handler(doc)


def _refused(why: str) -> tuple[int, Json]:
    _log.warning("verify.refused", reason=why)
    return 401, {"error": why}


def _answer(environ: dict[str, Any], status: Callable[[], Json], key: bytes | None, challenges: Challenges,
            verify: VerifyHandler | None) -> tuple[int, str, bytes] | None:
    """The answer to one request (status, content type, body); None for /metrics, which prometheus answers."""
    path, method = environ.get("PATH_INFO", ""), environ.get("REQUEST_METHOD", "GET")
    if path == "/metrics":
        return None
    if path == "/status":  # proven by `app`, over the very bytes sent (`status_proof`)
        return 200, "application/json", json.dumps(status(), indent=1).encode()
    if path == "/healthz":
        return 200, "text/plain", b"ok\n"
    if path in ("/verify/challenge", "/verify") and method != "POST":
        return 405, "text/plain", b"POST only\n"
    if path == "/verify/challenge":
        return 200, "application/json", json.dumps({"challenge": challenges.issue()}).encode()
    if path == "/verify":
        code, doc = _verify(environ, key, challenges, verify)
        return code, "application/json", json.dumps(doc).encode()
    return 404, "text/plain", b"not found\n"


def _app(status: Callable[[], Json], key: bytes | None = None, verify: VerifyHandler | None = None,
         challenges: Challenges | None = None) -> Callable[..., Iterable[bytes]]:
    metrics = make_wsgi_app(REGISTRY)
    challenges = challenges or Challenges()

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "")
        try:
            answer = _answer(environ, status, key, challenges, verify)
            if answer is None:
                served: Iterable[bytes] = metrics(environ, start_response)
                return served
        except Exception as exc:  # noqa: BLE001 - a bug answering (status() raised): one line, a 500, go on
            frame = traceback.extract_tb(exc.__traceback__)[-1] if exc.__traceback__ else None
            _log.error("http.error", path=printable(path), error=printable(f"{type(exc).__name__}: {exc}"),
                       where=f"{Path(frame.filename).name}:{frame.lineno}" if frame else None)
            start_response("500 Internal Server Error", [("Content-Type", "text/plain")])
            return [b"internal error\n"]
        code, kind, body = answer
        headers = [("Content-Type", kind), ("Content-Length", str(len(body)))]
        asked = CHALLENGE.search(environ.get("QUERY_STRING", "")) if path == "/status" else None
        if asked and key is not None:  # the challenge and the body: a relay can change neither (issue 53, G)
            headers.append((PROOF_HEADER, status_proof(key, asked.group(1), body)))
        start_response(f"{code} {HTTPStatus(code).phrase}", headers)
        return [body]

    return app


class ListenMismatch(RuntimeError):
    """systemd passed a socket on another address than `policy.listen`."""


def passed_socket(listen: str, named: str = "policy.listen") -> socket.socket | None:
    """The socket systemd bound for this process (socket activation), or None when none was passed. It must be on
    `listen` (what `named` says): two places naming the address must agree, or the operator is told which to
    change."""
    if os.environ.get("LISTEN_PID") != str(os.getpid()) or not os.environ.get("LISTEN_FDS", "").isdigit():
        return None
    if int(os.environ["LISTEN_FDS"]) < 1:
        return None
    sock = socket.socket(fileno=LISTEN_FDS_START)
    host, port = sock.getsockname()[:2]
    want_host, _, want_port = listen.rpartition(":")
    if (host, str(port)) != (want_host.strip("[]"), want_port):
        raise ListenMismatch(f"systemd passed a socket on {host}:{port} but {named} is {listen}: make "
                             f"ListenStream= in spark-reconciler.socket and {named} name the same address")
    for name in ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES"):
        os.environ.pop(name, None)  # not for the children (sd_listen_fds' unset_environment)
    return sock


def _bound_head_time(server: Any) -> None:
    """Close a connection whose request line and headers are still coming HEAD_TIME after they began: waitress's
    `channel_timeout` is reset by every byte, so a trickle of one byte a second never ends it. Runs in waitress's
    own maintenance (every `cleanup_interval` s, in its event loop's thread): the first time a channel is seen
    with a half-read head starts its clock; a completed head (or a new request) ends it."""
    heads: dict[Any, tuple[Any, float]] = {}
    idle_timeout = server.maintenance

    def maintenance(now: float) -> None:
        idle_timeout(now)
        active = server.active_channels
        for channel in list(heads):
            if channel not in active.values():
                del heads[channel]
        for channel in list(active.values()):
            request = channel.request
            if request is None or request.headers_finished:
                heads.pop(channel, None)
                continue
            seen = heads.get(channel)
            if seen is None or seen[0] is not request:
                heads[channel] = (request, now)
            elif now - seen[1] > HEAD_TIME:
                channel.will_close = True

    server.maintenance = maintenance


class Listener:
    """The running server: `server_address`, then `.shutdown()` and `.server_close()` as with socketserver."""

    def __init__(self, listen: str, status: Callable[[], Json], named: str = "policy.listen",
                 key: bytes | None = None, verify: VerifyHandler | None = None):
        _route_waitress_log()
        passed = passed_socket(listen, named)
        where: dict[str, Any] = {"sockets": [passed]} if passed is not None else {"listen": listen}
        self._server = create_server(
            _app(status, key, verify), **where, threads=WORKERS, channel_timeout=TIMEOUT, cleanup_interval=1,
            connection_limit=CONNECTIONS, backlog=BACKLOG, max_request_header_size=MAX_HEAD,
            max_request_body_size=MAX_HEAD, ident="spark-reconciler", expose_tracebacks=False)
        self.passed = passed is not None
        _bound_head_time(self._server)
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._run, name="http", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        """waitress's event loop. `shutdown` closes its sockets from another thread, and a `select` then still
        waiting on them raises EBADF: the end asked for, not an error (it printed a traceback at every stop)."""
        try:
            self._server.run()
        except OSError:
            if not self._closing.is_set():
                raise

    @property
    def server_address(self) -> tuple[str, int]:
        return self._server.effective_host, self._server.effective_port

    def shutdown(self) -> None:
        """Close every connection and the listening socket: the event loop ends with an empty map."""
        self._closing.set()
        self._server.task_dispatcher.shutdown()
        wasyncore.close_all(self._server._map)
        self._thread.join(5)

    def server_close(self) -> None:
        pass  # shutdown() closed the socket already


def serve(listen: str, status: Callable[[], Json], named: str = "policy.listen",
          key: bytes | None = None, verify: VerifyHandler | None = None) -> Listener:
    """Listen on `listen` (HOST:PORT, IPv6 as [::1]:PORT; `named`: where it was given) in a thread of its own;
    `key` proves its /status answers (`status_proof`) and authenticates the verify requests `verify` answers."""
    return Listener(listen, status, named, key, verify)
