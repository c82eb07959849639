"""One way to derive a test's desired-state text from a sample: replace each `before` once, and fail loudly when
the sample no longer holds it (a silent no-op edit would test the unedited sample)."""

from __future__ import annotations


def edited(text: str, *subs: tuple[str, str]) -> str:
    for old, new in subs:
        assert old in text, f"test bug: {old!r} not in the base text"
        text = text.replace(old, new, 1)
    return text
