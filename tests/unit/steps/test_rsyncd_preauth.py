"""Issue 53, finding L: a connection from the source's address that never authenticates holds no stream's slot.

The one-time daemon accepts exactly STREAMS good streams from the source's fabric address, and anyone on the
source can connect from there. A silent first connection used to take the only slot: the real stream's rsync
waited in the backlog until it gave up (exit 30 after 48 s on the testbed), and the sync failed. Now a connection
holds a slot only once its daemon asks for the secret (its client answered the challenge); one that stays silent,
or stops half-way through the greeting, is pending and dropped after PREAUTH seconds. Real sockets and the real
rsync on loopback, the real helper (its PREAUTH shortened to 1 s where the deadline itself is tested)."""

from __future__ import annotations

import socket
import subprocess
import time
from pathlib import Path

import pytest

from reconciler.edge.steps import rsyncd_helper
from reconciler.edge.steps.rsyncd import refused_from
from reconciler.edge.steps.weights import COPY_OPTIONS, RSYNC_IO_TIMEOUT
from tests.unit.steps import test_rsyncd_helper
from tests.unit.steps.test_rsyncd_helper import SECRET, Helper, alive, children_of, listening

CLIENT_TIMEOUT = 10  # the real stream's rsync gives up after this long without an answer (the step uses 60)


@pytest.fixture
def src(tmp_path) -> Path:
    d = tmp_path / "src"
    d.mkdir()
    (d / "shard").write_bytes(b"w" * 100_000)
    return d


def push(src: Path, url: str) -> tuple[subprocess.CompletedProcess, float]:
    """The real stream, and how long it took."""
    start = time.monotonic()
    done = subprocess.run(["rsync", *COPY_OPTIONS, "--partial-dir=.rsync-partial", f"--timeout={CLIENT_TIMEOUT}",
                           "--password-file=-", f"{src}/", url], input=f"{SECRET}\n", capture_output=True, text=True,
                          timeout=3 * CLIENT_TIMEOUT, check=False)
    return done, time.monotonic() - start


def knock(port: int, say: bytes = b"") -> socket.socket:
    """A connection from the source's address that says `say` (nothing: silent) and then nothing more."""
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    if say:
        s.sendall(say)
    return s


def closed_by_the_other_end(s: socket.socket, within: float) -> bool:
    """Whether the daemon's side of `s` ended (EOF after whatever it said) within `within` seconds."""
    s.settimeout(within)
    try:
        while s.recv(4096):
            pass
    except TimeoutError:
        return False
    except OSError:
        return True
    return True


def test_a_silent_first_connection_takes_no_stream_s_slot(tmp_path, src):
    """One stream asked; someone on the source connects first and says nothing. The real stream still gets in at
    once (not after the pre-authentication deadline) and the helper ends well; the silent daemon is ended with it."""
    dst = tmp_path / "dst"
    dst.mkdir()
    helper = Helper(dst, streams=1)
    silent = knock(helper.port)
    try:
        done, _ = push(src, helper.url())
        assert done.returncode == 0, done.stderr
        # in before the silent one was dropped: it did not wait out the pre-authentication deadline for a slot
        assert not closed_by_the_other_end(silent, 0.2), "the stream got in only once the silent one was dropped"
        code, out, err = helper.end()
        assert (code, out.split()) == (0, ["daemon", "0"]), err
        assert (dst / "shard").read_bytes() == (src / "shard").read_bytes()
        assert closed_by_the_other_end(silent, 10), "the silent connection's daemon outlived the helper"
        assert not listening(helper.port)
    finally:
        silent.close()


def test_connections_that_never_authenticate_are_dropped_at_the_deadline(tmp_path, src, monkeypatch):
    """With PREAUTH at 1 s: three connections from the source's address fill every pending place of a one-stream
    daemon (STREAMS + EXTRA_PENDING): two silent, one that stops after the greeting and the module's name (before
    answering the challenge). Each is dropped at the deadline, its daemon ended (its socket closed from the other
    end), refused and counted (the step reports them as `weights.refused`); then the real stream gets in."""
    source = Path(rsyncd_helper.__file__).read_text()
    patched = tmp_path / "rsyncd_helper.py"
    patched.write_text(source.replace("PREAUTH = 10.0 ", "PREAUTH = 1.0 "))
    monkeypatch.setattr(test_rsyncd_helper, "HELPER", str(patched))
    dst = tmp_path / "dst"
    dst.mkdir()
    helper = Helper(dst, streams=1)
    knocks = [knock(helper.port), knock(helper.port), knock(helper.port, b"@RSYNCD: 31.0\nmodels\n")]
    try:
        assert wait_for_daemons(helper.proc.pid, 3), "each connection got its daemon"
        daemons = {p: cmdline(p) for p in children_of(helper.proc.pid)}
        assert [closed_by_the_other_end(k, 10) for k in knocks] == [True] * 3, "dropped at the deadline"
        assert not [p for p, cmd in daemons.items() if alive(p) and cmdline(p) == cmd], "a dropped daemon lives on"
        assert list(dst.iterdir()) == []
        done, _ = push(src, helper.url())
        assert done.returncode == 0, done.stderr
        code, out, err = helper.end()
        assert (code, out.split()) == (0, ["daemon", "0"]), err
        assert err.count("refused a connection from 127.0.0.1 (it did not authenticate within 1 s;") == 3, err
        assert refused_from(err) == ["127.0.0.1"] * 3
        assert (dst / "shard").read_bytes() == (src / "shard").read_bytes()
    finally:
        for k in knocks:
            k.close()


def cmdline(pid: int) -> bytes:
    """A process's command line (a pid the busy machine reused since is another process)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def wait_for_daemons(pid: int, n: int) -> bool:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if len(children_of(pid)) >= n:
            return True
        time.sleep(0.05)
    return False


def test_the_deadline_is_in_the_helper_as_sent_and_well_inside_the_stream_s_patience():
    """The helper runs as its own text (`python3 -c`): the constant the test above shortens is there. A stream kept
    in the backlog behind pending connections waits PREAUTH at most: well under its own I/O timeout and under the
    helper's accept window, so it never gives up for them."""
    assert "PREAUTH = 10.0 " in Path(rsyncd_helper.__file__).read_text()
    assert min(RSYNC_IO_TIMEOUT, rsyncd_helper.ACCEPT_WINDOW) >= 2 * rsyncd_helper.PREAUTH
