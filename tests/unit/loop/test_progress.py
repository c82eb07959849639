"""Progress a person can watch (issue 33, item 6): the image copy's bytes of a total with a rate, and a cold start's
stage and vLLM's own last meaningful line, in `apply`, in /status and in the metrics.

The cold-start parser is judged on recorded logs. `fixtures/vllm-0.32.0-cpu-cold-start-*.log` are the real vLLM
0.32.0 CPU build's output (stdout and stderr in one file, as `docker logs 2>&1` gives them; bytes as written,
`\\r` included), recorded 2026-12-06 on this testbed machine with the testbed's own image venv
(/var/cache/spark-testbed/vllm/venv, testbed/realvllm) serving `testorg/tiny-llama` on 127.0.0.1, cut at
uvicorn's "Application startup complete.": `-compile` with vLLM's default torch.compile (one shard), `-eager-3-
shards` with `--enforce-eager` (the testbed's setting) and the model split in three shards. What the CPU build
cannot print (CUDA graphs, a bar in mid-course) is taken from the public record, cited at each line.
"""

from __future__ import annotations

import io
import json
import threading
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from rich.console import Console

from reconciler.core.observed import NodeObservation, Observed
from reconciler.core.planning import Step
from reconciler.core.vllm_log import MAX_DETAIL, STAGES, StartProgress, start_progress
from reconciler.edge.execute import Outcome, StepResult
from reconciler.edge.facts.images import image_from_inspect
from reconciler.edge.facts.serving import START_LOG_DEADLINE, START_LOG_LINES, start_fact
from reconciler.edge.ssh import Result
from reconciler.edge.steps import StepContext, images, serving
from reconciler.edge.steps.actions import Given, Report
from reconciler.loop.apply import _ProgressView
from reconciler.loop.metrics import REGISTRY, progress_ratio
from reconciler.loop.operations import Operations
from reconciler.loop.triggers import ReconcileRequests
from tests.unit.controllers import make_controller
from tests.unit.recorded import load
from tests.unit.step_driver import Driver

FIXTURES = Path(__file__).parents[1] / "fixtures"
COMPILE = (FIXTURES / "vllm-0.32.0-cpu-cold-start-compile.log").read_bytes().decode()
EAGER = (FIXTURES / "vllm-0.32.0-cpu-cold-start-eager-3-shards.log").read_bytes().decode()


def stages_seen(log: str) -> list[str]:
    """The stages a poll would have reported had it read the log after each of its lines, without repeats."""
    out: list[str] = []
    for end in range(len(log)):
        if log[end] == "\n" and (seen := start_progress(log[:end + 1])) and (not out or out[-1] != seen.stage):
            out.append(seen.stage)
    return out


# ------------------------------------------------------------------------------------------- the parser


def test_the_real_cold_start_with_torch_compile_goes_through_its_stages_in_order():
    assert stages_seen(COMPILE) == ["waiting", "loading-weights", "compiling", "api-starting", "serving"]
    assert start_progress(COMPILE) == StartProgress("serving", None, "Application startup complete.")


def test_the_real_eager_start_skips_what_it_does_not_do():
    assert stages_seen(EAGER) == ["waiting", "loading-weights", "api-starting", "serving"]


def _cut_after(log: str, text: str) -> str:
    return log[:log.index("\n", log.index(text)) + 1]


def test_the_real_shard_bar_gives_its_percent_and_its_line():
    """tqdm's first draw (`\\rLoading ...:   0% Completed | 0/3 [...]\\n`), then the last."""
    assert start_progress(_cut_after(EAGER, "0/3 [")) == StartProgress(
        "loading-weights", 0, "Loading safetensors checkpoint shards:   0% Completed | 0/3 [00:00<?, ?it/s]")
    seen = start_progress(_cut_after(EAGER, "3/3 ["))
    assert (seen.stage, seen.percent) == ("loading-weights", 100) and "3/3" in seen.line
    seen = start_progress(_cut_after(EAGER, "Loading weights took"))
    assert seen == StartProgress("loading-weights", 100, "Loading weights took 0.00 seconds"), "prefixes are cut"


def test_the_real_lines_after_the_weights_name_their_stage():
    compiling = start_progress(_cut_after(COMPILE, "Warming up model for the compilation"))
    assert compiling == StartProgress("compiling", None, "Warming up model for the compilation...")
    kv = start_progress(_cut_after(EAGER, "CPU KV cache size"))
    assert kv.stage == "loading-weights" and kv.line.startswith("CPU KV cache size: 2,097,152 tokens"), \
        "a line worth showing that names no stage keeps the one before it"
    api = start_progress(_cut_after(EAGER, "Route: /health"))
    assert api == StartProgress("api-starting", None, "Starting vLLM server on http://127.0.0.1:18437"), \
        "the route list says nothing: the last meaningful line stays"


# GPU lines the CPU build never prints, as the public record shows them (vLLM's own source where it is stored:
# vllm/model_executor/model_loader/weight_utils.py `_BAR_FORMAT`; vllm/compilation/monitor.py and backends.py;
# vllm/v1/worker/gpu_model_runner.py `capture_model`; uvicorn/lifespan/on.py), each with the stage and percent.
PUBLIC = [
    ("(EngineCore_DP0 pid=212) INFO 10-06 12:00:20 [gpu_model_runner.py:2602] Starting to load model "
     "Qwen/Qwen3-0.6B...", "loading-weights", None),
    ("Loading safetensors checkpoint shards:  45% Completed | 9/20 [01:02<01:16,  6.93s/it]", "loading-weights", 45),
    ("(EngineCore pid=594) INFO 08-04 13:09:54 [weight_utils.py:856] Prefetching checkpoint files: 10% (1/2)",
     "loading-weights", 10),
    ("Loading safetensors using Fastsafetensor loader:  50% Completed | 1/2 [00:03<00:03,  3.1s/it]",
     "loading-weights", 50),
    ("(EngineCore_DP0 pid=164) INFO 01-23 15:49:10 [gpu_model_runner.py:3659] Model loading took 55.22 GiB memory "
     "and 20.3s", "loading-weights", 100),
    ("(EngineCore_DP0 pid=191) INFO 03-18 13:41:09 [backends.py:643] Using cache directory: /root/.cache/vllm/"
     "torch_compile_cache/4aae4d336d/rank_0_0/backbone for vLLM's torch.compile", "compiling", None),
    ("(EngineCore_DP0 pid=191) INFO 03-18 13:41:09 [backends.py:703] Dynamo bytecode transform time: 5.73 s",
     "compiling", None),
    ("(Worker_TP0 pid=2412213) INFO 12-11 00:06:50 [backends.py:288] Compiling a graph for dynamic shape takes "
     "15.52 s", "compiling", None),
    ("(Worker_TP0 pid=2412213) INFO 12-11 00:06:52 [monitor.py:34] torch.compile takes 25.11 s in total",
     "compiling", None),
    ("Capturing CUDA graphs (mixed prefill-decode, PIECEWISE):  45%|████▌     | 30/67 [00:05<00:06,  5.41it/s]",
     "cuda-graphs", 45),
    ("Capturing CUDA graph shapes: 100%|██████████| 67/67 [00:21<00:00,  3.10it/s]", "cuda-graphs", 100),
    ("(EngineCore_DP0 pid=212) INFO 10-06 12:00:40 [gpu_model_runner.py:3480] Graph capturing finished in 8 secs, "
     "took 0.31 GiB", "cuda-graphs", 100),
    ("(EngineCore_DP0 pid=164) INFO 01-23 15:50:12 [core.py:250] init engine (profile, create kv cache, warmup "
     "model) took 62.08 seconds", "api-starting", None),
    ("(APIServer pid=1) INFO 10-06 12:00:41 [api_server.py:1971] Starting vLLM API server 0 on http://0.0.0.0:8000",
     "api-starting", None),
    ("(APIServer pid=1) INFO:     Waiting for application startup.", "api-starting", None),
    ("(APIServer pid=1) INFO:     Application startup complete.", "serving", None),
    ("INFO:     Uvicorn running on http://0.0.0.0:8000 (Press CTRL+C to quit)", "serving", None),
]


@pytest.mark.parametrize(("line", "stage", "percent"), PUBLIC, ids=[f"{s}-{i}" for i, (_, s, _) in enumerate(PUBLIC)])
def test_each_public_line_names_its_stage(line, stage, percent):
    seen = start_progress(f"some earlier line\n{line}\n")
    assert (seen.stage, seen.percent) == (stage, percent)
    assert "pid=" not in seen.line and not seen.line.startswith("INFO"), "vLLM's prefixes are not the message"


def test_every_stage_has_a_public_line():
    assert {stage for _, stage, _ in PUBLIC} | {"waiting"} == set(STAGES)


def test_a_bar_redrawn_on_one_line_with_carriage_returns_gives_its_last_draw():
    """tqdm's default bar (CUDA graphs) redraws with `\\r` and no newline until it ends: one log line."""
    bar = "Capturing CUDA graphs (decode, FULL): {:3d}%|{}| {}/35 [00:0{}<00:05,  5.00it/s]"
    line = "".join("\r" + bar.format(100 * n // 35, "#" * (n * 10 // 35), n, n % 10) for n in range(0, 31, 5))
    seen = start_progress("(EngineCore_DP0 pid=7) " + line)  # still drawing: no newline yet
    assert (seen.stage, seen.percent) == ("cuda-graphs", 85) and "30/35" in seen.line


def test_an_error_is_shown_and_keeps_the_stage():
    log = ("Loading safetensors checkpoint shards:  50% Completed | 1/2 [00:03<00:03,  3.1s/it]\n"
           "(EngineCore_DP0 pid=269) ERROR 10-14 22:49:20 [core.py:708] EngineCore failed to start.\n")
    assert start_progress(log) == StartProgress("loading-weights", None, "EngineCore failed to start.")


def test_a_log_without_a_line_vllm_would_print_says_nothing():
    assert start_progress("") is None
    assert start_progress("starting container\nINFO:     127.0.0.1:5000 - \"GET /health HTTP/1.1\" 503\n") is None


def test_hostile_bytes_are_escaped_bounded_and_never_a_crash():
    hostile = ("\x1b[2K\x1b]0;pwned\x07Loading safetensors checkpoint shards: 999% Completed | 9/2 "
               "\x00\x85\u2028\u202e" + "A" * 10_000)
    seen = start_progress("x" * 10_000_000 + "\n" + hostile)
    assert seen.stage == "loading-weights" and seen.percent == 100
    assert len(seen.line) <= MAX_DETAIL and seen.line.isprintable()
    assert "\x1b" not in seen.line and "pwned" not in seen.line, "terminal escapes are removed, not shown"
    assert "\\u202e" in seen.line, "other control characters show as escapes"


@given(st.text(alphabet=st.characters(codec="utf-8") | st.sampled_from("\r\n\x1b[]%|:()"), max_size=400))
def test_any_text_gives_a_stage_or_nothing(text):
    for log in (text, "Loading safetensors checkpoint shards:  45% Completed | 9/20\n" + text):
        seen = start_progress(log)
        assert seen is None or (seen.stage in STAGES and len(seen.line) <= MAX_DETAIL and seen.line.isprintable()
                                and (seen.percent is None or 0 <= seen.percent <= 100))


@pytest.mark.parametrize(("flags", "stages"), [
    ([], ["waiting", "loading-weights", "compiling", "cuda-graphs", "api-starting", "serving"]),
    (["--enforce-eager"], ["waiting", "loading-weights", "api-starting", "serving"]),
])
def test_the_testbeds_vllm_stand_in_logs_its_start_as_vllm_does(tmp_path, flags, stages):
    """The e2e tests watch the stand-in's cold start: it must go through vLLM's stages in vLLM's words."""
    from testbed.proc import free_port, wait_for
    from testbed.standin.testing import Proc, http_get
    from testbed.weights import generate

    model = generate(tmp_path / "models", "testorg/tiny-moe", "1" * 40, "plain", 3, 32 * 1024)
    port = free_port()
    proc = Proc("vllm", ["serve", str(model), "--host", "127.0.0.1", "--port", str(port), *flags], tmp_path)
    try:
        wait_for(lambda: http_get(f"http://127.0.0.1:{port}/health")[0] == 200, what="health 200")
        output = proc.log.read_bytes().decode()  # as written: `read_text` would turn each `\r` into a newline
        assert stages_seen(output) == stages
        if not flags:
            assert "\rCapturing CUDA graphs (mixed prefill-decode, PIECEWISE):  50%|" in output
    finally:
        proc.stop()


# ------------------------------------------------------------------------------------ the health wait's log


@dataclass
class Watching(Driver):
    """The step driver, keeping each report's fields (what `apply`, /status and the metrics are given)."""

    reports: list[tuple[str, dict]] = field(default_factory=list)

    def do(self, action):
        if isinstance(action, Report):
            self.reports.append((action.event, action.fields))
        return super().do(action)


def _await(*logs: str) -> list[tuple[str, dict]]:
    """await-health over the recorded testbed: the head's log at each poll (`facts.serving.start_fact`), its API serving
    at the last one; the reports it made."""
    from tests.unit.step_cases.serving import NAME, READINGS, RUNNING, head

    desired = load()
    driver = Watching(facts={**RUNNING, **READINGS,
                             f"head start {NAME}": [*(head(api="down", log=log) for log in logs[:-1]),
                                                    head(log=logs[-1])]})
    given = Given(desired, Observed(nodes={n.name: NodeObservation(name=n.name, reachable=True)
                                           for n in desired.nodes}))
    assert driver.drive(serving.await_health(given, Step("await-health", desired.head.name, "health"))) is None
    return [r for r in driver.reports if r[0] not in ("serving.memory", "serving.transport")]  # once it serves


def test_the_health_wait_reports_each_change_of_the_heads_log():
    loading = "(EngineCore_DP0 pid=9) \rLoading safetensors checkpoint shards:  45% Completed | 9/20\n"
    more = loading + "\rLoading safetensors checkpoint shards:  90% Completed | 18/20\n"
    graphs = more + "Capturing CUDA graphs (mixed prefill-decode, PIECEWISE):  10%|#| 7/67\n"
    events = _await("", loading, loading, more, "", graphs, graphs)  # "": `docker logs` did not answer in time
    said = [(e, f["stage"], f["percent"]) for e, f in events]
    assert said == [("serving.stage", "waiting", None), ("serving.stage", "loading-weights", 45),
                    ("serving.progress", "loading-weights", 90), ("serving.stage", "cuda-graphs", 10),
                    ("serving.done", "serving", None)], "each change once; a log that did not answer changes nothing"
    assert events[2][1]["line"] == "Loading safetensors checkpoint shards:  90% Completed | 18/20"


def test_the_log_read_is_bounded_on_the_node_and_in_time():
    """Its last START_LOG_LINES lines, at most vLLM_log.MAX_TEXT bytes of them (cut on the node: tqdm redraws a bar
    on one ever longer line), under a deadline of its own: a hung `docker logs` leaves the poll answered."""
    fact = start_fact(load(), "vllm_serving")
    read = f"timeout {START_LOG_DEADLINE} docker logs --tail {START_LOG_LINES} vllm_serving 2>&1 | tail -c 65536; rc 0"
    assert read in fact.lines
    assert START_LOG_DEADLINE <= 10


# ----------------------------------------------------------------------------------------- the image copy


def test_the_image_copy_reports_its_bytes_of_the_sources_size(cluster_yaml):
    """The image copy's progress: its total is the source's inspect `Size`, its count dd's records as they come
    (driven from recorded facts: tests/unit/step_driver.py)."""
    from reconciler.core.loader import load_file
    from reconciler.core.spec import Desired
    from reconciler.edge.steps.actions import Given
    from tests.unit.step_cases.images import COPY, inspect_of, trusted
    from tests.unit.step_driver import Driver, Raw

    desired = trusted()
    assert desired.serving.image == Desired.model_validate(load_file(cluster_yaml).data).serving.image
    raw = json.loads((FIXTURES / "docker-20.10-overlay2-image-inspect.json").read_text())[0]
    head, worker = desired.head.name, next(n.name for n in desired.nodes if n.role == "worker")
    ref = desired.serving.image
    events: list[Report] = []
    driver = Driver(facts={f"{head} image {ref}": [inspect_of(raw)],
                           f"{worker} image {ref}": [Raw(f"Error: No such image: {ref}", 1), inspect_of(raw)]},
                    results={COPY(desired, head, worker, ref): [Result("", f"Loaded image: {ref}\n", 0)]},
                    outputs={COPY(desired, head, worker, ref): [
                        b"4194304 bytes (4.2 MB, 4.0 MiB) copied, 1 s, 4.2 MB/s\r",
                        b"25165824 bytes (25 MB, 24 MiB) copied, 2 s, 12 MB/s\r"]})
    body = images.copy_image(Given(desired, Observed(nodes={})), Step("image", worker, "missing", image=ref,
                                                                     source=head))
    assert driver.drive(_reports(body, events)) is None
    size = image_from_inspect(raw).size
    assert size == raw["Size"] > 0
    said = [(r.event, r.fields["bytes_done"], r.fields["bytes_total"]) for r in events if r.event.startswith("image")]
    assert said == [("image.start", 0, size), ("image.progress", 4194304, size), ("image.progress", 25165824, size),
                    ("image.done", 25165824, size)]


def _reports(actions, into):
    """The step's actions passed through, every Report it makes (yielded, or returned by a Run's `on_output`)
    kept in `into`."""
    import dataclasses

    from reconciler.edge.steps.actions import Report, Run

    def tee(feed):
        def seen(chunk):
            report = feed(chunk)
            if report is not None:
                into.append(report)
            return report
        return seen

    value, error = None, None
    while True:
        try:
            action = actions.throw(error) if error is not None else actions.send(value)
        except StopIteration:
            return
        if isinstance(action, Report):
            into.append(action)
        if isinstance(action, Run) and action.on_output is not None:
            action = dataclasses.replace(action, on_output=tee(action.on_output))
        try:
            value, error = (yield action), None
        except Exception as exc:  # noqa: BLE001 - back into the step, as the driver raised it
            value, error = None, exc


def test_an_image_of_unknown_size_has_no_total():
    assert images.archive_estimate(image_from_inspect({"Id": "sha256:" + "a" * 64, "RootFS": {}})) is None


# ------------------------------------------------------------------------ operations, /status and metrics


class Gate:
    """A fake executor: the batch is in flight until the test releases it."""

    def __init__(self):
        self.release = threading.Event()

    def __call__(self, plan_, ctx, on_event, skip=lambda step: None, cancel_of=None):
        for step in plan_.steps:
            on_event("step.start", {"step": step})
        assert self.release.wait(20)
        return Outcome([StepResult(s, "success", 0.1, "") for s in plan_.steps])


class FakeSessions:
    def __init__(self, desired):
        pass

    def close(self):
        pass


def sample(name: str, **labels: str) -> float | None:
    return REGISTRY.get_sample_value(name, labels)


@pytest.fixture
def flying(desired_path, tmp_path):
    """A controller with an image copy to the worker and the head's health wait in flight; a clock the test moves."""
    gate, clock = Gate(), [5000.0]
    ops = Operations(on_end=lambda: None, clock=lambda: clock[0], run=gate)
    c = make_controller(desired_path, tmp_path / "state", ReconcileRequests(), threading.Event(), events=False,
                   observe_fn=lambda *a, **k: None, sessions_factory=FakeSessions, operations=ops)
    image, health = Step("image", "spark-5be3", "missing", image="x", source="spark-1a32"), \
        Step("await-health", "spark-1a32", "health")
    ctx = StepContext(desired=load(), sessions={}, observed=Observed(nodes={}))
    ops.launch([image, health], ctx, on_event=lambda e, f: None)
    yield c, clock
    gate.release.set()
    assert ops.join(20)


def test_progress_reports_become_the_operations_fields_and_metrics(flying):
    c, clock = flying
    c.reports("image.start", {"node": "spark-5be3", "bytes_done": 0, "bytes_total": 40 << 20})
    c.reports("serving.stage", {"node": "spark-1a32", "stage": "loading-weights", "percent": 45,
                                  "line": "Loading safetensors checkpoint shards:  45% Completed | 9/20"})
    clock[0] += 2
    c.reports("image.progress", {"node": "spark-5be3", "bytes_done": 30 << 20, "bytes_total": 40 << 20})
    ops = {o["step"]: o for o in c.operations.view()}
    image, health = ops["image/spark-5be3"], ops["await-health/spark-1a32"]
    assert (image["bytesDone"], image["bytesTotal"], image["bytesPerSecond"]) == (30 << 20, 40 << 20, 15 << 20)
    assert (health["stage"], health["percent"]) == ("loading-weights", 45) and "9/20" in health["detail"]
    assert image["stage"] is None and health["bytesTotal"] is None

    assert sample("reconciler_operation_progress_ratio", kind="image", node="spark-5be3") == 0.75
    assert sample("reconciler_operation_bytes_per_second", kind="image", node="spark-5be3") == 15 << 20
    assert sample("reconciler_operation_progress_ratio", kind="await-health", node="spark-1a32") == 0.45
    stages = {s: sample("reconciler_serving_start_stage", node="spark-1a32", stage=s) for s in STAGES}
    assert stages == {s: 1.0 if s == "loading-weights" else 0.0 for s in STAGES}

    clock[0] += 60  # a stall: no report for a minute; the rate the scrape reads falls
    assert sample("reconciler_operation_bytes_per_second", kind="image", node="spark-5be3") == round(
        (30 << 20) / 62)
    c.reports("serving.stage", {"node": "spark-1a32", "stage": "compiling", "percent": None,
                                  "line": "Dynamo bytecode transform time: 5.73 s"})
    assert sample("reconciler_operation_progress_ratio", kind="await-health", node="spark-1a32") is None, \
        "a stage whose line has no number has no fraction, not a stale one"
    assert sample("reconciler_serving_start_stage", node="spark-1a32", stage="compiling") == 1


def test_an_ended_operation_leaves_no_series(flying):
    c, _ = flying
    c.reports("serving.stage", {"node": "spark-1a32", "stage": "waiting", "percent": None, "line": ""})
    assert sample("reconciler_serving_start_stage", node="spark-1a32", stage="waiting") == 1
    c.operations._event("step.end", {"result": StepResult(Step("await-health", "spark-1a32", "health"), "success",
                                                          1.0, "")})
    assert sample("reconciler_serving_start_stage", node="spark-1a32", stage="waiting") is None
    assert sample("reconciler_operation_progress_ratio", kind="image", node="spark-5be3") is None, \
        "an operation that never said how far it is has no fraction"


def test_the_progress_metrics_are_exported_before_any_operation():
    names = {family.name for family in REGISTRY.collect()}
    assert {"reconciler_operation_progress_ratio", "reconciler_operation_bytes_per_second",
            "reconciler_serving_start_stage"} <= names


@pytest.mark.parametrize(("op", "ratio"), [
    ({"bytesDone": 5, "bytesTotal": 10, "percent": None}, 0.5),
    ({"bytesDone": 12, "bytesTotal": 10, "percent": None}, 1.0),  # docker save's archive outgrows Size a little
    ({"bytesDone": 0, "bytesTotal": None, "percent": 45}, 0.45),
    ({"bytesDone": 7, "bytesTotal": None, "percent": None}, None),
    ({"bytesDone": 0, "bytesTotal": 0, "percent": None}, None),
])
def test_the_ratio_is_bytes_of_a_total_or_the_lines_percent(op, ratio):
    assert progress_ratio(op) == ratio


# ----------------------------------------------------------------------------------------------- apply's view


def test_apply_shows_the_image_copy_and_the_cold_start_as_bars():
    out = io.StringIO()
    view = _ProgressView(Console(file=out, force_terminal=True, width=120))
    view("image.start", {"node": "w", "source": "h", "bytes_done": 0, "bytes_total": 40 << 20})
    view("image.progress", {"node": "w", "bytes_done": 10 << 20, "bytes_total": 40 << 20})
    view("serving.stage", {"node": "h", "stage": "loading-weights", "percent": 45,
                           "line": "Loading safetensors checkpoint shards:  45% Completed | 9/20"})
    assert view.bars is not None
    image, start = view.bars.tasks
    view.stop()
    assert (image.description, image.completed, image.total) == ("image -> w", 10 << 20, 40 << 20)
    assert (start.description, start.completed, start.total) == ("cold start on h", 45, 100)
    shown = out.getvalue()
    assert "10.5/41.9 MB" in shown and "loading-weights  Loading safetensors checkpoint shards:  45%" in shown


def test_apply_without_a_terminal_prints_a_line_at_each_change_of_stage_and_every_ten_seconds(capsys):
    clock = [0.0]
    view = _ProgressView(Console(file=io.StringIO(), force_terminal=False), clock=lambda: clock[0])
    view("image.start", {"node": "w", "source": "h", "bytes_done": 0, "bytes_total": 40_000_000})
    for second in range(1, 13):
        clock[0] = second
        view("image.progress", {"node": "w", "bytes_done": second * 3_000_000, "bytes_total": 40_000_000})
    view("image.done", {"node": "w", "bytes_done": 40_800_000, "bytes_total": 40_000_000})  # the archive: +2%
    view("serving.stage", {"node": "h", "stage": "waiting", "percent": None, "line": ""})
    view("serving.stage", {"node": "h", "stage": "compiling", "percent": None, "line": "torch.compile takes 25 s"})
    view("serving.progress", {"node": "h", "stage": "compiling", "percent": None, "line": "\x1b[2Jnext"})
    view("serving.stage", {"node": "h", "stage": "serving", "percent": None, "line": "\x1b[2JApplication startup"})
    view("serving.done", {"node": "h", "stage": "serving", "percent": None, "line": ""})
    assert capsys.readouterr().out.splitlines() == [
        "  image -> w: 0 bytes of ~40.0 MB (0%)",
        "  image -> w: 30.0 MB of ~40.0 MB (75%) at 3.0 MB/s",
        "  image -> w: 40.8 MB of ~40.0 MB (100%) at 3.4 MB/s, done",
        "  cold start on h: waiting",
        "  cold start on h: compiling (torch.compile takes 25 s)",
        "  cold start on h: serving (\\x1b[2JApplication startup)",
    ]
