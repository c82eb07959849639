"""Stopping containers. Co-tenants are stopped and never removed (their data and volumes stay). A serving
container is stopped only when this reconciler created it (its managed and instance labels, Container.owned_by,
judged against `core.ownership.owner` of the observation the plan was made from) and it is not protected; it is
removed only when it also bears the configured serving name, to free that name for a re-creation (fixed names +
asynchronous removal is a known source of "name already in use"). Each is read again on the node right before
acting (`facts.containers.container_fact`): the plan may be minutes old.
"""

from __future__ import annotations

from reconciler.core.observed import LABEL_INSTANCE, LABEL_ROLE, Container, Memory
from reconciler.core.planning import Step, kind_and_node
from reconciler.edge.facts.containers import container_fact
from reconciler.edge.facts.memory import MEMORY
from reconciler.edge.steps.actions import (
    Actions,
    Given,
    Read,
    Report,
    Run,
    StepFailed,
    StepTimedOut,
    read,
    run,
    wait,
)

#: How long a stopped container may take to show as stopped, and a removed one as gone, after docker said so.
STOPPED_WITHIN = 15.0
REMOVED_WITHIN = 30.0

#: `docker stop -t` for a headless rank (role worker: rank > 0, no API, no request to drain). On SIGTERM vLLM's
#: headless process shuts its workers down with `shutdown(procs)`, which gives them 5 s and then SIGKILLs them
#: (vllm/v1/utils.py, `timeout = 5.0`), and in an ordered restart they never end sooner: they wait in a collective
#: for rank 0, which is stopping too. Measured on the testbed (real vLLM 0.32.0, TP 2): the worker's stop took
#: 5.5 s against the head's 0.6 s, and every second of it was API outage (bench/downtime.py). Docker's SIGKILL
#: after 1 s ends the same processes vLLM would kill after 5: the API rank keeps the policy's grace.
HEADLESS_STOP_GRACE = 1


def owner_problem(given: Given, node: str, container: Container) -> str | None:
    """Why this reconciler must not stop or replace `container` on `node` as its own serving, if it must not."""
    name, ours = container.name, given.owner
    if given.desired.co_tenants.is_protected(node, name):
        return f"{name} on {node} is protected (co_tenants.protected); never stopped"
    if not container.managed:
        return f"{name} on {node} was not created by the reconciler; it is never stopped or removed"
    if not container.owned_by(ours):
        label = container.labels[LABEL_INSTANCE]
        hint = ours.hint(label)
        return (f"{name} on {node} is not this cluster's (instance {label}, this one is {ours.describe()})"
                + (f": {hint}" if hint else "") + "; never stopped or removed")
    return None


def _stop(given: Given, node: str, name: str, grace: int | None = None) -> Actions:
    """`docker stop` with `grace` (default: the policy's), then the container seen stopped."""
    grace = int(given.desired.policy.timeouts.stop_grace) if grace is None else grace
    yield Run(node, ("docker", "stop", "-t", str(grace), name), timeout=grace + 30)
    yield from wait(Read(node, container_fact(name)), lambda seen: seen is None or not seen.container.running,
                    timeout=STOPPED_WITHIN, what=f"{name} to stop on {node}")


def stop_container(given: Given, step: Step) -> Actions:
    """Stop a co-tenant that is not allowed. Re-checks that the file still disallows it and that it is still
    running and not the reconciler's own (a co-tenant stop never touches a managed container)."""
    name, node = step.container, step.node
    assert name is not None, "the plan sets it for a stop step"
    co_tenants = given.desired.co_tenants
    if co_tenants.is_allowed(node, name) or co_tenants.is_protected(node, name):
        return  # the file changed since the plan: nothing to do
    seen = yield from read(node, container_fact(name))
    if seen is None or not seen.container.running:
        return
    if seen.container.managed:
        raise StepFailed(f"{name} on {node} is managed by the reconciler; co-tenant stop refused")
    yield from _stop(given, node, name)
    # what the generation in force stopped, for the abort to what ran before it (core/restore)
    yield Report("co-tenant.stopped", {"node": node, "container": name, "id": seen.container.id})


#: How long a restored co-tenant waits for the memory the failed ranks held to come back (GB10 returns it with a
#: lag of up to a minute, serving.MEMORY_SETTLE) and how often it looks: it starts once two reads SETTLE_POLL
#: apart differ by less than SETTLED_WITHIN, or at the deadline (it ran in this memory before the generation).
SETTLE_DEADLINE = 90.0
SETTLE_POLL = 2.0
SETTLED_WITHIN = 1 << 30


def start_container(given: Given, step: Step) -> Actions:
    """`docker start` a co-tenant the failed generation stopped (core/restore), re-read right before: only the very
    container it stopped (the same id), not running, not managed. One removed or recreated since is left alone
    (said, not failed). After the node's failed ranks were stopped, the start waits for memory to settle."""
    name, node, wanted = step.container, step.node, step.container_id
    assert name is not None and wanted is not None, "the restore plan sets both for a start-container step"
    seen = yield from read(node, container_fact(name))
    if seen is None or seen.container.id != wanted or seen.container.running:
        yield Report("co-tenant.not-restored", {"node": node, "container": name,
                                                "why": "gone" if seen is None else "running" if
                                                seen.container.running else "replaced since"})
        return
    if seen.container.managed:
        raise StepFailed(f"{name} on {node} is managed by a reconciler; never started as a co-tenant")
    if any(kind_and_node(a) == ("stop-serving", node) for a in step.after):
        yield from _settled(node)
    yield Run(node, ("docker", "start", wanted), timeout=given.desired.policy.timeouts.command + 30)
    yield from wait(Read(node, container_fact(name)), lambda now: now is not None and now.container.running,
                    timeout=STOPPED_WITHIN, what=f"{name} to run on {node}")
    yield Report("co-tenant.restored", {"node": node, "container": name, "id": wanted})


def _settled(node: str) -> Actions:
    """Wait until MemAvailable stops rising (or the deadline): the failed ranks' memory is back."""
    last: list[int] = []

    def steady(memory: Memory | None) -> bool:
        if memory is None:
            return False
        last.append(memory.available_bytes)
        return len(last) > 1 and abs(last[-1] - last[-2]) < SETTLED_WITHIN

    try:
        yield from wait(Read(node, MEMORY), steady, timeout=SETTLE_DEADLINE, interval=SETTLE_POLL,
                        what="memory to settle")
    except StepTimedOut:
        pass  # it ran in this memory before: start it and let docker say


def stop_serving(given: Given, step: Step) -> Actions:
    """Stop one of our serving containers (ordered restart or no longer wanted); remove it only when it bears
    the configured serving name (a container under a former name is stopped and left for the operator)."""
    name, node = step.container, step.node
    assert name is not None, "the plan sets it for a stop step"
    seen = yield from read(node, container_fact(name))
    if seen is None:
        return
    if (problem := owner_problem(given, node, seen.container)) is not None:
        raise StepFailed(problem)
    if seen.container.running:
        headless = seen.container.labels.get(LABEL_ROLE) == "worker"
        graces = (int(given.desired.policy.timeouts.stop_grace), HEADLESS_STOP_GRACE if headless else None,
                  step.grace)  # the plan's own: a wedged generation's
        yield from _stop(given, node, name, min(g for g in graces if g is not None))
    if name != given.desired.serving.container_name:
        return
    yield from run(node, "docker", "rm", name)
    yield from wait(Read(node, container_fact(name)), lambda gone: gone is None, timeout=REMOVED_WITHIN,
                    what=f"{name} to be removed on {node}")
