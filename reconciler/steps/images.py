"""Copy the serving image to a node that lacks it: `docker save` on a node that has it, streamed into `docker
load` on the target (through the head for the internet-less worker), then verify the image ids match.
Skipped when the ids already match (the same check eugr's launcher does before every launch)."""

from __future__ import annotations

from reconciler.plan import Step
from reconciler.remote import pipe
from reconciler.steps import StepContext, StepFailed


def image_id(ctx: StepContext, node: str, ref: str) -> str | None:
    result = ctx.sessions[node].run(["docker", "image", "inspect", "--format", "{{.Id}}", ref],
                                    timeout=ctx.command_timeout, check=False)
    return result.stdout.strip() if result.ok else None


def copy_image(ctx: StepContext, step: Step) -> None:
    ref, source, node = step.params["image"], step.params["source"], step.node
    want = image_id(ctx, source, ref)
    if want is None:
        raise StepFailed(f"{ref} is no longer present on {source}")
    if image_id(ctx, node, ref) == want:
        return
    timeout = ctx.remaining(ctx.desired.policy.timeouts.image_sync)
    moved = pipe(ctx.sessions[source], ["docker", "save", ref], ctx.sessions[node], ["docker", "load"],
                 timeout=timeout, progress=lambda done: ctx.progress("image.progress", {"node": node, "bytes": done}))
    got = image_id(ctx, node, ref)
    if got != want:
        raise StepFailed(f"after loading {moved} bytes, {ref} on {node} is {got}, expected {want}")
    ctx.progress("image.done", {"node": node, "bytes": moved, "image_id": want})
