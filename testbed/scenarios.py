"""Scenarios: the state the nodes are put in before a test, and the fast ``reset`` back to one.

* ``seed`` — the starting point of the seed story: the head runs the co-tenants ``vllm_node`` (a GLM
  stand-in on :8000), ``vllm_embeddings`` (:8001) and ``reranker`` (:8002) and holds both test models in both
  layouts plus the serving image; the worker runs ``vllm_embeddings`` only, holds no weights and no serving
  image, and its fabric port is DOWN (mtu 1500, no address).
* ``converged`` — as the reconciler leaves it, minus the serving containers themselves: fabric up with mtu
  9000 and addresses on every node, the served model (hf-cache layout) and the serving image on every node,
  only the allowed co-tenants running.
* ``seed-fabric`` — the seed as a pair of Sparks has it: a worker has no management port of its own (its testbed
  cable to the inner switch is cut; a Spark has no such NIC) and is reached through the head over the fabric
  only. Its first fabric port is DOWN as in ``seed``, its twin is up (mtu 9000, its address): the reconciler
  reaches it over the twin (`ssh.fallback_hosts`) and repairs the first port from there.
* ``empty`` — nothing: no containers, no weights, no stand-in images on the workers, every fabric port down
  and unconfigured. (Images on the head are kept: they are the build cache.)
* ``fresh-head`` — the seed, but the head has to stage from "the internet": it holds neither the served model
  (``testorg/tiny-moe``: the Hub stand-in has it, testbed/hub.py) nor the serving image the desired state
  STATE/testbed-fresh.yaml asks for (``127.0.0.1:5000/testorg/vllm-standin:latest``: the head's registry has it,
  testbed/registry.py). The head keeps ``testorg/tiny-dense`` in the plain layout only (a model of its own, not
  the desired one) and its stand-in build cache (``vllm-standin:latest``, the same image id).

Every scenario has "the internet" on the head: the Hub stand-in and the registry run on the head's loopback, the
Hub's runtime config (gating, throttle) is back to its defaults, and the registry holds the serving stand-in.

``apply()`` is idempotent and is what ``up`` and ``reset`` both call: it removes every container, restores
links, sshd and dockerd, frees filled disks, and rewrites weights only where they differ from what the
scenario needs (a manifest of sizes and mtimes notices a corrupted, truncated or deleted shard).
"""
from __future__ import annotations

import json
import os
import pwd
import shutil
from pathlib import Path

from . import dockerd, gpu, hub, memory, net, registry, sshd, storage
from .layout import MODELS, SERVED_MODEL, SSH_USER, Layout, Node
from .proc import TestbedError
from .realvllm.image import IMAGE as REAL_IMAGE

SCENARIOS = ("seed", "seed-fabric", "converged", "empty", "fresh-head")
SERVING_IMAGE = "vllm-standin:latest"
COTENANT_IMAGE = "cotenant-standin:latest"
FILL_FILE = ".testbed-fill"
CRASH_MARKER = ".standin-crash"   # the serving stand-in crashes at start when this is at the model root

# name -> (port, hold-mb, label); ports as on the real head: 8000 is the serving port once vllm_node is gone
COTENANTS = {
    "vllm_node": (8000, 64, "glm-4.5-air"),
    "vllm_embeddings": (8001, 32, "embeddings"),
    "reranker": (8002, 16, "reranker"),
}
SEED_COTENANTS = {"head": ["vllm_node", "vllm_embeddings", "reranker"], "worker": ["vllm_embeddings"]}
CONVERGED_COTENANTS = {"head": ["vllm_embeddings", "reranker"], "worker": ["vllm_embeddings"]}


def shard_plan(weights_size: int, model_id: str) -> tuple[int, int]:
    """(shards, shard_bytes) for a model of about *weights_size* bytes: 4 shards for the MoE, 2 for dense."""
    shards = 4 if "moe" in model_id else 2
    return shards, max(weights_size // shards, 4096)


def run_cotenant(node: Node, name: str) -> None:
    port, hold, label = COTENANTS[name]
    dockerd.docker(node, "run", "-d", "--name", name, "--network", "host", "--restart", "unless-stopped",
                   COTENANT_IMAGE, "cotenant", "--port", str(port), "--hold-mb", str(hold), "--label", label)


def build_images(lay: Layout) -> None:
    """Build both stand-in images into the head's engine (docker's layer cache makes a rebuild cheap)."""
    from . import images  # written alongside (testbed/images); imported late so the rest works without it
    images.build(lay.head.docker_host, None)
    for ref in (SERVING_IMAGE, COTENANT_IMAGE):
        if dockerd.image_id(lay.head, ref) is None:
            raise TestbedError(f"images.build did not produce {ref} on the head")


def _remove_image(node: Node, ref: str) -> None:
    dockerd.docker(node, "rmi", "-f", ref, check=False)


# ---- weights -------------------------------------------------------------------------------------------------

def _manifest(root: Path) -> dict[str, list[int]]:
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in filenames + [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]:
            p = os.path.join(dirpath, name)
            st = os.lstat(p)
            out[os.path.relpath(p, root)] = [st.st_size, st.st_mtime_ns]
    return out


def _manifest_file(node: Node) -> Path:
    return node.state / "weights-manifest.json"


def ensure_weights(node: Node, wanted: list[tuple[str, str]], weights_size: int) -> None:
    """Make the node's model root hold exactly *wanted* [(model_id, layout)], regenerating only on change."""
    from . import weights
    key = {"wanted": sorted(map(list, wanted)), "size": weights_size}
    mf = _manifest_file(node)
    try:
        saved = json.loads(mf.read_text())
    except (OSError, ValueError):
        saved = None
    if saved and saved.get("key") == key and saved.get("files") == _manifest(node.model_root):
        return
    storage.wipe(node)
    for model_id, lay in wanted:
        shards, shard_bytes = shard_plan(weights_size, model_id)
        weights.generate(node.model_root, model_id, MODELS[model_id], lay, shards, shard_bytes)
    for dirpath, dirnames, filenames in os.walk(node.model_root):
        for n in dirnames + filenames:
            os.lchown(os.path.join(dirpath, n), *spark_ids())
    mf.write_text(json.dumps({"key": key, "files": _manifest(node.model_root)}))


def spark_ids() -> tuple[int, int]:
    import pwd
    pw = pwd.getpwnam(SSH_USER)
    return pw.pw_uid, pw.pw_gid


# ---- apply ---------------------------------------------------------------------------------------------------

def _role_key(node: Node) -> str:
    return "head" if node.index == 0 else "worker"


ALL_MODELS = [(m, layout) for m in MODELS for layout in ("hf-cache", "plain")]


def _seed_node(head: Node, n: Node, weights_size: int) -> None:
    """The head: fabric up, every model in both layouts, all co-tenants. A worker: fabric down, no weights,
    no serving image, only vllm_embeddings."""
    role = _role_key(n)
    if role == "head":
        net.fabric_configure(n)
    else:
        net.fabric_unconfigure(n)
    ensure_weights(n, ALL_MODELS if role == "head" else [], weights_size)
    if role == "worker":
        _remove_image(n, SERVING_IMAGE)
        dockerd.copy_image(head, n, COTENANT_IMAGE)
    for c in SEED_COTENANTS[role]:
        run_cotenant(n, c)


def _seed_fabric_node(head: Node, n: Node, weights_size: int) -> None:
    """As `_seed_node`; a worker reachable over its fabric twin only."""
    _seed_node(head, n, weights_size)
    if _role_key(n) == "worker":
        net.fabric_configure(n, twin_only=True)
        net.set_mgmt(n, False)


def _converged_node(head: Node, n: Node, weights_size: int) -> None:
    """Fabric up, the served model and the serving image in place, only the allowed co-tenants running."""
    role = _role_key(n)
    net.fabric_configure(n)
    ensure_weights(n, ALL_MODELS if role == "head" else [(SERVED_MODEL, "hf-cache")], weights_size)
    if role == "worker":
        dockerd.copy_image(head, n, SERVING_IMAGE)
        dockerd.copy_image(head, n, COTENANT_IMAGE)
    for c in CONVERGED_COTENANTS[role]:
        run_cotenant(n, c)


def _empty_node(head: Node, n: Node, weights_size: int) -> None:
    """Fabric down, no weights; a worker also loses both stand-in images (the head's are the build cache)."""
    net.fabric_unconfigure(n)
    ensure_weights(n, [], weights_size)
    if _role_key(n) == "worker":
        _remove_image(n, SERVING_IMAGE)
        _remove_image(n, COTENANT_IMAGE)


FRESH_HEAD_MODELS = [(m, "plain") for m in MODELS if m != SERVED_MODEL]


def _fresh_head_node(head: Node, n: Node, weights_size: int) -> None:
    """As `_seed_node`, but the head holds no weights of the served model (and no hf-cache at all) and no serving
    image under the registry's name: both are to be fetched from the head's "internet"."""
    _seed_node(head, n, weights_size)
    if _role_key(n) == "head":
        ensure_weights(n, FRESH_HEAD_MODELS, weights_size)


_SET_UP_NODE = {"seed": _seed_node, "seed-fabric": _seed_fabric_node, "converged": _converged_node,
                "empty": _empty_node, "fresh-head": _fresh_head_node}


def _restore(lay: Layout) -> None:
    """Daemons and management paths back (a test may have stopped them with a fault); then no containers, no
    disk fill and no crash marker on any node."""
    from .faults import probe_restore
    for n in lay.nodes:
        gpu.set_state(n, "ok")
        net.set_mgmt(n, True)
        sshd.start(n)
        probe_restore(lay, n.name)
        dockerd.start(n)
        memory.start_device_memory(n)
    for n in lay.nodes:
        dockerd.remove_all_containers(n)
        (n.model_root / FILL_FILE).unlink(missing_ok=True)
        (n.model_root / CRASH_MARKER).unlink(missing_ok=True)
    # the cluster lease (reconciler.edge.lease) is cluster state too: one a SIGKILLed daemon left would refuse every
    # `apply` of the next test for its 10 minutes; a reset is a fresh cluster
    shutil.rmtree(Path(pwd.getpwnam(SSH_USER).pw_dir) / ".spark-reconciler", ignore_errors=True)


def apply(lay: Layout, scenario: str, weights_size: int) -> None:
    if scenario not in SCENARIOS:
        raise ValueError(f"scenario must be one of {SCENARIOS}, not {scenario!r}")
    head = lay.head
    _restore(lay)
    hub.start(head, weights_size)       # the head's "internet" (kept running; the store is rebuilt only on change)
    hub.reset_config()
    registry.start(head)
    for n in lay.nodes:  # the real vLLM's image is not part of any scenario (`real-vllm` loads it when asked); the
        _remove_image(n, REAL_IMAGE)    # registry's name for the stand-in is on a node only once it was pulled
        _remove_image(n, registry.IMAGE)
    if scenario != "empty" or dockerd.image_id(head, COTENANT_IMAGE) is None:
        build_images(lay)
    if dockerd.image_id(head, SERVING_IMAGE) is not None:
        registry.publish(head)          # skipped when the registry already holds this image id
    for n in lay.nodes:
        _SET_UP_NODE[scenario](head, n, weights_size)
    # dangling layers of removed images are not "holding the image"; prune so `docker images` is exact
    for n in lay.workers:
        dockerd.docker(n, "image", "prune", "-f", check=False)
