"""The HTTP answers to `POST /verify` (beside server.py, which authenticates the request): 400 for a request that
is not one, 409 with a `reason` when this daemon cannot take it, 202 with the request's id when it did.
reconciler/edge/daemon_client.py reads the reasons, so their words are an interface.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from reconciler.core import spec
from reconciler.edge.verify import targets

Json = dict[str, object]
Answer = tuple[int, Json]


@dataclass(frozen=True)
class Asked:
    """A verify request this daemon may take: repair or not, the node it names (None: all), the nodes it checks."""

    repair: bool
    node: str | None
    targets: list[str]


def judge(doc: Json, keeps: Path, desired: spec.Desired | None, pid: int) -> Asked | Answer:
    """The request as this daemon (pid `pid`, keeping the file `keeps` with `desired` in force) can take it, or the
    refusal to answer."""
    file, repair, only = doc.get("file"), doc.get("repair"), doc.get("node")
    if not isinstance(file, str) or not isinstance(repair, bool) or not (only is None or isinstance(only, str)):
        return 400, {"error": "a verify request names file (a path), repair (true or false) and node (a name "
                              "or null)"}
    if os.path.realpath(file) != os.path.realpath(keeps):
        return 409, {"reason": "other-file", "pid": pid,
                     "error": f"the cluster is held by the daemon pid {pid}, which keeps {keeps}, not {file}"}
    refused = _refused(desired, repair)
    if refused is not None:
        return refused
    assert desired is not None
    nodes = targets(desired, only)
    if only is not None and not nodes:
        return 400, {"error": f"{only} is not a node to verify: the serving nodes but the source "
                              f"({desired.source_node}) are: {', '.join(targets(desired)) or 'none'}"}
    return Asked(repair, only, nodes)


def _refused(desired: spec.Desired | None, repair: bool) -> Answer | None:
    """Why the desired state in force takes no such verify (409), or None."""
    if desired is None:
        return 409, {"reason": "no-desired-state", "error": "the daemon has no valid desired state in force"}
    if len(desired.deployments) > 1:
        return 409, {"reason": "several-deployments", "error": "a verify compares one model's copies with its "
                     "source: a file of several deployments is not verified yet"}
    if repair and (desired.policy.mode != "enforce" or desired.policy.paused):
        return 409, {"reason": "not-enforcing", "error": "the daemon does not enforce (policy.mode "
                     f"{desired.policy.mode}, paused {str(desired.policy.paused).lower()}): a repair is not its"}
    return None


def busy(why: str) -> Answer:
    """Another verify runs and this one cannot join it."""
    return 409, {"reason": "busy", "error": why}


def accepted(request_id: str, joined: bool, asked: Asked, pid: int) -> Answer:
    return 202, {"id": request_id, "joined": joined, "targets": asked.targets, "pid": pid}
