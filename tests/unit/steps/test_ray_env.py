"""With the Ray launcher, vLLM copies the head's `VLLM_*`, `NCCL_*`, `UCX_*`, `HF_*` environment to every Ray
worker (vllm PR #34383, vllm/ray/ray_env.py) unless the name is listed in `$VLLM_CONFIG_ROOT/
ray_non_carry_over_env_vars.json`, read once by the driver. With asymmetric cabling the worker then used the
head's HCA and interface (spark-arena/sparkrun #135, fixed in #137 the same way)."""

from __future__ import annotations

import json
import shlex

from reconciler.core.loader import load_file
from reconciler.core.observed import NodeObservation, Observed
from reconciler.core.planning import Step
from reconciler.core.spec import Desired
from reconciler.core.vllm import launch_specs
from reconciler.edge.steps import serving
from reconciler.edge.steps.actions import Given
from tests.unit.step_driver import Driver, Raw


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


def _launched(desired: Desired, wrapper: tuple[str, ...] | None = None) -> Driver:
    """launch-model on the head, both nodes joined and no `vllm serve` yet, through the step driver."""
    head = launch_specs(desired)[0]
    name = head.container_name
    driver = Driver(facts={f"{head.node} ray {name}": [Raw("Active:\n 1 node_a\n 1 node_b\n")],
                           f"{head.node} vllm-serve {name}": [Raw("0")]})
    given = Given(desired, Observed(nodes={n.name: NodeObservation(name=n.name, reachable=True)
                                           for n in desired.nodes}))
    assert driver.drive(serving.launch_model(given, Step("launch-model", head.node, "missing", (),
                                                         wrapper=wrapper))) is None
    return driver


def test_the_list_is_written_in_the_head_container_before_vllm_serve(cluster_yaml):
    desired = _asymmetric(cluster_yaml, "ray")
    head = launch_specs(desired)[0]
    driver = _launched(desired)
    runs = [line for line in driver.transcript if line.startswith("run ")]
    writes = [i for i, line in enumerate(runs) if line.endswith(shlex.quote(serving.NON_CARRY_OVER_WRITE))]
    serves = [i for i, line in enumerate(runs) if " -d " in line and "vllm serve" in line]
    assert len(writes) == 1 and len(serves) == 1 and writes[0] < serves[0]
    [written] = [stdin for key, stdin in driver.stdin.items() if serving.NON_CARRY_OVER_WRITE in key]
    assert json.loads(written) == list(head.keep_local)


def test_vllm_serve_is_exec_d_under_the_images_entrypoint_wrapper(cluster_yaml):
    """`docker exec` bypasses the Entrypoint; NGC's sets up CUDA forward compatibility (core.vllm.serve_wrapper)."""
    driver = _launched(_asymmetric(cluster_yaml, "ray"), ("/opt/nvidia/nvidia_entrypoint.sh",))
    [serve] = [shlex.split(line)[-1] for line in driver.transcript if " -d " in line]
    assert serve.startswith("exec /opt/nvidia/nvidia_entrypoint.sh vllm serve ")
