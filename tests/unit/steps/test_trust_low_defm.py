"""The trust boundary's third pass (issue 53), low findings D, E, F and M, each reproduced the way it bites on
the code before the fix: real files, real links, the real shell and the real console command; no node, no testbed.

D: a copy rewritten in place at the same sizes (a fine-tune saved over the shards) was removed by retention.
E: a ledger line naming `/etc` or a home was planned, and on the node removed, like any copy.
F: `write_durably`'s fixed `NAME.tmp` was opened through a planted link (`reconciler rollback` as root wrote, chmodded
   and chowned where it led); `init -o` and `discover -o` wrote through a link at their path.
M: the compile cache directories were made and chmodded through a link (and docker mounted where it led); `verify`
   believed hashes anyone who can write ~/.cache could put in its cache there.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest
from click.testing import CliRunner

from reconciler.core.observed import CopyRecord, WeightFile, Weights
from reconciler.core.planning import Step
from reconciler.core.retention import out_of_reach, removals
from reconciler.edge import ledger
from reconciler.edge.facts.base import Section
from reconciler.edge.steps import weights as step
from reconciler.edge.steps.serving import CACHE_DIR_LINKED, cache_dirs_argv
from reconciler.loop import history
from reconciler.loop.generations import write_durably
from tests.unit.recorded import load
from tests.unit.steps.test_retention import (
    BY,
    DIGEST,
    HUB,
    _prune_ctx,
    containers_now,
    prune_weights,
    tree,
    with_copies,
)


@pytest.fixture
def desired():
    """The recorded cluster with retention on (test_retention's)."""
    return load(("policy:\n  mode: enforce", "policy:\n  mode: enforce\n  retention: {prune: true}"))

# ---------------------------------------------------------------------------------------------- D: rewritten in place


def test_the_tree_digest_changes_with_a_file_s_mtime_alone():
    """Same paths, same sizes, same link values: only the mtime differs, which is all a rewrite in place leaves."""
    before = Weights(root="/m", present=True, files=[WeightFile(path="config.json", size=517, mtime=1.5),
                                                     WeightFile(path="w", size=None, mtime=1.0, link_target="x")])
    after = before.model_copy(update={"files": [before.files[0].model_copy(update={"mtime": 2.5}), before.files[1]]})
    assert before.digest() != after.digest()
    assert before.digest() == before.model_copy().digest()


def test_a_copy_rewritten_in_place_at_the_same_sizes_is_kept(tmp_path, nodes, monkeypatch):
    """A fine-tune saved over the copied shards (every byte new, every size the same) and an edited config.json of
    the same length: retention's digest saw paths and sizes only, matched, and `rm -rf` took the person's work."""
    from tests.unit.steps.test_weights_tree import _desired, hf_tree, sync

    containers_now(monkeypatch)
    repo = hf_tree(tmp_path / "src", shards=2, shard_bytes=10_000)
    sync(tmp_path, nodes)
    dst = tmp_path / "dst" / "hub" / repo.name
    shards = sorted(p for p in (dst / "blobs").iterdir() if p.is_file() and p.stat().st_size >= 10_000)
    assert shards, "the copy's shards are regular files"
    tuned = shards[0]
    size, when = tuned.stat().st_size, tuned.stat().st_mtime
    tuned.write_bytes(b"\x7f" * size)  # the fine-tune, saved over the shard: same size
    os.utime(tuned, (when + 60, when + 60))
    events: list = []
    prune_weights(_prune_ctx(tmp_path, nodes, _desired, events),
                  Step("prune-weights", "dst", "test", remove=(str(dst),)))
    assert tuned.read_bytes() == b"\x7f" * size, "retention removed a copy rewritten in place"
    [why] = [f["why"] for e, f in events if e == "retention.kept"]
    assert why.startswith("unreadable, or changed since this cluster copied it (files added, removed, resized or "
                          "rewritten")
    assert ledger.parse_copies(Section((nodes["dst"].home / ledger.LEDGER).read_text(), 0), "dst") == [], \
        "released: never proposed again"


# ---------------------------------------------------------------------------------------------- E: planted lines

PLANTED = ["/etc", "/home/spark", "/home/spark/.ssh", "/root", "/srv/spark-testbed/worker1",
           "/srv/spark-testbed/worker1/models", "/var/lib/docker/volumes", "/srv/spark-testbed/other/hub/models--x"]


def test_a_planted_ledger_line_naming_etc_or_a_home_is_never_planned(desired, seen):
    """The newest lines name the system and the SSH user's home: once ranked like copies, planned past
    `previous` and proposed for removal. Now they are not retention's at all: they neither take a `previous`
    place (the older real copy is still the one kept) nor are removed."""
    planted = [CopyRecord(kind="weights", key=key, detail=DIGEST, by=BY, copied_at=1, used_at=900 + i)
               for i, key in enumerate(PLANTED)]
    observed = with_copies(seen, *planted, tree("old-a", 100), tree("old-b", 50))
    from reconciler.core.ownership import owner

    got = [key for r in removals(desired, observed, owner(desired, observed), None) for key in r.weights]
    assert got == [f"{HUB}/models--testorg--old-b"], "only the copy beyond the one previous, never a planted line"
    for key in PLANTED:
        assert out_of_reach(desired, "worker1", key) is not None, key
    assert out_of_reach(desired, "worker1", f"{HUB}/models--testorg--old-a") is None
    assert out_of_reach(desired, "worker1", "/srv/spark-testbed/worker1/models/plain-model") is None
    assert out_of_reach(desired, "worker1", "/srv/spark-testbed/worker1/models/.") is not None, "the parent itself"


def test_the_step_never_removes_a_planted_line_s_home_whatever_its_digest(tmp_path, nodes, monkeypatch):
    """A line naming a home (the test's stand-in for ~: its own .ssh, its files), with the digest of exactly what
    it holds: the step re-checked only the digest, the mounts and the current model, and removed it."""
    from tests.unit.steps.test_weights_tree import _desired, probe

    containers_now(monkeypatch)
    home = tmp_path / "home" / "spark"
    (home / ".ssh").mkdir(parents=True)
    (home / ".ssh" / "authorized_keys").write_text("ssh-ed25519 AAAA the-owner\n")
    (home / "notes.txt").write_text("mine")
    digest = probe(home).digest()
    book = nodes["dst"].home / ledger.LEDGER
    book.parent.mkdir(parents=True, exist_ok=True)
    book.write_text(f"copied\tdst\tweights\t{home}\t100\thead:22\t{digest}\n")
    events: list = []
    prune_weights(_prune_ctx(tmp_path, nodes, _desired, events),
                  Step("prune-weights", "dst", "test", remove=(str(home),)))
    assert (home / ".ssh" / "authorized_keys").is_file() and (home / "notes.txt").read_text() == "mine", \
        "retention removed a home a planted ledger line named"
    [why] = [f["why"] for e, f in events if e == "retention.kept"]
    assert why == f"it is not below {tmp_path / 'dst'}, where this file's models are"


# ---------------------------------------------------------------------------------------------- F: the temp file


def _victim(tmp_path: Path) -> Path:
    victim = tmp_path / "elsewhere" / "shadow"
    victim.parent.mkdir()
    victim.write_text("root:$6$secret:19000:0:99999:7:::\n")
    victim.chmod(0o640)
    return victim


def _untouched(victim: Path) -> None:
    assert victim.read_text() == "root:$6$secret:19000:0:99999:7:::\n", "written through the planted link"
    assert stat.S_IMODE(victim.stat().st_mode) == 0o640, "chmodded through the planted link"


def test_write_durably_never_writes_through_a_link_planted_at_its_temporary_name(tmp_path):
    """The state dir's files: a link at `NAME.tmp` (the fixed name it used) to a file elsewhere. The write lands
    in the file, as a regular file; the linked file keeps its bytes and mode, and no temporary file is left."""
    victim = _victim(tmp_path)
    state = tmp_path / "state"
    state.mkdir()
    file = state / "state-0123456789abcdef.json"
    for planted in (file.with_suffix(".tmp"), file.with_name(file.name + ".tmp")):
        planted.symlink_to(victim)
    write_durably(file, '{"generation": 2}', like=os.stat_result((0o100644, 0, 0, 1, 0, 0, 0, 0, 0, 0)))
    _untouched(victim)
    assert file.read_text() == '{"generation": 2}' and not file.is_symlink()
    assert stat.S_IMODE(file.stat().st_mode) == 0o644
    assert sorted(p.name for p in state.iterdir()) == sorted([file.name, "state-0123456789abcdef.tmp",
                                                             file.name + ".tmp"]), "a temporary file left"


def test_rollback_s_write_back_never_writes_through_a_planted_link(tmp_path):
    """`reconciler rollback` (as root) writes the kept generation over the desired-state file and a copy of what it
    held beside it, with the file's mode and owner: through a link at `cluster.tmp` it wrote, chmodded and
    chowned the linked file."""
    victim = _victim(tmp_path)
    conf = tmp_path / "etc-reconciler"
    conf.mkdir()
    path = conf / "cluster.yaml"
    path.write_text("generation: 3\n")
    path.chmod(0o600)
    (conf / "cluster.tmp").symlink_to(victim)
    copy = history.write_back(path, "generation: 2\n", 1_764_000_000.0)
    _untouched(victim)
    assert path.read_text() == "generation: 2\n" and copy.read_text() == "generation: 3\n"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and not path.is_symlink()


def _plant(out: Path, victim: Path) -> None:
    for planted in (out, out.with_suffix(".tmp"), out.with_name(out.name + ".tmp")):
        planted.symlink_to(victim)


def test_init_o_never_writes_through_a_link_at_its_path_or_its_temporary_name(tmp_path):
    from reconciler.cli import main

    victim = _victim(tmp_path)
    out = tmp_path / "cluster.yaml"
    _plant(out, victim)
    result = CliRunner().invoke(main, ["init", "--recipe", "bge-m3", "--head", "h", "-o", str(out)])
    assert result.exit_code == 0, result.output
    _untouched(victim)
    assert not out.is_symlink() and out.read_text().endswith("\n...\n") and "# GUESS:" in out.read_text()
    assert stat.S_IMODE(out.stat().st_mode) == 0o666 & ~_umask()


def test_discover_o_never_writes_through_a_link_at_its_path_or_its_temporary_name(tmp_path, monkeypatch):
    from reconciler.cli import main
    from reconciler.edge import discover as disc

    monkeypatch.setattr(disc, "sessions_for", lambda *a, **k: [])
    monkeypatch.setattr(disc, "probe", lambda sessions: {})
    monkeypatch.setattr(disc, "render", lambda facts, **k: "# GUESS: a drafted file\nnodes: []\n")
    victim = _victim(tmp_path)
    out = tmp_path / "cluster.yaml"
    _plant(out, victim)
    existing = tmp_path / "kept.yaml"
    existing.write_text("old\n")
    existing.chmod(0o604)
    for target in (out, existing):
        result = CliRunner().invoke(main, ["discover", "--head", "10.0.0.1", "-o", str(target)])
        assert f"wrote {target}" in result.output, result.output
        assert target.read_text() == "# GUESS: a drafted file\nnodes: []\n" and not target.is_symlink()
    _untouched(victim)
    assert stat.S_IMODE(existing.stat().st_mode) == 0o604, "a file already there keeps its mode"


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


# ---------------------------------------------------------------------------------------------- M: caches


def test_a_compile_cache_directory_that_is_a_link_is_refused_and_its_target_untouched(tmp_path):
    """Anyone who can write ~/.cache (a co-tenant container mounting it) links ~/.cache/vllm to a directory of
    the user's (here ~/.ssh): `mkdir -p && chmod 0700` went through it, and docker's `-v` would then have mounted
    it into the serving container as root. The real fragment, run by a real sh."""
    home = tmp_path / "home"
    ssh = home / ".ssh"
    ssh.mkdir(parents=True)
    ssh.chmod(0o755)
    (ssh / "authorized_keys").write_text("ssh-ed25519 AAAA the-owner\n")
    (home / ".cache").mkdir()
    (home / ".cache" / "vllm").symlink_to(ssh)
    triton = home / ".triton"
    dirs = [str(triton), str(home / ".cache" / "vllm"), str(home / ".tilelang")]
    done = subprocess.run(cache_dirs_argv(dirs), capture_output=True, text=True, timeout=30, check=False)
    assert (done.returncode, done.stdout) == (CACHE_DIR_LINKED, f"{home}/.cache/vllm\n"), done
    assert stat.S_IMODE(ssh.stat().st_mode) == 0o755, "chmodded through the link"
    assert (home / ".cache" / "vllm").is_symlink() and sorted(os.listdir(ssh)) == ["authorized_keys"]
    assert stat.S_IMODE(triton.stat().st_mode) == 0o700 and not (home / ".tilelang").exists(), \
        "the ones before are made; nothing after the refusal"


def test_a_dangling_cache_link_is_refused_and_nothing_is_made_where_it_points(tmp_path):
    home = tmp_path / "home"
    (home / ".cache").mkdir(parents=True)
    target = tmp_path / "elsewhere" / "made-by-us"
    (home / ".cache" / "vllm").symlink_to(target)
    done = subprocess.run(cache_dirs_argv([str(home / ".cache" / "vllm")]), capture_output=True, text=True,
                          timeout=30, check=False)
    assert done.returncode == CACHE_DIR_LINKED and not target.exists() and not target.parent.exists()


def test_cache_directories_under_a_linked_parent_are_still_made(tmp_path):
    """A link above the cache directory (a home or ~/.cache moved to another disk) is its owner's, not refused."""
    real = tmp_path / "disk" / "cache"
    real.mkdir(parents=True)
    home = tmp_path / "home"
    home.mkdir()
    (home / ".cache").symlink_to(real)
    subprocess.run(cache_dirs_argv([str(home / ".cache" / "vllm")]), check=True, timeout=30)
    assert stat.S_IMODE((real / "vllm").stat().st_mode) == 0o700


def _plain_copy(tmp_path: Path) -> tuple[Path, Path]:
    src, dst = tmp_path / "src" / "model", tmp_path / "dst" / "model"
    src.mkdir(parents=True)
    (src / "config.json").write_text('{"architectures": ["X"]}')
    (src / "model.safetensors").write_bytes(bytes(range(256)) * 64)
    shutil.copytree(src, dst)
    return src, dst


def test_a_forged_entry_in_the_old_hash_cache_is_not_believed(tmp_path):
    """A byte flipped on the target, and an entry in the source's `~/.cache/spark-reconciler` claiming the source
    file has the flipped file's hash, keyed by the source file's own path, size and mtime: `verify` answered
    from it and said the copies match. The cache is now in ~/.spark-reconciler (0700), where no one else writes."""
    from tests.unit.steps.test_weights_tree import Local, _desired

    src, dst = _plain_copy(tmp_path)
    flipped = bytearray((dst / "model.safetensors").read_bytes())
    flipped[1000] ^= 0xFF
    (dst / "model.safetensors").write_bytes(bytes(flipped))
    sessions = {"src": Local(tmp_path / "home-src"), "dst": Local(tmp_path / "home-dst")}
    stats = step._listing(sessions["src"], str(src), 30).resolved
    size, mtime = stats["model.safetensors"]
    forged = tmp_path / "home-src" / ".cache" / "spark-reconciler" / step._cache_path(str(src)).rsplit("/", 1)[1]
    forged.parent.mkdir(parents=True)
    forged.write_text(f"model.safetensors\t{size}\t{mtime}\t{hashlib.sha256(bytes(flipped)).hexdigest()}\n")
    found = step.verify_weights(_desired(tmp_path, layout="plain"), sessions, "dst", timeout=60)
    assert found.mismatched == ("model.safetensors",), "verify believed a forged hash"
    assert found.hashed_on_source == 2
    cache = tmp_path / "home-src" / step._cache_path(str(src))
    assert cache.parent == tmp_path / "home-src" / ".spark-reconciler"
    assert stat.S_IMODE(cache.parent.stat().st_mode) == 0o700 and stat.S_IMODE(cache.stat().st_mode) == 0o600


def test_the_weights_copy_s_file_lists_are_written_in_the_user_s_own_directory(tmp_path):
    """The rsync stream's file list lived beside the hash cache in ~/.cache, where whoever writes it could rewrite
    the list between its write and rsync's read; now in the 0700 ~/.spark-reconciler (the stream's instructions,
    issue 53's finding A, are written the same way)."""
    from tests.unit.steps.test_weights_tree import Local

    node = Local(tmp_path / "home")
    run = next(step._upload_file_list("src", "dst", "/hub/models--a--b", 0, b"config.json\0"))
    assert run.argv[-1].startswith(".spark-reconciler/rsync-dst-")
    node.run(run.argv, stdin=run.stdin, timeout=30)
    listed = tmp_path / "home" / run.argv[-1]
    assert listed.read_bytes() == b"config.json\0"
    assert stat.S_IMODE(listed.parent.stat().st_mode) == 0o700 and not (tmp_path / "home" / ".cache").exists()
