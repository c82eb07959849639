"""What one ssh_session command may make the daemon hold: MAX_OUTPUT. A huge or hostile answer is an error for that
command (its node's ProbeFailed, for the probe); a streamed output (rsync's progress over hours) keeps its tail."""

from __future__ import annotations

import pytest

from reconciler.edge.ssh import OutputTooLarge, Session
from reconciler.edge.ssh import session as ssh_session


def test_a_buffered_output_past_the_cap_is_an_error(monkeypatch):
    monkeypatch.setattr(ssh_session, "MAX_OUTPUT", 1000)
    output = ssh_session._ChannelOutput(Session("worker", None), None, "sh -s")  # type: ignore[arg-type]
    buffer = bytearray()
    output._keep(buffer, b"x" * 1000, streaming=False)
    with pytest.raises(OutputTooLarge, match="wrote more than 1000 bytes"):
        output._keep(buffer, b"y", streaming=False)


def test_a_streamed_output_keeps_its_last_bytes(monkeypatch):
    monkeypatch.setattr(ssh_session, "MAX_OUTPUT", 10)
    output = ssh_session._ChannelOutput(Session("worker", None), None, "rsync")  # type: ignore[arg-type]
    buffer = bytearray()
    for chunk in (b"0123456789", b"abc", b"defgh"):
        output._keep(buffer, chunk, streaming=True)
    assert bytes(buffer) == b"89abcdefgh"


def test_a_buffered_output_of_too_many_lines_is_an_error_under_the_byte_cap():
    """32 MiB of bare newlines fits MAX_OUTPUT, yet parsing it made the daemon peak at 628 MiB (issue 31): past
    MAX_LINES the command is an error before anything parses it."""
    output = ssh_session._ChannelOutput(Session("worker", None), None, "sh -s")  # type: ignore[arg-type]
    buffer = bytearray()
    chunk = b"\n" * (1 << 16)
    with pytest.raises(OutputTooLarge, match=f"more than {ssh_session.MAX_LINES} lines"):
        for _ in range(ssh_session.MAX_LINES // len(chunk) + 2):
            output._keep(buffer, chunk, streaming=False)
    assert len(buffer) < ssh_session.MAX_OUTPUT


def test_parsing_an_output_at_the_line_cap_stays_far_below_the_unit_s_memory():
    """What the cap buys, measured: a probe output of MAX_LINES bare newlines, decoded and split as the probe does,
    allocates well under the unit's MemoryMax=512M (tracemalloc's peak, Python's own allocations)."""
    import tracemalloc

    from reconciler.edge.facts.base import split_sections

    raw = b"@@n containers\n" + b"\n" * (ssh_session.MAX_LINES - 2) + b"@@n rc 0\n"
    tracemalloc.start()
    try:
        sections = split_sections(raw.decode(), "n")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert sections["containers"].body == ""
    assert peak < 64 * 2**20, f"{peak / 2**20:.0f} MiB"  # 1 MiB measured (18 before issue 53); 32 MiB: 616 MiB


def test_splitting_an_output_of_structured_lines_costs_about_its_own_size():
    """Lines with text cost more than bare newlines (issue 53, C): a million 31-byte lines (30 MiB, under both
    caps) became a million strings while the output was split into sections, and peaked at 123 MiB. A section's
    body is now one slice of the output."""
    import tracemalloc

    from reconciler.edge.facts.base import split_sections

    line = "x" * 31
    output = "@@n containers\n" + "\n".join([line] * (ssh_session.MAX_LINES - 2)) + "\n@@n rc 0\n"
    tracemalloc.start()
    try:
        sections = split_sections(output, "n")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert sections["containers"].body.count("\n") == ssh_session.MAX_LINES - 3
    assert peak < 1.25 * len(output), f"{peak / 2**20:.0f} MiB"  # 30.5 MiB measured, the body; before: 123 MiB
