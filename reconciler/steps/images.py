"""Copy the serving image to a node that lacks it: `docker save` on a node that has it, streamed into `docker
load` on the target (through the head for the internet-less worker), then verify the copy's content. Skipped
when the content already matches. Content (layers' diff ids and config), not the id: on Docker's containerd
image store a loaded image's id is not the saved one's (moby#44833; docs/troubleshooting.md "Image ids")."""

from __future__ import annotations

import json

from reconciler.observe import image_from_inspect
from reconciler.observed import Image
from reconciler.plan import Step
from reconciler.remote import pipe
from reconciler.steps import StepContext, StepFailed


def inspect_image(ctx: StepContext, node: str, ref: str) -> Image | None:
    result = ctx.sessions[node].run(["docker", "image", "inspect", ref], timeout=ctx.command_timeout, check=False)
    if not result.ok:
        return None
    try:
        return image_from_inspect(json.loads(result.stdout)[0])
    except (ValueError, LookupError, TypeError) as exc:
        raise StepFailed(f"`docker image inspect {ref}` on {node} printed no image: {exc}") from None


def copy_image(ctx: StepContext, step: Step) -> None:
    ref, source, node = step.params["image"], step.params["source"], step.node
    want = inspect_image(ctx, source, ref)
    if want is None:
        raise StepFailed(f"{ref} is no longer present on {source}")
    pin = ctx.desired.serving.image_id
    if pin and not want.matches_pin(pin):
        raise StepFailed(f"{ref} on {source} is {want.id[:19]}, not the pinned {pin[:19]}: nothing is copied")
    have = inspect_image(ctx, node, ref)
    if have is not None and have.content == want.content:
        return
    timeout = ctx.remaining(ctx.desired.policy.timeouts.image_sync)
    moved = pipe(ctx.sessions[source], ["docker", "save", ref], ctx.sessions[node], ["docker", "load"],
                 timeout=timeout, progress=lambda done: ctx.progress("image.progress", {"node": node, "bytes": done}))
    got = inspect_image(ctx, node, ref)
    if got is None or got.content != want.content:
        raise StepFailed(f"after loading {moved} bytes, {ref} on {node} has content "
                         f"{got.content[:19] if got else 'none'}, expected {want.content[:19]}")
    ctx.progress("image.done", {"node": node, "bytes": moved, "image_id": got.id, "content": want.content})
