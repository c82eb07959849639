"""Copy the serving image to a node that lacks it: `docker save` on a node that has it, piped over the fabric
(`reconciler.edge.steps.hop`) into `docker load` on the target, then verify the copy's content. Skipped when the
content already matches. Content (layers' diff ids and config), not the id: on Docker's containerd image store a
loaded image's id is not the saved one's (moby#44833; docs/troubleshooting.md "Image ids").

The stream never passes through the reconciler: a 20 GB image once crossed the daemon's process over the 10G
management port (and the worker's hop through the head). It runs on the source as one supervised command
(cancelled with the step, nothing left running on either node), bounded on both nodes, with its bytes counted
by `dd status=progress` for the step's progress.

Its page cache is dockerd's and containerd's (they read and write the image's bytes), so unlike the weights'
copy no drop-behind of ours can bound it: the owner bounds the two units (`MemoryHigh=`, docs/operations.md),
and `reconciler doctor` says where they are not (check `docker-mem`); the copy does not re-read it each time."""

from __future__ import annotations

import re

from reconciler.core.observed import Image
from reconciler.core.planning import Step
from reconciler.edge.facts.images import image_fact
from reconciler.edge.ssh import CommandFailed, Result, bounded, quote
from reconciler.edge.steps import hop, note
from reconciler.edge.steps.actions import Actions, Given, Report, Run, StepFailed, read

# bash for pipefail: a failed `docker save` or `docker load` fails the copy, not only the last stage. dd's report
# goes to stdout (fd 3) where the step reads progress; docker load's own output to stderr.
_COPY = ('set -o pipefail; exec 3>&1; docker save "$1" | LC_ALL=C dd bs=4M status=progress 2>&3 | "${@:2}" >&2')
_DD_BYTES = re.compile(rb"^(\d+) bytes")


class ByteCount:
    """The bytes dd reports, from its output as it arrives: SSH chunks split records anywhere, so only whole
    records (ended by dd's \\r or \\n) count, and the count never goes back."""

    def __init__(self) -> None:
        self.done = 0
        self._tail = b""

    def feed(self, chunk: bytes) -> bool:
        """True when the count grew."""
        *records, self._tail = re.split(rb"[\r\n]", self._tail + chunk)
        seen = [int(m.group(1)) for r in records if (m := _DD_BYTES.match(r.strip()))]
        if not seen or max(seen) <= self.done:
            return False
        self.done = max(seen)
        return True


def archive_estimate(image: Image) -> int | None:
    """The bytes `docker save` will stream, estimated: the image's size as the source's engine reports it (inspect
    `Size`, the unpacked layers). The archive is those layers as tar (a header and padding per file) plus the
    config and the manifest, so it comes out a little larger: measured on the testbed (Docker 20.10, overlay2),
    +1.68% for the real vLLM CPU image (2,318,014,033 B -> 2,357,003,776 B) and +2.42% for the 42 MB stand-in.
    Good for a bar and a time left, shown as an estimate, never checked against. None: the engine did not say."""
    return image.size or None


def copy_argv(given: Given, ref: str, target: str, timeout: float) -> tuple[str, ...]:
    """The source's command: save | count | ssh target 'docker load' (bounded on the target at `timeout`, the
    image copy's own deadline; the whole pipeline is bounded on the source by the step's)."""
    load = quote(bounded(["docker", "load"], timeout))
    return ("bash", "-c", _COPY, "bash", ref, *hop.ssh_options(given.desired, target),
            hop.address(given.desired, target), load)


_LOADED = re.compile(r"^Loaded image: (\S+)\s*$", re.M)


def _familiar(ref: str) -> str:
    """docker's short form of a reference (`docker.io/library/x:1` -> `x:1`), as `docker load` prints it."""
    for prefix in ("docker.io/library/", "docker.io/"):
        if ref.startswith(prefix):
            return ref[len(prefix):]
    return ref


def unexpected_tags(load_output: str, ref: str) -> list[str]:
    """Tags `docker load` reports besides `ref`: an archive from a source must carry only the image asked for
    (extra tags would silently repoint other images on the target)."""
    return [t for t in _LOADED.findall(load_output) if _familiar(t) != _familiar(ref)]


def _source_changed(step: Step, want: Image, pin: str | None) -> str | None:
    """Why the source's image may not be copied now: its content is not the one the plan saw, or its id is not
    the pinned one; None when it may."""
    if step.content and want.content != step.content:
        return (f"{step.image} on {step.source} changed since the plan (content {want.content[:19]}, planned "
                f"{step.content[:19]}): nothing is copied; the next reconcile plans again")
    if pin and not want.matches_pin(pin):
        return f"{step.image} on {step.source} is {want.id[:19]}, not the pinned {pin[:19]}: nothing is copied"
    return None


def _loaded_off_pin(step: Step, want: Image, got: Image, pin: str | None) -> str | None:
    """Why the loaded copy is not the pinned image, where the ids compare (within one store type); else None."""
    if pin and got.store == want.store and not got.matches_pin(pin):
        return f"after loading, {step.image} on {step.node} is {got.id[:19]}, not the pinned {pin[:19]}"
    return None


def copy_image(given: Given, step: Step) -> Actions:
    """The target must end up with the content the plan saw on the image source (the head unless listed
    otherwise); the archive may name no other tag. Checked on the target after the load, not taken from the
    stream's sender. Re-checks first: the source still has it, with the planned content and the pinned id; the
    target does not already hold that content."""
    ref, source, node = step.image, step.source, step.node
    assert ref is not None and source is not None, "the plan sets both for an image step"
    want = yield from read(source, image_fact(ref))
    if want is None:
        raise StepFailed(f"{ref} is no longer present on {source}")
    pin = given.desired.serving.image_id
    if why := _source_changed(step, want, pin):
        raise StepFailed(why)
    have = yield from read(node, image_fact(ref))
    if have is not None and have.content == want.content:
        return
    yield from hop.trust_target_on_source(given.desired, source, node)
    moved = ByteCount()
    total = archive_estimate(want)
    yield Report("image.start", {"node": node, "source": source, "bytes_done": 0, "bytes_total": total})

    def seen(chunk: bytes) -> Report | None:
        if not moved.feed(chunk):
            return None
        return Report("image.progress", {"node": node, "bytes_done": moved.done, "bytes_total": total})

    timeout = given.desired.policy.timeouts.image_sync
    try:
        copied: Result = yield Run(source, copy_argv(given, ref, node, timeout), timeout=timeout, long=True,
                                   on_output=seen)
    except CommandFailed as exc:
        raise StepFailed(f"copying {ref} {source} -> {node} over the fabric failed (exit {exc.exit_code}) "
                         f"after {moved.done} bytes: {exc.stderr.strip()[-600:]}") from None
    if extra := unexpected_tags(copied.stderr, ref):
        raise StepFailed(f"the archive from {source} also loaded {', '.join(extra)} on {node}: only {ref} was "
                         "asked for; check the source (docs/security.md \"Images\")")
    got = yield from read(node, image_fact(ref))
    if got is None or got.content != want.content:
        raise StepFailed(f"after loading {moved.done} bytes, {ref} on {node} has content "
                         f"{got.content[:19] if got else 'none'}, expected {want.content[:19]}")
    if why := _loaded_off_pin(step, want, got, pin):
        raise StepFailed(why)
    yield Report("image.done", {"node": node, "bytes_done": moved.done, "bytes_total": total, "image_id": got.id,
                                "content": want.content})
    yield from note(given, node, ("copied", "image", want.content, got.id))
