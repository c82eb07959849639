"""Issue 53, finding J: the history index (`history-KEY/index.json`) is a file anyone with the state dir's rights may
have written, or a disk may have mangled. Fuzzing found 2,206 of 1.9 M inputs that crashed `reconciler history`:
times out of range (JSON's `Infinity`, `1e300`: OverflowError in the table) and a hold of any type (`"since": "x"`:
TypeError). Whatever the index holds: `reconciler history` and `rollback` say it cannot be read (exit 1), the
daemon moves it aside (`index.json.corrupt`, the kept texts left where they are) and starts again, and an index
that reads is one every reader can show.
"""

from __future__ import annotations

import json
import string

import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from reconciler.cli import main
from reconciler.loop import history
from reconciler.loop.history import MAX_TIME, History, HistoryStore
from tests.unit.examples import examples

GOOD_ENTRY = {"generation": 1, "hash": "h1", "taken": 10.0, "served": 11.0, "ended": 0.0, "outcome": "in force",
              "why": "", "stopped": []}
GOOD_HOLD = {"generation": 2, "hash": "h2", "to": 1, "why": "await-health failed", "since": 12.0}


def _index(entry: dict | None = None, hold: object = None, **changes: object) -> str:
    return json.dumps({"entries": [{**GOOD_ENTRY, **(entry or {})}], "hold": hold}, **changes)  # type: ignore[arg-type]


HOSTILE = {
    "taken Infinity": _index({"taken": float("inf")}),
    "served 1e300": _index({"served": 1e300}),
    "ended past year 9999": _index({"ended": MAX_TIME + 1}),
    "taken an int too big for time_t": _index({"taken": 10**20}),
    "taken NaN": _index({"taken": float("nan")}),
    "taken negative": _index({"taken": -1}),
    "taken true": _index({"taken": True}),
    "why not text": _index({"why": ["x"]}),
    "hold since text": _index(hold={**GOOD_HOLD, "since": "x"}),
    "hold since Infinity": _index(hold={**GOOD_HOLD, "since": float("inf")}),
    "hold to a list": _index(hold={**GOOD_HOLD, "to": []}),
    "hold to negative": _index(hold={**GOOD_HOLD, "to": -1}),
    "hold generation text": _index(hold={**GOOD_HOLD, "generation": "2"}),
    "hold why a number": _index(hold={**GOOD_HOLD, "why": 5}),
    "hold a field short": _index(hold={k: v for k, v in GOOD_HOLD.items() if k != "since"}),
    "hold a field more": _index(hold={**GOOD_HOLD, "extra": 1}),
    "nested past the stack": "[" * 200_000,
    "not UTF-8": b"\xff\xfe{".decode("latin-1"),
}


def _write(state, desired, text: str | bytes) -> None:
    where = history.directory(state, desired)
    where.mkdir(parents=True, exist_ok=True)
    (where / "1.yaml").write_text("kept: 1\n")
    index = where / "index.json"
    index.write_bytes(text if isinstance(text, bytes) else text.encode("latin-1" if "\xff" in text else "utf-8"))


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_a_hostile_index_is_said_never_a_crash(tmp_path, name):
    desired, state = tmp_path / "cluster.yaml", tmp_path / "state"
    desired.write_text("x: 1\n")
    _write(state, desired, HOSTILE[name])
    for argv in (["history", str(desired)], ["history", str(desired), "--json"],
                 ["rollback", str(desired), "--daemon-user", "root"]):
        out = CliRunner().invoke(main, [*argv, "--state-dir", str(state)])
        assert out.exit_code == 1 and isinstance(out.exception, SystemExit), (argv, out.output, out.exception)
        assert "cannot read the history" in out.output or argv[0] == "rollback", out.output
    assert desired.read_text() == "x: 1\n", "rollback wrote nothing"
    store = HistoryStore(state, desired)  # the daemon: moved aside, started again, the kept text left
    assert store.history.entries == [] and store.hold is None
    where = history.directory(state, desired)
    assert (where / "index.json.corrupt").exists() and (where / "1.yaml").read_text() == "kept: 1\n"


def test_the_times_at_the_bounds_read_and_show(tmp_path):
    """0 is "not yet" and MAX_TIME (9999-12-31 23:59:59 UTC) the last time shown; an int is a time as a float is."""
    text = _index({"taken": MAX_TIME, "served": 0, "ended": 5}, hold={**GOOD_HOLD, "since": MAX_TIME})
    found = History.from_json(text)
    assert found.entries[0].taken == MAX_TIME and found.hold is not None and found.hold.since == MAX_TIME
    table = found.table()
    assert "rolled back: generation 2 is held" in table and table.splitlines()[1].split()[3] == "-"
    assert History.from_json(found.to_json()) == found


def test_the_daemon_never_writes_a_time_its_own_reader_refuses(tmp_path):
    """A state file damaged to `lastConverged: 1e300` (finite, so the record reads) once became a `served` time the
    next read refused, with the whole index."""
    store = HistoryStore(tmp_path, tmp_path / "c.yaml")
    store.taken(1, "h1", "one\n", 10.0)
    store.served(1, 1e300)
    kept = history.read(tmp_path, tmp_path / "c.yaml", daemon=False)
    assert 0 < kept.entries[0].served <= MAX_TIME


def test_the_error_names_the_entry_and_the_value():
    with pytest.raises(ValueError, match=r"^entry 1 has a time that is not one: inf$"):
        History.from_json(HOSTILE["taken Infinity"])
    with pytest.raises(ValueError, match=r"^the hold has a time that is not one: x$"):
        History.from_json(HOSTILE["hold since text"])


# -- the index under fuzzing -------------------------------------------------------------------------------------

ANY = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
                   lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
                   max_leaves=10)
TIME = st.one_of(st.integers(-5, 2**70), st.floats(allow_nan=True, allow_infinity=True),
                 st.floats(0, MAX_TIME), st.booleans(), st.text(max_size=4), st.none())
NUMBER = st.one_of(st.integers(-3, 5), ANY)
ENTRY = st.fixed_dictionaries(
    {"generation": NUMBER, "hash": st.one_of(st.just("h"), ANY)},
    optional={"taken": TIME, "served": TIME, "ended": TIME, "outcome": st.one_of(st.just("served"), ANY),
              "why": st.one_of(st.just("w"), ANY), "stopped": st.one_of(st.just([["n", "c", "id"]]), ANY)})
HOLD = st.one_of(st.none(), ANY, st.fixed_dictionaries(
    {"generation": NUMBER, "hash": st.one_of(st.just("h"), ANY), "to": NUMBER, "why": st.one_of(st.just("w"), ANY),
     "since": TIME}))
INDEX = st.one_of(st.fixed_dictionaries({"entries": st.lists(ENTRY, max_size=4), "hold": HOLD}).map(json.dumps),
                  st.text(string.printable, max_size=200), ANY.map(json.dumps))


def _every_reader(found: History) -> None:
    """What `reconciler history` (both forms), `rollback` and the daemon do with an index that reads."""
    found.table()
    assert History.from_json(found.to_json()) == found, "what is written reads back the same"
    try:
        history.rollback_target(found, None)
    except ValueError:
        pass
    if found.entries:
        history.rollback_target(found, found.entries[0].generation)


@settings(**examples(400), deadline=None, suppress_health_check=list(HealthCheck))
@given(text=INDEX)
@example(text=HOSTILE["taken Infinity"])
@example(text=HOSTILE["hold since text"])
@example(text=_index(hold={**GOOD_HOLD, "to": 7}))  # a hold back to a generation not kept
def test_any_index_reads_as_one_every_reader_shows_or_as_a_value_error(text):
    try:
        found = History.from_json(text)
    except ValueError:
        return
    _every_reader(found)
