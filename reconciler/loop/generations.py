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

A state file that cannot be read or parsed once became generation 0 in silence (issue 34): now it is logged
(`state.corrupt`, at error) and moved aside to `NAME.corrupt` before the numbers restart (`read_record`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path

from reconciler.core.spec import Desired
from reconciler.edge import log

_log = log.get("reconciler.state")


def path_key(path: Path) -> str:
    """A short stable name for a desired-state path (lock and state files live side by side per file)."""
    return hashlib.sha256(str(Path(path).resolve()).encode()).hexdigest()[:16]


def observe_only(desired: Desired) -> Desired:
    """What the daemon does with content whose generation it cannot record: observe and report, change nothing.
    A step taken under a number no restart would know again is a step nobody can account for."""
    return desired.model_copy(update={"policy": desired.policy.model_copy(update={"mode": "observe"})})


def write_durably(file: Path, text: str, like: os.stat_result | None = None, mode: int = 0o600) -> None:
    """Replace `file` with `text` so that after a crash or a power loss it holds the old text or the new one:
    written to a temporary file, fsynced, renamed over it, and the directory fsynced (the rename itself). A write
    that fails (a full disk) removes its temporary file, which gives the room back. `like`: the mode (and, as
    root, the owner) the file gets, set on the temporary file before the rename (default `mode`, this user's).

    The temporary file is a new one of a name no one can foresee (`mkstemp`: O_CREAT | O_EXCL | O_NOFOLLOW, in
    the file's own directory, so the rename stays on its filesystem). It was a fixed `NAME.tmp` opened with
    O_TRUNC: a link planted there made `reconciler rollback`, as root, write, chmod and chown the file it led
    to, and the rename then put the link itself in the file's place (issue 53, finding F). A link at `file`
    itself is replaced by the rename, never written through. The one writer of every file the reconciler
    replaces: the state dir's records, the history, the status key, `init -o` and `discover -o`."""
    file.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f".{file.name}.", suffix=".tmp", dir=file.parent)
    tmp = Path(name)
    try:
        try:
            os.fchmod(fd, stat.S_IMODE(like.st_mode) if like is not None else mode)
            if like is not None and os.geteuid() == 0:
                os.fchown(fd, like.st_uid, like.st_gid)
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


@dataclass(frozen=True)
class Record:
    """What the state file holds: the content in force (its hash), its generation, the generation the cluster
    reached and when (unix time; 0: never, or a file from before the time was kept)."""

    hash: str | None = None
    generation: int = 0
    observed_generation: int = 0
    last_converged: float = 0.0

    def to_json(self) -> str:
        return json.dumps({"hash": self.hash, "generation": self.generation,
                           "observedGeneration": self.observed_generation, "lastConverged": self.last_converged})

    @classmethod
    def from_json(cls, text: str) -> Record:
        """The record `to_json` wrote, or ValueError naming what is wrong: a file cut short, written over or by
        something else is not read as numbers it happens to contain."""
        data = json.loads(text)
        if not isinstance(data, dict):
            raise ValueError("not a JSON object")
        digest, last = data.get("hash"), data.get("lastConverged") or 0.0
        numbers = [data.get("generation", 0), data.get("observedGeneration", 0)]
        if digest is not None and not isinstance(digest, str):
            raise ValueError("hash is not a string")
        if not all(type(n) is int and n >= 0 for n in numbers):
            raise ValueError("generation and observedGeneration are not counts")
        if type(last) not in (int, float) or not math.isfinite(last) or last < 0:
            raise ValueError("lastConverged is not a time")
        return cls(digest, numbers[0], numbers[1], float(last))


def read_record(file: Path) -> Record | None:
    """The record in `file`; None when there is none (the first daemon for this desired state). A file that
    cannot be read or parsed is never taken for "no file" in silence: it is logged and moved aside to
    `NAME.corrupt` (the last one kept), so the generations that restart at 0 say why and the evidence stays."""
    try:
        return Record.from_json(file.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:  # UnicodeDecodeError and json's errors are ValueErrors
        aside = file.with_name(file.name + ".corrupt")
        try:
            os.replace(file, aside)
        except OSError as moved:
            _log.error("state.corrupt", file=str(file), error=str(exc), kept=None, move_error=str(moved),
                       generation=0)
        else:
            _log.error("state.corrupt", file=str(file), error=str(exc), kept=str(aside), generation=0)
        return None


class GenerationStore:
    def __init__(self, state_dir: Path, path: Path) -> None:
        self.file = Path(state_dir) / f"state-{path_key(path)}.json"
        self.content_hash: str | None = None  # of the desired state in force (None: none recorded yet)
        self.pending: str | None = None  # why the content last offered is not recorded (None: nothing waits)
        self._not_converged: str | None = None  # why "converged" is known in memory only
        self._on_disk = read_record(self.file)  # the record the file holds, as read or last written
        stored = self._on_disk or Record()
        self._stored_hash = stored.hash
        self.generation, self.observed_generation = stored.generation, stored.observed_generation
        self.last_converged = stored.last_converged

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

    def _record(self, digest: str | None, generation: int) -> Record:
        return Record(digest, generation, self.observed_generation, self.last_converged)

    def _save(self, digest: str | None, generation: int, what: str, meanwhile: str) -> str | None:
        """Write the record unless the file holds it already. None when it is on disk; else what could not be
        recorded, where, why, and what holds `meanwhile`."""
        record = self._record(digest, generation)
        if record != self._on_disk:
            try:
                write_durably(self.file, record.to_json())
            except OSError as exc:
                return f"cannot record {what} in {self.file.parent}: {exc.strerror or exc}; {meanwhile}"
            self._on_disk = record
        return None
