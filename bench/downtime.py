"""How long the API does not answer (benchmark 10): a serving change, a model change, a seed's first apply, a
wedge and a failed change, each next to what it cannot beat, with the real vLLM in the testbed (issue 36).

For a Spark owner the figure that matters is not the reconcile cycle but the outage. Measured on the real vLLM
0.32.0 CPU build at tensor parallel 2 across the two namespace nodes (the testbed's real serving: `testbed.api.
real_serving`), the tiny Llama and a second tiny model (`testbed.api.extra_model`), by a prober that asks one
short completion through the head's API every PROBE_EVERY seconds (`Prober`). An outage is the time from the
last completion the old generation answered to the first the new one answers.

Each round, in this order (so drift of the machine hits every row alike):

1. **seed -> first completion**: the seed (the worker has neither the image nor the model, its fabric port is
   down, co-tenants hold the head's port), `reconciler apply`, and the first completion answered, next to its
   parts each measured alone on the state that apply reached with the worker's copies and the serving removed:
   the image copy (`docker save` on the head piped into `docker load` on the worker, no SSH: docker's own ends),
   the weights copy (`cp -a` of the model tree: the filesystem's own speed) and a cold start (`raw_start`: the
   reconciler's own `docker run` argv on both nodes, rank 1 first, to the first completion; nothing else);
2. **serving change** (`max_model_len`, alternating between two values): the outage of `reconciler apply`, next
   to a cold start alone of the new generation (`raw_start`, measured after it);
3. **model change** (the tiny Llama -> the second model, as each round begins from the seed; its weights
   staged while the old one serves): the same;
4. **wedge**: the daemon serving with `unhealthy_grace` GRACE; the API server frozen (SIGSTOP: alive, holding
   its memory, answering nothing); the time from the freeze to the first completion answered again, next to
   GRACE + a cold start alone;
5. **failed change**: the daemon serving; the file changes the model to one vLLM refuses at start
   (`testbed.api.broken_model`); the time from the edit until the old model answers again (it rolls back by
   itself, `policy.on_failed_change: rollback`), and the outage within it.

Not in `--quick` (the smoke test): minutes of real vLLM starts per round.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from bench.common import ROOT, Options, Result, on_testbed, save, summary
from bench.daemon import Daemon
from testbed.proc import wait_for
from testbed.realvllm import image

if TYPE_CHECKING:
    from testbed.api import Testbed

PROBE_EVERY = 0.25  # seconds between two completions of the prober: the outage's resolution
GRACE = 20  # unhealthy_grace of the wedge round, in seconds
DEADLINE = 900.0  # any one wait of a round
CLI = str(ROOT / ".venv" / "bin" / "reconciler")
LENGTHS = (1024, 2048)  # max_model_len alternates between these (the seed's is 4096): each is a change

#: A desired state as `yaml.safe_load` reads it (and `save_as_editor` writes it back).
DesiredDoc = dict[str, Any]


class Prober:
    """One short completion through the head's API every PROBE_EVERY s, in a thread: the answered ones' times
    (time.monotonic() when the answer arrived)."""

    def __init__(self, tb: Testbed) -> None:
        self.tb = tb
        self.answered: list[float] = []
        self.failed: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Prober:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)

    def _run(self) -> None:
        while not self._stop.is_set():
            (self.answered if answers(self.tb, timeout=2) else self.failed).append(time.monotonic())
            self._stop.wait(PROBE_EVERY)

    def outage(self, since: float) -> float:
        """The outage that began after `since`: from the last completion answered before the first that failed
        after `since`, to the first answered after that failure."""
        first_fail = min((t for t in self.failed if t > since), default=None)
        if first_fail is None:
            return 0.0
        last_ok = max((t for t in self.answered if t < first_fail), default=since)
        back = min((t for t in self.answered if t > first_fail), default=None)
        if back is None:
            raise RuntimeError("the API never answered again")
        return back - last_ok

    def answered_after(self, since: float, timeout: float) -> float:
        """The first answer after `since`, waited for up to `timeout` s."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            failed_since = [t for t in self.failed if t > since]
            ok = [t for t in self.answered if t > (failed_since[0] if failed_since else since)]
            if ok:
                return ok[0]
            time.sleep(PROBE_EVERY)
        raise TimeoutError(f"no completion within {timeout:.0f}s")


def answers(tb: Testbed, timeout: float = 5) -> bool:
    body = json.dumps({"model": image.SERVED_NAME, "prompt": "Hello", "max_tokens": 1, "temperature": 0})
    res = tb.exec("head", f"curl -s -m {timeout:g} -H 'Content-Type: application/json' -d '{body}' "
                          "http://127.0.0.1:8000/v1/completions", timeout=timeout + 30)
    return res.returncode == 0 and '"choices"' in res.stdout


def first_answer(tb: Testbed, since: float, timeout: float = DEADLINE, watch: str | None = None) -> float:
    """Seconds from `since` (time.monotonic()) to the first completion answered; with `watch`, the head's
    container of that name must keep running meanwhile (its last log lines say why it did not)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if answers(tb, timeout=2):
            return time.monotonic() - since
        if watch and tb.docker("head", "inspect", "--format", "{{.State.Running}}", watch,
                               check=False).stdout.strip() != "true":
            logs = tb.docker("head", "logs", "--tail", "15", watch, check=False)
            raise RuntimeError(f"{watch} exited before answering: {(logs.stdout + logs.stderr)[-1500:]}")
        time.sleep(PROBE_EVERY)
    raise TimeoutError(f"no completion within {timeout:.0f}s")


@contextlib.contextmanager
def co_tenants_stopped(tb: Testbed) -> Iterator[None]:
    """The seed's co-tenants (a GLM on the head's :8000 among them) stopped while a cold start is measured alone:
    the reconciler stops them as part of the seed's apply, a start by hand must not find the port taken. Started
    again after."""
    stopped = {}
    for node in ("head", "worker"):
        ours = set(tb.docker(node, "ps", "--format", "{{.Names}}", "--filter", "label=spark-reconciler.managed=true",
                             check=False).stdout.split())
        names = [n for n in tb.docker(node, "ps", "--format", "{{.Names}}", check=False).stdout.split()
                 if n not in ours]
        if names:
            tb.docker(node, "stop", "-t", "5", *names, check=False)
        stopped[node] = names
    try:
        yield
    finally:
        for node, names in stopped.items():
            if names:
                tb.docker(node, "start", *names, check=False)


def apply(path: Path) -> None:
    p = subprocess.run([CLI, "apply", str(path), "--yes"], capture_output=True, text=True, timeout=DEADLINE,
                       check=False)
    if p.returncode != 0:
        raise RuntimeError(f"reconciler apply failed ({p.returncode}): {(p.stdout + p.stderr)[-3000:]}")


def save_as_editor(path: Path, data: DesiredDoc) -> Path:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(yaml.safe_dump(data, sort_keys=False, explicit_end=True))
    tmp.replace(path)
    return path


def remove_serving(tb: Testbed) -> None:
    for node in ("worker", "head"):
        tb.docker(node, "rm", "-f", "vllm_serving", check=False)


def raw_start(tb: Testbed, path: Path) -> float:
    """A cold start alone: the reconciler's own `docker run` argv (`launch_specs`) on both nodes, rank 1 first,
    to the first completion; none of the reconciler's steps around it (no preflight, no drop of the page cache,
    no health poll). What a serving change cannot beat. Leaves nothing running."""
    from reconciler.core.spec import load
    from reconciler.core.vllm import cache_dirs, launch_specs
    desired = load(path)
    remove_serving(tb)
    for spec in launch_specs(desired):
        if dirs := cache_dirs(desired, desired.node(spec.node)):
            tb.exec(spec.node, ["mkdir", "-p", *dirs.values()], check=True)
    t0 = time.monotonic()
    for spec in reversed(launch_specs(desired)):  # rank 1 first, as the reconciler starts them
        tb.docker(spec.node, *spec.run_argv(0))
    try:
        return first_answer(tb, t0, watch="vllm_serving")
    finally:
        remove_serving(tb)


def seed_parts(tb: Testbed, desired: DesiredDoc) -> dict[str, float]:
    """The seed's first apply in its parts, each alone, on the state that apply reached with the worker's copies
    and the serving containers removed again (the fabric link up and the co-tenants stopped, as the apply left
    them: a start cannot rendezvous over a link that is down). Leaves the copies in place and nothing serving."""
    head, worker = tb.node("head"), tb.node("worker")
    hub = desired["model"]["path"]
    tree = f"models--{image.MODEL_ID.replace('/', '--')}"
    src, dst = Path(hub["head"]) / tree, Path(hub["worker"]) / tree
    remove_serving(tb)
    shutil.rmtree(dst, ignore_errors=True)
    tb.docker("worker", "rmi", "-f", image.IMAGE, check=False)
    t0 = time.monotonic()
    save = subprocess.Popen(["docker", "-H", head.docker_host, "save", image.IMAGE], stdout=subprocess.PIPE)
    try:
        subprocess.run(["docker", "-H", worker.docker_host, "load", "-q"], stdin=save.stdout, check=True,
                       capture_output=True, timeout=DEADLINE)
    finally:
        assert save.stdout is not None
        save.stdout.close()
        if save.wait(DEADLINE) != 0:
            raise RuntimeError(f"docker save {image.IMAGE} on the head failed ({save.returncode})")
    image_s = time.monotonic() - t0
    t0 = time.monotonic()
    subprocess.run(["cp", "-a", str(src), str(dst)], check=True, timeout=DEADLINE)
    subprocess.run(["sync", "-f", str(dst)], check=True, timeout=DEADLINE)
    weights_s = time.monotonic() - t0
    with co_tenants_stopped(tb):
        cold_s = raw_start(tb, tb.state / "downtime-seed.yaml")
    return {"image": image_s, "weights": weights_s, "cold_start": cold_s}


def change(tb: Testbed, path: Path, data: DesiredDoc) -> tuple[float, float]:
    """The outage of `reconciler apply` of `data` (saved to `path`), and a cold start alone of that generation."""
    save_as_editor(path, data)
    with Prober(tb) as probe:
        time.sleep(4 * PROBE_EVERY)  # a few answers of the old generation first
        since = time.monotonic()
        apply(path)
        probe.answered_after(since, DEADLINE)
        outage = probe.outage(since)
    if not outage:  # a change restarts the serving: no failed completion means the edit changed nothing
        raise RuntimeError(f"the change to {path.name} stopped nothing: it measured no outage")
    cold = raw_start(tb, path)
    apply(path)  # back up under the reconciler (a cold start, not measured)
    return outage, cold


def _phase(d: Daemon, phase: str) -> bool:
    try:
        return d.status().get("phase") == phase
    except OSError:
        return False


def wedge(tb: Testbed, path: Path, data: DesiredDoc) -> float:
    """Freeze -> first completion again, under the daemon."""
    data = json.loads(json.dumps(data))
    data["serving"]["unhealthy_grace"] = f"{GRACE}s"
    data["policy"]["resync_interval"] = "3s"
    save_as_editor(path, data)
    d = Daemon(path)
    try:
        wait_for(lambda: _phase(d, "Converged"), DEADLINE, "the daemon converged")
        pid = int(tb.docker("head", "inspect", "--format", "{{.State.Pid}}", "vllm_serving").stdout)
        with Prober(tb) as probe:
            time.sleep(4 * PROBE_EVERY)
            frozen = time.monotonic()
            subprocess.run(["kill", "-STOP", str(pid)], check=True)
            back = probe.answered_after(frozen, DEADLINE)
        return back - frozen
    finally:
        d.stop()


def failed_change(tb: Testbed, path: Path, data: DesiredDoc) -> tuple[float, float]:
    """Edit -> the old model answering again after a change it rolled back, and the outage in it."""
    data = json.loads(json.dumps(data))
    data["policy"]["resync_interval"] = "3s"
    save_as_editor(path, data)
    d = Daemon(path)  # a state dir of its own: generation 1 is what serves
    try:
        wait_for(lambda: _phase(d, "Converged"), DEADLINE, "the daemon converged")
        broken, revision = tb.broken_model()
        bad = json.loads(json.dumps(data))
        bad["model"].update(id=broken, revision=revision)
        with Prober(tb) as probe:
            time.sleep(4 * PROBE_EVERY)
            since = time.monotonic()
            save_as_editor(path, bad)
            wait_for(lambda: _phase(d, "RolledBack"), DEADLINE, "the rollback")
            back = probe.answered_after(since, DEADLINE)
            outage = probe.outage(since)
        return back - since, outage
    finally:
        d.stop()
        save_as_editor(path, data)


def run_downtime(opts: Options) -> Result:
    runs = opts.n(5, 1)
    rows: dict[str, list[float]] = {k: [] for k in (
        "seed_apply", "seed_image", "seed_weights", "seed_cold", "serving_outage", "serving_cold",
        "model_outage", "model_cold", "wedge", "rollback", "rollback_outage")}
    with on_testbed(2, "seed") as run:
        tb = run.tb
        for i in range(runs):
            tb.reset("seed")
            seed_file = tb.real_vllm()
            shutil.copy(seed_file, tb.state / "downtime-seed.yaml")
            data = yaml.safe_load(seed_file.read_text())
            path = tb.state / "downtime.yaml"
            save_as_editor(path, data)
            second, second_rev = tb.second_model()
            since = time.monotonic()
            proc = subprocess.Popen([CLI, "apply", str(path), "--yes"], stdout=subprocess.DEVNULL,
                                    stderr=subprocess.DEVNULL)
            try:
                rows["seed_apply"].append(first_answer(tb, since))
            finally:
                proc.wait(DEADLINE)
            parts = seed_parts(tb, data)
            apply(path)  # serving again under the reconciler (its copies are in place: a start, not measured)
            for key, row in (("image", "seed_image"), ("weights", "seed_weights"), ("cold_start", "seed_cold")):
                rows[row].append(parts[key])
            opts.log(f"downtime round {i + 1}: seed -> first completion {rows['seed_apply'][-1]:.1f}s; parts: "
                     f"image {parts['image']:.1f}s, weights {parts['weights']:.2f}s, cold start "
                     f"{parts['cold_start']:.1f}s")

            data["serving"]["max_model_len"] = LENGTHS[i % 2]
            outage, cold = change(tb, path, data)
            rows["serving_outage"].append(outage)
            rows["serving_cold"].append(cold)
            data["model"].update(id=second, revision=second_rev)  # each round begins from the seed's model
            m_outage, m_cold = change(tb, path, data)
            rows["model_outage"].append(m_outage)
            rows["model_cold"].append(m_cold)
            opts.log(f"downtime round {i + 1}: serving change outage {outage:.1f}s (cold start alone {cold:.1f}s); "
                     f"model change outage {m_outage:.1f}s (cold start alone {m_cold:.1f}s)")

            rows["wedge"].append(wedge(tb, path, data))
            took, rb_outage = failed_change(tb, path, data)
            rows["rollback"].append(took)
            rows["rollback_outage"].append(rb_outage)
            opts.log(f"downtime round {i + 1}: wedge -> answering again {rows['wedge'][-1]:.1f}s (grace {GRACE}s); "
                     f"failed change -> the old model answering {took:.1f}s (outage {rb_outage:.1f}s)")
            with contextlib.suppress(Exception):
                remove_serving(tb)
    data_out: Result = {"runs": runs, "grace": GRACE, "probe_every": PROBE_EVERY, "leftovers": run.leftovers,
                **{k: summary(v) for k, v in rows.items()}, "raw": rows}
    save(opts, "downtime", data_out)
    return data_out
