"""`reconciler doctor` on who may change the source's hub (issue 53): the weights copy checks the source's links,
then reads them again seconds or hours later (finding A), so whoever else can write the hub, the model's tree or the
hub's shared blob store (a co-tenant container that mounts the cache read-write, a group-writable shared cache) can
swap a file for a link to the SSH user's key in between. Doctor reads, on the model's source, the owner and mode of
the hub, of every entry of the model's tree and of the blob store, and of every directory above the hub, and warns
with the exact `chmod`/`chown` where anyone but the SSH user may change them.

The pure check is fed constructed facts for each state; the fragment runs for real under `sh` (the node's `find`,
`stat`, `id`) on temporary hubs, its output read by the edge's own parser, and the fix it names is run and the hub
read again."""

from __future__ import annotations

import os
import pwd
import subprocess
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from reconciler.core import spec
from reconciler.core.preflight import Fix, HubEntry, HubFacts, hub_check
from reconciler.edge import doctor as edge
from reconciler.edge.facts.base import ProbeError, Section, read_sections
from tests.unit.edge.test_doctor import DESIRED, HEAD, WORKER, WORKER_ANSWER, _answer, _facts, one, run
from tests.unit.edge.test_probe_fragments import LocalNode
from tests.unit.edge.test_probe_fuzz import SECTIONS, only_probe_errors
from tests.unit.examples import examples

REPO = Path(__file__).resolve().parents[3]
HUB = "/srv/spark-testbed/head/models/hub"
TREE = f"{HUB}/models--testorg--tiny-moe"
REV = "1" * 40
SPARK = 1000
ROOTS = (HubEntry("above", "/srv/spark-testbed/head/models", SPARK, 0o755),
         HubEntry("above", "/srv/spark-testbed/head", 0, 0o755), HubEntry("above", "/srv/spark-testbed", 0, 0o755),
         HubEntry("above", "/srv", 0, 0o755), HubEntry("above", "/", 0, 0o755))


def facts(**kw) -> HubFacts:
    return HubFacts(**{"exists": True, "uid": SPARK, "above": ROOTS, "tree": True, "store": False, **kw})


def check(hub: HubFacts | None):
    return hub_check(DESIRED, HEAD, _facts(HEAD, hub=hub))


# -- the check -----------------------------------------------------------------------------------------------------

def test_a_hub_the_ssh_user_alone_can_change_is_ok():
    c = check(facts(store=True))
    assert (c.status, c.fix) == ("ok", None)
    assert c.message == (f"{HUB}: the hub, the model's tree, its shared blob store and every directory above: "
                         "spark's alone to change (no other owner, no group or other write)")
    assert one(run(head=_facts(HEAD, hub=facts())), "hub", "head").status == "ok"


def test_a_group_writable_tree_warns_with_its_chmod():
    c = check(facts(counts={"tree": (3, 0)}, loose=(HubEntry("tree", f"snapshots/{REV}", SPARK, 0o775),)))
    assert c.status == "warn"
    assert c.message == (f"{HUB}: 3 entries of the model's tree (3 writable by group or others; first snapshots/"
                         f"{REV}: mode 0775): whoever else can write there can swap a file of the model for a link "
                         "to spark's key before the copy lists it")
    assert c.fix == Fix(f"chmod -R go-w {TREE}", "spark", "head")


def test_the_hub_itself_writable_by_its_group_is_chmodded_alone_not_recursively():
    c = check(facts(counts={"hub": (1, 0)}, loose=(HubEntry("hub", ".", SPARK, 0o2775),)))
    assert c.status == "warn" and c.message.startswith(f"{HUB}: the hub itself is writable by group or others "
                                                        "(mode 2775): whoever else")
    assert c.fix == Fix(f"chmod go-w {HUB}", "spark", "head")  # the hub may hold other models: not -R


def test_entries_of_another_owner_are_chowned_by_root():
    c = check(facts(store=True, counts={"store": (2, 2), "tree": (1, 0)},
                    loose=(HubEntry("tree", "blobs", SPARK, 0o777), HubEntry("store", "ab/cdef", 0, 0o755))))
    assert c.status == "warn"
    assert ("1 entry of the model's tree (1 writable by group or others; first blobs: mode 0777); 2 entries of the "
            "hub's shared blob store (2 not spark's; first ab/cdef: uid 0, mode 0755)") in c.message
    assert c.fix == Fix(f"chmod -R go-w {TREE} && chown -R spark {HUB}/blobs && chmod -R go-w {HUB}/blobs", "root",
                        "head")


def test_a_loose_directory_above_the_hub_is_named_and_made_go_w_by_root():
    above = (HubEntry("above", "/srv/spark-testbed/head/models", SPARK, 0o755),
             HubEntry("above", "/srv/spark-testbed/head", 0, 0o777), *ROOTS[2:])
    c = check(facts(above=above))
    assert c.status == "warn" and c.message.startswith(f"{HUB}: /srv/spark-testbed/head above it is mode 0777: ")
    assert c.fix == Fix("chmod go-w /srv/spark-testbed/head", "root", "head")
    mine = (HubEntry("above", "/srv/spark-testbed/head/models", SPARK, 0o777), *ROOTS[1:])
    assert check(facts(above=mine)).fix == Fix("chmod go-w /srv/spark-testbed/head/models", "spark", "head")


def test_a_root_owned_sticky_directory_above_is_fine_and_another_owner_is_not():
    assert check(facts(above=(HubEntry("above", "/tmp", 0, 0o1777), ROOTS[-1]))).status == "ok"
    assert check(facts(above=(HubEntry("above", "/tmp", 1002, 0o1777), ROOTS[-1]))).status == "warn"
    c = check(facts(above=(HubEntry("above", "/home/alice", 1002, 0o750), ROOTS[-1])))
    assert c.status == "warn" and "/home/alice above it is uid 1002's" in c.message
    assert c.fix == Fix("move the model below a directory only root and spark own, then point model.path there",
                        "spark", "head")  # never chowned away from its owner


def test_no_hub_yet_or_one_the_user_cannot_enter_is_said_without_a_fix():
    c = check(HubFacts(exists=False))
    assert (c.status, c.fix) == ("warn", None) and "not there yet" in c.message and "reconciler apply" in c.message
    c = check(HubFacts(exists=True))
    assert (c.status, c.fix) == ("warn", None) and "spark cannot enter it" in c.message


def test_only_the_model_source_is_judged():
    assert check(None) is None
    found = run(worker=_facts(WORKER, hub=facts()))  # a worker's facts never carry it; if they did: not judged
    assert not [c for c in found if c.name == "hub" and c.node == "worker"]


# -- the edge: the section in the doctor script, and its parser ----------------------------------------------------

def test_doctor_asks_the_source_alone_and_reads_the_section_into_its_facts():
    assert "sec hub" in edge.doctor_script(DESIRED, HEAD).script
    assert "sec hub" not in edge.doctor_script(DESIRED, WORKER).script
    body = ("U\t1000\nA\t0\t755\t/srv\nA\t0\t755\t/\nT\thub\nN\thub\t0\t0\nT\ttree\nE\ttree\t1000\t775\t./blobs\n"
            "N\ttree\t1\t0")
    got = edge.parse_doctor(DESIRED, HEAD, _answer("n", {**WORKER_ANSWER, "hub": (body, 0)}), "n", sent=0.0).hub
    assert got == HubFacts(True, 1000, (HubEntry("above", "/srv", 0, 0o755), HubEntry("above", "/", 0, 0o755)),
                           (HubEntry("tree", "blobs", 1000, 0o775),), {"hub": (0, 0), "tree": (1, 0)}, tree=True)
    assert edge.parse_doctor(DESIRED, WORKER, _answer("n", WORKER_ANSWER), "n", sent=0.0).hub is None


@pytest.mark.parametrize("body", ["X\tanything", "U\t1000\nN\tbogus\t1\t0", "U\tme", "T\ttree",
                                  "U\t0\nE\ttree\t0\t8x8\t./a", "U\t0\n" + "A\t0\t755\t/\n" * 2049])
def test_a_section_the_fragment_would_not_print_is_the_nodes_probe_error(body):
    with pytest.raises(ProbeError, match="hub"):
        edge.parse_hub(Section(body, 0))


_HUB_LINE = st.one_of(st.sampled_from(["U\t1000", "U\t", "T\ttree", "T\thub", "T\tstore", "T\tx", "N\ttree\t1\t0",
                                         "N\ttree\t-1", "A\t0\t755\t/", "A\t0\t9\t/", "E\ttree\t0\t775\t./a",
                                         "E\tstore\t0\t775", "E\thub\tx\t1\t."]), st.text(max_size=40))


@settings(**examples(300), deadline=None, suppress_health_check=list(HealthCheck))
@given(section=st.one_of(SECTIONS, st.builds(Section, st.lists(_HUB_LINE, max_size=12).map("\n".join),
                                             st.integers(-1, 4))))
def test_the_hub_parser_raises_nothing_but_probe_error(section):
    """Node bytes: a HubFacts or a ProbeError naming the section, whatever they are (as test_probe_fuzz for the
    probe's parsers)."""
    only_probe_errors(lambda: edge.parse_hub(section))


def test_the_parser_keeps_the_first_entries_and_the_whole_counts():
    lines = "\n".join(f"E\ttree\t0\t777\t./f{i}" for i in range(500))
    got = edge.parse_hub(Section(f"U\t0\nT\ttree\n{lines}\nN\ttree\t500\t0", 0))
    assert got is not None and len(got.loose) == edge.HUB_SHOWN and got.loose[0].path == "f0"
    assert got.counts == {"tree": (500, 0)}
    assert edge.parse_hub(Section("", 2)) == HubFacts(exists=False)
    assert edge.parse_hub(Section("", 3)) == HubFacts(exists=True)
    assert edge.parse_hub(None) is None


# -- the fragment, run for real under sh -----------------------------------------------------------------------------

def _desired_with_hub(hub: Path, user: str) -> spec.Desired:
    """The testbed's desired state with the head's model path at `hub` and every node's SSH user `user` (this
    test's own user: the fragment judges against `id -u`)."""
    text = (REPO / "desired-state" / "testbed.yaml").read_text()
    text = text.replace(HUB, str(hub)).replace("user: spark", f"user: {user}")
    return spec.loads(text, str(REPO / "desired-state" / "testbed.yaml"))


def _tree(hub: Path) -> Path:
    """An hf-cache hub as huggingface_hub lays it out, with the Xet shared store: modes as a 022 umask makes them."""
    root = hub / "models--testorg--tiny-moe"
    snap = root / "snapshots" / REV
    for d in (snap, root / "blobs", root / "refs", hub / "blobs" / "ab"):
        d.mkdir(parents=True)
    (hub / "blobs" / "ab" / "cdef").write_bytes(b"x" * 10)
    (root / "blobs" / "etag1").symlink_to("../../blobs/ab/cdef")
    (snap / "model.safetensors").symlink_to("../../blobs/etag1")
    (snap / "config.json").write_text("{}")
    (root / "refs" / "main").write_text(REV)
    for p in [hub, *hub.rglob("*")]:
        if not p.is_symlink():
            p.chmod(0o755 if p.is_dir() else 0o644)
    return root


def _read(tmp_path: Path, desired: spec.Desired) -> HubFacts:
    """The fragment run by this machine's `sh -s` as `read_sections` runs it over SSH, read by `parse_hub`."""
    place = tmp_path / f"node{len(list(tmp_path.glob('node*')))}"
    place.mkdir()
    node = LocalNode(place)
    sec = read_sections(node, edge.hub_script(desired), timeout=60)["hub"]
    got = edge.parse_hub(sec)
    assert got is not None
    return got


@pytest.fixture
def me() -> str:
    return pwd.getpwuid(os.geteuid()).pw_name


def test_the_fragment_on_a_hub_only_its_user_can_change(tmp_path, me):
    hub = tmp_path / "models" / "hub"
    _tree(hub)
    desired = _desired_with_hub(hub, me)
    got = _read(tmp_path, desired)
    assert (got.exists, got.uid, got.tree, got.store) == (True, os.geteuid(), True, True)
    assert got.counts == {"hub": (0, 0), "tree": (0, 0), "store": (0, 0)} and got.loose == ()
    assert [e.path for e in got.above] == [str(p) for p in hub.resolve().parents]
    assert {e.path: e.mode for e in got.above}[str(tmp_path)] == tmp_path.stat().st_mode & 0o7777
    c = hub_check(desired, desired.node("head"), _facts(HEAD, hub=got))
    assert c is not None and c.status == "ok", c


def test_the_fragment_finds_what_others_may_change_and_the_fix_it_names_clears_it(tmp_path, me):
    hub = tmp_path / "models" / "hub"
    root = _tree(hub)
    hub.chmod(0o775)
    (root / "snapshots" / REV).chmod(0o777)
    (root / "snapshots" / REV / "config.json").chmod(0o666)
    odd = root / "snapshots" / REV / "new\nline.json"
    odd.write_text("{}")
    odd.chmod(0o646)
    (hub / "blobs" / "ab").chmod(0o770)
    (root / "linked").symlink_to("/etc")  # a link's own mode (0777) is nothing to fix: not reported
    desired = _desired_with_hub(hub, me)
    got = _read(tmp_path, desired)
    assert got.counts == {"hub": (1, 0), "tree": (3, 0), "store": (1, 0)}
    assert {(e.area, e.path, e.mode) for e in got.loose} == {
        ("hub", ".", 0o775), ("tree", f"snapshots/{REV}", 0o777), ("tree", f"snapshots/{REV}/config.json", 0o666),
        ("tree", "?", 0o646), ("store", "ab", 0o770)}
    c = hub_check(desired, desired.node("head"), _facts(HEAD, hub=got))
    assert c is not None and c.status == "warn" and c.fix is not None
    assert c.fix == Fix(f"chmod go-w {hub} && chmod -R go-w {root} && chmod -R go-w {hub}/blobs", me, "head")
    subprocess.run(["sh", "-c", c.fix.command], check=True, timeout=30)
    again = _read(tmp_path, desired)
    assert again.counts == {"hub": (0, 0), "tree": (0, 0), "store": (0, 0)}
    assert hub_check(desired, desired.node("head"), _facts(HEAD, hub=again)).status == "ok"  # type: ignore[union-attr]


def test_the_fragment_names_entries_of_another_owner_and_roots_fix_takes_them_back(tmp_path, me):
    hub = tmp_path / "models" / "hub"
    root = _tree(hub)
    os.chown(hub / "blobs" / "ab", 65534, 65534)  # a co-tenant's directory in the shared store: mode 0755
    os.lchown(root / "snapshots" / REV / "config.json", 65534, 65534)
    desired = _desired_with_hub(hub, me)
    got = _read(tmp_path, desired)
    assert got.counts == {"hub": (0, 0), "tree": (1, 1), "store": (1, 1)}
    assert {(e.area, e.path, e.uid) for e in got.loose} == {("tree", f"snapshots/{REV}/config.json", 65534),
                                                            ("store", "ab", 65534)}
    c = hub_check(desired, desired.node("head"), _facts(HEAD, hub=got))
    assert c is not None and c.fix == Fix(f"chown -R {me} {root} && chmod -R go-w {root} && chown -R {me} "
                                          f"{hub}/blobs && chmod -R go-w {hub}/blobs", "root", "head")
    subprocess.run(["sh", "-c", c.fix.command], check=True, timeout=30)
    assert _read(tmp_path, desired).counts == {"hub": (0, 0), "tree": (0, 0), "store": (0, 0)}


def test_the_fragment_on_a_missing_hub_a_linked_hub_and_a_plain_model(tmp_path, me):
    assert _read(tmp_path, _desired_with_hub(tmp_path / "absent" / "hub", me)) == HubFacts(exists=False)
    real = tmp_path / "disk" / "hub"
    _tree(real)
    (tmp_path / "disk").chmod(0o777)
    (tmp_path / "linked").mkdir()
    (tmp_path / "linked" / "hub").symlink_to(real)
    got = _read(tmp_path, _desired_with_hub(tmp_path / "linked" / "hub", me))
    assert got.above[0] == HubEntry("above", str(tmp_path / "disk"), os.geteuid(), 0o777)  # where the link leads
    (tmp_path / "disk").chmod(0o755)
    text = (REPO / "desired-state" / "testbed.yaml").read_text().replace("layout: hf-cache", "layout: plain")
    plain = spec.loads(text.replace(HUB, str(real / "models--testorg--tiny-moe")).replace("user: spark", f"user: {me}"),
                       str(REPO / "desired-state" / "testbed.yaml"))
    (real / "models--testorg--tiny-moe").chmod(0o775)
    got = _read(tmp_path, plain)
    assert got.counts == {"tree": (1, 0)} and got.loose == (HubEntry("tree", ".", os.geteuid(), 0o775),)
    c = hub_check(plain, plain.node("head"), _facts(HEAD, hub=got))
    assert c is not None and c.fix == Fix(f"chmod -R go-w {real / 'models--testorg--tiny-moe'}", me, "head")
