"""`reconciler status`'s question to the daemon: ask its /status with a fresh challenge and believe only the daemon
that keeps the state dir (`status_proof`, which the daemon's server computes with the same function). The answer is
drawn by the CLI (reconciler/cli/status_screen.py); `reconciler verify` (daemon_client.py) polls through `fetch`
too.

A failure is a StatusError carrying its exit code (reconciler/core/exits.py): 1 an answer that is not the daemon's
status (not provably from the daemon of the state dir, not JSON), 5 nobody answered (connection refused, timed out).
"""

from __future__ import annotations

import hashlib
import hmac
import http.client
import json
import secrets
import ssl
import urllib.error
import urllib.request
from pathlib import Path

from reconciler.core.exits import Exit

STATUS_KEY = "status.key"  # in the daemon's state dir, 0600: what proves a /status answer comes from that daemon
TIMEOUT = 5.0  # seconds for one answer: a daemon that takes longer counts as not answering


class StatusError(Exception):
    """Why there is no status to show, and the exit code that says so."""

    def __init__(self, message: str, code: Exit) -> None:
        super().__init__(message)
        self.message, self.code = message, code


#: The response header that carries `status_proof` (the same name `daemon_client` uses for a request's proof).
PROOF_HEADER = "X-Reconciler-Proof"


def status_proof(key: bytes, challenge: str, body: bytes) -> str:
    """HMAC-SHA256, under the daemon's status key, of the caller's fresh `challenge` and the exact `body` sent:
    whoever else answers on the port (a local user who bound it first) cannot make it without reading the state
    dir, and whoever relays the daemon's answer (a listener on `[::1]:PORT` that asks the daemon) cannot change a
    byte of it and keep the proof (issue 53, G: a proof of the challenge alone let a relay forge "Converged")."""
    return hmac.new(key, b"GET /status\n" + challenge.encode() + b"\n" + body, hashlib.sha256).hexdigest()


def read_key(state_dir: Path) -> tuple[bytes | None, str | None]:
    """The daemon's status key, or why the answer will not be verified (said, not fatal: an operator who is not
    the daemon's user may still read the status)."""
    try:
        return (state_dir / STATUS_KEY).read_bytes().strip(), None
    except OSError as exc:
        return None, (f"not verified that the daemon of {state_dir} answered ({exc.strerror}: run as its user or "
                      "root)")


def fetch(url: str, key: bytes | None, state_dir: Path, timeout: float = TIMEOUT) -> object:
    """The /status answer, proven when `key` is known; StatusError otherwise: UNREACHABLE when nobody answered,
    ERROR when something answered that is not JSON or lacks the proof."""
    challenge = secrets.token_hex(16)
    where = status_url(url)
    try:
        with urllib.request.urlopen(f"{where}?challenge={challenge}", timeout=timeout) as response:
            body, proof = response.read(), response.headers.get(PROOF_HEADER)
    except urllib.error.HTTPError as exc:  # it answered, with an error: not our daemon's /status, or a bug of it
        raise StatusError(f"{where} answered HTTP {exc.code} {exc.reason}", Exit.ERROR) from exc
    except http.client.HTTPException as exc:  # something answered that does not speak HTTP (an sshd on the port)
        raise StatusError(f"{where} did not answer HTTP ({type(exc).__name__}: {exc})", Exit.ERROR) from exc
    except (urllib.error.URLError, OSError, ValueError) as exc:
        reason = exc.reason if isinstance(exc, (urllib.error.URLError, ssl.SSLError)) else exc  # what says why
        if isinstance(reason, OSError):  # refused, timed out, no route: nobody answers there
            raise StatusError(f"cannot reach the daemon at {url}: {reason}", Exit.UNREACHABLE) from exc
        raise StatusError(f"cannot ask {where}: {reason}", Exit.ERROR) from exc  # a URL urllib cannot ask
    # the proof is checked on the bytes as they came, before anything of them is believed or even parsed: a local
    # user who bound the port first once served a fake Converged, and a relay that asked the daemon for its proof
    # then changed the document passed too while the proof covered the challenge alone
    if key is not None and not (proof is not None and hmac.compare_digest(
            proof.encode(), status_proof(key, challenge, body).encode())):
        raise StatusError(f"{where} answered without the proof of the daemon that keeps {state_dir} for the bytes "
                          "it sent: another process may hold the listener's port or relay it (run the daemon under "
                          "spark-reconciler.socket, docs/operations.md), or the daemon is older than this command "
                          "(restart it)", Exit.ERROR)
    try:
        doc = json.loads(body)
    except (ValueError, RecursionError) as exc:  # RecursionError: 200,000 `[` (tests/unit/steps/test_trust_low.py)
        raise StatusError(f"cannot read the answer of {where}: {exc}", Exit.ERROR) from exc
    return doc


def status_url(url: str) -> str:
    return f"{url.rstrip('/')}/status"
