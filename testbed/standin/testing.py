"""Helpers for tests that run the stand-in programs as host processes on loopback (never any other address)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
PROGRAMS = {"vllm": HERE / "vllm_standin.py", "ray": HERE / "ray_standin.py", "cotenant": HERE / "cotenant.py"}

FAST_ENV = {
    "STANDIN_NODE_MEMORY_BYTES": str(64 << 20),  # on the host, not in a testbed node: a small pretend node
    "STANDIN_LOAD_DELAY_S": "0.1",
    "STANDIN_HEARTBEAT_S": "0.2",
    "STANDIN_PEER_TIMEOUT_S": "2",
    "VLLM_ENGINE_READY_TIMEOUT_S": "20",
    "STANDIN_RAY_PG_TIMEOUT_S": "1",
    "STANDIN_RAY_CONNECT_TIMEOUT_S": "10",
    "HF_HUB_OFFLINE": "1",
}


def http_get(url: str, timeout: float = 2.0) -> tuple[int, str]:
    """(status, body); status 0 when nothing answers."""
    assert url.startswith("http://127.0.0.1:"), "tests talk to loopback only"
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
    except (OSError, urllib.error.URLError):
        return 0, ""


def http_post(url: str, body: bytes, timeout: float = 2.0) -> tuple[int, str]:
    assert url.startswith("http://127.0.0.1:")
    req = urllib.request.Request(url, data=body, headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


class Proc:
    """A stand-in program running on the host, output to a log file; always stopped by stop()."""

    def __init__(self, program: str, args: list[str], tmp: Path, env: dict[str, str] | None = None,
                 name: str | None = None):
        self.name = name or program
        self.log = Path(tmp) / f"{self.name}.log"
        full_env = {k: v for k, v in os.environ.items() if not k.startswith(("STANDIN_", "HF_", "RAY_", "VLLM_"))}
        full_env.update(FAST_ENV)
        full_env.update(env or {})
        with open(self.log, "wb") as f:
            self.p = subprocess.Popen([sys.executable, str(PROGRAMS[program]), *args], stdout=f,
                                      stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=full_env)

    @property
    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def wait(self, timeout: float = 20.0) -> int:
        return self.p.wait(timeout)

    def alive(self) -> bool:
        return self.p.poll() is None

    def terminate(self) -> None:
        if self.p.poll() is None:
            self.p.send_signal(signal.SIGTERM)

    def stop(self) -> None:
        if self.p.poll() is None:
            self.p.send_signal(signal.SIGTERM)
            try:
                self.p.wait(5)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait(5)
