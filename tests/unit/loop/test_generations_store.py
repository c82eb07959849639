"""The generation store's file (issue 34): a state file that cannot be read or parsed is said and kept, never
silently taken for "no file" (generation 0); a save is durable (fsync of the file, rename, fsync of the directory).
"""

from __future__ import annotations

import json
import os

import pytest
from structlog.testing import capture_logs

from reconciler.loop import generations
from reconciler.loop.generations import GenerationStore, Record


@pytest.fixture
def paths(tmp_path):
    desired, state = tmp_path / "cluster.yaml", tmp_path / "state"
    state.mkdir()
    return state, desired


@pytest.mark.parametrize("text", ['["not", "an", "object"]', '{"generation": 3, "observedGen', "\udcff",
                                  '{"hash": 5, "generation": 3}', '{"generation": "3"}', '{"generation": -1}',
                                  '{"generation": true}', '{"generation": 2, "lastConverged": "yesterday"}'])
def test_a_corrupt_state_file_is_logged_and_kept_before_the_numbers_restart(paths, text):
    state, desired = paths
    file = GenerationStore(state, desired).file
    file.write_text(text, errors="surrogateescape")
    with capture_logs() as logs:
        store = GenerationStore(state, desired)
    assert (store.generation, store.observed_generation, store.last_converged) == (0, 0, 0.0)
    [said] = [e for e in logs if e["event"] == "state.corrupt"]
    assert said["log_level"] == "error" and said["file"] == str(file) and said["generation"] == 0
    aside = file.with_name(file.name + ".corrupt")
    assert said["kept"] == str(aside) and aside.read_bytes() == text.encode(errors="surrogateescape")
    assert not file.exists()
    assert store.take("a") and store.generation == 1, "the store works on from 0 once it has said so"


def test_no_file_is_the_first_daemon_and_says_nothing(paths):
    state, desired = paths
    with capture_logs() as logs:
        store = GenerationStore(state, desired)
    assert store.generation == 0 and logs == []


def test_a_state_file_that_cannot_be_read_is_said_too(paths, monkeypatch):
    state, desired = paths
    file = GenerationStore(state, desired).file
    file.write_text(Record("h", 4, 4, 1.0).to_json())

    def refused(self, *args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(type(file), "read_text", refused)
    with capture_logs() as logs:
        GenerationStore(state, desired)
    [said] = [e for e in logs if e["event"] == "state.corrupt"]
    assert "Permission denied" in said["error"]


def test_the_record_round_trips_and_reads_a_file_from_before(paths):
    state, desired = paths
    store = GenerationStore(state, desired)
    assert store.take("a")
    store.converged(1_700_000_000.5)
    assert json.loads(store.file.read_text()) == {"hash": "a", "generation": 1, "observedGeneration": 1,
                                                  "lastConverged": 1_700_000_000.5}
    store.file.write_text('{"hash": null, "generation": 2, "observedGeneration": 2}')  # before lastConverged
    assert Record.from_json(store.file.read_text()) == Record(None, 2, 2, 0.0)


def test_a_save_fsyncs_the_file_then_renames_then_fsyncs_the_directory(paths, monkeypatch):
    state, desired = paths
    calls: list[tuple[str, str]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        calls.append(("fsync", "dir" if os.path.isdir(f"/proc/self/fd/{fd}") else "file"))
        real_fsync(fd)

    def replace(src, dst):
        calls.append(("replace", os.path.basename(dst)))
        real_replace(src, dst)

    monkeypatch.setattr(generations.os, "fsync", fsync)
    monkeypatch.setattr(generations.os, "replace", replace)
    store = GenerationStore(state, desired)
    assert store.take("a")
    assert calls == [("fsync", "file"), ("replace", store.file.name), ("fsync", "dir")]
