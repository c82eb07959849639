"""The plan says what changes (issue 33, findings 2 and 3): a serving restart names the launch fields that differ,
old -> new, as Terraform's `~ max_model_len = 32768 -> 65536  # forces replacement`, says up front that it stops
serving (an outage of about one cold start), and a rotated secret shows as `secret NAME changed`, never a value.

The old side is the running container's launch label (`spark-reconciler.launch`, core/vllm.py `launch_inputs`).
Each case starts from the recorded converged 4-node cluster (tests/unit/recorded.py) whose serving containers were
started from one file, and plans another.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from reconciler.cli.plan_text import plan_text
from reconciler.core import spec
from reconciler.core.drift import FieldChange, field_changes, serving_drift
from reconciler.core.observed import (
    LABEL_LAUNCH,
    LABEL_SPEC_HASH,
    MAX_LAUNCH_LABEL,
    MAX_LAUNCH_VALUE,
    Container,
    NodeObservation,
    Observed,
    parse_launch_label,
)
from reconciler.core.planning import Downtime, plan
from reconciler.core.vllm import LaunchSpec, launch_label, launch_specs, secret_fingerprint
from tests.unit.examples import examples
from tests.unit.recorded import WORKERS, changed, load, serving_with
from tests.unit.strategies import desired_dict, desireds

NAME = "vllm_serving"
ALL = ("head", *WORKERS)
KEY, ROTATED = "sk-live-0123456789abcdef", "sk-live-rotated-fedcba9876"


def started_labels(s: LaunchSpec) -> dict[str, str]:
    """The labels `docker run` gives the container, read off the argv the serving step runs."""
    argv = s.run_argv(1, env_file="/dev/stdin")
    return dict(argv[i + 1].split("=", 1) for i, a in enumerate(argv) if a == "--label")


def running(desired: spec.Desired, seen: Observed, **labels: str) -> Observed:
    """`seen` with each serving container as a start from `desired` left it: its spec hash and launch label
    (`labels` over them, by node)."""
    out = seen
    for s in launch_specs(desired):
        c = out.node(s.node).container(NAME)
        assert c is not None
        new = {k: v for k, v in started_labels(s).items() if k in (LABEL_SPEC_HASH, LABEL_LAUNCH)}
        if s.node in labels:
            new[LABEL_LAUNCH] = labels[s.node]
        out = changed(out, s.node, containers=serving_with(out, s.node, labels={**c.labels, **new}))
    return out


def with_secret(scope: str, value: str, *edits: tuple[str, str]) -> spec.Desired:
    return load(("  served_model_name: tiny-moe", f"  served_model_name: tiny-moe\n  secrets: {{VLLM_API_KEY: "
                                                  f"{scope}}}"), *edits).with_secrets({"VLLM_API_KEY": value})


def restarts(result) -> list[str]:
    return [s.node for s in result.steps if s.kind == "stop-serving"]


# ------------------------------------------------------------------------------------------------ a field


def test_a_longer_context_names_the_field_old_to_new_and_the_outage(desired, seen):
    after = load(("max_model_len: 4096", "max_model_len: 8192"))
    result = plan(after, running(desired, seen))
    new, old = ({s.node: s.spec_hash for s in launch_specs(d)} for d in (after, desired))
    change = FieldChange("serving.max_model_len", "4096", "8192")
    assert [(d.node, d.observed, d.changes) for d in result.drift] == [
        (n, f"spec {old[n]} (serving.max_model_len = 4096 -> 8192)", (change,)) for n in ALL]
    assert result.downtime == Downtime(ALL, (), 120.0)
    assert plan_text(result).startswith(
        "This plan stops serving on 4 nodes (head, worker1, worker2, worker3): the API is down for about one cold "
        "start (serving.health_timeout: up to 2m).\n"
        "  ~ serving.max_model_len = 4096 -> 8192  # forces replacement: head, worker1, worker2, worker3\n\nDrift:\n")
    assert f"expected spec {new['head']}; observed spec {old['head']} (serving.max_model_len" in plan_text(result)
    doc = json.loads(json.dumps(result.as_dict()))
    assert doc["field_changes"] == [{"node": n, "field": "serving.max_model_len", "old": "4096", "new": "8192",
                                     "secret": False, "action": "changed"} for n in ALL]
    assert doc["downtime"] == {"nodes": list(ALL), "restart_with": [], "health_timeout_seconds": 120.0}


def test_a_field_set_and_one_unset_say_null_on_the_side_that_has_none(desired, seen):
    after = load(("  max_model_len: 4096\n", ""), ("  served_model_name: tiny-moe", "  served_model_name: tiny-moe\n"
                                                   "  extra_args: [--enforce-eager]"))
    [drift, *_] = plan(after, running(desired, seen)).drift
    assert [c.words() for c in drift.changes] == ["serving.extra_args = null -> --enforce-eager",
                                                  "serving.max_model_len = 4096 -> null"]
    assert [c.action for c in drift.changes] == ["added", "removed"]
    assert "  + serving.extra_args = null -> --enforce-eager  # forces replacement: head, worker1" in plan_text(
        plan(after, running(desired, seen)))


def test_one_ranks_own_field_restarts_the_group_and_says_the_others_go_with_it(desired, seen):
    worker2 = "host: 10.231.1.12            # reachable only from the head, as the seed's worker\n      user: "
    after = load((worker2 + "spark", worker2 + "vllm"))  # worker2's compile caches move to the new user's home
    result = plan(after, running(desired, seen))
    assert [(d.node, [c.words() for c in d.changes]) for d in result.drift] == [
        ("worker2", ["nodes.worker2.ssh.user = spark -> vllm"])]
    assert restarts(result) == list(ALL)  # a tensor-parallel group restarts as a whole (planning, as before)
    assert result.downtime == Downtime(ALL, ("head", "worker1", "worker3"), 120.0)
    assert ("  head, worker1, worker3 restart too, though nothing of their own changed: the ranks of one "
            "tensor-parallel group start together.") in plan_text(result)


def test_the_heads_address_changes_every_rank_that_points_at_it(desired, seen):
    after = load(("address: 10.232.0.10/24", "address: 10.232.0.30/24"))
    result = plan(after, running(desired, seen))
    assert {d.node: [c.field for c in d.changes] for d in result.drift} == {
        "head": ["nodes.head.fabric.address"], **{w: ["nodes.head.fabric.address"] for w in WORKERS}}


def test_the_same_file_rendered_differently_says_it_is_the_reconciler_not_a_field(desired, seen):
    c = seen.node("worker1").container(NAME)
    assert c is not None
    observed = running(desired, seen)
    label = started_labels(launch_specs(desired)[1])[LABEL_LAUNCH]
    observed = changed(observed, "worker1", containers=serving_with(
        observed, "worker1", labels={**c.labels, LABEL_SPEC_HASH: "0", LABEL_LAUNCH: label}))
    [drift] = plan(desired, observed).drift
    assert (drift.observed, drift.changes) == (
        "spec 0 (no field of the file differs: the reconciler renders the launch differently now (an upgrade))", ())


def test_a_container_started_before_the_label_says_so_and_only_the_hashes(desired, seen):
    after = load(("max_model_len: 4096", "max_model_len: 8192"))
    result = plan(after, seen)  # the recording's containers carry no launch label
    old = {s.node: s.spec_hash for s in launch_specs(desired)}
    assert [d.observed for d in result.drift] == [f"spec {old[n]} (started before field labels)" for n in ALL]
    assert result.field_changes == [] and result.as_dict()["field_changes"] == []
    assert result.downtime == Downtime(ALL, (), 120.0)  # the outage is said all the same
    assert plan_text(result).startswith("This plan stops serving on 4 nodes")


def test_no_outage_is_announced_where_nothing_runs_or_nothing_runs_the_steps(desired, seen):
    after = load(("max_model_len: 4096", "max_model_len: 8192"))
    stopped = seen
    for n in ALL:
        stopped = changed(stopped, n, containers=serving_with(stopped, n, state="exited"))
    assert plan(after, stopped).downtime is None
    observing = load(("max_model_len: 4096", "max_model_len: 8192"), ("mode: enforce", "mode: observe"))
    result = plan(observing, running(desired, seen))
    assert result.downtime is None and len(result.field_changes) == 4
    assert plan_text(result).startswith("Serving launch fields that differ from the running containers:\n"
                                        "  ~ serving.max_model_len = 4096 -> 8192  # forces replacement: head, ")


# ------------------------------------------------------------------------------------------------ secrets


def test_a_rotated_key_is_secret_name_changed_and_never_its_value(seen):
    before, after = with_secret("head", KEY), with_secret("head", ROTATED)
    result = plan(after, running(before, seen))
    [drift] = result.drift  # the key reaches the head alone: only its launch changed
    assert (drift.node, [c.words() for c in drift.changes]) == ("head", ["secret VLLM_API_KEY changed"])
    assert restarts(result) == list(ALL) and result.downtime == Downtime(ALL, WORKERS, 120.0)
    text, doc = plan_text(result), json.dumps(result.as_dict())
    assert "  ~ secret VLLM_API_KEY changed  # forces replacement: head\n" in text
    assert result.as_dict()["field_changes"] == [{"node": "head", "field": "serving.secrets.VLLM_API_KEY",
                                                  "old": None, "new": None, "secret": True, "action": "changed"}]
    prints = [secret_fingerprint("VLLM_API_KEY", v) for v in (KEY, ROTATED)]
    for shown in (text, doc):
        assert not [v for v in (KEY, ROTATED, *prints) if v in shown]


def test_the_label_holds_a_fingerprint_of_the_key_never_the_key(seen):
    head = launch_specs(with_secret("head", KEY))[0]
    label = started_labels(head)[LABEL_LAUNCH]
    assert json.loads(label)["serving.secrets.VLLM_API_KEY"] == secret_fingerprint("VLLM_API_KEY", KEY)
    assert KEY not in " ".join(head.run_argv(1, env_file="/dev/stdin"))


@pytest.mark.parametrize(("scope", "internet", "reached"), [
    ("head", (), {"head"}),
    ("internet", (), {"head"}),  # the testbed's head alone has internet
    ("internet", ("worker2",), {"head", "worker2"}),
    ("serving", (), set(ALL)),
])
def test_a_rotated_secret_changes_the_launch_of_exactly_the_nodes_its_scope_reaches(scope, internet, reached):
    edits = [(f"address: 10.232.1.{11 + WORKERS.index(w)}/24\n    internet: false",
              f"address: 10.232.1.{11 + WORKERS.index(w)}/24\n    internet: true") for w in internet]
    before, after = with_secret(scope, KEY, *edits), with_secret(scope, ROTATED, *edits)
    pairs = zip(launch_specs(before), launch_specs(after), strict=True)
    assert {a.node for a, b in pairs if a.spec_hash != b.spec_hash} == reached
    assert {a.node for a in launch_specs(after) if "serving.secrets.VLLM_API_KEY" in a.inputs} == reached


def test_a_secret_whose_scope_reaches_no_serving_node_restarts_nothing(seen):
    offline = ("    internet: true             # declared only", "    internet: false            # offline")
    before, after = with_secret("internet", KEY, offline), with_secret("internet", ROTATED, offline)
    result = plan(after, running(before, seen))
    assert (result.drift, result.steps, result.downtime) == ([], [], None)


def test_with_one_node_serving_a_rotated_secret_restarts_that_node_alone(seen):
    one = ("tensor_parallel_size: 4", "tensor_parallel_size: 1")
    before, after = with_secret("serving", KEY, one), with_secret("serving", ROTATED, one)
    alone = seen
    for w in WORKERS:
        alone = changed(alone, w, containers=[c for c in alone.node(w).containers if c.name != NAME])
    result = plan(after, running(before, alone))
    assert [(d.node, [c.words() for c in d.changes]) for d in result.drift] == [
        ("head", ["secret VLLM_API_KEY changed"])]
    assert {s.node for s in result.steps} == {"head"} and result.downtime == Downtime(("head",), (), 120.0)


def test_a_worker_gaining_a_secret_the_ray_head_lacks_changes_the_heads_launch_too():
    """The Ray head tells vLLM not to copy any name its ranks set to the workers (keep_local): a name only a
    worker holds is part of the head's launch, and its diff says so."""
    raw = desired_dict(n_nodes=2, launcher="ray")
    raw["serving"]["secrets"] = {"HF_TOKEN": "internet"}
    raw["nodes"][0]["internet"] = False
    before = spec.Desired.model_validate(raw).with_secrets({"HF_TOKEN": "hf_0123456789"})
    raw["nodes"][1]["internet"] = True
    after = spec.Desired.model_validate(raw).with_secrets({"HF_TOKEN": "hf_0123456789"})
    diffs = [field_changes(a.inputs, b.inputs) for a, b in zip(launch_specs(before), launch_specs(after), strict=True)]
    assert [[c.words() for c in d] for d in diffs] == [["ray.env_of_other_ranks = null -> HF_TOKEN"],
                                                       ["secret HF_TOKEN added"]]


# ------------------------------------------------------------------------------------------------ odd labels


HOSTILE = {
    "huge": json.dumps({"serving.max_model_len": "1" * 100, **{f"k{i}": "v" * 150 for i in range(300)}}),
    "not JSON": '{"serving.max_model_len": "4096"',
    "not an object": '["serving.max_model_len", "4096"]',
    "a number": '{"serving.max_model_len": 4096}',
    "control characters": json.dumps({"serving.max_model_len": "4096\x1b[2J\n~ secret X changed"}),
    "a key the writer never writes": json.dumps({"serving.max_model_len\n": "4096"}),
    "a value beyond the bound": json.dumps({"serving.max_model_len": "4" * (MAX_LAUNCH_VALUE + 1)}),
    "deep": "[" * 100_000,
    "deep within the bound": "[" * (MAX_LAUNCH_LABEL - 1),
    "empty": "",
}


@pytest.mark.parametrize("label", HOSTILE.values(), ids=HOSTILE.keys())
def test_a_label_the_writer_could_not_have_written_falls_back_to_the_hashes(desired, seen, label):
    after = load(("max_model_len: 4096", "max_model_len: 8192"))
    result = plan(after, running(desired, seen, worker2=label))
    drift = {d.node: d for d in result.drift}
    old = launch_specs(desired)[2].spec_hash
    assert (drift["worker2"].observed, drift["worker2"].changes) == (f"spec {old} (its field label is unreadable)",
                                                                      ())
    assert [len(drift[n].changes) for n in ("head", "worker1", "worker3")] == [1, 1, 1]
    assert "\x1b" not in plan_text(result) and result.downtime == Downtime(ALL, (), 120.0)


@settings(**examples(300), deadline=None)
@given(st.one_of(st.text(), st.dictionaries(st.text(), st.one_of(st.text(), st.integers(), st.none())).map(
    json.dumps)))
def test_any_label_parses_to_nothing_or_to_what_the_writer_writes(raw):
    value = parse_launch_label(raw)
    assert value is None or all(k.isascii() and k.isprintable() and v.isprintable() and len(v) <= MAX_LAUNCH_VALUE
                                for k, v in value.items())


def test_a_long_value_is_cut_with_a_hash_so_a_change_past_the_cut_still_shows(desired, seen):
    long = "x" * 300
    before = load(("  served_model_name: tiny-moe", f"  served_model_name: tiny-moe\n  env: {{NOTE: {long}a}}"))
    after = load(("  served_model_name: tiny-moe", f"  served_model_name: tiny-moe\n  env: {{NOTE: {long}b}}"))
    [change] = plan(after, running(before, seen)).drift[0].changes
    assert change.field == "serving.env.NOTE" and change.old != change.new
    assert len(change.old or "") == len(change.new or "") <= MAX_LAUNCH_VALUE


def test_a_launch_too_large_for_a_label_carries_none_and_its_next_diff_says_hashes():
    many = {f"serving.env.V{i}": "x" * 150 for i in range(400)}
    assert launch_label(many) is None
    assert launch_label({"serving.port": "8000"}) == '{"serving.port":"8000"}'


# ------------------------------------------------------------------------------------------------ every restart


LIST_ITEMS = {"extra_args": "--enforce-eager", "cap_add": "IPC_LOCK", "devices": "/dev/infiniband/uverbs1",
              "volumes": "/srv/extra:/extra:ro"}
DICT_ITEMS = {"env": ("VLLM_LOGGING_LEVEL", "INFO"), "ulimits": ("core", "0"), "secrets": ("WANDB_API_KEY", "serving"),
              "path": None}
NONE_FILL = {"max_model_len": 65536, "served_model_name": "other", "rdma_device": "rocep1s0f0",
             "compile_cache": "/srv/cache", "gpus": "all", "ipc": "private", "shm_size": "8g", "nodes": None}
CHOICES = {"launcher": ["native", "ray"], "layout": ["hf-cache", "plain"], "host": ["127.0.0.1", "0.0.0.0"],
           "ipc": ["host", "private", None], "compile_cache": ["home", None, "/srv/cache"], "gpus": ["all", None],
           "internet": [True, False]}
VALUES = {"VLLM_API_KEY": ("sk-a-0123456789", "sk-b-0123456789"), "HF_TOKEN": ("hf_aaaaaaaaaaaa", "hf_bbbbbbbbbb"),
          "WANDB_API_KEY": ("wb-aaaaaaaaaaaaa", "wb-bbbbbbbbbbbbb")}


def _paths(value: Any, path: tuple = ()) -> list[tuple]:
    """Every place of the file an edit can change: each leaf, and each list and mapping (to add to)."""
    out = [path]
    if isinstance(value, dict):
        out += [p for k, v in value.items() for p in _paths(v, (*path, k))]
    elif isinstance(value, list):
        out += [p for i, v in enumerate(value) for p in _paths(v, (*path, i))]
    return out


def _edit(draw, old: Any, key: Any) -> Any:
    """Another value for `old` (a field named `key`), of the kind the file holds there."""
    if key in CHOICES:
        return draw(st.sampled_from(CHOICES[key]))
    if isinstance(old, bool):
        return not old
    if isinstance(old, int):
        return old + draw(st.sampled_from([1, 2, -1]))
    if isinstance(old, float):
        return round(old * draw(st.sampled_from([0.5, 1.5])), 3)
    if old is None:
        assume(NONE_FILL.get(key) is not None)
        return NONE_FILL[key]
    if isinstance(old, list):
        return old[:-1] if old and draw(st.booleans()) else [*old, LIST_ITEMS.get(key, "x")]
    if isinstance(old, dict):
        assume(DICT_ITEMS.get(key) is not None)
        name, value = DICT_ITEMS[key]
        return {**old, name: value}
    if "/" in old and old.replace(".", "").replace("/", "").isdigit():  # an address with its prefix
        ip, prefix = old.split("/")
        return ip.rsplit(".", 1)[0] + f".{int(ip.rsplit('.', 1)[1]) + 100}/{prefix}"
    return old + draw(st.sampled_from(["2", "-b", "0"]))


@st.composite
def edited_pairs(draw) -> tuple[spec.Desired, spec.Desired]:
    """A file with secrets, and the same file with one edit anywhere in it or its secrets' values rotated."""
    base = draw(desireds()).model_dump(mode="json")
    base["serving"]["secrets"] = {"VLLM_API_KEY": "head", "HF_TOKEN": draw(st.sampled_from(["internet", "serving"]))}
    for node in base["nodes"]:  # a worker online beside an offline head holds a secret the head lacks (Ray)
        node["internet"] = draw(st.booleans())
    before = after = {name: pair[0] for name, pair in VALUES.items()}
    raw = json.loads(json.dumps(base))
    if not draw(st.integers(0, 4)):  # one time in five the values rotate, else one edit of the file
        after = {name: draw(st.sampled_from(pair)) for name, pair in VALUES.items()}
    else:
        section = draw(st.sampled_from(["nodes", "model", "serving", "serving", "serving", "trust", "policy"]))
        path = draw(st.sampled_from(_paths(raw[section], (section,))))
        parent = raw
        for part in path[:-1]:
            parent = parent[part]
        parent[path[-1]] = _edit(draw, parent[path[-1]], path[-1] if isinstance(path[-1], str) else path[-2])
    try:
        return (spec.Desired.model_validate(base).with_secrets(before),
                spec.Desired.model_validate(raw).with_secrets(after))
    except ValueError:
        assume(False)
        raise


def _ran(desired: spec.Desired) -> Observed:
    """Every serving node running its launch of `desired`, as `docker run` labelled it."""
    specs = {s.node: s for s in launch_specs(desired)}
    return Observed(nodes={n.name: NodeObservation(
        name=n.name, reachable=True, docker_reachable=True,
        containers=[Container(name=s.container_name, id=n.name, image=s.image, state="running",
                              labels=started_labels(s))] if (s := specs.get(n.name)) else [])
        for n in desired.nodes})


@settings(**examples(400), deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(edited_pairs())
def test_every_restart_a_changed_spec_forces_is_explained_field_by_field(pair):
    """The diff explains every restart: whatever the edit, a launch whose spec hash changed differs in a named
    field of its launch inputs, and the drift that restarts it says which."""
    before, after = pair
    old = {s.node: s for s in launch_specs(before)}
    for new in launch_specs(after):
        if new.node in old and old[new.node].spec_hash != new.spec_hash:
            assert old[new.node].inputs != new.inputs, new.node
    for d in serving_drift(after, _ran(before)):
        if d.observed.startswith("spec "):
            assert d.changes, d
            assert all(c.secret or c.old != c.new for c in d.changes)
