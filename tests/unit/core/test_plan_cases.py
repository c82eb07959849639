"""Whole plans for the situations users meet, written out by hand: every step's id, reason, what it waits for
and its parameters, and every blocker's words.

Each case starts from the recorded converged 4-node cluster (tests/unit/recorded.py) with one thing changed. The
expected order is the one docs/architecture.md and the seed story give: stop what is not allowed and bring the
fabric up first; the image and the weights over the fabric; then a serving change stops every rank, starts the
workers headless and rank 0 last (Ray: the head's GCS, the workers join, `vllm serve` on the head) and waits for
/health. The properties (test_core_properties.py) judge plans against an independent oracle; these cases pin
what a plan says, which `plan`, `apply` and `/status` print.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from reconciler.core import spec
from reconciler.core.observed import LABEL_SPEC_HASH, Container, Observed, RdmaPort, ServeFlags, ServingApi
from reconciler.core.planning import Blocker, Step, plan
from reconciler.core.vllm import parse_serve_help
from tests.unit.recorded import REV, WORKERS, changed, hashes, link, load, observe, serving_with, without

FIXTURES = Path(__file__).parents[1] / "fixtures"

STOPS = tuple(f"stop-serving/{n}/vllm_serving" for n in ("head", *WORKERS))


def step(sid: str, reason: str, after: tuple[str, ...] = (), **params: str) -> Step:
    """A step by its documented id, `KIND/NODE[/CONTAINER]`, and its params as `plan --json` shows them."""
    kind, node, *container = sid.split("/")
    typed: dict[str, object] = {name: int(value) if name == "rank" else value for name, value in params.items()}
    if container:
        typed["container"] = container[0]
    step = Step(kind, node, reason, after, **typed)  # type: ignore[arg-type]
    assert step.id == sid
    return step


def ordered_restart(why: str, before: tuple[str, ...] = (), stopped: tuple[str, ...] = STOPS,
                    grace: int | None = None) -> list[Step]:
    """Stop every running rank (`grace`: the plan's own `docker stop -t`, a wedged generation's), start ranks 1-3
    headless, rank 0 last, then wait for health (native launcher)."""
    stops = [dataclasses.replace(step(s, f"ordered restart ({why})", before, container="vllm_serving"), grace=grace)
             for s in stopped]
    starts = [step(f"start-serving/{w}", f"start rank {i} (headless) first", before + stopped, rank=str(i))
              for i, w in enumerate(WORKERS, start=1)]
    head = step("start-serving/head", "start rank 0 last: it waits for the workers",
                before + stopped + tuple(s.id for s in starts), rank="0")
    return [*stops, *starts, head, step("await-health/head", "wait for /health and /v1/models", (head.id,))]


def steps_and_blockers(desired: spec.Desired, observed: Observed) -> tuple[list[Step], list[Blocker]]:
    result = plan(desired, observed)
    return result.steps, result.blocked


# ------------------------------------------------------------------------------------------------ modes


@pytest.mark.parametrize(("edit", "mode"), [(("mode: enforce", "mode: enforce\n  paused: true"), "paused"),
                                            (("mode: enforce", "mode: observe"), "observe")])
def test_paused_or_observing_reports_the_drift_and_plans_nothing(seen, edit, mode):
    desired = load(edit)
    after = changed(seen, "worker3", containers=without(seen, "worker3", "vllm_serving"))
    result = plan(desired, after)
    assert (result.steps, result.blocked, result.mode, result.trusted) == ([], [], mode, ())
    assert [(d.node, d.kind) for d in result.drift] == [("worker3", "serving")]
    assert result.changes


@pytest.mark.parametrize("paused", [False, True])
def test_trust_opt_ins_are_named_with_every_plan(paused):
    desired = load(("    privileged: false", "    privileged: true"),
                   ("co_tenants:", "trust:\n  privileged: true\n\nco_tenants:"),
                   ("mode: enforce", f"mode: enforce\n  paused: {str(paused).lower()}"))
    assert plan(desired, observe(desired)).trusted == tuple(desired.trust.granted())
    assert len(desired.trust.granted()) == 1


# ------------------------------------------------------------------------------------------------ serving


def test_a_changed_spec_on_one_rank_restarts_every_rank_in_order(desired, seen):
    c = seen.node("worker1").container("vllm_serving")
    assert c is not None
    after = changed(seen, "worker1", containers=serving_with(seen, "worker1", labels={**c.labels,
                                                                                        LABEL_SPEC_HASH: "0"}))
    why = (f"worker1: container/vllm_serving: expected spec {hashes(desired)['worker1']}, observed spec 0 (started "
           "before field labels)")
    assert steps_and_blockers(desired, after) == (ordered_restart(why), [])


def test_with_ray_the_head_starts_first_the_workers_join_and_the_head_launches(seen):
    desired = load(("launcher: native", "launcher: ray"))
    old, new = hashes(load()), hashes(desired)
    why = "; ".join(f"{n}: container/vllm_serving: expected spec {new[n]}, observed spec {old[n]} (started before "
                    "field labels)" for n in ("head", *WORKERS))
    stops = [step(s, f"ordered restart ({why})", container="vllm_serving") for s in STOPS]
    head = step("start-serving/head", "start the Ray head first", STOPS, rank="0")
    joins = [step(f"start-serving/{w}", "join the Ray cluster", (head.id,), rank=str(i))
             for i, w in enumerate(WORKERS, start=1)]
    launch = step("launch-model/head", "vllm serve on the Ray head once all nodes joined",
                  (head.id, *(j.id for j in joins)))
    assert steps_and_blockers(desired, seen) == (
        [*stops, head, *joins, launch, step("await-health/head", "wait for /health and /v1/models", (launch.id,))],
        [])


def test_a_missing_rank_restarts_the_others_but_has_nothing_of_its_own_to_stop(desired, seen):
    after = changed(seen, "worker3", containers=without(seen, "worker3", "vllm_serving"))
    why = f"worker3: container/vllm_serving: expected running, spec {hashes(desired)['worker3']}, observed missing"
    assert steps_and_blockers(desired, after) == (ordered_restart(why, stopped=STOPS[:3]), [])


def test_our_container_under_a_former_name_is_stopped_by_its_own_name(desired, seen):
    c = seen.node("worker2").container("vllm_serving")
    assert c is not None
    old = c.model_copy(update={"name": "vllm_old", "id": "0" * 64})
    after = changed(seen, "worker2", containers=[*seen.node("worker2").containers, old])
    assert steps_and_blockers(desired, after) == ([step(
        "stop-serving/worker2/vllm_old", "container/vllm_old: expected not running (no longer wanted), observed "
        "running", container="vllm_old")], [])


# ------------------------------------------------------------------------------------- one worker, all at once


def test_a_worker_with_everything_wrong_is_repaired_in_order_then_serving_restarts(desired, seen):
    foreign = Container(name="vllm_node", id="f" * 64, image="glm:latest", state="running")
    weights = seen.node("worker2").weights
    assert weights is not None
    after = changed(seen, "worker2", containers=[*seen.node("worker2").containers, foreign], images={},
                    fabric=link(seen, "worker2", admin_up=False, mtu=1500),
                    weights=weights.model_copy(update={"present": False, "files": []}))
    reference = seen.node("head").images["vllm-standin:latest"].content
    head_weights = seen.node("head").weights
    assert head_weights is not None
    repairs = [  # our generation runs on the other nodes: the co-tenant, which competes with it, goes at once
        step("stop-container/worker2/vllm_node", "vllm_node is running but not allowed", container="vllm_node"),
        step("link/worker2", "link/enp1s0f1np1: expected up, observed admin-down; link/enp1s0f1np1/mtu: expected "
             "9000, observed 1500"),
        step("image/worker2", f"image/vllm-standin:latest: expected content {reference[:19]}, observed missing",
             ("link/worker2",), source="head", image="vllm-standin:latest", content=reference),
        step("weights/worker2", f"weights/testorg/tiny-moe: expected {len(head_weights.files)} files, "
             f"{head_weights.total_bytes} bytes, observed missing", ("link/worker2",), source="head",
             path="/srv/spark-testbed/worker2/models/hub")]
    why = (f"worker2: container/vllm_serving: expected image content {reference[:19]}, observed image content "
           "missing")
    assert steps_and_blockers(desired, after) == (repairs + ordered_restart(why, tuple(s.id for s in repairs)), [])


def test_the_link_of_the_image_source_orders_the_copy_too(desired, seen):
    after = changed(changed(seen, "worker1", images={}), "head", fabric=link(seen, "head", mtu=1500))
    steps, _ = steps_and_blockers(desired, after)
    assert steps[0] == step("link/head", "link/enp1s0f1np1/mtu: expected 9000, observed 1500")
    assert steps[1].id == "image/worker1" and steps[1].after == ("link/head",)


# ------------------------------------------------------------------------------------------------ what waits


def test_a_restart_waits_for_a_rank_whose_output_does_not_parse(desired, seen):
    c = seen.node("worker1").container("vllm_serving")
    assert c is not None
    after = changed(seen, "worker1", containers=serving_with(seen, "worker1", labels={**c.labels,
                                                                                        LABEL_SPEC_HASH: "0"}))
    after = changed(after, "worker3", probe_error="docker section: not JSON", fabric=None, fabric_twin=None)
    assert steps_and_blockers(desired, after) == ([], [Blocker(
        "worker3", "serving restart waits for probe on worker3: probe/worker3: expected probe output that parses, "
        "observed docker section: not JSON")])


def test_a_restart_waits_for_weights_no_step_brings(desired, seen):
    c = seen.node("worker1").container("vllm_serving")
    assert c is not None
    after = changed(seen, "worker1", containers=serving_with(seen, "worker1", labels={**c.labels,
                                                                                        LABEL_SPEC_HASH: "0"}))
    desired = load(("    internet: true             # declared only", "    internet: false            # offline"))
    after = changed(after, "head", weights=seen.node("head").weights.model_copy(  # type: ignore[union-attr]
        update={"present": False}))
    steps, blocked = steps_and_blockers(desired, after)
    assert steps == []
    assert blocked == [Blocker("head", "serving restart waits for weights on head: weights/testorg/tiny-moe: "
                                       f"expected testorg/tiny-moe at revision {REV} on the source, observed missing "
                                       "in /srv/spark-testbed/head/models/hub: head has no internet in the file, so "
                                       f"put them there (`hf download testorg/tiny-moe --revision {REV}` where the "
                                       "Hub is reachable, then copy the tree to /srv/spark-testbed/head/models/hub)")]


def test_no_link_step_on_a_node_docker_cannot_be_asked_on_but_its_link_is_repaired(desired, seen):
    after = changed(seen, "worker2", docker_reachable=False, docker_error="down", containers=[], images={},
                    fabric=link(seen, "worker2", admin_up=False))
    steps, _ = steps_and_blockers(desired, after)
    assert [s.id for s in steps] == ["link/worker2"]


# ------------------------------------------------------------------------------------------------ health


def _health(**fields: object) -> ServingApi:
    return ServingApi(reachable=True, healthy=False, models=[]).model_copy(update=fields)


def test_a_cold_start_is_waited_for(desired, seen):
    after = changed(seen, "head", serving=_health())
    assert steps_and_blockers(desired, after) == ([step(
        "await-health/head", "serving containers are up; wait for the API to become healthy")], [])


def test_a_serving_that_served_and_fails_within_the_grace_is_left_alone_and_says_when(desired, seen):
    after = changed(seen, "head", serving=_health(served_before=True, unhealthy_for=30.4))
    grace = desired.serving.unhealthy_grace
    assert steps_and_blockers(desired, after) == ([], [Blocker(
        "head", f"serving served, then failed its health check for 30s; restarted in order after {grace:.0f}s")])
    after = changed(seen, "head", serving=_health(served_before=True))
    assert steps_and_blockers(desired, after)[1] == [Blocker(
        "head", f"serving served, then failed its health check for 0s; restarted in order after {grace:.0f}s")]


def test_a_wedged_serving_is_restarted_in_order_after_a_grace_that_doubles(desired, seen):
    grace = desired.serving.unhealthy_grace
    wedged = _health(served_before=True, unhealthy_for=2 * grace, health_restarts=1)
    note = (f"serving served, then failed its health check for {2 * grace:.0f}s; restarted in order after "
            f"{2 * grace:.0f}s")
    why = f"head: api/:8000: expected healthy, serving tiny-moe, completing, observed unhealthy; {note}"
    # stopped with 1 s, not stop_grace: it has not answered for the whole grace, and a frozen rank ignores SIGTERM
    assert steps_and_blockers(desired, changed(seen, "head", serving=wedged)) == (ordered_restart(why, grace=1), [])
    waiting = wedged.model_copy(update={"unhealthy_for": 2 * grace - 1})
    assert steps_and_blockers(desired, changed(seen, "head", serving=waiting))[0] == []


def test_waiting_for_health_needs_every_serving_node(desired, seen):
    after = changed(changed(seen, "head", serving=_health()), "worker2", reachable=False, error="timed out",
                    fabric=None, fabric_twin=None, containers=[], images={}, weights=None)
    after = changed(after, "worker1", probe_error="docker section: not JSON", fabric=None, fabric_twin=None)
    after = changed(after, "worker3", docker_reachable=False, docker_error="down", containers=[], images={})
    assert steps_and_blockers(desired, after)[1] == [Blocker(
        "head", "serving is not healthy; waiting needs worker1, worker2, worker3, which cannot be reached")]


@pytest.mark.parametrize("down", [{"probe_error": "docker section: not JSON", "fabric": None, "fabric_twin": None},
                                  {"docker_reachable": False, "docker_error": "down", "containers": [], "images": {}}])
def test_a_node_that_cannot_be_asked_holds_the_wait_for_health(desired, seen, down):
    after = changed(changed(seen, "head", serving=_health()), "worker2", **down)
    assert Blocker("head", "serving is not healthy; waiting needs worker2, which cannot be reached") in \
        steps_and_blockers(desired, after)[1]


# ------------------------------------------------------------------------------------------------ the image says no


def _flags(seen: Observed, **fields: object) -> ServeFlags:
    image_id = seen.node("head").images["vllm-standin:latest"].id
    known = parse_serve_help((FIXTURES / "vllm-0.32.0-cpu-serve-help-all.txt").read_text())
    return ServeFlags(image_id=image_id, flags=known, has_ray=True).model_copy(update=fields)


@pytest.mark.parametrize(("extra", "words"), [
    ('["--foo"]', "--foo is not a flag"),
    ('["--foo", "--bar=1"]', "--foo, --bar are not flags"),
])
def test_flags_the_image_does_not_know_stop_nothing(seen, extra, words):
    desired = load(("  health_timeout: 2m", f"  health_timeout: 2m\n  extra_args: {extra}"))
    observed = seen.model_copy(update={"serve_flags": _flags(seen)})
    image_id = observed.serve_flags.image_id  # type: ignore[union-attr]
    assert steps_and_blockers(desired, observed) == ([], [Blocker(
        "head", f"serving.extra_args: {words} of `vllm serve` in vllm-standin:latest ({image_id[:19]}), vLLM of an "
        "unknown version; nothing is stopped or started")])


def test_a_restart_waits_while_the_image_is_being_asked(seen):
    desired = load(("  health_timeout: 2m", '  health_timeout: 2m\n  extra_args: ["--foo"]'))
    observed = seen.model_copy(update={"serve_flags": _flags(seen, pending=True)})
    image_id = observed.serve_flags.image_id  # type: ignore[union-attr]
    assert steps_and_blockers(desired, observed)[1] == [Blocker(
        "head", f"serving waits for vllm-standin:latest ({image_id[:19]}) to say which flags its `vllm serve` "
        "knows and whether it has Ray (asked once per image id), to judge it before anything stops")]


def test_flags_of_another_image_id_hold_the_restart(seen):
    desired = load(("  health_timeout: 2m", '  health_timeout: 2m\n  extra_args: ["--foo"]'))
    observed = seen.model_copy(update={"serve_flags": _flags(seen, image_id="sha256:" + "0" * 64)})
    steps, blocked = steps_and_blockers(desired, observed)
    assert steps == [] and len(blocked) == 1 and "the answer at hand is about sha256:000000000000" in blocked[0].reason


def test_an_image_without_native_multi_node_flags_stops_nothing(seen):
    """NGC 25.09/25.10 predate vllm-project/vllm PR #23691: the reconciler's own rendered flags are judged too."""
    desired = load(("  health_timeout: 2m", "  health_timeout: 2m\n  extra_args: [--max-num-seqs, '4']"))
    old = [f for f in _flags(seen).flags if f not in ("--nnodes", "-n", "--node-rank", "-r", "--headless")]
    observed = seen.model_copy(update={"serve_flags": _flags(seen, flags=old, version="0.10.2")})
    steps, [blocked] = steps_and_blockers(desired, observed)
    assert not any(s.kind in ("stop-serving", "start-serving") for s in steps)
    assert "vLLM 0.10.2, does not know --nnodes, --node-rank, --headless, which the native launcher" in blocked.reason
    assert "vllm-project/vllm PR #23691" in blocked.reason


@pytest.mark.parametrize(("fields", "final"), [
    ({}, True),  # its own answer: a flag it does not know
    ({"pending": True}, False),  # a wait for the answer
    ({"image_id": "sha256:" + "0" * 64}, False),  # an answer about another image
    ({"error": "exec format error"}, False),  # asked again with backoff
])
def test_only_the_images_own_refusal_is_a_failed_change(seen, fields, final):
    """`Plan.refused` is what policy.on_failed_change rolls back: the image's answer, never a wait for one."""
    desired = load(("  health_timeout: 2m", '  health_timeout: 2m\n  extra_args: ["--foo"]'))
    observed = seen.model_copy(update={"serve_flags": _flags(seen, **fields)})
    refused = plan(desired, observed).refused
    assert (refused == ("serving.extra_args: --foo is not a flag of `vllm serve` in vllm-standin:latest ("
                        f"{_flags(seen).image_id[:19]}), vLLM of an unknown version; nothing is stopped or started",)
            if final else refused == ())


# ------------------------------------------------------------------------------ sources that do not serve


PIN = "sha256:" + "9" * 64
THREE_SERVE = ("tensor_parallel_size: 4", "tensor_parallel_size: 3\n  nodes: [head, worker1, worker2]")


def _serving_three(desired: spec.Desired, seen: Observed, changed_rank: str) -> Observed:
    """The recording with worker3 out of the span: ranks 0-2 on the specs of `desired`, `changed_rank` on an old
    one, worker3's container gone."""
    h = hashes(desired)
    for n in ("head", "worker1", "worker2"):
        c = seen.node(n).container("vllm_serving")
        assert c is not None
        label = h[n] if n != changed_rank else "0"
        seen = changed(seen, n, containers=serving_with(seen, n, labels={**c.labels, LABEL_SPEC_HASH: label}))
    return changed(seen, "worker3", containers=without(seen, "worker3", "vllm_serving"))


def test_a_restart_waits_for_a_pin_the_reference_image_on_a_node_that_does_not_serve_misses():
    # found by mutation testing (issue 17): the reference lived on worker3, outside the span, and the restart went
    # ahead on the unpinned image although the drift said "nothing is copied or started"
    desired = load(THREE_SERVE, ("  health_timeout: 2m\n", f'  health_timeout: 2m\n  image_id: "{PIN}"\n'
                                                           "  image_sources: [worker3, head]\n"))
    after = _serving_three(desired, observe(desired), "worker1")
    steps, blocked = steps_and_blockers(desired, after)
    assert steps == []
    assert [b.node for b in blocked] == ["worker3"] and blocked[0].reason.startswith(
        "serving restart waits for image on worker3: image/vllm-standin:latest: expected pinned sha256:999999999999")


def test_a_restart_waits_for_weights_missing_on_a_source_that_does_not_serve():
    desired = load(THREE_SERVE, ("  source: head", "  source: worker3"))
    seen = observe(desired)
    weights = seen.node("worker3").weights
    assert weights is not None
    after = changed(_serving_three(desired, seen, "worker1"), "worker3",
                    weights=weights.model_copy(update={"present": False}))
    assert steps_and_blockers(desired, after)[1] == [Blocker(
        "worker3", "serving restart waits for weights on worker3: weights/testorg/tiny-moe: expected "
        f"testorg/tiny-moe at revision {REV} on the source, observed missing in /srv/spark-testbed/worker3/models/hub: "
        f"worker3 has no internet in the file, so put them there (`hf download testorg/tiny-moe --revision {REV}` "
        "where the Hub is reachable, then copy the tree to /srv/spark-testbed/worker3/models/hub)")]


def test_an_rdma_port_down_with_its_netdev_is_in_the_link_steps_reason():
    desired = load(("address: 10.232.0.11/24\n", "address: 10.232.0.11/24\n      rdma_device: rocep1s0f1\n"),
                   ("address: 10.232.1.11/24\n", "address: 10.232.1.11/24\n        rdma_device: roceP2p1s0f1\n"))
    seen = observe(desired)
    c = seen.node("worker1").container("vllm_serving")
    assert c is not None
    seen = changed(seen, "worker1", containers=serving_with(seen, "worker1", labels={
        **c.labels, LABEL_SPEC_HASH: hashes(desired)["worker1"]}))
    port = link(seen, "worker1", admin_up=False, rdma=RdmaPort(state="1: DOWN", phys_state="3: Disabled"))
    assert steps_and_blockers(desired, changed(seen, "worker1", fabric=port)) == ([step(
        "link/worker1", "link/enp1s0f1np1: expected up, observed admin-down; rdma/rocep1s0f1: expected 4: ACTIVE, "
        "observed 1: DOWN (3: Disabled)")], [])


# ------------------------------------------------------------------------------------------------ platform


def _on_machines(observed: Observed, machine: str) -> Observed:
    for name in observed.nodes:
        observed = changed(observed, name, machine=machine)
    return observed


def test_an_image_of_another_platform_stops_nothing_and_copies_nothing(seen):
    """The recording's image is linux/amd64; on aarch64 Sparks (NVIDIA's playbook: "Missing ARM64 image") every
    rank would exit with `exec format error`. A serving change and a worker without the image plan nothing that
    stops, copies or starts; each serving node says what to pull, and the running generation keeps serving."""
    desired = load(("max_model_len: 4096", "max_model_len: 8192"))
    observed = _on_machines(changed(seen, "worker2", images={}), "aarch64")
    assert observed.node("head").images["vllm-standin:latest"].platform == "linux/amd64"
    result = plan(desired, observed)
    assert result.steps == [] and result.blocked
    image = [d for d in result.drift if d.kind == "image"]
    assert {d.node for d in image} == {"head", *WORKERS} and all(d.blocking and not d.actionable for d in image)
    assert image[0].expected == "an image for linux/arm64 (uname -m: aarch64)"
    assert "linux/amd64 on head: every rank would exit with 'exec format error'; pull the arm64 image on head" \
        in image[0].observed


@pytest.mark.parametrize("machine", ["x86_64", None])
def test_an_image_of_the_nodes_platform_restarts_as_before(desired, seen, machine):
    """x86_64 is amd64 (containerd/platforms normalizeArch); an unread machine (a snapshot from before the probe
    read it) judges nothing."""
    edited_desired = load(("max_model_len: 4096", "max_model_len: 8192"))
    steps, blocked = steps_and_blockers(edited_desired, _on_machines(seen, machine))
    assert blocked == [] and [s.kind for s in steps].count("stop-serving") == 4


# ------------------------------------------------------------------------------------------------ ports

GLM = Container(name="vllm_node", id="c0ffee", image="vllm-node:glm", state="running")


def _listening(seen: Observed, *ports: int, ours: str | None = "8000,29501", glm: bool = False) -> Observed:
    """The head with `ports` listening; its serving container labelled with `ours` (None: started before the
    label existed); `glm`: the seed's GLM, not allowed, running beside it."""
    head = seen.node("head")
    containers = serving_with(seen, "head", labels={**head.container("vllm_serving").labels,  # type: ignore[union-attr]
                                                    **({"spark-reconciler.ports": ours} if ours is not None else {})})
    return changed(seen, "head", listening=[22, *ports], containers=[*containers, *([GLM] if glm else [])])


@pytest.mark.parametrize("ours", ["8000,29501", None])
def test_ports_held_by_the_running_generation_are_its_own(seen, ours):
    """A serving change restarts as ever when the listeners are the generation's own, by its label, or, for a
    container started before the label, by what its node needs now."""
    desired = load(("max_model_len: 4096", "max_model_len: 8192"))
    steps, blocked = steps_and_blockers(desired, _listening(seen, 8000, 29501, ours=ours))
    assert blocked == [] and [s.kind for s in steps].count("stop-serving") == 4


def test_a_new_port_held_by_another_process_stops_nothing(seen):
    """Open WebUI (or any process) on 8080 and the API moved there: rank 0 would exit with "Address already in
    use" after every rank was stopped."""
    desired = load(("  port: 8000", "  port: 8080"))
    steps, blocked = steps_and_blockers(desired, _listening(seen, 8000, 8080, 29501))
    assert steps == [] and blocked == [Blocker(
        "head", "port 8080 (serving.port) on head is held by a process the reconciler did not start, and rank 0 "
        "must listen there: free it (`sudo ss -ltnp 'sport = :8080'` shows who holds it) or choose another port; "
        "nothing is stopped or started")]


def test_a_held_port_with_a_co_tenant_to_stop_waits_for_the_stop_while_a_generation_serves(seen):
    desired = load(("  master_port: 29501", "  master_port: 29600"))
    steps, [blocked] = steps_and_blockers(desired, _listening(seen, 8000, 29501, 29600, glm=True))
    assert [s.id for s in steps] == ["stop-container/head/vllm_node"]
    assert blocked.reason.startswith("port 29600 (serving.master_port) on head is held")
    assert blocked.reason.endswith("; judged again once stop-container/head/vllm_node has run (it may hold it)")


def test_with_nothing_of_ours_serving_the_start_follows_the_co_tenants_stop(seen):
    """The seed: the GLM holds :8000 and no generation of ours runs, so nothing is at stake; the start comes
    after the stop, as it always did."""
    desired = load()
    observed = seen
    for n in ("head", *WORKERS):
        observed = changed(observed, n, containers=without(observed, n, "vllm_serving"))
    observed = changed(observed, "head", listening=[22, 8000],
                       containers=[*observed.node("head").containers, GLM])
    steps, blocked = steps_and_blockers(desired, observed)
    assert blocked == [] and steps[0].id == "stop-container/head/vllm_node"
    assert "stop-container/head/vllm_node" in next(s for s in steps if s.id == "start-serving/head").after
