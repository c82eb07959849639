"""How far a vLLM cold start is, from the tail of its own log: the stage and vLLM's last meaningful line.

A cold start on a Spark takes many minutes (weights, torch.compile, CUDA graphs), and what an operator watches
for that time is vLLM's own output; `await-health` reads the head container's recent log every poll and reports
what this module makes of it (reconciler/edge/steps/serving.py, `StartWatch`).

The lines, as vLLM and uvicorn print them (in vllm-project/vllm unless said; the real 0.32.0 CPU build's own
output is recorded in tests/unit/fixtures/vllm-0.32.0-cpu-cold-start-*.log):

- weights: tqdm bars `Loading safetensors checkpoint shards:  45% Completed | 9/20 [...]` (`_BAR_FORMAT` and the
  iterators' `desc` in vllm/model_executor/model_loader/weight_utils.py; also "Loading pt checkpoint shards",
  "Loading safetensors using Fastsafetensor loader", ...), `Prefetching checkpoint files: 10% (1/2)`, then
  `Loading weights took 1.64 seconds` (default_loader.py) and `Model loading took 55.22 GiB memory and 20.3s`
  (v1/worker/gpu_model_runner.py);
- torch.compile: `Using cache directory: ... for vLLM's torch.compile`, `Dynamo bytecode transform time: 5.73 s`,
  `Compiling a graph for dynamic shape takes 15.52 s` (vllm/compilation/backends.py), `torch.compile takes 25.11 s
  in total` (vllm/compilation/monitor.py); the CPU build's `Warming up model for the compilation...`;
- CUDA graphs: tqdm bars `Capturing CUDA graphs (mixed prefill-decode, PIECEWISE):  45%|####5     | 30/67`
  ("Capturing CUDA graph shapes" in older releases), then `Graph capturing finished in 8 secs, took 0.31 GiB`
  (v1/worker/gpu_model_runner.py, `capture_model`);
- the API: `init engine (profile, create kv cache, warmup model) took 24.28 s` (v1/engine/core.py), `Starting vLLM
  API server 0 on http://...` (entrypoints/openai/api_server.py; `Starting vLLM server on ...` in 0.32), uvicorn's
  `Waiting for application startup.` and `Application startup complete.` (encode/uvicorn, lifespan/on.py).

The CUDA graph bar is redrawn with `\\r` and no newline until it ends, and Docker's log copier passes a line on
only at its newline (or 16 KiB of it: moby daemon/logger/copier.go), so `docker logs` holds that bar until the
capture ends: meanwhile the stage stays the one before.

Every line may carry vLLM's prefixes: the process, `(EngineCore_DP0 pid=212) `, and the logger's
`INFO 10-06 12:00:31 [gpu_model_runner.py:3480] `. tqdm redraws a bar with `\\r` and, with vLLM's bar format, ends
each redraw with `\\n`; other bars (CUDA graphs) redraw on one line until done, so every `\\r` and `\\n` ends a
line here.

Log text comes from a node and is not trusted: only the last `MAX_TEXT` characters are read, a line is looked at
up to `MAX_LINE` characters, the line returned is made printable (reconciler/core/text.py) and cut to
`MAX_DETAIL`, and no input makes this raise.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from reconciler.core.text import printable

#: The stages of a cold start, in order: the label values of `reconciler_serving_start_stage` (a fixed set).
STAGES = ("waiting", "loading-weights", "compiling", "cuda-graphs", "api-starting", "serving")

MAX_TEXT = 65536  # characters of the log's tail that are read (the node is asked for no more)
MAX_LINE = 2000  # characters of one line that the patterns look at
MAX_DETAIL = 200  # characters of the line that is reported

_ESCAPES = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)?|\x1b[@-_]?")
_PREFIX = re.compile(r"^(?:\([^()]{1,80}\)\s*)?"  # vLLM's process prefix: (EngineCore_DP0 pid=212)
                     r"(?:(?P<level>DEBUG|INFO|WARNING|ERROR|CRITICAL)"
                     r"(?:\s+\d\d-\d\d\s+\d\d:\d\d:\d\d(?:\.\d+)?\s+\[[^\]]{0,120}\]|:)\s+)?")  # logger or uvicorn
_BAR = re.compile(r"^(?P<desc>[^:|]{1,160}):\s*(?P<pct>\d{1,3})%\s*(?:Completed\s*)?\|")
_PREFETCH = re.compile(r"^Prefetching checkpoint files:\s*(?P<pct>\d{1,3})%")

# (pattern searched in the line without its prefixes, stage or None: the line is worth showing and keeps the stage
# the lines before it set, percent the line stands for when it has no number of its own)
_LINES: tuple[tuple[re.Pattern[str], str | None, int | None], ...] = (
    (re.compile(r"Application startup complete|Uvicorn running on"), "serving", None),
    (re.compile(r"Starting vLLM (?:API )?server|Waiting for application startup|Started server process"
                r"|init engine \(profile"), "api-starting", None),
    (re.compile(r"Graph capturing finished"), "cuda-graphs", 100),
    (re.compile(r"Capturing CUDA graph|Capturing the model for CUDA graphs|CUDA graph capturing"), "cuda-graphs",
     None),
    (re.compile(r"for vLLM's torch\.compile|torch\.compile takes|Dynamo bytecode transform|Compiling a graph"
                r"|compiled graph|AOT compiled|Warming up model for the compilation"), "compiling", None),
    (re.compile(r"Loading weights took|Model loading took"), "loading-weights", 100),
    (re.compile(r"Starting to load model|Loading model weights"), "loading-weights", None),
    (re.compile(r"Initializing a V1 LLM engine|vLLM API server version"), "waiting", None),
    (re.compile(r"KV cache size|Available KV cache memory|Maximum concurrency for|Memory profiling takes"), None,
     None),
)


@dataclass(frozen=True)
class StartProgress:
    """Where a cold start is: one of STAGES, the percent its line shows (None: it shows none), and that line."""

    stage: str
    percent: int | None
    line: str


@dataclass(frozen=True)
class _Seen:
    stage: str | None
    percent: int | None
    line: str


def start_progress(log: str) -> StartProgress | None:
    """The stage of the last line that names one, and vLLM's last meaningful line (with its percent); None when
    no line is recognised (an image that logs otherwise, or nothing yet)."""
    shown: _Seen | None = None
    for raw in reversed(re.split(r"[\r\n]", log[-MAX_TEXT:])):
        seen = _recognise(raw[:MAX_LINE])
        if seen is None:
            continue
        shown = shown or seen
        if seen.stage is not None:
            return StartProgress(seen.stage, shown.percent, shown.line)
    return StartProgress("waiting", shown.percent, shown.line) if shown else None


def _recognise(raw: str) -> _Seen | None:
    line = _ESCAPES.sub("", raw).strip()
    prefix = _PREFIX.match(line)
    body = line[prefix.end():].strip() if prefix else line
    level = prefix.group("level") if prefix else None
    if not body or level in ("DEBUG", "WARNING"):  # a warning names what is off, not how far the start is
        return None
    detail = printable(body)[:MAX_DETAIL]
    if bar := _BAR.match(body) or _PREFETCH.match(body):
        stage = _bar_stage(bar.groupdict().get("desc") or "Prefetching")
        if stage is not None:
            return _Seen(stage, min(100, int(bar.group("pct"))), detail)
    for pattern, stage, percent in _LINES:
        if pattern.search(body):
            return _Seen(stage, percent, detail)
    if level in ("ERROR", "CRITICAL"):
        return _Seen(None, None, detail)  # what went wrong is worth showing; it says nothing of the stage
    return None


def _bar_stage(desc: str) -> str | None:
    """The stage a tqdm bar belongs to, by its description."""
    if desc.startswith(("Loading ", "Prefetching")):
        return "loading-weights"
    if desc.startswith("Capturing CUDA graph"):
        return "cuda-graphs"
    if desc.startswith("Compiling"):
        return "compiling"
    return None
