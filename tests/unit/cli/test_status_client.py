"""Issue 33, finding 7: the real `reconciler status` against the daemon's real listener (reconciler/loop/server.py,
with its status key) serving recorded documents: the exit codes, the width when the output is not a terminal,
and `--watch` (redrawn until Ctrl-C or SIGTERM, one JSON document per line with `--json`).
Under a real terminal (tmux), at 80 and 200 columns: tests/unit/cli/test_status_tmux.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from reconciler.loop.server import Listener, make_status_key, serve
from testbed.proc import free_port, wait_for
from tests.unit.cli.test_status_view import fixture

WATCH_INTERVAL = "0.5"  # the smallest --interval: frames come fast, and the test still waits by deadline


@dataclass
class Daemon:
    """The daemon's listener and key (its state dir) answering whatever document `doc` is now."""

    url: str
    state_dir: Path
    doc: dict
    listener: Listener | None

    def stop(self) -> None:
        if self.listener is not None:
            self.listener.shutdown()
            self.listener = None


@contextlib.contextmanager
def answering(tmp_path: Path) -> Iterator[Daemon]:
    """The daemon's listener on a free loopback port, its key in a state dir, answering status-copying.json."""
    state_dir = tmp_path / "state"
    state_dir.mkdir()
    key = make_status_key(state_dir)
    assert key is not None
    served = Daemon("", state_dir, fixture("status-copying"), None)
    served.listener = serve("127.0.0.1:0", lambda: served.doc, key=key)
    served.url = f"http://127.0.0.1:{served.listener.server_address[1]}"
    try:
        yield served
    finally:
        served.stop()


@pytest.fixture
def daemon(tmp_path) -> Iterator[Daemon]:
    with answering(tmp_path) as served:
        yield served


def status(console_script: str, daemon: Daemon, *args: str) -> list[str]:
    return [console_script, "status", "--url", daemon.url, "--state-dir", str(daemon.state_dir), *args]


def environ(**set_: str) -> dict[str, str]:
    """This environment without a terminal size of its own (COLUMNS, LINES), plus `set_`."""
    return {**{k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}, **set_}


def run(argv: list[str], **set_: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False, env=environ(**set_))


# ------------------------------------------------------------------------------------------------ exit codes

def test_converged_exits_0_and_any_other_phase_2(console_script, daemon):
    blocked = run(status(console_script, daemon))
    assert blocked.returncode == 2 and "phase Blocked" in blocked.stdout and blocked.stderr == ""
    daemon.doc = {**fixture("status-held"), "phase": "Converged"}
    converged = run(status(console_script, daemon))
    assert converged.returncode == 0 and "phase Converged" in converged.stdout


def test_no_daemon_exits_5(console_script, daemon):
    daemon.stop()
    result = run(status(console_script, daemon))
    assert result.returncode == 5 and result.stdout == ""
    assert f"cannot reach the daemon at {daemon.url}: [Errno 111] Connection refused" in result.stderr


def test_another_daemon_s_answer_exits_1(console_script, daemon, tmp_path):
    """A listener whose key is not the one in --state-dir (a squatter on the port): not believed."""
    other = tmp_path / "other"
    other.mkdir()
    make_status_key(other)
    result = run([console_script, "status", "--url", daemon.url, "--state-dir", str(other)])
    assert result.returncode == 1 and result.stdout == ""
    assert f"{daemon.url}/status answered without the proof of the daemon that keeps {other}" in result.stderr


@pytest.mark.parametrize("doc,why", [({"status": "ok"}, "no phase"),
                                     ({"phase": "Converged", "conditions": [{"type": "Ready"}]}, "KeyError")])
def test_an_answer_that_is_not_a_status_document_exits_1(console_script, daemon, doc, why):
    daemon.doc = doc
    for args in ((), ("--json",)):
        result = run(status(console_script, daemon, *args))
        assert result.returncode == 1 and result.stdout == "" and "Traceback" not in result.stderr
        assert f"{daemon.url}/status did not answer a reconciler status document ({why}" in result.stderr


def test_an_error_page_exits_1(console_script, daemon):
    result = run([console_script, "status", "--url", f"{daemon.url}/elsewhere", "--state-dir",
                  str(daemon.state_dir)])
    assert result.returncode == 1 and f"{daemon.url}/elsewhere/status answered HTTP 404 Not Found" in result.stderr


def test_a_port_that_does_not_speak_http_exits_1(console_script, tmp_path):
    """An sshd (or anything else) on the listener's port: said in one line, never a traceback."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        def greet() -> None:
            conn, _ = server.accept()
            with conn:
                conn.sendall(b"SSH-2.0-OpenSSH_9.2p1 Debian-2+deb12u3\r\n")

        threading.Thread(target=greet, daemon=True).start()
        url = f"http://127.0.0.1:{server.getsockname()[1]}"
        result = run([console_script, "status", "--url", url, "--state-dir", str(tmp_path)])
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert f"{url}/status did not answer HTTP (BadStatusLine: SSH-2.0-OpenSSH_9.2p1" in result.stderr


def test_a_url_it_cannot_ask_exits_1(console_script, tmp_path):
    result = run([console_script, "status", "--url", "127.0.0.1:9464", "--state-dir", str(tmp_path)])
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert "cannot ask 127.0.0.1:9464/status: unknown url type" in result.stderr


# ------------------------------------------------------------------------------------------------ the width

def test_not_a_terminal_is_80_columns_unless_columns_says(console_script, daemon):
    narrow = run(status(console_script, daemon)).stdout
    wide = run(status(console_script, daemon), COLUMNS="200").stdout
    assert max(map(len, narrow.splitlines())) == 80  # the conditions' messages fill it, ending with "…"
    assert 80 < max(map(len, wide.splitlines())) <= 200
    message = next(c["message"] for c in daemon.doc["conditions"] if c["type"] == "WeightsInSync" and c["message"])
    assert message in wide and message not in narrow


def test_wide_shows_every_condition(console_script, daemon):
    result = run(status(console_script, daemon, "--wide"))
    assert result.returncode == 2
    for c in daemon.doc["conditions"]:
        assert any(c["type"] in line and (c["node"] or "-") in line for line in result.stdout.splitlines())
    assert max(map(len, result.stdout.splitlines())) <= 80


# ------------------------------------------------------------------------------------------------ --watch

def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


class Watching:
    """`reconciler status --watch` running, its output read as it comes."""

    def __init__(self, argv: list[str]) -> None:
        # Ctrl-C as a terminal delivers it: SIGINT at its default in the child, whatever this run inherited (a
        # suite started in the background by a shell without job control ignores SIGINT, and so would the child:
        # Python installs no KeyboardInterrupt handler for an ignored SIGINT).
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     env=environ(), preexec_fn=_default_sigint)
        self.out: list[str] = []
        self._reader = threading.Thread(target=lambda: self.out.extend(iter(self.proc.stdout.readline, "")),
                                        daemon=True)
        self._reader.start()

    def text(self) -> str:
        return "".join(self.out)

    def end(self, sig: int) -> tuple[int, str]:
        self.proc.send_signal(sig)
        code = self.proc.wait(timeout=15)
        self._reader.join(5)
        return code, self.proc.stderr.read()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def watching() -> Iterator[list[Watching]]:
    started: list[Watching] = []
    yield started
    for w in started:
        w.kill()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "Ctrl-C"])
def test_watch_draws_a_frame_per_interval_until_stopped(console_script, daemon, watching, sig):
    w = Watching(status(console_script, daemon, "--watch", "--interval", WATCH_INTERVAL))
    watching.append(w)
    header = f"every {WATCH_INTERVAL}s: reconciler status {daemon.url}"
    wait_for(lambda: w.text().count(header) >= 2, 15, "two frames")
    daemon.doc = fixture("status-syncing")
    wait_for(lambda: "phase Converging" in w.text(), 15, "a frame of the new answer")
    code, err = w.end(sig)
    assert code == 2, err  # the last frame's: not converged
    assert "Traceback" not in err and max(map(len, w.text().splitlines())) <= 80


def test_watch_says_a_daemon_that_stops_answering_and_keeps_asking(console_script, daemon, watching):
    w = Watching(status(console_script, daemon, "--watch", "--interval", WATCH_INTERVAL))
    watching.append(w)
    wait_for(lambda: "phase Blocked" in w.text(), 15, "a first frame")
    daemon.stop()
    unreachable = f"cannot reach the daemon at {daemon.url}"
    wait_for(lambda: w.text().count(unreachable) >= 2, 15, "the error in two frames")
    frame = w.text().rsplit(f"every {WATCH_INTERVAL}s:", 1)[0].rsplit(unreachable, 1)[1]
    assert "its last answer," in frame and "phase Blocked" in frame  # the last answer stays, under the error
    assert w.end(signal.SIGTERM)[0] == 5


def test_watch_json_writes_one_document_per_line(console_script, daemon, watching):
    w = Watching(status(console_script, daemon, "--watch", "--json", "--interval", WATCH_INTERVAL))
    watching.append(w)
    wait_for(lambda: len(w.out) >= 2, 15, "two documents")
    daemon.doc = {**fixture("status-held"), "phase": "Converged"}
    wait_for(lambda: json.loads(w.out[-1])["phase"] == "Converged", 15, "the new answer")
    docs = [json.loads(line) for line in list(w.out)]
    assert docs[0]["phase"] == "Blocked" and all("conditions" in d for d in docs)
    assert w.end(signal.SIGINT)[0] == 0


def test_watch_starts_without_a_daemon_and_exits_5(console_script, watching, tmp_path):
    url = f"http://127.0.0.1:{free_port()}"
    w = Watching([console_script, "status", "--watch", "--interval", WATCH_INTERVAL, "--url", url, "--state-dir",
                  str(tmp_path)])
    watching.append(w)
    wait_for(lambda: f"cannot reach the daemon at {url}" in w.text(), 15, "the error in a frame")
    code, err = w.end(signal.SIGTERM)
    assert code == 5 and f"not verified that the daemon of {tmp_path} answered" in err
