"""Real vLLM start to first completion, cold vs warm compile cache (benchmark 8).

What a restart costs is what an ordered serving change costs the users of a deployment. vLLM saves what
torch.compile (inductor) builds under ~/.cache/vllm/torch_compile_cache and inductor's own cache; a container
started with that directory kept on a volume skips the compile. Measured with the real vLLM 0.32.0 CPU build in
the testbed (testbed/realvllm), on the head, tensor parallel 1, compile on (no --enforce-eager), from `docker run`
to the first answered completion:

  cold = an empty cache directory each run;
  warm = the directory a cold run filled, kept (as `-v HOST_DIR:/root/.cache/vllm` keeps it across containers).

Runs alternate cold and warm so drift of the machine hits both alike. Not in `--quick` (the smoke test): its
minutes are already spent by tests/e2e/test_real_vllm.py, which checks the real vLLM works; this measures it.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING

from bench.common import Options, Result, on_testbed, save, summary
from testbed.realvllm import image

if TYPE_CHECKING:
    from testbed.api import Testbed

PORT = 8100
NAME = "bench_vllm"
START_DEADLINE = 900.0


def _await_completion(tb: Testbed, deadline: float) -> None:
    """Until a completion answers on the head (bounded by `deadline` seconds)."""
    body = json.dumps({"model": "tiny", "prompt": "Hello", "max_tokens": 2, "temperature": 0})
    start = time.monotonic()
    while time.monotonic() - start < deadline:
        res = tb.exec("head", f"curl -s -m 30 -H 'Content-Type: application/json' -d '{body}' "
                              f"http://127.0.0.1:{PORT}/v1/completions", timeout=60)
        if res.returncode == 0 and '"choices"' in res.stdout:
            return
        state = tb.docker("head", "inspect", "--format", "{{.State.Running}}", NAME, check=False).stdout.strip()
        if state != "true":
            logs = tb.docker("head", "logs", "--tail", "20", NAME, check=False)
            raise RuntimeError(f"vLLM exited before answering: {(logs.stdout + logs.stderr)[-2000:]}")
        time.sleep(1.0)
    raise TimeoutError(f"no completion within {deadline:.0f}s")


def _one_start(tb: Testbed, hub: Path, cache: Path) -> float:
    tb.docker("head", "rm", "-f", NAME, check=False)
    t0 = time.monotonic()
    tb.docker("head", "run", "-d", "--name", NAME, "--network", "host", "--ipc", "host",
              "-v", f"{hub}:/root/.cache/huggingface/hub", "-v", f"{cache}:/root/.cache/vllm",
              "-e", "HF_HUB_OFFLINE=1", "-e", "HF_HUB_CACHE=/root/.cache/huggingface/hub",
              "-e", "TORCHINDUCTOR_CACHE_DIR=/root/.cache/vllm/inductor",
              image.IMAGE, "vllm", "serve", image.MODEL_ID, "--revision", image.MODEL_REVISION,
              "--served-model-name", "tiny", "--host", "127.0.0.1", "--port", str(PORT),
              "--max-model-len", "512", "--max-num-seqs", "4", "--gpu-memory-utilization", "0.1")
    try:
        _await_completion(tb, START_DEADLINE)
        return time.monotonic() - t0
    finally:
        tb.docker("head", "rm", "-f", NAME, check=False)


def run_vllm_start(opts: Options) -> Result:
    runs = opts.n(5, 1)
    with on_testbed(2, "converged") as run:
        tb = run.tb
        tb.real_vllm()
        root = tb.head.model_root
        hub = root / "hub"
        caches = root / "bench-vllm-cache"
        shutil.rmtree(caches, ignore_errors=True)
        warm_dir = caches / "warm"
        cold: list[float] = []
        warm: list[float] = []
        for i in range(runs):  # cold run 0 fills the cache every warm run then keeps
            cold_dir = warm_dir if i == 0 else caches / f"cold-{i}"
            cold_dir.mkdir(parents=True, exist_ok=True)
            cold.append(_one_start(tb, hub, cold_dir))
            opts.log(f"   cold start {i}: {cold[-1]:.1f} s")
            warm.append(_one_start(tb, hub, warm_dir))
            opts.log(f"   warm start {i}: {warm[-1]:.1f} s")
            if cold_dir != warm_dir:
                shutil.rmtree(cold_dir, ignore_errors=True)
        cache_bytes = sum(p.stat().st_size for p in warm_dir.rglob("*") if p.is_file())
        shutil.rmtree(caches, ignore_errors=True)
    data: Result = {"runs": runs, "cold": summary(cold), "warm": summary(warm),
            "cache_mb": round(cache_bytes / 1e6, 1), "leftovers": run.leftovers}
    data["ratio"] = data["cold"]["median"] / data["warm"]["median"]
    save(opts, "vllm_start", data)
    return data
