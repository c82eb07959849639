"""Hypothesis strategies for the pure core: desired states of 2-4 nodes and arbitrary observations of them."""

from __future__ import annotations

from hypothesis import strategies as st

from reconciler.core import spec
from reconciler.core.observed import (
    LABEL_INSTANCE,
    LABEL_LAUNCH,
    LABEL_SPEC_HASH,
    ClusterIdentity,
    Container,
    Image,
    Link,
    Memory,
    NodeObservation,
    Observed,
    RdmaPort,
    ServingApi,
    WeightFile,
    Weights,
)
from reconciler.core.vllm import LaunchSpec, launch_label, launch_specs

GIB = 2**30
IMAGE = "vllm-standin:latest"
POOL = ["vllm_node", "vllm_embeddings", "reranker", "rogue-1", "vllm_serving", "old_serving", "monitor"]


REVISION = "1" * 40
# The head's cluster id (core.ownership), another cluster's, and a former address of the head's.
CLUSTER_ID = "0f8fad5b-d9cb-469f-a165-70867728950e"
OTHER_CLUSTER_ID = "7c9e6679-7425-40de-944b-e07fc1f90ae7"
FORMER = "10.8.8.8:22"
# The two ports a GB10's ConnectX-7 exposes; nodes cabled to different ones are the asymmetric case (sparkrun #135).
INTERFACES = ["enp1s0f1np1", "enP2p1s0f1np1"]


def desired_dict(n_nodes: int = 2, tp: int = 2, launcher: str = "native", layout: str = "hf-cache",
                 unlisted: str = "stop", mode: str = "enforce", paused: bool = False, rdma: bool = True,
                 allowed: dict | None = None, protected: dict | None = None, interfaces: list[str] | None = None,
                 source: str | None = None, per_node_paths: bool = False, image_sources: list[str] | None = None,
                 env: dict | None = None, served_model_name: str | None = "tiny", gmu: float = 0.5) -> dict:
    names = ["head"] + [f"worker{i}" for i in range(1, n_nodes)]
    nodes = []
    for i, name in enumerate(names):
        node = {"name": name, "role": "head" if i == 0 else "worker",
                "ssh": {"host": f"10.231.{0 if i == 0 else 1}.{2 if i == 0 else 10 + i}", "user": "spark"},
                "fabric": {"interface": interfaces[i] if interfaces else INTERFACES[0],
                           "address": f"10.232.0.{10 + i}/24", "mtu": 9000},
                "internet": i == 0}
        if i:
            node["ssh"]["jump"] = "head"
        if rdma:
            node["fabric"]["rdma_device"] = "rocep1s0f1"
        nodes.append(node)
    serving: dict = {"image": IMAGE, "launcher": launcher, "tensor_parallel_size": tp,
                     "gpu_memory_utilization": gmu, "docker": {"gpus": None, "privileged": False, "shm_size": "1g"}}
    if served_model_name:
        serving["served_model_name"] = served_model_name
    if image_sources:
        serving["image_sources"] = image_sources
    if env:
        serving["env"] = env
    model: dict = {"id": "testorg/tiny-moe", "revision": REVISION, "layout": layout, "source": source or "head",
                   "path": ({n: f"/srv/models/{n}/hub" for n in names} if per_node_paths else "/srv/models/hub")}
    return {
        "nodes": nodes,
        "model": model,
        "serving": serving,
        "co_tenants": {"allowed": allowed if allowed is not None else {"head": ["vllm_embeddings", "rerank*"],
                                                                       "*": ["vllm_embeddings"]},
                       "protected": protected if protected is not None else {"*": ["monitor"]},
                       "unlisted": unlisted},
        "policy": {"mode": mode, "paused": paused},
    }


@st.composite
def desireds(draw) -> spec.Desired:
    """Desired states where the cases that matter are common: 3-4 nodes, Ray, asymmetric interfaces, per-node
    paths, a weights source and image sources other than the head, env and names that feed the launch."""
    n = draw(st.sampled_from([2, 3, 3, 4]))
    names = ["head"] + [f"worker{i}" for i in range(1, n)]
    raw = desired_dict(
        n_nodes=n, tp=draw(st.integers(1, n)), launcher=draw(st.sampled_from(["native", "ray"])),
        layout=draw(st.sampled_from(["hf-cache", "plain"])),
        unlisted=draw(st.sampled_from(["stop", "stop", "report"])), rdma=draw(st.booleans()),
        interfaces=draw(st.lists(st.sampled_from(INTERFACES), min_size=n, max_size=n)),
        source=draw(st.sampled_from(["head", "head", names[1]])), per_node_paths=draw(st.booleans()),
        image_sources=draw(st.sampled_from([None, None, ["head", names[1]]])),
        env=draw(st.sampled_from([None, {"VLLM_LOGGING_LEVEL": "DEBUG"}])),
        served_model_name=draw(st.sampled_from(["tiny", "tiny-2", None])))
    return spec.Desired.model_validate(raw)


def manifest(n_files: int, salt: str = "", prefix: str = "") -> list[WeightFile]:
    return [WeightFile(path=f"{prefix}model-{i:05d}.safetensors", size=1000 + i, mtime=1.0,
                       sha256=f"{salt}{i:064d}"[-64:]) for i in range(n_files)]


def often(fine, *bad):
    """`fine` three times in four: most examples get past every blocker, and the interesting (mis)states of
    the other aspects are what is left to plan for."""
    return st.sampled_from([fine, fine, fine, *bad]) if len(bad) == 1 else st.one_of(
        st.just(fine), st.just(fine), st.just(fine), st.sampled_from(bad))


@st.composite
def containers(draw, desired: spec.Desired, node: str, image_id: str, label: str | None = None) -> list[Container]:
    """Co-tenants from POOL, and (often) the serving container: ours with the right or a stale spec, legacy
    (no instance label), another reconciler's, or a stranger's holding the name. Ours is labelled `label` (what
    the cluster labels with now: its id, or the head's address) or, less often, a name it may or may not go by
    (the head's address, the id, a former address)."""
    label = desired.instance if label is None else label
    specs = {s.node: s for s in launch_specs(desired)}
    serving = desired.serving.container_name
    out = []
    names = draw(st.lists(st.sampled_from([n for n in POOL if n != serving]), unique=True, max_size=4))
    if draw(st.integers(0, 3)) > 0:
        names.append(serving)
    for name in names:
        labels = {}
        if name in (serving, "old_serving"):
            good = specs.get(node)
            owner = draw(often("ours", "legacy", "other", "stranger"))
            if owner != "stranger":
                labels = {"spark-reconciler.managed": "true", **launched(draw, good)}
            if owner == "ours":
                labels[LABEL_INSTANCE] = draw(often(label, desired.instance, CLUSTER_ID, FORMER))
            elif owner == "other":
                labels[LABEL_INSTANCE] = draw(st.sampled_from(["10.9.9.9:22", OTHER_CLUSTER_ID]))
        out.append(Container(name=name, id=f"{node}-{name}", image=IMAGE,
                             image_id=draw(often(image_id, "sha256:old")),
                             state=draw(often("running", "exited", "created")), labels=labels))
    return out


#: Fields a stale container's launch label may hold where the file says otherwise (or nothing).
STALE_FIELDS = [{"serving.gpu_memory_utilization": "0.93"}, {"serving.max_model_len": "4096"},
                {"serving.tensor_parallel_size": "9"}, {"serving.served_model_name": "older"},
                {"serving.env.VLLM_LOGGING_LEVEL": "INFO"}]


def launched(draw, good: LaunchSpec | None) -> dict[str, str]:
    """The spec hash and launch label (`spark-reconciler.launch`) of a container started from the file (`good`,
    its node's launch now), from an older file (a stale hash, a label with a field the file has otherwise) or
    before field labels existed (a stale hash, no label). The two labels always agree, as a reconciler writes
    them: the oracle judges by the label, the plan by the hash."""
    if good is not None and draw(st.booleans()):
        return {LABEL_SPEC_HASH: good.spec_hash, LABEL_LAUNCH: launch_label(good.inputs) or ""}
    if good is None or draw(st.booleans()):
        return {LABEL_SPEC_HASH: "stale"}
    return {LABEL_SPEC_HASH: "stale", LABEL_LAUNCH: launch_label(good.inputs | draw(st.sampled_from(STALE_FIELDS)))
            or ""}


def _weights(draw, desired: spec.Desired, node: str, files: list[WeightFile]) -> Weights:
    root = desired.model.path_on(node)
    if node == desired.source_node:
        return Weights(root=root, present=True, files=files)
    kind = draw(st.sampled_from(["complete", "complete", "partial", "damaged", "none"]))
    if kind == "none":
        return Weights(root=root, present=False)
    if kind == "partial":
        return Weights(root=root, present=True, files=files[:draw(st.integers(0, len(files) - 1))])
    if kind == "damaged":
        i = draw(st.integers(0, len(files) - 1))
        bad = files[i].model_copy(update=draw(st.sampled_from([{"size": files[i].size + 1},
                                                                {"sha256": "f" * 64}, {"size": None}])))
        return Weights(root=root, present=True, files=[*files[:i], bad, *files[i + 1:]])
    return Weights(root=root, present=True, files=list(files))


def api_state(draw, desired: spec.Desired) -> ServingApi:
    want = desired.serving.served_model_name or desired.model.id
    healthy = draw(st.booleans())
    return ServingApi(reachable=draw(often(True, False)), healthy=healthy,
                   models=[draw(often(want, "other-model"))],
                   completion_error=draw(often(None, "timed out")),
                   served_before=draw(st.booleans()), unhealthy_for=draw(st.sampled_from([None, 5.0, 10_000.0])),
                   health_restarts=draw(st.integers(0, 6)))


@st.composite
def observations(draw, desired: spec.Desired, all_reachable: bool = False) -> Observed:
    nodes = {}
    rev = desired.model.revision
    prefix = f"snapshots/{rev}/" if desired.model.layout == "hf-cache" else ""
    files = manifest(draw(st.integers(1, 4)), prefix=prefix)
    if prefix and draw(often(True, False)):  # else the revision does not resolve in the source's cache
        files.append(WeightFile(path=f"refs/{rev}", size=40, mtime=1.0))
    elif prefix:
        files = manifest(len(files), prefix="snapshots/" + "2" * 40 + "/")
    # The head's cluster id: not read (an older snapshot), made with the head's address of today, made under a
    # former address (renumbered since), or both former names adopted.
    identity = draw(st.sampled_from([None, ClusterIdentity(id=CLUSTER_ID, known_as=[desired.instance]),
                                     ClusterIdentity(id=CLUSTER_ID, known_as=[FORMER]),
                                     ClusterIdentity(id=CLUSTER_ID, known_as=[FORMER, desired.instance])]))
    label = identity.id if identity else desired.instance
    for node in desired.nodes:
        reachable = all_reachable or draw(st.integers(0, 9)) > 0
        if not reachable:
            nodes[node.name] = NodeObservation(name=node.name, reachable=False, error="timed out")
            continue
        image = draw(often(Image(id="sha256:good", content="sha256:good"),
                           Image(id=f"sha256:{node.name}-copy", content="sha256:good"),  # containerd store
                           Image(id="sha256:old", content="sha256:old"), None))
        if node.name in desired.image_sources[:1] and draw(often(True, False)):
            image = Image(id="sha256:good", content="sha256:good")
        images = {IMAGE: image} if image else {}
        ports = node.fabric.ports()
        links = [Link(name=p.interface, admin_up=draw(often(True, False)), carrier=draw(often(True, False)),
                      operstate="up", mtu=draw(often(node.fabric.mtu, 1500)),
                      addresses=draw(often([str(p.address)], [], ["10.9.9.9/24"])),
                      rdma=(RdmaPort(state=draw(often("4: ACTIVE", "1: DOWN")), phys_state="5: LinkUp")
                            if p.rdma_device else None))
                 for p in ports]
        if draw(st.integers(0, 19)) == 0:
            links[0] = Link(name=ports[0].interface, exists=False)
        nodes[node.name] = NodeObservation(
            name=node.name, reachable=True, docker_reachable=all_reachable or draw(st.integers(0, 9)) > 0,
            containers=draw(containers(desired, node.name, image.id if image else "sha256:none", label)),
            images=images, identity=identity if node.role == "head" else None,
            fabric=links[0], fabric_twin=links[1] if len(links) > 1 else None,
            memory=Memory(total_bytes=128 * GIB, available_bytes=draw(often(120, 10)) * GIB),
            weights=_weights(draw, desired, node.name, files),
            serving=api_state(draw, desired) if node.role == "head" else None)
    return Observed(nodes=nodes)
