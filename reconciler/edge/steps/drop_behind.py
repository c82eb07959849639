"""Bound a weights copy's page cache on both ends, and a download's on the node that downloads:
`drop_behind_helper` runs beside the copy on the source and on the target (beside `hf download` on the model's
source), and drops the tree's pages from the page cache behind it (`policy.weights.drop_behind`, on by
default). Without it a copy fills a GB10's one memory pool with cache beside a serving generation, and the
GPU's driver does not count that cache as free (docs/weights-transport.md "Page cache")."""

from __future__ import annotations

from collections.abc import Generator
from pathlib import Path
from typing import Any

from reconciler.edge.steps.actions import Action, Actions, Given, Report, Start, StepFailed, Stop

_HELPER = Path(__file__).with_name("drop_behind_helper.py").read_text()


def start_bound(given: Given, node: str, root: str, what: str = "the copy") -> Generator[Action, Any, Start | None]:
    """Keep `root`'s files on `node` out of the page cache from now on (None: `policy.weights.drop_behind` is off).
    A helper that cannot start stops `what` (a copy, a download) before its first byte: staging beside a serving
    generation is bounded or not made. Its lifetime is the weights' deadline (the executor also ends it with the
    step). `root` may not exist yet (a download makes it): the helper's passes find nothing until it does."""
    if not given.desired.policy.weights.drop_behind:
        return None
    helper = Start(node, ("python3", "-c", _HELPER, root, str(int(given.desired.policy.timeouts.weights_sync))))
    first = yield helper
    if first != "ready":
        said = yield Stop(helper, "finish")
        raise StepFailed(f"the page-cache bound for {what} could not start on {node} (exit {said.exit_code}): "
                         f"{(said.stderr or first or 'no output').strip()[-400:]}; it needs python3 there "
                         "(or set policy.weights.drop_behind: false)")
    return helper


def end_bound(helper: Start | None) -> Actions:
    """One last pass and the helper's end (after the caller's `sync -f`, the copy's last pages are clean and leave
    too). A helper that ended badly is said, not a failure: the copy is good, only its cache may have grown."""
    if helper is None:
        return
    said = yield Stop(helper, "end")
    if said.exit_code != 0:
        yield Report("weights.drop-behind-ended", {"node": helper.node, "exit": said.exit_code,
                                                   "stderr": said.stderr.strip()[-300:]})
