"""Bound a weights copy's page cache on both ends: `drop_behind_helper` runs beside the copy on the source and
on the target, and drops the tree's pages from the page cache behind the copy (`policy.weights.drop_behind`,
on by default). Without it a copy fills a GB10's one memory pool with cache beside a serving generation, and the
GPU's driver does not count that cache as free (docs/weights-transport.md "Page cache")."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

from reconciler.edge.steps import StepContext, StepFailed

_HELPER = Path(__file__).with_name("drop_behind_helper.py").read_text()


@contextlib.contextmanager
def drop_behind(ctx: StepContext, node: str, root: str) -> Iterator[None]:
    """While the block runs, keep `root`'s files on `node` out of the page cache; on leaving it, one last pass
    (after the caller's `sync -f`, the copy's last pages are clean and leave too). A helper that cannot start
    stops the copy before its first byte: a copy beside a serving generation is bounded or not made."""
    if not ctx.desired.policy.weights.drop_behind:
        yield
        return
    argv = ["python3", "-c", _HELPER, root, str(int(ctx.remaining()))]
    with ctx.sessions[node].companion(argv, timeout=ctx.remaining(), stdin=b"",
                                      open_timeout=ctx.command_timeout) as helper:
        first = helper.line(ctx.command_timeout)
        if first != "ready":
            said = helper.finish(ctx.command_timeout)
            raise StepFailed(f"the page-cache bound for the copy could not start on {node} (exit {said.exit_code}): "
                             f"{(said.stderr or first or 'no output').strip()[-400:]}; it needs python3 there "
                             "(or set policy.weights.drop_behind: false)")
        yield
        said = helper.end(ctx.command_timeout)
        if said.exit_code != 0:  # the copy is good; only its cache may have grown: said, not failed
            ctx.progress("weights.drop-behind-ended", {"node": node, "exit": said.exit_code,
                                                      "stderr": said.stderr.strip()[-300:]})
