"""The one-time rsync daemon's confinement, tested with the exploit itself (issue 31, HIGH 1): a client holding the
step's secret (the source node's rsync, or whoever alters a weight sync on the cable) tries to write outside the
module through a link it plants. Run for real on loopback with the real helper against three rsync daemons: the
installed one, Debian 12's 3.2.7-1+deb12u6 (Ubuntu 24.04, DGX OS's base, ships a 3.2.7) and upstream 3.4.1, whose
daemon with the old config let the write through (CVE-2026-53785). `testbed/rsync-builds.sh` (run by `make deps`)
puts the two builds in /var/cache/spark-reconciler/rsync."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from reconciler.edge.steps import links_helper
from reconciler.edge.steps.weights import COPY_OPTIONS
from tests.unit.steps.test_rsyncd_helper import SECRET, Helper

BUILDS = Path(os.environ.get("RSYNC_BUILDS", "/var/cache/spark-reconciler/rsync"))
DAEMONS = {"installed": Path(shutil.which("rsync") or "/usr/bin/rsync").parent,
           "3.2.7": BUILDS / "3.2.7", "3.4.1": BUILDS / "3.4.1"}


def daemon_env(version: str) -> dict:
    """The helper's environment with `version`'s rsync first on PATH (the helper runs `rsync --daemon`)."""
    where = DAEMONS[version]
    assert (where / "rsync").is_file(), f"{where}/rsync is missing: run `make deps` (testbed/rsync-builds.sh)"
    return {**os.environ, "PATH": f"{where}:{os.environ['PATH']}"}


def everything_under(top: Path, but: Path) -> set[str]:
    """Every path below `top` except the module's own subtree, links not followed."""
    found = set()
    for dirpath, dirnames, filenames in os.walk(top):
        here = Path(dirpath)
        dirnames[:] = [d for d in dirnames if here / d != but]
        found |= {str((here / n).relative_to(top)) for n in dirnames + filenames}
    return found


def client(url: str, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    """The attacker's rsync: the installed client, holding the secret."""
    return subprocess.run(["rsync", "--timeout=20", "--password-file=-", *args, url], cwd=cwd,
                          input=f"{SECRET}\n", capture_output=True, text=True, timeout=60, check=False)


@pytest.fixture
def home(tmp_path) -> Path:
    """A user's home with the module two levels below it, as `~/.cache/huggingface/...` is."""
    (tmp_path / "home" / ".ssh").mkdir(parents=True)
    (tmp_path / "home" / "hub" / "models--o--m").mkdir(parents=True)
    return tmp_path / "home"


def escaping_links(module: Path) -> list[str]:
    """The links inside the module that resolve outside it (a later process following one would leave it)."""
    out = []
    for dirpath, dirnames, filenames in os.walk(module):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            if p.is_symlink() and not Path(os.path.realpath(p)).is_relative_to(module.resolve()):
                out.append(f"{p.relative_to(module)} -> {os.readlink(p)}")
    return out


@pytest.mark.parametrize("version", sorted(DAEMONS))
def test_a_planted_link_never_carries_a_write_outside_the_module(tmp_path, home, version):
    """The exploit's streams: `a -> .`; then `a/a/esc -> ../..` (two levels deep by its name, so rsync's depth check
    lets `../..` through, yet made at the module's top through `a`: it names the home directory); then
    `esc/.ssh/authorized_keys` through it with `-K`, and `esc/.ssh/authorized_keys2` with `-R --no-implied-dirs`.
    Upstream 3.4.1's daemon wrote both with the old config."""
    module = home / "hub" / "models--o--m"
    before = everything_under(home, module)
    dot, deep, keep, relative = (tmp_path / name for name in ("dot", "deep", "keep", "relative"))
    dot.mkdir()
    (dot / "a").symlink_to(".")
    (deep / "a" / "a").mkdir(parents=True)
    (deep / "a" / "a" / "esc").symlink_to("../..")
    for src, name in ((keep, "authorized_keys"), (relative, "authorized_keys2")):
        (src / "esc" / ".ssh").mkdir(parents=True)
        (src / "esc" / ".ssh" / name).write_text("ssh-ed25519 AAAA attacker\n")
    helper = Helper(module, streams=4, env=daemon_env(version))
    url = helper.url()
    said = [client(url, "-a", "./", cwd=dot),
            client(url, "-a", "-R", "--no-implied-dirs", "a/a/esc", cwd=deep),
            client(url, "-a", "-K", "./", cwd=keep),
            client(url, "-a", "-R", "--no-implied-dirs", "esc/.ssh/authorized_keys2", cwd=relative)]
    helper.end(close=True)
    assert everything_under(home, module) == before, [s.stderr for s in said]
    assert not any(os.path.lexists(home / ".ssh" / n) for n in ("authorized_keys", "authorized_keys2"))
    assert escaping_links(module) == []


@pytest.mark.parametrize("version", sorted(DAEMONS))
def test_the_project_s_own_streams_still_arrive_through_the_confined_daemon(tmp_path, version):
    """What the weights step itself sends (no links, no -D/-o/-g: `weights._rsync_argv`) passes every refusal."""
    src, dst = tmp_path / "src", tmp_path / "dst"
    (src / "blobs").mkdir(parents=True)
    (src / "blobs" / "abc").write_bytes(os.urandom(50_000))
    dst.mkdir()
    helper = Helper(dst, env=daemon_env(version))
    done = client(helper.url(), *COPY_OPTIONS, "--partial-dir=.rsync-partial", "./", cwd=src)
    code, out, err = helper.end()
    assert (done.returncode, code, out.split()) == (0, 0, ["daemon", "0"]), done.stderr + err
    assert (dst / "blobs" / "abc").read_bytes() == (src / "blobs" / "abc").read_bytes()


def make_links(root: Path, pairs: list[tuple[str, str]]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(Path(links_helper.__file__)), str(root)],
                          input=b"".join(p.encode() + b"\0" + v.encode() + b"\0" for p, v in pairs),
                          capture_output=True, timeout=60, check=False)


def test_the_links_are_made_inside_and_never_through_a_link_on_the_way(tmp_path):
    """`links_helper`: a snapshot link is made (and remade with a new value); a path with a link on the way, a
    link onto a directory, and a value or path that is not relative are refused, and nothing appears outside."""
    root, outside = tmp_path / "tree", tmp_path / "outside"
    (root / "blobs").mkdir(parents=True)
    (root / "taken").mkdir()
    outside.mkdir()
    (root / "away").symlink_to(outside)
    (root / "old").symlink_to("blobs/x")
    said = make_links(root, [("snapshots/r/model.safetensors", "../../blobs/abc"), ("old", "blobs/y"),
                             ("away/planted", "x"), ("taken", "blobs/x"), ("abs", "/etc/passwd"),
                             ("a/../b", "x")])
    assert said.returncode == 1 and said.stdout.decode().split() == ["made", "2"], said.stderr
    assert os.readlink(root / "snapshots" / "r" / "model.safetensors") == "../../blobs/abc"
    assert os.readlink(root / "old") == "blobs/y"
    assert list(outside.iterdir()) == [] and (root / "taken").is_dir() and not (root / "abs").exists()
    assert all(name in said.stderr.decode() for name in ("away/planted", "taken", "abs", "a/../b"))
