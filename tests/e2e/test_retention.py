"""Retention end to end (`policy.retention`, issue 29 item 3): three generations of the model, each copied to the
internet-less worker into its own tree; with `prune: true` the worker keeps the current and the previous tree,
and the oldest one, which this cluster copied, is removed by a planned step — while the new generation serves,
the head's source trees are untouched and a tree a person put on the worker stays."""

from __future__ import annotations

import pytest

from tests.e2e.test_converge import DESIRED, api_models, reconciler, variant

pytestmark = pytest.mark.e2e

SRV = "/srv/spark-testbed"
TREE = "models--testorg--tiny-moe"


def _hub(node: str, i: int) -> str:
    return f"{SRV}/{node}/models/hub" + ("" if i == 1 else str(i))


def _generation(i: int):
    def change(d):
        d.setdefault("policy", {})["retention"] = {"prune": True, "previous": 1}
        d["model"]["path"] = {"head": _hub("head", i), "worker": _hub("worker", i)}
    return change


def _exists(tb, node: str, path: str) -> bool:
    return tb.exec(node, f"test -e {path}").returncode == 0


def test_the_oldest_copy_goes_the_previous_stays(seed_testbed, tmp_path):
    tb = seed_testbed
    try:
        for i in (2, 3):  # the same model under other hub directories on the head: other trees to copy
            tb.exec("head", f"cp -a {_hub('head', 1)} {_hub('head', i)}", check=True)
        tb.exec("worker", f"mkdir -p {_hub('worker', 1)}/models--someone--notes && "
                          f"echo mine > {_hub('worker', 1)}/models--someone--notes/README", check=True)
        for i in (1, 2):
            result = reconciler("apply", str(variant(tmp_path, _generation(i))), "--yes")
            assert result.returncode == 0, result.stdout + result.stderr
            assert "prune-" not in result.stdout, "the current and one previous tree: nothing to remove yet"
        ledger = tb.exec("worker", "cat ~/.spark-reconciler/copies", check=True).stdout
        assert f"copied\tworker\tweights\t{_hub('worker', 1)}/{TREE}\t" in ledger, ledger
        assert f"served\tworker\tweights\t{_hub('worker', 2)}/{TREE}\t" in ledger, ledger

        third = variant(tmp_path, _generation(3))
        shown = reconciler("plan", str(third))
        assert shown.returncode == 2, shown.stdout + shown.stderr  # changes pending (docs/cli.md)
        assert "prune-weights/worker" in shown.stdout and f"- {_hub('worker', 1)}/{TREE}" in shown.stdout, \
            shown.stdout
        result = reconciler("apply", str(third), "--yes")
        assert result.returncode == 0, result.stdout + result.stderr
        assert not _exists(tb, "worker", f"{_hub('worker', 1)}/{TREE}"), "the oldest copy is removed"
        assert _exists(tb, "worker", f"{_hub('worker', 2)}/{TREE}"), "the previous one stays for a rollback"
        assert _exists(tb, "worker", f"{_hub('worker', 3)}/{TREE}")
        assert tb.exec("worker", f"cat {_hub('worker', 1)}/models--someone--notes/README").stdout == "mine\n"
        for i in (1, 2, 3):
            assert _exists(tb, "head", f"{_hub('head', i)}/{TREE}"), "the source is never pruned"
        assert api_models(tb) == ["tiny-moe"]
        assert "removed\tworker\tweights" in tb.exec("worker", "cat ~/.spark-reconciler/copies").stdout
        again = reconciler("plan", str(third))
        assert again.returncode == 0, again.stdout
    finally:
        for node in ("head", "worker"):
            tb.exec(node, f"rm -rf {_hub(node, 2)} {_hub(node, 3)} {_hub('worker', 1)}/models--someone--notes",
                    user="root")
        reconciler("apply", str(DESIRED), "--yes")


def _image_generation(i: int):
    def change(d):
        d.setdefault("policy", {})["retention"] = {"prune": True, "previous": 1}
        d["serving"]["image"] = "vllm-standin:latest" if i == 1 else f"vllm-standin:gen{i}"
    return change


def _image_id(tb, node: str, ref: str) -> str | None:
    found = tb.docker(node, "image", "inspect", "--format", "{{.Id}}", ref, check=False)
    return found.stdout.strip() if found.returncode == 0 else None


def test_the_oldest_image_goes_unforced_the_previous_stays(seed_testbed, tmp_path):
    """Three serving images of different content (the stand-in with one more layer each, made on the head by
    `docker commit`, as a rebuilt tag would be). After the third, the worker keeps the second and the third; the
    first, which this cluster loaded there, is removed with `docker image rm` (no --force)."""
    tb = seed_testbed
    try:
        for i in (2, 3):
            tb.docker("head", "rm", "-f", f"retention-gen{i}", check=False)
            for node in ("head", "worker"):  # left by a run that died before its cleanup
                tb.docker(node, "image", "rm", "-f", f"vllm-standin:gen{i}", check=False)
            mark = tmp_path / f"gen{i}"
            mark.write_text(f"generation {i}\n")
            tb.docker("head", "create", "--name", f"retention-gen{i}", "vllm-standin:latest")  # never started
            tb.docker("head", "cp", str(mark), f"retention-gen{i}:/generation")  # a layer of its own
            tb.docker("head", "commit", f"retention-gen{i}", f"vllm-standin:gen{i}")
            tb.docker("head", "rm", f"retention-gen{i}")
        first = None
        for i in (1, 2, 3):
            result = reconciler("apply", str(variant(tmp_path, _image_generation(i))), "--yes")
            assert result.returncode == 0, result.stdout + result.stderr
            if i == 1:
                first = _image_id(tb, "worker", "vllm-standin:latest")
                assert first, "the seed's image was copied to the worker"
            assert api_models(tb) == ["tiny-moe"]
        assert _image_id(tb, "worker", "vllm-standin:latest") is None, "the oldest image is removed"
        assert _image_id(tb, "worker", "vllm-standin:gen2") and _image_id(tb, "worker", "vllm-standin:gen3")
        assert _image_id(tb, "head", "vllm-standin:latest"), "the image source is never pruned"
        ledger = tb.exec("worker", "cat ~/.spark-reconciler/copies", check=True).stdout
        assert "removed\tworker\timage\tsha256:" in ledger, ledger
    finally:
        reconciler("apply", str(DESIRED), "--yes")  # serving back on the testbed's image, then the others go:
        for i in (2, 3):  # the data roots outlive the testbed (its image cache), and so would these tags
            for node in ("head", "worker"):
                tb.docker(node, "image", "rm", "-f", f"vllm-standin:gen{i}", check=False)
