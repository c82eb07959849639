"""Hypothesis strategies for the pure core: desired states of 2-4 nodes and arbitrary observations of them."""

from __future__ import annotations

from hypothesis import strategies as st

from reconciler import spec
from reconciler.observed import (
    Container,
    Link,
    Memory,
    NodeObservation,
    Observed,
    RdmaPort,
    Serving,
    WeightFile,
    Weights,
)
from reconciler.vllm import launch_specs

GIB = 2**30
IMAGE = "vllm-standin:latest"
POOL = ["vllm_node", "vllm_embeddings", "reranker", "rogue-1", "vllm_serving", "old_serving", "monitor"]


def desired_dict(n_nodes: int = 2, tp: int = 2, launcher: str = "native", layout: str = "hf-cache",
                 unlisted: str = "stop", mode: str = "enforce", paused: bool = False, rdma: bool = True,
                 allowed: dict | None = None, protected: dict | None = None) -> dict:
    names = ["head"] + [f"worker{i}" for i in range(1, n_nodes)]
    nodes = []
    for i, name in enumerate(names):
        node = {"name": name, "role": "head" if i == 0 else "worker",
                "ssh": {"host": f"10.231.{0 if i == 0 else 1}.{2 if i == 0 else 10 + i}", "user": "spark"},
                "fabric": {"interface": "enp1s0f1np1", "address": f"10.232.0.{10 + i}/24", "mtu": 9000},
                "internet": i == 0}
        if i:
            node["ssh"]["jump"] = "head"
        if rdma:
            node["fabric"]["rdma_device"] = "rocep1s0f1"
        nodes.append(node)
    return {
        "nodes": nodes,
        "model": {"id": "testorg/tiny-moe", "revision": "1" * 40, "layout": layout, "source": "head",
                  "path": "/srv/models/hub"},
        "serving": {"image": IMAGE, "launcher": launcher, "tensor_parallel_size": tp, "served_model_name": "tiny",
                    "docker": {"gpus": None, "privileged": False, "shm_size": "1g"}},
        "co_tenants": {"allowed": allowed if allowed is not None else {"head": ["vllm_embeddings", "rerank*"],
                                                                       "*": ["vllm_embeddings"]},
                       "protected": protected if protected is not None else {"*": ["monitor"]},
                       "unlisted": unlisted},
        "policy": {"mode": mode, "paused": paused},
    }


@st.composite
def desireds(draw) -> spec.Desired:
    n = draw(st.integers(2, 4))
    return spec.Desired.model_validate(desired_dict(
        n_nodes=n, tp=draw(st.integers(1, n)), launcher=draw(st.sampled_from(["native", "ray"])),
        layout=draw(st.sampled_from(["hf-cache", "plain"])), unlisted=draw(st.sampled_from(["stop", "report"])),
        rdma=draw(st.booleans())))


def manifest(n_files: int, salt: str = "") -> list[WeightFile]:
    return [WeightFile(path=f"model-{i:05d}.safetensors", size=1000 + i, mtime=1.0, sha256=f"{salt}{i:064d}"[-64:])
            for i in range(n_files)]


@st.composite
def containers(draw, desired: spec.Desired, node: str, image_id: str) -> list[Container]:
    specs = {s.node: s for s in launch_specs(desired)}
    out = []
    for name in draw(st.lists(st.sampled_from(POOL), unique=True, max_size=5)):
        managed = name in ("vllm_serving", "old_serving") and draw(st.booleans())
        labels = {}
        if managed:
            good = specs.get(node)
            labels = {"spark-reconciler.managed": "true",
                      "spark-reconciler.spec-hash": good.spec_hash if good and draw(st.booleans()) else "stale"}
        out.append(Container(name=name, id=f"{node}-{name}", image=IMAGE,
                             image_id=draw(st.sampled_from([image_id, "sha256:old"])),
                             state=draw(st.sampled_from(["running", "exited", "created"])), labels=labels))
    return out


@st.composite
def observations(draw, desired: spec.Desired, all_reachable: bool = False) -> Observed:
    nodes = {}
    files = manifest(draw(st.integers(1, 4)))
    for node in desired.nodes:
        reachable = all_reachable or draw(st.integers(0, 9)) > 0
        if not reachable:
            nodes[node.name] = NodeObservation(name=node.name, reachable=False, error="timed out")
            continue
        image_id = draw(st.sampled_from(["sha256:good", "sha256:old", None]))
        if node.role == "head":
            image_id = "sha256:good"
        images = {IMAGE: image_id} if image_id else {}
        link = Link(name=node.fabric.interface, admin_up=draw(st.booleans()), carrier=draw(st.booleans()),
                    operstate="up", mtu=draw(st.sampled_from([1500, 9000])),
                    addresses=draw(st.sampled_from([[], [str(node.fabric.address)]])),
                    rdma=(RdmaPort(state=draw(st.sampled_from(["4: ACTIVE", "1: DOWN"])), phys_state="5: LinkUp")
                          if node.fabric.rdma_device else None))
        if node.name == desired.source_node:
            weights = Weights(root="/srv/models/hub", present=True, files=files)
        else:
            kept = draw(st.integers(0, len(files)))
            weights = Weights(root="/srv/models/hub", present=kept > 0, files=files[:kept])
        total = 128 * GIB
        nodes[node.name] = NodeObservation(
            name=node.name, reachable=True, docker_reachable=all_reachable or draw(st.integers(0, 9)) > 0,
            containers=draw(containers(desired, node.name, image_id or "sha256:none")), images=images,
            fabric=link, memory=Memory(total_bytes=total, available_bytes=draw(st.sampled_from([10, 120])) * GIB),
            weights=weights,
            serving=Serving(reachable=True, healthy=draw(st.booleans()), models=["tiny"]) if node.role == "head"
            else None)
    return Observed(nodes=nodes)
