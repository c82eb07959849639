#!/usr/bin/env python3
"""`ray` stand-in: `ray start --head|--address=HEAD:PORT [--node-ip-address A] [--block]`, `ray status`, `ray stop`.

The head listens on --port (its 'GCS'), keeps the list of live nodes (itself + every `ray start --address` node,
watched with heartbeats), writes $RAY_TMPDIR/ray_current_cluster (default /tmp/ray) so that `ray status` and
`vllm serve --distributed-executor-backend ray` in the same container find it, and forwards model checks to the
nodes (each node checks the weights on its own disk). A node exits 1 when it loses the head.
GPUs per node: --num-gpus or STANDIN_GPUS_PER_NODE (1). Stdlib only.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import NoReturn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import (
    JsonObject,
    LineConn,
    Terminated,
    connect,
    env_float,
    env_int,
    heartbeats,
    install_signal_handlers,
    listen,
)
from ray_client import RayError, cluster_file, ray_request, ray_tmpdir

VERSION = "2.49.0+standin"


class ClickParser(argparse.ArgumentParser):
    """click-style errors, as the real `ray` CLI prints them."""

    def error(self, message: str) -> NoReturn:
        if message.startswith("unrecognized arguments: "):
            opt = message.split(": ", 1)[1].split()[0]
            message = f"No such option: {opt}"
        sys.stderr.write(f"Usage: {self.prog} [OPTIONS]\nTry '{self.prog} --help' for help.\n\nError: {message}\n")
        sys.exit(2)


def build_parser() -> argparse.ArgumentParser:
    p = ClickParser(prog="ray")
    p.add_argument("--version", action="version", version=f"ray, version {VERSION}")
    sub = p.add_subparsers(dest="cmd", parser_class=ClickParser)
    s = sub.add_parser("start", prog="ray start")
    s.add_argument("--head", action="store_true")
    s.add_argument("--address", default=None)
    s.add_argument("--port", type=int, default=6379)
    s.add_argument("--node-ip-address", default=None)
    s.add_argument("--block", action="store_true")
    s.add_argument("--num-gpus", type=int, default=None)
    s.add_argument("--num-cpus", type=int, default=None)
    s.add_argument("--object-store-memory", type=int, default=None)
    s.add_argument("--dashboard-port", type=int, default=8265)
    s.add_argument("--dashboard-host", default=None)
    s.add_argument("--include-dashboard", default=None)
    s.add_argument("--disable-usage-stats", action="store_true")
    s.add_argument("--temp-dir", default=None)
    st = sub.add_parser("status", prog="ray status")
    st.add_argument("--address", default=None)
    st.add_argument("-v", "--verbose", action="store_true")
    sub.add_parser("stop", prog="ray stop").add_argument("--force", "-f", action="store_true")
    return p


def out(line: str = "") -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def node_id(ip: str) -> str:
    return hashlib.sha256(f"{ip}-{os.getpid()}-{time.time_ns()}".encode()).hexdigest()[:56]


def local_check(msg: JsonObject, ip: str) -> JsonObject:
    """Check a model on this node's disk the way a RayWorkerWrapper loading its shard would fail."""
    from model_check import ModelError, check_weights, crash_marker, resolve

    try:
        path = resolve(msg["model"], msg.get("revision"), msg.get("download_dir"))
        if msg.get("load_format") != "dummy":
            check_weights(path)
        marker = crash_marker(path)
        if marker:
            line = f"torch.AcceleratorError: CUDA error: an illegal memory access was encountered (stand-in: {marker})"
            return {"ok": False, "ip": ip, "lines": [line]}
        return {"ok": True, "ip": ip}
    except ModelError as e:
        return {"ok": False, "ip": ip, "lines": e.lines}


# ------------------------------------------------------------------------------------------------ head


class Head:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.ip = args.node_ip_address or "127.0.0.1"
        self.bind = args.node_ip_address or "0.0.0.0"
        self.gpus = args.num_gpus if args.num_gpus is not None else env_int("STANDIN_GPUS_PER_NODE", 1)
        self.cpus = args.num_cpus or os.cpu_count() or 1
        self.me = {"id": node_id(self.ip), "ip": self.ip, "gpus": self.gpus, "cpus": self.cpus, "head": True}
        self.nodes: dict[str, JsonObject] = {}
        self.conns: dict[str, LineConn] = {}
        self.lock = threading.Lock()
        self.pending: dict[int, JsonObject | None] = {}  # a request's answer, None until it comes
        self.cond = threading.Condition(self.lock)
        self.req_ids = itertools.count(1)
        self.hb = env_float("STANDIN_HEARTBEAT_S", 1.0)
        self.peer_timeout = env_float("STANDIN_PEER_TIMEOUT_S", 5.0)

    def status(self) -> JsonObject:
        with self.lock:
            return {"op": "status", "nodes": [self.me] + list(self.nodes.values()),
                    "address": f"{self.ip}:{self.args.port}"}

    def run(self) -> int:
        try:
            srv = listen(self.bind, self.args.port)
        except OSError as e:
            out(f"ConnectionError: Failed to start GCS on {self.bind}:{self.args.port}: {e.strerror}")
            return 1
        os.makedirs(ray_tmpdir(), exist_ok=True)
        with open(cluster_file(), "w") as f:
            f.write(f"{self.ip}:{self.args.port}")
        write_pidfile()
        out(f"Local node IP: {self.ip}")
        out()
        out("--------------------")
        out("Ray runtime started.")
        out("--------------------")
        out()
        out("Next steps")
        out("  To add another node to this Ray cluster, run")
        out(f"    ray start --address='{self.ip}:{self.args.port}'")
        out()
        out("--block")
        out("  This command will now block forever until terminated by a signal.")
        threading.Thread(target=self._accept, args=(srv,), daemon=True).start()
        while True:
            time.sleep(0.5)

    def _accept(self, srv: socket.socket) -> None:
        while True:
            try:
                sock, addr = srv.accept()
            except OSError:
                return
            threading.Thread(target=self._client, args=(sock, addr), daemon=True).start()

    def _client(self, sock: socket.socket, addr: tuple[str, int]) -> None:
        conn = LineConn(sock)
        try:
            msg = conn.recv(10.0)
        except TimeoutError:
            msg = None
        if not msg:
            conn.close()
            return
        op = msg.get("op")
        if op == "status":
            conn.send(self.status())
            conn.close()
        elif op == "check_model":
            conn.send({"op": "check_result", "results": self.check_model(msg)})
            conn.close()
        elif op == "join":
            self._node(conn, msg, addr)
        else:
            conn.send({"op": "error", "error": f"unknown op {op!r}"})
            conn.close()

    def check_model(self, msg: JsonObject) -> list[JsonObject]:
        results = [local_check(msg, self.ip)]
        with self.lock:
            targets = list(self.conns.items())
            ids = {}
            for nid, _ in targets:
                rid = next(self.req_ids)
                ids[rid] = nid
                self.pending[rid] = None
        for rid, nid in ids.items():
            self.conns.get(nid) and self.conns[nid].send({**msg, "op": "check_model", "req": rid})
        deadline = time.monotonic() + 60
        with self.cond:
            while any(self.pending.get(r) is None for r in ids) and time.monotonic() < deadline:
                self.cond.wait(0.5)
            for rid, nid in ids.items():
                res = self.pending.pop(rid, None)
                results.append(res or {"ok": False, "ip": nid, "lines": ["RayActorError: node did not answer"]})
        return results

    def _node(self, conn: LineConn, msg: JsonObject, addr: tuple[str, int]) -> None:
        nid = msg.get("node_id") or node_id(addr[0])
        info = {"id": nid, "ip": msg.get("ip") or addr[0], "gpus": int(msg.get("gpus", 1)),
                "cpus": int(msg.get("cpus", 1)), "head": False}
        with self.lock:
            self.nodes[nid] = info
            self.conns[nid] = conn
        conn.send({"op": "joined", "node_id": nid, "head": self.me["id"]})
        out(f"[stand-in] node {nid[:8]} joined from {info['ip']} ({info['gpus']} GPU)")
        for m in heartbeats(conn, self.hb, self.peer_timeout):
            if m is None:
                break
            if m.get("op") == "check_result":
                with self.cond:
                    if m.get("req") in self.pending:
                        self.pending[m["req"]] = m
                        self.cond.notify_all()
        with self.lock:
            self.nodes.pop(nid, None)
            self.conns.pop(nid, None)
        conn.close()
        out(f"[stand-in] node {nid[:8]} ({info['ip']}) is dead: connection lost")


# ------------------------------------------------------------------------------------------------ worker node


def _connect_to_gcs(host: str, port: int) -> socket.socket | None:
    """A socket to the head's GCS, retried until STANDIN_RAY_CONNECT_TIMEOUT_S; None (with Ray's message)
    when it never answers."""
    deadline = time.monotonic() + env_float("STANDIN_RAY_CONNECT_TIMEOUT_S", 30.0)
    while True:
        try:
            return connect(host, port, timeout=2.0)
        except OSError as e:
            if time.monotonic() > deadline:
                out(f"ConnectionError: Unable to connect to GCS at {host}:{port}. Check that (1) Ray GCS with matching "
                    f"version started successfully at the specified address, and (2) there is no firewall setting "
                    f"preventing access. ({e.strerror or e})")
                return None
            time.sleep(0.5)


def _joined(conn: LineConn, join: JsonObject, gcs: str) -> bool:
    """Send the join request; True when the head answers `joined` within 10 s."""
    conn.send(join)
    try:
        msg = conn.recv(10.0)
    except TimeoutError:
        msg = None
    if not msg or msg.get("op") != "joined":
        out(f"ConnectionError: GCS at {gcs} refused the node: {msg}")
        return False
    return True


def _worker_banner(ip: str) -> None:
    out(f"Local node IP: {ip}")
    out()
    out("--------------------")
    out("Ray runtime started.")
    out("--------------------")
    out()
    out("To terminate the Ray runtime, run")
    out("  ray stop")
    out()
    out("--block")
    out("  This command will now block forever until terminated by a signal.")


def _serve_head(conn: LineConn, gcs: str, ip: str) -> int:
    """Ping the head every heartbeat and answer its model checks; exit 1 like a raylet when it goes silent."""
    hb = env_float("STANDIN_HEARTBEAT_S", 1.0)
    timeout = env_float("STANDIN_PEER_TIMEOUT_S", 5.0)
    last = time.monotonic()
    last_sent = 0.0
    while True:
        now = time.monotonic()
        if now - last_sent >= hb:
            conn.send({"op": "ping"})
            last_sent = now
        try:
            m = conn.recv(hb)
        except TimeoutError:
            if time.monotonic() - last > timeout:
                m = None
            else:
                continue
        if m is None:
            out(f"[raylet] Failed to connect to GCS at {gcs} (connection lost); the raylet is exiting. "
                "This usually happens when the head node dies.")
            return 1
        last = time.monotonic()
        if m.get("op") == "check_model":
            res = local_check(m, ip)
            conn.send({**res, "op": "check_result", "req": m.get("req")})


def run_worker(args: argparse.Namespace) -> int:
    host, _, port_text = args.address.rpartition(":")
    host = host.strip("[]") or "127.0.0.1"
    try:
        port = int(port_text)
    except ValueError:
        out(f"ValueError: invalid --address {args.address!r}")
        return 1
    ip = args.node_ip_address or "127.0.0.1"
    gpus = args.num_gpus if args.num_gpus is not None else env_int("STANDIN_GPUS_PER_NODE", 1)
    sock = _connect_to_gcs(host, port)
    if sock is None:
        return 1
    conn = LineConn(sock)
    join = {"op": "join", "node_id": node_id(ip), "ip": ip, "gpus": gpus, "cpus": args.num_cpus or os.cpu_count() or 1}
    if not _joined(conn, join, f"{host}:{port}"):
        return 1
    write_pidfile()
    _worker_banner(ip)
    return _serve_head(conn, f"{host}:{port}", ip)


# ------------------------------------------------------------------------------------------------ commands


def pid_dir() -> str:
    return os.path.join(ray_tmpdir(), "standin-pids")


def write_pidfile() -> None:
    os.makedirs(pid_dir(), exist_ok=True)
    with open(os.path.join(pid_dir(), str(os.getpid())), "w") as f:
        f.write(" ".join(sys.argv))


def cmd_status(args: argparse.Namespace) -> int:
    try:
        st = ray_request({"op": "status"}, args.address)
    except RayError as e:
        out(str(e))
        return 1
    nodes = st["nodes"]
    cpus = sum(n.get("cpus", 1) for n in nodes)
    gpus = sum(n.get("gpus", 0) for n in nodes)
    out(f"======== Autoscaler status: {time.strftime('%Y-%m-%d %H:%M:%S')}.000000 ========")
    out("Node status")
    out("-" * 63)
    out("Active:")
    for n in nodes:
        out(f" 1 node_{n['id']}")
    out("Pending:")
    out(" (no pending nodes)")
    out("Recent failures:")
    out(" (no failures)")
    out()
    out("Resources")
    out("-" * 63)
    out("Usage:")
    out(f" 0.0/{float(cpus)} CPU")
    out(f" 0.0/{float(gpus)} GPU")
    out(f" 0B/{8.0 * len(nodes):.2f}GiB memory")
    out(f" 0B/{1.0 * len(nodes):.2f}GiB object_store_memory")
    out()
    out("Demands:")
    out(" (no resource demands)")
    return 0


def cmd_stop(args: argparse.Namespace) -> int:
    d = pid_dir()
    pids = []
    if os.path.isdir(d):
        for name in os.listdir(d):
            try:
                pids.append(int(name))
            except ValueError:
                pass
            os.unlink(os.path.join(d, name))
    stopped = 0
    for pid in pids:
        if pid == os.getpid():
            continue
        try:
            os.kill(pid, signal.SIGKILL if args.force else signal.SIGTERM)
            stopped += 1
        except OSError:
            pass
    try:
        os.unlink(cluster_file())
    except OSError:
        pass
    out(f"Stopped all {stopped} Ray processes.")
    return 0


def cmd_start(args: argparse.Namespace) -> int:
    if args.temp_dir:
        os.environ["RAY_TMPDIR"] = args.temp_dir
    if bool(args.head) == bool(args.address):
        out("ValueError: exactly one of --head or --address must be given" if args.head else
            "ValueError: --address is required when not starting the head (--head)")
        return 1
    if not args.block:
        return daemonize()
    return Head(args).run() if args.head else run_worker(args)


def daemonize() -> int:
    """`ray start` without --block: run the same command with --block in the background, return when it is up."""
    logdir = os.path.join(ray_tmpdir(), "session_latest", "logs")
    os.makedirs(logdir, exist_ok=True)
    logpath = os.path.join(logdir, f"standin-{os.getpid()}.out")
    cmd = [sys.executable, os.path.abspath(__file__), *sys.argv[1:], "--block"]
    with open(logpath, "wb") as logf:
        child = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                 start_new_session=True)
    deadline = time.monotonic() + env_float("STANDIN_RAY_CONNECT_TIMEOUT_S", 30.0) + 5
    marker = os.path.join(pid_dir(), str(child.pid))
    while time.monotonic() < deadline:
        if os.path.exists(marker):
            with open(logpath) as f:
                sys.stdout.write(f.read().replace("--block\n  This command will now block forever until terminated "
                                                  "by a signal.\n", ""))
            return 0
        if child.poll() is not None:
            with open(logpath) as f:
                sys.stdout.write(f.read())
            return child.returncode or 1
        time.sleep(0.1)
    child.terminate()
    out("TimeoutError: the Ray runtime did not start in time")
    return 1


def main(argv: list[str] | None = None) -> int:
    install_signal_handlers()
    parser = build_parser()
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        if args.cmd == "start":
            return cmd_start(args)
        if args.cmd == "status":
            return cmd_status(args)
        if args.cmd == "stop":
            return cmd_stop(args)
        parser.print_help()
        return 0
    except Terminated:
        return 0
    finally:
        if args.cmd == "start" and args.block:
            stale = [os.path.join(pid_dir(), str(os.getpid()))] + ([cluster_file()] if args.head else [])
            for path in stale:
                try:
                    os.unlink(path)
                except OSError:
                    pass


if __name__ == "__main__":
    sys.exit(main())
