"""`python -m testbed demo` (the body of `make demo`): watch the reconciler converge a simulated two-Spark cluster.

seed testbed -> `reconciler plan` -> `reconciler run` in the background (console log) -> Converged (status table,
metrics URL) -> fabric link down on the worker -> detected and repaired -> daemon stopped with SIGTERM. The
testbed stays up for poking around (`make demo-down` removes it). Ctrl-C at any point stops the daemon and brings
the testbed down. Every wait has a deadline; nothing sleeps a fixed time where a condition can be polled.
"""
from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from . import api
from .proc import TestbedError, wait_for

REPO = Path(__file__).resolve().parents[1]
DESIRED = REPO / "desired-state" / "testbed.yaml"
URL = "http://127.0.0.1:9464"
LOCK = "/run/spark-testbed.lock"


def _cli() -> str:
    exe = Path(sys.executable).with_name("reconciler")
    return str(exe) if exe.exists() else "reconciler"


def say(text: str) -> None:
    print(f"\n\033[1m==> {text}\033[0m", flush=True)


def status() -> dict[str, Any] | None:
    try:
        with urllib.request.urlopen(f"{URL}/status", timeout=2) as r:
            doc: dict[str, Any] = json.loads(r.read())
            return doc
    except (OSError, ValueError):
        return None


def phase_is(*phases: str) -> Callable[[], dict[str, Any] | None]:
    def check() -> dict[str, Any] | None:
        doc = status()
        return doc if doc and doc.get("phase") in phases else None
    return check


class Daemon:
    def __init__(self, state_dir: str):
        self.proc = subprocess.Popen([_cli(), "run", str(DESIRED), "--log-format", "console",
                                      "--state-dir", state_dir], stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, bufsize=1)
        self.lines: list[str] = []
        self.thread = threading.Thread(target=self._pump, daemon=True)
        self.thread.start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None    # stdout=PIPE
        for line in self.proc.stdout:
            self.lines.append(line)
            print(f"  daemon | {line}", end="", flush=True)

    def find(self, *words: str, start: int = 0) -> str | None:
        """The first daemon log line from index `start` on that contains every word."""
        for line in self.lines[start:]:
            if all(w in line for w in words):
                return line
        return None

    def stop(self, timeout: float = 60) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.thread.join(5)
        return self.proc.returncode


def run() -> int:
    if os.geteuid() != 0:
        print("the demo needs root (the testbed uses network namespaces and mounts)", file=sys.stderr)
        return 1
    guard = open(LOCK, "a")  # noqa: SIM115 - held for the demo's lifetime; one testbed per machine
    try:
        fcntl.flock(guard, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        print(f"another testbed user (a test run?) holds {LOCK}; waiting for it...", flush=True)
        try:
            fcntl.flock(guard, fcntl.LOCK_EX)
        except KeyboardInterrupt:      # the testbed is someone else's until we hold the lock: leave it alone
            print("interrupted while waiting; nothing started, nothing torn down", file=sys.stderr)
            guard.close()
            return 130
    daemon: Daemon | None = None
    try:
        say("Bringing up the simulated cluster (2 'Sparks': network namespaces with sshd + dockerd), scenario seed")
        cfg = api.status()
        if cfg.get("up") and len(cfg.get("nodes", {})) != 2:
            api.down()
        t = time.monotonic()
        api.up(nodes=2, scenario="seed")
        print(f"up in {time.monotonic() - t:.1f}s: the head runs vllm_node (GLM on :8000), vllm_embeddings, reranker "
              "and holds the weights; the worker's fabric port is down, with no weights and no serving image")

        say(f"reconciler plan {DESIRED.relative_to(REPO)}")
        plan = subprocess.run([_cli(), "plan", str(DESIRED)], capture_output=True, text=True, timeout=120, check=False)
        print(plan.stdout + plan.stderr, end="")

        say("Starting the daemon: reconciler run (console log); step progress below")
        state_dir = tempfile.mkdtemp(prefix="spark-reconciler-demo-")
        daemon = running = Daemon(state_dir)
        wait_for(status, 30, "the daemon's listener", interval=0.5)
        t = time.monotonic()
        wait_for(phase_is("Converged"), 600, "convergence", interval=0.5)
        say(f"Converged in {time.monotonic() - t:.1f}s")
        print(subprocess.run([_cli(), "status"], capture_output=True, text=True, timeout=30, check=False).stdout)
        print(f"metrics: {URL}/metrics  (Prometheus text; e.g. curl -s {URL}/metrics | grep reconciler_)")

        say("Fault: the worker's fabric link goes down (python -m testbed fault link-down --node worker)")
        mark = len(daemon.lines)
        print(api.fault("link-down", "worker"))
        t = time.monotonic()
        # the daemon watches link events, so detection and repair can take well under one status poll: read them
        # from its log (reconcile.plan naming the link, then reconcile.end Converged), then confirm via /status
        detected = wait_for(lambda: running.find("reconcile.plan", "link", start=mark), 120, "detection", interval=0.1)
        assert detected is not None    # wait_for returns the condition's first truthy value
        print(f"detected {time.monotonic() - t:.1f}s after the fault: {detected.split('reconcile.plan', 1)[1].strip()}")
        wait_for(lambda: running.find("reconcile.end", "phase=Converged", start=mark), 300, "repair", interval=0.1)
        wait_for(phase_is("Converged"), 60, "status Converged", interval=0.5)
        link = api.exec_("worker", "ip -br link show dev enp1s0f1np1", check=True).stdout.strip()
        print(f"worker fabric now: {link}")
        say(f"Repaired: back to Converged {time.monotonic() - t:.1f}s after the fault")
        print(subprocess.run([_cli(), "status"], capture_output=True, text=True, timeout=30, check=False).stdout)

        say("Stopping the daemon (SIGTERM)")
        print(f"daemon exited with {daemon.stop()}")
        daemon = None
        say("Done. The testbed is still up: python -m testbed exec head -- docker ps; "
            "`make demo-down` cleans up")
        return 0
    except KeyboardInterrupt:
        say("Interrupted: stopping the daemon and bringing the testbed down")
        if daemon is not None:
            daemon.stop()
            daemon = None
        left = api.down()
        print("testbed down" + (f" (left behind: {left})" if left else ""))
        return 130
    except TestbedError as exc:
        seen = "the daemon's last lines are above. " if daemon is not None else ""
        print(f"demo: {exc}; {seen}The testbed stays up; `make demo-down` cleans up.", file=sys.stderr)
        return 1
    finally:
        if daemon is not None:
            daemon.stop()
        guard.close()
