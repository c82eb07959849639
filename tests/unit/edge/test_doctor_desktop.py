"""`reconciler doctor` on the desktop (issue 52, item 4): DGX OS boots into `graphical.target`, so Xorg and
gnome-shell run on the GB10 in the unified memory the serving ranks share, outside anything the budget reserves.
Doctor reads `systemctl get-default` on every node and warns on a serving node that boots into it, with the fix;
a node without systemd gets no check. Facts are built as tests/unit/edge/test_doctor.py builds them."""

from __future__ import annotations

from reconciler.core import preflight
from reconciler.edge import doctor as edge_doctor
from reconciler.edge.facts.base import Section
from tests.unit.edge.test_doctor import DESIRED, HEAD, LOCAL, WORKER, _facts, one, run


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


def test_a_graphical_default_with_no_display_server_running_is_said_not_warned():
    """What holds memory is the desktop that runs: a stock Debian install (the testbed's nodes) defaults to
    graphical.target with no display manager at all."""
    found = run(head=_facts(HEAD, default_target="graphical.target", display=()),
                worker=_facts(WORKER, default_target="graphical.target", display=("Xorg", "gnome-shell")))
    assert one(found, "desktop", "head").status == "ok"
    warned = one(found, "desktop", "worker")
    assert warned.status == "warn" and "(Xorg, gnome-shell running)" in warned.message


def test_doctor_reads_the_display_servers_that_run():
    import subprocess

    assert edge_doctor.parse_display(Section("Xorg\ngnome-shell\nXorg-not\n", 0)) == ("Xorg", "gnome-shell")
    assert edge_doctor.parse_display(Section("", 0)) == ()
    assert edge_doctor.parse_display(None) is None
    line = next(line for line in edge_doctor.doctor_script(DESIRED, HEAD).script.splitlines()
                if "ps -eo comm=" in line)
    out = subprocess.run(["sh", "-c", line.replace("; rc 0", "")], capture_output=True, text=True, timeout=30,
                         check=False)
    assert out.returncode in (0, 1) and not out.stderr, "the line runs as the node's sh runs it"
    assert set(out.stdout.split()) <= set(edge_doctor.DISPLAY_SERVERS.split("|")), out.stdout


def test_a_node_without_systemd_gets_no_check():
    assert "desktop" not in [c.name for c in run()]


def test_a_node_that_serves_nothing_is_not_asked():
    """A worker outside the deployment's span (the deployment on the head alone) is no serving node."""
    alone = DESIRED.with_deployment(serving=DESIRED.serving.model_copy(
        update={"nodes": ["head"], "tensor_parallel_size": 1}))
    found = preflight.checks(alone, {"head": _facts(HEAD, default_target="graphical.target"),
                                     "worker": _facts(WORKER, default_target="graphical.target")}, LOCAL)
    assert [c.node for c in found if c.name == "desktop"] == ["head"]
