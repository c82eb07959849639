"""Human-readable output: the plan like `terraform plan` (grouped by node, +/-/~, with reasons).

The text `plan` and `apply` print (`apply` is given it: the loop imports no CLI); the demo shows the same. Every
line goes through `printable` (reconciler/core/text.py): node names are validated, but drift values, container names,
image references, reasons and messages are read from the nodes, and no escape sequence or line break of theirs
reaches a terminal.
"""

from __future__ import annotations

from reconciler.core.kinds import KINDS
from reconciler.core.observed import NodeObservation, Observed
from reconciler.core.planning import Plan
from reconciler.core.spec import format_duration
from reconciler.core.text import printable


def plan_text(plan: Plan) -> str:
    lines: list[str] = []
    if plan.trusted:  # every time: the opt-ins are root-equivalent on the serving nodes (docs/security.md)
        lines += [f"Trusted beyond the default (trust): {', '.join(plan.trusted)}.", ""]
    if not plan.drift and not plan.steps:
        return _join([*lines, "No changes. The cluster matches the desired state."])
    lines += _serving_change(plan)
    lines += _drift_lines(plan)
    if plan.mode != "enforce":
        lines += ["", f"Mode is {plan.mode}: no steps will run."]
    elif plan.steps:
        lines += _step_lines(plan)
    if any(s.kind == "start-serving" for s in plan.steps):
        lines += ["", f"Serving starts with ulimits {' '.join(plan.ulimits) or '(none)'} (serving.docker.ulimits "
                      "merged over the defaults)."]
    if plan.blocked:
        lines += ["", "Blocked:", *(f"  ! {b.node}: {b.reason}" for b in plan.blocked)]
    counts = {k: sum(1 for s in plan.steps if KINDS[s.kind].sign == k) for k in "+~-"}
    lines += ["", f"Plan: {counts['+']} to start/copy, {counts['~']} to change, {counts['-']} to stop; "
                 f"{len(plan.blocked)} blocked."]
    return _join(lines)


def _drift_lines(plan: Plan) -> list[str]:
    """The drift, by node, each with whether it blocks or is only reported."""
    lines = ["Drift:" if plan.drift else "Drift: none."]
    for node in dict.fromkeys(d.node for d in plan.drift):
        lines.append(f"  node {node}")
        for d in (x for x in plan.drift if x.node == node):
            flag = " [blocking]" if d.blocking else ("" if d.actionable else " [report only]")
            lines.append(f"    ~ {d.kind:<10} {d.resource}: expected {d.expected}; observed {d.observed}{flag}")
    return lines


def _step_lines(plan: Plan) -> list[str]:
    """The steps by node, numbered in execution order, each with its kind's sign and the numbers it comes after."""
    lines = ["", "Steps (numbered in execution order):"]
    order = {s.id: i for i, s in enumerate(plan.steps, start=1)}
    for node in dict.fromkeys(s.node for s in plan.steps):
        lines.append(f"  node {node}")
        for s in (x for x in plan.steps if x.node == node):
            after = f" (after {', '.join(str(order[a]) for a in s.after)})" if s.after else ""
            lines.append(f"    {order[s.id]:>2}. {KINDS[s.kind].sign} {s.id}: {s.reason}{after}")
            lines += [f"          - {printable(item)}" for item in s.remove or ()]
    return lines


_CHANGE_SIGN = {"changed": "~", "added": "+", "removed": "-"}


def _serving_change(plan: Plan) -> list[str]:
    """Up front, like `terraform plan`'s replacements: the outage a serving restart is, then each launch field
    that forces it, once with the nodes it differs on (`~ serving.max_model_len = 32768 -> 65536  # forces
    replacement: head, worker1`; a secret only as `secret NAME changed`), then the ranks that restart with them."""
    lines = []
    if down := plan.downtime:
        lines.append(f"This plan stops serving on {len(down.nodes)} node{'s' if len(down.nodes) != 1 else ''} "
                     f"({', '.join(down.nodes)}): the API is down for about one cold start (serving.health_timeout: "
                     f"up to {format_duration(down.health_timeout)}).")
    elif plan.field_changes:
        lines.append("Serving launch fields that differ from the running containers:")
    nodes_of: dict[str, list[str]] = {}  # a secret's words, unlike its fingerprints, are the same on every node
    for node, change in plan.field_changes:
        nodes_of.setdefault(f"{_CHANGE_SIGN[change.action]} {change.words()}", []).append(node)
    lines += [f"  {words}  # forces replacement: {', '.join(nodes)}" for words, nodes in nodes_of.items()]
    if down and down.restart_with:
        lines.append(f"  {', '.join(down.restart_with)} restart{'s' if len(down.restart_with) == 1 else ''} too, "
                     "though nothing of their own changed: the ranks of one tensor-parallel group start together.")
    return [*lines, ""] if lines else []


def observed_text(observed: Observed) -> str:
    """One block per node: reachability, containers, link, memory, weights, serving."""
    lines = []
    for name, n in observed.nodes.items():
        lines += _node_lines(name, n) if n.reachable else [f"node {name}: UNREACHABLE ({n.error})"]
    if answer := observed.serve_flags:
        ray = {True: "yes", False: "no", None: "unknown"}[answer.has_ray]
        said = ("asking" if answer.pending else f"could not be asked: {answer.error}" if answer.error else
                f"vLLM {answer.version or '(version not said)'}, {len(answer.flags)} serve flags, ray {ray}")
        lines.append(f"serving image {answer.image_id[:19]}: {said}")
    return _join(lines)


def _node_lines(name: str, n: NodeObservation) -> list[str]:
    """A reachable node's block: its machine, docker, then what it holds and runs."""
    lines = [f"node {name}: reachable{', ' + n.machine if n.machine else ''}, "
             f"docker {'ok' if n.docker_reachable else n.docker_error}"]
    lines += [f"  container {c.name:<20} {c.state:<8} {c.image}{' [managed]' if c.managed else ''}"
              for c in n.containers]
    for f in n.links():
        rdma = f", rdma {f.rdma.state} / {f.rdma.phys_state}" if f.rdma else ""
        lines.append(f"  fabric {f.name}: {'up' if f.up else 'DOWN'}, mtu {f.mtu}, "
                     f"{', '.join(f.addresses) or 'no address'}{rdma}")
    return lines + _holdings_lines(n)


def _holdings_lines(n: NodeObservation) -> list[str]:
    """A node's memory, weights, images and serving API."""
    gib = 2**30
    lines = []
    if n.memory:
        lines.append(f"  memory {n.memory.available_bytes / gib:.1f} GiB available of "
                     f"{n.memory.total_bytes / gib:.1f} GiB")
    if n.weights:
        lines.append(f"  weights {n.weights.root}: " + (f"{len(n.weights.files)} files, "
                     f"{n.weights.total_bytes} bytes" if n.weights.present else "absent"))
    for ref, image in n.images.items():
        lines.append(f"  image {ref}: {image.id[:19]} ({image.platform + ', ' if image.platform else ''}"
                     f"content {image.content[:19]}{', ' + image.store + ' store' if image.store else ''})")
    if n.serving:
        s = n.serving
        lines.append(f"  serving: {'healthy' if s.healthy else 'not healthy'}"
                     f"{', models ' + ', '.join(s.models) if s.models else ''}")
    return lines


def _join(lines: list[str]) -> str:
    """The lines as text: each made printable, so a line break or an escape inside a value stays visible text."""
    return "\n".join(printable(line) for line in lines) + "\n"
