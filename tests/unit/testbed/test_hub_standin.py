"""The Hub stand-in (testbed/hub.py) against the REAL `hf` CLI (huggingface_hub 2.4.0, testbed/hf-requirements.txt,
installed by testbed/install-deps.sh into /opt/spark-testbed/hf): what `hf download` writes must be what the
testbed lays out itself (testbed/weights.py), byte for byte, in both layouts; a gated repo needs the token.

Loopback only: the stand-in listens on 127.0.0.1 (kernel-chosen ports), and the CLI's own calls elsewhere (PyPI's
update check, telemetry) are switched off by HF_HUB_DISABLE_UPDATE_CHECK / HF_HUB_DISABLE_TELEMETRY.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from testbed import hub, weights
from testbed.layout import MODELS
from testbed.proc import wait_for
from testbed.scenarios import shard_plan

HF = os.environ.get("SPARK_TESTBED_HF", "/opt/spark-testbed/hf/bin/hf")
SIZE = 1 << 20          # per model: two 512 KiB shards for tiny-dense, four 256 KiB for tiny-moe
DENSE, MOE = "testorg/tiny-dense", "testorg/tiny-moe"


def hf_cli() -> str:
    assert Path(HF).exists() or shutil.which(HF), (
        f"{HF} not found: `bash testbed/install-deps.sh` installs the pinned `hf` CLI (testbed/hf-requirements.txt)")
    return HF


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("hubstore")
    hub.ensure_testbed_repos(SIZE, root)
    return root


@pytest.fixture
def standin(store, tmp_path):
    h = hub.Hub(store / "repos.json", None, tmp_path / "requests.jsonl", port=0, cdn_port=0).start()
    yield h
    h.stop()


def hf(standin: hub.Hub, home: Path, *args: str, token: str | None = None, timeout: float = 120):
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home), "HF_HOME": str(home / "hf-home"),
           "HF_ENDPOINT": standin.url, "HF_HUB_DISABLE_TELEMETRY": "1", "HF_HUB_DISABLE_UPDATE_CHECK": "1",
           "HF_HUB_DISABLE_PROGRESS_BARS": "1", "NO_COLOR": "1"}
    if token:
        env["HF_TOKEN"] = token
    return subprocess.run([hf_cli(), "download", *args], capture_output=True, text=True, timeout=timeout, env=env,
                          check=False)


def reference(tmp: Path, model: str, layout: str) -> Path:
    """The testbed's own layout of *model* (what `up` generates on the head)."""
    shards, shard_bytes = shard_plan(SIZE, model)
    return weights.generate(tmp / "ref", model, MODELS[model], layout, shards, shard_bytes)


def tree(d: Path, skip: tuple[str, ...] = ()) -> dict[str, bytes]:
    """relative path -> bytes (symlinks followed) of every file below d, but those under a *skip* prefix."""
    out = {}
    for p in sorted(d.rglob("*")):
        rel = str(p.relative_to(d))
        if p.is_file() and not rel.startswith(skip):
            out[rel] = p.read_bytes()
    return out


def links(snapshot: Path) -> dict[str, str]:
    """snapshot entry -> the blob it points to (name only); every entry must be a relative link into ../../blobs."""
    out = {}
    for p in sorted(snapshot.iterdir()):
        assert p.is_symlink(), f"{p} is not a symlink"
        target = os.readlink(p)
        assert not os.path.isabs(target) and target.startswith("../../blobs/"), target
        out[p.name] = os.path.basename(target)
    return out


def assert_same_cache(got_repo: Path, ref_snapshot: Path, rev: str) -> None:
    ref_repo = ref_snapshot.parent.parent
    got_snapshot = got_repo / "snapshots" / rev
    assert links(got_snapshot) == links(ref_snapshot)                 # same names, same blob names (sha256 / sha1)
    assert tree(got_repo / "blobs") == tree(ref_repo / "blobs")       # same blobs, same bytes
    assert tree(got_snapshot) == tree(ref_snapshot)
    assert sorted(os.listdir(got_repo / "snapshots")) == [rev]
    assert not list((got_repo / "blobs").glob("*.incomplete"))


@pytest.mark.parametrize("model", [DENSE, MOE])
def test_hf_download_cache_dir_is_the_testbed_hf_cache_layout(standin, tmp_path, model):
    rev = MODELS[model]
    cache = tmp_path / "hub"
    r = hf(standin, tmp_path, model, "--revision", rev, "--cache-dir", str(cache))
    assert r.returncode == 0, r.stderr
    org, name = model.split("/")
    repo = cache / f"models--{org}--{name}"
    assert_same_cache(repo, reference(tmp_path, model, "hf-cache"), rev)
    # a commit-hash revision writes no ref (huggingface_hub file_download.py
    # `_cache_commit_hash_for_specific_revision`): refs/main is only written when `main` is asked for
    assert not (repo / "refs" / "main").exists()
    kinds = [(q["method"], q["kind"]) for q in hub_requests(standin)]
    assert ("GET", "tree") in kinds and ("GET", "info") not in kinds   # the sha needs no repo_info
    n_lfs = len(weights.shard_names(shard_plan(SIZE, model)[0]))
    assert kinds.count(("GET", "cdn")) == n_lfs                        # every shard through the CDN redirect


def test_hf_download_main_writes_refs_main_as_the_testbed_does(standin, tmp_path):
    cache = tmp_path / "hub"
    r = hf(standin, tmp_path, DENSE, "--cache-dir", str(cache))    # no --revision: main
    assert r.returncode == 0, r.stderr
    ref = reference(tmp_path, DENSE, "hf-cache")
    repo = cache / "models--testorg--tiny-dense"
    assert_same_cache(repo, ref, MODELS[DENSE])
    assert (repo / "refs" / "main").read_bytes() == (ref.parent.parent / "refs" / "main").read_bytes()
    assert ("GET", "info") in [(q["method"], q["kind"]) for q in hub_requests(standin)]


def test_hf_download_local_dir_is_the_testbed_plain_layout(standin, tmp_path):
    out = tmp_path / "plain" / "testorg--tiny-moe"
    r = hf(standin, tmp_path, MOE, "--revision", MODELS[MOE], "--local-dir", str(out))
    assert r.returncode == 0, r.stderr
    assert tree(out, skip=(".cache",)) == tree(reference(tmp_path, MOE, "plain"))


def test_a_gated_repo_needs_the_token(standin, tmp_path):
    standin.set_config(gated=[DENSE])
    cache = tmp_path / "hub"
    r = hf(standin, tmp_path, DENSE, "--revision", MODELS[DENSE], "--cache-dir", str(cache))
    assert r.returncode != 0
    # the CLI's words for a GatedRepoError (huggingface_hub cli/_errors.py)
    assert f"Access denied. Model '{DENSE}' requires approval." in r.stderr, r.stderr
    assert not list(cache.glob("models--*/blobs/*"))
    r = hf(standin, tmp_path, DENSE, "--revision", MODELS[DENSE], "--cache-dir", str(cache), token="hf_wrong")
    assert r.returncode != 0 and "Invalid credentials" in r.stderr, r.stderr
    r = hf(standin, tmp_path, DENSE, "--revision", MODELS[DENSE], "--cache-dir", str(cache), token=hub.HUB_TOKEN)
    assert r.returncode == 0, r.stderr
    assert_same_cache(cache / "models--testorg--tiny-dense", reference(tmp_path, DENSE, "hf-cache"), MODELS[DENSE])
    got = [q for q in hub_requests(standin) if q["status"] in (200, 302)]
    assert all(q["auth"] for q in got if q["kind"] == "resolve")     # the token went to the Hub's origin...
    assert not any(q["auth"] for q in got if q["kind"] == "cdn")     # ...and not to the CDN (a signed URL's host)


def test_unknown_revision_and_repo_fail_as_on_the_hub(standin, tmp_path):
    r = hf(standin, tmp_path, DENSE, "--revision", "3" * 40, "--cache-dir", str(tmp_path / "hub"))
    assert r.returncode != 0 and "revision" in r.stderr.lower(), r.stderr
    r = hf(standin, tmp_path, "testorg/nope", "--cache-dir", str(tmp_path / "hub"))
    assert r.returncode != 0 and "not found" in r.stderr.lower(), r.stderr


def test_throttle_and_a_dropped_body(standin, tmp_path):
    """At 4 MB/s the 1 MiB model takes >= 0.25 s (a test can watch the .incomplete blob grow). A body cut after
    100 kB is fetched again by the client, and the bytes still match: huggingface_hub's `http_get` resumes with
    `Range: bytes=N-` only from what it has written, and it reads 10 MiB chunks (constants.DOWNLOAD_CHUNK_SIZE), so
    a body cut before 10 MiB restarts from 0 (seen here: no Range)."""
    standin.set_config(throttle=4_000_000, drop_after=100_000, drop_times=1)
    t = time.monotonic()
    r = hf(standin, tmp_path, DENSE, "--revision", MODELS[DENSE], "--cache-dir", str(tmp_path / "hub"))
    took = time.monotonic() - t
    assert r.returncode == 0, r.stderr
    assert took >= 0.25
    assert_same_cache(tmp_path / "hub" / "models--testorg--tiny-dense", reference(tmp_path, DENSE, "hf-cache"),
                      MODELS[DENSE])
    reqs = hub_requests(standin)
    dropped = [q for q in reqs if q["status"] < 0]
    assert [(q["status"], q["bytes"]) for q in dropped] == [(-200, 100_000)]
    again = [q for q in reqs if q["path"] == dropped[0]["path"] and q["status"] > 0]
    assert len(again) == 1 and again[0]["range"] is None
    assert standin.stats()["in_flight"] == 0


def test_range_requests_are_answered_206(standin, tmp_path):
    """What the client sends to resume (`http_get`: `Range: bytes=N-`), answered as the Hub's CDN does."""
    import json
    import urllib.request
    repo = json.loads((Path(standin.db_path)).read_text())[DENSE]
    path, f = next((p, f) for p, f in repo["files"].items() if f["lfs"])
    data = (Path(repo["dir"]) / path).read_bytes()
    url = f"{standin.cdn_url}/repos/{DENSE}/{f['lfs']['oid']}"
    with urllib.request.urlopen(urllib.request.Request(url, headers={"Range": "bytes=1000-"}), timeout=10) as resp:
        assert resp.status == 206
        assert resp.headers["Content-Range"] == f"bytes 1000-{len(data) - 1}/{len(data)}"
        assert resp.read() == data[1000:]
    with urllib.request.urlopen(urllib.request.Request(url, headers={"Range": "bytes=10-19"}), timeout=10) as resp:
        assert resp.read() == data[10:20]


def hub_requests(standin: hub.Hub) -> list[dict]:
    import json
    assert standin.log_path is not None
    return [json.loads(line) for line in standin.log_path.read_text().splitlines()]


def test_the_testbed_process_reads_its_config_file_when_it_changes(store, tmp_path, monkeypatch):
    """`hub.configure()` (what a test calls while the testbed runs the stand-in as its own process) takes effect at
    the next request; `reset_config()` (every scenario) puts the defaults back."""
    import urllib.error
    import urllib.request
    monkeypatch.setenv("SPARK_TESTBED_STATE", str(tmp_path))
    h = hub.Hub(store / "repos.json", hub.config_file(), hub.log_file(), port=0, cdn_port=0).start()
    try:
        url = f"{h.url}/{DENSE}/resolve/main/config.json"

        def head_status(token: str | None = None) -> int:
            req = urllib.request.Request(url, method="HEAD",
                                         headers={"Authorization": f"Bearer {token}"} if token else {})
            try:
                with urllib.request.urlopen(req, timeout=10) as resp:
                    return resp.status
            except urllib.error.HTTPError as e:
                assert e.headers["X-Error-Code"] == "GatedRepo"
                return e.code

        assert head_status() == 200
        hub.configure(gated=[DENSE], tokens=["hf_other"])
        assert head_status() == 401 and head_status("hf_other") == 200
        hub.reset_config()
        assert head_status() == 200
        # a request is logged just after its answer went out (by its own handler thread, so the next request's line
        # may come first): poll, in any order
        wait_for(lambda: sorted(q["status"] for q in hub.requests()) == [200, 200, 200, 401], timeout=30,
                 what="the four requests in the log")
    finally:
        h.stop()


def test_a_published_repo_downloads_as_install_snapshot_lays_it_out(standin, store, tmp_path):
    """`real-vllm` publishes the tiny Llama's files (testbed/realvllm/image.py `ensure_model`) on the Hub stand-in and
    lays them out on the head with `weights.install_snapshot`: `hf download` of it gives the same cache."""
    model, rev = "testorg/tiny-llama", "3" * 40
    files = {"config.json": b'{"model_type": "llama"}\n', "model.safetensors": bytes(range(256)) * 300,
             "tokenizer.json": b"{}\n"}
    hub.publish(model, rev, files, root=store)
    r = hf(standin, tmp_path, model, "--cache-dir", str(tmp_path / "hub"))
    assert r.returncode == 0, r.stderr
    ref = weights.install_snapshot(tmp_path / "ref", model, rev, files)
    repo = tmp_path / "hub" / "models--testorg--tiny-llama"
    assert_same_cache(repo, ref, rev)
    assert (repo / "refs" / "main").read_text() == rev
