import json

from testbed.proc import free_port, wait_for
from testbed.standin.testing import Proc, http_get


def test_cotenant_serves_holds_memory_and_stops_on_sigterm(tmp_path):
    port = free_port()
    p = Proc("cotenant", ["--port", str(port), "--hold-mb", "32", "--label", "vllm_embeddings", "--host", "127.0.0.1"],
             tmp_path)
    try:
        wait_for(lambda: http_get(f"http://127.0.0.1:{port}/health")[0] == 200, what="cotenant health")
        body = json.loads(http_get(f"http://127.0.0.1:{port}/health")[1])
        assert body["label"] == "vllm_embeddings"
        assert json.loads(http_get(f"http://127.0.0.1:{port}/v1/models")[1])["data"][0]["id"] == "vllm_embeddings"
        with open(f"/proc/{p.p.pid}/status") as f:
            rss_kb = int(next(line for line in f if line.startswith("VmRSS:")).split()[1])
        assert rss_kb > 32 * 1024
        p.terminate()
        assert p.wait(5) == 0, "SIGTERM ends the co-tenant cleanly, within the wait's deadline"
    finally:
        p.stop()


def test_cotenant_port_in_use_fails(tmp_path):
    port = free_port()
    a = Proc("cotenant", ["--port", str(port), "--host", "127.0.0.1"], tmp_path, name="a")
    try:
        wait_for(lambda: http_get(f"http://127.0.0.1:{port}/health")[0] == 200, what="first")
        b = Proc("cotenant", ["--port", str(port), "--host", "127.0.0.1"], tmp_path, name="b")
        assert b.wait(10) == 1 and "address already in use" in b.output.lower()
    finally:
        a.stop()
