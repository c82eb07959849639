"""The machine a node reports and the platform an image says, read from node bytes and compared by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from reconciler.core.platforms import machine_platform, runs_on
from reconciler.edge.facts.base import ProbeError, Section
from reconciler.edge.facts.host import parse_machine
from reconciler.edge.facts.images import image_from_inspect

FIXTURES = Path(__file__).parents[1] / "fixtures"


@pytest.mark.parametrize(("machine", "platform"), [("aarch64", "linux/arm64"), ("x86_64", "linux/amd64"),
                                                   ("ppc64le", "linux/ppc64le")])
def test_the_kernels_name_is_the_oci_name(machine, platform):
    assert machine_platform(machine) == platform


@pytest.mark.parametrize(("image", "machine", "fits"), [
    ("linux/arm64/v8", "aarch64", True),      # what an NGC image on a Spark says
    ("linux/amd64", "aarch64", False),        # an x86 tag pulled on a Spark
    ("linux/arm64", "x86_64", False),
    ("windows/amd64", "x86_64", False),
    ("", "aarch64", True), ("linux/amd64", None, True),   # not known: judged by the other checks
])
def test_an_image_runs_where_os_and_architecture_match(image, machine, fits):
    assert runs_on(image, machine) is fits


def test_the_platform_comes_from_the_inspect_object():
    raw = json.loads((FIXTURES / "docker-20.10-overlay2-image-inspect.json").read_text())
    raw = raw[0] if isinstance(raw, list) else raw
    assert image_from_inspect(raw).platform == f"{raw['Os']}/{raw['Architecture']}"
    arm = {**raw, "Architecture": "arm64", "Variant": "v8"}
    assert image_from_inspect(arm).platform == "linux/arm64/v8"
    assert image_from_inspect(arm).content != image_from_inspect(raw).content, "a copy keeps the platform too"


@pytest.mark.parametrize(("body", "rc", "machine"), [("aarch64\n", 0, "aarch64"), ("", 127, None)])
def test_uname_is_read_or_not_known(body, rc, machine):
    assert parse_machine(Section(body, rc)) == machine


@pytest.mark.parametrize("body", ["aarch64 x86_64\n", "\x1b[31mboom\n", "a" * 40 + "\n"])
def test_anything_but_one_word_is_odd_output_of_the_node(body):
    with pytest.raises(ProbeError, match="machine"):
        parse_machine(Section(body, 0))


# ----------------------------------------------------------------------------------------- listening ports

#: Rows as /proc/net/tcp and tcp6 print them (this machine, 2026-12-05): the probe's grep keeps the 0A (LISTEN)
#: ones; tcp6 addresses are 32 hex digits.
PROC_NET_TCP = (
    "   0: 00000000:1F40 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 1247 1 "
    "000000002852fc79 100 0 0 10 0\n"
    "   3: 0100007F:7335 00000000:0000 0A 00000000:00000000 00:00000000 00000000  1000        0 7781 1 "
    "0000000011a2b3c4 100 0 0 10 0\n"
    "   0: 00000000000000000000000000000000:0016 00000000000000000000000000000000:0000 0A 00000000:00000000 "
    "00:00000000 00000000     0        0 1300 1 00000000d1f0a2b3 100 0 0 10 0\n")


def test_listening_ports_are_read_from_the_kernels_table():
    from reconciler.edge.facts.ports import parse_listening
    assert parse_listening(Section(PROC_NET_TCP, 0)) == [22, 8000, 29493]
    assert parse_listening(Section("", 0)) == [], "nothing listens"
    assert parse_listening(Section("", 2)) is None, "/proc/net/tcp could not be read: not known"


def test_a_row_that_is_not_a_listen_row_is_odd_output():
    from reconciler.edge.facts.ports import parse_listening
    with pytest.raises(ProbeError, match="listen"):
        parse_listening(Section("   1: 0100E70A:9A00 0200E70A:0016 01 00000000:00000000\n", 0))
