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
