"""The probe: ONE POSIX sh script per node per cycle, made of `probes`' fragments, and its reading into an
`Observed`, all nodes in parallel.

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
from functools import partial

from reconciler.core.observed import DeploymentFacts, Image, NodeObservation, Observed, ServeFlags
from reconciler.core.planning import plan
from reconciler.core.spec import Desired, Node
from reconciler.edge.image_flags import flags_once, flags_wanted
from reconciler.edge.ledger import ledger_script, parse_copies
from reconciler.edge.manifest import manifest_script, parse_weights
from reconciler.edge.probes import (
    ProbeError,
    Sealed,
    Section,
    api_script,
    containers_script,
    disk_script,
    gpu_script,
    identity_script,
    image_script,
    link_script,
    listen_script,
    machine_script,
    memory_script,
    parse_containers,
    parse_disk,
    parse_disk_fs,
    parse_gpu_stack,
    parse_identity,
    parse_image,
    parse_links,
    parse_listen_addresses,
    parse_listening,
    parse_machine,
    parse_memory,
    parse_serving,
    ray_script,
    sealed,
    split_sections,
)
from reconciler.edge.ssh import OutputTooLarge, RemoteError, Sessions, node_deadline, quote_word


def probe_script(desired: Desired, node: Node) -> Sealed:
    """The script for one node: every fragment of `probes`, the head's cluster id, and where a deployment's rank 0
    runs (`Desired.api_node`) its API and Ray. In a file of several deployments, each deployment's fragments (its
    image, weights, API) run under its own section prefix (`PFX=NAME/`, probes.SECTION_FUNCTION)."""
    head = node.role == "head"
    if len(desired.deployments) == 1:  # a file of one: the script as it always was
        lines = [*containers_script(),
                 *(identity_script(desired.instance) if head else []), *image_script(desired.serving.image),
                 *link_script(node), *machine_script(), *listen_script(), *memory_script(),
                 *(gpu_script() if desired.serving.docker.gpus is not None else []),
                 *disk_script(desired.model.path_on(node.name)),
                 manifest_script(desired.weights_root(node.name)),
                 *(ledger_script() if desired.policy.retention.prune else [])]
        return sealed(lines + (_api_lines(desired) if node.name == desired.api_node.name else []))
    views = desired.views()
    lines = [*containers_script(), *(identity_script(desired.instance) if head else []),
             *link_script(node), *machine_script(), *listen_script(), *memory_script(),
             *(gpu_script() if any(v.serving.docker.gpus is not None for v in views) else []),
             *(ledger_script() if desired.policy.retention.prune else [])]
    for view in views:
        lines += [f"PFX={quote_word(view.deployment.name + '/')}", *image_script(view.serving.image)]
        if _has_path(view, node.name):
            lines += [*disk_script(view.model.path_on(node.name)), manifest_script(view.weights_root(node.name))]
        lines += _api_lines(view) if node.name == view.api_node.name else []
    return sealed([*lines, "PFX="])


def _api_lines(view: Desired) -> list[str]:
    return [*api_script(view), *(ray_script(view.serving.container_name) if view.serving.launcher == "ray" else [])]


def _has_path(view: Desired, node: str) -> bool:
    """The deployment names a model path on `node` (a per-node mapping may leave out a node it never uses)."""
    return isinstance(view.model.path, str) or node in view.model.path


def parse_probe(desired: Desired, node: Node, output: str, nonce: str) -> NodeObservation:
    """One node's probe output (sealed with `nonce`) as its observation; ProbeError (naming the section) when it
    does not parse."""
    sections = split_sections(output, nonce)
    docker_ok, docker_error, containers = parse_containers(sections.get("containers"))
    fabric, fabric_twin = parse_links(node, sections)
    identity = parse_identity(sections.get("identity")) if node.role == "head" else None
    seen = NodeObservation(
        name=node.name, reachable=True, machine=parse_machine(sections.get("machine")),
        listening=parse_listening(sections.get("listen")),
        listen_addresses=parse_listen_addresses(sections.get("listen")),
        gpu_stack=parse_gpu_stack(sections.get("gpu"), sections.get("gpu_hook"), sections.get("os")),
        docker_reachable=docker_ok, docker_error=docker_error, containers=containers,
        fabric=fabric, fabric_twin=fabric_twin, memory=parse_memory(sections.get("meminfo")),
        copies=parse_copies(sections.get("copies"), node.name), identity=identity)
    if len(desired.deployments) == 1:
        image, facts = _deployment_facts(desired, node, sections)
        return seen.model_copy(update={"images": {desired.serving.image: image} if image else {},
                                       "weights": facts.weights, "serving": facts.serving,
                                       "disk_free": facts.disk_free, "disk_fs": facts.disk_fs})
    images, by_deployment = {}, {}
    for view in desired.views():
        prefix = view.deployment.name + "/"
        own = {name[len(prefix):]: sec for name, sec in sections.items() if name.startswith(prefix)}
        image, by_deployment[view.deployment.name] = _deployment_facts(view, node, own)
        if image:
            images[view.serving.image] = image
    return seen.model_copy(update={"images": images, "deployments": by_deployment})


def _deployment_facts(view: Desired, node: Node, sections: dict[str, Section]) -> tuple[Image | None,
                                                                                        DeploymentFacts]:
    """What one deployment's fragments read on `node`: its image, and its weights, API (the head) and disk room."""
    serving = None
    if node.name == view.api_node.name:  # where its API runs
        serving = parse_serving(sections.get("health"), sections.get("models"), sections.get("ray"),
                                sections.get("completion"), sections.get("engine"), sections.get("port_owner"))
    weights = (parse_weights(view.weights_root(node.name), sections.get("weights"))
               if _has_path(view, node.name) else None)
    return parse_image(sections.get("image")), DeploymentFacts(weights=weights, serving=serving,
                                                               disk_free=parse_disk(sections.get("disk")),
                                                               disk_fs=parse_disk_fs(sections.get("disk")))


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
