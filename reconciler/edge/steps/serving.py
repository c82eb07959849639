"""Starting vLLM across the nodes and waiting for it to serve.

The launch itself is rendered by `reconciler.core.vllm` (pure); here it is run: a memory preflight (GB10 memory is
unified, and a start that overshoots wedges the node), removal of our own stopped container of the same name (no
"name already in use"), `docker run` with the labels that carry the spec hash, and for the head the wait for
/health, /v1/models and one completion under its own deadline: a 119 GB cold start takes many minutes, far
beyond a step timeout. Meanwhile every poll reads the head container's recent log and reports vLLM's stage and
last meaningful line (`reconciler.core.vllm_log`), so `apply`, /status and the metrics show the cold start move.
A container that exits while we wait fails the step at once with its last log lines.
"""

from __future__ import annotations

from reconciler.core.drift import image_holder
from reconciler.core.fabric import carrying_rdma_devices
from reconciler.core.observed import LABEL_SPEC_HASH, Memory
from reconciler.core.planning import Step, kind_and_node
from reconciler.core.vllm import (
    LaunchSpec,
    at_start,
    cache_dirs,
    launch_specs,
    memory_needed,
    memory_words,
    weights_size,
)
from reconciler.core.vllm_log import MAX_TEXT, StartProgress, start_progress
from reconciler.edge.probes import count_ray_nodes, ray_script, read_api, read_memory, read_sections
from reconciler.edge.ssh import RemoteError, quote
from reconciler.edge.steps import StepBlocked, StepContext, StepDeferred, StepFailed, note_copy, wait_for
from reconciler.edge.steps.containers import inspect, owner_problem

GIB = 2**30
# Where vLLM's Ray executor looks for the names it must not copy from the driver to the workers:
# $VLLM_CONFIG_ROOT, default $XDG_CONFIG_HOME/vllm or ~/.config/vllm (vllm/envs.py, vllm/ray/ray_env.py).
NON_CARRY_OVER_WRITE = ('d="${VLLM_CONFIG_ROOT:-${XDG_CONFIG_HOME:-$HOME/.config}/vllm}"; mkdir -p "$d" && '
                        'cat > "$d/ray_non_carry_over_env_vars.json"')


def spec_for(ctx: StepContext, node: str) -> LaunchSpec:
    """The launch of `node`, labelled with this cluster's instance label (the head's cluster id when the plan's
    observation read it)."""
    return next(s for s in launch_specs(ctx.desired, ctx.owner.label) if s.node == node)


def _memory(ctx: StepContext, node: str) -> Memory:
    memory = read_memory(ctx.sessions[node], ctx.command_timeout)
    if memory is None:
        raise StepFailed(f"/proc/meminfo on {node} did not answer")
    return memory


#: How long a start waits for memory a stop on its node just released. GB10 hands a stopped generation's memory
#: back with a lag of up to a minute (sovgrid.org, "SGLang Restart OOM Fix"); past this the start is deferred to
#: the next reconcile, not failed.
MEMORY_SETTLE = 90.0
SETTLE_POLL = 2.0  # seconds between the reads of MemAvailable meanwhile
START_RESERVE = 70.0  # what the start needs of its step after the wait: `docker run` and 60 s to see it running


def _after_a_stop(step: Step) -> bool:
    """The plan ran a stop on this step's node before it (our generation's or a co-tenant's)."""
    return any(kind_and_node(a) in (("stop-serving", step.node), ("stop-container", step.node)) for a in step.after)


def make_cache_dirs(session, dirs: list[str], timeout: float) -> None:
    """The kept compile caches' host directories, made by the SSH user (`docker run` would make them as root) and
    0700: the serving container's root writes into them, and Docker offers no `nosuid` for a bind mount, so a
    setuid file it left there must be out of every other local user's reach (issue 31, item 18)."""
    session.run(["sh", "-c", 'mkdir -p -- "$@" && chmod 0700 -- "$@"', "sh", *dirs], timeout=timeout)


def _drop_caches(ctx: StepContext, node: str) -> None:
    """Write the weights' filesystem back, then drop the clean page cache: before every start, not only when
    MemAvailable is short. On GB10 MemAvailable counts the clean cache as free while the GPU driver does not
    (vllm-project/vllm#35313: vLLM's startup check fails; NV_ERR_NO_MEMORY, vllm-project/vllm#56824), so the cache
    after a weights copy, or of warm shards, is exactly what makes a start that passed the preflight fail; NVIDIA's
    vLLM playbook flushes it by hand, and MiaAI-Lab/GLM-5.3-Flash-EXL3-2x-DGX-Sparks#47 on both nodes before every
    launch. drop_caches frees clean pages only ("will not free any dirty objects", kernel vm.rst), hence the
    `sync -f` of the weights' filesystem first (no root needed; not every mount: a hung NFS one would hold the
    start; past its deadline, go on). A node whose sudoers lacks the line (`reconciler sudoers FILE`) is said and
    the start goes on: the preflight and vLLM's own check still guard it."""
    try:
        ctx.sessions[node].run(["sync", "-f", ctx.desired.model.path_on(node)], timeout=ctx.command_timeout)
    except RemoteError as exc:
        ctx.progress("serving.sync-skipped", {"node": node, "error": exc.message[:200]})
    try:
        ctx.sessions[node].run(["/usr/sbin/sysctl", "-w", "vm.drop_caches=3"], sudo=True, timeout=ctx.command_timeout)
    except RemoteError as exc:
        ctx.progress("serving.drop-caches-refused", {"node": node, "error": exc.message[:200]})


def memory_preflight(ctx: StepContext, node: str, settle: float = 0.0) -> None:
    """MemAvailable must cover `memory_needed` (`memory_terms`), after the page cache is dropped (policy.drop_caches,
    on by default: `_drop_caches`). With `settle`
    (a stop on this node just ran), MemAvailable is read again every 2 s up to that many seconds before the start
    is deferred (StepDeferred: not counted toward holds); without, a short node blocks at once."""
    policy = ctx.desired.policy
    if policy.drop_caches:
        _drop_caches(ctx, node)
    memory = _memory(ctx, node)
    weights = weights_size(ctx.desired, ctx.observed)
    need = memory_needed(ctx.desired, memory.total_bytes, weights)
    after_stop, settle = settle > 0, min(settle, ctx.remaining() - START_RESERVE)  # the start must fit after it
    if memory.available_bytes < need and settle > 0:
        seen = [memory]

        def returned() -> bool:
            seen.append(_memory(ctx, node))
            return seen[-1].available_bytes >= need

        try:
            wait_for(returned, timeout=settle, interval=SETTLE_POLL, what="memory", cancel=ctx.cancel)
        except StepFailed:
            if ctx.cancel.is_set():
                raise  # a shutdown is no deferral
        memory = seen[-1]
    if memory.available_bytes < need:
        short = (f"{node}: {memory.available_bytes / GIB:.1f} GiB available, but "
                 f"{memory_words(ctx.desired, memory.total_bytes, weights)} is needed")
        if after_stop:
            raise StepDeferred(f"{short}, {max(settle, 0):.0f} s after the stop on {node} (GB10 returns a stopped "
                               "generation's memory with a lag); tried again at the next reconcile")
        raise StepBlocked(short)


def logs_tail(ctx: StepContext, node: str, name: str, lines: int = 15) -> str:
    result = ctx.sessions[node].run(["docker", "logs", "--tail", str(lines), name], timeout=ctx.command_timeout,
                                    check=False)
    return (result.stdout + result.stderr).strip()[-1500:]


def start_serving(ctx: StepContext, step: Step) -> None:
    node = step.node
    spec = at_start(spec_for(ctx, node), carrying_rdma_devices(ctx.desired.node(node), ctx.observed.node(node)))
    info = inspect(ctx, node, spec.container_name)
    if info is not None:
        if (problem := owner_problem(ctx, node, spec.container_name, info)) is not None:
            raise StepBlocked(f"{spec.container_name} exists and is not ours to replace: {problem}")
        labels = info["Config"].get("Labels") or {}
        if info["State"]["Running"] and labels.get(LABEL_SPEC_HASH) == spec.spec_hash:
            return  # already what we want (a crash after `docker run`, before the step was recorded)
        if info["State"]["Running"]:
            raise StepFailed(f"{spec.container_name} on {node} runs another spec; the plan stops it first")
        ctx.sessions[node].run(["docker", "rm", spec.container_name], timeout=ctx.command_timeout)
    memory_preflight(ctx, node, MEMORY_SETTLE if _after_a_stop(step) else 0.0)
    _note_use(ctx, node, spec)
    session = ctx.sessions[node]
    if dirs := cache_dirs(ctx.desired, ctx.desired.node(node)):
        make_cache_dirs(session, list(dirs.values()), ctx.command_timeout)
    # The environment reaches the docker CLI on its stdin: `--env-file /dev/stdin` (the CLI opens the path like
    # any file, and sshd hands a command's stdin over as a pipe). So no value is on a command line (`ps`, error
    # messages) and none is ever on a node's disk, where a daemon killed between writing and removing a temp file
    # would leave the secret behind.
    session.run(["docker", *spec.run_argv(ctx.generation, env_file="/dev/stdin")],
                stdin=spec.env_file_text().encode(), timeout=ctx.command_timeout)

    def running() -> bool:
        state = (inspect(ctx, node, spec.container_name) or {}).get("State", {})
        if state.get("Status") in ("exited", "dead"):
            raise StepFailed(f"{spec.container_name} on {node} exited with {state.get('ExitCode')} at start:\n"
                             + logs_tail(ctx, node, spec.container_name))
        return bool(state.get("Running"))

    wait_for(running, timeout=ctx.remaining(60), what=f"{spec.container_name} to run on {node}", cancel=ctx.cancel)


def _note_use(ctx: StepContext, node: str, spec: LaunchSpec) -> None:
    """The copy ledger's `served` lines, before the start (a crash after it still counts as a use): the last use
    orders what retention keeps for a rollback (core/retention.py). The image is the plan's reference content: the
    image step before this one made the node's copy that content, or the start would not run."""
    holder = image_holder(ctx.desired, ctx.observed)
    image = ctx.observed.node(holder).images.get(spec.image) if holder else None
    note_copy(ctx, node, ("served", "weights", spec.weights, "-"),
              *([("served", "image", image.content, "-")] if image else []))


def launch_model(ctx: StepContext, step: Step) -> None:
    """Ray launcher: once every node joined the head's Ray cluster, run `vllm serve` inside the head container."""
    node, spec = step.node, spec_for(ctx, step.node)
    nodes = len(ctx.desired.serving_nodes)
    session = ctx.sessions[node]

    def joined() -> bool:
        status = read_sections(session, ray_script(spec.container_name), ctx.command_timeout).get("ray")
        return status is not None and status.rc == 0 and count_ray_nodes(status.body) >= nodes

    wait_for(joined, timeout=ctx.remaining(120), interval=0.5, what=f"{nodes} nodes in `ray status`",
             cancel=ctx.cancel)
    running = session.run(["docker", "exec", spec.container_name, "sh", "-c", "ps -eo args | grep -c '[v]llm serve'"],
                          timeout=ctx.command_timeout, check=False).stdout.strip()
    if running not in ("", "0"):
        return
    assert spec.serve_exec is not None
    # Before `vllm serve` imports vllm.ray.ray_env, which reads the file once (path: vllm/envs.py VLLM_CONFIG_ROOT).
    session.run(["docker", "exec", "-i", spec.container_name, "sh", "-c", NON_CARRY_OVER_WRITE],
                stdin=spec.non_carry_over_json().encode(), timeout=ctx.command_timeout)
    # Under the image's Entrypoint (`Step.wrapper`, from the plan): `docker exec` would bypass NGC's CUDA setup.
    argv = (*(step.wrapper or ()), *spec.serve_exec)
    session.run(["docker", "exec", "-d", spec.container_name, "sh", "-c",
                 f"exec {quote(argv)} >/proc/1/fd/1 2>/proc/1/fd/2"], timeout=ctx.command_timeout)


#: The head's log read each poll of the health wait: its last lines, at most MAX_TEXT bytes of them
#: (cut on the node: tqdm redraws a bar on one ever longer line), under a deadline of its own.
START_LOG_LINES = 200
START_LOG_DEADLINE = 10.0
HEALTH_POLL = 1.0  # seconds between the health wait's polls
_START_LOG = 'docker logs --tail "$1" "$2" 2>&1 | tail -c "$3"'


class StartWatch:
    """The cold start as the head's log tells it: reported when it changes, `serving.stage` on a new stage (logged
    at info), `serving.progress` on a new line or percent within it. A log that cannot be read or says nothing
    vLLM would is no failure of the wait: the last report stands."""

    def __init__(self, ctx: StepContext, node: str, container: str):
        self.ctx, self.node, self.container = ctx, node, container
        self.last = StartProgress("waiting", None, "")
        self._report("serving.stage")

    def poll(self) -> None:
        try:
            result = self.ctx.sessions[self.node].run(
                ["sh", "-c", _START_LOG, "sh", str(START_LOG_LINES), self.container, str(MAX_TEXT)],
                timeout=min(START_LOG_DEADLINE, self.ctx.command_timeout), check=False)
        except RemoteError:
            return
        seen = start_progress(result.stdout)
        if seen is None or seen == self.last:
            return
        event = "serving.stage" if seen.stage != self.last.stage else "serving.progress"
        self.last = seen
        self._report(event)

    def served(self) -> None:
        """The API serves: the wait is over (the last line read may be older than that)."""
        self.last = StartProgress("serving", None, "")
        self._report("serving.done")

    def _report(self, event: str) -> None:
        self.ctx.progress(event, {"node": self.node, "stage": self.last.stage, "percent": self.last.percent,
                                  "line": self.last.line})


def await_health(ctx: StepContext, step: Step) -> None:
    """Wait for /health == 200, the served name in /v1/models and one answered completion (the whole
    tensor-parallel group works, not only the API process), under serving.health_timeout. The API is read by the
    probe's own fragment and parser (`probes.read_api`); until it serves, each poll reports where the cold start
    is (`StartWatch`)."""
    d = ctx.desired
    head, want = step.node, d.served_name
    session = ctx.sessions[head]
    watch = StartWatch(ctx, head, spec_for(ctx, head).container_name)

    def healthy() -> bool:
        for spec in launch_specs(d):
            state = (inspect(ctx, spec.node, spec.container_name) or {}).get("State", {})
            if not state.get("Running"):
                raise StepFailed(f"{spec.container_name} on {spec.node} is {state.get('Status', 'missing')} "
                                 f"(exit {state.get('ExitCode')}) while waiting for health:\n"
                                 + logs_tail(ctx, spec.node, spec.container_name))
        if read_api(session, d, ctx.command_timeout).serves(want):
            return True
        watch.poll()
        return False

    wait_for(healthy, timeout=min(d.serving.health_timeout, ctx.remaining()), interval=HEALTH_POLL, cancel=ctx.cancel,
             what=f"http://127.0.0.1:{d.serving.port}/health on {head}, {want!r} in /v1/models and one completion")
    watch.served()
