"""The real vLLM (0.32.0, CPU build) across the two namespace nodes: tensor parallel 2 over the fabric veth, and
on the worker alone a second deployment, an embeddings server (the vLLM stand-in with `--runner pooling`): the
seed owner's mix of a big model across both Sparks and a small pooling model on the worker (issue 35).

Few tests, each earning its minutes, run in this order on one cluster (module fixture):
1. seed -> both deployments converged in one `apply`: the worker's link comes up, the tiny Llama (HF cache) and the
   2 GB image are copied to the worker, rank 1 (headless) then rank 0 start, then the embeddings deployment on the
   worker (its model and image copied there too; the smaller, after the larger answers), and a completion through
   the head and a pooling request on the worker answer;
1b. an edit of the embeddings deployment restarts it alone while the real vLLM keeps answering, and an edit that
   over-commits the worker is refused with nothing stopped;
2. a serving change (max_model_len) restarts in order and answers again;
3. the worker's fabric link goes down under the running deployment: what vLLM does is recorded (measured on
   2026-12-03: /health kept answering 200 while a completion hung), the reconciler sees the drift (the link, and
   the failed completion), repairs the link, and the deployment answers again;
4. under a load that takes every slot, the daemon says Busy and restarts nothing;
5. a model change whose start fails rolls back by itself to the model that served (issue 36).

Every check reads the nodes directly (testbed exec/docker), not the reconciler's own view.
"""

from __future__ import annotations

import json
import threading
import time

import pytest
import yaml

from testbed.api import EMBED_NAME, EMBED_PORT, with_embeddings
from testbed.proc import wait_for
from testbed.realvllm import image
from tests.e2e.test_busy import load
from tests.e2e.test_converge import containers, content_hashes, reconciler
from tests.e2e.test_loop import serving_ids
from tests.e2e.test_reliability import cond, converged, daemon

pytestmark = pytest.mark.e2e

START_TIMEOUT = 900  # an apply that copies a 2 GB image and starts vLLM twice over on 2 busy cores
GRACE = 20  # unhealthy_grace of the busy test, as in the reproduction


def completion(tb, timeout: int = 60) -> tuple[int, dict | None]:
    """(curl exit code, answer) of one short completion through the head's API."""
    body = json.dumps({"model": image.SERVED_NAME, "prompt": "Hello", "max_tokens": 4, "temperature": 0})
    res = tb.exec("head", f"curl -s -m {timeout} -H 'Content-Type: application/json' -d '{body}' "
                          "http://127.0.0.1:8000/v1/completions")
    try:
        return res.returncode, json.loads(res.stdout)
    except ValueError:
        return res.returncode, None


def health(tb) -> str:
    return tb.exec("head", "curl -s -o /dev/null -m 5 -w '%{http_code}' http://127.0.0.1:8000/health").stdout


def pooling(tb, timeout: int = 30) -> tuple[int, dict | None]:
    """(curl exit code, answer) of one request to the embeddings deployment's Pooling API on the worker."""
    body = json.dumps({"model": EMBED_NAME, "input": "Hello"})
    res = tb.exec("worker", f"curl -s -m {timeout} -H 'Content-Type: application/json' -d '{body}' "
                          f"http://127.0.0.1:{EMBED_PORT}/pooling")
    try:
        return res.returncode, json.loads(res.stdout)
    except ValueError:
        return res.returncode, None


def moe(data: dict) -> dict:
    """The real vLLM's serving section of the mix."""
    return data["deployments"][0]["serving"]


def written(path, data: dict):
    path.write_text(yaml.safe_dump(data, sort_keys=False, explicit_end=True))
    return path


@pytest.fixture(scope="module")
def real(testbed, tmp_path_factory):
    """The seed scenario serving the mix: the real vLLM's image and the tiny model on the head only."""
    tb = testbed.reset("seed")
    single = yaml.safe_load(tb.real_vllm().read_text())
    return tb, written(tmp_path_factory.mktemp("mix") / "mix.yaml", with_embeddings(single))


@pytest.fixture(scope="module")
def deployed(real):
    tb, desired = real
    result = reconciler("apply", str(desired), "--yes", timeout=START_TIMEOUT)
    return tb, desired, result


def test_seed_converges_with_the_real_vllm_in_one_apply(deployed):
    tb, desired, result = deployed
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    assert "Converged" in result.stdout
    done = [line.split()[1] for line in result.stdout.splitlines() if line.strip().startswith("ok ")]
    for step in ("link/worker", "image/worker/@moe", "weights/worker/@moe", "start-serving/worker/@moe",
                 "start-serving/head/@moe", "await-health/head/@moe", "image/worker/@embed",
                 "weights/worker/@embed", "start-serving/worker/@embed", "await-health/worker/@embed"):
        assert step in done, (step, done)
    assert done.index("start-serving/worker/@moe") < done.index("start-serving/head/@moe"), "rank 1 first"
    assert done.index("await-health/head/@moe") < done.index("start-serving/worker/@embed"), "the larger first"

    spec = yaml.safe_load(desired.read_text())["deployments"][0]
    hub = f"models--{image.MODEL_ID.replace('/', '--')}"
    src = content_hashes(tb, "head", f"{spec['model']['path']['head']}/{hub}")
    assert content_hashes(tb, "worker", f"{spec['model']['path']['worker']}/{hub}") == src
    ids = {n: tb.docker(n, "image", "inspect", "--format", "{{.Id}}", image.IMAGE).stdout.strip()
           for n in ("head", "worker")}
    assert ids["head"] == ids["worker"] != ""

    worker = containers(tb, "worker")["vllm_serving"]
    assert worker["State"]["Running"] and "--headless" in worker["Args"]
    env = dict(e.split("=", 1) for e in worker["Config"]["Env"])
    assert env["GLOO_SOCKET_IFNAME"] == "enp1s0f1np1" and env["HF_HUB_OFFLINE"] == "1"
    logs = tb.docker("head", "logs", "vllm_serving").stderr + tb.docker("head", "logs", "vllm_serving").stdout
    assert "world_size=2" in logs and "backend=gloo" in logs, "a real two-rank group, over gloo"
    rc, answer = completion(tb)
    assert rc == 0 and answer and answer["choices"][0]["text"], answer
    rc, pooled = pooling(tb)
    assert rc == 0 and pooled and pooled["data"], pooled
    embed = containers(tb, "worker")["vllm_embed"]
    assert embed["State"]["Running"] and "pooling" in embed["Args"] and "vllm_embed" not in containers(tb, "head")


def test_an_edit_of_one_deployment_restarts_it_alone_while_the_other_answers(deployed, tmp_path):
    """The embeddings deployment's max_model_len changes: its container is replaced, the real vLLM's ranks are
    not, and completions through the head answer all along (asked every second while the apply runs)."""
    tb, desired, _ = deployed
    data = yaml.safe_load(desired.read_text())
    before = {n: {c: containers(tb, n)[c]["Id"] for c in containers(tb, n) if c in ("vllm_serving", "vllm_embed")}
              for n in ("head", "worker")}
    data["deployments"][1]["serving"]["max_model_len"] = 2048
    edit = written(tmp_path / "embed.yaml", data)
    answers: list[int] = []
    done = threading.Event()

    def ask() -> None:
        while not done.is_set() and len(answers) < 600:  # bounded: at most 10 minutes of one request a second
            answers.append(completion(tb, timeout=10)[0])
            done.wait(1)
    asking = threading.Thread(target=ask, daemon=True)
    asking.start()
    try:
        result = reconciler("apply", str(edit), "--yes", timeout=START_TIMEOUT)
    finally:
        done.set()
        asking.join(30)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    order = [line.split()[1] for line in result.stdout.splitlines() if line.strip().startswith("ok ")]
    assert order == ["stop-serving/worker/vllm_embed/@embed", "start-serving/worker/@embed",
                     "await-health/worker/@embed"]
    after = {n: {c: containers(tb, n)[c]["Id"] for c in containers(tb, n) if c in ("vllm_serving", "vllm_embed")}
             for n in ("head", "worker")}
    assert after["head"] == before["head"] and after["worker"]["vllm_serving"] == before["worker"]["vllm_serving"]
    assert after["worker"]["vllm_embed"] != before["worker"]["vllm_embed"]
    assert answers and all(rc == 0 for rc in answers), answers
    assert pooling(tb)[0] == 0
    written(desired, data)  # the state the next tests start from


def test_an_edit_that_over_commits_the_worker_is_refused_with_nothing_stopped(deployed, tmp_path):
    tb, desired, _ = deployed
    data = yaml.safe_load(desired.read_text())
    data["deployments"][1]["serving"]["gpu_memory_utilization"] = 0.95  # 0.1 + 0.95 of the worker
    before = serving_ids(tb, "head") | serving_ids(tb, "worker")
    result = reconciler("apply", str(written(tmp_path / "over.yaml", data)), "--yes", timeout=120)
    assert result.returncode == 3, result.stdout[-3000:] + result.stderr[-3000:]
    assert "over-committed: moe 0.1 + embed 0.95 = 1.05" in result.stderr, result.stderr[-3000:]
    assert serving_ids(tb, "head") | serving_ids(tb, "worker") == before
    assert completion(tb)[0] == 0 and pooling(tb)[0] == 0


def test_the_probe_reads_the_real_vllms_own_counters(deployed):
    """What tells busy from wedged (issue 30, finding 1) read off vLLM 0.32 itself: the probe's engine section
    finds vllm:num_requests_running, vllm:num_requests_waiting and the token counters, and the tokens grow by what
    a completion made (each probe's own one-token completion comes first, so at least 4 + 1)."""
    tb, desired, _ = deployed

    def engine() -> dict:
        out = reconciler("observe", str(desired), "--json")
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
        api = json.loads(out.stdout)["nodes"]["head"]["deployments"]["moe"]["serving"]
        assert api["engine"] is not None, api
        return api["engine"]

    before = engine()
    rc, answer = completion(tb)
    assert rc == 0 and answer and answer["usage"]["completion_tokens"] == 4, answer
    after = engine()
    assert after["tokens"] >= before["tokens"] + 4 + 1, (before, after)
    assert after["running"] == 0 and after["waiting"] == 0, after


def test_serving_change_restarts_in_order_and_answers_again(deployed, tmp_path):
    tb, desired, _ = deployed
    data = yaml.safe_load(desired.read_text())
    moe(data)["max_model_len"] = 2048
    edit = written(tmp_path / "desired.yaml", data)
    result = reconciler("apply", str(edit), "--yes", timeout=START_TIMEOUT)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    order = [line.split()[1] for line in result.stdout.splitlines() if line.strip().startswith("ok ")]
    stops = [i for i, s in enumerate(order) if s.startswith("stop-serving/")]
    starts = [i for i, s in enumerate(order) if s.startswith("start-serving/")]
    assert len(stops) == 2 and len(starts) == 2 and max(stops) < min(starts), order
    assert order.index("start-serving/worker/@moe") < order.index("start-serving/head/@moe")
    assert not [s for s in order if s.endswith("/@embed")], "the other deployment is left alone"
    models = json.loads(tb.exec("head", "curl -s -m 5 http://127.0.0.1:8000/v1/models", check=True).stdout)
    assert models["data"][0]["max_model_len"] == 2048, "vLLM itself reports the new length"
    rc, answer = completion(tb)
    assert rc == 0 and answer and answer["choices"], answer


def test_fabric_link_down_is_seen_by_a_completion_and_repaired(deployed, tmp_path):
    tb, desired, _ = deployed
    data = yaml.safe_load(desired.read_text())
    moe(data)["max_model_len"] = 2048  # the state the previous test left
    current = written(tmp_path / "desired.yaml", data)
    tb.fault("link-down", "worker")
    code = health(tb)
    rc, _ = completion(tb, timeout=10)
    print(f"fabric down under vLLM: /health {code}, completion curl exit {rc}")  # docs/testbed.md records it
    assert rc != 0, "no rank-1 answer over a downed fabric"

    plan = reconciler("plan", str(current), "--json", timeout=120)
    drift = {(d["node"], d["kind"]): d for d in json.loads(plan.stdout)["drift"]}
    assert ("worker", "link") in drift
    assert ("head", "health") in drift
    if code == "200":
        assert "completion failed" in drift[("head", "health")]["observed"], "/health alone would call it healthy"

    result = reconciler("apply", str(current), "--yes", timeout=START_TIMEOUT)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    assert "link/worker" in result.stdout
    rc, answer = completion(tb)
    assert rc == 0 and answer and answer["choices"], answer


def test_every_slot_taken_on_the_real_vllm_is_busy_and_never_restarted(deployed, tmp_path):
    """Finding 1 of issue 30 as it was reproduced, on vLLM 0.32 itself: `--max-num-seqs 4` (the testbed's real
    serving), six clients of long generations for two graces of 20 s. The probe's one-token completion queues
    behind every slot past its 5 s deadline, while vLLM's own token counters keep moving: the status says Busy,
    nothing restarts, and every request is answered (before: "serving served, then failed its health", then both
    ranks stopped at the busiest moment). Two graces of load: a restart would have come after the first."""
    tb, desired, _ = deployed
    data = yaml.safe_load(desired.read_text())
    moe(data).update(max_model_len=2048, unhealthy_grace=f"{GRACE}s")  # 2048: what the tests before left
    data["policy"]["resync_interval"] = "3s"
    busy = tmp_path / "busy.yaml"
    busy.write_text(yaml.safe_dump(data, sort_keys=False, explicit_end=True))
    d = daemon(busy, tmp_path / "state")
    try:
        converged(d, 300)
        before = serving_ids(tb, "head") | serving_ids(tb, "worker")
        body = json.dumps({"model": image.SERVED_NAME, "prompt": "Once upon a time", "max_tokens": 1000,
                           "ignore_eos": True, "temperature": 0})

        def ask() -> int:
            out = tb.exec("head", f"curl -s -o /dev/null -m 600 -w '%{{http_code}}' -H 'Content-Type: "
                                  f"application/json' -d '{body}' http://127.0.0.1:8000/v1/completions",
                          timeout=660).stdout
            return int(out or 0)

        answers, clients = load(ask, 2 * GRACE)
        wait_for(lambda: cond(d, "head", "ServingBusy").get("status") == "True", 3 * GRACE + 60,
                 "the status saying Busy")
        busy_seen = cond(d, "head", "ServingBusy")
        for c in clients:
            c.join(900)
        assert answers and all(code == 200 for code in answers), answers
        assert serving_ids(tb, "head") | serving_ids(tb, "worker") == before, "a busy cluster is never restarted"
        assert busy_seen["reason"] == "QueueFull", busy_seen
        print(f"real vLLM under load: {len(answers)} requests of 1000 tokens answered; busy: {busy_seen['message']}")
    finally:
        d.close()


def test_a_model_change_whose_start_fails_rolls_back_to_the_model_that_served(deployed, tmp_path):
    """Issue 36: the daemon serves the tiny Llama; the file changes the model to one vLLM refuses at start (an
    architecture its registry does not know). Its weights are copied, the old generation is stopped, the new one
    starts and exits: the daemon brings the tiny Llama back up by itself, holds the failed generation, and says
    so (phase RolledBack, the condition, the metric). `reconciler rollback` then writes the served generation
    back into the file, which the daemon takes without restarting anything. Read on the nodes: which model the
    head's serving container runs, and completions."""
    tb, desired, _ = deployed
    data = yaml.safe_load(desired.read_text())
    moe(data).update(max_model_len=2048, unhealthy_grace=f"{GRACE}s")  # what the tests before left
    data["policy"]["resync_interval"] = "3s"
    path = tmp_path / "cluster.yaml"
    saved(path, data)
    state = tmp_path / "state"
    d = daemon(path, state)
    try:
        converged(d, 300)
        broken, revision = tb.broken_model()
        data["deployments"][0]["model"].update(id=broken, revision=revision)
        changed = time.time()
        saved(path, data)
        rolled = wait_for(lambda: (s := d.status()) and s["phase"] == "RolledBack" and s, START_TIMEOUT,
                          "the failed change rolled back")
        assert rolled["generation"] == 2 and rolled["rollback"]["to"] == 1, rolled["rollback"]
        assert "await-health" in rolled["rollback"]["why"] or "start-serving" in rolled["rollback"]["why"]
        wait_for(lambda: completion(tb, timeout=10)[0] == 0 and serves(tb, image.MODEL_ID), START_TIMEOUT,
                 "the tiny Llama answering again")
        took = time.time() - changed
        assert cond(d, "", "RolledBack")["status"] == "True"
        assert d.metric("reconciler_rolled_back") == 1 and d.metric("reconciler_converged") == 0
        logs = tb.docker("head", "logs", "vllm_serving", check=False)
        print(f"rollback: the failed model change to the tiny Llama answering again in {took:.0f}s")
        assert "NoSuchForCausalLM" not in logs.stdout + logs.stderr, "the container now is the old model's"

        listed = json.loads(reconciler("history", str(path), "--state-dir", str(state), "--json").stdout)
        assert [(e["generation"], e["outcome"]) for e in listed["entries"]] == [(1, "served"),
                                                                              (2, "rolled back to 1")]
        before = serving_ids(tb, "head") | serving_ids(tb, "worker")
        wrote = reconciler("rollback", str(path), "--state-dir", str(state))
        assert wrote.returncode == 0, wrote.stderr
        assert yaml.safe_load(path.read_text())["deployments"][0]["model"]["id"] == image.MODEL_ID
        converged(d, 300, since=time.time())
        assert d.status()["generation"] == 3 and d.metric("reconciler_rolled_back") == 0
        assert serving_ids(tb, "head") | serving_ids(tb, "worker") == before, "the file now says what runs"
    finally:
        d.close()


def saved(path, data: dict) -> None:
    """Save as editors do: a new file renamed over the old one."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(yaml.safe_dump(data, sort_keys=False, explicit_end=True))
    tmp.replace(path)


def serves(tb, model_id: str) -> bool:
    """The head's serving container runs and was started for `model_id` (its `vllm serve` argument: the id in an
    HF cache, a path in a plain layout)."""
    seen = containers(tb, "head").get("vllm_serving", {})
    return seen.get("State", {}).get("Running", False) and any(
        model_id in a or model_id.replace("/", "--") in a for a in seen.get("Args", []))
