"""Issue 53, finding A (HIGH): what the weights copy checked is what it copies.

The copy lists the source's tree, refuses links leading out of it, and used to hand each link it had checked to
`rsync --copy-links`, which resolved the link again when it read it. Whoever can write the hub's blob store but not
`~/.ssh` (a co-tenant container mounting `~/.cache/huggingface` read-write) swaps a store file, or a directory on the
way, for a link to the SSH user's private key between the check and the read: the key lands in the worker's tree.
A regular (no `-L`) run is no better against a directory on the way: rsync opens only the last component with
O_NOFOLLOW. Here the swap is made for real, on this machine as both nodes (`test_weights_tree.Local`), over the
one-time daemon (the real helper, on loopback) and over the hop's rsync, at the two moments it can happen: right
after the listing (the step's check), and right before rsync starts reading (after `links_helper send` checked the
files once more and holds their directories: a shim on PATH swaps, then runs the real rsync, of each version the
project meets). Whatever happens, nothing but bytes the listing saw arrives on the target: never the secret's.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from reconciler.core.observed import WeightFile, Weights
from reconciler.edge.manifest import PARTIAL_DIR, Listing
from reconciler.edge.steps import links_helper
from reconciler.edge.steps import weights as step
from reconciler.edge.steps.actions import StepFailed
from reconciler.edge.steps.links_helper import CHANGED, STAGING
from testbed.proc import wait_for
from tests.unit.steps.test_weights_tree import SECRET, hf_tree, probe, sync

BUILDS = Path(os.environ.get("RSYNC_BUILDS", "/var/cache/spark-reconciler/rsync"))
HELPER = str(Path(links_helper.__file__))
TRANSPORTS = ["rsync-daemon", "ssh"]


def secret_of(size: int) -> bytes:
    """The private key, padded to the size the listing checked: a size check alone would not tell it apart."""
    return (SECRET * (size // len(SECRET) + 1))[:size]


def regular_files(top: Path) -> dict[str, bytes]:
    """Every regular file below `top` (links not followed), by its path: staging and partial data included."""
    found = {}
    for dirpath, _, names in os.walk(top):
        for name in names:
            p = Path(dirpath) / name
            if not p.is_symlink() and p.is_file():
                found[str(p.relative_to(top))] = p.read_bytes()
    return found


class Source:
    """An hf-cache hub with a shared blob store (`HUB/blobs/XX/HASH`, the repo's `blobs/ETAG` a relative link to
    it: copied as a file), the swaps an attacker with write access to the hub can make, and the bytes it listed."""

    def __init__(self, tmp_path: Path):
        self.repo = hf_tree(tmp_path / "src", shards=2, shard_bytes=20_000, shared=1)
        self.hub = self.repo.parent
        self.stored = next(p for p in (self.hub / "blobs").glob("*/*") if p.is_file())
        self.outside = tmp_path / "outside"  # a directory the attacker cannot write (~/.ssh)
        self.outside.mkdir()
        self.listed = set(regular_files(tmp_path / "src").values())

    def planted(self, names: dict[str, int]) -> Path:
        """The secret under each name, at each size, in a directory outside the hub (what the links will name)."""
        where = self.outside / f"secret-{len(list(self.outside.iterdir()))}"
        where.mkdir()
        for name, size in names.items():
            (where / name).write_bytes(secret_of(size))
        return where

    def swap(self, what: str) -> None:
        """`store file`: the store file becomes a link to a secret file of its name and size; `store directory`: the
        store directory on its way becomes a link to a directory holding a secret file of the same name; `tree
        directory`: the tree's own `blobs/` (regular files, read by a no `-L` run) likewise."""
        if what == "store file":
            secret = self.planted({self.stored.name: self.stored.stat().st_size}) / self.stored.name
            self.stored.rename(self.stored.with_name(self.stored.name + ".moved"))
            self.stored.symlink_to(secret)
        elif what == "store directory":
            folder = self.stored.parent
            elsewhere = self.planted({self.stored.name: self.stored.stat().st_size})
            folder.rename(folder.with_name(folder.name + ".moved"))
            folder.symlink_to(elsewhere)
        else:
            blobs = self.repo / "blobs"
            elsewhere = self.planted({p.name: p.stat().st_size for p in blobs.iterdir()
                                      if p.is_file() and not p.is_symlink()})
            blobs.rename(blobs.with_name("blobs.moved"))
            blobs.symlink_to(elsewhere)

    def nothing_else_arrived(self, target: Path) -> None:
        arrived = regular_files(target)
        assert not [p for p, data in arrived.items() if SECRET in data], "the secret's bytes are on the target"
        assert not [p for p, data in arrived.items() if data not in self.listed], (
            "bytes the listing never saw are on the target")


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("what", ["store file", "store directory", "tree directory"])
def test_a_swap_after_the_check_sends_nothing_of_it_and_fails_naming_it(tmp_path, nodes, transport, what):
    """The swap right after the step's listing (its check): the store file (or a directory on the way) is now a
    link to a secret file of the same name and size. `--copy-links` copied the key into the worker's tree (and a
    same-size secret even passed the size check after the copy); now the source's `links_helper send` finds a link
    where the listing checked a regular file or directory, sends nothing of that stream, and the step fails
    saying the source changed after the check."""
    source = Source(tmp_path)
    nodes["src"].after_listing = lambda: source.swap(what)
    try:
        sync(tmp_path, nodes, streams=2, transport=transport)
        message = None
    except StepFailed as failed:
        message = str(failed)
    source.nothing_else_arrived(tmp_path / "dst")
    assert message is not None and "changed after it was checked" in message, message
    assert ("no longer a regular file" if what == "store file" else "changed since it was listed") in message


def _shim(tmp_path: Path, real: Path, swap: str) -> Path:
    """A `rsync` first on PATH that makes `swap` (shell) once, then runs the real rsync: the moment after
    `links_helper send` checked and holds the directories, before rsync reads anything."""
    where = tmp_path / "shim"
    where.mkdir()
    (where / "rsync").write_text(f'#!/bin/sh\nif mkdir {tmp_path}/swapped 2>/dev/null; then {swap}; fi\n'
                                 f'exec {real} "$@"\n')
    (where / "rsync").chmod(0o755)
    return where


SENDERS = {"installed": Path(shutil.which("rsync") or "/usr/bin/rsync"),
           "3.2.7": BUILDS / "3.2.7" / "rsync", "3.4.1": BUILDS / "3.4.1" / "rsync"}


@pytest.mark.parametrize(("version", "transport"), [("installed", "rsync-daemon"), ("installed", "ssh"),
                                                    ("3.2.7", "rsync-daemon"), ("3.4.1", "ssh")])
@pytest.mark.parametrize("what", ["store file", "store directory"])
def test_a_swap_just_before_rsync_reads_never_sends_the_secret(tmp_path, nodes, version, transport, what):
    """The swap after the last check, as rsync starts: a directory swapped then is not what rsync reads (it reads
    the directory held since the check: the listed bytes arrive and the copy completes, on 3.5 because it walks the
    held directory's path again with no link followed, on older ones because the kernel resolves /proc/self/fd/N
    to the directory held); a file swapped for a link is skipped (rsync opens it with O_NOFOLLOW), so it does not
    arrive and the step fails moving it into place. Before, rsync resolved the checked link there and then."""
    real = SENDERS[version]
    assert real.is_file(), f"{real} is missing: `make deps` builds it (testbed/rsync-builds.sh)"
    source = Source(tmp_path)
    secret = source.planted({source.stored.name: source.stored.stat().st_size})
    if what == "store file":
        swap = f"mv {source.stored} {source.stored}.moved && ln -s {secret / source.stored.name} {source.stored}"
    else:
        folder = source.stored.parent
        swap = f"mv {folder} {folder}.moved && ln -s {secret} {folder}"
    nodes["src"].env["PATH"] = f"{_shim(tmp_path, real, swap)}:{nodes['src'].env['PATH']}"
    listed = [(f.path, f.size) for f in probe(source.repo).files]
    try:
        sync(tmp_path, nodes, streams=1, transport=transport)
        message = None
    except StepFailed as failed:
        message = str(failed)
    assert (tmp_path / "swapped").is_dir(), "the shim ran: the swap was made"
    source.nothing_else_arrived(tmp_path / "dst")
    if what == "store file":
        assert message is not None and "moving the copied files into place on dst failed" in message, message
        assert "it did not arrive" in message
    else:
        assert message is None, message
        dst = tmp_path / "dst" / "hub" / source.repo.name
        assert [(f.path, f.size) for f in probe(dst).files] == listed


# -- the plan: what is read, under which name ----------------------------------------------------------------------

def _listing() -> Listing:
    files = [WeightFile(path="blobs/e1", size=3, link_target="../../blobs/ab/h1"),
             WeightFile(path="blobs/e2", size=4, link_target="../../blobs/cd/h2"),
             WeightFile(path="config.json", size=5),
             WeightFile(path="snapshots/r/config.json", size=5, link_target="/hub/models--o--m/config.json"),
             WeightFile(path="snapshots/r/model", size=3, link_target="../../blobs/e1")]
    return Listing(Weights(root="/hub/models--o--m", present=True, files=files), {}, "/hub/models--o--m",
                   {"blobs/e1": ("/hub/blobs", "ab/h1"), "blobs/e2": ("/hub/blobs", "cd/h2"),
                    "snapshots/r/config.json": ("/hub/models--o--m", "config.json"),
                    "snapshots/r/model": ("/hub/blobs", "ab/h1")})


def test_each_file_is_read_where_the_listing_found_it_under_a_name_that_survives_a_resume():
    """A copied link is read at the file it was resolved to (never through the link), a regular file at its path;
    the held directories are numbered over the whole listing, so a resumed copy (fewer files to move) stages each
    file under the same name and finds its partial data; two paths of one file are read once."""
    listing = _listing()
    copied = step.links_to_copy(listing.weights)
    assert copied == {"blobs/e1", "blobs/e2", "snapshots/r/config.json"}  # snapshots/r/model stays a link
    whole = step._plan(listing, step._files_to_copy(listing.weights, Weights(root="/t", present=False), copied),
                       copied)
    assert whole.pins == {10: ("/hub/blobs", "ab"), 11: ("/hub/blobs", "cd"), 12: ("/hub/models--o--m", "")}
    assert whole.sends == {"10/h1": 3, "11/h2": 4, "12/config.json": 5}
    assert whole.moves == [("10/h1", "blobs/e1"), ("11/h2", "blobs/e2"), ("12/config.json", "config.json"),
                           ("12/config.json", "snapshots/r/config.json")]
    resumed = step._plan(listing, [("blobs/e2", 4)], copied)
    assert (resumed.sends, resumed.pins) == ({"11/h2": 4}, {11: ("/hub/blobs", "cd")})
    assert step._instructions(whole, ["11/h2", "12/config.json"]) == (
        b"P\x0011\x00/hub/blobs\x00cd\x00P\x0012\x00/hub/models--o--m\x00\x00"
        b"F\x0011\x00h2\x004\x00F\x0012\x00config.json\x005\x00")


def test_a_listing_that_does_not_say_where_its_tree_is_copies_nothing():
    listing = Listing(Weights(root="/m", present=True, files=[WeightFile(path="a", size=1)]), {})
    with pytest.raises(StepFailed, match="does not say where a is"):
        step._plan(listing, [("a", 1)], set())


def test_the_staging_directory_is_below_rsync_s_partial_directory():
    """The target's manifest skips PARTIAL_DIR: a copy interrupted before its files were placed leaves no extra
    files in the tree, and its data stays for the resume."""
    assert STAGING.startswith(PARTIAL_DIR + "/")


def test_one_file_at_two_paths_arrives_at_both(tmp_path, nodes):
    """A link copied as a file that lands on a regular file inside the tree (an absolute link to the tree's own
    config.json): read once, placed at both paths as regular files."""
    source = Source(tmp_path)
    (source.repo / "extra.json").symlink_to(source.repo / "snapshots" / os.listdir(source.repo / "snapshots")[0]
                                            / "config.json")
    sync(tmp_path, nodes, streams=2)
    dst = tmp_path / "dst" / "hub" / source.repo.name
    assert [(f.path, f.size) for f in probe(dst).files] == [(f.path, f.size) for f in probe(source.repo).files]
    assert (dst / "extra.json").is_file() and not (dst / "extra.json").is_symlink()
    assert not (dst / STAGING).exists() or not any((dst / STAGING).iterdir())


# -- links_helper's own refusals ---------------------------------------------------------------------------------

def _helper(*argv: str, stdin: bytes = b"", cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, HELPER, *argv], input=stdin, capture_output=True, timeout=60, cwd=cwd,
                          check=False)


@pytest.mark.parametrize(("records", "said"), [
    ([("P", "10", "relative/root", "")], "not a record"),
    ([("P", "10", "/srv", "../etc")], "not a name"),
    ([("P", "3", "/srv", "")], "not a descriptor"),
    ([("P", "10", "/srv", ""), ("F", "10", "a/b", "1")], "not a name"),
    ([("P", "10", "/srv", ""), ("F", "11", "a", "1")], "not a record"),
    ([("P", "10", "/srv", "")], "no file to send"),
])
def test_send_takes_only_what_the_head_checked(tmp_path, records, said):
    (tmp_path / "i").write_bytes(b"".join("\0".join(r).encode() + b"\0" for r in records))
    done = _helper("send", "i", "rsync", "--files-from=l", "/proc/self/fd/", "dst/", cwd=tmp_path)
    assert (done.returncode, said in done.stderr.decode()) == (64, True), done.stderr
    assert not (tmp_path / "l").exists()


@pytest.mark.parametrize("argv", [["rsync", "-L", "--files-from=l", "/proc/self/fd/", "d/"],
                                  ["rsync", "--copy-links", "--files-from=l", "/proc/self/fd/", "d/"],
                                  ["rsync", "--files-from=l", "/srv/tree/", "d/"],
                                  ["sh", "-c", "cat ~/.ssh/id_ed25519", "/proc/self/fd/", "d/"]])
def test_send_runs_no_rsync_that_follows_a_link_or_reads_elsewhere(tmp_path, argv):
    (tmp_path / "i").write_bytes(b"P\x0010\x00/tmp\x00\x00F\x0010\x00x\x001\x00")
    assert _helper("send", "i", *argv, cwd=tmp_path).returncode == 64


def test_send_refuses_a_file_changed_since_the_listing(tmp_path):
    """A file of another size, a link where a file was, a directory gone: each named, exit CHANGED, no list."""
    (tmp_path / "tree" / "d").mkdir(parents=True)
    (tmp_path / "tree" / "d" / "a").write_bytes(b"12345")
    (tmp_path / "tree" / "d" / "b").symlink_to(tmp_path / "tree" / "d" / "a")
    tree = os.path.realpath(tmp_path / "tree")
    (tmp_path / "i").write_bytes("\0".join(["P", "10", tree, "d", "P", "11", tree, "gone", "F", "10", "a", "4",
                                            "F", "10", "b", "5", "F", "11", "c", "1", ""]).encode())
    done = _helper("send", "i", "rsync", "--files-from=l", "/proc/self/fd/", "d/", cwd=tmp_path)
    err = done.stderr.decode()
    assert done.returncode == CHANGED, err
    assert f"{tree}/d/a: 5 bytes, the listing checked 4" in err
    assert f"{tree}/d/b: no longer a regular file" in err
    assert f"{tree}/gone: No such file or directory" in err
    assert not (tmp_path / "l").exists()


def _pairs(*pairs: tuple[str, str]) -> bytes:
    data = b"".join(a.encode() + b"\0" + b.encode() + b"\0" for a, b in pairs)
    return f"{len(data)}\n".encode() + data


def test_receive_removes_links_below_staging_and_refuses_a_linked_staging_directory(tmp_path):
    """rsync's receiver writes below STAGING: a link left there (by whoever writes the target's tree) would carry
    the write out of it. `receive` removes every link below it before `ready`, and refuses one on its way."""
    root = tmp_path / "root"
    (root / STAGING / "10" / PARTIAL_DIR).mkdir(parents=True)
    (root / STAGING / "10" / "h1").symlink_to(tmp_path / "elsewhere")
    (root / STAGING / "10" / PARTIAL_DIR / "h2").symlink_to("/etc/passwd")
    (root / STAGING / "10" / PARTIAL_DIR / "h3").write_bytes(b"partial")
    done = _helper("receive", str(root), "30", stdin=_pairs(("11/h4", "blobs/h4")))
    assert (done.returncode, done.stdout.decode().split()[0]) == (1, "ready"), done.stderr
    assert "blobs/h4 (copied as .rsync-partial/staged/11/h4): it did not arrive" in done.stderr.decode()
    left = sorted(str(p.relative_to(root / STAGING)) for p in (root / STAGING).rglob("*"))
    assert left == ["10", f"10/{PARTIAL_DIR}", f"10/{PARTIAL_DIR}/h3"], "links gone, partial data kept"
    other = tmp_path / "other"
    other.mkdir()
    (other / PARTIAL_DIR).symlink_to(tmp_path / "elsewhere2")
    (tmp_path / "elsewhere2").mkdir()
    done = _helper("receive", str(other), "30", stdin=_pairs(("10/x", "x")))
    assert done.returncode == 1 and b"ready" not in done.stdout
    assert "a link or a file on the way" in done.stderr.decode()
    assert list((tmp_path / "elsewhere2").iterdir()) == []


def test_receive_moves_only_regular_files_never_through_a_link(tmp_path):
    root = tmp_path / "root"
    (root / STAGING / "10").mkdir(parents=True)
    (root / STAGING / "10" / "h1").write_bytes(b"one")
    (root / STAGING / "10" / "h3").write_bytes(b"three")
    (root / "linked").symlink_to(tmp_path / "elsewhere")
    (tmp_path / "elsewhere").mkdir()
    proc = subprocess.Popen([sys.executable, HELPER, "receive", str(root), "30"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(_pairs(("10/h1", "blobs/a"), ("10/h2", "blobs/b"), ("10/h3", "linked/c"), ("10/h1", "d/a2"),
                            ("10/h9", "blobs/d")))
    proc.stdin.flush()
    assert proc.stdout.readline() == b"ready\n"
    (root / STAGING / "10" / "h2").symlink_to("/etc/passwd")  # arrives as a link: refused, left alone
    wait_for(lambda: (root / "blobs" / "a").exists(), timeout=10, what="a file moved as it arrived")
    proc.stdin.close()  # the lifeline: its last look
    assert proc.wait(timeout=30) == 1
    out, err = proc.stdout.read(), proc.stderr.read()
    assert (root / "blobs" / "a").read_bytes() == (root / "d" / "a2").read_bytes() == b"one"
    assert stat.S_ISREG((root / "blobs" / "a").lstat().st_mode)
    said = err.decode()
    assert "blobs/b (copied as" in said and "not a regular file" in said and not (root / "blobs" / "b").exists()
    assert "linked/c" in said and list((tmp_path / "elsewhere").iterdir()) == []
    assert "blobs/d" in said and "it did not arrive" in said
    assert out.decode().split()[-2:] == ["placed", "2"]
