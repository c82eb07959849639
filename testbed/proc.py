"""Running commands, waiting for conditions, and the pid registry that makes ``down`` exact.

Every long-lived process the testbed starts is recorded (pid + kernel start time) in STATE/pids.json, so
``down`` kills exactly those processes and never something that happens to reuse a pid. Waits poll a
condition until a deadline instead of sleeping for a guessed time.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypedDict, TypeVar, overload

from .layout import state_dir

T = TypeVar("T")


class TestbedError(RuntimeError):
    pass


class PidEntry(TypedDict):
    """One process of the pid registry: its pid and kernel start time (None when it was already gone)."""

    pid: int
    starttime: int | None


@overload
def run(cmd: Sequence[str], *, check: bool = True, input: str | None = None, timeout: float = 120,
        capture: bool = True, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]: ...


@overload
def run(cmd: Sequence[str], *, check: bool = True, input: bytes, timeout: float = 120,
        capture: bool = True, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[bytes]: ...


def run(cmd: Sequence[str], *, check: bool = True, input: str | bytes | None = None, timeout: float = 120,
        capture: bool = True, env: dict[str, str] | None = None
        ) -> subprocess.CompletedProcess[str] | subprocess.CompletedProcess[bytes]:
    """Run a command; on failure raise TestbedError with its stderr (the message one needs to debug)."""
    text = not isinstance(input, bytes)
    p = subprocess.run(list(cmd), input=input, capture_output=capture, text=text, timeout=timeout,
                       env=env, check=False)
    if check and p.returncode != 0:
        err = p.stderr if capture else ""
        raise TestbedError(f"{' '.join(map(str, cmd))!s} -> exit {p.returncode}: {str(err).strip()[-2000:]}")
    return p


def ok(cmd: Sequence[str], timeout: float = 30) -> bool:
    try:
        return subprocess.run(list(cmd), capture_output=True, timeout=timeout, check=False).returncode == 0
    except subprocess.TimeoutExpired:
        return False


def wait_for(cond: Callable[[], T], timeout: float = 15.0, what: str = "condition", *,
             interval: float | None = None) -> T:
    """Poll *cond* until it returns a truthy value or *timeout* seconds pass (then TestbedError): the one wait of
    the testbed, the tests and the bench. A condition may raise until it holds (a port not yet listening); a
    TestbedError (it can never hold: the daemon died) or an AssertionError (a test's check failed) from it ends
    the wait at once. Without `interval`, the polls start at 50 ms and slow to 0.5 s (a node's dockerd takes
    seconds); with one, they keep it (a test acting right after a step boundary must not act late).

    The product has its own wait (`reconciler.edge.steps.wait_for`: cancellable, never swallowing an error); the
    harness does not borrow it, so a bug there cannot hide in the tests that judge it."""
    deadline = time.monotonic() + timeout
    pause = interval if interval is not None else 0.05
    last_exc: Exception | None = None
    while True:
        try:
            v = cond()
            if v:
                return v
        except (TestbedError, AssertionError):
            raise                 # it can never hold (the daemon died), or a test's check inside it failed
        except Exception as e:  # noqa: BLE001 - the condition may fail until it holds
            last_exc = e
        if time.monotonic() > deadline:
            raise TestbedError(f"timed out after {timeout:g}s waiting for {what}"
                               + (f" (last error: {last_exc})" if last_exc else ""))
        time.sleep(pause)
        pause = pause if interval is not None else min(pause * 1.5, 0.5)


def free_port() -> int:
    """A loopback TCP port nobody listens on now (the kernel's choice), for a process the harness starts."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


# ---- pid registry -------------------------------------------------------------------------------------------

def _registry() -> Path:
    return state_dir() / "pids.json"


def _starttime(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])


def alive(pid: int, starttime: int | None = None) -> bool:
    st = _starttime(pid)
    if st is None:
        return False
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    if state == "Z":
        return False
    return starttime is None or st == starttime


def load_pids() -> dict[str, PidEntry]:
    try:
        pids: dict[str, PidEntry] = json.loads(_registry().read_text())
        return pids
    except (OSError, ValueError):
        return {}


def record_pid(name: str, pid: int) -> None:
    reg = load_pids()
    reg[name] = {"pid": pid, "starttime": _starttime(pid)}
    _registry().parent.mkdir(parents=True, exist_ok=True)
    tmp = _registry().with_suffix(".tmp")
    tmp.write_text(json.dumps(reg, indent=1))
    tmp.replace(_registry())


def forget_pid(name: str) -> None:
    reg = load_pids()
    if reg.pop(name, None) is not None:
        tmp = _registry().with_suffix(".tmp")
        tmp.write_text(json.dumps(reg, indent=1))
        tmp.replace(_registry())


def recorded_alive(name: str) -> int | None:
    e = load_pids().get(name)
    if e and alive(e["pid"], e.get("starttime")):
        return e["pid"]
    return None


def stop_pid(pid: int, starttime: int | None = None, *, timeout: float = 15) -> None:
    """SIGTERM, wait up to *timeout*, then SIGKILL; reap if it is our child."""
    if not alive(pid, starttime):
        return
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        wait_for(lambda: _reap(pid) or not alive(pid, starttime), timeout=timeout, what=f"pid {pid} to exit")
    except TestbedError:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            return
        wait_for(lambda: _reap(pid) or not alive(pid, starttime), timeout=10, what=f"pid {pid} to die")


def _reap(pid: int) -> bool:
    try:
        done, _ = os.waitpid(pid, os.WNOHANG)
        return done == pid
    except ChildProcessError:
        return False


def stop_recorded(name: str, *, timeout: float = 15) -> None:
    e = load_pids().get(name)
    if e:
        stop_pid(e["pid"], e.get("starttime"), timeout=timeout)
        forget_pid(name)


def spawn(name: str, cmd: Sequence[str], *, log: Path, env: dict[str, str] | None = None) -> int:
    """Start a daemon in its own session (so it outlives this Python process) and record its pid."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as f:
        p = subprocess.Popen(list(cmd), stdin=subprocess.DEVNULL, stdout=f, stderr=subprocess.STDOUT,
                             start_new_session=True, env=env, close_fds=True)
    record_pid(name, p.pid)
    return p.pid
