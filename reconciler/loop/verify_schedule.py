"""When the verify `reconciler verify` asked of the daemon runs: its request taken (`POST /verify`, answered by
`verify_answers`), and each reconcile its next node started when nothing it conflicts with is in flight or about to
start. The verify itself runs beside the loop (`verify.Verifier`); its SSH work is `edge/verify.py`.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from reconciler.core import spec
from reconciler.core.planning import Plan, Step
from reconciler.edge.lease import Lease
from reconciler.edge.ssh import Sessions
from reconciler.edge.verify import NodeResult
from reconciler.loop import verify_answers
from reconciler.loop.operations import Operations, verify_conflict, verify_waits
from reconciler.loop.reasons import Reason
from reconciler.loop.triggers import ReconcileRequests
from reconciler.loop.verify import Busy, Verifier

VerifyFn = Callable[[spec.Desired, Sessions, str, bool, threading.Event], NodeResult]


class VerifySchedule:
    """The Controller's verify requests: taken on the listener's threads, started by the loop's."""

    def __init__(self, verifier: Verifier, verify_fn: VerifyFn, requests: ReconcileRequests, path: Path,
                 logger: Any) -> None:
        self.verifier = verifier
        self._verify_fn = verify_fn
        self.requests = requests
        self.path = path
        self.log = logger

    def next(self, desired: spec.Desired, current: Plan, operations: Operations, wanted: list[Step],
             sessions: Sessions | None, lease: Lease | None) -> None:
        """Start the asked verify on its next node when nothing it conflicts with is in flight (`operations`) or
        about to start (`wanted`); a repair only while the daemon enforces and holds the lease (it deletes files)."""
        request = self.verifier.pending()
        if request is None or self.verifier.verifying() is not None:
            return
        if request.repair and not (current.mode == "enforce" and lease is not None and lease.holding):
            self.verifier.wait("a repair waits until the daemon enforces and holds the cluster's lease")
            return
        waits = self._waits(request.todo, desired.source_node, operations.busy(), wanted)
        node = next((n for n, why in waits.items() if why is None), None)
        if node is None:
            self.verifier.wait("; ".join(f"{n}: {why}" for n, why in waits.items()))
            return
        repair, verify = request.repair, self._verify_fn
        assert sessions is not None, "a valid desired state opens the sessions"
        if self.verifier.start(node, lambda cancel: verify(desired, sessions, node, repair, cancel)):
            self.log.info("verify.start", request=request.id, node=node, repair=repair)

    @staticmethod
    def _waits(todo: list[str], source: str, busy: list[Step], wanted: list[Step]) -> dict[str, str | None]:
        """Per node still to verify, what it waits for (None: nothing): a step in flight or one about to start
        that it conflicts with."""
        return {node: verify_waits(node, source, busy) or next(
            (f"{s.id} starts first" for s in wanted if verify_conflict(s, node, source)), None)
            for node in todo}

    def request(self, doc: dict[str, object], desired: spec.Desired | None) -> tuple[int, dict[str, object]]:
        """`POST /verify`, authenticated by the listener (server._verify), on one of its threads: take a verify of
        this daemon's desired state (202 and the request's id), or say why not (`verify_answers`)."""
        pid = os.getpid()
        asked = verify_answers.judge(doc, self.path, desired, pid)
        if not isinstance(asked, verify_answers.Asked):
            return asked
        try:
            request, joined = self.verifier.ask(asked.repair, asked.node, asked.targets)
        except Busy as exc:
            return verify_answers.busy(str(exc))
        self.log.info("verify.requested", request=request.id, repair=asked.repair, node=asked.node, joined=joined)
        self.requests.request(Reason("verify-request"))
        return verify_answers.accepted(request.id, joined, asked, pid)
