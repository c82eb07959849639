"""The Hub's size of a model revision, asked from the node that downloads it (`hub_size_fact`)."""

from __future__ import annotations

import urllib.parse
from dataclasses import dataclass

from reconciler.edge.facts.base import Fact, Section, node_json
from reconciler.edge.ssh import quote_word


@dataclass(frozen=True)
class HubSize:
    """The Hub's size of a revision (`bytes`), or why it gave none (`problem`, and curl's `exit`)."""

    bytes: int | None
    problem: str = ""
    exit: int = 0


def hub_size(payload: str) -> int:
    """Total bytes of a revision from the Hub's model-info answer (`siblings[].size`). A sibling without a size
    (an answer without `blobs=true`) makes the size unknown: ValueError, and nothing is downloaded."""
    doc = node_json(payload)
    siblings = doc.get("siblings") if isinstance(doc, dict) else None
    if not isinstance(siblings, list) or not siblings:
        raise ValueError("the Hub's answer lists no files")
    sizes = [s.get("size") if isinstance(s, dict) else None for s in siblings]
    counted = [n for n in sizes if isinstance(n, int) and not isinstance(n, bool) and n >= 0]
    if len(counted) != len(sizes):
        raise ValueError("the Hub's answer gives no size for some files")
    return sum(counted)


def parse_hub_size(sec: Section | None) -> HubSize:
    if sec is None:
        return HubSize(None, "no answer", -1)
    if sec.rc != 0:
        return HubSize(None, sec.body.strip()[-300:], sec.rc)
    try:
        return HubSize(hub_size(sec.body))
    except ValueError as exc:  # json's errors are ValueErrors too
        return HubSize(None, str(exc))


def hub_size_fact(model_id: str, revision: str, token: str | None, timeout: float) -> Fact[HubSize]:
    """The Hub's size of `model_id` at `revision` (`GET /api/models/ID/revision/REV?blobs=true`, what
    `HfApi.model_info(files_metadata=True)` asks), asked from the node (HF_ENDPOINT as its owner set it). The
    token, when there is one, is in the script (stdin of `sh -s`) and reaches curl through a builtin's pipe
    (`-H @-`): never an argv."""
    header = f"Authorization: Bearer {token}\n" if token else "Accept: application/json\n"
    path = f"/api/models/{model_id}/revision/{urllib.parse.quote(revision, safe='')}?blobs=true"
    return Fact(f"hub-size {model_id}@{revision}",
                ("sec hub_size",
                 f"printf %s {quote_word(header)} | curl -fsS --max-time {int(timeout)} -H @- "
                 f'"${{HF_ENDPOINT:-https://huggingface.co}}"{quote_word(path)} 2>&1; rc $?'),
                lambda sections: parse_hub_size(sections.get("hub_size")))
