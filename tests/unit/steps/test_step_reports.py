"""What a step case's transcript only names (tests/unit/step_cases/): the fields of each progress report, a
command's supervision (`long`) and progress hook (`on_output`, fed recorded output here), a wait's interval, what
a ledger write carries, an error a node raises into a removal, and the refusals the plan's own asserts and the hop
make before any action. Each test kills survivors of issue 34's mutation run over the image, staging, retention,
link and hop steps (docs/mutation-survivors-edge.md; the judged list is /work/notes/34-stepsA.md)."""

from __future__ import annotations

import dataclasses
import shlex
from collections.abc import Mapping, Sequence
from typing import Any

import pytest

from reconciler.core.planning import Step
from reconciler.core.spec import Desired
from reconciler.edge.ssh import ChannelRefused, Result
from reconciler.edge.steps import hop
from reconciler.edge.steps.actions import Action, Given, Read, Report, Run, StepFailed, Wait
from reconciler.edge.steps.images import copy_image
from reconciler.edge.steps.link import converge_link
from reconciler.edge.steps.retention import prune_images, prune_weights
from reconciler.edge.steps.staging import download, pull_image
from tests.unit.recorded import load, observe
from tests.unit.step_cases import HEAD, WORKER, reachable, sample
from tests.unit.step_cases import images as img
from tests.unit.step_cases import link as lnk
from tests.unit.step_cases import retention as ret
from tests.unit.step_cases import staging as stg
from tests.unit.step_driver import Driver


class Recorder(Driver):
    """The step driver, keeping what its transcript leaves out: each report with its fields (those its commands'
    output hooks return too), each command, read and wait as the step yielded it."""

    def __init__(self, facts: Mapping[str, Sequence[object]], results: Mapping[str, Sequence[Result]] | None = None,
                 outputs: Mapping[str, Sequence[bytes]] | None = None) -> None:
        super().__init__(facts, results or {}, outputs=outputs or {})
        self.reports: list[tuple[str, dict[str, Any]]] = []
        self.runs: list[Run] = []
        self.reads: list[Read] = []
        self.waits: list[Wait] = []

    def do(self, action: Action) -> object:
        if isinstance(action, Report):
            self.reports.append((action.event, action.fields))
        elif isinstance(action, Read):
            self.reads.append(action)
        elif isinstance(action, Wait):
            self.waits.append(action)
        return super().do(action)

    def run(self, action: Run) -> Result:
        self.runs.append(action)
        if action.on_output is not None:
            hook = action.on_output

            def seen(chunk: bytes) -> Report | None:
                if (report := hook(chunk)) is not None:
                    self.reports.append((report.event, report.fields))
                return report
            action = dataclasses.replace(action, on_output=seen)
        return super().run(action)

    def command(self, argv0: str) -> Run:
        (run,) = {id(r): r for r in self.runs if r.argv[0] == argv0}.values()
        return run


def ledger_words(stdin: bytes) -> list[str]:
    """The entry words a ledger write carries (`ledger.append`: `set -- NODE BY ACTION KIND KEY DETAIL...`)."""
    return shlex.split(stdin.decode().split("\n", 1)[0])[4:]


# -- the image copy (images.copy_image)

DD = [b"1048576 bytes (1.0 MB, 1.0 MiB) copied, 1 s, 1.0 MB/s\r", b"2097152 bytes (2.1 MB, 2.0 MiB) copied, 2 s\r"]
IMAGE_SIZE = 41_811_973  # the fixture's inspect `Size`: the archive's estimate


def test_an_image_copy_runs_supervised_at_its_own_deadline_and_reports_its_bytes() -> None:
    """The copy is a long command (ends on a shutdown, SIGTERM when its channel closes) bounded by
    `timeouts.image_sync`; dd's counts reach the progress bar; the done report carries the loaded image's id and
    the content it was checked by; the ledger records exactly that copy."""
    driver = Recorder({f"{HEAD} image {img.REF}": [img.inspect_of(img.RAW)],
                       f"{WORKER} image {img.REF}": [img.no_image(), img.inspect_of(img.RAW)]},
                      {img.COPY(img.trusted()): [img.LOADED]}, outputs={img.COPY(img.trusted()): DD})
    assert driver.drive(copy_image(Given(img.trusted(), reachable()), img._step())) is None
    copy = driver.command("bash")
    assert (copy.node, copy.timeout, copy.long) == (HEAD, 3600, True)
    assert driver.reports == [
        ("image.start", {"node": WORKER, "source": HEAD, "bytes_done": 0, "bytes_total": IMAGE_SIZE}),
        ("image.progress", {"node": WORKER, "bytes_done": 1_048_576, "bytes_total": IMAGE_SIZE}),
        ("image.progress", {"node": WORKER, "bytes_done": 2_097_152, "bytes_total": IMAGE_SIZE}),
        ("image.done", {"node": WORKER, "bytes_done": 2_097_152, "bytes_total": IMAGE_SIZE, "image_id": img.ID,
                        "content": img.CONTENT})]
    assert ledger_words(driver.stdin[f"{WORKER} sh -s"]) == ["copied", "image", img.CONTENT, img.ID]


def test_an_image_step_without_its_source_is_the_plans_error_before_any_action() -> None:
    """The plan sets both the image and its source; a step missing either must not read a node named None."""
    step = Step("image", WORKER, "missing", (), image=img.REF, source=None, content=img.CONTENT)
    with pytest.raises(AssertionError, match="the plan sets both for an image step"):
        next(copy_image(Given(img.trusted(), reachable()), step))


# -- staging: download and pull-image

#: `bytes N` lines as the fetch prints them every 2 s: a repeat, a chunk with no size, a smaller one after a
#: larger one in one chunk, bytes that are not UTF-8: the progress only grows, and only on a larger size.
FETCH_OUTPUT = [b"bytes 1024\n", b"bytes 1024\n", b"du: cannot access 'x'\n", b"bytes 4096\nbytes 2048\n",
                b"\xff\xfe not a size\n"]


def test_a_download_runs_supervised_at_the_weights_deadline_and_reports_the_tree_as_it_grows() -> None:
    driver = Recorder({stg.SIZE: [stg.ANSWER], stg.LISTED: [stg.WHOLE]}, stg.BOUND_READY,
                      outputs={stg.FETCH: FETCH_OUTPUT})
    assert driver.drive(download(Given(sample(), stg._observed(200 * stg.GIB)), stg.DOWNLOAD)) is None
    fetch = driver.command("sh")
    assert (fetch.node, fetch.timeout, fetch.long) == (HEAD, 43_200, True)
    assert driver.reports == [
        ("download.start", {"node": HEAD, "model": stg.MODEL, "revision": stg.REVISION, "bytes_total": stg.TOTAL}),
        ("download.progress", {"node": HEAD, "bytes_done": 1024, "bytes_total": stg.TOTAL}),
        ("download.progress", {"node": HEAD, "bytes_done": 4096, "bytes_total": stg.TOTAL}),
        ("download.done", {"node": HEAD, "bytes": 4096, "bytes_total": stg.TOTAL})]


def test_the_hubs_size_is_asked_with_the_token_scoped_to_internet() -> None:
    """A gated model's size needs the token: the size read's script carries it (on sh's stdin, never an argv)."""
    data = sample().model_dump(mode="json")
    data["serving"]["secrets"] = {**data["serving"]["secrets"], "HF_TOKEN": "internet"}
    desired = Desired.model_validate(data).with_secrets({"VLLM_API_KEY": "k", "HF_TOKEN": "hf_secret"})
    driver = Recorder({stg.SIZE: [stg.ANSWER], stg.LISTED: [stg.WHOLE]},
                      {**stg.BOUND_READY, stg.FETCH: [Result("", "", 0)]})
    driver.drive(download(Given(desired, stg._observed(200 * stg.GIB)), stg.DOWNLOAD))
    size, _listing = driver.reads
    assert "'Authorization: Bearer hf_secret\n'" in size.fact.lines[1]


PULL = f"{HEAD} docker pull {stg.IMAGE}"
#: `docker pull`'s lines as they arrive: two layers announced, one landing (then said again), the other found.
PULL_OUTPUT = [b"26.05-py3: Pulling from nvidia/vllm\nabcdef012345: Pulling fs layer\n0123456789ab: Pulling fs layer\n",
               b"abcdef012345: Pull complete\n", b"abcdef012345: Pull complete\n", b"0123456789ab: Already exists\n"]


def test_a_pull_runs_supervised_at_the_image_deadline_and_reports_its_layers_as_they_land() -> None:
    driver = Recorder({}, outputs={PULL: PULL_OUTPUT})
    assert driver.drive(pull_image(Given(sample(), stg._observed(200 * stg.GIB)), stg.PULL)) is None
    pull = driver.command("docker")
    assert (pull.node, pull.timeout, pull.long) == (HEAD, 3600, True)
    assert driver.reports == [
        ("pull.progress", {"node": HEAD, "image": stg.IMAGE, "layers_done": 1, "layers_seen": 2}),
        ("pull.progress", {"node": HEAD, "image": stg.IMAGE, "layers_done": 2, "layers_seen": 2}),
        ("pull.done", {"node": HEAD, "image": stg.IMAGE, "layers": 2})]


# -- retention: prune-weights and prune-images


def _prune_weights(facts: Mapping[str, Sequence[object]], results: Mapping[str, Sequence[Result]] | None = None,
                   *remove: str) -> Recorder:
    driver = Recorder(facts, results)
    desired = load()
    assert driver.drive(prune_weights(Given(desired, observe(desired)), ret.weights(*(remove or (ret.OLD,))))) is None
    return driver


def test_a_removed_tree_is_reported_with_its_bytes() -> None:
    driver = _prune_weights({f"{ret.W1} containers": [ret.NOW], f"{ret.W1} realpath": [ret.CANONICAL],
                             f"{ret.W1} copies": [ret.ledger(ret.COPIED)], f"{ret.W1} tree {ret.OLD}": [ret.LISTING]})
    assert driver.reports == [("retention.remove", {"node": ret.W1, "weights": ret.OLD, "bytes": 67_112_903})]
    assert ledger_words(driver.stdin[f"{ret.W1} sh -s"]) == ["removed", "weights", ret.OLD, "-"]


def test_a_kept_tree_says_why_naming_every_container_whose_mounts_were_unreadable() -> None:
    """Kept is said (`retention.kept`, with the tree and why) and released in the ledger with no detail ("-")."""
    driver = _prune_weights({f"{ret.W1} containers": [ret.containers(vllm_serving="?", vllm_embeddings="?")],
                             f"{ret.W1} realpath": [ret.realpath(ret.OLD, ret.CURRENT, ret.HUB)],
                             f"{ret.W1} copies": [ret.ledger(ret.COPIED)]})
    assert driver.reports == [("retention.kept", {
        "node": ret.W1, "weights": ret.OLD, "why": "the mounts of vllm_embeddings, vllm_serving could not be read"})]
    assert ledger_words(driver.stdin[f"{ret.W1} sh -s"]) == ["released", "weights", ret.OLD, "-"]


def _prune_images(driver: Recorder) -> BaseException | None:
    desired = load()
    return driver.drive(prune_images(Given(desired, observe(desired)), ret.images(ret.IMAGE_CONTENT)))


RM = f"{ret.W1} docker image rm {ret.IMAGE_ID}"


def test_a_removed_image_is_reported_by_its_id() -> None:
    driver = Recorder({f"{ret.W1} copies": [ret.ledger(ret.COPIED_IMAGE)]})
    assert _prune_images(driver) is None
    assert driver.reports == [("retention.remove", {"node": ret.W1, "image": ret.IMAGE_ID})]
    assert ledger_words(driver.stdin[f"{ret.W1} sh -s"]) == ["removed", "image", ret.IMAGE_CONTENT, "-"]


def test_an_image_docker_refuses_is_kept_with_its_short_id_and_the_tail_of_dockers_reason() -> None:
    driver = Recorder({f"{ret.W1} copies": [ret.ledger(ret.COPIED_IMAGE)]}, {RM: [Result("", "x" + "y" * 200, 1)]})
    assert _prune_images(driver) is None
    assert driver.reports == [("retention.kept", {
        "node": ret.W1, "image": ret.IMAGE_CONTENT,
        "why": f"docker refused to remove sha256:000000000000 ({'y' * 200}): released"})]


class Refusing(Recorder):
    """A node whose sshd refuses the removal's channel (MaxSessions): the session raises, no result."""

    def run(self, action: Run) -> Result:
        if action.argv[:3] == ("docker", "image", "rm"):
            raise ChannelRefused(action.node, "open failed: administratively prohibited")
        return super().run(action)


def test_an_image_removal_the_node_cannot_run_fails_the_step_naming_the_node_and_why() -> None:
    driver = Refusing({f"{ret.W1} copies": [ret.ledger(ret.COPIED_IMAGE)]})
    error = _prune_images(driver)
    assert isinstance(error, StepFailed)
    assert str(error) == "`docker image rm` on worker1: worker1: open failed: administratively prohibited"
    assert driver.reports == [] and f"{ret.W1} sh -s" not in driver.stdin, "nothing recorded as removed"


# -- link and hop


def test_the_dont_fragment_ping_is_retried_every_half_second() -> None:
    """Pings a second apart would spend the 20 s on few tries; each is quick (`-W 1`)."""
    driver = Recorder({f"{lnk.W1} links": [lnk.ports()]})
    desired = load()
    assert driver.drive(converge_link(Given(desired, observe(desired)), lnk._step())) is None
    assert [(w.action.argv[0], w.interval) for w in driver.waits if isinstance(w.action, Run)] == [
        ("ping", 0.5), ("ping", 0.5)]


def test_a_target_without_a_known_host_key_is_named_with_its_ssh_port() -> None:
    """known_hosts names a host on another port `[host]:port`: so does the refusal, for the user to look it up."""
    desired = sample()
    nodes = [n.model_copy(update={"ssh": n.ssh.model_copy(update={"port": 2222})}) if n.name == WORKER else n
             for n in desired.nodes]
    with pytest.raises(StepFailed, match=r"^no host key for \[192\.168\.200\.13\]:2222 in "
                                         r"/etc/spark-reconciler/known_hosts$"):
        next(hop.trust_target_on_source(desired.model_copy(update={"nodes": nodes}), HEAD, WORKER))
