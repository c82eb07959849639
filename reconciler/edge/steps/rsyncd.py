"""The weights' fabric transport: a one-time rsync daemon on the target's fabric address, for one step.

Over SSH, one core's cipher caps a stream (~0.45 GB/s on a Spark; here the two ends' ciphers cost 2.1 CPU seconds
per GB against the daemon's 0.4: docs/benchmarks.md). The fabric is a dedicated cable between the nodes and the
bytes are public weights, so confidentiality is not needed there; authentication is, and integrity: rsync's
challenge-response with a secret made for this step alone (never sent, sha512 of it and a fresh challenge), its
whole-file checksum of every file, then the manifest check of the step. What listens, and for how long:
`rsyncd_helper` (run on the target) binds the target's fabric address only, on a port the kernel picks, hands
each connection from the source's fabric address to an `rsync --daemon` that serves it and exits, until one daemon
per stream ended well (a stranger's connection is refused and counted; a daemon that failed frees its slot; only a
connection that authenticates holds one: one from the source's address that stays silent is dropped, refused and
counted after `rsyncd_helper.PREAUTH` seconds, issue 53); it ends them all when the step closes its SSH channel
(done, failed, cancelled) or at the step's deadline.
docs/research/weights-transport.md has the reasons, from rsync's source.
"""

from __future__ import annotations

import secrets
from collections.abc import Generator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from reconciler.edge.steps.actions import Action, Actions, Given, Report, Start, StepFailed, Stop
from reconciler.edge.steps.rsyncd_helper import MODULE, USER

_HELPER = Path(__file__).with_name("rsyncd_helper.py").read_text()


@dataclass(frozen=True)
class Door:
    """Where the source's rsync clients connect, and with what."""

    address: str
    port: int
    secret: str = ""

    def url(self) -> str:
        return f"rsync://{USER}@{self.address}:{self.port}/{MODULE}/"

    def __repr__(self) -> str:  # the secret never in a log line or a traceback
        return f"Door({self.address}:{self.port})"


def _port(line: str | None) -> int | None:
    """The port from the helper's first line (`port N`), or None for anything else a node might print."""
    word = (line or "").split()
    if len(word) == 2 and word[0] == "port" and word[1].isdigit() and 0 < int(word[1]) < 65536:
        return int(word[1])
    return None


def start_daemon(given: Given, source: str, target: str, root: str,
                 streams: int) -> Generator[Action, Any, tuple[Start, Door]]:
    """Run the one-time daemon on `target` for `streams` connections from `source`, writing below `root`: the
    helper and the door its clients use. Its secret is made here for this step alone and travels on stdin only.
    Stopping it with `close` (or the step's end) ends whatever still runs there (partial data kept for the
    resume); `confirm` it once every client succeeded."""
    bind, peer = (str(given.desired.node(n).fabric.address.ip) for n in (target, source))
    secret = secrets.token_urlsafe(32)
    helper = Start(target, ("python3", "-c", _HELPER, bind, peer, str(streams), root,
                            str(int(given.desired.policy.timeouts.weights_sync))), stdin=f"{secret}\n".encode())
    first = yield helper
    port = _port(first)
    if port is None:
        said = yield Stop(helper, "finish")
        raise StepFailed(f"the rsync daemon on {target} did not start (exit {said.exit_code}): "
                         f"{(said.stderr or first or 'no output').strip()[-600:]}")
    return helper, Door(bind, port, secret)


def confirm(helper: Start) -> Actions:
    """Wait for the helper to report that every daemon ended well (they exit right after their client)."""
    said = yield Stop(helper, "finish")
    if said.exit_code != 0:
        raise StepFailed(f"the rsync daemon on {helper.node} ended with exit {said.exit_code}: "
                         f"{said.stderr.strip()[-800:]}")
    strangers = refused_from(said.stderr)
    if strangers:  # the step went on; the operator still hears that someone knocked (one log line): another
        # address, or the source's own that never authenticated
        yield Report("weights.refused", {"node": helper.node, "connections": len(strangers),
                                         "from": sorted(set(strangers))[:10]})


def refused_from(stderr: str) -> list[str]:
    """The addresses the helper refused (`refused a connection from ADDR (N refused)`), one per connection; only
    dotted IPv4 addresses are taken from a node's text."""
    out: list[str] = []
    for line in stderr.splitlines():
        words = line.split()
        if line.startswith("refused a connection from ") and len(words) > 4:
            addr = words[4]
            if len(addr) <= 15 and addr.count(".") == 3 and all(p.isdigit() for p in addr.split(".")):
                out.append(addr)
    return out
