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
    """Send `KEY=VALUE` lines in one datagram; True when a socket was there to receive it."""
    address = _address()
    if address is None:
        return False
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
        sock.sendto("\n".join(fields).encode(), address)
    return True


def ready(status: str) -> bool:
    return notify("READY=1", f"STATUS={status}")


def status(text: str) -> bool:
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
