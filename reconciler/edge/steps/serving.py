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

from collections.abc import Callable, Generator
from typing import Any

from reconciler.core.drift import image_holder
from reconciler.core.fabric import rdma_at_start
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
from reconciler.core.vllm_log import StartProgress, start_progress
from reconciler.edge.facts.containers import ContainerState, container_fact, log_tail_fact
from reconciler.edge.facts.memory import MEMORY, rank_fact
from reconciler.edge.facts.serving import StartSeen, ray_nodes_fact, serve_processes_fact, start_fact
from reconciler.edge.facts.verify import VerifyAnswer, shown, verify_fact
from reconciler.edge.ssh import Cancelled, CommandFailed, RemoteError, quote
from reconciler.edge.steps import note
from reconciler.edge.steps.actions import (
    Action,
    Actions,
    Given,
    Read,
    Report,
    Run,
    StepBlocked,
    StepCancelled,
    StepDeferred,
    StepFailed,
    StepTimedOut,
    read,
    wait,
)
from reconciler.edge.steps.containers import owner_problem

GIB = 2**30
# Where vLLM's Ray executor looks for the names it must not copy from the driver to the workers:
# $VLLM_CONFIG_ROOT, default $XDG_CONFIG_HOME/vllm or ~/.config/vllm (vllm/envs.py, vllm/ray/ray_env.py).
NON_CARRY_OVER_WRITE = ('d="${VLLM_CONFIG_ROOT:-${XDG_CONFIG_HOME:-$HOME/.config}/vllm}"; mkdir -p "$d" && '
                        'cat > "$d/ray_non_carry_over_env_vars.json"')

#: How long a start waits for memory a stop on its node just released. GB10 hands a stopped generation's memory
#: back with a lag of up to a minute (sovgrid.org, "SGLang Restart OOM Fix"); past this the start is deferred to
#: the next reconcile, not failed.
MEMORY_SETTLE = 90.0
SETTLE_POLL = 2.0  # seconds between the reads of MemAvailable meanwhile
START_RESERVE = 70.0  # what the start needs of its step after the wait: `docker run` and 60 s to see it running
RUNNING_WITHIN = 60.0  # seconds for a started container to show as running
JOINED_WITHIN = 120.0  # seconds for every node to join the head's Ray cluster
HEALTH_POLL = 1.0  # seconds between the health wait's polls
WORKERS_EVERY = 5  # polls of the head between two reads of the other nodes' containers in the health wait


def spec_for(given: Given, node: str) -> LaunchSpec:
    """The launch of `node`, labelled with this cluster's instance label (the head's cluster id when the plan's
    observation read it)."""
    return next(s for s in launch_specs(given.desired, given.owner.label) if s.node == node)


def _after_a_stop(step: Step) -> bool:
    """The plan ran a stop on this step's node before it (our generation's or a co-tenant's)."""
    return any(kind_and_node(a) in (("stop-serving", step.node), ("stop-container", step.node)) for a in step.after)


CACHE_DIR_LINKED = 3  # the exit status of CACHE_DIRS when a cache directory is a link (its path on stdout)
# Each directory "$d" (absolute, normalized): refused when it is a link (its path printed, exit CACHE_DIR_LINKED),
# else made, entered from its parent with `cd -P` and checked to be where the parent's physical path says (a link
# swapped in since the first look is refused the same way), and chmodded from inside (`chmod .`: the directory
# just checked, never what a name leads to). Links above the directory (a home, ~/.cache) are its owner's.
CACHE_DIRS = (f'for d; do if [ -L "$d" ]; then printf \'%s\\n\' "$d"; exit {CACHE_DIR_LINKED}; fi; '
              'mkdir -p -- "$d" || exit 1; '
              '(cd -P -- "${d%/*}/" || exit 1; p=$(pwd -P); cd -P -- "./${d##*/}" || exit 1; '
              f'[ "$(pwd -P)" = "${{p%/}}/${{d##*/}}" ] || {{ printf \'%s\\n\' "$d"; exit {CACHE_DIR_LINKED}; }}; '
              'chmod 0700 .) || exit; done')


def cache_dirs_argv(dirs: list[str]) -> tuple[str, ...]:
    """The kept compile caches' host directories, made by the SSH user (`docker run` would make them as root) and
    0700: the serving container's root writes into them, and Docker offers no `nosuid` for a bind mount, so a
    setuid file it left there must be out of every other local user's reach (issue 31, item 18). A directory that
    is a link is refused, never followed (`CACHE_DIRS`): `mkdir -p` and `chmod` went through a link planted at
    `~/.cache/vllm` by anyone who can write `~/.cache` (a co-tenant container that mounts it), and docker's `-v`
    would have mounted where it leads into the serving container, as root (issue 53, finding M)."""
    return ("sh", "-c", CACHE_DIRS, "sh", *dirs)


def _drop_caches(given: Given, node: str) -> Actions:
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
        yield Run(node, ("sync", "-f", given.desired.model.path_on(node)))
    except RemoteError as exc:
        yield Report("serving.sync-skipped", {"node": node, "error": exc.message[:200]})
    try:
        yield Run(node, ("/usr/sbin/sysctl", "-w", "vm.drop_caches=3"), sudo=True)
    except RemoteError as exc:
        yield Report("serving.drop-caches-refused", {"node": node, "error": exc.message[:200]})


def _memory(node: str, memory: Memory | None) -> Memory:
    if memory is None:
        raise StepFailed(f"/proc/meminfo on {node} did not answer")
    return memory


def memory_preflight(given: Given, node: str, after_stop: bool) -> Actions:
    """MemAvailable must cover `memory_needed` (`memory_terms`), after the page cache is dropped (policy.drop_caches,
    on by default: `_drop_caches`). After a stop on this node, MemAvailable is read again every SETTLE_POLL s up to
    MEMORY_SETTLE s (never into the START_RESERVE the start itself needs) before the start is deferred
    (StepDeferred: not counted toward holds); without one, a short node blocks at once."""
    desired = given.desired
    if desired.policy.drop_caches:
        yield from _drop_caches(given, node)
    memory = _memory(node, (yield from read(node, MEMORY)))
    weights = weights_size(desired, given.observed)
    need = memory_needed(desired, memory.total_bytes, weights)
    if memory.available_bytes < need and after_stop:
        seen = [memory]

        def returned(now: Memory | None) -> bool:
            seen.append(_memory(node, now))
            return seen[-1].available_bytes >= need

        try:
            yield from wait(Read(node, MEMORY), returned, timeout=MEMORY_SETTLE, interval=SETTLE_POLL,
                            reserve=START_RESERVE, what="memory")
        except StepTimedOut:
            pass  # decided below on the last read (a cancel, StepCancelled, is no deferral: it goes on up)
        memory = seen[-1]
    if memory.available_bytes < need:
        short = (f"{node}: {memory.available_bytes / GIB:.1f} GiB available, but "
                 f"{memory_words(desired, memory.total_bytes, weights)} is needed")
        if after_stop:
            raise StepDeferred(f"{short}, up to {MEMORY_SETTLE:.0f} s after the stop on {node} (GB10 returns a "
                               "stopped generation's memory with a lag); tried again at the next reconcile")
        raise StepBlocked(short)


def _failed(node: str, name: str, why: str) -> Generator[Action, Any, None]:
    """Fail the step saying `why`, with the container's last log lines."""
    tail = yield from read(node, log_tail_fact(name))
    raise StepFailed(f"{name} on {node} {why}:\n{tail}")


def _not_running(node: str, name: str, seen: ContainerState | None) -> Generator[Action, Any, None]:
    state, code = (seen.container.state, seen.exit_code) if seen is not None else ("missing", None)
    yield from _failed(node, name, f"is {state} (exit {code}) while waiting for health")


def start_serving(given: Given, step: Step) -> Actions:
    """`docker run` of this node's launch, after re-reading the container that holds its name (the plan may be
    minutes old): one already running with this spec is left alone, ours stopped is removed first, anyone else's
    blocks the start; then the memory preflight, the ledger's `served` lines and the kept caches' directories."""
    node, desired = step.node, given.desired
    spec = at_start(spec_for(given, node), rdma_at_start(desired.node(node), given.observed.node(node)))
    name = spec.container_name
    seen = yield from read(node, container_fact(name))
    if seen is not None:
        if (problem := owner_problem(given, node, seen.container)) is not None:
            raise StepBlocked(f"{name} exists and is not ours to replace: {problem}")
        if seen.container.running and seen.container.labels.get(LABEL_SPEC_HASH) == spec.spec_hash:
            return  # already what we want (a crash after `docker run`, before the step was recorded)
        if seen.container.running:
            raise StepFailed(f"{name} on {node} runs another spec; the plan stops it first")
        yield Run(node, ("docker", "rm", name))
    yield from memory_preflight(given, node, _after_a_stop(step))
    yield from _note_use(given, node, spec)
    if dirs := cache_dirs(desired, desired.node(node)):
        made = yield Run(node, cache_dirs_argv(list(dirs.values())), check=False)
        if made.exit_code == CACHE_DIR_LINKED:  # named by our own path, never by what the node printed
            linked = next((d for d in dirs.values() if d == made.stdout.strip()), " or ".join(dirs.values()))
            raise StepFailed(f"the compile cache directory {linked} on {node} is a symbolic link: refused, never "
                             "followed (docker would mount where it leads into the serving container, as root); "
                             "remove the link, or set serving.compile_cache to a directory only the SSH user can "
                             "write")
        if not made.ok:
            raise CommandFailed(node, cache_dirs_argv(list(dirs.values())), made.exit_code, made.stdout, made.stderr)
    # The environment reaches the docker CLI on its stdin: `--env-file /dev/stdin` (the CLI opens the path like
    # any file, and sshd hands a command's stdin over as a pipe). So no value is on a command line (`ps`, error
    # messages) and none is ever on a node's disk, where a daemon killed between writing and removing a temp file
    # would leave the secret behind.
    yield Run(node, ("docker", *spec.run_argv(given.generation, env_file="/dev/stdin")),
              stdin=spec.env_file_text().encode())
    started = yield from wait(Read(node, container_fact(name)),
                              lambda now: now is not None and (now.container.running
                                                               or now.container.state in ("exited", "dead")),
                              timeout=RUNNING_WITHIN, what=f"{name} to run on {node}")
    if not started.container.running:
        yield from _failed(node, name, f"exited with {started.exit_code} at start")


def _note_use(given: Given, node: str, spec: LaunchSpec) -> Actions:
    """The copy ledger's `served` lines, before the start (a crash after it still counts as a use): the last use
    orders what retention keeps for a rollback (core/retention.py). The image is the plan's reference content: the
    image step before this one made the node's copy that content, or the start would not run. Lines that cannot be
    written are reported, never a failure of the start: unrecorded, a copy is only kept longer (retention never
    removes what the ledger does not name)."""
    holder = image_holder(given.desired, given.observed)
    image = given.observed.node(holder).images.get(spec.image) if holder else None
    yield from note(given, node, ("served", "weights", spec.weights, "-"),
                    *([("served", "image", image.content, "-")] if image else []))


def launch_model(given: Given, step: Step) -> Actions:
    """Ray launcher: once every node joined the head's Ray cluster, run `vllm serve` inside the head container,
    unless it already runs there (a crash after the exec, before the step was recorded)."""
    node, spec = step.node, spec_for(given, step.node)
    name, nodes = spec.container_name, len(given.desired.serving_nodes)
    yield from wait(Read(node, ray_nodes_fact(name)), lambda joined: joined is not None and joined >= nodes,
                    timeout=JOINED_WITHIN, interval=0.5, what=f"{nodes} nodes in `ray status`")
    if (yield from read(node, serve_processes_fact(name))) > 0:
        return
    assert spec.serve_exec is not None, "a Ray launch has its `vllm serve`"
    # Before `vllm serve` imports vllm.ray.ray_env, which reads the file once (path: vllm/envs.py VLLM_CONFIG_ROOT).
    yield Run(node, ("docker", "exec", "-i", name, "sh", "-c", NON_CARRY_OVER_WRITE),
              stdin=spec.non_carry_over_json().encode())
    # Under the image's Entrypoint (`Step.wrapper`, from the plan): `docker exec` would bypass NGC's CUDA setup.
    argv = (*(step.wrapper or ()), *spec.serve_exec)
    yield Run(node, ("docker", "exec", "-d", name, "sh", "-c", f"exec {quote(argv)} >/proc/1/fd/1 2>/proc/1/fd/2"))


class StartWatch:
    """The cold start as the head's log tells it: reported when it changes, `serving.stage` on a new stage (logged
    at info), `serving.progress` on a new line or percent within it. A log that cannot be read or says nothing
    vLLM would is no failure of the wait: the last report stands. Pure state over the log's text."""

    def __init__(self, node: str):
        self.node = node
        self.last = StartProgress("waiting", None, "")

    def changed(self, log: str) -> bool:
        seen = start_progress(log)
        return seen is not None and seen != self.last

    def seen(self, log: str) -> Report | None:
        """The report of what the log says now, if it says something new."""
        seen = start_progress(log)
        if seen is None or seen == self.last:
            return None
        event = "serving.stage" if seen.stage != self.last.stage else "serving.progress"
        self.last = seen
        return self.report(event)

    def served(self) -> Report:
        """The API serves: the wait is over (the last line read may be older than that)."""
        self.last = StartProgress("serving", None, "")
        return self.report("serving.done")

    def report(self, event: str) -> Report:
        return Report(event, {"node": self.node, "stage": self.last.stage, "percent": self.last.percent,
                              "line": self.last.line})


def _poll_ends(watch: StartWatch, want: str, every: int | None) -> Callable[[StartSeen], bool]:
    """When a poll of the head ends the health wait's current round: the head's container is no longer running,
    the API serves, the log says something new, or (`every` polls) the other nodes' containers are due."""
    polls = [0]

    def ends(seen: StartSeen) -> bool:
        polls[0] += 1
        return (seen.container is None or not seen.container.container.running or seen.api.serves(want)
                or watch.changed(seen.log) or (every is not None and polls[0] >= every))
    return ends


def await_health(given: Given, step: Step) -> Actions:
    """Wait for /health == 200, the served name in /v1/models and one answered completion (the whole
    tensor-parallel group works, not only the API process), under serving.health_timeout (the step's own
    deadline: each round's wait is capped by what is left of it). Each poll reads the head's container, API and
    log in one round trip (`facts.serving.start_fact`); a change of the log is reported (`StartWatch`); the other nodes'
    containers are read every WORKERS_EVERY polls. A container that is not running fails the step with its last
    log lines. Once it serves, each rank's node is read (`rank_readings`), then serving.verify, when declared,
    asks its question (`verify_answer`): a wrong answer fails the step."""
    d = given.desired
    head, want = step.node, d.served_name
    specs = launch_specs(d)
    others = [s for s in specs if s.node != head]
    name = next(s.container_name for s in specs if s.node == head)
    watch = StartWatch(head)
    yield watch.report("serving.stage")
    what = f"http://127.0.0.1:{d.serving.port}/health on {head}, {want!r} in /v1/models and one completion"
    while True:
        for spec in others:
            other = yield from read(spec.node, container_fact(spec.container_name))
            if other is None or not other.container.running:
                yield from _not_running(spec.node, spec.container_name, other)
        try:
            seen = yield from wait(Read(head, start_fact(d, name)),
                                   _poll_ends(watch, want, WORKERS_EVERY if others else None),
                                   timeout=d.serving.health_timeout, interval=HEALTH_POLL, what=what)
        except StepTimedOut:  # a round's wait is capped by the step's deadline: say the whole allowance
            raise StepTimedOut(f"timed out after {d.serving.health_timeout:g}s waiting for {what}") from None
        if seen.container is None or not seen.container.container.running:
            yield from _not_running(head, name, seen.container)
        if seen.api.serves(want):
            yield watch.served()
            yield from rank_readings(given, specs)
            yield from verify_answer(given, head, seen.container.container.id)
            return
        if (report := watch.seen(seen.log)) is not None:
            yield report


def rank_readings(given: Given, specs: list[LaunchSpec]) -> Actions:
    """Once the deployment serves, each rank's node as it holds it now (`facts.memory.rank_fact`), reported twice:
    `serving.memory` (MemTotal, MemAvailable, the rank container's cgroup memory.current, the running containers):
    the status publisher judges it against the budget (`core.budget.overshoot`) into /status and
    `reconciler_memory_overshoot_bytes`, so an owner tunes policy.memory_overhead_per_instance and
    policy.memory_margin from the node's own numbers; and, for a deployment across nodes, `serving.transport`: the
    networks the rank's log says NCCL chose (`core.nccl`), judged into the condition NcclTransport and
    `reconciler_nccl_socket_fallback`. The API already serves: a node that does not answer is said
    (`serving.memory-unread`), never a failure of the step; a cancel still ends it."""
    d = given.desired
    weights = weights_size(d, given.observed)
    for spec in specs:
        try:
            seen = yield from read(spec.node, rank_fact(spec.container_name))
        except (Cancelled, StepCancelled):
            raise
        except (RemoteError, StepFailed) as exc:
            yield Report("serving.memory-unread", {"node": spec.node, "error": str(exc)[:200]})
            continue
        memory = seen.memory
        yield Report("serving.memory", {
            "node": spec.node, "deployment": d.deployment.name, "container": spec.container_name,
            "total": memory.total_bytes if memory else None, "available": memory.available_bytes if memory else None,
            "current": seen.current, "running": list(seen.running), "weights": weights})
        if len(specs) > 1:
            yield Report("serving.transport", {
                "node": spec.node, "deployment": d.deployment.name, "container": seen.container,
                "networks": None if seen.networks is None else list(seen.networks)})


#: How long serving.verify waits for an answer at all: each request has its own deadline (facts.verify.VERIFY_DEADLINE)
#: and is asked again while none comes (a fresh engine's first requests, clients queued in its few slots); an
#: answer, right, wrong or an HTTP error, ends the wait at once.
VERIFY_WITHIN = 120.0


def verify_answer(given: Given, head: str, container: str) -> Actions:
    """serving.verify, once the deployment serves: one greedy request through the head's API
    (`facts.verify.verify_fact`, the API key sent as the health check sends it) whose text must match `expect`.
    The result is reported (`serving.verify`: the status publisher keeps it per deployment and head container, into
    the condition ServingVerified and reconciler_serving_verified), then a wrong answer, an error answer or none within
    VERIFY_WITHIN fails the step, quoting what came back (printable, capped) and what was expected: await-health
    is a start, so a new generation that never served is a failed change (policy.on_failed_change)."""
    d = given.desired
    verify = d.serving.verify
    if verify is None:
        return
    seen: list[VerifyAnswer] = []

    def answered(now: VerifyAnswer) -> bool:
        seen.append(now)
        return now.answered

    try:
        yield from wait(Read(head, verify_fact(d)), answered, timeout=VERIFY_WITHIN, interval=HEALTH_POLL,
                        what=f"an answer to serving.verify's '{shown(verify.prompt)}' on {head}")
    except StepTimedOut:
        pass  # judged below on the last try (a cancel, StepCancelled, goes on up)
    last = seen[-1] if seen else VerifyAnswer(None, "not asked", answered=False)
    ok = last.text is not None and verify.matches(last.text)
    asked = (f"serving.verify on {head}: {verify.endpoint} of '{shown(verify.prompt)}' (greedy, at most "
             f"{verify.max_tokens} tokens)")
    expected = f"'{shown(verify.expect)}'"
    if last.text is not None:
        said = f"{asked} answered '{shown(last.text)}', which {'matches' if ok else 'does not match'} {expected}"
    elif not last.answered:
        said = f"{asked} got no answer within {VERIFY_WITHIN:g}s ({last.problem}); expected a match of {expected}"
    else:
        said = f"{asked} got no text ({last.problem}); expected a match of {expected}"
    yield Report("serving.verify", {
        "node": head, "deployment": d.deployment.name, "container": container, "ok": ok,
        "verify": verify.model_dump(), "answer": None if last.text is None else shown(last.text),
        "problem": last.problem, "message": said})
    if not ok:
        raise StepFailed(said)
