"""How the tests make a controller: with a manager of its own (the daemon builds one and hands it over; a
controller never makes it), shaped by `events` (the nodes' event streams) and `sessions_factory` (fakes)."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from reconciler.edge.ssh import Sessions
from reconciler.loop.controller import Controller
from reconciler.loop.manager import Manager, SessionsFactory
from reconciler.loop.triggers import ReconcileRequests


def make_controller(path: Path, state_dir: Path, requests: ReconcileRequests, cancel: threading.Event,
                    events: bool = True, sessions_factory: SessionsFactory = Sessions, **kwargs: Any) -> Controller:
    manager = Manager(Path(path), requests, events=events, sessions_factory=sessions_factory)
    return Controller(path, state_dir, requests, cancel, manager=manager, **kwargs)
