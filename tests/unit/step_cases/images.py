"""image: the serving image copied head -> worker over the fabric (`docker save | dd | ssh 'docker load'`), its
re-checks (the source still has the planned content and pin; the target lacks it) and its checks after the load
(no other tag loaded, the content arrived). The inspect answers are a real `docker image inspect` (Docker 20.10,
overlay2: tests/unit/fixtures/docker-20.10-overlay2-image-inspect.json)."""

from __future__ import annotations

import copy
import json
import shlex
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any

from reconciler.core.observed import Observed
from reconciler.core.planning import Step
from reconciler.core.spec import Desired
from reconciler.edge.facts.images import image_from_inspect
from reconciler.edge.ssh import Result
from reconciler.edge.steps.actions import Given
from reconciler.edge.steps.images import copy_argv
from tests.unit.step_cases import HEAD, WORKER, Case, sample, with_known_hosts
from tests.unit.step_driver import Raw

FIXTURE = Path(__file__).parent.parent / "fixtures" / "docker-20.10-overlay2-image-inspect.json"
RAW: dict[str, Any] = json.loads(FIXTURE.read_text())[0]
REF = "nvcr.io/nvidia/vllm:26.05-py3"  # the sample's serving.image
#: A host key as the reconciler's known_hosts holds it (the worker's, under its ssh address).


def inspect_of(raw: dict[str, Any]) -> Raw:
    """`docker image inspect REF` as a node prints it: an array of one inspect object."""
    return Raw(json.dumps([raw]))


def no_image(ref: str = REF) -> Raw:
    return Raw(f"Error response from daemon: No such image: {ref}", 1)


def other_layers() -> dict[str, Any]:
    """The same tag with other content (another build): its layers differ."""
    raw = copy.deepcopy(RAW)
    raw["RootFS"]["Layers"] = ["sha256:" + "5" * 64]
    raw["Id"] = "sha256:" + "6" * 64
    return raw


CONTENT = image_from_inspect(RAW).content


@cache
def trusted() -> Desired:
    """The sample, its known_hosts a file that holds both nodes' keys (the hop's strict host key needs them)."""
    return with_known_hosts(sample())


@cache
def pinned_elsewhere() -> Desired:
    desired = trusted()
    return desired.with_deployment(serving=desired.serving.model_copy(
        update={"image_id": "sha256:" + "7" * 64}))


def COPY(desired: Desired, source: str = HEAD, target: str = WORKER, ref: str = REF) -> str:
    """The copy's command line as the transcript shows it (the argv is pinned by test_image_copy_shell.py, which
    runs it with stand-in docker and ssh)."""
    given = Given(desired, Observed(nodes={}))
    return f"{source} " + shlex.join(copy_argv(given, ref, target, desired.policy.timeouts.image_sync))


TRUST = (f"run {HEAD} sh -c 'umask 077 && mkdir -p \"$HOME/.ssh\" && cat > \"$HOME/.ssh/$0\"' "
         f"spark-reconciler_fabric_known_hosts_{WORKER}")


def _step(content: str | None = CONTENT) -> Step:
    return Step("image", WORKER, "missing", (), image=REF, source=HEAD, content=content)


def _case(name: str, commands: list[str], facts: dict[str, list[object]], *, step: Step | None = None,
          results: dict[str, list[Result]] | None = None, raises: str | None = None,
          desired: Callable[[], Desired] = trusted) -> Case:
    return Case(name, step or _step(), commands, facts=facts, results=results or {}, raises=raises,
                desired=desired)


READS = [f"read {HEAD} image {REF}", f"read {WORKER} image {REF}"]
SHORT = "docker.io/library/vllm:1"  # `docker load` prints it as `vllm:1`
LOADED = Result("", f"Loaded image: {REF}\n", 0)


def _copied(*after: str, ref: str = REF) -> list[str]:
    return [f"read {HEAD} image {ref}", f"read {WORKER} image {ref}", TRUST, "report image.start",
            f"run {COPY(trusted(), ref=ref)}", *after]


CASES = [
    _case("the target holds the same content: nothing copied", READS,
          {f"{HEAD} image {REF}": [inspect_of(RAW)], f"{WORKER} image {REF}": [inspect_of(RAW)]}),
    _case("the target lacks it: trusted, copied, checked, recorded",
          _copied(f"read {WORKER} image {REF}", "report image.done", f"run {WORKER} sh -s"),
          {f"{HEAD} image {REF}": [inspect_of(RAW)], f"{WORKER} image {REF}": [no_image(), inspect_of(RAW)]},
          results={COPY(trusted()): [LOADED]}),
    _case("the target holds other content under the tag: copied over it",
          _copied(f"read {WORKER} image {REF}", "report image.done", f"run {WORKER} sh -s"),
          {f"{HEAD} image {REF}": [inspect_of(RAW)],
           f"{WORKER} image {REF}": [inspect_of(other_layers()), inspect_of(RAW)]},
          results={COPY(trusted()): [LOADED]}),
    _case("a ledger that cannot be written is said, the copy stands",
          _copied(f"read {WORKER} image {REF}", "report image.done", f"run {WORKER} sh -s",
                  "report ledger.unwritten"),
          {f"{HEAD} image {REF}": [inspect_of(RAW)], f"{WORKER} image {REF}": [no_image(), inspect_of(RAW)]},
          results={COPY(trusted()): [LOADED], f"{WORKER} sh -s": [Result("", "disk full", 1)]}),
    _case("the source no longer has it: refused", READS[:1], {f"{HEAD} image {REF}": [no_image()]},
          raises=f"{REF} is no longer present on {HEAD}"),
    _case("the source's content changed since the plan: nothing copied", READS[:1],
          {f"{HEAD} image {REF}": [inspect_of(other_layers())]},
          raises="changed since the plan .*nothing is copied; the next reconcile plans again"),
    _case("the plan saw no content: the source's is taken as it is now", READS,
          {f"{HEAD} image {REF}": [inspect_of(other_layers())], f"{WORKER} image {REF}": [inspect_of(other_layers())]},
          step=_step(None)),
    _case("the source is not the pinned id: nothing copied", READS[:1], {f"{HEAD} image {REF}": [inspect_of(RAW)]},
          raises="is sha256:87a0f05abb90, not the pinned sha256:777777777777: nothing is copied",
          desired=pinned_elsewhere),
    _case("a broken engine on the target is no reason to copy 20 GB", READS,
          {f"{HEAD} image {REF}": [inspect_of(RAW)],
           f"{WORKER} image {REF}": [Raw("Cannot connect to the Docker daemon at unix:///var/run/docker.sock", 1)]},
          raises=f"{WORKER}: `docker image inspect {REF}` failed \\(exit 1\\): Cannot connect"),
    _case("no verified host key for the target: nothing copied", READS,
          {f"{HEAD} image {REF}": [inspect_of(RAW)], f"{WORKER} image {REF}": [no_image()]},
          raises="no host key for 192.168.200.13 in /etc/spark-reconciler/known_hosts", desired=sample),
    _case("the archive loaded another tag too: refused", _copied(),
          {f"{HEAD} image {REF}": [inspect_of(RAW)], f"{WORKER} image {REF}": [no_image()]},
          results={COPY(trusted()): [Result("", f"Loaded image: {REF}\nLoaded image: ubuntu:24.04\n", 0)]},
          raises="the archive from spark-1a32 also loaded ubuntu:24.04 on spark-5be3: only .* was asked for"),
    _case("docker's own short form of the tag is the tag",
          _copied(f"read {WORKER} image {SHORT}", "report image.done", f"run {WORKER} sh -s", ref=SHORT),
          {f"{HEAD} image {SHORT}": [inspect_of(RAW)], f"{WORKER} image {SHORT}": [no_image(), inspect_of(RAW)]},
          step=Step("image", WORKER, "missing", (), image=SHORT, source=HEAD, content=CONTENT),
          results={COPY(trusted(), ref=SHORT): [Result("", "Loaded image: vllm:1\n", 0)]}),
    _case("the pipeline fails: the copy fails with its stderr", _copied(),
          {f"{HEAD} image {REF}": [inspect_of(RAW)], f"{WORKER} image {REF}": [no_image()]},
          results={COPY(trusted()): [Result("", "write /dev/stdout: no space left on device", 1)]},
          raises="over the fabric failed \\(exit 1\\) after 0 bytes: write /dev/stdout: no space left on device"),
    _case("the load left other content: the copy fails", _copied(f"read {WORKER} image {REF}"),
          {f"{HEAD} image {REF}": [inspect_of(RAW)], f"{WORKER} image {REF}": [no_image(), inspect_of(other_layers())]},
          results={COPY(trusted()): [LOADED]}, raises="after loading 0 bytes, .* has content sha256:"),
    _case("the load left nothing: the copy fails", _copied(f"read {WORKER} image {REF}"),
          {f"{HEAD} image {REF}": [inspect_of(RAW)], f"{WORKER} image {REF}": [no_image()]},
          results={COPY(trusted()): [LOADED]}, raises="has content none, expected sha256:"),
]


# -- the survivors of issue 34's mutation run (docs/mutation-survivors-edge.md): the pin checked on both ends,
# the exact short ids a refusal names, docker's short form without `library/`, a long stderr cut to its tail.

ID = RAW["Id"]  # the fixture's own id: the pin it matches
OTHER_CONTENT = image_from_inspect(other_layers()).content
HUB_REF = "docker.io/nvidia/vllm:1"  # `docker load` prints it as `nvidia/vllm:1`


def pinned_to(image_id: str) -> Callable[[], Desired]:
    """The trusted sample with `serving.image_id` pinned to `image_id`."""
    def desired() -> Desired:
        base = trusted()
        return base.with_deployment(serving=base.serving.model_copy(update={"image_id": image_id}))
    return desired


def reloaded(image_id: str, *, containerd: bool = False) -> dict[str, Any]:
    """The fixture's image as a load leaves it on the target: the same content (layers, config) under `image_id`,
    on the same graph-driver store or (`containerd`) on the containerd image store (the inspect's Descriptor)."""
    raw = copy.deepcopy(RAW)
    raw["Id"] = image_id
    if containerd:
        raw["Descriptor"] = {"mediaType": "application/vnd.oci.image.index.v1+json", "digest": image_id, "size": 1}
    return raw


ANOTHER_ID = "sha256:" + "8" * 64
TAIL = "y" * 600  # what a refusal keeps of a long stderr: its last 600 characters

CASES += [
    _case("the source is the pinned id: copied, and the loaded image checked against the pin",
          _copied(f"read {WORKER} image {REF}", "report image.done", f"run {WORKER} sh -s"),
          {f"{HEAD} image {REF}": [inspect_of(RAW)], f"{WORKER} image {REF}": [no_image(), inspect_of(RAW)]},
          results={COPY(trusted()): [LOADED]}, desired=pinned_to(ID)),
    _case("the load left the content under another id on the same store: not the pinned image, refused",
          _copied(f"read {WORKER} image {REF}"),
          {f"{HEAD} image {REF}": [inspect_of(RAW)],
           f"{WORKER} image {REF}": [no_image(), inspect_of(reloaded(ANOTHER_ID))]},
          results={COPY(trusted()): [LOADED]}, desired=pinned_to(ID),
          raises=f"^after loading, {REF} on {WORKER} is sha256:888888888888, not the pinned sha256:87a0f05abb90$"),
    _case("the target's containerd store gives the loaded image another id: ids of two stores never compared",
          _copied(f"read {WORKER} image {REF}", "report image.done", f"run {WORKER} sh -s"),
          {f"{HEAD} image {REF}": [inspect_of(RAW)],
           f"{WORKER} image {REF}": [no_image(), inspect_of(reloaded(ANOTHER_ID, containerd=True))]},
          results={COPY(trusted()): [LOADED]}, desired=pinned_to(ID)),
    _case("docker.io/ORG/NAME loads as ORG/NAME: the same tag, copied",
          _copied(f"read {WORKER} image {HUB_REF}", "report image.done", f"run {WORKER} sh -s", ref=HUB_REF),
          {f"{HEAD} image {HUB_REF}": [inspect_of(RAW)], f"{WORKER} image {HUB_REF}": [no_image(), inspect_of(RAW)]},
          step=Step("image", WORKER, "missing", (), image=HUB_REF, source=HEAD, content=CONTENT),
          results={COPY(trusted(), ref=HUB_REF): [Result("", "Loaded image: nvidia/vllm:1\n", 0)]}),
    _case("the archive loaded two other tags: both named", _copied(),
          {f"{HEAD} image {REF}": [inspect_of(RAW)], f"{WORKER} image {REF}": [no_image()]},
          results={COPY(trusted()): [Result("", f"Loaded image: {REF}\nLoaded image: a:1\nLoaded image: b:2\n", 0)]},
          raises=f"also loaded a:1, b:2 on {WORKER}: only"),
    _case("the source's content changed: both contents named by their first 12 hex digits", READS[:1],
          {f"{HEAD} image {REF}": [inspect_of(other_layers())]},
          raises=rf"\(content {OTHER_CONTENT[:19]}, planned {CONTENT[:19]}\): nothing is copied"),
    _case("the load left other content: both contents named by their first 12 hex digits",
          _copied(f"read {WORKER} image {REF}"),
          {f"{HEAD} image {REF}": [inspect_of(RAW)], f"{WORKER} image {REF}": [no_image(), inspect_of(other_layers())]},
          results={COPY(trusted()): [LOADED]},
          raises=f"has content {OTHER_CONTENT[:19]}, expected {CONTENT[:19]}$"),
    _case("a failed pipeline's long stderr: only its last 600 characters in the refusal", _copied(),
          {f"{HEAD} image {REF}": [inspect_of(RAW)], f"{WORKER} image {REF}": [no_image()]},
          results={COPY(trusted()): [Result("", "x" + TAIL, 1)]},
          raises=f"after 0 bytes: {TAIL}$"),
]
