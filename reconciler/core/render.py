"""Human-readable output: the plan like `terraform plan` (grouped by node, +/-/~, with reasons).

Kept apart from the CLI so the daemon's log and the demo show the same text. Every line goes through
`printable` (reconciler/core/text.py): node names are validated, but drift values, container names, image references,
reasons and messages are read from the nodes, and no escape sequence or line break of theirs reaches a terminal.
"""

from __future__ import annotations

from reconciler.core.observed import Observed
from reconciler.core.planning import Plan
from reconciler.core.text import printable

_SIGN = {"stop-container": "-", "stop-serving": "-", "link": "~", "prune-weights": "-", "prune-images": "-",
         "download": "+", "pull-image": "+", "image": "+", "weights": "+",
         "start-serving": "+", "launch-model": "+", "await-health": "?"}


def plan_text(plan: Plan) -> str:
    lines: list[str] = []
    if plan.trusted:  # every time: the opt-ins are root-equivalent on the serving nodes (docs/security.md)
        lines += [f"Trusted beyond the default (trust): {', '.join(plan.trusted)}.", ""]
    if not plan.drift and not plan.steps:
        return _join([*lines, "No changes. The cluster matches the desired state."])
    lines.append("Drift:" if plan.drift else "Drift: none.")
    for node in dict.fromkeys(d.node for d in plan.drift):
        lines.append(f"  node {node}")
        for d in (x for x in plan.drift if x.node == node):
            flag = " [blocking]" if d.blocking else ("" if d.actionable else " [report only]")
            lines.append(f"    ~ {d.kind:<10} {d.resource}: expected {d.expected}; observed {d.observed}{flag}")
    if plan.mode != "enforce":
        lines += ["", f"Mode is {plan.mode}: no steps will run."]
    elif plan.steps:
        lines += ["", "Steps (numbered in execution order):"]
        order = {s.id: i for i, s in enumerate(plan.steps, start=1)}
        for node in dict.fromkeys(s.node for s in plan.steps):
            lines.append(f"  node {node}")
            for s in (x for x in plan.steps if x.node == node):
                after = f" (after {', '.join(str(order[a]) for a in s.after)})" if s.after else ""
                lines.append(f"    {order[s.id]:>2}. {_SIGN[s.kind]} {s.id}: {s.reason}{after}")
                lines += [f"          - {printable(item)}" for item in s.remove or ()]
    if any(s.kind == "start-serving" for s in plan.steps):
        lines += ["", f"Serving starts with ulimits {' '.join(plan.ulimits) or '(none)'} (serving.docker.ulimits "
                      "merged over the defaults)."]
    if plan.blocked:
        lines += ["", "Blocked:"]
        for b in plan.blocked:
            lines.append(f"  ! {b.node}: {b.reason}")
    counts = {k: sum(1 for s in plan.steps if _SIGN[s.kind] == k) for k in "+~-"}
    lines += ["", f"Plan: {counts['+']} to start/copy, {counts['~']} to change, {counts['-']} to stop; "
                 f"{len(plan.blocked)} blocked."]
    return _join(lines)


def observed_text(observed: Observed) -> str:
    """One block per node: reachability, containers, link, memory, weights, serving."""
    gib = 2**30
    lines = []
    for name, n in observed.nodes.items():
        if not n.reachable:
            lines.append(f"node {name}: UNREACHABLE ({n.error})")
            continue
        lines.append(f"node {name}: reachable{', ' + n.machine if n.machine else ''}, "
                     f"docker {'ok' if n.docker_reachable else n.docker_error}")
        for c in n.containers:
            lines.append(f"  container {c.name:<20} {c.state:<8} {c.image}{' [managed]' if c.managed else ''}")
        for f in n.links():
            rdma = f", rdma {f.rdma.state} / {f.rdma.phys_state}" if f.rdma else ""
            lines.append(f"  fabric {f.name}: {'up' if f.admin_up and f.carrier else 'DOWN'}, mtu {f.mtu}, "
                         f"{', '.join(f.addresses) or 'no address'}{rdma}")
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
    if answer := observed.serve_flags:
        ray = {True: "yes", False: "no", None: "unknown"}[answer.has_ray]
        said = ("asking" if answer.pending else f"could not be asked: {answer.error}" if answer.error else
                f"vLLM {answer.version or '(version not said)'}, {len(answer.flags)} serve flags, ray {ray}")
        lines.append(f"serving image {answer.image_id[:19]}: {said}")
    return _join(lines)


def _join(lines: list[str]) -> str:
    """The lines as text: each made printable, so a line break or an escape inside a value stays visible text."""
    return "\n".join(printable(line) for line in lines) + "\n"


def status_text(doc: dict) -> str:
    """`reconciler status`: the phase, generations, then a condition table (cluster first, then per node).

    Every cell is a rich `Text` of printable text, never a markup string: a message holding `[/rank0]` (vLLM's
    log prefix) once crashed rich's markup parser, and `[bold]` from a node must print as written."""
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    def cell(value: object) -> Text:
        return Text(printable(str(value)))

    table = Table(title=cell(f"phase {doc.get('phase')}  generation {doc.get('generation')}  observed "
                             f"{doc.get('observedGeneration')}"), title_justify="left")
    for column in ("node", "condition", "status", "reason", "message"):
        table.add_column(column, overflow="fold")
    for c in doc.get("conditions", []):
        table.add_row(*map(cell, (c["node"] or "(cluster)", c["type"], c["status"], c["reason"], c["message"][:160])))
    ops = Table(title="operations in flight", title_justify="left")
    for column in ("step", "state", "running", "deadline in", "progress"):
        ops.add_column(column, overflow="fold")
    for o in doc.get("operations", []):
        total = o.get("bytesTotal")
        rate = o.get("bytesPerSecond")
        progress = (f"{o.get('bytesDone', 0) / 2**20:.0f} / {total / 2**20:.0f} MiB"
                    + (f" at {rate / 2**20:.0f} MiB/s" if rate else "")) if total else ""
        ops.add_row(*map(cell, (o["step"], o["state"], f"{o['seconds']:.0f}s", f"{o['deadlineIn']:.0f}s", progress)))
    console = Console(width=140, record=True, force_terminal=False)
    with console.capture() as captured:
        console.print(table)
        if doc.get("operations"):
            console.print(ops)
        if doc.get("lastError"):
            console.print(cell(f"last error: {doc['lastError']}"))
    return captured.get()
