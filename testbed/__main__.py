"""CLI: ``python -m testbed up|down|status|exec|reset|fault`` (run as root). See docs/testbed.md."""
from __future__ import annotations

import argparse
import json
import sys
import time

from . import api
from .faults import FAULTS
from .proc import TestbedError
from .scenarios import SCENARIOS


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m testbed", description="A simulated DGX Spark cluster.")
    sub = p.add_subparsers(dest="cmd", required=True)

    s = sub.add_parser("up", help="bring the testbed up (again: harmless) in a scenario")
    s.add_argument("--nodes", type=int, default=2)
    s.add_argument("--scenario", choices=SCENARIOS, default="seed")
    s.add_argument("--weights-size", default=api.DEFAULT_WEIGHTS, help="bytes per model, e.g. 64M, 1G")
    s.add_argument("--worker-disk", default=None, help="size of each worker's model filesystem, e.g. 2G")
    s.add_argument("--node-memory", default="8G", help="each node's unified-memory budget (its MemTotal), e.g. 8G")

    sub.add_parser("down", help="remove every process, namespace, mount and file the testbed made")
    sub.add_parser("status", help="what is up (JSON)")
    sub.add_parser("demo", help="bring up the seed testbed and watch the reconciler converge and repair it")

    s = sub.add_parser("exec", help="run a command on a node as its SSH user: exec NODE -- CMD...")
    s.add_argument("node")
    s.add_argument("--user", default="spark")
    s.add_argument("command", nargs=argparse.REMAINDER)

    s = sub.add_parser("reset", help="back to a scenario without a full teardown")
    s.add_argument("--scenario", choices=SCENARIOS, default="seed")

    sub.add_parser("real-vllm", help="serve with the real vLLM: its image and model on the head (built once)")

    s = sub.add_parser("fault", help="inject a fault")
    s.add_argument("kind", choices=sorted(FAULTS))
    s.add_argument("--node", default=None, help="default: the (first) worker")
    s.add_argument("--count", type=int)
    s.add_argument("--interval", type=float)
    s.add_argument("--value", type=int, help="mtu")
    s.add_argument("--name", help="container name")
    s.add_argument("--mode", choices=["truncate", "flip", "header"])
    s.add_argument("--model", help="model id (corrupt-shard, delete-shard)")
    s.add_argument("--layout", choices=["hf-cache", "plain"])
    s.add_argument("--index", type=int, help="shard index")
    s.add_argument("--leave", type=int, help="fill-disk: bytes to leave free")
    s.add_argument("--dev", help="link faults: interface (default enp1s0f1np1)")
    s.add_argument("--clear", action="store_true", default=None, help="crash-serving: remove the marker")
    s.add_argument("--state", help="gpu: ok | mismatch | no-driver | hung")
    s.add_argument("--driver", help="gpu: the driver version nvidia-smi reports")

    a = p.parse_args(argv)
    if a.cmd == "demo":
        from .demo import run as demo

        return demo()
    try:
        if a.cmd == "up":
            t = time.monotonic()
            tb = api.up(a.nodes, a.scenario, a.weights_size, a.worker_disk, a.node_memory)
            print(f"testbed up ({len(tb.nodes)} nodes, scenario {a.scenario}) in {time.monotonic() - t:.1f}s; "
                  f"desired state: {tb.desired_state}")
        elif a.cmd == "down":
            left = api.down()
            if left:
                print("left behind: " + "; ".join(left), file=sys.stderr)
                return 1
            print("testbed down")
        elif a.cmd == "status":
            print(json.dumps(api.status(), indent=2))
        elif a.cmd == "exec":
            cmd = a.command[1:] if a.command[:1] == ["--"] else a.command
            if not cmd:
                p.error("exec NODE -- CMD...")
            r = api.exec_(a.node, cmd, user=a.user)
            sys.stdout.write(r.stdout)
            sys.stderr.write(r.stderr)
            return r.returncode
        elif a.cmd == "reset":
            t = time.monotonic()
            api.reset(a.scenario)
            print(f"reset to {a.scenario} in {time.monotonic() - t:.1f}s")
        elif a.cmd == "real-vllm":
            t = time.monotonic()
            path = api.real_vllm()
            print(f"real vLLM image and model on the head in {time.monotonic() - t:.1f}s; desired state: {path}")
        elif a.cmd == "fault":
            kw = {"count": a.count, "interval": a.interval, "value": a.value, "name": a.name, "mode": a.mode,
                  "model": a.model, "layout": a.layout, "index": a.index, "leave": a.leave, "dev": a.dev,
                  "clear": a.clear, "state": a.state, "driver": a.driver}
            print(api.fault(a.kind, a.node, **kw))
    except (TestbedError, KeyError, ValueError) as e:
        print(f"testbed: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
