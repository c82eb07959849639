"""Issue 33, item 5: logs journald reads right.

Under systemd stderr is the journal's stream, and a line without a `<N>` prefix is taken at priority info: every
warning and error was invisible to `journalctl -p warning`. Here: the level -> priority mapping, the journal's
detection ($JOURNAL_STREAM against stderr's fstat, systemd.exec(5)), `--log-level`, and the real daemon (`reconciler
run`) with its stderr connected as systemd connects it (a stream socket, JOURNAL_STREAM its device and inode; the
testbed has no systemd as PID 1, so no journald): a node whose host key is refused is `<3>`, a node it cannot reach
`<4>`, a reconcile `<6>`.
"""

from __future__ import annotations

import io
import json
import logging
import os
import re
import select
import signal
import socket
import subprocess
import sys
import threading
import time

import paramiko
import pytest
import structlog
import yaml

from reconciler.edge import log
from testbed.proc import free_port
from tests.unit.conftest import BASE_YAML


@pytest.fixture
def restored():
    """Everything log.configure changes, put back afterwards."""
    saved = structlog.get_config(), logging.getLogRecordFactory(), sys.excepthook, threading.excepthook
    journal = log._journal
    yield
    structlog.configure(**saved[0])
    logging.setLogRecordFactory(saved[1])
    sys.excepthook, threading.excepthook = saved[2], saved[3]
    log._journal = journal


def stream_of(sock: socket.socket) -> str:
    st = os.fstat(sock.fileno())
    return f"{st.st_dev}:{st.st_ino}"


class JournalStream:
    """A stream socket as systemd connects a service's stderr to journald, JOURNAL_STREAM naming it; `install`
    makes it sys.stderr (in the test itself: pytest sets its own sys.stderr when the test's call begins)."""

    def __init__(self, monkeypatch) -> None:
        self.monkeypatch = monkeypatch
        self.ours, self.journald = socket.socketpair()
        self.stderr = self.ours.makefile("w", buffering=1, encoding="utf-8")
        self.journald.setblocking(False)
        monkeypatch.setenv("JOURNAL_STREAM", stream_of(self.ours))

    def install(self) -> None:
        self.monkeypatch.setattr(sys, "stderr", self.stderr)

    def written(self) -> list[str]:
        """What reached the journal's side."""
        self.stderr.flush()
        data = b""
        while select.select([self.journald], [], [], 0.2)[0]:
            chunk = self.journald.recv(65536)
            if not chunk:
                break
            data += chunk
        return data.decode().splitlines()

    def close(self) -> None:
        self.stderr.close()
        self.ours.close()
        self.journald.close()


@pytest.fixture
def journal(monkeypatch):
    stream = JournalStream(monkeypatch)
    yield stream
    stream.close()


@pytest.mark.parametrize(("level", "prefix"), [("debug", "<7>"), ("info", "<6>"), ("warning", "<4>"),
                                               ("error", "<3>"), ("critical", "<2>"), ("unknown", "<6>")])
def test_each_level_has_the_syslog_priority_systemd_reads(level, prefix):
    assert log.prefixed("one", level) == f"{prefix}one"
    assert log.prefixed("a\nb\n", level) == f"{prefix}a\n{prefix}b", "journald reads each line as its own entry"


def test_the_journal_is_stderr_only_when_its_device_and_inode_match():
    a, b = socket.socketpair()
    try:
        assert log.stderr_is_journal({"JOURNAL_STREAM": stream_of(a)}, a)
        assert not log.stderr_is_journal({"JOURNAL_STREAM": stream_of(b)}, a), "inherited, stderr redirected"
        assert not log.stderr_is_journal({}, a)
        for bad in ("", "12", "a:b", "1:2:3"):
            assert not log.stderr_is_journal({"JOURNAL_STREAM": bad}, a)
        assert not log.stderr_is_journal({"JOURNAL_STREAM": stream_of(a)}, io.StringIO()), "no descriptor"
    finally:
        a.close()
        b.close()


def test_under_the_journal_every_line_carries_its_priority(restored, journal):
    journal.install()
    log.configure(json_lines=True)
    logger = log.get()
    logger.debug("not.shown")
    logger.info("reconcile.end", phase="Converged")
    logger.warning("events.reconnect", node="worker", error="connection refused")
    logger.error("daemon.listen", error="mismatch")
    try:
        raise RuntimeError("a bug\nover two lines")
    except RuntimeError:
        logger.exception("reconcile.crashed")
    lines = journal.written()
    got = [(line[:3], json.loads(line[3:])["event"]) for line in lines]
    assert got == [("<6>", "reconcile.end"), ("<4>", "events.reconnect"), ("<3>", "daemon.listen"),
                   ("<3>", "reconcile.crashed")], lines


def test_without_the_journal_lines_stay_as_they_are(restored, journal, monkeypatch):
    journal.install()
    monkeypatch.delenv("JOURNAL_STREAM")
    log.configure(json_lines=True)
    log.get().warning("events.reconnect")
    assert [json.loads(line)["event"] for line in journal.written()] == ["events.reconnect"]


def test_the_log_level_filters_and_is_one_of_the_levels(restored, journal):
    journal.install()
    log.configure(json_lines=True, level="warning")
    log.get().info("reconcile.end")
    log.get().warning("node.unreachable")
    assert [line[:3] for line in journal.written()] == ["<4>"]
    with pytest.raises(ValueError, match="one of debug, info, warning, error"):
        log.configure(level="verbose")


def test_an_uncaught_exception_is_an_error_on_every_line(restored, journal, monkeypatch):
    journal.install()
    monkeypatch.setattr(sys, "excepthook", sys.__excepthook__)  # pytest's own hook is kept by configure
    log.configure(json_lines=True)
    try:
        raise KeyError("lost")
    except KeyError as exc:
        sys.excepthook(type(exc), exc, exc.__traceback__)
    lines = journal.written()
    assert len(lines) > 2 and all(line.startswith("<3>") for line in lines), lines


# -- the daemon, its stderr connected as systemd connects it to journald ---------------------------------------

class RefusedHead:
    """An SSH server on loopback that only shows its host key (which no known_hosts lists)."""

    def __init__(self) -> None:
        self.key = paramiko.RSAKey.generate(2048)
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._handshake, args=(conn,), daemon=True).start()

    def _handshake(self, conn: socket.socket) -> None:
        transport = paramiko.Transport(conn)
        transport.add_server_key(self.key)
        try:
            transport.start_server(server=paramiko.ServerInterface())
            transport.join(10)
        except (paramiko.SSHException, EOFError, OSError):
            pass
        finally:
            transport.close()


def test_the_daemon_under_journald_gives_failures_their_priority(tmp_path, console_script):
    head = RefusedHead()
    known_hosts = tmp_path / "known_hosts"
    known_hosts.write_text("")  # the head's key is not in it: refused, never trusted on first use
    data = yaml.safe_load(BASE_YAML)
    data["nodes"][0]["ssh"].update(host="127.0.0.1", port=head.port, known_hosts=str(known_hosts))
    data["nodes"][1]["ssh"].update(known_hosts=str(known_hosts))  # through the head: unreachable
    desired = tmp_path / "cluster.yaml"
    desired.write_text(yaml.safe_dump(data, sort_keys=False, explicit_end=True))
    ours, journald = socket.socketpair()
    env = {**os.environ, "JOURNAL_STREAM": stream_of(ours)}
    env.pop("NOTIFY_SOCKET", None)
    proc = subprocess.Popen([console_script, "run", str(desired), "--state-dir", str(tmp_path / "state"),
                             "--listen", f"127.0.0.1:{free_port()}", "--log-format", "json"],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=ours, env=env)
    ours.close()
    lines: list[str] = []
    buffer = b""
    try:
        deadline = time.monotonic() + 60
        while not _seen(lines) and time.monotonic() < deadline:
            if select.select([journald], [], [], 1.0)[0]:
                chunk = journald.recv(65536)
                assert chunk, f"the daemon ended: {proc.wait()}\n" + "\n".join(lines)
                buffer += chunk
                *done, buffer = buffer.split(b"\n")
                lines += [line.decode() for line in done]
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(30)
        journald.close()
        head.sock.close()
    assert _seen(lines), "\n".join(lines)
    assert code == 0
    assert all(re.match(r"<[2-7]>\{", line) for line in lines), [x for x in lines if not re.match(r"<\d>\{", x)]


def _seen(lines: list[str]) -> bool:
    """The head's refused host key at error, the worker behind it at warning, a reconcile at info."""
    events = [(line[:3], json.loads(line[3:])) for line in lines if re.match(r"<\d>\{", line)]
    return (any(p == "<3>" and e["event"] == "node.unreachable" and e["node"] == "head-a"
                and "HostKeyRejected" in e["error"] for p, e in events)
            and any(p == "<4>" and e["event"] == "node.unreachable" and e["node"] == "worker-b" for p, e in events)
            and any(p == "<6>" and e["event"] == "reconcile.end" for p, e in events))
