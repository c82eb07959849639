"""Each generation's desired state, kept, and the rollback of a change that never served.

Argo Rollouts and Flagger abort a release that fails its analysis back to the stable version; a Kubernetes
Deployment only stops progressing (`progressDeadlineSeconds`) and waits for a person. On a Spark the cost of a
change that cannot serve is the API down until someone acts, so the reconciler keeps every generation's file (the
text the owner wrote, comments included: `reconciler rollback` writes it back) with when it was taken, when it
first served (converged) and how it ended, and with `policy.on_failed_change: rollback` brings the last generation
that served back up when a new one fails (docs/operations.md "History and rollback").

A rollback is a hold, not an edit: the file still says the failed generation, the daemon enforces the one it brought
back, and says so (status phase RolledBack, `reconciler_rolled_back`, the RolledBack alert) until the file changes.
The hold is kept in the state dir, so a daemon restart does not try the failed change again.

Layout, per desired-state path (`generations.path_key`): `history-KEY/index.json` (the entries and the hold) and
`history-KEY/GEN.yaml` (each kept generation's text), all written with `generations.write_durably`. The newest
`policy.history` generations are kept, and besides them the newest that served (what a rollback needs).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from reconciler.core.restore import AS_FOUND, StoppedCoTenant
from reconciler.core.text import printable
from reconciler.edge import log
from reconciler.loop.generations import path_key, write_durably

_log = log.get("reconciler.history")

#: How a generation ended, as `reconciler history` shows it.
IN_FORCE, SERVED, REPLACED, FAILED, ROLLED_BACK = "in force", "served", "replaced", "failed", "rolled back"
#: The latest time an entry or the hold may carry (unix seconds; 0 is "not yet"): 9999-12-31 23:59:59 UTC, which
#: `time.localtime` and the table show on every platform. JSON's `Infinity` or a 1e300 is not a time: `reconciler
#: history` once died on one with an OverflowError (issue 53).
MAX_TIME = 253_402_300_799


def _time(value: object, what: str) -> float:
    """`value` as a time of the index, finite and between 0 and MAX_TIME; ValueError naming `what` otherwise."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= MAX_TIME:  # NaN too
        raise ValueError(f"{what} has a time that is not one: {str(value)[:40]}")
    return value


@dataclass(frozen=True)
class Entry:
    """One generation: its number and content hash, when it was taken (became the generation in force), when it
    first served (converged; 0: never), when another replaced it (0: in force), how it ended, and why."""

    generation: int
    hash: str
    taken: float
    served: float = 0.0
    ended: float = 0.0
    outcome: str = IN_FORCE
    why: str = ""
    #: The co-tenants this generation stopped (node, name, container id): what a rollback to generation 0 starts.
    stopped: tuple[StoppedCoTenant, ...] = ()

    @classmethod
    def from_dict(cls, data: object) -> Entry:
        if not isinstance(data, dict):
            raise ValueError("an entry is not a JSON object")
        entry = cls(**{k: data[k] for k in ("generation", "hash", "taken", "served", "ended", "outcome", "why")
                       if k in data}, stopped=_stopped(data.get("stopped", [])))
        if type(entry.generation) is not int or not all(isinstance(v, str) for v in (entry.hash, entry.outcome,
                                                                                    entry.why)):
            raise ValueError(f"entry {str(entry.generation)[:40]} is not a generation")
        for t in (entry.taken, entry.served, entry.ended):
            _time(t, f"entry {entry.generation}")
        return entry


def _stopped(data: object) -> tuple[StoppedCoTenant, ...]:
    """The `stopped` list of an entry as written (`[node, name, id]` each); ValueError when it is not one."""
    if not isinstance(data, list) or not all(isinstance(t, list) and len(t) == 3 and
                                             all(isinstance(v, str) for v in t) for t in data):
        raise ValueError("an entry's `stopped` is not a list of [node, name, id]")
    return tuple(StoppedCoTenant(*t) for t in data)


@dataclass(frozen=True)
class Hold:
    """The failed generation (`generation`, its `hash`) the daemon does not enforce, the one it brought back
    (`to`), why, and since when (unix time)."""

    generation: int
    hash: str
    to: int
    why: str
    since: float

    @classmethod
    def from_dict(cls, data: object) -> Hold:
        """The hold as written; ValueError when a field is missing, unknown or not of its type (the table, the
        daemon and `reconciler rollback` read each as typed)."""
        if not isinstance(data, dict) or set(data) != {"generation", "hash", "to", "why", "since"}:
            raise ValueError("the hold is not a JSON object of generation, hash, to, why and since")
        if type(data["generation"]) is not int or type(data["to"]) is not int or data["to"] < 0 \
                or not isinstance(data["hash"], str) or not isinstance(data["why"], str):
            raise ValueError("the hold's generation, hash, to or why is not one")
        return cls(data["generation"], data["hash"], data["to"], data["why"], _time(data["since"], "the hold"))


@dataclass
class History:
    """The entries, oldest first, and the rollback hold (None: the daemon enforces the file)."""

    entries: list[Entry] = field(default_factory=list)
    hold: Hold | None = None

    def entry(self, generation: int) -> Entry | None:
        return next((e for e in self.entries if e.generation == generation), None)

    def last_served(self, before: int) -> Entry | None:
        """The newest generation older than `before` that served: what a rollback brings back."""
        return next((e for e in reversed(self.entries) if e.generation < before and e.served), None)

    def table(self) -> str:
        """`reconciler history`: a line per generation, newest first, and the hold."""
        def when(t: float) -> str:
            return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) if t else "-"

        rows = [("GEN", "TAKEN", "SERVED", "ENDED", "OUTCOME")] + [
            (str(e.generation), when(e.taken), when(e.served), when(e.ended),
             printable(e.outcome + (f": {e.why}" if e.why else ""))) for e in reversed(self.entries)]
        widths = [max(len(r[i]) for r in rows) for i in range(4)]
        lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=False)) + "  " + r[4] for r in rows]
        if not self.entries:
            lines.append("(no generation kept)")
        if self.hold is not None:
            back = AS_FOUND if self.hold.to == 0 else f"generation {self.hold.to}"
            lines.append(printable(f"\nrolled back: generation {self.hold.generation} is held, {back} is "
                                   f"served in its place since {when(self.hold.since)} ({self.hold.why})"))
        return "\n".join(lines)

    def to_json(self) -> str:
        return json.dumps({"entries": [{**asdict(e), "stopped": [[t.node, t.name, t.id] for t in e.stopped]}
                                       for e in self.entries],
                           "hold": asdict(self.hold) if self.hold else None}, indent=1)

    @classmethod
    def from_json(cls, text: str) -> History:
        """The index as written; ValueError says what is not (any text: never another exception)."""
        try:
            data = json.loads(text)
        except RecursionError:  # nesting deeper than the interpreter's stack
            raise ValueError("not a history: nested too deep") from None
        if not isinstance(data, dict) or not isinstance(data.get("entries"), list):
            raise ValueError("not a history: no entries")
        hold = data.get("hold")
        if hold is not None and not isinstance(hold, dict):
            raise ValueError("the hold is not a JSON object")
        try:
            return cls([Entry.from_dict(e) for e in data["entries"]], Hold.from_dict(hold) if hold else None)
        except TypeError as exc:  # a field missing or unknown
            raise ValueError(str(exc)) from None


def directory(state_dir: Path, path: Path) -> Path:
    return Path(state_dir) / f"history-{path_key(path)}"


def read(state_dir: Path, path: Path, daemon: bool = True) -> History:
    """The history of the desired state at `path`; an empty one when there is none. For the daemon (`daemon`),
    one that cannot be parsed is logged and moved aside (`index.json.corrupt`) and starts again: the texts stay
    where they are. For a command (`daemon=False`), nothing is moved: an OSError (a state dir this user may not
    read) or a ValueError says why."""
    index = directory(state_dir, path) / "index.json"
    try:
        return History.from_json(index.read_text())
    except FileNotFoundError:
        return History()
    except (OSError, ValueError) as exc:
        if not daemon:
            raise
        aside = index.with_name("index.json.corrupt")
        try:
            index.replace(aside)
        except OSError:
            pass
        _log.error("history.corrupt", file=str(index), error=str(exc), kept=str(aside))
        return History()


def text_of(state_dir: Path, path: Path, generation: int) -> str | None:
    """The file as it was at `generation`; None when it is not kept."""
    return _kept_text(directory(state_dir, path), generation)


def _kept_text(where: Path, generation: int) -> str | None:
    try:
        return (where / f"{generation}.yaml").read_text()
    except (OSError, UnicodeDecodeError):
        return None


class HistoryStore:
    """The daemon's writer of one file's history. A write that fails is logged and the history stays in memory:
    the history informs rollbacks and people, it never blocks the loop (the generation store says whether the state
    dir holds the generation in force)."""

    def __init__(self, state_dir: Path, path: Path, keep: int = 10) -> None:
        self.dir = directory(state_dir, path)
        self.history = read(state_dir, path)
        self.keep = keep
        self.error: str | None = None  # why the last write failed (None: the disk holds it)

    @property
    def hold(self) -> Hold | None:
        return self.history.hold

    def taken(self, generation: int, digest: str, text: str | None, now: float) -> Hold | None:
        """`generation` (content `digest`, read from `text`) is the file's generation in force. The one before it
        ended (served, or replaced before it did); a new content ends a rollback hold. Returns the hold that
        still applies: the same failed content read again after a daemon restart stays held."""
        h = self.history
        current = h.entry(generation)
        if current is not None and current.hash == digest:
            held = h.hold is not None and h.hold.hash == digest and h.hold.generation == generation
            return h.hold if held and not current.served else None
        # Numbers at or above this one belong to a count that restarted (a state file lost, issue 34): forgotten.
        h.entries = [e if e.ended else replace(e, ended=now, outcome=e.outcome if e.outcome != IN_FORCE
                                               else SERVED if e.served else REPLACED)
                     for e in h.entries if e.generation < generation]
        h.entries.append(Entry(generation, digest, now))
        h.hold = None
        self._write(text, generation)
        return None

    def served(self, generation: int, now: float) -> None:
        """`generation` converged, enforcing: it served. Said once, at the first time; a failure said of it
        before (a first generation that failed, then came up) is over, and so is any hold of it. A `now` no index
        may hold (the state file's last convergence, damaged to 1e300: the next read would refuse the whole index)
        is taken as the time of this call."""
        now = now if 0 <= now <= MAX_TIME else time.time()
        e = self.history.entry(generation)
        if e is not None and not e.served:
            if self.history.hold is not None and self.history.hold.generation == generation:
                self.history.hold = None
            self._update(replace(e, served=now, outcome=IN_FORCE, why=""))

    def stopped(self, generation: int, tenant: StoppedCoTenant) -> None:
        """`generation` stopped the co-tenant `tenant` to make room (written at once: a crash right after must not
        forget what to bring back). A container stopped again under the same id is recorded once."""
        e = self.history.entry(generation)
        if e is not None and tenant not in e.stopped:
            self._update(replace(e, stopped=(*e.stopped, tenant)))

    def failed(self, generation: int, why: str) -> None:
        """`generation` failed before it served, with nothing to bring back (or a policy that does not): said in
        its entry, written only when that changes (a failure seen every reconcile is one write)."""
        e = self.history.entry(generation)
        if e is not None and not e.served and (e.outcome, e.why) != (FAILED, why):
            self._update(replace(e, outcome=FAILED, why=why))

    def rolled_back(self, generation: int, to: int, why: str, now: float) -> Hold | None:
        """`generation` failed before it served and `to` is enforced in its place: the hold, recorded (None: the
        generation is not one to hold)."""
        e = self.history.entry(generation)
        if e is None or e.served:
            return None
        self.history.hold = Hold(generation, e.hash, to, why, now)
        self._update(replace(e, outcome=f"{ROLLED_BACK} to {AS_FOUND if to == 0 else to}", why=why, ended=now))
        return self.history.hold

    def release(self) -> None:
        """The hold ends without a new content (what it brought back can no longer be taken)."""
        if self.history.hold is not None:
            self.history.hold = None
            self._write(None, None)

    def text(self, generation: int) -> str | None:
        return _kept_text(self.dir, generation)

    def _update(self, entry: Entry) -> None:
        self.history.entries = [entry if e.generation == entry.generation else e for e in self.history.entries]
        self._write(None, None)

    def _pruned(self) -> list[Entry]:
        """The newest `keep` entries and the newest that served."""
        entries = self.history.entries
        kept = entries[-self.keep:]
        last = next((e for e in reversed(entries) if e.served), None)
        return [e for e in entries if e in kept or e is last]

    def _write(self, text: str | None, generation: int | None) -> None:
        try:
            if text is not None and generation is not None:
                write_durably(self.dir / f"{generation}.yaml", text)
            self.history.entries = self._pruned()
            write_durably(self.dir / "index.json", self.history.to_json())
            kept = {f"{e.generation}.yaml" for e in self.history.entries}
            for old in self.dir.glob("*.yaml"):
                if old.name not in kept:
                    old.unlink()
            self.error = None
        except OSError as exc:
            self.error = f"cannot write the history in {self.dir}: {exc.strerror or exc}"
            _log.warning("history.unwritten", error=self.error)


def rollback_target(history: History, generation: int | None) -> Entry:
    """The generation `reconciler rollback` writes back: the one asked for, else the one the daemon brought back
    (a hold), else the newest that served before the newest taken. ValueError says why there is none."""
    if generation is not None:
        entry = history.entry(generation)
        if entry is None:
            kept = ", ".join(str(e.generation) for e in history.entries) or "none"
            raise ValueError(f"generation {generation} is not kept (kept: {kept})")
        return entry
    if history.hold is not None and (held := history.entry(history.hold.to)) is not None:
        return held
    newest = history.entries[-1].generation if history.entries else 0
    back = history.last_served(newest)
    if back is None:
        raise ValueError("no generation before the newest served: name one (`reconciler history` lists them)")
    return back


def write_back(path: Path, text: str, now: float) -> Path:
    """Write a kept generation's `text` over the desired-state file, atomically and durably, after a copy of what
    it held (`NAME.before-rollback-UNIXTIME[-N]` beside it, never over an earlier copy). Both are written with the
    file's owner and mode before they take their names (the daemon refuses a file others may change, and a crash
    between a rename and a chmod would leave it unreadable to the daemon's user). A symlinked file is written
    where it points (a desired state kept in a checkout stays there). Returns the copy's path."""
    real = Path(os.path.realpath(path))
    st = real.stat()
    copy = real.with_name(f"{real.name}.before-rollback-{int(now)}")
    n = 1
    while copy.exists():
        n += 1
        copy = real.with_name(f"{real.name}.before-rollback-{int(now)}-{n}")
    write_durably(copy, real.read_text(), like=st)
    write_durably(real, text, like=st)
    return copy
