"""A real `reconciler run` process for end-to-end tests: its NOTIFY_SOCKET, its /status and /metrics, its log."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

from reconciler.loop.daemon import SHUTDOWN_DEADLINE
from testbed.proc import free_port, wait_for

CLI = str(Path(sys.executable).with_name("reconciler"))
# Scheduling slack on a loaded 2-core machine on top of the product's own deadline; a deadline to wait with, not a
# duration the test measures.
SHUTDOWN_SLACK = 5.0


def holds_for(check, seconds: float, what: str, interval: float = 0.1) -> None:
    """Assert `check()` stays true for the whole window (to prove something does NOT happen)."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        assert check(), f"{what} stopped holding after {seconds - (end - time.monotonic()):.1f}s"
        time.sleep(interval)


class Daemon:
    def __init__(self, desired: Path, state_dir: Path, *extra: str, environ: dict[str, str] | None = None):
        self.desired, self.state_dir = desired, state_dir
        self.environ = environ or {}  # added to the daemon's environment (serving.secrets' values)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.notify_path = str(state_dir / "notify.sock")
        state_dir.mkdir(parents=True, exist_ok=True)
        self.notify.bind(self.notify_path)
        self.notify.settimeout(0.2)
        self.notifications: list[str] = []
        self._reading = threading.Event()
        self._reader = threading.Thread(target=self._read_notifications, daemon=True)
        self._reader.start()
        self.log_path = state_dir / "daemon.log"
        self.extra = extra
        self.proc: subprocess.Popen | None = None

    def start(self) -> Daemon:
        env = dict(os.environ, NOTIFY_SOCKET=self.notify_path, **self.environ)
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen([CLI, "run", str(self.desired), "--state-dir", str(self.state_dir),
                                      "--listen", f"127.0.0.1:{self.port}", "--log-format", "json", *self.extra],
                                     stdout=self._log, stderr=subprocess.STDOUT, env=env)
        return self

    def _read_notifications(self) -> None:
        """Drain NOTIFY_SOCKET like systemd does (the daemon drops notifications rather than block on a full
        queue, so an unread socket would lose READY/STOPPING)."""
        while not self._reading.is_set():
            try:
                self.notifications.append(self.notify.recv(4096).decode())
            except TimeoutError:
                continue
            except OSError:
                return

    def messages(self) -> list[str]:
        return list(self.notifications)

    def status(self) -> dict | None:
        try:
            with urllib.request.urlopen(f"{self.url}/status", timeout=2) as r:
                return json.loads(r.read())
        except OSError:
            return None

    def metric(self, name: str, **labels: str) -> float:
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=2) as r:
            text = r.read().decode()
        total = 0.0
        for line in text.splitlines():
            match = re.match(rf"^{re.escape(name)}(\{{[^}}]*\}})? (\S+)$", line)
            if match and all(f'{k}="{v}"' in (match.group(1) or "") for k, v in labels.items()):
                total += float(match.group(2))
        return total

    def condition(self, node: str, type_: str) -> dict | None:
        doc = self.status() or {}
        return next((c for c in doc.get("conditions", []) if c["node"] == node and c["type"] == type_), None)

    def wait_phase(self, phase: str, timeout: float = 60) -> dict:
        return wait_for(lambda: (lambda s: s if s and s["phase"] == phase else None)(self.status()), timeout,
                          f"phase {phase} (last: {(self.status() or {}).get('phase')})")

    def log_events(self) -> list[dict]:
        out = []
        for line in self.log_path.read_text(errors="replace").splitlines():
            if line.startswith("{"):
                try:
                    out.append(json.loads(line))
                except ValueError:
                    pass
        return out

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            code = self.proc.wait(timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
            self._log.close()
        return code

    def close(self) -> None:
        """Stop the daemon as systemd does. Every test that leaves it running ends by checking the shutdown
        contract (docs/reliability.md): SIGTERM -> exit 0 within the deadline, by the orderly path (the
        product's last-resort exit prints `daemon.shutdown_forced` and every thread's stack: a stuck thread)."""
        running = self.proc is not None and self.proc.poll() is None
        try:
            code = self.stop(timeout=SHUTDOWN_DEADLINE + SHUTDOWN_SLACK)
        except subprocess.TimeoutExpired:
            code = None  # stop() killed it
        finally:
            self._reading.set()
            self._reader.join(2)
            self.notify.close()
        if running:
            assert code == 0, f"SIGTERM: exit {code}, not 0 within {SHUTDOWN_DEADLINE:g}s (+{SHUTDOWN_SLACK:g}s slack)"
            forced = self.log_path.read_text(errors="replace").count("daemon.shutdown_forced")
            assert forced == 0, f"the shutdown had to be forced: a thread was stuck (stacks in {self.log_path})"
