"""With the Ray launcher, vLLM copies the head's `VLLM_*`, `NCCL_*`, `UCX_*`, `HF_*` environment to every Ray
worker (vllm PR #34383, vllm/ray/ray_env.py) unless the name is listed in `$VLLM_CONFIG_ROOT/
ray_non_carry_over_env_vars.json`, read once by the driver. With asymmetric cabling the worker then used the
head's HCA and interface (spark-arena/sparkrun #135, fixed in #137 the same way)."""

from __future__ import annotations

import json
from types import SimpleNamespace

from reconciler.core.loader import load_file
from reconciler.core.observed import Observed
from reconciler.core.ownership import owner
from reconciler.core.spec import Desired
from reconciler.core.vllm import launch_specs
from reconciler.edge.steps import serving
from testbed.recordings import answer


def _asymmetric(cluster_yaml, launcher: str) -> Desired:
    data = load_file(cluster_yaml).data
    data["serving"]["launcher"] = launcher
    worker = next(n for n in data["nodes"] if n["role"] == "worker")
    worker["fabric"] |= {"interface": "enp1s0f0np0", "rdma_device": "rocep1s0f0"}  # cabled to the other port
    worker["fabric"]["twin"] |= {"interface": "enP2p1s0f0np0", "rdma_device": "roceP2p1s0f0"}
    return Desired.model_validate(data)


def test_every_name_that_differs_per_node_stays_with_its_node(cluster_yaml):
    head, worker = launch_specs(_asymmetric(cluster_yaml, "ray"))
    differing = {k for k in head.env if head.env[k] != worker.env.get(k)}
    assert {"NCCL_IB_HCA", "NCCL_SOCKET_IFNAME", "UCX_NET_DEVICES", "VLLM_HOST_IP"} <= differing
    kept = json.loads(head.non_carry_over_json())
    assert differing <= set(kept) and set(worker.env) <= set(kept)


def test_native_launches_are_unchanged(cluster_yaml):
    """No list and no new spec hash for the native launcher: upgrading does not restart a native deployment."""
    specs = launch_specs(_asymmetric(cluster_yaml, "native"))
    assert all(s.keep_local == () for s in specs)


def test_the_list_is_written_in_the_head_container_before_vllm_serve(cluster_yaml):
    desired = _asymmetric(cluster_yaml, "ray")
    head = launch_specs(desired)[0]
    calls = []

    class Session:
        def run(self, argv, timeout, check=True, stdin=None):
            calls.append((argv, stdin))
            return SimpleNamespace(stdout="0\n", exit_code=0)

        def run_script(self, script, timeout):  # the probe's `ray` fragment (reconciler.edge.probes.ray_script)
            assert "ray status" in script
            return SimpleNamespace(stdout=answer(script, "@@ray\nActive:\n 1 node_a\n 1 node_b\n@@rc 0\n"), exit_code=0)

    ctx = SimpleNamespace(desired=desired, sessions={head.node: Session()}, command_timeout=5, cancel=None,
                          remaining=lambda t=None: 60, observed=Observed(nodes={}),
                          owner=owner(desired, Observed(nodes={})))
    serving.launch_model(ctx, SimpleNamespace(node=head.node, wrapper=None))
    writes = [i for i, (argv, _) in enumerate(calls) if argv[-1] == serving.NON_CARRY_OVER_WRITE]
    serves = [i for i, (argv, _) in enumerate(calls) if "-d" in argv and "vllm serve" in " ".join(argv)]
    assert len(writes) == 1 and len(serves) == 1 and writes[0] < serves[0]
    assert json.loads(calls[writes[0]][1]) == list(head.keep_local)


def test_vllm_serve_is_exec_d_under_the_images_entrypoint_wrapper(cluster_yaml):
    """`docker exec` bypasses the Entrypoint; NGC's sets up CUDA forward compatibility (core.vllm.serve_wrapper)."""
    desired = _asymmetric(cluster_yaml, "ray")
    head = launch_specs(desired)[0]
    calls = []

    class Session:
        def run(self, argv, timeout, check=True, stdin=None):
            calls.append(argv)
            return SimpleNamespace(stdout="0\n", exit_code=0)

        def run_script(self, script, timeout):
            return SimpleNamespace(stdout=answer(script, "@@ray\nActive:\n 1 node_a\n 1 node_b\n@@rc 0\n"), exit_code=0)

    ctx = SimpleNamespace(desired=desired, sessions={head.node: Session()}, command_timeout=5, cancel=None,
                          remaining=lambda t=None: 60, observed=Observed(nodes={}),
                          owner=owner(desired, Observed(nodes={})))
    serving.launch_model(ctx, SimpleNamespace(node=head.node, wrapper=("/opt/nvidia/nvidia_entrypoint.sh",)))
    [serve] = [argv[-1] for argv in calls if "-d" in argv]
    assert serve.startswith("exec /opt/nvidia/nvidia_entrypoint.sh vllm serve ")
