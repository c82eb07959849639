"""The YAML loader: positions, duplicate keys, size and alias caps, non-mapping documents, file errors."""

from __future__ import annotations

import builtins
import errno
import os
import threading
from pathlib import Path

import pytest

from reconciler.core import loader, spec
from reconciler.core.loader import Document, LoadError, Position, Problem


def _load_error(text: bytes) -> list[Problem]:
    with pytest.raises(LoadError) as info:
        loader.load_text(text)
    return info.value.problems


def _only(problems: list[Problem]) -> Problem:
    assert len(problems) == 1, problems
    return problems[0]


# ---------------------------------------------------------------------------------------------- positions


def test_positions_of_values_and_keys_are_one_based():
    doc = loader.load_text(b"nodes:\n  - name: a\n    ssh: {host: h}\nmodel:\n  id: x/y\n")
    assert doc.data == {"nodes": [{"name": "a", "ssh": {"host": "h"}}], "model": {"id": "x/y"}}
    assert doc.key_positions[("nodes",)] == Position(1, 1)
    assert doc.value_positions[("nodes", 0)] == Position(2, 5)
    assert doc.key_positions[("nodes", 0, "name")] == Position(2, 5)
    assert doc.value_positions[("nodes", 0, "name")] == Position(2, 11)
    assert doc.value_positions[("nodes", 0, "ssh", "host")] == Position(3, 17)
    assert doc.key_positions[("model", "id")] == Position(5, 3)
    assert doc.value_positions[("model", "id")] == Position(5, 7)


def test_position_of_a_present_value_is_the_value():
    doc = loader.load_text(b"model:\n  id: x/y\n")
    assert doc.position_of(("model", "id")) == Position(2, 7)


def test_position_of_a_missing_field_points_at_the_parent_key():
    doc = loader.load_text(b"nodes:\n  - name: a\n    ssh:\n      user: u\nmodel:\n  id: x/y\n")
    # ssh.host is missing: the `ssh:` key of that node
    assert doc.position_of(("nodes", 0, "ssh", "host")) == Position(3, 5)
    # model.path is missing: the `model:` key
    assert doc.position_of(("model", "path")) == Position(5, 1)
    # a chain of missing levels goes up to the nearest ancestor that exists
    assert doc.position_of(("nodes", 0, "fabric", "address")) == Position(2, 5)
    # a missing top-level section: the start of the document
    assert doc.position_of(("serving",)) == Position(1, 1)
    assert doc.position_of(("serving", "image")) == Position(1, 1)


def test_position_of_with_an_empty_document_map_is_line_one():
    assert Document(data={}).position_of(("anything", 0)) == Position(1, 1)


def test_missing_field_is_reported_at_the_parent_key_end_to_end():
    text = (Path(__file__).parents[1] / "invalid" / "missing-required-fabric-address.yaml").read_text()
    with pytest.raises(spec.InvalidDesiredState) as info:
        spec.loads(text, "F")
    assert "F:7:5: nodes[0].fabric.address: required field is missing" in info.value.lines()


def test_format_loc_and_render():
    assert loader.format_loc(()) == ""
    assert loader.format_loc(("nodes", 1, "ssh", "jump")) == "nodes[1].ssh.jump"
    assert loader.format_loc(("co_tenants", "allowed", "*", 0)) == "co_tenants.allowed.*[0]"
    assert Problem(Position(3, 4), "a.b", "bad").render("f.yaml") == "f.yaml:3:4: a.b: bad"
    assert Problem(Position(1, 1), "", "empty").render("f.yaml") == "f.yaml:1:1: empty"


def test_yaml_scalars_keep_their_types():
    doc = loader.load_text(b"a: 1\nb: 0.5\nc: true\nd: null\ne: '1'\nf: [1, x]\n")
    assert doc.data == {"a": 1, "b": 0.5, "c": True, "d": None, "e": "1", "f": [1, "x"]}


def test_non_string_keys_become_strings():
    assert loader.load_text(b"1: a\ntrue: b\n").data == {"1": "a", "True": "b"}


# ---------------------------------------------------------------------------------------------- duplicate keys


def test_duplicate_key_names_the_first_position():
    p = _only(_load_error(b"nodes: []\nmodel:\n  id: a/b\n  path: /x\n  id: c/d\n"))
    assert p.position == Position(5, 3)
    assert p.path == "model.id"
    assert p.message == "duplicate key 'id' (first defined at line 3, column 3)"


def test_duplicate_top_level_key():
    p = _only(_load_error(b"policy: {}\nnodes: []\npolicy: {mode: observe}\n"))
    assert (p.position, p.path) == (Position(3, 1), "policy")
    assert "first defined at line 1, column 1" in p.message


def test_duplicate_key_inside_a_list_item_and_a_flow_mapping():
    p = _only(_load_error(b"nodes:\n  - name: a\n  - name: b\n    role: head\n    role: worker\n"))
    assert (p.position, p.path) == (Position(5, 5), "nodes[1].role")
    assert "first defined at line 4, column 5" in p.message
    p = _only(_load_error(b"a: {x: 1, y: 2, x: 3}\n"))
    assert (p.position, p.path) == (Position(1, 17), "a.x")
    assert "first defined at line 1, column 5" in p.message


def test_keys_equal_after_conversion_to_string_are_duplicates():
    p = _only(_load_error(b"a:\n  1: x\n  '1': y\n"))
    assert p.path == "a.1" and "duplicate key '1'" in p.message


def test_same_key_in_different_mappings_is_fine():
    assert loader.load_text(b"a: {x: 1}\nb: {x: 2}\nc: [{x: 1}, {x: 2}]\n").data["c"] == [{"x": 1}, {"x": 2}]


# ---------------------------------------------------------------------------------------------- size cap


def test_exactly_one_mib_is_accepted_one_byte_more_is_not():
    body = b"a: 1\n"
    padding = b"#" * (loader.MAX_BYTES - len(body) - 1) + b"\n"
    assert len(body + padding) == loader.MAX_BYTES
    assert loader.load_text(body + padding).data == {"a": 1}
    p = _only(_load_error(body + padding + b"#"))
    assert p.position == Position(1, 1) and p.path == ""
    assert "1 MiB" in p.message and "larger" in p.message


def test_a_100_mb_file_is_refused_before_parsing(tmp_path, build_meter):
    big = tmp_path / "big.yaml"
    with open(big, "wb") as handle:
        line = b"key_" + b"x" * 59 + b": 1\n"
        chunk = line * (1024 * 1024 // len(line) + 1)
        while handle.tell() < 100 * 1000 * 1000:
            handle.write(chunk)
    assert big.stat().st_size >= 100 * 1000 * 1000
    with pytest.raises(spec.InvalidDesiredState) as info:
        spec.load(big)
    assert build_meter() == 0, "refused on its size, before a single value was built"
    assert info.value.lines() == [f"{big}:1:1: file is larger than the 1048576-byte (1 MiB) limit for a desired state"]


def test_a_huge_file_is_not_read_entirely(tmp_path, monkeypatch):
    """Whatever the timing, at most MAX_BYTES + 1 bytes are read from the file."""
    big = tmp_path / "sparse.yaml"
    with open(big, "wb") as handle:
        handle.truncate(10 * 1024**3)  # 10 GiB, sparse
    read_sizes: list[int] = []
    real_open = builtins.open

    class Spy:
        def __init__(self, handle):
            self.handle = handle

        def read(self, size=-1):
            data = self.handle.read(size)
            read_sizes.append(len(data))
            return data

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.handle.close()

    monkeypatch.setattr(loader, "open", lambda *a, **k: Spy(real_open(*a, **k)), raising=False)
    with pytest.raises(LoadError, match="1 MiB"):
        loader.load_file(big)
    assert read_sizes and sum(read_sizes) <= loader.MAX_BYTES + 1


# ---------------------------------------------------------------------------------------------- alias bombs


def _billion_laughs(levels: int = 9) -> bytes:
    names = "abcdefghijklmnop"[:levels]
    lines = [f'{names[0]}: &{names[0]} ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    for prev, cur in zip(names, names[1:]):
        lines.append(f"{cur}: &{cur} [" + ",".join([f"*{prev}"] * 9) + "]")
    return ("\n".join(lines) + "\n").encode()


def test_billion_laughs_is_refused_within_the_cap_with_a_clear_message(build_meter):
    text = _billion_laughs(9)
    assert len(text) < 1000
    p = _only(_load_error(text))
    assert build_meter() == loader.MAX_EXPANDED_NODES + 1, "stopped at the first value past the cap"
    assert "expands to more than" in p.message and "aliases" in p.message


def test_mapping_alias_bomb_is_refused_within_the_cap(build_meter):
    lines = ["a: &a {x1: lol, x2: lol, x3: lol, x4: lol, x5: lol, x6: lol, x7: lol, x8: lol, x9: lol}"]
    for prev, cur in zip("abcdefgh", "bcdefghi"):
        lines.append(f"{cur}: &{cur} {{" + ", ".join(f"k{i}: *{prev}" for i in range(9)) + "}")
    p = _only(_load_error(("\n".join(lines) + "\n").encode()))
    assert build_meter() == loader.MAX_EXPANDED_NODES + 1
    assert "anchors/aliases" in p.message


def test_billion_laughs_through_spec_load_is_one_placed_problem(tmp_path, build_meter):
    bomb = tmp_path / "bomb.yaml"
    bomb.write_bytes(_billion_laughs(9))
    with pytest.raises(spec.InvalidDesiredState) as info:
        spec.load(bomb)
    assert build_meter() == loader.MAX_EXPANDED_NODES + 1
    (line,) = info.value.lines()
    assert line.startswith(f"{bomb}:") and "anchors/aliases used as a bomb" in line


def test_ordinary_aliases_are_fine():
    doc = loader.load_text(b"paths: &p /data\nmodel: {path: *p}\n")
    assert doc.data == {"paths": "/data", "model": {"path": "/data"}}


def test_recursive_alias_is_a_load_error_not_a_crash(build_meter):
    """`a: &a [*a]` once made the builder recurse until RecursionError (a traceback, exit 1); the depth cap
    stops it after one path's worth of values."""
    for text in (b"a: &a [*a]\n", b"a: &a {b: *a}\n"):
        with pytest.raises(LoadError):
            loader.load_text(text)
        assert build_meter() <= loader.MAX_DEPTH + 2


def test_deep_nesting_is_a_load_error_not_a_crash():
    """600 nested lists (1.2 kB) once overflowed the builder's recursion (RecursionError)."""
    for depth in (600, 900):
        with pytest.raises(LoadError):
            loader.load_text(b"a: " + b"[" * depth + b"]" * depth + b"\n")


def test_very_deep_nesting_is_stopped_by_the_parser():
    p = _only(_load_error(b"a: " + b"[" * 3000 + b"]" * 3000 + b"\n"))
    assert p.message.startswith("invalid YAML:")


# ---------------------------------------------------------------------------------------------- document shape


@pytest.mark.parametrize("text,kind,position", [
    (b"- nodes: []\n- model: {}\n", "list", Position(1, 1)),
    (b"\n\n  - a\n", "list", Position(3, 3)),
    (b"just a string\n", "scalar", Position(1, 1)),
    (b"42\n", "scalar", Position(1, 1)),
    (b"~\n", "scalar", Position(1, 1)),
])
def test_non_mapping_top_level(text, kind, position):
    p = _only(_load_error(text))
    assert p.message == f"the top level must be a mapping (key: value), not a {kind}"
    assert p.position == position


@pytest.mark.parametrize("text", [b"", b"\n\n", b"# only a comment\n", b"   \n"])
def test_empty_file(text):
    p = _only(_load_error(text))
    assert p.position == Position(1, 1)
    assert p.message.startswith("the file is empty")


def test_second_document_is_refused():
    p = _only(_load_error(b"a: 1\n---\nb: 2\n"))
    assert p.position == Position(3, 1)
    assert "only one YAML document" in p.message


def test_explicit_single_document_markers_are_fine():
    assert loader.load_text(b"---\na: 1\n...\n").data == {"a": 1}


def test_merge_keys_are_refused():
    p = _only(_load_error(b"base: &b {x: 1}\nmodel:\n  <<: *b\n  y: 2\n"))
    assert p.path == "model" and "merge keys (<<)" in p.message
    assert p.position == Position(3, 3)


def test_complex_keys_are_refused():
    p = _only(_load_error(b"? [a, b]\n: c\n"))
    assert p.message == "mapping keys must be plain scalars"


@pytest.mark.parametrize("text", [b"a: !!python/name:os.system x\n", b"a: !custom x\n"])
def test_unknown_tags_are_a_load_error_not_a_crash(text):
    """An unknown tag once raised yaml's ConstructorError out of load_text (traceback, exit 1)."""
    with pytest.raises(LoadError) as info:
        loader.load_text(text)
    assert info.value.problems[0].position == Position(1, 4)


def test_invalid_yaml_has_a_position():
    p = _only(_load_error(b"a: 1\nb: [1, 2\nc: 3\n"))
    assert p.message.startswith("invalid YAML:")
    assert p.position.line >= 2


def test_tabs_in_indentation_are_invalid_yaml():
    p = _only(_load_error(b"a:\n\tb: 1\n"))
    assert p.position == Position(2, 1)  # the tab itself
    assert p.message.startswith("invalid YAML: found character that cannot start any token")
    p = _only(_load_error(b"a:\n  - x: 1\n\ty: 2\n"))
    assert p.position == Position(3, 1)
    assert p.message.startswith("invalid YAML:")


def test_utf8_bom_is_accepted():
    assert loader.load_text(b"\xef\xbb\xbfa: 1\n").data == {"a": 1}


# ---------------------------------------------------------------------------------------------- encoding


def test_invalid_utf8_reports_line_and_column():
    p = _only(_load_error(b"a: 1\nb: ok\nc: ab\xffcd\n"))
    assert p.position == Position(3, 6)
    assert p.message == "not valid UTF-8 (byte 0xff)"


def test_invalid_utf8_on_the_first_byte():
    p = _only(_load_error(b"\x80a: 1\n"))
    assert p.position == Position(1, 1) and "0x80" in p.message


def test_truncated_multibyte_sequence():
    p = _only(_load_error("a: caf\u00e9".encode()[:-1] + b"\n"))
    assert p.position == Position(1, 7)
    assert "not valid UTF-8" in p.message


def test_utf16_file_is_refused_as_not_utf8():
    p = _only(_load_error("a: 1\n".encode("utf-16")))
    assert "not valid UTF-8" in p.message


# ---------------------------------------------------------------------------------------------- files


def test_directory(tmp_path):
    with pytest.raises(spec.InvalidDesiredState) as info:
        spec.load(tmp_path)
    assert info.value.lines() == [f"{tmp_path}:1:1: is a directory, not a file"]


def test_missing_file(tmp_path):
    missing = tmp_path / "nope.yaml"
    with pytest.raises(spec.InvalidDesiredState) as info:
        spec.load(missing)
    assert info.value.lines() == [f"{missing}:1:1: no such file"]


def test_permission_denied_is_mapped(tmp_path, monkeypatch):
    """Tests run as root in CI, where chmod 000 does not stop reading; simulate the kernel's EACCES instead."""
    target = tmp_path / "secret.yaml"
    target.write_text("a: 1\n")

    def denied(*args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied", str(target))

    monkeypatch.setattr(loader, "open", denied, raising=False)
    with pytest.raises(LoadError) as info:
        loader.load_file(target)
    assert _only(info.value.problems).message == "permission denied"


def test_chmod_000_file_real_behaviour(tmp_path, base_yaml):
    """As root a chmod 000 file is readable (CAP_DAC_OVERRIDE); as anyone else it is `permission denied`."""
    target = tmp_path / "locked.yaml"
    target.write_text(base_yaml)
    target.chmod(0)
    try:
        if os.geteuid() == 0:
            assert spec.load(target).head.name == "head-a"
        else:
            with pytest.raises(spec.InvalidDesiredState) as info:
                spec.load(target)
            assert info.value.lines() == [f"{target}:1:1: permission denied"]
    finally:
        target.chmod(0o600)


def test_other_os_errors_are_mapped(tmp_path):
    loop = tmp_path / "loop.yaml"
    loop.symlink_to(tmp_path / "loop2.yaml")
    (tmp_path / "loop2.yaml").symlink_to(loop)
    with pytest.raises(LoadError) as info:
        loader.load_file(loop)
    message = _only(info.value.problems).message
    assert message == "cannot read: Too many levels of symbolic links"  # the OS's words, not errno and path


def test_load_error_message_joins_problems():
    err = LoadError([Problem(Position(1, 1), "", "one"), Problem(Position(2, 1), "x", "two")])
    assert str(err) == "one; two"


@pytest.mark.parametrize("text", [b"!0\t:", b"!custom key: 1\n", b"a:\n  !!python/name:os.system k: 1\n"])
def test_unknown_tags_on_keys_are_a_load_error_not_a_crash(text):
    """Found by the fuzz test: a tag on a mapping *key* escaped as yaml's ConstructorError (a traceback)."""
    problem = _only(_load_error(text))
    assert "is not allowed in a desired state" in problem.message


def test_date_like_keys_stay_text():
    assert loader.load_text(b"2001-01-01: x\n").data == {"2001-01-01": "x"}


def test_a_stream_larger_than_the_cap_is_refused_without_reading_it_to_the_end(tmp_path):
    """A FIFO (or /dev/zero, or a file still being written) has no size to check first: the loader must stop after
    the cap, not read to an end that may never come. The writer holds the pipe open until the loader is done or a
    deadline passes; a loader that read to the end would only return after the writer gave up."""
    fifo = tmp_path / "endless.yaml"
    os.mkfifo(fifo)
    finished, gave_up = threading.Event(), threading.Event()

    def writer() -> None:
        try:
            with open(fifo, "wb") as out:
                out.write(b"#" * (loader.MAX_BYTES + 100))
                if not finished.wait(timeout=20):
                    gave_up.set()
        except BrokenPipeError:  # the loader closed its end after the cap: what it should do
            pass

    thread = threading.Thread(target=writer, daemon=True)
    thread.start()
    with pytest.raises(loader.LoadError) as info:
        loader.load_file(fifo)
    stopped_early = not gave_up.is_set()
    finished.set()
    thread.join(timeout=30)
    assert stopped_early, "the loader read the stream to its end"
    assert [p.message for p in info.value.problems] == [
        f"file is larger than the {loader.MAX_BYTES}-byte (1 MiB) limit for a desired state"]
