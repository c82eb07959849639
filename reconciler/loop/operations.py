"""Long work beside the loop: the steps a reconcile admits run in a batch thread of their own, tracked here.

A weight sync may take hours, an image copy or a cold start an hour. The loop never waits for them: it keeps
observing on every trigger and resync, repairs what does not conflict with an operation in flight (a co-tenant,
a link on another node), and publishes status and progress every cycle. An operation's end is a trigger, like any
other (level-triggered: the next reconcile re-observes and decides).

What may run next to what is one pure function, `admit`: never the same step twice, never two parts of an ordered
serving restart at once (the chain runs as one), and never a step whose dependency is still in flight.
What a new generation of the desired state makes wrong is another, `stale`: only those steps are cancelled
(`Operations.cancel_stale`), so an edit of `max_model_len` leaves a 12-hour weight sync running.
Results are handed back to the loop (`drain`), which alone records them in the holds: the loop stays the only
writer of its state.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from reconciler.core.kinds import FETCHES, KINDS, SERVING_CHAIN, StaleRule
from reconciler.core.observed import ServeFlags
from reconciler.core.planning import Plan, Step
from reconciler.core.spec import Desired
from reconciler.core.vllm import launch_specs
from reconciler.edge.execute import Outcome, StepResult, execute, step_timeout
from reconciler.edge.steps import StepContext


def admit(steps: Iterable[Step], busy: Iterable[Step], vetoed: Mapping[str, str] | None = None
          ) -> tuple[list[Step], dict[str, str]]:
    """Split a plan's steps into those that may start now and those that wait (step id -> why).

    A step waits when the holds veto it (`vetoed`: backing off, held), when the same step is in flight, when it
    belongs to the serving chain while any part of the chain is in flight (a restart is one ordered unit), or when
    a step it comes after waits (transitively)."""
    busy = list(busy)
    busy_ids = {s.id for s in busy}
    chain_busy = next((s.id for s in busy if s.kind in SERVING_CHAIN), None)
    admitted: list[Step] = []
    waiting: dict[str, str] = {}
    for step in steps:  # a plan lists every step after the steps it comes after
        if vetoed and step.id in vetoed:
            waiting[step.id] = vetoed[step.id]
        elif step.id in busy_ids:
            waiting[step.id] = "already in flight"
        elif step.kind in SERVING_CHAIN and chain_busy:
            waiting[step.id] = f"the serving chain is in flight ({chain_busy})"
        elif blocker := next((d for d in step.after if d in waiting or d in busy_ids), None):
            waiting[step.id] = f"after {blocker}, which is {'in flight' if blocker in busy_ids else 'waiting'}"
        else:
            admitted.append(step)
    return admitted, waiting


#: What a verify of the weights must not run beside (`reconciler.loop.verify`): a weight sync or a download writes
#: the trees it hashes, and the serving chain loads them (a cold start reads every shard) and is one unit that must
#: not stall halfway for a weekly check.
VERIFY_CONFLICTS = frozenset({"weights", "download"}) | SERVING_CHAIN


def verify_conflict(step: Step, target: str, source: str) -> bool:
    """Whether `step` and the verify of `target` (against `source`) may not run at once: it writes or loads the
    target's tree or the source's (a sync to the target, a download on the source, the serving chain on either)."""
    return step.kind in VERIFY_CONFLICTS and step.node in (target, source)


def verify_waits(target: str, source: str, busy: Iterable[Step]) -> str | None:
    """Why the verify of `target` may not start now (a conflicting step in flight), or None when it may. The other
    direction is the controller's: a conflicting step that may start makes a running verify yield (it is low
    priority; serving and syncs never wait for it)."""
    blocker = next((s.id for s in busy if verify_conflict(s, target, source)), None)
    return None if blocker is None else f"{blocker} is in flight"


def connection(desired: Desired, name: str) -> tuple[object, ...]:
    """Everything that decides how `name` is reached: its ssh settings and, through a jump host, that host's own
    connection. Equal for two desired states exactly when `Sessions.update` keeps the node's session (the same
    settings, the same gateway), so a step or an event stream on it may run on across the edit."""
    ssh = desired.node(name).ssh
    return (ssh, connection(desired, ssh.jump) if ssh.jump else None)


def _declared(desired: Desired) -> set[str]:
    return {n.name for n in desired.nodes}


def _model_tree(desired: Desired, node: str) -> str | None:
    """The model's tree on `node`; None where a per-node `model.path` names no path for it."""
    path = desired.model.path
    return desired.weights_root(node) if isinstance(path, str) or node in path else None


def model_on(desired: Desired, node: str) -> tuple[str | None, ...]:
    """What a copy or a download of the weights to `node` produces: the model, its revision and layout, and the
    tree it writes (the source's tree too, for a copy: that is what it reads)."""
    m, source = desired.model, desired.source_node
    return m.id, m.revision, m.layout, source, _model_tree(desired, node), _model_tree(desired, source)


def _image(desired: Desired) -> tuple[str, str | None, tuple[str, ...]]:
    return desired.serving.image, desired.serving.image_id, tuple(desired.image_sources)


def _launch(desired: Desired) -> dict[str, str]:
    return {spec.node: spec.spec_hash for spec in launch_specs(desired)}


def _moved(step: Step, old: Desired, new: Desired) -> str | None:
    """Why a copy (weights, image) or a fetch (download, pull-image) can no longer run as it began: its target no
    longer serves, the fabric it copies over changed at either end, or the node fetching lost the internet."""
    if step.kind in FETCHES:
        return None if new.node(step.node).internet else f"{step.node} may no longer reach the internet"
    if step.node not in {n.name for n in new.serving_nodes}:
        return f"{step.node} no longer serves the model"
    changed = [n for n in (step.node, step.source) if n and old.node(n).fabric != new.node(n).fabric]
    return f"the fabric of {changed[0]} changed" if changed else None


def _stale_weights(step: Step, old: Desired, new: Desired) -> str | None:  # weights, download
    if why := _moved(step, old, new):
        return why
    if model_on(old, step.node) != model_on(new, step.node):
        return "the model (id, revision, layout, source or path) is no longer the desired one"
    return None


def _stale_image(step: Step, old: Desired, new: Desired) -> str | None:  # image, pull-image
    if why := _moved(step, old, new):
        return why
    if _image(old) != _image(new):
        return "the serving image (reference, pinned id or sources) is no longer the desired one"
    return None


def _stale_serving(step: Step, old: Desired, new: Desired) -> str | None:  # the serving chain: one unit
    if (before := _launch(old)) == (after := _launch(new)):
        return None
    changed = sorted(n for n in before.keys() | after.keys() if before.get(n) != after.get(n))
    return f"the launch spec changed (spec hash of {', '.join(changed)})"


def _stale_co_tenant(step: Step, old: Desired, new: Desired) -> str | None:  # stop-container
    name, tenants = step.container or "", new.co_tenants
    if tenants.unlisted != "stop" or tenants.is_allowed(step.node, name) or tenants.is_protected(step.node, name):
        return f"{name} may now run on {step.node} (co_tenants)"
    return None


def _stale_restore(step: Step, old: Desired, new: Desired) -> str | None:  # start-container
    """A co-tenant brought back after a failed first generation: a new file is a new attempt, planned afresh
    (its own co-tenant stops included); the start is not carried over."""
    return "a new desired state: the failed generation's rollback ends" if old != new else None


def _stale_link(step: Step, old: Desired, new: Desired) -> str | None:
    return f"the fabric of {step.node} changed" if old.node(step.node).fabric != new.node(step.node).fabric else None


def _stale_retention(step: Step, old: Desired, new: Desired) -> str | None:  # prune-weights, prune-images
    if (old.policy.retention, model_on(old, step.node), _image(old)) != (
            new.policy.retention, model_on(new, step.node), _image(new)):
        return "what retention keeps changed (policy.retention, the model or the image)"
    return None


#: What makes a step in flight wrong under a new desired state, by the rule its kind names (`StepKindInfo.stale`;
#: every rule has its function: tests/unit/core/test_step_kinds.py).
STALE_RULES: Mapping[StaleRule, Callable[[Step, Desired, Desired], str | None]] = {
    "weights": _stale_weights, "image": _stale_image, "serving": _stale_serving, "co-tenant": _stale_co_tenant,
    "restore": _stale_restore, "link": _stale_link, "retention": _stale_retention}


def _stale_by_rule(step: Step, old: Desired, new: Desired) -> str | None:
    return STALE_RULES[KINDS[step.kind].stale](step, old, new)


def stale(step: Step, old: Desired, new: Desired) -> str | None:
    """Why the new desired state makes a step admitted under the old one wrong (it is cancelled), or None: it
    keeps running. Pure: the same step and states always give the same answer.

    A step is wrong when what it produces is no longer wanted: the weights of another model, an image no longer
    declared, a serving chain whose launch spec changed, a co-tenant now allowed, a link whose fabric changed, a
    removal whose retention changed; or when it can no longer run as it began: its node (or the node it copies
    from) is no longer declared or is reached another way (its session is rebuilt), a copy's fabric changed, a
    fetch's node lost the internet. A deployment's step is judged on that deployment's views of both files (a
    deployment removed from the file ends its steps). Everything else keeps running:
    an edit of `max_model_len` changes the launch spec, not the weights or the image. A desired state that no
    longer enforces (observe, paused), or names another head (the lease is given back), cancels everything:
    nothing may act for it."""
    if new.policy.mode != "enforce" or new.policy.paused:
        return "the desired state no longer enforces (policy.mode observe or policy.paused)"
    if old.instance != new.instance:
        return f"the head is now {new.instance}: the cluster's lease is given back"
    for node in (step.node, step.source):
        if node is None:
            continue
        if node not in _declared(new):
            return f"{node} is no longer declared"
        if connection(old, node) != connection(new, node):
            return f"the connection to {node} changed"
    name = step.deployment or (old.deployment_names[0] if len(old.deployments) == 1 else None)
    if name is None:  # a node's own step of a file of several: a link, a co-tenant's or a stale container's stop
        if step.kind in SERVING_CHAIN:
            again = (step.node, step.container) in new.serving_containers
            return f"{step.container} is wanted on {step.node} again" if again else None
        return _stale_by_rule(step, old, new)
    if name not in new.deployment_names:
        return f"the deployment {name} is no longer declared"
    return _stale_by_rule(step, old.view(name), new.view(name))


@dataclass
class Operation:
    """One step in flight: what, where, since when, until when, and how far: bytes (of a total, when the step
    knows one), or the stage a cold start is in with vLLM's last meaningful line and its percent."""

    step: Step
    started: float  # unix time the batch was launched
    deadline: float  # unix time the step's own timeout ends (a queued step: from launch)
    cancel: threading.Event  # its own: setting it ends this step at its next check, and nothing else
    state: str = "queued"  # queued (its dependencies in the batch run first) | running
    released: bool = False  # the executor let it start: from then on only its cancel stops it
    bytes_done: int = 0
    bytes_total: int | None = None
    first_bytes: tuple[float, int] | None = None  # (when, bytes) of the first progress: the rate's start
    stage: str | None = None  # a cold start's stage (reconciler.core.vllm_log.STAGES)
    percent: int | None = None  # what the stage's line shows (shards loaded, CUDA graphs captured)
    detail: str | None = None  # that line, printable and bounded by the parser

    def as_dict(self, now: float) -> dict[str, object]:
        return {"step": self.step.id, "kind": self.step.kind, "node": self.step.node, "state": self.state,
                "seconds": round(now - self.started, 1), "deadlineIn": round(self.deadline - now, 1),
                "bytesDone": self.bytes_done, "bytesTotal": self.bytes_total,
                "bytesPerSecond": self.rate(now), "stage": self.stage, "percent": self.percent,
                "detail": self.detail}

    def rate(self, now: float) -> int | None:
        """Bytes per second since the bytes started moving (the manifests and the queue before are not the
        link's speed); None before a second progress report."""
        if self.first_bytes is None or now <= self.first_bytes[0]:
            return None
        since, at_first = self.first_bytes
        return round((self.bytes_done - at_first) / (now - since))


OnEvent = Callable[[str, dict[str, Any]], None]
Run = Callable[..., Outcome]


class Operations:
    """The steps in flight and the results not yet handed to the loop. Thread-safe; the clock is passed in.

    A batch (the steps one reconcile admitted) runs in one executor call; each step has its own cancel event
    (`execute`'s `cancel_of`), the batch one more that a shutdown sets. So a step is cancelled on its own: while it
    waits in its batch the executor's `skip` vetoes it (and the steps after it are skipped: they come after a step
    that did not run); once it runs its own event ends it, and the batch's other steps go on (a 12-hour weight
    sync admitted beside an image copy outlives an edit of the image)."""

    def __init__(self, on_end: Callable[[], None], clock: Callable[[], float] = time.time,
                 run: Run = execute) -> None:
        self._lock = threading.Lock()
        self._running: dict[str, Operation] = {}
        self._finished: list[StepResult] = []
        self._threads: list[threading.Thread] = []
        self._cancels: list[threading.Event] = []
        self._vetoed: dict[str, str] = {}  # step id -> why it must not start (cancel_stale), until its run ends
        self._on_end = on_end
        self._clock = clock
        self._run = run

    def busy(self) -> list[Step]:
        """Steps in flight, and steps that ended but whose result the loop has not drained yet: those must not
        start again before their outcome is in the holds (a failure's backoff)."""
        with self._lock:
            return [op.step for op in self._running.values()] + [r.step for r in self._finished]

    def view(self) -> list[dict[str, object]]:
        now = self._clock()
        with self._lock:
            return [op.as_dict(now) for op in self._running.values()]

    def launch(self, steps: list[Step], ctx: StepContext, on_event: OnEvent) -> None:
        """Run `steps` (in their `after` order, independent ones in parallel) in a thread of their own."""
        now = self._clock()
        cancel = threading.Event()  # this batch's own: what a shutdown sets (no more starts)
        own = {step.id: threading.Event() for step in steps}  # each step's: what cancel_stale or a shutdown sets
        if ctx.cancel.is_set():
            for flag in (cancel, *own.values()):
                flag.set()
        ctx = dataclasses.replace(ctx, cancel=cancel)
        mine = {step.id: Operation(step, now, now + step_timeout(ctx, step), own[step.id]) for step in steps}
        with self._lock:
            self._cancels = [c for c in self._cancels if not c.is_set()] + [cancel, *own.values()]
            self._running.update(mine)

        def event(name: str, fields: dict[str, Any]) -> None:
            self._event(name, fields)
            on_event(name, fields)

        def batch() -> None:
            try:
                results = self._run(Plan([], steps, [], "enforce"), ctx, on_event=event, skip=self._release,
                                    cancel_of=lambda step: own[step.id]).results
            except Exception as exc:  # noqa: BLE001 - an executor bug must still free the steps and say why
                results = [StepResult(s, "failed", 0.0, f"executor crashed: {exc!r}") for s in steps]
            with self._lock:
                for result in results:  # those whose step.end was not heard (skipped, cancelled, crashed)
                    if (op := mine.get(result.step.id)) is not None and self._end(op):
                        self._finished.append(result)
                for op in mine.values():
                    self._end(op)
            self._on_end()

        thread = threading.Thread(target=batch, name=f"operations-{steps[0].id}", daemon=True)
        with self._lock:
            self._threads = [t for t in self._threads if t.is_alive()] + [thread]
        thread.start()

    def _release(self, step: Step) -> str | None:
        """The executor asks before it starts a step: the reason a cancel_stale gave it, or None (it starts, and
        from now on only its own cancel stops it). One lock with cancel_stale, so a step is either vetoed
        here or seen released there, never neither."""
        with self._lock:
            if (why := self._vetoed.get(step.id)) is not None:
                return why
            if (op := self._running.get(step.id)) is not None:
                op.released = True
            return None

    def _event(self, name: str, fields: dict[str, Any]) -> None:
        with self._lock:
            if name == "step.start" and (op := self._running.get(fields["step"].id)):
                op.state = "running"
                op.deadline = self._clock() + (op.deadline - op.started)
            elif name == "step.end" and (op := self._running.get(fields["result"].step.id)) and self._end(op):
                self._finished.append(fields["result"])

    def _end(self, op: Operation) -> bool:
        """Take `op` out of the steps in flight, with its veto, if it is still there (call with the lock held).
        An entry is ended by its own run only: once a step's end was reported, the loop may launch the same step
        again in a new batch while the old batch runs on, and the old batch's end must not end the new run (the
        step would be free for a third, concurrent launch, and the old result handed out twice)."""
        if self._running.get(op.step.id) is not op:
            return False
        del self._running[op.step.id]
        self._vetoed.pop(op.step.id, None)
        return True

    def cancel_stale(self, judge: Callable[[Step], str | None]) -> dict[str, str]:
        """Cancel the steps in flight that `judge` (`stale`, over the old and the new desired state) says are
        wrong now: a waiting one is vetoed (the executor skips it and what comes after it), a started one is
        cancelled alone. Returns step id -> why, for what was cancelled."""
        cancelled: dict[str, str] = {}
        with self._lock:
            for op in self._running.values():
                if (why := judge(op.step)) is None:
                    continue
                cancelled[op.step.id] = why
                if op.released:
                    op.cancel.set()
                else:
                    self._vetoed[op.step.id] = f"cancelled: {why}"
        return cancelled

    def cancel_all(self) -> int:
        """Cancel every batch in flight and each of its steps (they stop at their next check; rsync is sent
        SIGTERM and keeps its partial data): the daemon is stopping. Returns how many batches were running."""
        with self._lock:
            cancels, self._cancels = self._cancels, []
            batches = len({id(t) for t in self._threads if t.is_alive()})
        for cancel in cancels:
            cancel.set()
        return batches

    def progress(self, kind: str, node: str, done: int, total: int | None = None) -> None:
        """Bytes moved so far by the `kind` step on `node` (the weight sync's rsync, the image stream)."""
        with self._lock:
            for op in self._running.values():
                if op.step.kind == kind and op.step.node == node:
                    if op.first_bytes is None:
                        op.first_bytes = (self._clock(), done)
                    op.bytes_done = done
                    op.bytes_total = total if total is not None else op.bytes_total

    def stage(self, kind: str, node: str, stage: str, percent: int | None, detail: str | None) -> None:
        """Where the `kind` step on `node` is, in words: a cold start's stage and vLLM's last meaningful line."""
        with self._lock:
            for op in self._running.values():
                if op.step.kind == kind and op.step.node == node:
                    op.stage, op.percent, op.detail = stage, percent, detail or None

    def drain(self) -> list[StepResult]:
        """The results finished since the last call (each handed out once)."""
        with self._lock:
            out, self._finished = self._finished, []
            return out

    def join(self, timeout: float) -> bool:
        """Wait for every batch to end (after a cancel); False when one is still running at the deadline."""
        deadline = time.monotonic() + timeout
        with self._lock:
            threads = list(self._threads)
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        return not any(t.is_alive() for t in threads)


class FlagsQuery:
    """The serving image's `vllm serve --help=all`, asked beside the loop: it imports torch (~26 s here, more on a
    busy node), far too long to hold a reconcile. Asked once per image id; until the answer is in, the plan sees
    ServeFlags(pending=True) and holds a serving (re)start, so an unknown flag is still refused before anything
    stops. An answer that could not be had (a crash, a deadline, `exec format error`) refuses a start too, and is
    asked again after `RETRY_INITIAL` seconds, doubling to `RETRY_MAX`: never kept as the image's last word.
    The answer's arrival is a trigger."""

    RETRY_INITIAL = 15.0
    RETRY_MAX = 600.0

    def __init__(self, ask: Callable[[str, str], ServeFlags], on_answer: Callable[[], None],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._ask = ask
        self._on_answer = on_answer
        self._clock = clock
        self._lock = threading.Lock()
        self._answers: dict[str, ServeFlags] = {}
        self._failures: dict[str, tuple[int, float]] = {}  # image id -> (failed answers, when to ask again)

    def get(self, wanted: tuple[str, str] | None) -> ServeFlags | None:
        """The answer for (holder, image id), or a pending one after starting the question."""
        if wanted is None:
            return None
        holder, image_id = wanted
        with self._lock:
            known = self._answers.get(image_id)
            failed, retry_at = self._failures.get(image_id, (0, 0.0))
            if known is not None and (known.error is None or self._clock() < retry_at):
                return known
            self._answers[image_id] = ServeFlags(image_id=image_id, pending=True)

        def ask() -> None:
            try:
                answer = self._ask(holder, image_id)
            except Exception as exc:  # noqa: BLE001 - an answer of some kind must arrive, or serving waits forever
                answer = ServeFlags(image_id=image_id, error=f"asking failed: {exc!r}")
            with self._lock:
                self._answers[image_id] = answer
                if answer.error is None:
                    self._failures.pop(image_id, None)
                else:
                    wait = min(self.RETRY_MAX, self.RETRY_INITIAL * 2 ** failed)
                    self._failures[image_id] = (failed + 1, self._clock() + wait)
            self._on_answer()

        threading.Thread(target=ask, name=f"flags-{image_id[:19]}", daemon=True).start()
        return ServeFlags(image_id=image_id, pending=True)
