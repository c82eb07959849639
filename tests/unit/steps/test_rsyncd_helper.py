"""The one-time rsync daemon's helper (`reconciler/edge/steps/rsyncd_helper.py`), run here for real on loopback with
the real rsync: who gets in, what is left behind, and that it ends when the step lets go of it."""

from __future__ import annotations

import os
import select
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from reconciler.edge.steps import rsyncd, rsyncd_helper
from reconciler.edge.steps.weights import COPY_OPTIONS
from testbed.proc import wait_for

HELPER = str(Path(rsyncd_helper.__file__))
SECRET = "one-time-secret-for-this-test"


class Helper:
    def __init__(self, root: Path, streams: int = 1, peer: str = "127.0.0.1", lifetime: int = 60,
                 secret: str = SECRET, env: dict | None = None):
        self.proc = subprocess.Popen([sys.executable, HELPER, "127.0.0.1", peer, str(streams), str(root),
                                      str(lifetime)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, env=env)
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(f"{secret}\n".encode())
        self.proc.stdin.flush()
        first = self.proc.stdout.readline().decode().split()
        assert first[0] == "port", first
        self.port = int(first[1])

    def url(self) -> str:
        return f"rsync://fabric@127.0.0.1:{self.port}/models/"

    def end(self, close: bool = False) -> tuple[int, str, str]:
        assert self.proc.stdin is not None and self.proc.stdout is not None and self.proc.stderr is not None
        if close:
            self.proc.stdin.close()
        self.proc.wait(timeout=30)
        return self.proc.returncode, self.proc.stdout.read().decode(), self.proc.stderr.read().decode()


def push(src: Path, url: str, secret: str = SECRET, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(["rsync", *COPY_OPTIONS, "--partial-dir=.rsync-partial", "--timeout=30",
                           "--password-file=-", *extra, f"{src}/", url], input=f"{secret}\n", capture_output=True,
                          text=True, timeout=60, check=False)


def listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


@pytest.fixture
def src(tmp_path) -> Path:
    d = tmp_path / "src"
    (d / "blobs").mkdir(parents=True)
    (d / "snapshots" / "r").mkdir(parents=True)
    (d / "blobs" / "abc").write_bytes(os.urandom(100_000))
    (d / "snapshots" / "r" / "model.safetensors").symlink_to("../../blobs/abc")
    return d


def test_one_stream_arrives_without_its_links_and_nothing_is_left(tmp_path, src):
    """The weights step's own options: regular files arrive, a link is skipped (the reconciler makes the links)."""
    dst = tmp_path / "dst"
    dst.mkdir()
    helper = Helper(dst)
    done = push(src, helper.url())
    assert done.returncode == 0, done.stderr
    code, out, err = helper.end()
    assert (code, out.split()) == (0, ["daemon", "0"]), err
    assert (dst / "blobs" / "abc").read_bytes() == (src / "blobs" / "abc").read_bytes()
    assert not os.path.lexists(dst / "snapshots" / "r" / "model.safetensors")
    assert not listening(helper.port)


def test_a_wrong_secret_is_refused_writes_nothing_and_frees_its_slot(tmp_path, src):
    """Whoever on the source connects first without the secret (a local user there) takes no stream's slot: the
    real client still gets in after it, and the step ends well."""
    dst = tmp_path / "dst"
    dst.mkdir()
    helper = Helper(dst)
    done = push(src, helper.url(), "not-the-secret")
    assert done.returncode != 0 and "auth failed" in done.stderr
    assert list(dst.iterdir()) == []
    assert push(src, helper.url()).returncode == 0
    code, out, err = helper.end()
    words = out.split()
    assert (code, words[::2], words[1] != "0", words[3]) == (0, ["daemon", "daemon"], True, "0"), err


def test_a_stranger_is_refused_and_counted_and_the_step_goes_on(tmp_path, src):
    """A connection from another address than the source's (a local user on the target; the management LAN through
    Linux's weak host model) is closed before any daemon hears it, counted, and never the end of the step."""
    dst = tmp_path / "dst"
    dst.mkdir()
    helper = Helper(dst)
    stranger = push(src, helper.url(), SECRET, "--address=127.0.0.2")
    assert stranger.returncode != 0
    assert list(dst.iterdir()) == []
    assert push(src, helper.url()).returncode == 0
    code, out, err = helper.end()
    assert (code, out.split()) == (0, ["daemon", "0"]), err
    assert "refused a connection from 127.0.0.2 (1 refused)" in err
    assert not listening(helper.port)


def test_exactly_the_streams_asked_for_get_in(tmp_path, src):
    dst = tmp_path / "dst"
    dst.mkdir()
    helper = Helper(dst, streams=2)
    assert push(src, helper.url()).returncode == 0
    assert push(src, helper.url()).returncode == 0
    code, out, _ = helper.end()
    assert code == 0 and out.split() == ["daemon", "0", "daemon", "0"]
    assert push(src, helper.url()).returncode != 0  # a third: nobody listens any more


def test_closing_the_lifeline_mid_transfer_ends_every_daemon_and_keeps_the_partial_data(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "big").write_bytes(os.urandom(32 << 20))
    dst = tmp_path / "dst"
    dst.mkdir()
    helper = Helper(dst)
    client = subprocess.Popen(["rsync", *COPY_OPTIONS, "--partial-dir=.rsync-partial", "--timeout=30", "--bwlimit=2m",
                               "--password-file=-", f"{src}/", helper.url()], stdin=subprocess.PIPE,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    assert client.stdin is not None
    client.stdin.write(f"{SECRET}\n")
    client.stdin.close()
    wait_for(lambda: any(p.name.startswith(".big") for p in dst.iterdir()), timeout=30, what="the transfer's start")
    daemons = children_of(helper.proc.pid)
    assert daemons
    code, _, err = helper.end(close=True)
    assert code == 3 and "lifeline closed" in err
    assert client.wait(timeout=30) != 0
    assert not [p for p in daemons if alive(p)], "a daemon outlived the helper"
    assert (dst / ".rsync-partial" / "big").stat().st_size > 0
    assert not (dst / "big").exists(), "no half-written file under its final name"


def test_the_secret_is_in_no_argv_and_no_file_left_behind(tmp_path, src):
    dst = tmp_path / "dst"
    dst.mkdir()
    runtime = tmp_path / "run"
    runtime.mkdir()
    helper = Helper(dst, env={**os.environ, "XDG_RUNTIME_DIR": str(runtime)})
    [rundir] = list(runtime.iterdir())
    assert oct(rundir.stat().st_mode & 0o777) == "0o700"
    assert SECRET not in (rundir / "rsyncd.conf").read_text()
    assert SECRET not in Path(f"/proc/{helper.proc.pid}/cmdline").read_text()
    assert push(src, helper.url()).returncode == 0
    assert helper.end()[0] == 0
    assert list(runtime.iterdir()) == []


def children_of(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True, check=False)
    return [int(p) for p in out.stdout.split()]


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_a_daemon_s_exit_wakes_the_helper_at_once():
    """The step waits for every `daemon 0` before its `sync -f`: the helper must hear a daemon's exit when it
    happens (SIGCHLD on `child_exits`' descriptor), not at its next look at the clock, which put up to 0.2 s on
    every copy's path. Nothing else writes that descriptor, so it is readable only because the child exited."""
    old_handler = signal.getsignal(signal.SIGCHLD)
    woken = rsyncd_helper.child_exits()
    try:
        assert select.select([woken], [], [], 0)[0] == [], "nothing has exited yet"
        subprocess.run(["true"], check=True)
        ready, _, _ = select.select([woken], [], [], 30)  # a bound for a stuck machine, not a timing
        assert ready == [woken]
        assert os.read(woken, 4096), "the wakeup byte is there to drain"
    finally:
        os.close(signal.set_wakeup_fd(-1))  # the helper's write end
        signal.signal(signal.SIGCHLD, old_handler)
        os.close(woken)


def test_only_a_port_line_from_the_node_names_a_port():
    for said in (None, "", "port", "port x", "port 0", "port 65536", "port 22 23", "Traceback (most recent", "22"):
        assert rsyncd._port(said) is None, said
    assert rsyncd._port("port 4242") == 4242


def test_a_client_asking_for_links_is_refused_and_writes_nothing(tmp_path, src):
    """`-a` carries -l (and -D, -o, -g): the daemon refuses the whole stream (`rsyncd_helper.REFUSED`)."""
    dst = tmp_path / "dst"
    dst.mkdir()
    helper = Helper(dst)
    done = subprocess.run(["rsync", "-a", "--timeout=30", "--password-file=-", f"{src}/", helper.url()],
                          input=f"{SECRET}\n", capture_output=True, text=True, timeout=60, check=False)
    helper.end(close=True)
    assert done.returncode != 0 and "refuse" in done.stderr, done.stderr
    assert list(dst.iterdir()) == []


def test_a_node_whose_rsync_cannot_be_confined_gets_no_daemon(tmp_path):
    """An rsync older than MIN_VERSION: the helper refuses before it listens (exit 5, says what to do)."""
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "rsync").write_text("#!/bin/sh\necho 'rsync  version 3.0.9  protocol version 30'\n")
    (fake / "rsync").chmod(0o755)
    proc = subprocess.run([sys.executable, HELPER, "127.0.0.1", "127.0.0.1", "1", str(tmp_path), "60"],
                          input=f"{SECRET}\n", capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PATH": f"{fake}:{os.environ['PATH']}"}, check=False)
    assert (proc.returncode, proc.stdout) == (5, ""), proc.stderr
    assert "3.0.9 is older than 3.1.0" in proc.stderr and "transport: ssh" in proc.stderr


def test_the_refused_addresses_are_read_from_the_helper_s_own_lines_only():
    said = ("refused a connection from 127.0.0.2 (1 refused)\nrefused a connection from 10.0.0.9 (2 refused)\n"
            "refused a connection from 127.0.0.2 (3 refused)\nrefused a connection from $(reboot) (4 refused)\n"
            "2026/12/06 [81] auth failed on module models\n")
    assert rsyncd.refused_from(said) == ["127.0.0.2", "10.0.0.9", "127.0.0.2"]
