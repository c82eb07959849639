"""Stopping containers. Co-tenants are stopped and never removed (their data and volumes stay). A serving
container is stopped only when this reconciler created it (its managed and instance labels, Container.owned_by,
judged against `core.ownership.owner` of the observation the plan was made from) and it is not protected; it is
removed only when it also bears the configured serving name, to free that name for a re-creation (fixed names +
asynchronous removal is a known source of "name already in use"). Each is checked again on the node right before
acting: the plan may be minutes old.
"""

from __future__ import annotations

import json

from reconciler.core.observed import LABEL_INSTANCE, Container
from reconciler.core.planning import Step
from reconciler.edge.steps import StepContext, StepFailed, wait_for


def inspect(ctx: StepContext, node: str, name: str) -> dict | None:
    """`docker inspect NAME` as a dict, None when there is no such container."""
    result = ctx.sessions[node].run(["docker", "inspect", "--type", "container", name],
                                    timeout=ctx.command_timeout, check=False)
    if result.exit_code != 0:
        if "No such" in result.stderr or "no such" in result.stderr:
            return None
        raise StepFailed(f"docker inspect {name} on {node} failed: {result.stderr.strip()}")
    return json.loads(result.stdout)[0]


def _labelled(info: dict) -> Container:
    """The labels of `docker inspect NAME` judged by the observed model's own rules (`Container.managed`,
    `owned_by`), so a step and the plan can never disagree on whose a container is."""
    return Container(name=info.get("Name", "").lstrip("/"), id=info.get("Id", ""), image="", state="created",
                     labels=(info.get("Config") or {}).get("Labels") or {})


def is_managed(info: dict) -> bool:
    return _labelled(info).managed


def owner_problem(ctx: StepContext, node: str, name: str, info: dict) -> str | None:
    """Why this reconciler must not stop `name` on `node` as its own serving container, if it must not."""
    container = _labelled(info)
    ours = ctx.owner
    if ctx.desired.co_tenants.is_protected(node, name):
        return f"{name} on {node} is protected (co_tenants.protected); never stopped"
    if not container.managed:
        return f"{name} on {node} was not created by the reconciler; it is never stopped or removed"
    if not container.owned_by(ours):
        label = container.labels[LABEL_INSTANCE]
        hint = ours.hint(label)
        return (f"{name} on {node} is not this cluster's (instance {label}, this one is {ours.describe()})"
                + (f": {hint}" if hint else "") + "; never stopped or removed")
    return None


def _stop(ctx: StepContext, node: str, name: str) -> None:
    grace = int(ctx.desired.policy.timeouts.stop_grace)
    ctx.sessions[node].run(["docker", "stop", "-t", str(grace), name], timeout=ctx.remaining(grace + 30))
    wait_for(lambda: not ((inspect(ctx, node, name) or {}).get("State", {}).get("Running")), timeout=15,
             what=f"{name} to stop on {node}", cancel=ctx.cancel)


def stop_container(ctx: StepContext, step: Step) -> None:
    """Stop a co-tenant that is not allowed. Re-checks that it is still running, unmanaged and not allowed."""
    name, node = step.container, step.node
    assert name is not None, "the plan sets it for a stop step"
    ct = ctx.desired.co_tenants
    if ct.is_allowed(node, name) or ct.is_protected(node, name):
        return  # the file changed since the plan: nothing to do
    info = inspect(ctx, node, name)
    if info is None or not info["State"]["Running"]:
        return
    if is_managed(info):
        raise StepFailed(f"{name} on {node} is managed by the reconciler; co-tenant stop refused")
    _stop(ctx, node, name)


def stop_serving(ctx: StepContext, step: Step) -> None:
    """Stop one of our serving containers (ordered restart or no longer wanted); remove it only when it bears
    the configured serving name (a container under a former name is stopped and left for the operator)."""
    name, node = step.container, step.node
    assert name is not None, "the plan sets it for a stop step"
    info = inspect(ctx, node, name)
    if info is None:
        return
    if (problem := owner_problem(ctx, node, name, info)) is not None:
        raise StepFailed(problem)
    if info["State"]["Running"]:
        _stop(ctx, node, name)
    if name != ctx.desired.serving.container_name:
        return
    ctx.sessions[node].run(["docker", "rm", name], timeout=ctx.command_timeout)
    wait_for(lambda: inspect(ctx, node, name) is None, timeout=30, what=f"{name} to be removed on {node}",
             cancel=ctx.cancel)
