"""The head's "internet" (docs/testbed.md): in `fresh-head`, the head, over SSH as `spark`, downloads a model from
the Hub stand-in with the real `hf` CLI (testbed/hub.py) and pulls the serving image from the registry
(testbed/registry.py); the worker has no `hf`, and neither the Hub nor the registry answers it."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from testbed import hub, registry, weights
from testbed.layout import MODELS, SERVED_MODEL
from testbed.proc import wait_for
from testbed.sshd import HF_BIN

DENSE = "testorg/tiny-dense"


def run(conn, cmd: str):
    return conn.run(cmd, hide=True, warn=True, in_stream=False)


@pytest.mark.e2e
def test_the_head_reaches_the_hub_and_the_registry_and_the_worker_does_not(testbed, ssh):
    testbed.reset("fresh-head")
    try:
        head, worker = ssh("head"), ssh("worker")
        cache = testbed.head.model_root / "hub"
        org, name = SERVED_MODEL.split("/")
        assert not (cache / f"models--{org}--{name}").exists()               # the scenario: nothing to serve yet
        assert run(head, f"docker image inspect {registry.IMAGE}").failed

        since = time.time()
        rev = MODELS[DENSE]
        r = run(head, f"hf download {DENSE} --revision {rev} --cache-dir {cache}")
        assert r.ok, r.stderr
        assert weights.verify_model(cache / "models--testorg--tiny-dense" / "snapshots" / rev)
        wait_for(lambda: any(q["kind"] == "cdn" and q["status"] == 200 for q in hub.requests(since)), timeout=5,
                 what="the shards' GETs in the Hub stand-in's log")
        r = run(head, f"docker pull {registry.IMAGE}")
        assert r.ok, r.stderr
        ids = run(head, f"docker image inspect --format '{{{{.Id}}}}' {registry.IMAGE} vllm-standin:latest"
                  ).stdout.split()
        assert len(ids) == 2 and ids[0] == ids[1]

        assert run(worker, "command -v hf").failed                     # no `hf` on its PATH
        tmp = run(worker, "mktemp -d").stdout.strip()
        r = run(worker, f"HF_ENDPOINT={hub.HF_ENDPOINT} HF_HUB_DISABLE_UPDATE_CHECK=1 {HF_BIN}/hf download {DENSE} "
                       f"--revision {rev} --cache-dir {tmp}")
        assert r.failed and "Connection refused" in r.stderr, r.stderr
        assert not list(Path(tmp).rglob("*.safetensors"))
        run(worker, f"rm -rf {tmp}")
        r = run(worker, f"docker pull {registry.IMAGE}")
        assert r.failed and "connection refused" in r.stderr, r.stderr
    finally:
        testbed.reset("seed")
