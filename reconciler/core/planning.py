"""drift -> an ordered list of steps. Pure: the same desired and observed state always give the same plan.

The order encodes what the seed story learned by hand: free memory and bring the fabric up first; the weights and
the image must be on every node before serving starts; a serving change stops serving everywhere, then starts the
workers (headless) and the head last (Ray: the head's GCS first, then the workers, then `vllm serve` on the head),
then waits for /health. Steps carry stable ids so logs, metrics and holds can name them across reconciles.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import NamedTuple

from reconciler.core.drift import UNUSABLE_KINDS, Drift, FieldChange, diff, image_holder
from reconciler.core.kinds import ENGINE_STARTS, FETCHES, NODE_STEPS, STAGING, StepKind
from reconciler.core.listeners import ANY, takes
from reconciler.core.observed import Container, NodeObservation, Observed, ServeFlags
from reconciler.core.ownership import owner
from reconciler.core.retention import removals
from reconciler.core.spec import Desired
from reconciler.core.vllm import LaunchSpec, extra_flags, launch_specs, serve_argvs, serve_wrapper, unknown_flags


@dataclass(frozen=True)
class Step:
    """One action on one node. What the action needs beyond its kind and node is a typed field of its own (the
    container to stop, the node to copy from, the rank to start); `params` is their view in `plan --json` and
    /status, where every value is a string (docs/cli.md). The id is made of the fields, never stored beside them,
    so the two cannot disagree."""

    kind: StepKind
    node: str
    reason: str
    after: tuple[str, ...] = ()
    container: str | None = None  # stop-container, stop-serving
    source: str | None = None  # image, weights: the node copied from
    image: str | None = None  # image: the reference copied
    content: str | None = None  # image: the content id the copy must have
    path: str | None = None  # weights: where the tree goes on the target
    rank: int | None = None  # start-serving: the node's rank in the tensor-parallel group
    wrapper: tuple[str, ...] | None = None  # launch-model: the image's Entrypoint that `vllm serve` runs under
    remove: tuple[str, ...] | None = None  # prune-weights: tree roots; prune-images: content ids (retention)
    deployment: str | None = None  # whose step, in a file of several (None: the node's own, or a file of one)
    grace: int | None = None  # stop-serving: `docker stop -t` (None: the policy's stop_grace; a headless rank 1 s)
    container_id: str | None = None  # start-container: the container the reconciler stopped (core/restore)

    @property
    def id(self) -> str:
        """`KIND/NODE[/CONTAINER][/@DEPLOYMENT]`: stable across reconciles, so logs, metrics, holds and /status
        name a step the same way every time (docs/cli.md)."""
        return "/".join([self.kind, self.node, *([self.container] if self.container else []),
                         *([f"@{self.deployment}"] if self.deployment else [])])

    @property
    def params(self) -> dict[str, str]:
        fields: dict[str, str | int | tuple[str, ...] | None] = {
            "container": self.container, "source": self.source, "image": self.image, "content": self.content,
            "path": self.path, "rank": self.rank, "wrapper": self.wrapper, "remove": self.remove,
            "grace": self.grace, "container_id": self.container_id}
        return {name: " ".join(value) if isinstance(value, tuple) else str(value)
                for name, value in fields.items() if value is not None}

    def as_dict(self) -> dict[str, object]:
        return {"id": self.id, "kind": self.kind, "node": self.node, "reason": self.reason,
                "after": list(self.after), "params": self.params,
                **({"deployment": self.deployment} if self.deployment else {})}



def kind_and_node(step_id: str) -> tuple[str, str]:
    """The kind and node a `Step.id` names: for what outlives the plan and is kept by id alone (the holds across
    reconciles). The id's format is made in `Step.id` and read only here."""
    kind, node = step_id.split("/")[:2]
    return kind, node


@dataclass(frozen=True)
class Blocker:
    node: str
    reason: str


@dataclass(frozen=True)
class Downtime:
    """What a plan that stops running serving costs: the API is down from the first stop until the new generation
    answers, about one cold start, at most serving.health_timeout (the `await-health` deadline). Said up front,
    as a restart of serving is an outage, not a change in place."""

    nodes: tuple[str, ...]  # where serving that runs is stopped
    #: The ranks that restart though nothing of their own changed: a tensor-parallel group starts as a whole.
    restart_with: tuple[str, ...]
    health_timeout: float

    def as_dict(self) -> dict[str, object]:
        return {"nodes": list(self.nodes), "restart_with": list(self.restart_with),
                "health_timeout_seconds": self.health_timeout}


@dataclass(frozen=True)
class Plan:
    drift: list[Drift]
    steps: list[Step]
    blocked: list[Blocker]
    mode: str = "enforce"
    trusted: tuple[str, ...] = ()  # the file's `trust` opt-ins in words: shown with every plan (docs/security.md)
    ulimits: tuple[str, ...] = ()  # the serving containers' effective `--ulimit`s: shown with every start
    downtime: Downtime | None = None  # the steps stop serving that runs
    #: Why the image refuses the file's start, by its own answer (a flag its `vllm serve` does not know, no Ray):
    #: a change that cannot serve, which policy.on_failed_change may roll back (reconciler.loop.history).
    refused: tuple[str, ...] = ()

    @property
    def field_changes(self) -> list[tuple[str, FieldChange]]:
        """Per node, the launch fields that force its serving to restart (`Drift.changes`)."""
        return [(d.node, c) for d in self.drift for c in d.changes]

    @property
    def changes(self) -> bool:
        """True while the cluster differs from the file in a way that needs action (by us or, when blocking, by
        the operator). Report-only drift (co-tenants under `unlisted: report`, no carrier) does not count."""
        return any(d.actionable or d.blocking for d in self.drift) or bool(self.steps)

    def as_dict(self) -> dict[str, object]:
        return {"changes": self.changes, "mode": self.mode, "drift": [d.as_dict() for d in self.drift],
                "steps": [s.as_dict() for s in self.steps],
                "blocked": [{"node": b.node, "reason": b.reason} for b in self.blocked],
                "trusted": list(self.trusted), "ulimits": list(self.ulimits),
                "field_changes": [c.as_dict(node) for node, c in self.field_changes],
                "downtime": self.downtime.as_dict() if self.downtime else None, "refused": list(self.refused)}


#: The grace before a restart for health doubles per restart that did not hold, up to 2**4 = 16x.
MAX_GRACE_DOUBLINGS = 4


def health_grace(grace: float, restarts: int) -> float:
    """The one grace formula: `grace` (serving.unhealthy_grace) doubled per restart for health that did not
    hold, up to 16x. The plan waits this long before a restart; the health watch forgets the restarts once
    serving has served for the longest of them."""
    return grace * (1 << min(max(restarts, 0), MAX_GRACE_DOUBLINGS))


def _explain(d: Drift) -> str:
    return f"{d.resource}: expected {d.expected}, observed {d.observed}"


def plan(desired: Desired, observed: Observed) -> Plan:
    """The plan from `observed`; a node it lacks (a snapshot from before the file named it) did not answer.

    One pass per concern, in the order the steps run (docs/architecture.md, "Step order"): the co-tenant stops and
    the links, retention's removals, the image and the weights (or their fetch from the internet), then serving."""
    observed = observed.covering(n.name for n in desired.nodes)
    if len(desired.deployments) > 1:
        return _plan_several(desired, observed)
    drift = diff(desired, observed)
    mode = _mode(desired)
    if mode != "enforce":
        return Plan(drift, [], [], mode, tuple(desired.trust.granted()))
    down = _down(drift)
    stops = _co_tenant_stops(drift)
    links = _link_steps(drift)
    link_ids = {s.node: s.id for s in links}
    holder = image_holder(desired, observed)
    reference = observed.node(holder).images[desired.serving.image].content if holder else None
    prunes = [] if desired.is_part else _prune_steps(desired, observed, reference)  # see _plan_several
    prune_ids = {node: tuple(s.id for s in prunes if s.node == node) for node in dict.fromkeys(s.node for s in prunes)}
    steps = [*stops, *links, *prunes, *_image_steps(desired, observed, drift, holder, link_ids, prune_ids),
             *_weights_steps(desired, drift, link_ids, prune_ids)]
    serving = _serving_steps(desired, observed, drift, steps, down)
    steps, held = _hold_or_order_stops(steps, stops, serving, _running_ours(desired, observed))
    ulimits = tuple(f"{k}={v}" for k, v in desired.serving.docker.effective_ulimits.items())
    return Plan(drift, steps, [*serving.blocked, *held], mode, tuple(desired.trust.granted()), ulimits,
                _downtime(desired, observed, drift, steps), (serving.refused,) if serving.refused else ())


def _down(drift: list[Drift]) -> set[str]:
    """The nodes the plan cannot work on (unreachable, docker not answering)."""
    return {d.node for d in drift if d.kind in UNUSABLE_KINDS}


def _mode(desired: Desired) -> str:
    """What the file lets the plan do: `enforce` plans steps; `observe` and `paused` only the drift."""
    return "paused" if desired.policy.paused else desired.policy.mode


def _co_tenant_stops(drift: list[Drift]) -> list[Step]:
    return [Step("stop-container", d.node, f"{d.container} is running but not allowed", container=d.container)
            for d in drift if d.kind == "co-tenant" and d.actionable]


def _link_steps(drift: list[Drift]) -> list[Step]:
    """One link step per node whose fabric (link or RDMA port) drifted, its reasons all said."""
    faulty = [d for d in drift if d.kind in ("link", "rdma")]
    return [Step("link", name, "; ".join(_explain(d) for d in faulty if d.node == name))
            for name in dict.fromkeys(d.node for d in faulty if d.actionable)]


def _image_steps(desired: Desired, observed: Observed, drift: list[Drift], holder: str | None,
                 link_ids: dict[str, str], prune_ids: dict[str, tuple[str, ...]]) -> list[Step]:
    """The image to every node that lacks it: copied from `holder` over the fabric (after the links at both ends
    and the target's removals), or, when no source holds it, pulled by the internet node."""
    image, steps = desired.serving.image, []
    for d in (d for d in drift if d.kind == "image" and d.actionable):
        if holder is None:
            steps.append(Step("pull-image", d.node, _explain(d), image=image))
            continue
        after = tuple(link_ids[n] for n in (holder, d.node) if n in link_ids)  # it goes over the fabric
        after += prune_ids.get(d.node, ())  # room first
        expect = observed.node(holder).images[image].content  # what the target must end up with, whatever it loads
        steps.append(Step("image", d.node, _explain(d), after, source=holder, image=image, content=expect))
    return steps


def _weights_steps(desired: Desired, drift: list[Drift], link_ids: dict[str, str],
                   prune_ids: dict[str, tuple[str, ...]]) -> list[Step]:
    """The weights to every node that lacks them, from the source over the fabric; the source itself downloads
    them from the Hub first."""
    source, steps = desired.source_node, []
    for d in (d for d in drift if d.kind == "weights" and d.actionable):
        if d.node == source:
            steps.append(Step("download", source, _explain(d), prune_ids.get(source, ()),
                              path=desired.model.path_on(source)))
            continue
        after = tuple(link_ids[n] for n in (source, d.node) if n in link_ids) + prune_ids.get(d.node, ())
        steps.append(Step("weights", d.node, _explain(d), after, source=source, path=desired.model.path_on(d.node)))
    return steps


def _downtime(desired: Desired, observed: Observed, drift: list[Drift], steps: list[Step]) -> Downtime | None:
    """The outage the steps cause, when they stop a running serving container (an ordered restart stops every
    rank, whatever changed on which: planning restarts the tensor-parallel group as a whole)."""
    stopping = _stops_running_serving(desired, observed, steps)
    if not stopping:
        return None
    name = desired.serving.container_name
    own = {d.node for d in drift if d.kind == "serving" and d.container == name}
    started = {s.node for s in steps if s.kind == "start-serving"}
    with_them = tuple(n.name for n in desired.serving_nodes if n.name in started and n.name not in own)
    return Downtime(stopping, with_them if own else (), desired.serving.health_timeout)


def _stops_running_serving(desired: Desired, observed: Observed, steps: list[Step]) -> tuple[str, ...]:
    """The nodes where the steps stop our serving container while it runs."""
    name = desired.serving.container_name
    return tuple(s.node for s in steps if s.kind == "stop-serving" and s.container == name
                 and (c := observed.node(s.node).container(name)) is not None and c.running)


def _running_ours(desired: Desired, observed: Observed) -> bool:
    """Some serving container of this cluster runs now (a generation that serves, or is starting)."""
    cluster = owner(desired, observed)
    return any(c.running and c.owned_by(cluster) for n in desired.serving_nodes
               for c in observed.node(n.name).containers)


def _hold_or_order_stops(steps: list[Step], stops: list[Step], serving: Serving,
                         ours_running: bool) -> tuple[list[Step], list[Blocker]]:
    """The co-tenant stops, judged against the start they make room for. A start that is blocked keeps them
    running (a plan never stops a working model for a start that cannot happen: the seed's GLM kept serving
    while nothing could replace it). A start from nothing of ours stops them only once the staging is done,
    so they serve through the downloads and copies (hours, for a 122B model). With a generation of ours
    running, or no start planned, a stop goes ahead at once: the co-tenant competes with what serves for
    unified memory (a GB10 rank dies with NV_ERR_NO_MEMORY when the pool runs short), and the file's
    allow-list is at work. Returns the steps in order and the stops held back, as blockers."""
    rest = [s for s in steps if s not in stops]
    then = list(serving.steps)
    if serving.held is not None:
        return rest + then, [Blocker(s.node, f"{s.container} keeps running, though not allowed: the serving start "
                                             f"that stopping it makes room for is blocked ({serving.held})")
                             for s in stops]
    if ours_running or not any(s.kind in ENGINE_STARTS for s in then):
        return steps + then, []
    staging = tuple(s.id for s in rest if s.kind in STAGING)
    if not staging:
        return steps + then, []
    return rest + [dataclasses.replace(s, after=staging) for s in stops] + then, []


def _prune_steps(desired: Desired, observed: Observed, reference: str | None) -> list[Step]:
    """Retention's removals as steps (core/retention.py), shown in the plan like any change; a copy to the same
    node comes after them, so the room they free is there for it."""
    steps: list[Step] = []
    ours = owner(desired, observed)
    if not ours.identity:
        return []  # whose a copy is cannot be told without the head's cluster id: nothing is removed
    for r in removals(desired, observed, ours, reference):
        if r.weights:
            steps.append(Step("prune-weights", r.node, f"retention: {len(r.weights)} older model tree(s) this "
                              f"cluster copied, beyond the current and {desired.policy.retention.previous} "
                              "previous", remove=r.weights))
        if r.images:
            steps.append(Step("prune-images", r.node, f"retention: {len(r.images)} older image(s) this cluster "
                              f"copied, beyond the current and {desired.policy.retention.previous} previous",
                              remove=r.images))
    return steps


@dataclass(frozen=True)
class Serving:
    """The serving part of a plan: its steps (the ordered (re)start and the stops it needs, or the wait for a
    start), what blocks it, and `held`: why a restart that is wanted cannot happen now (the image refuses it, or
    it waits for other drift), which holds the co-tenant stops back too."""

    steps: tuple[Step, ...] = ()
    blocked: tuple[Blocker, ...] = ()
    held: str | None = None
    refused: str | None = None  # the image's own answer refuses this start (`Refusal.final`)


def _serving_steps(desired: Desired, observed: Observed, drift: list[Drift], before: list[Step],
                   down: set[str]) -> Serving:
    """The ordered (re)start of serving and the stops it needs (`Serving`): our stale containers' stops, then
    why serving restarts (`_why_restart`), what holds the restart back (`_restart_held`), or the restart."""
    serving = [n.name for n in desired.serving_nodes]
    name = desired.serving.container_name
    restart = [d for d in drift if d.kind == "serving" and d.actionable and d.node in serving
               and d.container == name]
    stops = _Stops(down)
    for d in drift:
        if d.kind == "serving" and d.actionable and d not in restart:
            assert d.container is not None, "a serving drift that is not a container's is never actionable"
            stops.add(d.node, d.container, _explain(d), ())
    why = _why_restart(desired, observed, drift, restart, down)
    if why.reason is None:
        return Serving((*stops.steps, *why.steps), why.blocked)
    if (held := _restart_held(desired, observed, drift, before)) is not None:
        return dataclasses.replace(held, steps=tuple(stops.steps))
    return Serving(tuple(_ordered_restart(desired, observed, why, before, stops)))


@dataclass
class _Stops:
    """The serving stops of a plan, each once (the first reason wins), none on a node that cannot be reached."""

    down: set[str]
    steps: list[Step] = dataclasses.field(default_factory=list)

    def add(self, node: str, container: str, reason: str, after: tuple[str, ...], grace: int | None = None) -> None:
        step = Step("stop-serving", node, reason, after, container=container, grace=grace)
        if node not in self.down and all(s.id != step.id for s in self.steps):
            self.steps.append(step)


def _restart_held(desired: Desired, observed: Observed, drift: list[Drift], before: list[Step]) -> Serving | None:
    """Why a restart that is wanted cannot happen now (as a `Serving` without steps), or None: it goes ahead. The
    image refuses it, it waits for other drift or for a fetch from the internet (its result is planned next pass),
    or a port it needs is taken."""
    serving = [n.name for n in desired.serving_nodes]
    head = serving[0]
    if alien := _image_refuses(desired, observed):
        held = "the image refuses the start" if alien.final else "it waits for the serving image's answer"
        return Serving((), (Blocker(head, alien.reason),), f"{held}: see the blocker on {head}",
                       alien.reason if alien.final else None)
    hurdles = list(dict.fromkeys(_restart_hurdles(drift, serving)))
    fetches = [s for s in before if s.kind in FETCHES]
    if hurdles or fetches:
        waits = [f"{d.kind} on {d.node}" for d in hurdles] + [s.id for s in fetches]
        return Serving((), (
            *(Blocker(d.node, f"serving restart waits for {d.kind} on {d.node}: {_explain(d)}") for d in hurdles),
            *(Blocker(s.node, f"serving restart waits for {s.id}: the copies and the start are planned once it is "
                              "done") for s in fetches)), f"it waits for {', '.join(dict.fromkeys(waits))}")
    if taken := _ports_taken(desired, observed, before):
        return Serving((), tuple(taken))  # a co-tenant this plan stops may hold the port: it goes ahead
    return None


def _ordered_restart(desired: Desired, observed: Observed, why: Restart, before: list[Step],
                     stops: _Stops) -> list[Step]:
    """Stop our serving containers after everything else, then start the group in order (`_start_steps`)."""
    serving = [n.name for n in desired.serving_nodes]
    name = desired.serving.container_name
    prereq = tuple(s.id for s in before)
    ours = owner(desired, observed)
    for node in serving:
        c = observed.node(node).container(name)
        if c is not None and c.owned_by(ours):
            stops.add(node, name, f"ordered restart ({why.reason})", prereq, WEDGED_STOP_GRACE if why.wedged else None)
    image = observed.node(serving[0]).images.get(desired.serving.image)
    wrapper = serve_wrapper(image.entrypoint) if image else ()
    return stops.steps + _start_steps(desired.serving.launcher, serving, prereq + tuple(s.id for s in stops.steps),
                                      wrapper)


@dataclass(frozen=True)
class Restart:
    """Whether serving restarts in order, and why (`reason`); when it does not, what the plan does instead: the
    wait for a (cold) start (`steps`) or why nothing happens (`blocked`)."""

    reason: str | None = None
    steps: tuple[Step, ...] = ()
    blocked: tuple[Blocker, ...] = ()
    wedged: bool = False  # it served, then failed its health check for the whole grace: nothing left to drain


#: `docker stop -t` for a generation restarted because it is wedged: it has not answered its health check for the
#: whole `serving.unhealthy_grace`, so there is nothing left to drain, and a frozen process (a hung collective, a
#: SIGSTOP) never acts on SIGTERM: the policy's stop_grace (30 s) would be 30 s more of outage before docker's
#: SIGKILL (measured on the testbed: the wedge round of bench/downtime.py took grace + cold start + 28 s).
WEDGED_STOP_GRACE = 1


def _why_restart(desired: Desired, observed: Observed, drift: list[Drift], restart: list[Drift],
                 down: set[str]) -> Restart:
    """Why serving restarts in order: its containers drifted, or it served and has failed its health check for
    the whole grace. Else no reason, with the wait for a (cold) start or why nothing happens."""
    head = desired.serving_nodes[0].name
    if restart:
        return Restart("; ".join(f"{d.node}: {_explain(d)}" for d in restart))
    unhealthy = next((d for d in drift if d.kind == "health"), None)
    if unhealthy is None:
        return Restart()
    if unseen := [n.name for n in desired.serving_nodes if n.name in down]:
        # waiting for health needs every serving node; say why instead of failing a step
        return Restart(blocked=(Blocker(head, f"serving is not healthy; waiting needs {', '.join(unseen)}, "
                                              "which cannot be reached"),))
    wedged = _wedged_for(desired, observed)
    if wedged is None:  # a (cold) start: wait for it, under serving.health_timeout
        return Restart(steps=(Step("await-health", head,
                                   "serving containers are up; wait for the API to become healthy"),))
    if not wedged:
        return Restart(blocked=(Blocker(head, _grace_note(desired, observed)),))
    return Restart(f"{head}: {_explain(unhealthy)}; {_grace_note(desired, observed)}", wedged=True)


def unhealthy_grace(desired: Desired, observed: Observed) -> float:
    """The grace before a restart for health: serving.unhealthy_grace, doubled per restart that did not hold."""
    health = observed.node(desired.api_node.name).serving
    return health_grace(desired.serving.unhealthy_grace, health.health_restarts if health else 0)


def _wedged_for(desired: Desired, observed: Observed) -> bool | None:
    """None: serving has not served since its start (a cold start: wait). False: it served and fails, within the
    grace (wait without a step). True: it served and has failed for the whole grace: restart in order."""
    health = observed.node(desired.api_node.name).serving
    if health is None or not health.served_before:
        return None
    return (health.unhealthy_for or 0.0) >= unhealthy_grace(desired, observed)


def _grace_note(desired: Desired, observed: Observed) -> str:
    health = observed.node(desired.api_node.name).serving
    failing = health.unhealthy_for if health and health.unhealthy_for is not None else 0.0
    return (f"serving served, then failed its health check for {failing:.0f}s; restarted in order after "
            f"{unhealthy_grace(desired, observed):.0f}s")


#: vLLM's own multi-node flags, which the native launcher renders: they arrived with vllm-project/vllm PR #23691,
#: after NVIDIA's 25.09 (vLLM 0.10.1.1) and 25.10 (0.10.2) images were built (spark-arena/sparkrun#287).
NATIVE_MULTI_NODE_FLAGS = ("--nnodes", "--node-rank", "--master-addr", "--master-port", "--headless")


class Refusal(NamedTuple):
    """Why the image refuses a start (`_image_refuses`); `final`: its own answer, not a wait for one."""

    reason: str
    final: bool = False


def _image_refuses(desired: Desired, observed: Observed) -> Refusal | None:
    """Why serving must not (re)start on this image, as the image itself says (asked once per image id): a flag
    of any `vllm serve` argv the start would run (the reconciler's own, extra_args) that its `vllm serve` does not
    know, `launcher: ray` on an image without Ray (NVIDIA's 26.05-py3 ships without it, and the offline worker
    cannot pip-install it), or no answer at all. Every rank would exit at once; saying so before anything is
    stopped keeps the running generation serving. Fail closed (issue 29): an answer still pending, about another
    image id, or that could not be had refuses too. No answer at all (`serve_flags` None) is only an offline
    snapshot's: `observe` asks whenever a restart is planned, and the daemon asks every image id it sees.
    `final`: the image's own answer refuses (not a wait for one, nor a failure to ask): a failed change, which
    policy.on_failed_change may roll back."""
    holder = image_holder(desired, observed)
    image = observed.node(holder).images.get(desired.serving.image) if holder else None
    if holder is None or image is None:
        return None  # no node holds the image: its own drift blocks the restart and says what to do
    flags = observed.serve_flags
    named = f"{desired.serving.image} ({image.id[:19]})"
    if flags is None:
        return None  # not asked: only a snapshot without an answer (the daemon and the commands always ask first)
    return _no_answer(desired, flags, image.id, holder, named) or _unknown_flags(desired, flags, named)


def _no_answer(desired: Desired, flags: ServeFlags, image_id: str, holder: str, named: str) -> Refusal | None:
    """The image's answer is not at hand (about another id, pending, failed) or says it has no Ray."""
    if flags.image_id != image_id:
        return Refusal(f"serving waits for {named} to say which flags its `vllm serve` knows: the answer at "
                       f"hand is about {flags.image_id[:19]}; nothing is stopped")
    if flags.pending:
        return Refusal(f"serving waits for {named} to say which flags its `vllm serve` knows and whether it has "
                       "Ray (asked once per image id), to judge it before anything stops")
    if flags.error:
        return Refusal(f"{named} could not be asked on {holder} which flags its `vllm serve` knows: {flags.error}. "
                "Nothing is stopped or started; it is asked again with backoff. See why with `docker run --rm "
                f"--entrypoint sh {desired.serving.image} -c 'vllm serve --help=all'` on {holder} (`exec format "
                "error`: an image for another platform)")  # asked again: not final
    if desired.serving.launcher == "ray" and flags.has_ray is False:
        return Refusal(f"serving.launcher is ray, but {named} has no `ray` command (NVIDIA's vLLM 26.05-py3 ships "
                "without Ray, and the offline worker cannot install it): use launcher: native, or an image "
                "with Ray; nothing is stopped or started", final=True)
    return None


def _unknown_flags(desired: Desired, flags: ServeFlags, named: str) -> Refusal | None:
    """The flags of the start's `vllm serve` argvs the image does not know: the launcher's own, or extra_args."""
    unknown = list(dict.fromkeys(f for argv in serve_argvs(desired) for f in unknown_flags(list(argv), flags.flags)))
    if not unknown:
        return None
    version = f"vLLM {flags.version}" if flags.version else "vLLM of an unknown version"
    extra = set(extra_flags(desired.serving.extra_args))
    own, theirs = [f for f in unknown if f not in extra], [f for f in unknown if f in extra]
    if own:
        hint = (" vLLM's native multi-node arrived with vllm-project/vllm PR #23691, after NVIDIA's 25.09 and 25.10 "
                "images: use a newer image, or launcher: ray." if set(own) & set(NATIVE_MULTI_NODE_FLAGS) else "")
        launcher = desired.serving.launcher
        return Refusal(f"`vllm serve` in {named}, {version}, does not know {', '.join(own)}, which the {launcher} "
                "launcher passes; every rank would exit with 'unrecognized arguments'." + hint +
                " Nothing is stopped or started", final=True)
    verb = "is not a flag" if len(theirs) == 1 else "are not flags"
    return Refusal(f"serving.extra_args: {', '.join(theirs)} {verb} of `vllm serve` in {named}, {version}; nothing "
                   "is stopped or started", final=True)


def _ports_taken(desired: Desired, observed: Observed, before: list[Step]) -> list[Blocker]:
    """The fixed ports a start needs (`LaunchSpec.listens`) that something else listens on: vLLM would exit
    with "Address already in use" (the API) or never rendezvous (torch's TCPStore, Ray's GCS). A listener is
    ours when one of this cluster's running containers on the node was started for that port (its ports
    label; one from before the label is taken to hold what its node needs now). A co-tenant this plan stops
    may be the holder, but nothing says so (/proc/net/tcp names no process the SSH user may see): with nothing
    of ours serving, the start goes on after the stop (the seed's GLM on :8000); with a generation to keep,
    the restart waits for the stop to land and judges again. Only a listener in the way counts (`_in_the_way`):
    on `[::1]` or `127.0.0.2`, beside a serving.host of `127.0.0.1`, a local user holds no start (issue 53, B)."""
    cluster = owner(desired, observed)
    running = {n.name: [c for c in observed.node(n.name).containers if c.running and c.owned_by(cluster)]
               for n in desired.serving_nodes}
    serving_now = _running_ours(desired, observed)
    out = []
    for spec in launch_specs(desired):
        taken = _taken(desired, observed.node(spec.node), spec, running[spec.node])
        freeing = [s.id for s in before if s.kind == "stop-container" and s.node == spec.node]
        if taken and not (freeing and not serving_now):
            out.append(_port_blocker(spec.node, taken, freeing))
    return out


def _taken(desired: Desired, node: NodeObservation, spec: LaunchSpec,
           running: list[Container]) -> list[tuple[str, int]]:
    """The (field, port)s of `spec` that something not ours listens on in the way on `node`."""
    if node.listening is None or not spec.listens:
        return []  # not read: only a snapshot from before the probe read it
    ours = set().union(*({p for _, p in spec.listens} if c.held_ports is None else c.held_ports for c in running))
    return [(field, port) for field, port in spec.listens if port not in ours and _in_the_way(
        node, port, desired.serving.host if field == "serving.port" else ANY)]


def _port_blocker(node: str, taken: list[tuple[str, int]], freeing: list[str]) -> Blocker:
    held = ", ".join(f"{port} ({field})" for field, port in taken)
    then = (f"; judged again once {', '.join(freeing)} has run (it may hold it)" if freeing else
            "; nothing is stopped or started")
    return Blocker(node, f"port {held} on {node} is held by a process the reconciler did not start, and rank 0 "
                         f"must listen there: free it (`sudo ss -ltnp 'sport = :{taken[0][1]}'` shows who holds it) "
                         f"or choose another port{then}")


def _in_the_way(node: NodeObservation, port: int, host: str) -> bool:
    """Something listens on `port` where a bind of `host` there would meet it (`core.listeners.takes`; `ANY` for
    what binds every address: torch's TCPStore, Ray's GCS). A port whose addresses were not read (an older
    snapshot, a row that did not read) is in the way, as every listener was before."""
    if port not in (node.listening or []):
        return False
    addresses = (node.listen_addresses or {}).get(port)
    return not addresses or any(takes(address, host) for address in addresses)


def _restart_hurdles(drift: list[Drift], serving: list[str]) -> list[Drift]:
    """What a serving restart must wait for: blocking drift on a serving node, or of the weights or the image,
    wherever it is: their reference may live on a node that does not serve (a weights source, an image source
    whose image is not the pinned one). An actionable weights or image drift needs no wait of its own: `plan()`
    gives it a step, which the stops come after."""
    return [d for d in drift if d.blocking and (d.node in serving or d.kind in ("weights", "image"))]


def _start_steps(launcher: str, serving: list[str], stopped: tuple[str, ...], wrapper: tuple[str, ...]) -> list[Step]:
    """Start serving on `serving` (head first in the list) once `stopped` are done, then wait for health.

    native: the workers (headless) first, the head (rank 0) last, as it waits for them. Ray: the head's GCS
    first, then the workers join, then `vllm serve` on the head."""
    head, workers = serving[0], serving[1:]
    if launcher == "native":
        starts = [Step("start-serving", w, f"start rank {i + 1} (headless) first",
                       stopped, rank=i + 1) for i, w in enumerate(workers)]
        head_step = Step("start-serving", head, "start rank 0 last: it waits for "
                         "the workers", stopped + tuple(s.id for s in starts), rank=0)
        steps = starts + [head_step]
    else:
        head_step = Step("start-serving", head, "start the Ray head first", stopped,
                         rank=0)
        starts = [Step("start-serving", w, "join the Ray cluster", (head_step.id,),
                       rank=i + 1) for i, w in enumerate(workers)]
        launch = Step("launch-model", head, "vllm serve on the Ray head once all "
                      "nodes joined", (head_step.id,) + tuple(s.id for s in starts), wrapper=wrapper or None)
        steps = [head_step, *starts, launch]
    return steps + [Step("await-health", head, "wait for /health and /v1/models",
                         (steps[-1].id,))]


def _plan_several(desired: Desired, observed: Observed) -> Plan:
    """A file of several deployments: each deployment planned as a file of one on its view (`Desired.view`,
    `Observed.view`), its steps tagged with its name (`Step.deployment`), the nodes' own steps (links,
    co-tenant stops) once, our stale containers' stops once, and the starts ordered across deployments
    (`_in_start_order`). A co-tenant stop that any deployment holds back (its start is blocked) stays held: a
    plan never stops what works for a start that cannot happen. Retention prunes nothing yet in a file of
    several: what is current is every deployment's model and image, which `core.retention` judges one at a time."""
    drift = diff(desired, observed)
    mode = _mode(desired)
    trusted = tuple(desired.trust.granted())
    if mode != "enforce":
        return Plan(drift, [], [], mode, trusted)
    parts = [(v.deployment.name, plan(v, observed.view(v.deployment.name))) for v in _in_start_order(desired)]
    steps = _stale_containers_stops(drift)
    blocked = [Blocker(b.node, f"{name}: {b.reason}") for name, part in parts for b in part.blocked]
    ulimits = tuple(dict.fromkeys(u for _, p in parts for u in p.ulimits))
    return Plan(drift, steps + _joined_steps(parts), list(dict.fromkeys(blocked)), mode, trusted, ulimits,
                _joined_downtime([p.downtime for _, p in parts if p.downtime]),
                tuple(f"{name}: {why}" for name, p in parts for why in p.refused))


def _stale_containers_stops(drift: list[Drift]) -> list[Step]:
    """The stops of our containers no deployment wants (a former name, a node that serves no more), said once for
    the file, on the nodes that can be reached."""
    down = _down(drift)
    return [Step("stop-serving", d.node, _explain(d), container=d.container) for d in drift
            if d.kind == "serving" and d.deployment is None and d.actionable and d.node not in down]


def _joined_steps(parts: list[tuple[str, Plan]]) -> list[Step]:
    """The deployments' steps in start order, tagged: a node's own step (`NODE_STEPS`) once, and not at all when
    a deployment holds it back; each engine start after the health of the deployments before it."""
    stops = [{s.id for s in p.steps if s.kind == "stop-container"} for _, p in parts]
    held = set[str]().union(*stops) - stops[0].intersection(*stops[1:])  # a blocked start holds them back
    steps: list[Step] = []
    previous: tuple[str, ...] = ()
    for name, part in parts:
        tagged = _tagged(name, part.steps)
        for step in tagged:
            if step.kind in NODE_STEPS:
                if step.id not in held and all(s.id != step.id for s in steps):
                    steps.append(step)
                continue
            if step.kind in ENGINE_STARTS and previous:
                step = dataclasses.replace(step, after=tuple(dict.fromkeys(step.after + previous)))
            steps.append(step)
        previous = previous + tuple(s.id for s in tagged if s.kind == "await-health")
    return steps


def _in_start_order(desired: Desired) -> list[Desired]:
    """The deployments largest first (their memory fraction; ties in file order): on one node, each start must
    find its memory free when vLLM sizes its pool (it takes gpu_memory_utilization x the total and refuses to
    start when less is free), and two engines profiling at once count each other's allocations as their own. The
    largest, the one most likely not to find its memory, goes first, with the page cache just dropped; the next
    starts once it answers (`_plan_several` makes each start wait for the health of those before)."""
    return sorted(desired.views(), key=lambda v: -v.serving.gpu_memory_utilization)


def _tagged(name: str, steps: list[Step]) -> list[Step]:
    """One deployment's steps with its name in their ids (`Step.deployment`), their `after` following: a node's
    own steps (`NODE_STEPS`) keep their ids, as the plan says them once."""
    ids = {s.id: dataclasses.replace(s, deployment=name).id for s in steps if s.kind not in NODE_STEPS}
    return [dataclasses.replace(s, deployment=None if s.kind in NODE_STEPS else name,
                                after=tuple(ids.get(a, a) for a in s.after)) for s in steps]


def _joined_downtime(parts: list[Downtime]) -> Downtime | None:
    """The outage of several deployments' restarts, said as one: every node where serving stops, the longest
    cold start."""
    if not parts:
        return None
    return Downtime(tuple(dict.fromkeys(n for d in parts for n in d.nodes)),
                    tuple(dict.fromkeys(n for d in parts for n in d.restart_with)),
                    max(d.health_timeout for d in parts))
