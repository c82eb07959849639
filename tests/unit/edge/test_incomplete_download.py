"""A cut `hf download` is not the model (issue 52, item 1).

huggingface_hub writes `refs/<rev>` before a single file arrives and streams each file into
`blobs/<etag>.incomplete` (`_snapshot_download.py`, `file_download.py`). The judgement (core/completeness) is
checked two ways: on the seed's tree cut as a real cut leaves it, planned end to end (no copy, no stop, no start:
the download again, which resumes); and on the tree the REAL `hf` CLI leaves when it is killed halfway against the
Hub stand-in, listed by the probe's own script, then resumed to completion.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest

from reconciler.core.completeness import incomplete_reason, missing_shards
from reconciler.core.drift import diff
from reconciler.core.loader import load_file
from reconciler.core.observed import Observed, WeightFile, Weights
from reconciler.core.planning import plan
from reconciler.core.spec import Desired
from reconciler.edge.facts.base import sealed, split_sections
from reconciler.edge.manifest import manifest_script, read_listing
from testbed import hub
from testbed.proc import wait_for
from tests.unit.testbed.test_hub_standin import DENSE, MOE, hf_cli, store, tree  # noqa: F401 (store: a fixture)

HEAD, WORKER = "spark-1a32", "spark-5be3"
SNAP = "snapshots/0f6e4b1a9d3c2b5a8e7f6d5c4b3a29181716151a"


def _seed(cluster_yaml: Path, seed_snapshot: Path, *, internet: bool = True) -> tuple[Desired, dict]:
    data = load_file(cluster_yaml).data
    if not internet:
        data["nodes"] = [{**n, "internet": False} for n in data["nodes"]]
    return Desired.model_validate(data), json.loads(seed_snapshot.read_text())


def _cut(raw: dict, keep_shards: int, partial: bool) -> Observed:
    """The seed's head tree as a cut download leaves it: refs/main, the first `keep_shards` of 39 shards (blob and
    link), and the next shard's blob streaming (`.incomplete`) when `partial`."""
    files = raw["nodes"][HEAD]["weights"]["files"]
    links = [f for f in files if f["path"].startswith(SNAP)]
    kept = links[:keep_shards]
    blobs = {"blobs/" + os.path.basename(f["link_target"]) for f in kept}
    out = [f for f in files if f["path"] == "refs/main" or f in kept or f["path"] in blobs]
    if partial and keep_shards < len(links):
        nxt = links[keep_shards]
        raw["nodes"][HEAD]["weights"]["partials"] = ["blobs/" + os.path.basename(nxt["link_target"]) +
                                                     ".2ed6410c.incomplete"]
    raw["nodes"][HEAD]["weights"]["files"] = out
    return Observed.model_validate(raw)


@pytest.mark.parametrize(("keep", "partial", "named"), [
    (10, True, ".incomplete"),                       # the reproduction: 10 of 39 shards, one streaming
    (10, False, "model-00011-of-00039.safetensors"),  # cut between files: the series names what is missing
    (0, False, "refs/main is written"),                # cut right after the ref
])
def test_a_cut_download_plans_the_download_again_and_nothing_else(cluster_yaml, seed_snapshot, keep, partial,
                                                                    named):
    desired, raw = _seed(cluster_yaml, seed_snapshot)
    observed = _cut(raw, keep, partial)
    weights = [d for d in diff(desired, observed) if d.kind == "weights"]
    assert [(d.node, d.actionable) for d in weights] == [(HEAD, True)], weights
    assert "incomplete" in weights[0].observed and named in weights[0].observed, weights[0].observed
    steps = plan(desired, observed).steps
    assert [s.id for s in steps if s.kind == "download"] == [f"download/{HEAD}"]
    # never copied, never served, never a reason to stop anything: GLM (`vllm_node`) keeps running meanwhile
    assert not [s for s in steps if s.kind in ("weights", "start-serving", "stop-serving")], steps
    assert not [s for s in steps if s.kind.startswith("stop")], steps


def test_an_offline_source_with_a_cut_tree_blocks_saying_so(cluster_yaml, seed_snapshot):
    desired, raw = _seed(cluster_yaml, seed_snapshot, internet=False)
    observed = _cut(raw, 10, True)
    blocking = [d for d in diff(desired, observed) if d.kind == "weights" and d.blocking]
    assert len(blocking) == 1 and not blocking[0].actionable
    assert "incomplete" in blocking[0].observed and "no internet" in blocking[0].observed
    assert not [s for s in plan(desired, observed).steps if s.kind in ("download", "weights", "start-serving")]


def test_the_whole_seed_tree_is_complete(cluster_yaml, seed_snapshot):
    desired, raw = _seed(cluster_yaml, seed_snapshot)
    weights = Observed.model_validate(raw).node(HEAD).weights
    assert weights is not None
    assert incomplete_reason(weights, "main", "hf-cache") is None
    assert incomplete_reason(weights, SNAP.split("/")[1], "hf-cache") is None


def _w(*paths: str, broken: tuple[str, ...] = ()) -> Weights:
    """A listing as the manifest parses it: partials apart from the files."""
    return Weights(root="/m", present=True, files=[
        WeightFile(path=p, size=None if p in broken else 1, link_target="../../blobs/x" if p in broken else None)
        for p in paths if not p.endswith(".incomplete")], partials=[p for p in paths if p.endswith(".incomplete")])


def test_a_broken_snapshot_link_is_incomplete_and_an_unrelated_commit_is_not_judged():
    rev, other = "a" * 40, "b" * 40
    tree_ = _w(f"snapshots/{rev}/config.json", f"snapshots/{other}/model-00001-of-00002.safetensors",
               broken=(f"snapshots/{rev}/config.json",))
    assert "link to blobs" in (incomplete_reason(tree_, rev, "hf-cache") or "")
    # a commit revision is judged on its own snapshot: the other's half series is not its concern
    whole = _w(f"snapshots/{rev}/config.json", f"snapshots/{other}/model-00001-of-00002.safetensors")
    assert incomplete_reason(whole, rev, "hf-cache") is None
    # a branch cannot tell which snapshot its ref names: every snapshot must be whole
    assert "model-00002-of-00002" in (incomplete_reason(whole, "main", "hf-cache") or "")


def test_a_leftover_partial_beside_its_finished_blob_is_not_a_download_in_progress():
    etag = "d" * 40
    left = _w(f"blobs/{etag}", f"blobs/{etag}.2ed6410c.incomplete", f"snapshots/{'a' * 40}/config.json")
    assert incomplete_reason(left, "a" * 40, "hf-cache") is None
    streaming = _w(f"blobs/{etag}.2ed6410c.incomplete", f"snapshots/{'a' * 40}/config.json")
    assert ".incomplete" in (incomplete_reason(streaming, "a" * 40, "hf-cache") or "")
    old_client = _w(f"blobs/{etag}.incomplete", f"snapshots/{'a' * 40}/config.json")
    assert ".incomplete" in (incomplete_reason(old_client, "a" * 40, "hf-cache") or "")


def test_a_plain_tree_is_judged_whole_and_the_local_dir_metadata_counts_for_streaming():
    assert incomplete_reason(_w("config.json", "model-00001-of-00001.safetensors"), "main", "plain") is None
    streaming = _w("config.json", ".cache/huggingface/download/model-00001-of-00001.safetensors.incomplete")
    assert ".incomplete" in (incomplete_reason(streaming, "main", "plain") or "")


def test_missing_shards_against_a_brute_force_oracle():
    """The arithmetic count and the first names against the obvious enumeration, on every mix of a small
    series; and a hostile series of 99,999 costs the names it shows, not the count it implies."""
    import itertools
    for n in range(1, 6):
        for have in itertools.chain.from_iterable(itertools.combinations(range(1, n + 1), k) for k in range(n + 1)):
            names = [f"m-{i:05d}-of-{n:05d}.safetensors" for i in have]
            absent = [f"m-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1) if i not in have]
            count, first = missing_shards(names)
            assert count == (len(absent) if have else 0) and first == (absent[:3] if have else [])
    count, first = missing_shards(f"s{i}-00001-of-99999.safetensors" for i in range(1000))
    assert count == 1000 * 99_998 and len(first) == 3


def _list(root: Path) -> Weights:
    """The tree as the probe lists it: the probe's own script, run by sh here, parsed as observe parses it."""
    script = sealed(manifest_script(str(root)).split("\n"))
    out = subprocess.run(["sh", "-s"], input=script.script, capture_output=True, text=True, check=True,
                         timeout=60).stdout
    return read_listing(str(root), split_sections(out, script.nonce).get("weights")).weights


def _hf_env(standin: hub.Hub, home: Path) -> dict[str, str]:
    return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home), "HF_HOME": str(home / "hf-home"),
            "HF_ENDPOINT": standin.url, "HF_HUB_DISABLE_TELEMETRY": "1", "HF_HUB_DISABLE_UPDATE_CHECK": "1",
            "HF_HUB_DISABLE_PROGRESS_BARS": "1", "NO_COLOR": "1"}


def test_the_real_client_killed_halfway_leaves_an_incomplete_tree_and_resumes_it_whole(store, tmp_path):  # noqa: F811
    """The world's own artifact: `hf download ... main` (refs first) killed while its bodies stream, slowed by the
    stand-in's throttle (the client writes 10 MiB chunks, so a small shard's `.incomplete` may still be empty:
    its name is what a cut leaves). The probe's listing of what it left is incomplete; the next `hf download`
    finishes it, and the same judgement then says whole."""
    standin = hub.Hub(store / "repos.json", None, tmp_path / "requests.jsonl", port=0, cdn_port=0).start()
    try:
        standin.set_config(throttle=64_000)
        cache = tmp_path / "hub"
        repo = cache / "models--testorg--tiny-moe"
        argv = [hf_cli(), "download", MOE, "--cache-dir", str(cache)]
        proc = subprocess.Popen(argv, env=_hf_env(standin, tmp_path), stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, start_new_session=True)
        try:
            wait_for(lambda: list((repo / "blobs").glob("*.incomplete")), timeout=60, what="a blob streaming")
        finally:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
        cut = _list(repo)
        assert (repo / "refs" / "main").exists(), "the premise: the client wrote the ref first"
        reason = incomplete_reason(cut, "main", "hf-cache")
        assert reason is not None and ".incomplete" in reason, (reason, [f.path for f in cut.files])

        standin.set_config(throttle=0)
        done = subprocess.run(argv, env=_hf_env(standin, tmp_path), capture_output=True, text=True, timeout=120,
                              check=False)
        assert done.returncode == 0, done.stderr
        whole = _list(repo)
        assert incomplete_reason(whole, "main", "hf-cache") is None, [f.path for f in whole.files]
        # huggingface_hub 2.x names each partial per process and a kill leaves them: the finished blob beside one
        # is what says it is a leftover (core/completeness._streaming)
        assert whole.partials, [f.path for f in whole.files]
        assert not any(f.path.endswith(".incomplete") for f in whole.files), "a partial is never the model's"
        assert any(f.path.endswith(".safetensors") for f in whole.files)
    finally:
        standin.stop()
