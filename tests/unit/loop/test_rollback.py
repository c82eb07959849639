"""History and rollback (reconciler.loop.history): a change that never serves brings the last generation that
served back up, holds the failed one until the file changes, says so, and survives a daemon restart; the
history keeps each generation's own text, and `reconciler rollback` writes one back without losing the file.

The controller runs with the fakes of test_controller_loop (scripted observations, a gate for the steps); the
oracle for "what is enforced" is the file's own text (its max_model_len), not the controller's plan.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from types import SimpleNamespace

import pytest
from click.testing import CliRunner

from reconciler.cli import main
from reconciler.core import spec
from reconciler.core.observed import ServeFlags
from reconciler.core.planning import Step, plan
from reconciler.core.restore import StoppedCoTenant
from reconciler.core.simulate import apply_plan
from reconciler.core.spec import load, loads
from reconciler.core.vllm import parse_serve_help
from reconciler.edge.execute import StepResult
from reconciler.loop import history
from reconciler.loop.history import FAILED, IN_FORCE, REPLACED, SERVED, HistoryStore
from reconciler.loop.metrics import REGISTRY
from reconciler.loop.reasons import Reason
from reconciler.loop.rollback import decide
from reconciler.loop.rollback import touches as _touches
from tests.unit.loop.test_controller_loop import Gate, Script, _condition, _controller

FIXTURES = Path(__file__).parents[1] / "fixtures"

OLD, NEW = "max_model_len: 32768", "max_model_len: 16384"


def _edit(path, old, new) -> None:
    text = path.read_text()
    assert old in text
    path.write_text(text.replace(old, new))


def _failed_start(desired_path, tmp_path, converged, policy: str | None = None):
    """Generation 1 serves; generation 2 (max_model_len halved) is started and its await-health fails."""
    if policy:
        _edit(desired_path, "policy:", f"policy:\n  on_failed_change: {policy}")
    gate = Gate(failing=("await-health",))
    gate.release.set()
    c, requests = _controller(desired_path, tmp_path, Script(converged), gate)
    c.image.query = SimpleNamespace(get=lambda wanted: None)  # type: ignore[assignment]  # no image to ask here
    assert c.reconcile({Reason("start")}).phase == "Converged"
    _edit(desired_path, OLD, NEW)
    c.reconcile({Reason("file")})
    assert c.store.generation == 2 and any("await-health" in s for s in gate.batches[-1]), "the change starts"
    assert c.operations.join(20)
    return c, gate


def test_a_change_whose_start_fails_brings_back_the_last_generation_that_served(desired_path, tmp_path, converged):
    before = REGISTRY.get_sample_value("reconciler_rollbacks_total") or 0
    c, gate = _failed_start(desired_path, tmp_path, converged)
    result = c.reconcile({Reason("operation")})

    assert c.desired is not None and c.desired.serving.max_model_len == 32768, "generation 1's state is enforced"
    assert c.held is not None and (c.held.generation, c.held.to) == (2, 1)
    assert result.phase == "RolledBack" and c.status["phase"] == "RolledBack"
    assert c.status["rollback"]["to"] == 1 and "await-health" in c.status["rollback"]["why"]
    rolled = _condition(c.status, "", "RolledBack")
    assert rolled["status"] == "True" and "`reconciler rollback 1`" in rolled["message"]
    assert _condition(c.status, "", "Ready")["status"] == "False", "the file's generation is not what runs"
    assert REGISTRY.get_sample_value("reconciler_rolled_back") == 1
    assert REGISTRY.get_sample_value("reconciler_rolled_back_to_generation") == 1
    assert REGISTRY.get_sample_value("reconciler_rollbacks_total") == before + 1
    assert REGISTRY.get_sample_value("reconciler_converged") == 0
    assert c.store.observed_generation == 1, "generation 2 was never reached"
    kept = history.read(tmp_path / "state", desired_path)
    assert [(e.generation, e.outcome) for e in kept.entries] == [(1, SERVED), (2, "rolled back to 1")]
    assert kept.entries[0].served > 0 and kept.entries[1].served == 0


def test_a_rollback_survives_a_daemon_restart_and_ends_when_the_file_changes(desired_path, tmp_path, converged):
    c, _ = _failed_start(desired_path, tmp_path, converged)
    c.reconcile({Reason("operation")})
    assert c.held is not None

    again, _ = _controller(desired_path, tmp_path, Script(converged), Gate())
    again.image.query = SimpleNamespace(get=lambda wanted: None)  # type: ignore[assignment]
    assert again.reconcile({Reason("start")}).phase == "RolledBack", "the failed change is not tried again"
    assert again.store.generation == 2 and again.desired is not None and again.desired.serving.max_model_len == 32768

    _edit(desired_path, NEW, "max_model_len: 8192")
    gate = Gate()
    again.operations = type(again.operations)(on_end=lambda: None, run=gate)
    again.reconcile({Reason("file")})
    assert again.held is None and again.store.generation == 3
    assert again.desired is not None and again.desired.serving.max_model_len == 8192
    assert REGISTRY.get_sample_value("reconciler_rolled_back") == 0
    gate.release.set()
    assert again.operations.join(20)


def test_a_change_the_image_refuses_is_rolled_back_before_anything_stops(desired_path, tmp_path, converged):
    gate = Gate()
    c, _ = _controller(desired_path, tmp_path, Script(converged), gate)
    known = parse_serve_help((FIXTURES / "vllm-0.32.0-cpu-serve-help-all.txt").read_text())
    c.image.query = SimpleNamespace(  # type: ignore[assignment]
        get=lambda wanted: ServeFlags(image_id=wanted[1], flags=[f for f in known if f != "--max-model-len"]))
    assert c.reconcile({Reason("start")}).phase == "Converged"
    _edit(desired_path, OLD, NEW)
    assert c.reconcile({Reason("file")}).phase == "RolledBack"
    assert gate.batches == [], "nothing was stopped or started"
    assert c.held is not None and "does not know --max-model-len" in c.held.why
    assert c.desired is not None and c.desired.serving.max_model_len == 32768


def test_policy_hold_keeps_trying_the_change(desired_path, tmp_path, converged):
    c, _ = _failed_start(desired_path, tmp_path, converged, policy="hold")
    c.reconcile({Reason("operation")})
    assert c.held is None and c.desired is not None and c.desired.serving.max_model_len == 16384
    assert c.status["phase"] != "RolledBack" and c.status["rollback"] is None


def test_a_first_generation_that_fails_has_nothing_to_go_back_to(desired_path, tmp_path, converged):
    _edit(desired_path, OLD, NEW)  # what runs is not the file's first generation: it restarts, and fails
    gate = Gate(failing=("await-health",))
    gate.release.set()
    c, _ = _controller(desired_path, tmp_path, Script(converged), gate)
    c.image.query = SimpleNamespace(get=lambda wanted: None)  # type: ignore[assignment]
    c.reconcile({Reason("start")})
    assert c.operations.join(20)
    assert any("await-health" in s for s in gate.batches[-1]), "the first start is made"
    c.reconcile({Reason("operation")})
    assert c.held is None
    assert [(e.generation, e.outcome) for e in history.read(tmp_path / "state", desired_path).entries] == [
        (1, FAILED)]


# ---------------------------------------------------------------------------------------------- the store


def test_the_history_keeps_the_newest_and_the_last_that_served(tmp_path):
    store = HistoryStore(tmp_path, tmp_path / "c.yaml", keep=3)
    store.taken(1, "h1", "one\n", 10.0)
    store.served(1, 11.0)
    for g in range(2, 7):
        store.taken(g, f"h{g}", f"text {g}\n", 10.0 * g)
    kept = history.read(tmp_path, tmp_path / "c.yaml")
    assert [e.generation for e in kept.entries] == [1, 4, 5, 6], "the newest 3, and 1: the last that served"
    assert [e.outcome for e in kept.entries] == [SERVED, REPLACED, REPLACED, IN_FORCE]
    assert sorted(p.name for p in store.dir.glob("*.yaml")) == ["1.yaml", "4.yaml", "5.yaml", "6.yaml"]
    assert history.text_of(tmp_path, tmp_path / "c.yaml", 1) == "one\n"


def test_the_same_content_read_again_is_not_a_new_entry(tmp_path):
    store = HistoryStore(tmp_path, tmp_path / "c.yaml")
    store.taken(1, "h1", "one\n", 10.0)
    store.taken(1, "h1", "one\n", 20.0)
    assert [(e.generation, e.taken) for e in store.history.entries] == [(1, 10.0)]


def test_an_unreadable_history_is_moved_aside_and_starts_again(tmp_path):
    where = history.directory(tmp_path, tmp_path / "c.yaml")
    where.mkdir()
    (where / "index.json").write_text('{"entries": [{"generation": "x"}]}')
    assert history.read(tmp_path, tmp_path / "c.yaml").entries == []
    assert (where / "index.json.corrupt").exists()


@pytest.mark.parametrize("broken", ['{"entries": 3}', "[]", '{"entries": [], "hold": 1}', "{", '{"entries": [{}]}'])
def test_a_history_that_is_not_one_is_refused(broken):
    with pytest.raises(ValueError):
        history.History.from_json(broken)


def test_the_rollback_target(tmp_path):
    store = HistoryStore(tmp_path, tmp_path / "c.yaml")
    for g, served in ((1, True), (2, True), (3, False)):
        store.taken(g, f"h{g}", f"t{g}", float(g))
        if served:
            store.served(g, float(g))
    h = store.history
    assert history.rollback_target(h, None).generation == 2, "the newest that served before the newest"
    assert history.rollback_target(h, 1).generation == 1
    with pytest.raises(ValueError, match="generation 9 is not kept"):
        history.rollback_target(h, 9)
    store.rolled_back(3, 2, "await-health failed", 4.0)
    assert h.hold is not None and h.hold.to == 2
    assert history.rollback_target(h, None).generation == 2


# ---------------------------------------------------------------------------------------------- the CLI


def _served_then_changed(desired_path, tmp_path):
    """Generation 1 (the file as it is) served; generation 2 (an edit) is in force."""
    first = desired_path.read_text()
    store = HistoryStore(tmp_path / "state", desired_path)
    store.taken(1, load(desired_path).fingerprint(), first, 100.0)
    store.served(1, 150.0)
    _edit(desired_path, OLD, NEW)
    store.taken(2, load(desired_path).fingerprint(), desired_path.read_text(), 200.0)
    return first


def test_reconciler_rollback_writes_the_generation_back_and_keeps_a_copy(desired_path, tmp_path):
    first = _served_then_changed(desired_path, tmp_path)
    second = desired_path.read_text()
    os.chmod(desired_path, 0o640)
    out = CliRunner().invoke(main, ["rollback", str(desired_path), "--state-dir", str(tmp_path / "state"),
                                    "--daemon-user", "root"], env=dict(os.environ))
    assert out.exit_code == 0, out.output
    assert desired_path.read_text() == first, "the owner's own text, comments included"
    assert stat.S_IMODE(desired_path.stat().st_mode) == 0o640
    [copy] = tmp_path.glob("cluster.yaml.before-rollback-*")
    assert copy.read_text() == second
    assert loads(desired_path.read_text()).serving.max_model_len == 32768


def test_reconciler_rollback_writes_nothing_that_is_not_valid_today(desired_path, tmp_path):
    _served_then_changed(desired_path, tmp_path)
    (history.directory(tmp_path / "state", desired_path) / "1.yaml").write_text("nodes: [\n")
    before = desired_path.read_text()
    out = CliRunner().invoke(main, ["rollback", str(desired_path), "1", "--state-dir", str(tmp_path / "state"),
                                    "--daemon-user", "root"], env=dict(os.environ))
    assert out.exit_code == 3 and "not valid today" in out.output
    assert desired_path.read_text() == before and not list(tmp_path.glob("cluster.yaml.before-rollback-*"))


def test_reconciler_history_lists_the_generations(desired_path, tmp_path):
    _served_then_changed(desired_path, tmp_path)
    state = str(tmp_path / "state")
    text = CliRunner().invoke(main, ["history", str(desired_path), "--state-dir", state])
    assert text.exit_code == 0
    lines = text.output.splitlines()
    assert lines[0].split() == ["GEN", "TAKEN", "SERVED", "ENDED", "OUTCOME"]
    assert lines[1].split()[0] == "2" and lines[1].endswith(IN_FORCE)
    assert lines[2].split()[0] == "1" and lines[2].endswith(SERVED)
    doc = json.loads(CliRunner().invoke(main, ["history", str(desired_path), "--state-dir", state, "--json"]).output)
    assert [e["generation"] for e in doc["entries"]] == [1, 2] and doc["hold"] is None
    none = CliRunner().invoke(main, ["history", str(tmp_path / "other.yaml"), "--state-dir", state])
    assert none.exit_code == 1 and "no generation kept" in none.output


def test_a_count_that_restarted_forgets_the_numbers_it_reuses(tmp_path):
    """A lost state file restarts the generations at 1 (generations.read_record): the history's old 1..3 are
    another count's, and a rollback must never pick one of them by number."""
    store = HistoryStore(tmp_path, tmp_path / "c.yaml")
    for g in (1, 2, 3):
        store.taken(g, f"h{g}", f"t{g}", float(g))
        store.served(g, float(g))
    store.taken(1, "new", "fresh", 10.0)
    assert [(e.generation, e.hash) for e in store.history.entries] == [(1, "new")]
    assert history.text_of(tmp_path, tmp_path / "c.yaml", 1) == "fresh"
    assert store.history.last_served(1) is None


def test_a_kept_text_others_may_change_is_never_brought_back(desired_path, tmp_path, converged):
    """The kept text is as much the desired state as the file: a copy anyone may write is refused like the file
    would be (trusted_files.load_text), and the file's generation stays in force."""
    c, _ = _failed_start(desired_path, tmp_path, converged)
    kept = history.directory(tmp_path / "state", desired_path) / "1.yaml"
    os.chmod(kept, 0o666)
    c.reconcile({Reason("operation")})
    assert c.held is None and c.desired is not None and c.desired.serving.max_model_len == 16384
    kept_history = history.read(tmp_path / "state", desired_path)
    assert kept_history.hold is None, "no hold is recorded for a rollback that was not made"
    assert kept_history.entries[-1].outcome == FAILED
    out = CliRunner().invoke(main, ["rollback", str(desired_path), "1", "--state-dir", str(tmp_path / "state"),
                                    "--daemon-user", "root"], env=dict(os.environ))
    assert out.exit_code == 3 and "writable by others" in out.output

    os.chmod(kept, 0o600)  # fixed: generation 2 now comes up and serves; a restart must not roll it back
    c.image.query = SimpleNamespace(get=lambda wanted: None)  # type: ignore[assignment]
    c.history.served(2, 5.0)
    again, _ = _controller(desired_path, tmp_path, Script(converged), Gate())
    again.image.query = SimpleNamespace(get=lambda wanted: None)  # type: ignore[assignment]
    again.reconcile({Reason("start")})
    assert again.held is None and again.desired is not None and again.desired.serving.max_model_len == 16384


def _converged_on(desired_path, observed):
    desired = load(desired_path, os.environ)
    for _ in range(3):
        observed = apply_plan(desired, observed, plan(desired, observed))
    assert not plan(desired, observed).changes
    return observed


def _a_start_of(c, generation: int, result: str = "failed") -> None:
    """A start of `generation` that ended with `result`, as the operations report it."""
    step = Step("await-health", "spark-1a32", "wait")
    c.results.launched[step.id] = generation
    c._record([StepResult(step, result, 1.0, "vllm_serving on spark-1a32 is exited (exit 1):\nTraceback ...")])


def test_a_generation_that_served_is_repaired_in_place_not_rolled_back(desired_path, tmp_path, converged):
    """A start that fails after the generation served (converged, for real) is a wedge or a crash (restarted after
    unhealthy_grace), never a failed change."""
    gate = Gate()
    gate.release.set()
    c, _ = _controller(desired_path, tmp_path, Script(converged), gate)
    c.image.query = SimpleNamespace(get=lambda wanted: None)  # type: ignore[assignment]
    c.reconcile({Reason("start")})
    _edit(desired_path, OLD, NEW)
    c._observe_fn = Script(_converged_on(desired_path, converged))
    assert c.reconcile({Reason("file")}).phase == "Converged" and c.store.generation == 2
    _a_start_of(c, 2)
    c.reconcile({Reason("operation")})
    assert c.held is None and c.desired is not None and c.desired.serving.max_model_len == 16384
    assert history.read(tmp_path / "state", desired_path).entries[-1].outcome == IN_FORCE


def test_a_start_of_an_earlier_generation_that_fails_after_an_edit_rolls_nothing_back(desired_path, tmp_path,
                                                                                     converged):
    gate = Gate()
    c, _ = _controller(desired_path, tmp_path, Script(converged), gate)
    c.image.query = SimpleNamespace(get=lambda wanted: None)  # type: ignore[assignment]
    c.reconcile({Reason("start")})
    _edit(desired_path, OLD, NEW)
    c.reconcile({Reason("file")})
    _a_start_of(c, 2)
    _edit(desired_path, NEW, "max_model_len: 8192")  # generation 3 arrives with the failure of 2's start
    c.reconcile({Reason("file"), Reason("operation")})
    assert c.store.generation == 3 and c.held is None
    assert c.desired is not None and c.desired.serving.max_model_len == 8192
    gate.release.set()
    assert c.operations.join(20)


def test_the_reason_kept_is_one_line_and_never_a_secret(desired_path, tmp_path, converged):
    from reconciler.edge import log

    log.register_secret("hf_s3cr3tvalue42")
    c, _ = _failed_start(desired_path, tmp_path, converged)
    _a_start_of(c, 2)
    c.results.start_failed = (2, "default", "await-health/spark-1a32: token hf_s3cr3tvalue42 refused\nline two")
    c.reconcile({Reason("operation")})
    index = (history.directory(tmp_path / "state", desired_path) / "index.json").read_text()
    assert "hf_s3cr3tvalue42" not in index and "line two" not in index
    assert c.held is not None and "\n" not in c.held.why


def test_an_observed_generation_is_never_what_a_rollback_brings_back(desired_path, tmp_path, converged):
    """Generation 1 only observed (policy.mode observe) matched the cluster: it did not serve by the reconciler's
    hand, and bringing it back would stop nothing and start nothing."""
    _edit(desired_path, "  mode: enforce", "  mode: observe")
    gate = Gate(failing=("await-health",))
    gate.release.set()
    c, _ = _controller(desired_path, tmp_path, Script(converged), gate)
    c.image.query = SimpleNamespace(get=lambda wanted: None)  # type: ignore[assignment]
    c.reconcile({Reason("start")})
    _edit(desired_path, "  mode: observe", "  mode: enforce")
    _edit(desired_path, OLD, NEW)
    c.reconcile({Reason("file")})
    assert any("await-health" in x for x in gate.batches[-1]), "generation 2's start is made, and fails"
    assert c.operations.join(20)
    c.reconcile({Reason("operation")})
    assert c.held is None
    assert [e.served for e in history.read(tmp_path / "state", desired_path).entries] == [0.0, 0.0]


def test_only_a_deployment_the_change_touched_rolls_the_file_back():
    from tests.unit.core.test_deployments_plan import _two

    before = _two()
    data = before.model_dump(mode="json")
    data["deployments"][1]["serving"]["max_model_len"] = 1024
    after = spec.Desired.model_validate(data)
    assert _touches(after, before, "small") and not _touches(after, before, "big")
    data["deployments"].append({**data["deployments"][1], "name": "third", "serving": {
        **data["deployments"][1]["serving"], "container_name": "vllm_third", "port": 8004,
        "gpu_memory_utilization": 0.05, "served_model_name": "third"}})
    assert _touches(spec.Desired.model_validate(data), before, "third"), "a new deployment is the change's"


def _served_then(desired_path, tmp_path, converged, old: str, new: str):
    """Generation 1 serves (converged); generation 2 is the edit `old` -> `new`."""
    c, _ = _controller(desired_path, tmp_path, Script(converged), Gate())
    c.image.query = SimpleNamespace(get=lambda wanted: None)  # type: ignore[assignment]
    assert c.reconcile({Reason("start")}).phase == "Converged"
    _edit(desired_path, old, new)
    c.reconcile({Reason("file")})
    assert c.store.generation == 2
    return c


def test_a_start_that_is_blocked_is_the_nodes_condition_not_a_failed_change(desired_path, tmp_path, converged):
    c = _served_then(desired_path, tmp_path, converged, OLD, NEW)
    _a_start_of(c, 2, "blocked")  # e.g. a container not ours holds the name, or memory short with nothing stopped
    c.reconcile({Reason("operation")})
    assert c.held is None and c.desired is not None and c.desired.serving.max_model_len == 16384


def test_a_failure_of_what_the_change_left_as_it_was_is_not_the_changes(desired_path, tmp_path, converged):
    """The edit changes only the resync interval; the serving it left as it was fails its start: retried as
    before, not a reason to go back."""
    from reconciler.core.observed import Container
    from tests.unit.loop.test_controller_loop import WORKER, _with

    worker = converged.node(WORKER)
    intruder = Container(name="intruder", id="i1", image="busybox", state="running")
    busy = _with(converged, WORKER, containers=[*worker.containers, intruder])  # generation 2 does not converge
    c, _ = _controller(desired_path, tmp_path, Script(converged), Gate())
    c.image.query = SimpleNamespace(get=lambda wanted: None)  # type: ignore[assignment]
    assert c.reconcile({Reason("start")}).phase == "Converged"
    _edit(desired_path, "resync_interval: 30s", "resync_interval: 20s")
    c._observe_fn = Script(busy)
    c.reconcile({Reason("file")})
    assert c.store.generation == 2 and not history.read(tmp_path / "state", desired_path).entries[-1].served
    _a_start_of(c, 2)
    c.reconcile({Reason("operation")})
    assert c.held is None and c.desired is not None and c.desired.policy.resync_interval == 20
    c.operations.cancel_all()  # the co-tenant's stop, held at the gate
    assert c.operations.join(20)


def test_a_hold_whose_generation_can_no_longer_be_taken_ends_at_a_restart(desired_path, tmp_path, converged):
    c, _ = _failed_start(desired_path, tmp_path, converged)
    c.reconcile({Reason("operation")})
    assert c.held is not None
    (history.directory(tmp_path / "state", desired_path) / "1.yaml").write_text("nodes: [\n")
    again, _ = _controller(desired_path, tmp_path, Script(converged), Gate())
    again.image.query = SimpleNamespace(get=lambda wanted: None)  # type: ignore[assignment]
    again.reconcile({Reason("start")})
    assert again.held is None and again.desired is not None and again.desired.serving.max_model_len == 16384
    assert history.read(tmp_path / "state", desired_path).hold is None, "the history says no rollback holds"


# -- the decision alone, from data (reconciler.loop.rollback.decide: pure) ---------------------------------------

def _history(*entries) -> history.History:
    return history.History(entries=[history.Entry(g, f"h{g}", float(g), served=s, stopped=stopped)
                                    for g, s, stopped in entries])


TENANT = StoppedCoTenant("spark-1a32", "vllm_node", "c0ffee")
#: (name, the history's entries (generation, served, stopped), policy, can generation 1 be brought back,
#:  the decision's action, the generation it brings back, words of why nothing is)
DECISIONS = [
    ("it served: repaired in place", [(1, 5.0, ()), (2, 9.0, ())], "rollback", True, "none", 0, ""),
    ("not in the history", [(1, 5.0, ())], "rollback", True, "none", 0, ""),
    ("the last that served comes back", [(1, 5.0, ()), (2, 0.0, ())], "rollback", True, "roll-back", 1, ""),
    ("policy hold", [(1, 5.0, ()), (2, 0.0, ())], "hold", True, "failed", 0, "on_failed_change is hold"),
    ("nothing served before", [(2, 0.0, ())], "rollback", True, "failed", 0, "no earlier generation"),
    ("what served cannot be taken", [(1, 5.0, ()), (2, 0.0, ())], "rollback", False, "failed", 0,
     "generation 1 cannot be taken"),
    ("a first deploy that stopped co-tenants", [(2, 0.0, (TENANT,))], "rollback", True, "as-found", 0, ""),
    ("a first deploy that stopped co-tenants, hold", [(2, 0.0, (TENANT,))], "hold", True, "failed", 0,
     "on_failed_change is hold"),
]


@pytest.mark.parametrize(("name", "entries", "policy", "takeable", "action", "to", "words"), DECISIONS,
                         ids=[d[0] for d in DECISIONS])
def test_the_rollback_decision_from_data(desired_path, name, entries, policy, takeable, action, to, words):
    desired = load(desired_path, os.environ)
    desired = desired.model_copy(update={"policy": desired.policy.model_copy(update={"on_failed_change": policy})})
    served = load(desired_path, os.environ)
    asked: list[int] = []

    def bring_back(generation: int):
        asked.append(generation)
        return served if takeable else None

    decision = decide(_history(*entries), 2, desired, None, bring_back)
    assert (decision.action, decision.to) == (action, to), name
    assert words in decision.why_not
    assert asked == ([1] if action == "roll-back" or "cannot be taken" in words else []), \
        "what served is loaded only when the policy may bring it back"


def test_a_failure_of_a_deployment_the_change_left_as_it_was_is_not_the_change_s():
    from tests.unit.core.test_deployments_plan import _two

    before = _two()
    data = before.model_dump(mode="json")
    data["deployments"][1]["serving"]["max_model_len"] = 1024
    after = spec.Desired.model_validate(data)
    entries = _history((1, 5.0, ()), (2, 0.0, ()))
    assert decide(entries, 2, after, "big", lambda g: before).action == "none", "big is as it served"
    assert decide(entries, 2, after, "small", lambda g: before).action == "roll-back"
    assert decide(entries, 2, after, None, lambda g: before).action == "roll-back", "the whole file's failure"
