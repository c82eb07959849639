"""How the head's serving has fared across reconciles: the memory a single observation lacks.

One probe sees "the API does not answer". Whether that is a cold start (a 119 GB load takes many minutes: wait,
up to `serving.health_timeout`) or a wedge (an NCCL hang, a stuck rank: restart after `serving.unhealthy_grace`)
depends on history: did this very container serve before, and since when has it failed? The watch keeps that
history per container id and writes it into the observation (`ServingApi.unhealthy_for`, `served_before`,
`health_restarts`), so the pure plan decides from one snapshot, and `plan --observed` of a saved snapshot decides
the same. A container older than the cold-start allowance counts as having served: after a daemon restart a
wedged vLLM is not granted another hour.

Backoff: a restart for health that did not hold (the new container also served, then failed again) doubles the
grace, up to 16x; serving well for 16 graces forgets the count.

Clocks: every duration here (failing since, serving since, the container's age) runs on the monotonic clock the
caller passes (`now`). They ran on the wall clock, and a clock step is not time passing: 2 h forward restarted a
model in the middle of its cold start (its age and its failure both jumped past their limits), and a day back
delayed a wedged restart by a day (issue 31, finding 10). The wall clock is read once per container, when it is
first seen, for the only age a watch without history has: docker's StartedAt (the head's clock) against now.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import datetime
from itertools import takewhile

from reconciler.core.observed import Container, Observed, ServingApi
from reconciler.core.planning import MAX_GRACE_DOUBLINGS, health_grace
from reconciler.core.spec import Desired


def started_timestamp(started_at: str | None) -> float | None:
    """docker's StartedAt (RFC 3339 with nanoseconds) as unix time; None when absent or unreadable."""
    if not started_at or started_at.startswith("0001-"):
        return None
    text = started_at.replace("Z", "+00:00")
    head, dot, rest = text.partition(".")
    if dot:  # Python parses at most microseconds: cut the fraction to 6 digits, keep the offset
        digits = "".join(takewhile(str.isdigit, rest))  # the fraction's only: the offset's are kept after it
        text = f"{head}.{digits[:6] or '0'}{rest[len(digits):]}"
    try:
        return datetime.fromisoformat(text).timestamp()
    except ValueError:
        return None


def _age(started_at: str | None, now: float) -> float:
    """Seconds since docker's StartedAt; 0 when absent or unreadable."""
    started = started_timestamp(started_at)
    return 0.0 if started is None else max(0.0, now - started)


class HealthWatch:
    def __init__(self, wall: Callable[[], float] = time.time) -> None:
        self.wall = wall  # unix time: read only when a container is first seen (its StartedAt)
        self.container_id: str | None = None
        self._start: tuple[tuple[str, str | None], float, float] | None = None  # (start, first seen, age then)
        self.served = False
        self.unhealthy_since: float | None = None
        self.serving_since: float | None = None
        self.restarts = 0
        self.tokens: float | None = None  # the engine's token count at the last probe that read it (this container)
        self.kv_usage: float | None = None  # and its KV cache usage then
        self._wedged = False  # the current container served and now fails: its replacement is a restart for health

    def annotate(self, desired: Desired, observed: Observed, now: float) -> Observed:
        """`now`: the monotonic clock's reading for this observation."""
        head = desired.api_node.name  # where its API runs
        node = observed.nodes.get(head)  # None: an observation without the head (a snapshot's): nothing serves
        serving = node.serving if node else None
        container = node.container(desired.serving.container_name) if node else None
        if node is None or serving is None or container is None or not container.running:
            self.unhealthy_since = self.serving_since = None
            return observed
        self._follow(container.id)
        busy = self._busy(desired, serving)
        self._judge(serving.serves(desired.served_name) or busy, desired.serving.unhealthy_grace, now)
        served_before = self.served or self._age(container, now) > desired.serving.health_timeout
        self._wedged = served_before and self.unhealthy_since is not None
        annotated = serving.model_copy(update={
            "unhealthy_for": None if self.unhealthy_since is None else now - self.unhealthy_since,
            "served_before": served_before, "health_restarts": self.restarts, "busy": busy})
        nodes = dict(observed.nodes)
        nodes[head] = node.model_copy(update={"serving": annotated})
        return observed.model_copy(update={"nodes": nodes})

    def _follow(self, container_id: str) -> None:
        """Another container under the name: a new start, judged afresh; it replaced a wedged one (a restart for
        health), which counts."""
        if container_id == self.container_id:
            return
        if self._wedged:
            self.restarts += 1
        self.container_id, self.served, self._wedged = container_id, False, False
        self.unhealthy_since = self.serving_since = self.tokens = self.kv_usage = None

    def _judge(self, working: bool, grace: float, now: float) -> None:
        """One probe's verdict: serving (or busy) since when, else failing since when; a serving that held for the
        longest grace ends the count of restarts."""
        if working:
            self.served, self.unhealthy_since = True, None
            self.serving_since = self.serving_since if self.serving_since is not None else now
            if now - self.serving_since >= health_grace(grace, MAX_GRACE_DOUBLINGS):
                self.restarts = 0
        else:
            self.serving_since = None
            self.unhealthy_since = self.unhealthy_since if self.unhealthy_since is not None else now

    def _age(self, container: Container, now: float) -> float:
        """The container's age, on the monotonic clock: its StartedAt read against the wall clock once, when that
        start (container id and StartedAt) is first seen, the only age a watch without history has; then the
        monotonic time since."""
        start = (container.id, container.started_at)
        if self._start is None or self._start[0] != start:
            self._start = (start, now, _age(container.started_at, self.wall()))
        _, seen, age = self._start
        return age + (now - seen)

    def _busy(self, desired: Desired, serving: ServingApi) -> bool:
        """The completion did not answer, but the engine's tokens grew since the last probe read them: vLLM
        schedules first come, first served (priority scheduling is opt-in, vllm-project/vllm PR #5958) and Spark
        recipes keep `--max-num-seqs` at 1-4, so with every slot taken by long generations the probe's one token
        waits in the queue. That is serving at capacity, not a wedge; a wedged engine's counters stand still.
        The baseline is read after the probe's own completion, so a freeze shows at the first failed check.

        A chunked prefill longer than the grace with nothing else decoding counts no token until it completes
        (vLLM counts prompt tokens per finished prefill), but every chunk allocates KV blocks: a KV cache usage
        that moved while a request runs is progress too."""
        engine, before, kv_before = serving.engine, self.tokens, self.kv_usage
        if engine is not None:
            self.tokens, self.kv_usage = engine.tokens, engine.kv_usage
        if serving.serves(desired.served_name) or desired.served_name not in serving.models or engine is None:
            return False
        tokens_grew = before is not None and engine.tokens > before
        prefilling = (engine.running > 0 and kv_before is not None and engine.kv_usage is not None
                      and engine.kv_usage != kv_before)
        return tokens_grew or prefilling


class HealthWatches:
    """A `HealthWatch` per deployment: each deployment's serving has its own history (a wedged embeddings
    server restarts on its own grace, the big model's cold start takes its own allowance). A file of one is
    watched as it always was; in a file of several each deployment's API is annotated on its view and written
    back where the probe put it (`NodeObservation.deployments`)."""

    def __init__(self, wall: Callable[[], float] = time.time) -> None:
        self.wall = wall
        self.watches: dict[str, HealthWatch] = {}

    def watch(self, deployment: str) -> HealthWatch:
        return self.watches.setdefault(deployment, HealthWatch(self.wall))

    def annotate(self, desired: Desired, observed: Observed, now: float) -> Observed:
        names = desired.deployment_names
        self.watches = {name: w for name, w in self.watches.items() if name in names}  # a removed one is forgotten
        if len(names) == 1:
            return self.watch(names[0]).annotate(desired, observed, now)
        nodes = dict(observed.nodes)
        for view in desired.views():
            name, where = view.deployment.name, view.api_node.name
            node = nodes.get(where)
            if node is None or name not in node.deployments:
                continue
            seen = self.watch(name).annotate(view, observed.view(name), now).node(where).serving
            facts = {**node.deployments, name: node.deployments[name].model_copy(update={"serving": seen})}
            nodes[where] = node.model_copy(update={"deployments": facts})
        return observed.model_copy(update={"nodes": nodes})
