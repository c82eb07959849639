"""A state dir that cannot be written (issue 31, finding 9), on a real filesystem: a 64 KiB tmpfs mounted for the
test (the unit tests run as root, like `make unit`), filled until the kernel says ENOSPC, or remounted read-only.

Before: writing the lock's pid on a full disk kept the daemon from starting; a running daemon took an edit's new
hash and number before the save failed, so the edit was never enforced, and `/status` showed its generation.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import subprocess
import threading
from pathlib import Path

import pytest

from reconciler.loop.daemon import AlreadyRunning, lock
from reconciler.loop.generations import GenerationStore, path_key
from reconciler.loop.operations import Operations
from reconciler.loop.reasons import Reason
from reconciler.loop.triggers import ReconcileRequests
from tests.unit.controllers import make_controller
from tests.unit.loop.test_controller_loop import WORKER, FakeSessions, Gate, Script, _with


class SmallDisk:
    """A 64 KiB tmpfs: `fill` it until a write fails with ENOSPC, `free` it, or make it `read_only`."""

    def __init__(self, path: Path):
        self.path = path
        self.filler = path / "filler"

    def fill(self) -> None:
        fd = os.open(self.filler, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        try:
            while True:
                os.write(fd, b"\0" * 4096)
        except OSError as exc:
            assert exc.errno == errno.ENOSPC
        finally:
            os.close(fd)

    def free(self) -> None:
        self.filler.unlink()

    def read_only(self) -> None:
        subprocess.run(["mount", "-o", "remount,ro", str(self.path)], check=True)


@pytest.fixture
def disk(tmp_path):
    path = tmp_path / "state"
    path.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k,mode=0700", "tmpfs", str(path)], check=True)
    try:
        yield SmallDisk(path)
    finally:
        subprocess.run(["umount", "-l", str(path)], check=True)


def _controller(desired_path, disk, script, gate):
    requests = ReconcileRequests()
    ops = Operations(on_end=lambda: requests.request(Reason("operation")), run=gate)
    return make_controller(desired_path, disk.path, requests, threading.Event(), events=False, observe_fn=script,
                      sessions_factory=FakeSessions, operations=ops)


def test_the_daemon_starts_on_a_full_state_dir_and_only_observes_until_it_can_record(desired_path, disk, converged):
    disk.fill()
    held = lock(disk.path, desired_path)  # the lock file is made (an empty file needs no block); its pid is not
    try:
        with pytest.raises(AlreadyRunning):
            lock(disk.path, desired_path)  # and it still refuses a second daemon on the same file
        gate = Gate()
        gate.release.set()
        c = _controller(desired_path, disk, Script(_with(converged, WORKER, weights=None)), gate)
        c.reconcile({Reason("start")})
        status = c.status
        assert status["lastPlan"]["mode"] == "observe" and gate.batches == [], "nothing acts"
        assert [d["kind"] for d in status["drift"]] == ["weights"], "but the drift is seen and said"
        assert not status["stateSaved"] and "No space left on device" in status["stateError"]
        assert "observing only" in status["lastError"] and status["generation"] == 0

        disk.free()
        c.reconcile({Reason("resync")})
        assert c.status["stateSaved"] and c.status["generation"] == 1
        assert gate.batches == [[f"weights/{WORKER}"]], "recorded: enforced"
        assert c.operations.join(20)
    finally:
        if held is not None:
            os.close(held)


def test_an_edit_on_a_full_disk_waits_for_its_generation_and_is_never_lost(desired_path, disk, converged):
    c = _controller(desired_path, disk, Script(converged), Gate())
    c.reconcile({Reason("start")})
    assert (c.store.generation, c.status["observedGeneration"]) == (1, 1)
    disk.fill()
    desired_path.write_text(desired_path.read_text().replace("resync_interval: 30s", "resync_interval: 45s"))

    with contextlib.suppress(Exception):  # as Daemon._loop does: a reconcile that raises is logged, the loop goes on
        c.reconcile({Reason("file")})
    assert c.desired is not None and c.desired.policy.resync_interval == 30, "the recorded one stays in force"

    disk.free()
    c.reconcile({Reason("resync")})  # no file event: the edit is retried by itself
    assert c.desired.policy.resync_interval == 45, "the edit was lost"
    assert c.status["generation"] == 2 and c.status["stateSaved"]
    restarted = GenerationStore(disk.path, desired_path)
    assert restarted.generation == 2 and restarted.take(c.desired.fingerprint()), "what a restart reads"
    assert restarted.generation == 2


def test_while_an_edit_waits_the_status_shows_the_generation_in_force_and_why(desired_path, disk, converged):
    c = _controller(desired_path, disk, Script(converged), Gate())
    c.reconcile({Reason("start")})
    disk.fill()
    desired_path.write_text(desired_path.read_text().replace("resync_interval: 30s", "resync_interval: 45s"))
    c.reconcile({Reason("file")})
    assert c.status["generation"] == 1, "the generation in force, not one nobody recorded"
    assert not c.status["stateSaved"] and "cannot record generation 2" in c.status["stateError"]
    assert "generation 1 stays in force" in c.status["stateError"]
    assert c.status["phase"] == "Converged", "generation 1 is, and the status says the edit waits"


def test_a_read_only_state_dir_holding_the_content_enforces_as_before(desired_path, disk, converged):
    first = _controller(desired_path, disk, Script(converged), Gate())
    first.reconcile({Reason("start")})
    disk.read_only()
    held = lock(disk.path, desired_path)  # opened read-only: flock needs no write
    try:
        gate = Gate()
        gate.release.set()
        c = _controller(desired_path, disk, Script(_with(converged, WORKER, weights=None)), gate)
        c.reconcile({Reason("start")})
        assert c.status["generation"] == 1 and c.status["lastPlan"]["mode"] == "enforce"
        assert gate.batches == [[f"weights/{WORKER}"]]
        assert c.operations.join(20)
    finally:
        if held is not None:
            os.close(held)


def test_a_read_only_state_dir_without_a_lock_file_still_starts(desired_path, disk):
    disk.read_only()
    assert lock(disk.path, desired_path) is None, "no lock file can be made: the daemon runs without it"


def test_a_generation_is_on_disk_before_it_is_taken(desired_path, tmp_path, monkeypatch):
    """Durable: the new file is fsynced before it replaces the old one, and the directory after (the rename)."""
    synced: list[str] = []
    real = os.fsync

    def fsync(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    state = tmp_path / "state"
    store = GenerationStore(state, desired_path)
    assert store.take("a")
    final = state / f"state-{path_key(desired_path)}.json"
    [temporary, directory] = synced  # the temporary file is a new one of its own name (issue 53, finding F)
    assert directory == str(state) and Path(temporary).parent == state
    assert Path(temporary).name.startswith(f".{final.name}.") and temporary.endswith(".tmp")
    assert json.loads(final.read_text())["generation"] == 1
