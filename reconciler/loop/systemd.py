"""sd_notify without libsystemd: READY=1, STATUS=, WATCHDOG=1, STOPPING=1 as datagrams to $NOTIFY_SOCKET.

A leading `@` in the socket name means the Linux abstract namespace (systemd uses it for some services); both
forms are handled. Outside systemd (no NOTIFY_SOCKET) every call is a cheap no-op.
"""

from __future__ import annotations

import os
import socket


def _address() -> str | bytes | None:
    name = os.environ.get("NOTIFY_SOCKET")
    if not name:
        return None
    return b"\0" + name[1:].encode() if name.startswith("@") else name


def notify(*fields: str) -> bool:
    """Send `KEY=VALUE` lines in one datagram; True when it was delivered.

    Never blocks: a receiver that stopped reading (full queue) or vanished loses a notification rather than
    stalling the reconcile loop (which would then also stop the watchdog pings)."""
    address = _address()
    if address is None:
        return False
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC | socket.SOCK_NONBLOCK) as sock:
        try:
            sock.sendto("\n".join(fields).encode(), address)
        except OSError:
            return False
    return True


def ready(status: str) -> bool:
    return notify("READY=1", f"STATUS={status}")


_last_status: dict[str, str] = {}


def status(text: str) -> bool:
    """STATUS=, sent only when it changed (a 1 s resync must not flood the manager)."""
    key = os.environ.get("NOTIFY_SOCKET", "")
    if _last_status.get(key) == text:
        return True
    _last_status[key] = text
    return notify(f"STATUS={text}")


def watchdog() -> bool:
    return notify("WATCHDOG=1")


def stopping() -> bool:
    return notify("STOPPING=1", "STATUS=stopping")


def watchdog_interval() -> float | None:
    """Half of WatchdogSec (as systemd advises), when the watchdog is on for this very process."""
    usec = os.environ.get("WATCHDOG_USEC")
    pid = os.environ.get("WATCHDOG_PID")
    if not usec or (pid and pid != str(os.getpid())):
        return None
    return int(usec) / 1e6 / 2
