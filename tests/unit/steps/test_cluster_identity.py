"""The cluster's identity (issue 29, finding 7): the head's `~/.spark-reconciler/cluster-id` names the cluster, not
the head's SSH address. Renumbering the head (DHCP, a move to its `.local` name) used to make both running
containers "another reconciler's container ... holds the name [blocking]" until someone ran `docker rm -f` on both
nodes; now the containers stay this cluster's, and a label that is not says how to adopt it.

The probe's fragment is run by a real `sh` in a temporary HOME (made once, kept, never clobbered); its parser is fed
good and odd files; the plan is judged on the sample file's converged cluster with the head renumbered.
"""

from __future__ import annotations

import json
import os
import shlex
import stat
import subprocess
from pathlib import Path

import pytest

from reconciler.core.observed import (
    LABEL_INSTANCE,
    LABEL_MANAGED,
    ClusterIdentity,
    Container,
    Memory,
    NodeObservation,
    Observed,
)
from reconciler.core.ownership import CLUSTER_ID_FILE, owner
from reconciler.core.planning import plan
from reconciler.core.spec import Desired, load, loads
from reconciler.edge.facts.base import ProbeError, Section, sealed, split_sections
from reconciler.edge.facts.host import IDENTITY_MAX_BYTES, identity_script, parse_identity
from reconciler.edge.observe import observe_node, probe_script
from reconciler.edge.ssh import Result
from reconciler.edge.steps import StepFailed
from reconciler.edge.steps.actions import Given
from reconciler.edge.steps.serving import start_serving
from testbed.recordings import answer
from tests.unit.conftest import converged_in_simulator
from tests.unit.core.test_ownership import stop_serving_on
from tests.unit.recorded import parsed
from tests.unit.step_cases import inspected, no_such
from tests.unit.step_driver import Driver, Raw

ID = "0f8fad5b-d9cb-469f-a165-70867728950e"
OTHER_ID = "7c9e6679-7425-40de-944b-e07fc1f90ae7"
HEAD, WORKER = "spark-1a32", "spark-5be3"  # the sample's nodes
OLD_HOST, NEW_HOST = "10.1.230.180", "spark-1a32.local"


# ------------------------------------------------------------------------------------------- the probe fragment


def _run_fragment(home: Path, instance: str) -> tuple[Section | None, subprocess.CompletedProcess]:
    """The fragment as the probe runs it (`sec` function, LC_ALL=C), by a real sh with HOME set to `home`."""
    script = sealed(identity_script(instance))
    done = subprocess.run(["sh", "-s"], input=script.script, capture_output=True, text=True, timeout=30,
                          env={"HOME": str(home), "PATH": os.environ.get("PATH", "/usr/bin:/bin")}, check=False)
    return split_sections(done.stdout, script.nonce).get("identity"), done


def test_a_missing_id_is_made_once_and_kept(tmp_path):
    sec, _ = _run_fragment(tmp_path, "10.1.230.180:22")
    made = parse_identity(sec)
    assert made is not None and made.known_as == ["10.1.230.180:22"]
    path = tmp_path / ".spark-reconciler" / "cluster-id"
    assert path.read_text() == f"{made.id}\n10.1.230.180:22\n"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    again, _ = _run_fragment(tmp_path, "spark-1a32.local:22")  # the head renumbered: the same machine's id
    assert parse_identity(again) == made
    assert sorted(p.name for p in path.parent.iterdir()) == ["cluster-id"], "no temp file is left behind"


def test_an_existing_file_is_never_rewritten_and_an_empty_one_is_made(tmp_path):
    d = tmp_path / ".spark-reconciler"
    d.mkdir(mode=0o700)
    (d / "cluster-id").write_text(f"{ID}\n10.0.0.1:22\n\nspark-1a32.local:22\n")
    sec, _ = _run_fragment(tmp_path, "10.9.9.9:22")
    assert parse_identity(sec) == ClusterIdentity(id=ID, known_as=["10.0.0.1:22", "spark-1a32.local:22"])
    assert (d / "cluster-id").read_text().startswith(ID)
    (d / "cluster-id").write_text("")
    sec, _ = _run_fragment(tmp_path, "10.9.9.9:22")
    made = parse_identity(sec)
    assert made is not None and made.id != ID and made.known_as == ["10.9.9.9:22"]


def test_the_instance_reaches_the_file_as_one_literal_word(tmp_path):
    """Quoted by `ssh.quote_word`: a value that would run something in the shell is written as it is, and the
    parser then refuses it (the spec never lets such a host through; this is the second wall)."""
    sec, done = _run_fragment(tmp_path, "$(touch pwned);`touch pwned2`:22")
    assert not (tmp_path / "pwned").exists() and not list(Path.cwd().glob("pwned*")), done.stderr
    assert (tmp_path / ".spark-reconciler" / "cluster-id").read_text().splitlines()[1] == \
        "$(touch pwned);`touch pwned2`:22"
    with pytest.raises(ProbeError, match="identity"):
        parse_identity(sec)


def test_a_head_that_cannot_make_the_file_says_so(tmp_path):
    (tmp_path / ".spark-reconciler").write_text("a file where the directory goes")
    sec, _ = _run_fragment(tmp_path, "10.1.230.180:22")
    assert sec is not None and sec.rc != 0
    with pytest.raises(ProbeError, match="cluster-id could not be made or read on the head"):
        parse_identity(sec)


# --------------------------------------------------------------------------------------------------- the parser


@pytest.mark.parametrize(("body", "why"), [
    ("0F8FAD5B-D9CB-469F-A165-70867728950E\n", "uppercase id"),
    ("not-a-uuid\n", "not a uuid"),
    (f"{ID}x\n", "trailing garbage on the id"),
    (f"{ID}\n10.0.0.1:22; rm -rf ~\n", "a former name with a space and a ;"),
    (f"{ID}\nhead\u200b.local:22\n", "a former name with an invisible character"),
    (f"{ID}\n{'a' * 301}\n", "a former name of 301 bytes"),
    (f"{ID}\n" + "".join(f"10.0.{i // 250}.{i % 250}:22\n" for i in range(65)), "65 former names"),
    (f"{ID}\n" + "a" * IDENTITY_MAX_BYTES, "longer than the probe prints"),
    ("", "empty"),
])
def test_odd_files_are_the_heads_probe_error(body, why):
    with pytest.raises(ProbeError, match="^identity: "):
        parse_identity(Section(body, 0))
    assert why


def test_a_good_file_reads_and_a_missing_section_is_not_read():
    body = f"{ID}\n10.1.230.180:22\n  [fe80::1%25enp1s0]:22  \n10.1.230.180:22\n"
    assert parse_identity(Section(body, 0)) == ClusterIdentity(id=ID, known_as=["10.1.230.180:22",
                                                                                "[fe80::1%25enp1s0]:22"])
    assert parse_identity(None) is None


def test_only_the_head_is_asked_and_odd_output_is_its_probe_condition(desired_sample):
    head, worker = desired_sample.node(HEAD), desired_sample.node(WORKER)
    assert "sec identity" in probe_script(desired_sample, head).script
    assert "sec identity" not in probe_script(desired_sample, worker).script
    assert "cluster-id" not in probe_script(desired_sample, worker).script
    good = f"@@identity\n{ID}\n{desired_sample.instance}\n@@rc 0\n"
    assert parsed(desired_sample, HEAD, good).identity == ClusterIdentity(id=ID,
                                                                               known_as=[desired_sample.instance])
    assert parsed(desired_sample, WORKER, good).identity is None, "only the head's file names the cluster"

    class Session:
        def run_script(self, script, timeout, cancel=None):
            return Result(answer(script, "@@identity\nnot-an-id\n@@rc 0\n"), "", 0)

    seen = observe_node(desired_sample, {HEAD: Session()}, head)  # type: ignore[dict-item]
    assert seen.reachable and seen.identity is None
    assert seen.probe_error is not None and seen.probe_error.startswith("identity: ")


# ------------------------------------------------------------------------------------------------------- the plan


@pytest.fixture
def desired_sample(cluster_yaml) -> Desired:
    return load(cluster_yaml, os.environ)


@pytest.fixture
def renumbered(cluster_yaml) -> Desired:
    """The sample with the head reached at its `.local` name instead of its DHCP address."""
    text = cluster_yaml.read_text()
    assert f"host: {OLD_HOST} " in text
    moved = loads(text.replace(f"host: {OLD_HOST} ", f"host: {NEW_HOST} ")).with_secrets(os.environ)
    assert moved.instance == f"{NEW_HOST}:22"
    return moved


@pytest.fixture
def converged(desired_sample, seed_snapshot) -> Observed:
    """The sample converged by the reconciler of today (containers labelled with the head's `host:port`)."""
    return converged_in_simulator(desired_sample, seed_snapshot)


def _relabel(observed: Observed, label: str | None, identity: ClusterIdentity | None) -> Observed:
    """Every managed container labelled `label`; the head's identity as given."""
    nodes = {}
    for name, obs in observed.nodes.items():
        containers = [c.model_copy(update={"labels": {**c.labels, LABEL_INSTANCE: label}}) if c.managed and label
                      else c for c in obs.containers]
        nodes[name] = obs.model_copy(update={"containers": containers,
                                             **({"identity": identity} if name == HEAD else {})})
    return observed.model_copy(update={"nodes": nodes})


def _serving(result) -> list:
    return [d for d in result.drift if d.kind == "serving"]


def test_containers_labelled_with_the_id_stay_ours_when_the_head_is_renumbered(converged, renumbered):
    observed = _relabel(converged, ID, ClusterIdentity(id=ID, known_as=[f"{OLD_HOST}:22"]))
    result = plan(renumbered, observed)
    assert _serving(result) == [] and result.steps == [] and not result.changes


def test_containers_labelled_with_a_former_address_are_adopted(converged, renumbered, desired_sample):
    """The upgrade's case: the containers carry the old `host:port`, which the probe wrote as `known_as` when
    it made the id; the head is then renumbered. Today: blocking, no step, `docker rm -f` by hand."""
    observed = _relabel(converged, desired_sample.instance, ClusterIdentity(id=ID, known_as=[desired_sample.instance]))
    result = plan(renumbered, observed)
    assert _serving(result) == [] and result.steps == [] and not result.changes


def test_a_label_that_is_not_this_clusters_blocks_and_says_how_to_adopt_it(converged, renumbered):
    observed = _relabel(converged, OTHER_ID, ClusterIdentity(id=ID, known_as=[]))
    result = plan(renumbered, observed)
    name = renumbered.serving.container_name
    blocking = [d for d in _serving(result) if d.blocking and not d.actionable]
    assert {d.node for d in blocking} == {HEAD, WORKER}
    for d in blocking:
        assert d.expected == f"created by this reconciler (cluster {ID})"
        assert f"(instance {OTHER_ID})" in d.observed
        assert f"add the line `{OTHER_ID}` to {CLUSTER_ID_FILE} on {HEAD}" in d.observed
        assert "remove or rename that container" in d.observed
    assert [s for s in result.steps if s.container == name or s.kind == "start-serving"] == []


def test_a_head_whose_identity_cannot_be_read_stops_nothing_of_ours(converged, renumbered):
    """The head unreachable, or its probe failed: the worker's container (labelled with the id) is not judged
    another reconciler's, and nothing of ours is stopped, also under a former name."""
    observed = _relabel(converged, ID, None)
    worker = observed.node(WORKER)
    stray = Container(name="vllm_serving_old", id="x", image="img", state="running",
                      labels={LABEL_MANAGED: "true", LABEL_INSTANCE: ID})
    for head in (NodeObservation(name=HEAD, reachable=False, error="timed out"),
                 NodeObservation(name=HEAD, reachable=True, probe_error="identity: not a cluster id")):
        nodes = {**observed.nodes, HEAD: head, WORKER: worker.model_copy(
            update={"containers": [*worker.containers, stray]})}
        result = plan(renumbered, observed.model_copy(update={"nodes": nodes}))
        assert [s for s in result.steps if s.kind in ("stop-serving", "stop-container", "start-serving")] == []
        [d] = [d for d in _serving(result) if d.node == WORKER]
        assert d.blocking and "another reconciler" not in d.observed
        assert f"the cluster id on the head {HEAD} could not be read" in d.observed


def test_a_start_labels_the_containers_with_the_id(desired_sample, converged):
    """A first start on a head that has an id: every `docker run` carries it, and the plan of what it left is
    empty (the simulator starts them as the step does)."""
    from reconciler.core.simulate import apply_plan

    name = desired_sample.serving.container_name
    free = Memory(total_bytes=128 << 30, available_bytes=127 << 30)  # nothing of ours runs: its memory is free
    nodes = {n: o.model_copy(update={"containers": [c for c in o.containers if c.name != name], "memory": free,
                                     **({"identity": ClusterIdentity(id=ID)} if n == HEAD else {})})
             for n, o in converged.nodes.items()}
    observed = converged.model_copy(update={"nodes": nodes})
    result = plan(desired_sample, observed)
    starts = [s for s in result.steps if s.kind == "start-serving"]
    assert {s.node for s in starts} == {HEAD, WORKER}
    meminfo = Raw(f"MemTotal: {128 << 20} kB\nMemAvailable: {127 << 20} kB")  # nothing of ours runs: free
    for step in starts:
        driver = Driver(facts={f"{step.node} container {name}": [no_such(name), inspected(name)],
                               f"{step.node} meminfo": [meminfo]})
        assert driver.drive(start_serving(Given(desired_sample, observed), step)) is None
        [run] = [shlex.split(line) for line in driver.transcript if line.startswith(f"run {step.node} docker run ")]
        assert f"{LABEL_INSTANCE}={ID}" in run
    after = apply_plan(desired_sample, observed, result)
    assert {c.labels[LABEL_INSTANCE] for o in after.nodes.values() for c in o.containers if c.managed} == {ID}
    assert not plan(desired_sample, after).changes


def test_the_stop_step_judges_ownership_by_the_plans_identity(desired_sample):
    name = desired_sample.serving.container_name
    observed = Observed(nodes={HEAD: NodeObservation(name=HEAD, reachable=True,
                                                     identity=ClusterIdentity(id=ID, known_as=["10.0.0.1:22"]))})
    for label in (ID, "10.0.0.1:22"):
        ran, error = stop_serving_on(desired_sample, name, {LABEL_MANAGED: "true", LABEL_INSTANCE: label}, observed,
                                     node=HEAD)
        assert error is None and f"docker rm {name}" in ran, label
    ran, error = stop_serving_on(desired_sample, name, {LABEL_MANAGED: "true", LABEL_INSTANCE: OTHER_ID}, observed,
                                 node=HEAD)
    assert ran == [] and isinstance(error, StepFailed)
    assert f"add the line `{OTHER_ID}` to ~/.spark-reconciler/cluster-id on {HEAD}" in str(error)


def test_an_old_snapshot_plans_as_before_and_a_new_one_round_trips(desired_sample, seed_snapshot, converged):
    """Snapshots from before the identity have no `identity`: the head's SSH address stands for the cluster, as
    it did; and `observe --json` with an identity loads back (`plan --observed`) and plans the same."""
    raw = json.loads(seed_snapshot.read_text())
    assert all("identity" not in n for n in raw["nodes"].values())
    old = Observed.model_validate(raw)
    assert owner(desired_sample, old).names == {desired_sample.instance}
    assert owner(desired_sample, old).label == desired_sample.instance
    assert not plan(desired_sample, converged).changes  # labelled host:port, no identity: ours, as before
    foreign = _relabel(converged, "10.9.9.9:22", None)
    assert [d.observed for d in _serving(plan(desired_sample, foreign)) if d.blocking][0] == \
        "another reconciler's container (instance 10.9.9.9:22) holds the name"
    new = _relabel(converged, ID, ClusterIdentity(id=ID, known_as=[desired_sample.instance]))
    back = Observed.model_validate_json(new.model_dump_json())
    assert back == new and back.node(HEAD).identity == ClusterIdentity(id=ID, known_as=[desired_sample.instance])
    assert plan(desired_sample, back).as_dict() == plan(desired_sample, new).as_dict()
