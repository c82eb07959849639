"""Staging on the internet node, for real (issue 32, item 2): in the `fresh-head` scenario the head holds neither
the served model nor the serving image; "the internet" is the head's own loopback, where a Hugging Face Hub
stand-in serves the model's files (testbed/hub.py, driven by the real `hf` CLI) and Debian's docker-registry holds
the image (testbed/registry.py). The GLM co-tenant `vllm_node` runs on the head, as in the seed.

One pass of `apply` stages and stops nothing: the head downloads the tree with `hf download` and pulls the image,
GLM keeps serving. The next passes copy to the worker, stop GLM only then, start, and a completion answers."""

from __future__ import annotations

import json
import os
import subprocess
import time

import pytest
import yaml

from testbed import hub
from tests.e2e.test_converge import CLI, containers, content_hashes, reconciler

pytestmark = pytest.mark.e2e

TREE = "/srv/spark-testbed/head/models/hub/models--testorg--tiny-moe"
IMAGE = "127.0.0.1:5000/testorg/vllm-standin:latest"


@pytest.fixture
def fresh(testbed):
    yield testbed.reset("fresh-head")
    testbed.reset("seed")  # the tests that take the testbed as they find it expect the seed's head


def test_a_fresh_head_stages_while_glm_serves_then_converges(fresh):
    tb = fresh
    desired = str(tb.desired_state_fresh)
    assert tb.exec("head", f"test -e {TREE}").returncode != 0, "the premise: the head lacks the model"
    assert tb.docker("head", "image", "inspect", IMAGE, check=False).returncode != 0, "and the image"
    assert containers(tb, "head")["vllm_node"]["State"]["Running"]

    staged = reconciler("apply", desired, "--yes", "--max-passes", "1", timeout=600)
    assert staged.returncode == 1, staged.stdout + staged.stderr  # not converged after one pass: by design
    out = staged.stdout + staged.stderr
    assert "download/head" in out and "pull-image/head" in out
    assert "vllm_node keeps running" in out
    assert containers(tb, "head")["vllm_node"]["State"]["Running"], "GLM is not stopped for a start that waits"
    assert tb.docker("head", "image", "inspect", IMAGE, check=False).returncode == 0
    downloaded = content_hashes(tb, "head", TREE)
    assert any(p.endswith(".safetensors") for p in downloaded)
    assert tb.exec("worker", "test -e /srv/spark-testbed/worker/models/hub/models--testorg--tiny-moe").returncode != 0

    converged = reconciler("apply", desired, "--yes", timeout=900)
    assert converged.returncode == 0, converged.stdout + converged.stderr
    assert "vllm_node" not in {n for n, c in containers(tb, "head").items() if c["State"]["Running"]}
    assert content_hashes(tb, "worker", "/srv/spark-testbed/worker/models/hub/models--testorg--tiny-moe") == \
        downloaded
    body = json.dumps({"model": "tiny-moe", "prompt": "ping", "max_tokens": 2})
    answer = tb.exec("head", f"curl -s -m 30 -H 'Content-Type: application/json' -d '{body}' "
                             "http://127.0.0.1:8000/v1/completions", check=True).stdout
    assert json.loads(answer)["choices"]


def _with_token_scoped(tb, tmp_path) -> str:
    data = yaml.safe_load(tb.desired_state_fresh.read_text())
    data["serving"].setdefault("secrets", {})["HF_TOKEN"] = "internet"
    out = tmp_path / "gated.yaml"
    out.write_text(yaml.safe_dump(data, sort_keys=False, explicit_end=True))
    return str(out)


def test_a_gated_model_downloads_only_with_the_token_scoped_internet(fresh, tmp_path):
    """Without the token the Hub refuses: the download fails saying what to do, and GLM keeps serving; with
    HF_TOKEN scoped `internet` the Hub sees it as a bearer header (never an argv) and the tree arrives."""
    tb = fresh
    hub.configure(gated=["testorg/tiny-moe"], tokens=[hub.HUB_TOKEN])
    desired = _with_token_scoped(tb, tmp_path)
    env = {**os.environ, "HF_TOKEN": "hf_wrong"}
    refused = subprocess.run([CLI, "apply", desired, "--yes", "--max-passes", "1"], capture_output=True, text=True,
                             timeout=600, env=env, check=False)
    out = refused.stdout + refused.stderr
    assert refused.returncode == 1 and "download/head" in out and "HF_TOKEN" in out, out
    assert "hf_wrong" not in out, "a secret never reaches the output"
    assert containers(tb, "head")["vllm_node"]["State"]["Running"]
    assert tb.exec("head", f"test -d {TREE}/snapshots").returncode != 0

    since = time.time()
    allowed = subprocess.run([CLI, "apply", desired, "--yes", "--max-passes", "1"], capture_output=True, text=True,
                             timeout=600, env={**env, "HF_TOKEN": hub.HUB_TOKEN}, check=False)
    assert hub.HUB_TOKEN not in allowed.stdout + allowed.stderr
    assert any(f.endswith(".safetensors") for f in content_hashes(tb, "head", TREE)), allowed.stdout
    seen = [r for r in hub.requests(since) if "tiny-moe" in r.get("path", "")]
    asked = [r for r in seen if r.get("kind") in ("info", "tree", "resolve")]  # the CDN's signed URLs need none
    assert asked and all(r["auth"] for r in asked), asked[:3]


def _cut_by_its_deadline(tb, tmp_path, deadline: str) -> str:
    """The fresh head's file at revision `main` (the client writes refs/main before any file, as on the Hub),
    the download's deadline `deadline`."""
    data = yaml.safe_load(tb.desired_state_fresh.read_text())
    data["model"]["revision"] = "main"
    data["policy"].setdefault("timeouts", {})["weights_sync"] = deadline
    out = tmp_path / f"cut-{deadline}.yaml"
    out.write_text(yaml.safe_dump(data, sort_keys=False, explicit_end=True))
    return str(out)


def test_a_download_cut_halfway_is_taken_up_again_and_nothing_stops_for_it(fresh, tmp_path):
    """Issue 52, item 1, for real: the Hub throttled so that the download step's own deadline cuts `hf download`
    halfway (as a reboot, a daemon restart or a Hub error at hour two would). What is left is the real client's
    cut tree: refs/main, part of the snapshot, partials. It is not the model: the next plan downloads again and
    neither copies it, stops GLM nor starts; once the Hub is fast again the download finishes and the cluster
    converges on the whole tree."""
    tb = fresh
    hub.configure(throttle=2_000_000)  # ~64 MB of tiny-moe: over 30 s, against a 6 s deadline
    cut = _cut_by_its_deadline(tb, tmp_path, "6s")
    first = reconciler("apply", cut, "--yes", "--max-passes", "1", timeout=600)
    out = first.stdout + first.stderr
    assert first.returncode == 1 and "download/head" in out, out
    assert tb.exec("head", f"test -s {TREE}/refs/main").returncode == 0, "the premise: the ref came first"
    left = tb.exec("head", f"find {TREE}/blobs -name '*.incomplete'", check=True).stdout.split()
    assert left, "the premise: the cut left partials"
    assert containers(tb, "head")["vllm_node"]["State"]["Running"], "GLM is not stopped for a cut download"

    planned = reconciler("plan", cut, "--json", timeout=300)
    steps = [s["id"] for s in json.loads(planned.stdout)["steps"]]
    assert "download/head" in steps, steps
    assert not [s for s in steps if s.split("/")[0] in ("weights", "start-serving", "launch-model",
                                                          "stop-container", "stop-serving")], steps
    assert tb.exec("worker", "test -e /srv/spark-testbed/worker/models/hub/models--testorg--tiny-moe"
                   ).returncode != 0, "nothing of a cut tree is copied"

    hub.configure(throttle=0)
    converged = reconciler("apply", _cut_by_its_deadline(tb, tmp_path, "1h"), "--yes", timeout=900)
    assert converged.returncode == 0, converged.stdout + converged.stderr
    whole = {p: h for p, h in content_hashes(tb, "head", TREE).items() if not p.endswith(".incomplete")}
    assert sum(p.endswith(".safetensors") for p in whole) >= 2
    assert content_hashes(tb, "worker", "/srv/spark-testbed/worker/models/hub/models--testorg--tiny-moe") == whole
    assert "vllm_node" not in {n for n, c in containers(tb, "head").items() if c["State"]["Running"]}
