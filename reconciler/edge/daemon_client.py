"""`reconciler verify` through the running daemon: the client side of `POST /verify` (reconciler/loop/server.py).

The weekly timer's `reconciler verify --repair` could not succeed beside the daemon: a repair needs the cluster's
lease, which the daemon holds while it enforces, so it exited 4 every week. Now the command asks the daemon, which
runs the verify as a low-priority operation beside its loop (reconciler/loop/verify.py), and waits for its result:

1. `POST /verify/challenge`: a fresh challenge, good once. Nobody listening (connection refused): `NoDaemon`, and
   the command verifies by itself, as before (a repair takes the lease itself).
2. `POST /verify`, a JSON body (the challenge, the desired-state file, repair, node) with its HMAC-SHA256 under the
   daemon's status key (`request_proof`, header `X-Reconciler-Proof`). The key is in the daemon's state dir, 0600:
   only the daemon's user and root can read it, so only they can have the daemon verify, let alone repair. A
   request heard once cannot be sent again: its challenge is spent.
3. `/status?challenge=...` every POLL seconds, each answer proven to be that daemon's (`status_client.fetch`), until
   the request's record there says done; its results decide the exit code (`exit_code`).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import ssl
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from reconciler.core.exits import Exit
from reconciler.core.text import printable
from reconciler.edge.status_client import PROOF_HEADER as PROOF_HEADER  # a request's and an answer's, one name
from reconciler.edge.status_client import STATUS_KEY, StatusError, fetch

POLL = 2.0  # seconds between two looks at /status while the daemon verifies
LOST_AFTER = 30.0  # seconds without an answer while waiting: the daemon is gone (a restart answers within them)
WAIT = 6 * 3600.0  # the default deadline for the result (`verify --wait`)
TIMEOUT = 5.0  # seconds for one answer


def request_proof(key: bytes, body: bytes) -> str:
    """HMAC-SHA256 of a verify request's body (its challenge included) under the daemon's status key: what only the
    daemon's user and root can make (docs/security.md, "Who can have the daemon verify")."""
    return hmac.new(key, b"POST /verify\n" + body, hashlib.sha256).hexdigest()


class NoDaemon(Exception):
    """Nothing listens at the daemon's address: verify here."""


class Declined(Exception):
    """The daemon will not run this verify (a repair while it does not enforce, no desired state in force): verify
    here, where a repair takes the lease itself."""


class Failed(Exception):
    """No result, and the exit code that says why."""

    def __init__(self, message: str, code: Exit) -> None:
        super().__init__(message)
        self.message, self.code = message, code


def exit_code(results: Sequence[Mapping[str, Any]]) -> Exit:
    """The verify's exit code from its per-node results (reconciler/edge/verify.py: `outcome`): an error of any kind
    first (a tree not fully compared, a failed command, a cancelled verify), then a node not reached, then files that
    differ (repaired or not: a repair only removes them, the daemon's next sync copies them again), else 0."""
    outcomes = {r.get("outcome") for r in results}
    if outcomes - {"match", "differ", "unreachable"}:
        return Exit.ERROR
    if "unreachable" in outcomes:
        return Exit.UNREACHABLE
    return Exit.CHANGES if "differ" in outcomes else Exit.OK


def verify_by_daemon(url: str, state_dir: Path, file: str, *, repair: bool, only: str | None, wait: float = WAIT,
                     say: Callable[[str], None] = lambda line: None, sleep: Callable[[float], None] = time.sleep,
                     monotonic: Callable[[], float] = time.monotonic) -> list[dict[str, Any]]:
    """Have the daemon at `url` (keeping `state_dir`) verify `file`'s weights and return its per-node results;
    `say` gets a line whenever the request's state changes (waiting, running on a node). NoDaemon, Declined or
    Failed otherwise (module docstring)."""
    base = url.rstrip("/")
    challenge = _challenge(base)
    key = _key(state_dir, base)
    body = json.dumps({"challenge": challenge, "file": os.path.abspath(file), "repair": repair,
                       "node": only}).encode()
    try:
        code, answer = _post(f"{base}/verify", body, {PROOF_HEADER: request_proof(key, body)})
    except NoDaemon as exc:
        raise Failed(f"the daemon at {base} went away: {exc}", Exit.UNREACHABLE) from None
    request = _accepted(base, code, answer)
    say(f"verify request {request} accepted by the daemon at {base} (pid {answer.get('pid')})")
    return _wait(base, state_dir, request, monotonic() + wait, say, sleep, monotonic)


def _post(url: str, body: bytes, headers: dict[str, str]) -> tuple[int, dict[str, Any]]:
    request = urllib.request.Request(url, data=body, method="POST",
                                     headers={"Content-Type": "application/json", **headers})
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT) as response:
            return response.status, _json(response.read())
    except urllib.error.HTTPError as exc:  # it answered, with a refusal: the body says why
        return exc.code, _json(exc.read())
    except (urllib.error.URLError, OSError) as exc:
        reason = exc.reason if isinstance(exc, (urllib.error.URLError, ssl.SSLError)) else exc  # what says why
        if isinstance(reason, ConnectionRefusedError):
            raise NoDaemon(f"nothing listens at {url}") from None
        raise Failed(f"cannot reach the daemon at {url}: {reason}", Exit.UNREACHABLE) from None


def _json(body: bytes) -> dict[str, Any]:
    try:
        doc = json.loads(body)
    except (ValueError, RecursionError):
        return {}
    return doc if isinstance(doc, dict) else {}


def _challenge(base: str) -> str:
    code, answer = _post(f"{base}/verify/challenge", b"", {})
    challenge = answer.get("challenge")
    if code == 200 and isinstance(challenge, str):
        return challenge
    if code == 404:
        raise Failed(f"the daemon at {base} takes no verify requests: it is older than this command (restart it: "
                     "systemctl restart spark-reconciler)", Exit.ERROR)
    raise Failed(f"{base}/verify/challenge answered HTTP {code}: {printable(str(answer.get('error')))}", Exit.ERROR)


def _key(state_dir: Path, base: str) -> bytes:
    """The daemon's status key, read anew each time (a restarted daemon has a new one)."""
    try:
        return (state_dir / STATUS_KEY).read_bytes().strip()
    except OSError as exc:
        raise Failed(f"the daemon at {base} runs, but its status key {state_dir / STATUS_KEY} cannot be read "
                     f"({exc.strerror}): only the daemon's user and root can have it verify; run as one of them "
                     "(or name its state dir: --state-dir)", Exit.ERROR) from None


def _accepted(base: str, code: int, answer: dict[str, Any]) -> str:
    """The request's id, or why there is none: Declined (verify here) or Failed."""
    request = answer.get("id")
    if code == 202 and isinstance(request, str):
        return request
    error = printable(str(answer.get("error") or f"HTTP {code}"))
    if code == 409 and answer.get("reason") in ("not-enforcing", "no-desired-state"):
        raise Declined(error)
    if code == 409:  # another verify in progress, or a daemon that keeps another file: held by another actor
        raise Failed(error, Exit.HELD)
    raise Failed(f"the daemon at {base} refused the verify request: {error}", Exit.ERROR)


def _wait(base: str, state_dir: Path, request: str, deadline: float, say: Callable[[str], None],
          sleep: Callable[[float], None], monotonic: Callable[[], float]) -> list[dict[str, Any]]:
    """Poll the proven /status until the request is done; Failed when the daemon stops answering for LOST_AFTER,
    forgets the request (it restarted), or the deadline passes first."""
    lost_since: float | None = None
    said = ""
    while True:
        now = monotonic()
        try:
            doc = fetch(base, _key(state_dir, base), state_dir, TIMEOUT)
        except StatusError as exc:
            if exc.code != Exit.UNREACHABLE:
                raise Failed(exc.message, exc.code) from None
            lost_since = now if lost_since is None else lost_since
            if now - lost_since >= LOST_AFTER:
                raise Failed(f"the daemon stopped answering while verify request {request} ran: {exc.message}",
                             Exit.UNREACHABLE) from None
        else:
            lost_since = None
            record = _record(doc, request)
            if record.get("state") == "done":
                return [r for r in record.get("results") or [] if isinstance(r, dict)]
            if (line := _progress(request, record)) != said:
                say(line)
                said = line
        if now >= deadline:
            raise Failed(f"no result within the deadline; the daemon goes on with verify request {request} "
                         "(`reconciler status` shows it)", Exit.ERROR)
        sleep(POLL)


def _record(doc: object, request: str) -> dict[str, Any]:
    records = doc.get("verifyRequests") if isinstance(doc, dict) else None
    found = next((r for r in records or [] if isinstance(r, dict) and r.get("id") == request), None)
    if found is None:
        raise Failed(f"the daemon no longer knows verify request {request} (it restarted?): no result will come",
                     Exit.ERROR)
    return found


def _progress(request: str, record: dict[str, Any]) -> str:
    if record.get("running"):
        return f"verify request {request}: verifying {printable(str(record['running']))}"
    waiting = record.get("waiting")
    return f"verify request {request}: " + (f"waiting: {printable(str(waiting))}" if waiting else "queued")
