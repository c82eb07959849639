"""The full weight verification's SSH work: one target's sha256 comparison as its result, and the command's own
verify without a daemon. The loop (`reconciler.loop.verify`) only schedules these beside its steps.

A node's result is one dict, what `verify --json` prints and the daemon's /status keeps: `Verification`'s fields,
`outcome` (match, differ, problem, unreachable, error, cancelled), `message` and `error`.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import asdict

from reconciler.core.spec import Desired
from reconciler.edge.lease import Holder, held
from reconciler.edge.ssh import Cancelled, RemoteError, Sessions, Unreachable
from reconciler.edge.steps.weights import Verification, verify_weights

#: Bound of each hashing command (the target's tree, then the source's files not in its cache).
HASH_TIMEOUT = 3600.0

NodeResult = dict[str, object]


def targets(desired: Desired, only: str | None = None) -> list[str]:
    """The nodes a verify compares with the source: every serving node but the source, or `only` among them."""
    return [n.name for n in desired.serving_nodes if n.name != desired.source_node and only in (None, n.name)]


def node_result(v: Verification) -> NodeResult:
    outcome = "match" if v.ok else ("problem" if v.problem else "differ")
    return {**asdict(v), "outcome": outcome, "message": v.message(), "error": None}


def failed_result(node: str, outcome: str, why: str) -> NodeResult:
    return {"node": node, "outcome": outcome, "message": f"{node}: not verified: {why}", "error": why}


def verify_node(desired: Desired, sessions: Sessions, node: str, repair: bool,
                cancel: threading.Event | None = None) -> NodeResult:
    """One target's verification as its result: a node that cannot be reached, or a command that fails, is that
    node's result, never an exception that loses the others'. Cancelled (`cancel` set) is raised: the caller
    decides whether that node is verified later (a yield) or not at all."""
    try:
        return node_result(verify_weights(desired, sessions, node, repair=repair, timeout=HASH_TIMEOUT,
                                          cancel=cancel))
    except Cancelled:
        raise
    except Unreachable as exc:
        return failed_result(node, "unreachable", exc.message)
    except RemoteError as exc:
        return failed_result(node, "error", exc.message)


def verify_here(desired: Desired, holder: Holder, only: str | None, repair: bool) -> list[NodeResult]:
    """The command's own verify, without a daemon: a repair takes the cluster's lease first (LeaseHeld otherwise:
    nothing is hashed or removed)."""
    sessions = Sessions(desired)
    try:
        with contextlib.ExitStack() as stack:
            if repair:  # repairing deletes files on the nodes: one actor at a time (reconciler.edge.lease)
                stack.enter_context(held(desired, sessions, holder))
            return [verify_node(desired, sessions, node, repair) for node in targets(desired, only)]
    finally:
        sessions.close()
