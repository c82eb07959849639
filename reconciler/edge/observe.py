"""The probe: ONE POSIX sh script per node per cycle, made of `probes`' fragments, and its reading into an
`Observed`, all nodes in parallel.

A probe that fails on one node (unreachable, odd output, too much output) is that node's condition; the others
are observed all the same. The one-shot commands also ask the serving image for its flags here (`image_flags`); the
daemon asks beside its loop.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

from reconciler.core.observed import NodeObservation, Observed
from reconciler.core.planning import plan
from reconciler.core.spec import Desired, Node
from reconciler.edge.image_flags import flags_once, flags_wanted
from reconciler.edge.ledger import ledger_script, parse_copies
from reconciler.edge.manifest import manifest_script, parse_weights
from reconciler.edge.probes import (
    SECTION_FUNCTION,
    ProbeError,
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
    parse_gpu_stack,
    parse_identity,
    parse_image,
    parse_links,
    parse_listening,
    parse_machine,
    parse_memory,
    parse_serving,
    ray_script,
    split_sections,
)
from reconciler.edge.ssh import OutputTooLarge, RemoteError, Sessions


def probe_script(desired: Desired, node: Node) -> str:
    """The script for one node: every fragment of `probes`, the head's cluster id, API and Ray too."""
    head = node.role == "head"
    lines = ["export LC_ALL=C", SECTION_FUNCTION, *containers_script(),
             *(identity_script(desired.instance) if head else []), *image_script(desired.serving.image),
             *link_script(node), *machine_script(), *listen_script(), *memory_script(),
             *(gpu_script() if desired.serving.docker.gpus is not None else []),
             *disk_script(desired.model.path_on(node.name)),
             manifest_script(desired.weights_root(node.name)),
             *(ledger_script() if desired.policy.retention.prune else [])]
    if head:
        lines += api_script(desired)
        if desired.serving.launcher == "ray":
            lines += ray_script(desired.serving.container_name)
    return "\n".join(lines) + "\n"


def parse_probe(desired: Desired, node: Node, output: str) -> NodeObservation:
    """One node's probe output as its observation; ProbeError (naming the section) when it does not parse."""
    sections = split_sections(output)
    docker_ok, docker_error, containers = parse_containers(sections.get("containers"))
    image = parse_image(sections.get("image"))
    images = {desired.serving.image: image} if image else {}
    fabric, fabric_twin = parse_links(node, sections)
    serving = identity = None
    if node.role == "head":
        serving = parse_serving(sections.get("health"), sections.get("models"), sections.get("ray"),
                                sections.get("completion"), sections.get("engine"))
        identity = parse_identity(sections.get("identity"))
    return NodeObservation(
        name=node.name, reachable=True, machine=parse_machine(sections.get("machine")),
        listening=parse_listening(sections.get("listen")), disk_free=parse_disk(sections.get("disk")),
        gpu_stack=parse_gpu_stack(sections.get("gpu"), sections.get("gpu_hook"), sections.get("os")),
        docker_reachable=docker_ok, docker_error=docker_error,
        containers=containers, images=images,
        fabric=fabric, fabric_twin=fabric_twin,
        memory=parse_memory(sections.get("meminfo")),
        weights=parse_weights(desired.weights_root(node.name), sections.get("weights")), serving=serving,
        copies=parse_copies(sections.get("copies"), node.name),
        identity=identity)


def observe_node(desired: Desired, sessions: Sessions, node: Node, timeout: float = 20.0,
                 cancel: threading.Event | None = None) -> NodeObservation:
    try:
        result = sessions[node.name].run_script(probe_script(desired, node), timeout=timeout, cancel=cancel)
    except OutputTooLarge as exc:
        return NodeObservation(name=node.name, reachable=True, probe_error=exc.message)
    except RemoteError as exc:
        return NodeObservation(name=node.name, reachable=False, error=exc.message)
    try:
        return parse_probe(desired, node, result.stdout)
    except ProbeError as exc:
        return NodeObservation(name=node.name, reachable=True, probe_error=str(exc))


def observe(desired: Desired, sessions: Sessions, timeout: float = 20.0, cancel: threading.Event | None = None,
            ask_flags: bool = True) -> tuple[Observed, dict[str, float]]:
    """Probe all nodes in parallel (an unreachable node never stalls the others); also return seconds per node.
    `cancel` (the daemon's shutdown) ends a probe that waits on a hung node within a second, not its timeout.
    `ask_flags`: also ask the serving image for its flags here and now when a serving (re)start is planned (the
    one-shot commands: asking imports torch, tens of seconds); the daemon asks every image id beside its loop
    instead (`reconciler.loop.operations.FlagsQuery`)."""
    durations: dict[str, float] = {}

    def one(node: Node) -> NodeObservation:
        start = time.perf_counter()
        try:
            return observe_node(desired, sessions, node, timeout, cancel)
        finally:
            durations[node.name] = time.perf_counter() - start

    with ThreadPoolExecutor(max_workers=max(1, len(desired.nodes))) as pool:
        results = list(pool.map(one, desired.nodes))
    observed = Observed(nodes={r.name: r for r in results})
    if ask_flags and (wanted := flags_wanted(desired, observed)) and _starts_serving(desired, observed):
        holder, image_id = wanted
        observed = observed.model_copy(update={"serve_flags": flags_once(desired, sessions, holder, image_id)})
    return observed, durations


def _starts_serving(desired: Desired, observed: Observed) -> bool:
    """Whether a plan of this observation (no answer from the image yet) would start serving: only then is the
    image asked, and the answer then judges that start (core.planning._image_refuses)."""
    return any(s.kind == "start-serving" for s in plan(desired, observed).steps)
