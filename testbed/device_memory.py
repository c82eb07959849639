"""What the GPU says is free on a testbed node, as a GB10 answers it: the node's memory minus everything its
processes and containers hold, the page cache included.

On GB10 the CPU and the GPU share one pool, and the driver's free memory (`cudaMemGetInfo`, what vLLM's startup
check compares with `gpu_memory_utilization` x the total) does not count page cache the kernel could reclaim: after
a weights copy, or once shards are warm, vLLM's start fails with "Free memory on device ... on startup is less than
desired GPU memory utilization" while MemAvailable looked ample (vllm-project/vllm#35313; NVIDIA's vLLM playbook,
"manually flush the buffer cache"). Releases whose `MemorySnapshot` takes an integrated GPU's free memory from the
kernel's MemAvailable instead do not fail this way; NGC images from before do.

One tiny HTTP server per node, on the node's loopback (`DEVICE_MEMORY_PORT`), started by `up` inside the node's
network namespace: GET answers `{"total": LIMIT, "free": LIMIT - USAGE}` read fresh from the node's memory cgroup
(`memory.usage_in_bytes` counts the page cache charged to the node). The vLLM stand-in asks it before it allocates
(`STANDIN_DEVICE_MEMORY_URL`, set by desired-state/testbed.yaml), as vLLM asks the driver.
"""

from __future__ import annotations

import json
import sys
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

DEVICE_MEMORY_PORT = 9479


def answer(cgroup: Path) -> dict[str, int]:
    limit = int((cgroup / "memory.limit_in_bytes").read_text())
    usage = int((cgroup / "memory.usage_in_bytes").read_text())
    return {"total": limit, "free": max(0, limit - usage)}


def serve(cgroup: Path, port: int) -> None:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = json.dumps(answer(cgroup)).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    HTTPServer(("127.0.0.1", port), Handler).serve_forever()


if __name__ == "__main__":
    serve(Path(sys.argv[1]), int(sys.argv[2]))
