#!/usr/bin/env python3
"""Co-tenant stand-in (the seed's `vllm_node` GLM server, `vllm_embeddings`, `reranker`):
`cotenant --port P --hold-mb M --label L [--host H]` holds M MiB of touched memory, answers GET /health (200),
/v1/models (the label as model id) and /metrics on H:P (default 0.0.0.0), and exits 0 promptly on SIGTERM."""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import QuietHandler, Terminated, install_signal_handlers, log, raw, serve_http


def main(argv: list[str] | None = None) -> int:
    install_signal_handlers()
    p = argparse.ArgumentParser(prog="cotenant")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--hold-mb", type=int, default=0)
    p.add_argument("--label", default="cotenant")
    p.add_argument("--host", default="0.0.0.0")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        n = max(0, args.hold_mb) << 20
        hold = bytearray(n)
        if n:
            hold[::4096] = b"\x01" * len(range(0, n, 4096))  # touch every page so it is resident
        label = args.label
        started = int(time.time())

        class Handler(QuietHandler):
            def do_GET(self) -> None:
                path = self.path.split("?", 1)[0]
                if path == "/health":
                    self.reply(200, {"status": "ok", "label": label, "hold_mb": args.hold_mb})
                elif path == "/v1/models":
                    self.reply(200, {"object": "list", "data": [
                        {"id": label, "object": "model", "created": started, "owned_by": "vllm"}]})
                elif path == "/metrics":
                    self.reply(200, f'cotenant_hold_bytes{{label="{label}"}} {len(hold)}\n', "text/plain")
                else:
                    self.reply(404, {"detail": "Not Found"})

        try:
            serve_http(args.host, args.port, Handler)
        except OSError as e:
            raw(f"ERROR:    [Errno {e.errno}] error while attempting to bind on address ('{args.host}', "
                f"{args.port}): {e.strerror}")
            return 1
        log("INFO", "cotenant.py:1", f"{label}: holding {args.hold_mb} MiB, serving on {args.host}:{args.port}")
        raw(f"INFO:     Uvicorn running on http://{args.host}:{args.port} (Press CTRL+C to quit)")
        while True:
            time.sleep(1)
    except Terminated:
        raw("INFO:     Shutting down")
        return 0


if __name__ == "__main__":
    sys.exit(main())
