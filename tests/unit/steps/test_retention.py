"""Retention (`policy.retention`): each node keeps the current and the `previous` most recently used models and
images, and the plan removes older ones this cluster copied there, as the node's copy ledger records them. Never
what it did not copy, never what a container uses, and the step checks the tree again on the node before it
removes anything (tests with real files at the end)."""

from __future__ import annotations

import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from reconciler.cli.plan_text import plan_text
from reconciler.core.observed import LABEL_WEIGHTS, ClusterIdentity, Container, CopyRecord, Observed
from reconciler.core.planning import Step, plan
from reconciler.core.retention import removals
from reconciler.core.simulate import apply_plan
from reconciler.edge import ledger
from reconciler.edge.facts.base import Fact, Section
from reconciler.edge.steps import StepContext
from reconciler.edge.steps import retention as prune
from tests.unit.examples import examples
from tests.unit.recorded import CLUSTER_ID, changed, load

HUB = "/srv/spark-testbed/worker1/models/hub"
CURRENT = f"{HUB}/models--testorg--tiny-moe"
CLUSTER = CLUSTER_ID  # the recording's head made it; its serving containers carry it
BY = CLUSTER  # records are written with the cluster's id (core/ownership.py)
DIGEST = "d" * 64


def tree(name: str, used: int, by: str = BY) -> CopyRecord:
    return CopyRecord(kind="weights", key=f"{HUB}/models--testorg--{name}", detail=DIGEST, by=by, copied_at=used,
                      used_at=used)


def image(n: int, used: int, by: str = BY) -> CopyRecord:
    return CopyRecord(kind="image", key=f"sha256:{n:064x}", detail=f"sha256:{n + 100:064x}", by=by, copied_at=used,
                      used_at=used)


@pytest.fixture
def desired():
    return load(("policy:\n  mode: enforce", "policy:\n  mode: enforce\n  retention: {prune: true}"))


def serving_names_its_tree(seen: Observed, node: str = "worker1") -> Observed:
    """The node's serving container as a start since retention labels it: naming the tree it serves."""
    containers = [c.model_copy(update={"labels": c.labels | {LABEL_WEIGHTS: CURRENT}})
                  if c.name == "vllm_serving" else c for c in seen.node(node).containers]
    return changed(seen, node, containers=containers)


def with_copies(seen: Observed, *records: CopyRecord) -> Observed:
    """The worker's ledger holds `records`; the head's cluster id was read (made when the head had its address of
    the recording)."""
    identified = changed(seen, "head", identity=ClusterIdentity(id=CLUSTER, known_as=["10.231.0.2:22"]))
    return changed(serving_names_its_tree(identified), "worker1", copies=list(records))


def test_the_desired_state_names_the_tree_the_records_carry(desired):
    assert desired.weights_root("worker1") == CURRENT


def test_without_the_heads_cluster_id_nothing_is_removed(desired, seen):
    """Whose a copy is cannot be told: an older snapshot, or a head whose probe failed."""
    observed = with_copies(seen, tree("old-a", 1), tree("old-b", 2), tree("old-c", 3))
    assert plan(desired, observed).steps
    assert not plan(desired, changed(observed, "head", identity=None)).steps


def test_older_copies_beyond_the_previous_are_removed_as_planned_steps(desired, seen):
    observed = with_copies(seen, tree("old-a", 100), tree("old-b", 300), tree("old-c", 200),
                           image(1, 100), image(2, 300), image(3, 200))
    result = plan(desired, observed)
    steps = {s.id: s for s in result.steps}
    assert set(steps) == {"prune-weights/worker1", "prune-images/worker1"}
    assert steps["prune-weights/worker1"].remove == (f"{HUB}/models--testorg--old-a", f"{HUB}/models--testorg--old-c")
    assert steps["prune-images/worker1"].remove == (f"sha256:{1:064x}", f"sha256:{3:064x}")
    text = plan_text(result)
    assert "Drift: none." in text and f"- {HUB}/models--testorg--old-a" in text and "2 to stop" in text
    assert result.changes, "a removal is a change: plan's exit code says so"


def test_previous_counts_by_last_use_not_by_copy(desired, seen):
    """B copied last, but A served since (A -> B -> A): A is the previous a rollback needs, B goes."""
    a = tree("old-a", 100).model_copy(update={"used_at": 500})
    observed = with_copies(seen, a, tree("old-b", 300), tree("old-x", 50))
    step = next(s for s in plan(desired, observed).steps if s.kind == "prune-weights")
    assert step.remove == (f"{HUB}/models--testorg--old-b", f"{HUB}/models--testorg--old-x")


def test_nothing_is_removed_unless_asked(seen):
    observed = with_copies(seen, tree("old-a", 1), tree("old-b", 2), tree("old-c", 3))
    assert not plan(load(), observed).steps


def test_what_another_cluster_copied_is_never_removed(desired, seen):
    observed = with_copies(seen, tree("old-a", 1, by="10.9.9.9:22"), tree("old-b", 2, by="10.9.9.9:22"),
                           image(1, 1, by="other"), image(2, 2, by="other"))
    assert not plan(desired, observed).steps


def test_the_current_tree_and_image_are_never_removed_whatever_their_age(desired, seen):
    local = seen.node("worker1").images["vllm-standin:latest"]
    current_image = CopyRecord(kind="image", key=local.content, detail=local.id, by=BY, copied_at=1, used_at=1)
    current_tree = CopyRecord(kind="weights", key=CURRENT, detail=DIGEST, by=BY, copied_at=1, used_at=1)
    observed = with_copies(seen, current_tree, current_image, tree("old-a", 5), image(1, 5))
    assert not plan(desired, observed).steps, "the only others are the previous ones"


def test_a_tree_a_container_mounts_is_kept(desired, seen):
    old = f"{HUB}/models--testorg--old-a"
    observed = with_copies(seen, tree("old-a", 1), tree("old-b", 2))
    containers = [c.model_copy(update={"mounts": [old + "/snapshots"]}) if c.name == "vllm_embeddings" else c
                  for c in observed.node("worker1").containers]
    assert not plan(desired, changed(observed, "worker1", containers=containers)).steps


def test_a_container_mounting_the_hub_keeps_every_tree_unless_it_names_its_own(desired, seen):
    """The recorded serving container (from before the label) mounts the hub: every tree in it may be its."""
    observed = with_copies(seen, tree("old-a", 1), tree("old-b", 2))
    unlabelled = [c.model_copy(update={"labels": {k: v for k, v in c.labels.items() if k != LABEL_WEIGHTS}})
                  for c in observed.node("worker1").containers]
    assert not plan(desired, changed(observed, "worker1", containers=unlabelled)).steps
    assert plan(desired, with_copies(seen, tree("old-a", 1), tree("old-b", 2))).steps


def test_a_container_whose_mounts_were_not_read_keeps_every_tree(desired, seen):
    observed = with_copies(seen, tree("old-a", 1), tree("old-b", 2))
    containers = [c.model_copy(update={"mounts": None}) if c.name == "vllm_embeddings" else c
                  for c in observed.node("worker1").containers]
    assert not plan(desired, changed(observed, "worker1", containers=containers)).steps


def test_an_image_a_container_was_made_from_is_kept(desired, seen):
    observed = with_copies(seen, image(1, 1), image(2, 2))
    stopped = seen.node("worker1").containers[0].model_copy(update={"name": "old", "state": "exited",
                                                                     "image_id": image(1, 1).detail})
    observed = changed(observed, "worker1", containers=[*observed.node("worker1").containers, stopped])
    assert not plan(desired, observed).steps


def test_a_copy_to_the_node_waits_for_the_room_its_removals_free(desired, seen):
    observed = with_copies(seen, tree("old-a", 1), tree("old-b", 2))
    observed = changed(observed, "worker1", weights=None)
    steps = {s.id: s for s in plan(desired, observed).steps}
    assert steps["weights/worker1"].after == ("prune-weights/worker1",)


def test_applying_the_removals_converges(desired, seen):
    observed = with_copies(seen, tree("old-a", 1), tree("old-b", 2), tree("old-c", 3), image(1, 1), image(2, 2))
    after = apply_plan(desired, observed, plan(desired, observed))
    assert not plan(desired, after).steps
    assert {r.key for r in after.node("worker1").copies or []} == {f"{HUB}/models--testorg--old-c",
                                                                   f"sha256:{2:064x}"}


@settings(**examples(150), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.sampled_from(["weights", "image"]), st.integers(0, 6), st.integers(0, 9),
                          st.booleans(), st.booleans()), max_size=12), st.integers(1, 3))
def test_removals_match_an_oracle_written_from_the_rule(records, previous):
    """For any ledger: removed is exactly this cluster's copies that are not current, ranked by last use behind
    the `previous` newest of their kind, and not mounted (here: `old-0` is mounted by a co-tenant)."""
    desired = load(("policy:\n  mode: enforce", f"policy:\n  mode: enforce\n  retention: {{prune: true, previous: "
                                                 f"{previous}}}"))
    from tests.unit.recorded import observe

    seen = observe(desired)
    copies = {}
    for kind, n, used, ours, _ in records:
        rec = tree(f"old-{n}", used) if kind == "weights" else image(n, used)
        copies[(kind, rec.key)] = rec.model_copy(update={"by": BY if ours else "someone-else:22"})
    observed = with_copies(seen, *copies.values())
    mounted = f"{HUB}/models--testorg--old-0"
    containers = [c.model_copy(update={"mounts": [mounted]}) if c.name == "vllm_embeddings" else c
                  for c in observed.node("worker1").containers]
    observed = changed(observed, "worker1", containers=containers)
    from reconciler.core.ownership import owner

    got = {key for r in removals(desired, observed, owner(desired, observed), None) for key in (*r.weights, *r.images)}
    want = set()
    for kind in ("weights", "image"):
        mine = [r for r in copies.values() if r.kind == kind and r.by == BY]
        for rank, r in enumerate(sorted(mine, key=lambda r: (-r.used_at, r.key))):
            if rank >= previous and r.key != mounted:
                want.add(r.key)
    assert got == want



# -- the ledger, as the node holds it --------------------------------------------------------------------------

LEDGER = (
    f"copied\tworker1\tweights\t{HUB}/models--a\t100\t{BY}\t{DIGEST}\n"
    f"copied\tworker1\timage\tsha256:{1:064x}\t110\t{BY}\tsha256:{101:064x}\n"
    f"served\tworker1\tweights\t{HUB}/models--a\t400\t{BY}\t-\n"
    f"copied\tworker1\tweights\t{HUB}/models--b\t200\t{BY}\t{DIGEST}\n"
    f"removed\tworker1\tweights\t{HUB}/models--b\t300\t{BY}\t-\n"
    f"served\tworker1\timage\tsha256:{2:064x}\t120\t{BY}\t-\n"  # served, never copied here: not a copy
    f"copied\tworker1\tweights\t{HUB}/models--c\t500\t{BY}\n"  # cut short by a crash
    f"copied\tworker1\tweights\t{HUB}/../etc\t500\t{BY}\t{DIGEST}\n"  # a path that climbs out
    "copied\tworker1\tweights\trelative/path\t500\tx\t" + DIGEST + "\n"
    f"copied\thead\tweights\t{HUB}/models--h\t500\t{BY}\t{DIGEST}\n"  # another node's (a shared home)
    "garbage\n")


def test_the_ledger_folds_to_what_is_copied_and_not_removed_since():
    records = ledger.parse_copies(Section(LEDGER, 0), "worker1")
    assert records == [
        CopyRecord(kind="image", key=f"sha256:{1:064x}", detail=f"sha256:{101:064x}", by=BY, copied_at=110,
                   used_at=110),
        CopyRecord(kind="weights", key=f"{HUB}/models--a", detail=DIGEST, by=BY, copied_at=100, used_at=400)]
    assert ledger.parse_copies(None, "worker1") is None
    assert ledger.parse_copies(Section("", 0), "worker1") == []


def test_a_start_notes_its_weights_and_image_as_used(tmp_path):
    """The `served` lines a start writes before its `docker run` (serving._note_use, through ledger.append) are
    what orders the copies by last use: run by a real sh, they move the weights' and the image's use forward."""
    import os
    import subprocess

    from reconciler.core.vllm import launch_specs
    from reconciler.edge.steps import serving
    from reconciler.edge.steps.actions import Given
    from tests.unit.recorded import RAW, observe, sections_of
    from tests.unit.step_cases import inspected, no_such
    from tests.unit.step_driver import Driver, Raw

    desired, node = load(), "worker1"
    observed = observe(desired)  # the head holds the serving image: its content is the reference
    spec = next(s for s in launch_specs(desired) if s.node == node)
    content = observed.node("head").images[desired.serving.image].content
    book = tmp_path / ledger.LEDGER
    book.parent.mkdir(parents=True)
    book.write_text(f"copied\t{node}\tweights\t{spec.weights}\t100\t{CLUSTER_ID}\t{DIGEST}\n"
                    f"copied\t{node}\timage\t{content}\t100\t{CLUSTER_ID}\tsha256:{7:064x}\n")
    name = spec.container_name
    driver = Driver(facts={f"{node} container {name}": [no_such(name), inspected(name)],
                           f"{node} meminfo": [Raw(sections_of(RAW["outputs"][node])["meminfo"].body)]})
    step = Step("start-serving", node, "missing", (), rank=1)
    assert driver.drive(serving.start_serving(Given(desired, observed), step)) is None
    subprocess.run(["sh", "-s"], input=driver.stdin[f"{node} sh -s"], check=True, timeout=30,
                   env={"HOME": str(tmp_path), "PATH": os.environ["PATH"]})
    records = ledger.parse_copies(Section(book.read_text(), 0), node)
    assert [(r.kind, r.key, r.used_at > 100) for r in records] == [("image", content, True),
                                                                    ("weights", spec.weights, True)]


# -- the steps, on real files (a node that is this machine: tests/unit/test_weights_tree.Local) ----------------

def test_a_copied_tree_is_recorded_then_removed_once_it_is_no_longer_current(tmp_path, nodes, monkeypatch):
    from tests.unit.steps.test_weights_tree import _desired, hf_tree, probe, sync

    containers_now(monkeypatch)
    repo = hf_tree(tmp_path / "src", shards=2, shard_bytes=10_000)
    sync(tmp_path, nodes)
    dst = tmp_path / "dst" / "hub" / repo.name
    [record] = ledger.parse_copies(Section((nodes["dst"].home / ledger.LEDGER).read_text(), 0), "dst")
    assert (record.kind, record.key, record.detail, record.by) == ("weights", str(dst), probe(dst).digest(),
                                                                   "head:22"), "no cluster id read: the address"
    ctx = _prune_ctx(tmp_path, nodes, _desired)
    prune_weights(ctx, Step("prune-weights", "dst", "test", remove=(str(dst),)))
    assert not dst.exists() and (tmp_path / "src" / "hub" / repo.name).is_dir()
    assert ledger.parse_copies(Section((nodes["dst"].home / ledger.LEDGER).read_text(), 0), "dst") == []


def test_a_tree_changed_since_the_copy_is_kept_released_and_said(tmp_path, nodes, monkeypatch):
    """Kept, never forced: and released (never proposed again), so a person's edit cannot hold the next copy."""
    from tests.unit.steps.test_weights_tree import _desired, hf_tree, sync

    containers_now(monkeypatch)
    repo = hf_tree(tmp_path / "src", shards=2, shard_bytes=10_000)
    sync(tmp_path, nodes)
    dst = tmp_path / "dst" / "hub" / repo.name
    (dst / "my-notes.txt").write_text("a person's file")
    events: list = []
    ctx = _prune_ctx(tmp_path, nodes, _desired, events)
    prune_weights(ctx, Step("prune-weights", "dst", "test", remove=(str(dst),)))
    assert (dst / "my-notes.txt").read_text() == "a person's file"
    assert [f["why"] for e, f in events if e == "retention.kept"][0].startswith("unreadable, or changed since")
    assert ledger.parse_copies(Section((nodes["dst"].home / ledger.LEDGER).read_text(), 0), "dst") == []


def test_a_tree_a_container_mounts_under_another_name_is_kept(tmp_path, nodes, monkeypatch):
    """The container mounts the tree through a symlinked parent: the same directory, as the node resolves it."""
    from tests.unit.steps.test_weights_tree import _desired, hf_tree, sync

    repo = hf_tree(tmp_path / "src", shards=2, shard_bytes=10_000)
    sync(tmp_path, nodes)
    dst = tmp_path / "dst" / "hub" / repo.name
    (tmp_path / "alias").symlink_to(tmp_path / "dst" / "hub")
    user = Container(name="notebook", id="c1", image="x", state="exited", mounts=[str(tmp_path / "alias" / repo.name)])
    containers_now(monkeypatch, user)
    events: list = []
    prune_weights(_prune_ctx(tmp_path, nodes, _desired, events),
                        Step("prune-weights", "dst", "test", remove=(str(dst),)))
    assert dst.is_dir() and [f["why"] for e, f in events if e == "retention.kept"] == [
        "a container on the node mounts it"]


def test_a_tree_the_ledger_does_not_name_is_never_removed(tmp_path, nodes, monkeypatch):
    from tests.unit.steps.test_weights_tree import _desired

    containers_now(monkeypatch)
    mine = tmp_path / "dst" / "hub" / "models--someone--else"
    mine.mkdir(parents=True)
    (mine / "weights.safetensors").write_bytes(b"x" * 100)
    ctx = _prune_ctx(tmp_path, nodes, _desired)
    prune_weights(ctx, Step("prune-weights", "dst", "test", remove=(str(mine),)))
    assert (mine / "weights.safetensors").stat().st_size == 100


def containers_now(monkeypatch, *containers: Container) -> None:
    """The node's containers as `containers`: the node is this machine, whose docker is not the test's."""
    monkeypatch.setattr(prune, "CONTAINERS", Fact("containers", ("sec containers", "rc 0"),
                                                  lambda sections: list(containers)))


def prune_weights(ctx: StepContext, step: Step) -> None:
    """The step through the one executor, on the ctx's nodes."""
    ctx.perform(prune.prune_weights(ctx.given, step))


def _prune_ctx(tmp_path, nodes, make_desired, events: list | None = None) -> StepContext:
    """The file now names another model in another hub: the copied tree is no longer the current one."""
    desired = make_desired(tmp_path)
    desired.weights_root = lambda n: str(tmp_path / n / "hub2" / "models--testorg--next")
    desired.model.path_on = lambda n: str(tmp_path / n / "hub2")
    return StepContext(desired=desired, sessions=nodes, observed=Observed(nodes={}), deadline=time.monotonic() + 60,
                       progress=lambda e, f: (events if events is not None else []).append((e, f)))


def test_a_copy_resumed_after_an_interruption_is_still_recorded_and_a_topped_up_tree_is_not(tmp_path, nodes):
    """The first attempt began the tree (`started`) and died; the second finds it present and completes it: still
    this cluster's copy. A tree that was there before any copy began (a person's) is topped up, never recorded."""
    from tests.unit.steps.test_weights_tree import hf_tree, sync

    repo = hf_tree(tmp_path / "src", shards=2, shard_bytes=10_000)
    dst = tmp_path / "dst" / "hub" / repo.name
    ledger_file = nodes["dst"].home / ledger.LEDGER

    dst.mkdir(parents=True)  # a person's partial download, no `started` line
    (dst / "notes.txt").write_text("mine")
    sync(tmp_path, nodes)
    assert not ledger_file.exists() or ledger.parse_copies(Section(ledger_file.read_text(), 0), "dst") == []

    import shutil
    shutil.rmtree(dst)
    dst.mkdir(parents=True)
    ledger_file.parent.mkdir(parents=True, exist_ok=True)
    with ledger_file.open("a") as f:  # what the interrupted first attempt wrote before its first byte
        f.write(f"started\\tdst\\tweights\\t{dst}\\t100\\thead:22\\t-\\n")
    sync(tmp_path, nodes)
    [record] = ledger.parse_copies(Section(ledger_file.read_text(), 0), "dst")
    assert record.key == str(dst) and record.by == "head:22"
