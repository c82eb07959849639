"""The generation store: which version of the desired state is enforced, and which one the cluster reached.

Kubernetes' generation/observedGeneration, for one file: a new valid content bumps `generation`; a converged
observation sets `observed_generation` to it. Both are kept in the state dir (one JSON file per desired-state
path, replaced atomically and durably), so a daemon restart neither renumbers the same content nor makes
Grafana's "since last converged" read as 1970 until the first converged reconcile.

A generation is taken only once it is saved. The first version bumped the number and kept the new content's hash
in memory before writing: on a full disk the write failed, the next look at the file found "the same content",
and the edit was never enforced while `/status` showed its generation (issue 31, finding 9). Now a save that
fails leaves the store as it was and says why (`unsaved`); the controller keeps the generation in force and asks
again every reconcile. A state dir that cannot be written does not keep the daemon from starting: content whose
number is already on disk needs no write, and anything else is observed, never enforced (`observe_only`), until
its number can be recorded.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from pathlib import Path

from reconciler.core.spec import Desired


def path_key(path: Path) -> str:
    """A short stable name for a desired-state path (lock and state files live side by side per file)."""
    return hashlib.sha256(str(Path(path).resolve()).encode()).hexdigest()[:16]


def observe_only(desired: Desired) -> Desired:
    """What the daemon does with content whose generation it cannot record: observe and report, change nothing.
    A step taken under a number no restart would know again is a step nobody can account for."""
    return desired.model_copy(update={"policy": desired.policy.model_copy(update={"mode": "observe"})})


def write_durably(file: Path, text: str) -> None:
    """Replace `file` with `text` so that after a crash or a power loss it holds the old text or the new one:
    written to a temporary file, fsynced, renamed over it, and the directory fsynced (the rename itself). A write
    that fails (a full disk) removes its temporary file, which gives the room back."""
    file.parent.mkdir(parents=True, exist_ok=True)
    tmp = file.with_suffix(".tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            data = text.encode()
            while data:
                data = data[os.write(fd, data):]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, file)
    except OSError:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    directory = os.open(file.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


class GenerationStore:
    def __init__(self, state_dir: Path, path: Path) -> None:
        self.file = Path(state_dir) / f"state-{path_key(path)}.json"
        self.content_hash: str | None = None  # of the desired state in force (None: none recorded yet)
        self.generation = self.observed_generation = 0
        self.last_converged = 0.0
        self.pending: str | None = None  # why the content last offered is not recorded (None: nothing waits)
        self._not_converged: str | None = None  # why "converged" is known in memory only
        self._on_disk: dict | None = None  # the record the file holds, as read or last written
        self._stored_hash: str | None = None
        try:
            data = json.loads(self.file.read_text())
            self._stored_hash = data.get("hash")
            self.generation = int(data.get("generation", 0))
            self.observed_generation = int(data.get("observedGeneration", 0))
            self.last_converged = float(data.get("lastConverged") or 0.0)
            self._on_disk = self._record(self._stored_hash, self.generation)
        except (OSError, ValueError, TypeError, AttributeError):
            self.generation = self.observed_generation = 0
            self.last_converged = 0.0

    def take(self, digest: str) -> bool:
        """A valid content was loaded; True when it is a new generation, recorded. The content stored by the
        previous daemon keeps its number across a restart; anything else (an edit, or the first content ever)
        bumps. False also when the new number could not be saved (`pending` says why): nothing changed here."""
        if digest == self.content_hash:
            self.pending = None  # the content in force (an edit undone): nothing waits
            return False
        keeps = self.content_hash is None and digest == self._stored_hash and self.generation > 0
        generation = self.generation if keeps else self.generation + 1
        meanwhile = ("observing only, changing nothing, until it can be" if self.content_hash is None
                     else f"generation {self.generation} stays in force until it can be")
        self.pending = self._save(digest, generation, f"generation {generation}", meanwhile)
        if self.pending is not None:
            return False
        self._not_converged = None  # the record written holds everything known
        self.content_hash, self.generation = digest, generation
        return True

    def converged(self, now: float) -> None:
        """The cluster reached the generation in force. Kept in memory whether or not it can be saved: it is true
        now, and a restart that reads an older number only converges once more."""
        self.observed_generation = self.generation
        self.last_converged = now
        self._not_converged = self._save(self.content_hash, self.generation,
                                         f"that generation {self.generation} converged",
                                         "known until the daemon restarts")

    @property
    def unsaved(self) -> str | None:
        """What the state dir does not hold, in words (None: it holds everything): for /status."""
        return self.pending or self._not_converged

    def _record(self, digest: str | None, generation: int) -> dict:
        return {"hash": digest, "generation": generation, "observedGeneration": self.observed_generation,
                "lastConverged": self.last_converged}

    def _save(self, digest: str | None, generation: int, what: str, meanwhile: str) -> str | None:
        """Write the record unless the file holds it already. None when it is on disk; else what could not be
        recorded, where, why, and what holds `meanwhile`."""
        record = self._record(digest, generation)
        if record != self._on_disk:
            try:
                write_durably(self.file, json.dumps(record))
            except OSError as exc:
                return f"cannot record {what} in {self.file.parent}: {exc.strerror or exc}; {meanwhile}"
            self._on_disk = record
        return None
