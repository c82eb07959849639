"""The weights tree (issue 16, finding 7): what leaves the model tree is never copied, the walk is bounded, and
`verify --repair` removes nothing outside the tree.

The probe's real shell script runs here, on trees in a temp dir (as the testbed's nodes run it); the weights step
and `verify_weights` run against `Local` sessions: this machine as both nodes, the hop's rsync run locally
without ssh. Nothing here ever syncs a tree that holds a link to `/` (the old `--copy-unsafe-links` would copy
the whole disk): such links only meet the probe, whose output is capped.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from reconciler.core.observed import Observed
from reconciler.core.planning import Step
from reconciler.edge import manifest
from reconciler.edge.facts.base import sealed, split_sections
from reconciler.edge.manifest import manifest_script, parse_weights
from reconciler.edge.ssh import CommandFailed, Result
from reconciler.edge.steps import StepContext, StepFailed
from reconciler.edge.steps import weights as step
from testbed.recordings import unseal
from testbed.weights import generate
from tests.unit.examples import examples
from tests.unit.recorded import sections_of

MODEL = "testorg/tiny-dense"
REV = "3" * 40
SECRET = b"-----BEGIN OPENSSH PRIVATE KEY----- not a real key\n"
OUTPUT_CAP = 20_000_000  # bytes of probe output read: a walk of `/` is cut here, not held in memory


def run_probe(root: str | Path, shell: str = "sh") -> str:
    """The real `weights` section's output, run here by `shell`."""
    script = sealed([manifest_script(str(root))])
    return unseal(subprocess.run([shell, "-c", f"{shell} -s | head -c {OUTPUT_CAP}"], input=script.script,
                                 capture_output=True, text=True, timeout=120, env={**os.environ, "LC_ALL": "C"},
                                 check=False).stdout, script.nonce)


def probe(root: str | Path, shell: str = "sh"):
    return parse_weights(str(root), sections_of(run_probe(root, shell)).get("weights"))


def hf_tree(base: Path, shards: int = 2, shard_bytes: int = 20_000, shared: int = 1) -> Path:
    """An hf-cache hub under base/hub; the first `shared` shard blobs moved into huggingface_hub's cross-repo store
    (HUB/blobs/XX/HASH, the repo's blobs/ETAG a relative link to it). Returns models--ORG--NAME."""
    snap = generate(base, MODEL, REV, "hf-cache", shards, shard_bytes)
    repo = snap.parent.parent
    store = base / "hub" / "blobs"
    for link in sorted(snap.glob("*.safetensors"))[:shared]:
        blob = (snap / os.readlink(link)).resolve()
        home = store / blob.name[:2] / blob.name
        home.parent.mkdir(parents=True, exist_ok=True)
        blob.rename(home)
        blob.symlink_to(os.path.relpath(home, blob.parent))
    (store / ".huggingface-shared-blobs").parent.mkdir(parents=True, exist_ok=True)
    (store / ".huggingface-shared-blobs").write_text("1\n")
    return repo


def outside_secret(base: Path) -> Path:
    secret = base / "outside" / "id_ed25519"
    secret.parent.mkdir(parents=True, exist_ok=True)
    secret.write_bytes(SECRET)
    return secret


def holds_secret(tree: Path) -> list[str]:
    found = []
    for dirpath, _, names in os.walk(tree):
        for name in names:
            p = Path(dirpath) / name
            if p.is_file() and not p.is_symlink() and SECRET in p.read_bytes():
                found.append(str(p.relative_to(tree)))
    return found


# -- the probe: links resolved on the listing, none followed, the walk bounded ------------------------------------

@pytest.mark.parametrize("shell", ["sh", "bash"])
def test_the_probe_resolves_links_on_its_listing_and_follows_none(tmp_path, shell):
    """(a) HF links (snapshot -> ../../blobs/ETAG, and blobs/ETAG -> the hub's shared store) are sized as their
    files; (b) a link to a file outside the tree is reported with where it leads; (c) a loop and a link to `/`
    are not followed: the output stays a few lines (the old `find -L` walked the whole disk on every probe)."""
    repo = hf_tree(tmp_path, shared=1)
    snap = repo / "snapshots" / REV
    secret = outside_secret(tmp_path)
    (snap / "leak.json").symlink_to(secret)
    (snap / "loop").symlink_to("loop")
    (snap / "rootfs").symlink_to("/")
    (snap / "up").symlink_to("../../../../outside")
    out = run_probe(repo, shell)
    assert len(out) < 20_000, f"{len(out)} bytes of probe output: a link was followed"
    w = parse_weights(str(repo), sections_of(out).get("weights"))
    assert w.present and w.truncated is None
    files = {f.path: f for f in w.files}
    shards = sorted(p for p in files if p.startswith(f"snapshots/{REV}/model-"))
    assert len(shards) == 2
    for p in shards:  # (a) real sizes through the links, the one in the shared store included
        assert files[p].size == (snap / Path(p).name).stat().st_size > 0
    in_store = [f for f in w.files if f.path.startswith("blobs/") and f.link_target]
    assert len(in_store) == 1 and in_store[0].link_target.startswith("../../blobs/")
    assert in_store[0].size == (repo / in_store[0].path).stat().st_size
    # (b) and (c): named, with where each leads; none sized
    assert w.unsafe_count == 3
    assert f"snapshots/{REV}/leak.json -> {secret} (outside the tree: {secret})" in w.unsafe
    assert f"snapshots/{REV}/rootfs -> / (outside the tree: /)" in w.unsafe
    assert any(u.startswith(f"snapshots/{REV}/up -> ../../../../outside (outside the tree: ") for u in w.unsafe)
    for name in ("leak.json", "rootfs", "up", "loop"):
        assert files[f"snapshots/{REV}/{name}"].size is None
    assert not any("loop" in u for u in w.unsafe), "a loop inside the tree is broken, not outside"


def test_the_walk_is_bounded_in_entries_and_depth(tmp_path, monkeypatch):
    monkeypatch.setattr(manifest, "MAX_ENTRIES", 20)
    wide = tmp_path / "wide"
    wide.mkdir()
    for i in range(30):
        (wide / f"f{i:02d}").write_bytes(b"x")
    out = run_probe(wide)
    assert out.count("\nE\t") <= 20 + 6, "the walk stops at the cap (head ends find)"
    w = parse_weights(str(wide), sections_of(out).get("weights"))
    assert w.truncated == "more than 20 entries"
    for i in range(10, 30):
        (wide / f"f{i:02d}").unlink()
    assert probe(wide).truncated is None

    deep = tmp_path / "deep"
    leaf = deep.joinpath(*[f"d{i}" for i in range(manifest.MAX_DEPTH)])
    leaf.mkdir(parents=True)
    (leaf.parent / "ok").write_bytes(b"x")
    assert probe(deep).truncated is None, f"{manifest.MAX_DEPTH} levels are listed"
    (leaf / "too-deep").write_bytes(b"x")
    assert probe(deep).truncated == f"entries deeper than {manifest.MAX_DEPTH} levels"


def test_names_with_a_newline_or_tab_are_refused_not_misread(tmp_path):
    root = tmp_path / "m"
    root.mkdir()
    (root / "ok").write_bytes(b"x")
    (root / "a\nE\tfake\tf\t1\t1\t").write_bytes(b"x")
    (root / "tab\tlink").symlink_to("ok")
    (root / "value").symlink_to("ok\n../../etc")
    w = probe(root)
    assert [f.path for f in w.files] == ["ok"]
    assert w.unsafe_count == 1 and w.unsafe[0].startswith("3 names or link values with a tab or newline")


# -- the resolution on the listing against the kernel's ----------------------------------------------------------

TOKENS = ["..", "..", ".", "a", "b", "f1", "f2", "blobs", "e1", "l1", "l2", "l3", "models--o--m", "ab", "h1",
          "outside", "secret", "hub", "x"]
LINKS = ["l1", "a/l2", "a/b/l3", "blobs/l4"]
TARGETS = ["hub/models--o--m/f1", "hub/models--o--m/a/f2", "hub/models--o--m/blobs/e1", "hub/blobs/ab/h1",
           "outside/secret", "outside", "hub", "hub/models--o--m/a", "hub/models--o--m", "hub/models--o--m/l1",
           "hub/models--o--m/a/l2", "hub/models--o--m/a/b/l3", "hub/models--o--m/blobs/l4", ""]


def _value(base: str, where: str):
    """A link's value: mostly aimed at a real place (relative or absolute, with detours through `..`, `.` or
    other links), sometimes any jumble of names."""
    here = os.path.dirname(f"{base}/hub/models--o--m/{where}")
    jumble = st.tuples(st.sampled_from(["", "", "/", f"{base}/", f"{base}/hub/"]),
                       st.lists(st.sampled_from(TOKENS), min_size=1, max_size=6).map("/".join)).map("".join)

    def aim(target: str, absolute: bool, detour: str, at: int, trail: str) -> str:
        path = f"{base}/{target}".rstrip("/") or "/"
        parts = (path if absolute else os.path.relpath(path, here)).split("/")
        at = min(at, len(parts))
        return "/".join(parts[:at] + ([detour] if detour else []) + parts[at:]) + trail

    aimed = st.builds(aim, st.sampled_from(TARGETS), st.booleans(),
                      st.sampled_from(["", "", "", ".", "x/..", "a/..", "l1/..", "blobs/../..", ".."]),
                      st.integers(0, 8), st.sampled_from(["", "", "", "/", "/."]))
    return st.one_of(aimed, aimed, aimed, jumble)


@settings(**examples(100), deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_where_a_link_leads_on_the_listing_is_where_the_kernel_goes(data):
    """Links of any shape (relative, absolute, through other links, loops, into the hub's store, out of it): a link
    the kernel resolves outside the tree and the store is always named unsafe, and a link given a size lands on a
    regular file inside of exactly that size."""
    with tempfile.TemporaryDirectory() as tmp:
        base = os.path.realpath(tmp)
        hub = Path(base) / "hub"
        root, store = hub / "models--o--m", hub / "blobs"
        for d in (root / "a" / "b", root / "blobs", store / "ab", Path(base) / "outside"):
            d.mkdir(parents=True)
        for path, size in ((root / "f1", 3), (root / "a" / "f2", 5), (root / "blobs" / "e1", 7),
                           (store / "ab" / "h1", 11), (Path(base) / "outside" / "secret", 13)):
            path.write_bytes(b"x" * size)
        values = [data.draw(_value(base, where)) for where in LINKS]
        for where, value in zip(LINKS, values, strict=True):
            os.symlink(value, root / where)
        w = probe(root)
        files = {f.path: f for f in w.files}
        for where, value in zip(LINKS, values, strict=True):
            link = root / where
            named = any(u.startswith(f"{where} -> ") for u in w.unsafe)
            if link.exists():
                real = os.path.realpath(link)
                inside = any(os.path.commonpath([real, str(r)]) == str(r) for r in (root, store))
                if not inside:
                    assert named, (where, value, real)
                elif os.path.isfile(real) and not named:  # named: a detour outside, refused though it comes back
                    assert files[where].size == os.path.getsize(real), (where, value, real)
            if files[where].size is not None:
                assert link.exists() and os.path.isfile(link), (where, value)
                real = os.path.realpath(link)
                assert any(os.path.commonpath([real, str(r)]) == str(r) for r in (root, store)), (where, value)
                assert files[where].size == os.path.getsize(link)
                assert not named


# -- which links rsync keeps ---------------------------------------------------------------------------------------

@pytest.mark.parametrize(("path", "value", "kept"), [
    ("snapshots/r/f", "../../blobs/e", True),  # the HF snapshot link
    ("blobs/e", "../../blobs/ab/h", False),  # huggingface_hub's shared store: climbs out
    ("f", "/abs/inside", False),  # absolute: never
    ("a/f", "../g", True),
    ("a/f", "../../g", False),
    ("a/f", "b/../g", False),  # an embedded `..`: unsafe since rsync 3.4 (CVE-2024-12088)
    ("a/f", "b/..", False),
    ("a/f", "./g", True),
    ("f", "", False),
])
def test_rsync_keeps_link_cases(path, value, kept):
    assert step.rsync_keeps_link(path, value) is kept


@settings(**examples(60), deadline=None, suppress_health_check=list(HealthCheck))
@given(links=st.lists(st.tuples(st.sampled_from(["l", "a/l", "a/b/l"]),
                                st.lists(st.sampled_from(["..", ".", "a", "b", "x", ""]), min_size=1,
                                         max_size=5).map("/".join)), min_size=1, max_size=6))
@example(links=[("a/l", "b/../x"), ("a/b/l", "../../x"), ("l", "x/..")])
def test_a_link_kept_by_the_model_is_kept_by_rsync(links):
    """What `rsync_keeps_link` keeps, this machine's rsync keeps under `-a --safe-links`: a link it judges
    unsafe is then copied as a file (when inside) or refused, never left to a run that would drop it."""
    with tempfile.TemporaryDirectory() as tmp:
        src, dst = Path(tmp) / "src", Path(tmp) / "dst"
        (src / "a" / "b").mkdir(parents=True)
        made = {}
        for i, (where, value) in enumerate(links):
            if not value.strip("/"):
                continue
            name = f"{where}{i}"
            os.symlink(value, src / name)
            made[name] = value
        subprocess.run(["rsync", "-a", "--safe-links", f"{src}/", f"{dst}/"], check=True, capture_output=True)
        for name, value in made.items():
            if step.rsync_keeps_link(name, value):
                assert os.path.islink(dst / name), (name, value)


# -- the weights step, this machine as both nodes --------------------------------------------------------------

class LocalBulk:
    """`Local.bulk()`: runs on the same machine, recording which argvs went over the bulk connection."""

    def __init__(self, node: Local):
        self.node = node

    def run(self, argv, **kw):
        self.node.bulk_argvs.append(list(argv))
        return self.node.run(argv, **kw)


class Local:
    """A node that is this machine: argv and scripts run here, in $HOME = `home`. Over the daemon transport, all
    of it is real: the helper listens on loopback (both nodes' fabric address here), the real rsync clients get the
    secret on stdin. Over ssh, the hop's rsync runs locally (its `-e ssh ...` and the target's `host:` dropped).
    `after_listing` runs once after the first manifest."""

    def __init__(self, home: Path, after_listing=None):
        self.home = home
        home.mkdir(parents=True, exist_ok=True)
        self.env = {**os.environ, "HOME": str(home), "LC_ALL": "C"}
        self.argvs: list[list[str]] = []
        self.bulk_argvs: list[list[str]] = []
        self.lists: dict[str, list[str]] = {}
        self.after_listing = after_listing

    def bulk(self) -> Local:
        """The bulk connection (`Session.bulk`): a second view of the same node, which counts what runs on it."""
        return LocalBulk(self)

    def run(self, argv, *, timeout, stdin=None, check=True, on_output=None, cancel=None, supervised=False,
            sudo=False):
        argv = list(argv)
        self.argvs.append(argv)
        # a stream: rsync itself, or as `links_helper send` runs it (it execs the rsync after its words)
        at = argv.index("rsync") if "rsync" in argv else None
        if at is not None and "-e" in argv:
            i = argv.index("-e")
            del argv[i:i + 2]
            argv[-1] = argv[-1].split(":", 1)[1]
        p = subprocess.run(argv, input=stdin, capture_output=True, timeout=timeout, env=self.env, cwd=self.home,
                           check=False)
        if at is not None:
            listed = next((a.split("=", 1)[1] for a in argv if a.startswith("--files-from=")), None)
            if listed and (self.home / listed).exists():
                self.lists[" ".join(argv[at:])] = (self.home / listed).read_bytes().decode().strip("\0").split("\0")
        result = Result(p.stdout.decode(errors="replace"), p.stderr.decode(errors="replace"), p.returncode)
        if argv[0] == "find":
            self._listed()
        if on_output is not None:
            on_output(p.stdout)
        if check and not result.ok:
            raise CommandFailed("local", argv, result.exit_code, result.stdout, result.stderr)
        return result

    @contextlib.contextmanager
    def companion(self, argv, *, timeout, stdin, open_timeout):
        self.argvs.append(list(argv))
        proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                env=self.env, cwd=self.home)
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write(stdin)
        proc.stdin.flush()
        try:
            yield LocalCompanion(proc)
        finally:
            if proc.poll() is None:
                proc.stdin.close()
            proc.wait(timeout=10)

    def run_script(self, script, *, timeout, cancel=None):
        p = subprocess.run(["sh", "-s"], input=script.encode(), capture_output=True, timeout=timeout, env=self.env,
                           cwd=self.home, check=False)
        if "sec weights" in script:
            self._listed()
        return Result(p.stdout.decode(errors="replace"), p.stderr.decode(errors="replace"), p.returncode)

    def _listed(self) -> None:
        if self.after_listing is not None:
            hook, self.after_listing = self.after_listing, None
            hook()

    def rsyncs(self) -> list[list[str]]:
        """Each stream's rsync argv (run by `links_helper send`, or alone)."""
        return [a[a.index("rsync"):] for a in self.argvs if "rsync" in a]


class LocalCompanion:
    def __init__(self, proc: subprocess.Popen):
        self.proc = proc

    def line(self, timeout):
        """As `remote.Companion.line`: the line without its newline, None at the end."""
        raw = self.proc.stdout.readline().decode()
        return raw.removesuffix("\n") if raw else None

    def finish(self, timeout):
        """As `remote.Companion.finish`: wait for it to end by itself, then close its stdin."""
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=timeout)
        out, err = self.proc.communicate(timeout=timeout)
        return Result(out.decode(), err.decode(), self.proc.returncode)

    def end(self, timeout):
        """As `remote.Companion.end`: close its stdin at once, then wait for it to end."""
        out, err = self.proc.communicate(timeout=timeout)
        return Result(out.decode(), err.decode(), self.proc.returncode)


def _desired(tmp_path: Path, layout: str = "hf-cache", streams: int = 2, transport: str = "rsync-daemon"):
    paths = {"src": str(tmp_path / "src" / "hub"), "dst": str(tmp_path / "dst" / "hub")}
    if layout == "plain":
        paths = {"src": str(tmp_path / "src" / "model"), "dst": str(tmp_path / "dst" / "model")}
    model = SimpleNamespace(id=MODEL, layout=layout, path_on=paths.__getitem__)
    policy = SimpleNamespace(weights=SimpleNamespace(parallel_streams=streams, bandwidth_limit=None,
                                                     transport=transport, drop_behind=True),
                             timeouts=SimpleNamespace(command=60, weights_sync=120))
    loopback = SimpleNamespace(fabric=SimpleNamespace(address=SimpleNamespace(ip="127.0.0.1")))
    hub_tree = "models--" + MODEL.replace("/", "--")
    return SimpleNamespace(model=model, policy=policy, source_node="src", node=lambda name: loopback,
                           head=SimpleNamespace(name="src"),
                           weights_root=lambda n: paths[n] if layout == "plain" else f"{paths[n]}/{hub_tree}",
                           instance="head:22")


def sync(tmp_path, nodes, streams=2, events=None, transport="rsync-daemon", drop_behind=True):
    desired = _desired(tmp_path, streams=streams, transport=transport)
    desired.policy.weights.drop_behind = drop_behind
    ctx = StepContext(desired=desired, sessions=nodes,
                      observed=Observed(nodes={}),
                      progress=lambda e, f: (events if events is not None else []).append((e, f)),
                      deadline=time.monotonic() + 120)
    ctx.perform(step.sync_weights(ctx.given, Step(kind="weights", node="dst", reason="test", source="src")))


@pytest.mark.parametrize("streams,transport", [(1, "rsync-daemon"), (3, "rsync-daemon"), (1, "ssh"), (3, "ssh")])
def test_a_hf_cache_with_shared_blobs_arrives_as_real_files(tmp_path, nodes, streams, transport):
    """Over the daemon too: rsync carries no link (the daemon refuses -l and munges any that arrive); the snapshot
    links are made on the target by the reconciler from the source's manifest (`make_links`)."""
    repo = hf_tree(tmp_path / "src", shards=3, shard_bytes=30_000, shared=2)
    events: list = []
    sync(tmp_path, nodes, streams, events, transport)
    dst = tmp_path / "dst" / "hub" / repo.name
    src_w, dst_w = probe(repo), probe(dst)
    assert [(f.path, f.size) for f in dst_w.files] == [(f.path, f.size) for f in src_w.files]
    for f in src_w.files:
        if f.link_target and f.path.startswith("blobs/"):  # the shared-store links: real files on the target
            assert (dst / f.path).is_file() and not (dst / f.path).is_symlink()
        elif f.link_target:  # the snapshot links: the same relative links
            assert os.readlink(dst / f.path) == f.link_target
    argvs = nodes["src"].rsyncs()
    assert argvs and not any(set(a) & {"--copy-unsafe-links", "--copy-links", "-L", "-a", "-l"} for a in argvs), (
        "no rsync follows or carries a link (issue 53: --copy-links read each checked link again)")
    assert all(a[-2] == "/proc/self/fd/" for a in argvs), "each reads only the directories held since the check"
    copied = step.links_to_copy(src_w)
    assert len(copied) == 2
    listed = [name for names in nodes["src"].lists.values() for name in names]
    assert sorted(listed) == sorted(set(listed)) and all(n.split("/")[0].isdigit() for n in listed)
    assert len(listed) == sum(1 for f in src_w.files if f.link_target is None or f.path in copied)
    start = next(f for e, f in events if e == "weights.start")
    assert start["bytes_total"] == sum(f.size for f in src_w.files if f.link_target is None or f.path in copied)


@pytest.mark.parametrize("bound", [True, False])
def test_the_page_cache_bound_runs_on_both_ends_around_the_copy_when_asked(tmp_path, nodes, bound):
    """On: one helper on each end, over that end's tree; off: none."""
    hf_tree(tmp_path / "src", shards=2, shard_bytes=10_000)
    sync(tmp_path, nodes, drop_behind=bound)
    helpers = {name: [a[-2] for a in node.argvs if a[:2] == ["python3", "-c"] and "POSIX_FADV_DONTNEED" in a[2]]
               for name, node in nodes.items()}
    roots = {name: _desired(tmp_path).weights_root(name) for name in ("src", "dst")}
    assert helpers == ({name: [root] for name, root in roots.items()} if bound else {"src": [], "dst": []})


def test_a_tree_with_a_link_out_of_it_is_refused_naming_the_link(tmp_path, nodes):
    repo = hf_tree(tmp_path / "src")
    secret = outside_secret(tmp_path)
    (repo / "snapshots" / REV / "tokenizer_extra.json").symlink_to(secret)
    with pytest.raises(StepFailed) as failed:
        sync(tmp_path, nodes)
    message = str(failed.value)
    assert f"snapshots/{REV}/tokenizer_extra.json -> {secret} (outside the tree: {secret})" in message
    assert "Refusing to sync" in message
    assert not nodes["src"].rsyncs(), "nothing copied"
    assert not holds_secret(tmp_path / "dst")


def test_a_link_rsync_would_drop_and_not_a_file_inside_is_refused(tmp_path, nodes):
    """A shared-store link whose blob was pruned from the store, an absolute link to a directory inside: rsync
    would skip them (absolute, or climbing out) and there is no file to copy in their place."""
    repo = hf_tree(tmp_path / "src", shared=1)
    stored = next(p for p in (repo / "blobs").iterdir() if p.is_symlink())
    stored.resolve().unlink()
    (repo / "snapshots" / REV / "extra").symlink_to(repo / "snapshots")
    with pytest.raises(StepFailed) as failed:
        sync(tmp_path, nodes)
    message = str(failed.value)
    assert "2 link(s) that rsync would not keep" in message and f"blobs/{stored.name} -> ../../blobs/" in message
    assert f"snapshots/{REV}/extra -> {repo}/snapshots" in message
    assert not nodes["src"].rsyncs()


def test_a_partial_listing_is_refused(tmp_path, nodes, monkeypatch):
    hf_tree(tmp_path / "src", shards=3)
    monkeypatch.setattr(manifest, "MAX_ENTRIES", 8)
    with pytest.raises(StepFailed, match="is not fully listed .more than 8 entries.*refusing to sync from a partial"):
        sync(tmp_path, nodes)
    assert not nodes["src"].rsyncs()


def test_rsync_itself_never_copies_a_link_out_of_the_tree(tmp_path, nodes):
    """Defence in depth: even when the probe is wrong (here: the source's manifest shows the outside link as a
    harmless link inside), rsync never carries or follows that link: the target gets the link the manifest
    names, made by the reconciler. The old `--copy-unsafe-links` copied the key into the worker's model dir."""
    repo = hf_tree(tmp_path / "src")
    secret = outside_secret(tmp_path)
    sneaky = f"snapshots/{REV}/generation_config.json"
    inside = os.readlink(repo / sneaky)
    (repo / sneaky).unlink()
    (repo / sneaky).symlink_to(secret)
    real = nodes["src"].run_script

    def fooled(script, **kw):
        res = real(script, **kw)
        return Result(res.stdout.replace(f"\t{secret}\n", f"\t{inside}\n"), res.stderr, res.exit_code)

    nodes["src"].run_script = fooled
    script = sealed([manifest_script(str(repo))])
    seen = parse_weights(str(repo), split_sections(fooled(script.script, timeout=30).stdout, script.nonce)["weights"])
    assert not getattr(seen, "unsafe", []) and {f.path: f.link_target for f in seen.files}[sneaky] == inside
    sync(tmp_path, nodes, streams=1)
    assert not holds_secret(tmp_path / "dst")
    assert os.readlink(tmp_path / "dst" / "hub" / repo.name / sneaky) == inside


# -- verify --repair: only inside the tree ----------------------------------------------------------------------

SEGMENTS = st.sampled_from(["a", "b", "blobs", "..", ".", "", "x y", "-n", "l"])


@settings(**examples(500), deadline=None)
@given(parts=st.lists(SEGMENTS, min_size=0, max_size=6), absolute=st.booleans())
@example(parts=["a", "..", "..", "b"], absolute=False)
@example(parts=["..", "x"], absolute=False)
def test_inside_tree_accepts_only_paths_that_stay_inside(parts, absolute):
    path = ("/" if absolute else "") + "/".join(parts)
    root = "/srv/models/hub/models--o--m"
    joined = os.path.normpath(os.path.join(root, path))
    stays = os.path.commonpath([root, joined]) == root and joined != root
    if step.inside_tree(path):
        assert stays, path
    if not absolute and parts and all(p not in ("", ".", "..") for p in parts):
        assert step.inside_tree(path), path


def test_repair_removes_nothing_outside_the_tree(tmp_path, monkeypatch):
    """A target whose directory became a link to elsewhere between the listing and the removal (or a path that
    names one): `verify --repair` leaves what is outside alone and removes the differing files inside."""
    src_repo = hf_tree(tmp_path / "src", shared=0)
    dst_repo = tmp_path / "dst" / "hub" / src_repo.name
    dst_repo.parent.mkdir(parents=True)
    subprocess.run(["cp", "-a", str(src_repo), str(dst_repo.parent)], check=True)
    blobs = sorted(p.name for p in (dst_repo / "blobs").iterdir() if p.is_file() and not p.is_symlink())
    flipped = dst_repo / "blobs" / blobs[0]
    flipped.write_bytes(b"!" + flipped.read_bytes()[1:])
    (dst_repo / "refs" / "main").write_text("4" * 40)  # differs too: the victim stands in for it
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    victim = elsewhere / "main"
    victim.write_text("not the model's")

    def swap():  # after the target was listed: refs/ becomes a link to a directory outside
        (dst_repo / "refs").rename(tmp_path / "refs.old")
        (dst_repo / "refs").symlink_to(elsewhere)

    sessions = {"src": Local(tmp_path / "home-src"), "dst": Local(tmp_path / "home-dst", after_listing=swap)}
    found = step.verify_weights(_desired(tmp_path), sessions, "dst", repair=True, timeout=60)
    assert f"blobs/{blobs[0]}" in found.mismatched and "refs/main" in found.mismatched
    assert victim.read_text() == "not the model's", "verify --repair removed a file outside the tree"
    assert not flipped.exists() and found.repaired == (f"blobs/{blobs[0]}",)


def test_remove_files_refuses_paths_that_leave_the_tree(tmp_path):
    root = tmp_path / "root"
    (root / "blobs").mkdir(parents=True)
    (root / "blobs" / "a").write_bytes(b"x")
    (root / "to-outside").symlink_to(tmp_path / "outside")
    (tmp_path / "outside").mkdir()
    for name in ("v1", "v2", "v3"):
        (tmp_path / "outside" / name).write_bytes(b"keep")
    (root / "file-link").symlink_to(tmp_path / "outside" / "v3")
    removed = step.remove_files(Local(tmp_path / "home"), str(root),
                                ["blobs/a", "../outside/v1", str(tmp_path / "outside" / "v2"), "to-outside/v2",
                                 "file-link", "blobs/../../outside/v1"], timeout=30)
    assert removed == ("blobs/a",)
    assert sorted(p.name for p in (tmp_path / "outside").iterdir()) == ["v1", "v2", "v3"]
    assert (root / "file-link").is_symlink()


def test_the_source_hash_cache_keys_are_unchanged(tmp_path):
    """The cache of source hashes keys on (path, size, mtime as find prints it): the listing gives a link its
    target's, as `find -L` did, so an upgrade re-hashes nothing."""
    repo = hf_tree(tmp_path)
    listing = step._listing(Local(tmp_path / "home"), str(repo), 30)
    old = subprocess.run(["find", "-L", str(repo), "-mindepth", "1", "-type", "f", "-printf", "%P\t%s\t%T@\n"],
                         capture_output=True, text=True, check=True, env={**os.environ, "LC_ALL": "C"}).stdout
    was = {p: (int(s), t) for p, s, t in (line.split("\t") for line in old.splitlines())}
    assert listing.resolved == was


@pytest.mark.parametrize("transport", ["rsync-daemon", "ssh"])
def test_a_target_tree_with_a_link_leading_out_gets_no_copy(tmp_path, nodes, transport):
    """A link already in the target's tree that leads out of it (a directory elsewhere) is a way out for a daemon
    that follows links on its path (rsync <= 3.4.1) and for the links made after the data: either transport
    refuses before any rsync runs, and says what to do."""
    repo = hf_tree(tmp_path / "src")
    dst = tmp_path / "dst" / "hub" / repo.name
    dst.mkdir(parents=True)
    (tmp_path / "elsewhere").mkdir()
    (dst / "snapshots").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(StepFailed, match="link.* leading out of it.*remove it.*led out of the tree"):
        sync(tmp_path, nodes, streams=1, transport=transport)
    assert not nodes["src"].rsyncs() and list((tmp_path / "elsewhere").iterdir()) == []


def test_a_sync_of_many_streams_keeps_the_node_s_own_connection_free(tmp_path, nodes):
    """`parallel_streams: 9` on a tree mixing regular files and copied links once asked for 18 long channels of
    the source's one connection (9): the accept window ended every stream, or the probe starved (issue 31). Every
    rsync runs on the bulk connection now, and no more runs than its budget holds."""
    from reconciler.edge.ssh import MAX_CHANNELS

    repo = hf_tree(tmp_path / "src", shards=12, shard_bytes=5_000, shared=6)
    sync(tmp_path, nodes, streams=9)
    rsyncs = [a for a in nodes["src"].argvs if "rsync" in a]
    assert rsyncs and all(a in nodes["src"].bulk_argvs for a in rsyncs)
    assert len(rsyncs) <= step.BULK_STREAMS < MAX_CHANNELS
    assert [(f.path, f.size) for f in probe(tmp_path / "dst" / "hub" / repo.name).files] == \
        [(f.path, f.size) for f in probe(repo).files]


def test_repair_never_removes_through_a_linked_model_root(tmp_path):
    """Issue 31, item 12. The target's model directory is a link to its user's home, and the source's tree holds
    a file by the name of one in that home (a hostile repository's `.docker/config.json`): the listing and the
    hashes follow the link (`cd -P`), the file differs, and `verify --repair` removed the home's own registry
    credentials through the link."""
    src = tmp_path / "src" / "model"
    (src / ".docker").mkdir(parents=True)
    (src / "config.json").write_text("{}")
    (src / ".docker" / "config.json").write_text('{"auths": {}}')
    home = tmp_path / "home-dst"
    (home / ".docker").mkdir(parents=True)
    (home / "config.json").write_text("{}")
    credentials = home / ".docker" / "config.json"
    credentials.write_text('{"auths": {"registry.example": {"auth": "c2VjcmV0"}}}')
    (tmp_path / "dst").mkdir()
    (tmp_path / "dst" / "model").symlink_to(home)
    sessions = {"src": Local(tmp_path / "home-src"), "dst": Local(home)}
    found = step.verify_weights(_desired(tmp_path, layout="plain"), sessions, "dst", repair=True, timeout=60)
    assert ".docker/config.json" in found.mismatched
    assert credentials.read_text() == '{"auths": {"registry.example": {"auth": "c2VjcmV0"}}}', (
        "verify --repair removed a file through a linked model root")
    assert found.repaired == () and "goes through a link: nothing removed" in (found.problem or "")


def test_the_daemon_s_secret_goes_on_stdin_only_to_it_and_to_each_stream():
    """The one-time daemon's secret: made for the step, fed to the helper and to each rsync client on stdin
    (`--password-file=-`), in no command line; a new one for every copy."""
    from reconciler.edge.steps.actions import Given
    from tests.unit.step_cases.weights import FRESH, HELPERS, STEP, _daemon, _observed, daemon, recorded
    from tests.unit.step_driver import Driver

    seen = []
    for _ in range(2):
        driver = Driver(facts=FRESH, results={**HELPERS, **_daemon()})
        assert driver.drive(step.sync_weights(Given(recorded(), _observed()), STEP)) is None
        secret = driver.stdin[f"start {daemon(4)}"]
        streams = {key: fed for key, fed in driver.stdin.items()
                   if key.startswith("head python3 -c '<links_helper.py>' send ")}
        assert len(secret) > 40 and secret.endswith(b"\n") and list(streams.values()) == [secret] * 4
        assert not any(secret.strip().decode() in line for line in driver.transcript)
        seen.append(secret)
    assert seen[0] != seen[1]
