"""`reconciler doctor` on the desktop (issue 52, item 4): DGX OS boots into `graphical.target`, so Xorg and
gnome-shell run on the GB10 in the unified memory the serving ranks share, outside anything the budget reserves.
Doctor reads `systemctl get-default` on every node and warns on a serving node that boots into it, with the fix;
a node without systemd gets no check. Facts are built as tests/unit/test_doctor.py builds them."""

from __future__ import annotations

from reconciler.core import preflight
from reconciler.edge import doctor as edge_doctor
from reconciler.edge.probes import Section
from tests.unit.test_doctor import DESIRED, HEAD, LOCAL, WORKER, _facts, one, run


def test_doctor_reads_the_default_target():
    """`systemctl get-default` prints the unit (`graphical.target`, as on a stock DGX OS); without systemd its
    complaint goes to /dev/null and it exits 1."""
    assert edge_doctor.parse_default_target(Section("graphical.target\n", 0)) == "graphical.target"
    assert edge_doctor.parse_default_target(Section("multi-user.target", 0)) == "multi-user.target"
    assert edge_doctor.parse_default_target(Section("", 1)) is None
    assert edge_doctor.parse_default_target(Section("graphical.target; rm -rf /", 0)) is None
    assert edge_doctor.parse_default_target(None) is None
    assert "sec default_target\nsystemctl get-default 2>/dev/null; rc $?" in edge_doctor.doctor_script(
        DESIRED, HEAD).script


def test_a_serving_node_that_boots_into_the_desktop_is_warned_with_the_fix():
    found = run(head=_facts(HEAD, default_target="graphical.target"),
                worker=_facts(WORKER, default_target="multi-user.target"))
    warned = one(found, "desktop", "head")
    assert warned.status == "warn" and "graphical.target" in warned.message
    assert "Xorg and gnome-shell" in warned.message
    assert warned.fix == preflight.Fix("sudo systemctl set-default multi-user.target && sudo systemctl isolate "
                                       "multi-user.target (or reboot)", "spark", "head")
    assert one(found, "desktop", "worker").status == "ok"
    assert preflight.exit_code(found) == 0, "a warning: apply converges all the same"


def test_a_node_without_systemd_gets_no_check():
    assert "desktop" not in [c.name for c in run()]


def test_a_node_that_serves_nothing_is_not_asked():
    """A worker outside the deployment's span (the deployment on the head alone) is no serving node."""
    alone = DESIRED.with_deployment(serving=DESIRED.serving.model_copy(
        update={"nodes": ["head"], "tensor_parallel_size": 1}))
    found = preflight.checks(alone, {"head": _facts(HEAD, default_target="graphical.target"),
                                     "worker": _facts(WORKER, default_target="graphical.target")}, LOCAL)
    assert [c.node for c in found if c.name == "desktop"] == ["head"]
