"""Recorded probe outputs, in the form they are kept: section markers written `@@NAME` and `@@rc N`, as the probe
printed them before its markers were sealed with a per-script nonce (`reconciler.edge.facts.base.sealed`). A recording
is replayed by resealing it with the nonce of the script it answers; a new one is kept by unsealing."""

from __future__ import annotations


def reseal(recorded: str, nonce: str) -> str:
    """A kept recording as the sealed script with `nonce` would have printed it."""
    return "\n".join(f"@@{nonce} {line[2:]}" if line.startswith("@@") else line
                     for line in recorded.split("\n"))


def unseal(output: str, nonce: str) -> str:
    """A sealed output in the kept form."""
    mark = f"@@{nonce} "
    return "\n".join("@@" + line[len(mark):] if line.startswith(mark) else line for line in output.split("\n"))


def nonce_of(script: str) -> str:
    """The nonce a sealed script's first line sets (`SEAL=@@NONCE`)."""
    first = script.split("\n", 1)[0]
    assert first.startswith("SEAL=@@"), first
    return first[len("SEAL=@@"):]


def answer(script: str, kept: str) -> str:
    """What a stand-in node prints for `script`: `kept` sealed with the script's nonce."""
    return reseal(kept, nonce_of(script))
