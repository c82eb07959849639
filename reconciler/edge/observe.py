"""The probe: ONE POSIX sh script per node per cycle, a list of `facts` joined (`probe_facts`), and its reading
into an `Observed`, all nodes in parallel.

A probe that fails on one node (unreachable, odd output, too much output) is that node's condition; the others
are observed all the same, and none waits for another: each node has its own deadline (`node_deadline`), and a node
late for it reads Unreachable for that cycle (issue 31: one node's accepted, never answered channel held them all).
The one-shot commands also ask the serving image for its flags here (`image_flags`); the daemon asks beside its
loop.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

from reconciler.core.observed import DeploymentFacts, NodeObservation, Observed, ServeFlags
from reconciler.core.planning import plan
from reconciler.core.spec import Desired, Node
from reconciler.edge.facts.base import Fact, ProbeError, Sealed, Section, sealed, split_sections
from reconciler.edge.facts.containers import DOCKER
from reconciler.edge.facts.disk import disk_fact
from reconciler.edge.facts.gpu import GPU_STACK
from reconciler.edge.facts.host import MACHINE, identity_fact
from reconciler.edge.facts.images import served_image_fact
from reconciler.edge.facts.links import links_fact
from reconciler.edge.facts.memory import MEMORY
from reconciler.edge.facts.ports import LISTEN
from reconciler.edge.facts.serving import api_fact
from reconciler.edge.image_flags import flags_once, flags_wanted
from reconciler.edge.ledger import copies_fact
from reconciler.edge.manifest import weights_fact
from reconciler.edge.ssh import OutputTooLarge, RemoteError, Sessions, node_deadline


@dataclass(frozen=True)
class Probe:
    """One node's probe as facts: the node's own (`node`, by name) and each deployment's (`deployments`, by the
    deployment's name, then by fact), the latter under the deployment's section prefix in a file of several."""

    node: dict[str, Fact[Any]]
    deployments: dict[str, dict[str, Fact[Any]]]

    def facts(self) -> list[Fact[Any]]:
        """Every fact of the probe, in the order they run."""
        return [*self.node.values(), *(fact for own in self.deployments.values() for fact in own.values())]

    def script(self) -> Sealed:
        """The facts joined into one script for `sh -s`."""
        return sealed([line for fact in self.facts() for line in fact.script])

    def read(self, sections: dict[str, Section]) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
        """Each fact's value from the script's sections, by the names `node` and `deployments` give them."""
        return ({name: fact.value(sections) for name, fact in self.node.items()},
                {deployment: {name: fact.value(sections) for name, fact in own.items()}
                 for deployment, own in self.deployments.items()})


def probe_facts(desired: Desired, node: Node) -> Probe:
    """What the probe reads on `node`: its containers, fabric ports, machine, listeners, memory, the GPU stack
    (where a deployment declares GPUs), the copy ledger (under a retention that prunes), the head's cluster id;
    and each deployment's image, disk room and weights (where it names a model path on the node) and, where its
    rank 0 runs (`Desired.api_node`), its API and Ray. A file of one deployment reads as one of several with one
    entry; only its sections keep their plain names (no prefix)."""
    views = desired.views()
    own: dict[str, Fact[Any]] = {"docker": DOCKER, "links": links_fact(node)}
    if node.role == "head":
        own["identity"] = identity_fact(desired.instance)
    own |= {"machine": MACHINE, "listen": LISTEN}
    if any(view.serving.docker.gpus is not None for view in views):
        own["gpu"] = GPU_STACK
    own["memory"] = MEMORY
    if desired.policy.retention.prune:
        own["copies"] = copies_fact(node.name)
    prefixed = len(views) > 1
    return Probe(own, {view.deployment.name: {name: fact.under(view.deployment.name + "/" if prefixed else "")
                                              for name, fact in _deployment_facts(view, node).items()}
                       for view in views})


def _deployment_facts(view: Desired, node: Node) -> dict[str, Fact[Any]]:
    """What the probe reads on `node` for one deployment (`view`)."""
    facts: dict[str, Fact[Any]] = {"image": served_image_fact(view.serving.image)}
    if _has_path(view, node.name):
        facts["disk"] = disk_fact(view.model.path_on(node.name))
        facts["weights"] = weights_fact(view.weights_root(node.name))
    if node.name == view.api_node.name:  # where its API runs
        facts["serving"] = api_fact(view, ray=view.serving.launcher == "ray")
    return facts


def probe_script(desired: Desired, node: Node) -> Sealed:
    """The script for one node (`probe_facts`). In a file of several deployments, each deployment's facts (its
    image, weights, API) run under its own section prefix (`PFX=NAME/`, `Fact.prefix`)."""
    return probe_facts(desired, node).script()


def _has_path(view: Desired, node: str) -> bool:
    """The deployment names a model path on `node` (a per-node mapping may leave out a node it never uses)."""
    return isinstance(view.model.path, str) or node in view.model.path


def parse_probe(desired: Desired, node: Node, output: str, nonce: str) -> NodeObservation:
    """One node's probe output (sealed with `nonce`) as its observation; ProbeError (naming the section) when it
    does not parse."""
    values, by_deployment = probe_facts(desired, node).read(split_sections(output, nonce))
    seen = _node_observation(node, values)
    images = {view.serving.image: image for view in desired.views()
              if (image := by_deployment[view.deployment.name]["image"]) is not None}
    facts = {name: _deployment_observation(own) for name, own in by_deployment.items()}
    if len(desired.deployments) > 1:
        return seen.model_copy(update={"images": images, "deployments": facts})
    (alone,) = facts.values()
    return seen.model_copy(update={"images": images, "weights": alone.weights, "serving": alone.serving,
                                   "disk_free": alone.disk_free, "disk_fs": alone.disk_fs})


def _node_observation(node: Node, values: dict[str, Any]) -> NodeObservation:
    """The node's own facts (`Probe.node`'s values) as its observation; a fact the probe did not read is None."""
    docker_ok, docker_error, containers = values["docker"]
    fabric, fabric_twin = values["links"]
    listening, listen_addresses = values["listen"]
    return NodeObservation(
        name=node.name, reachable=True, machine=values["machine"], listening=listening,
        listen_addresses=listen_addresses, gpu_stack=values.get("gpu"), docker_reachable=docker_ok,
        docker_error=docker_error, containers=containers, fabric=fabric, fabric_twin=fabric_twin,
        memory=values["memory"], copies=values.get("copies"), identity=values.get("identity"))


def _deployment_observation(values: dict[str, Any]) -> DeploymentFacts:
    """One deployment's facts (`Probe.deployments`' values) as what the node holds of it: its weights, its API
    (where its rank 0 runs) and the disk room (where it names a model path); None where the probe did not read."""
    disk_free, disk_fs = values.get("disk", (None, None))
    return DeploymentFacts(weights=values.get("weights"), serving=values.get("serving"), disk_free=disk_free,
                           disk_fs=disk_fs)


def observe_node(desired: Desired, sessions: Sessions, node: Node, timeout: float = 20.0,
                 cancel: threading.Event | None = None) -> NodeObservation:
    try:
        script = probe_script(desired, node)
        result = sessions[node.name].run_script(script.script, timeout=timeout, cancel=cancel)
    except OutputTooLarge as exc:
        return NodeObservation(name=node.name, reachable=True, probe_error=exc.message)
    except RemoteError as exc:
        return NodeObservation(name=node.name, reachable=False, error=exc.message)
    try:
        return parse_probe(desired, node, result.stdout, script.nonce)
    except ProbeError as exc:
        return NodeObservation(name=node.name, reachable=True, probe_error=str(exc))


def observe(desired: Desired, sessions: Sessions, timeout: float = 20.0, cancel: threading.Event | None = None,
            ask_flags: bool = True) -> tuple[Observed, dict[str, float]]:
    """Probe all nodes in parallel, each under its own deadline (`node_deadline`): a node that is unreachable, or
    hangs, never stalls the others; also return seconds per node.
    `cancel` (the daemon's shutdown) ends a probe that waits on a hung node within a second, not its timeout.
    `ask_flags`: also ask the serving image for its flags here and now when a serving (re)start is planned (the
    one-shot commands: asking imports torch, tens of seconds); the daemon asks every image id beside its loop
    instead (`reconciler.loop.operations.FlagsQuery`)."""
    probes = {node.name: _Probe(node.name, partial(observe_node, desired, sessions, node, timeout, cancel))
              for node in desired.nodes}
    for probe in probes.values():
        probe.start()
    nodes: dict[str, NodeObservation] = {}
    durations: dict[str, float] = {}
    for node in desired.nodes:
        nodes[node.name], durations[node.name] = probes[node.name].outcome(node_deadline(desired, node, timeout),
                                                                           cancel)
    observed = Observed(nodes=nodes)
    if not ask_flags:
        return observed, durations
    return with_flags(desired, observed, lambda view, wanted: flags_once(view, sessions, *wanted)), durations


#: The image's answer for one deployment (its view of the file, and the (node, image id) to ask), None for none.
Answer = Callable[[Desired, tuple[str, str]], ServeFlags | None]


def with_flags(desired: Desired, observed: Observed, answer: Answer, starting_only: bool = True) -> Observed:
    """`observed` with each deployment's serving image's answer (`answer`: at once, or a pending one from a
    question beside the caller), where a node holds that image; with `starting_only`, only where a plan of this
    observation would start serving (asking imports torch: tens of seconds). A file of one keeps its answer as
    `serve_flags`, a file of several each deployment's under its name; answers `observed` held before are
    replaced (whether a start is planned is judged without them: a pending one holds the start)."""
    observed = observed.model_copy(update={"serve_flags": None, "deployment_flags": {}})
    if len(desired.deployments) == 1:
        if (wanted := flags_wanted(desired, observed)) and (not starting_only or _starts_serving(desired, observed)):
            observed = observed.model_copy(update={"serve_flags": answer(desired, wanted)})
        return observed
    flags = {}
    for view in desired.views():
        seen = observed.view(view.deployment.name)
        wanted = flags_wanted(view, seen)
        if wanted and (not starting_only or _starts_serving(view, seen)) and (got := answer(view, wanted)):
            flags[view.deployment.name] = got
    return observed.model_copy(update={"deployment_flags": flags})


def flags_pending(observed: Observed) -> bool:
    """Whether an answer `with_flags` attached is still pending (the serving start waits for it)."""
    answers = [observed.serve_flags, *observed.deployment_flags.values()]
    return any(a is not None and a.pending for a in answers)


class _Probe(threading.Thread):
    """One node's probe on a thread of its own. A daemon thread: one left behind by its deadline ends at its
    session's own deadlines and never holds the daemon's exit (a ThreadPoolExecutor's workers are joined at exit,
    and its `with` waits for every node). It writes only into itself, never into what observe returned."""

    def __init__(self, node: str, work: Callable[[], NodeObservation]):
        super().__init__(daemon=True, name=f"probe-{node}")
        self.node, self._work, self._done = node, work, threading.Event()
        self._start = time.monotonic()
        self._result: NodeObservation | None = None
        self._error: BaseException | None = None
        self._seconds = 0.0

    def run(self) -> None:
        try:
            self._result = self._work()
        except BaseException as exc:  # noqa: BLE001 - raised again in observe's caller, as it was
            self._error = exc
        finally:
            self._seconds = time.monotonic() - self._start
            self._done.set()

    def outcome(self, seconds: float, cancel: threading.Event | None) -> tuple[NodeObservation, float]:
        """The observation and its seconds, waited for until `seconds` after the start; past that, or once
        cancelled, the node reads Unreachable for this cycle."""
        if not self._ended(self._start + seconds, cancel):
            why = ("observation cancelled" if cancel is not None and cancel.is_set() else
                   f"no observation within {seconds:g}s (observe's deadline for this node): read as unreachable "
                   "for this cycle")
            return NodeObservation(name=self.node, reachable=False, error=why), time.monotonic() - self._start
        if self._error is not None:
            raise self._error
        assert self._result is not None
        return self._result, self._seconds

    def _ended(self, until: float, cancel: threading.Event | None) -> bool:
        """Whether the probe ended before `until`, looking a second at a time to leave at once on `cancel`."""
        while not self._done.wait(min(max(until - time.monotonic(), 0.0), 1.0)):
            if time.monotonic() >= until or (cancel is not None and cancel.is_set()):
                return False
        return True


def _starts_serving(desired: Desired, observed: Observed) -> bool:
    """Whether a plan of this observation (no answer from the image yet) would start serving: only then is the
    image asked, and the answer then judges that start (core.planning._image_refuses)."""
    return any(s.kind == "start-serving" for s in plan(desired, observed).steps)
