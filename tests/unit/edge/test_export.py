"""`reconciler export --format lws` and the pure parts of `reconciler discover`, on recorded outputs.

The LWS manifest is checked against lws-crd-subset.schema.json (the upstream CRD's schema pruned to the fields the
export writes, see make_lws_schema.py) with a small validator for the keywords that file uses, plus the semantic
checks the schema cannot express (size = serving nodes, the LWS variables in the argv, the probe port)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import click
import pytest
import yaml

from reconciler.core import spec
from reconciler.core.export import lws_manifest, lws_yaml
from reconciler.edge import discover as disc
from reconciler.edge.facts.base import Section
from reconciler.edge.facts.containers import parse_containers
from tests.unit.recorded import sections_of

REPO = Path(__file__).resolve().parents[3]
FIX = Path(__file__).parents[1] / "fixtures"
DISC = FIX / "discover"
TESTBED = REPO / "desired-state" / "testbed.yaml"


def text_fixture(name: str) -> str:
    return "\n".join(line for line in (DISC / name).read_text().splitlines() if not line.startswith("#"))


def json_fixture(name: str) -> str:
    doc = json.loads((DISC / name).read_text())
    assert doc["source"], "every fixture says where it came from"
    return json.dumps(doc["output"])


# ------------------------------------------------------------------------------------------ schema validation

_PY_TYPES = {"object": dict, "array": list, "string": str, "boolean": bool}


def _wrong_type(schema: dict, value, path: str) -> str | None:
    """The error when `value` is not of the schema's `type` (then no other keyword is checked)."""
    kind = schema.get("type")
    if kind == "integer" and (isinstance(value, bool) or not isinstance(value, int)):
        return f"{path}: not an integer: {value!r}"
    if kind in _PY_TYPES and not isinstance(value, _PY_TYPES[kind]):
        return f"{path}: not {kind}: {value!r}"
    return None


def _value_errors(schema: dict, value, path: str) -> list[str]:
    """format int32, enum, minimum, maximum."""
    errs: list[str] = []
    if schema.get("type") == "integer" and schema.get("format") == "int32" and not -2**31 <= value < 2**31:
        errs.append(f"{path}: out of int32")
    if "enum" in schema and value not in schema["enum"]:
        errs.append(f"{path}: {value!r} not in {schema['enum']}")
    if "minimum" in schema and value < schema["minimum"]:
        errs.append(f"{path}: below {schema['minimum']}")
    if "maximum" in schema and value > schema["maximum"]:
        errs.append(f"{path}: above {schema['maximum']}")
    return errs


def _object_errors(schema: dict, value: dict, path: str) -> list[str]:
    """required, properties, additionalProperties (false: the API server would prune the field)."""
    errs = [f"{path}: missing required {key}" for key in schema.get("required", []) if key not in value]
    props = schema.get("properties", {})
    extra = schema.get("additionalProperties", True)
    for key, v in value.items():
        if key in props:
            errs += validate(props[key], v, f"{path}.{key}")
        elif extra is False:
            errs.append(f"{path}: unknown field {key!r} (the API server would prune it)")
        elif isinstance(extra, dict):
            errs += validate(extra, v, f"{path}.{key}")
    return errs


def validate(schema: dict, value, path: str = "$") -> list[str]:
    """The JSON-Schema keywords lws-crd-subset.schema.json uses (type, enum, minimum, maximum, required,
    properties, additionalProperties, items, x-kubernetes-int-or-string)."""
    if schema.get("x-kubernetes-int-or-string"):
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            return [f"{path}: not int-or-string: {value!r}"]
        return []
    wrong = _wrong_type(schema, value, path)
    if wrong:
        return [wrong]
    errs = _value_errors(schema, value, path)
    if isinstance(value, dict):
        errs += _object_errors(schema, value, path)
    if isinstance(value, list) and "items" in schema:
        for i, v in enumerate(value):
            errs += validate(schema["items"], v, f"{path}[{i}]")
    return errs


@pytest.fixture(scope="module")
def schema() -> dict:
    doc = json.loads((FIX / "lws-crd-subset.schema.json").read_text())
    assert "kubernetes-sigs/lws" in doc["$comment"]
    return doc


def variant(change) -> spec.Desired:
    data = yaml.safe_load(TESTBED.read_text())
    change(data)
    return spec.loads(yaml.safe_dump(data, explicit_end=True))


def four_nodes(d: dict) -> None:
    for i in (2, 3):
        w = json.loads(json.dumps(d["nodes"][1]))
        w["name"], w["ssh"]["host"] = f"worker{i}", f"10.231.1.{10 + i}"
        w["fabric"]["address"] = f"10.232.0.{10 + i}/24"
        w["fabric"]["twin"]["address"] = f"10.232.1.{10 + i}/24"
        d["nodes"].append(w)
        d["model"]["path"][f"worker{i}"] = f"/srv/spark-testbed/worker{i}/models/hub"
    d["serving"]["tensor_parallel_size"] = 4


def test_the_validator_rejects_what_it_should(schema):
    bad = lws_manifest(spec.load(TESTBED))
    bad["spec"]["leaderWorkerTemplate"]["restartPolicy"] = "Always"
    bad["spec"]["leaderWorkerTemplate"]["sizes"] = 2
    del bad["spec"]["leaderWorkerTemplate"]["workerTemplate"]
    errs = validate(schema, bad)
    assert any("restartPolicy" in e for e in errs) and any("sizes" in e for e in errs)
    assert any("missing required workerTemplate" in e for e in errs)


@pytest.mark.parametrize("change", [lambda d: None, four_nodes,
                                    lambda d: (d["serving"]["docker"].update(privileged=True),
                                               d.update(trust={"privileged": True})),
                                    lambda d: d["serving"].update(launcher="ray")],
                         ids=["testbed", "four-nodes", "privileged", "ray"])
def test_manifest_fits_the_lws_crd_fields(schema, change):
    desired = variant(change)
    manifest = lws_manifest(desired)
    assert validate(schema, manifest) == []
    n = len(desired.serving_nodes)
    lwt = manifest["spec"]["leaderWorkerTemplate"]
    assert manifest["apiVersion"] == "leaderworkerset.x-k8s.io/v1" and manifest["kind"] == "LeaderWorkerSet"
    assert manifest["spec"]["replicas"] == 1 and lwt["size"] == n
    assert lwt["restartPolicy"] == "RecreateGroupOnPodRestart"
    for role in ("leaderTemplate", "workerTemplate"):
        pod = lwt[role]["spec"]
        c = pod["containers"][0]
        assert pod["hostNetwork"] is True and c["image"] == desired.serving.image
        assert c["resources"]["limits"]["nvidia.com/gpu"] == "1"
        shm = next(v for v in pod["volumes"] if v["name"] == "dshm")
        assert shm["emptyDir"]["medium"] == "Memory"
        assert "command" not in c, "command replaces the image's ENTRYPOINT (NGC's CUDA compat setup)"
        argv = c["args"]
        assert argv[:3] == ["vllm", "serve", desired.model.id]
        for flag, var in (("--nnodes", "$(LWS_GROUP_SIZE)"), ("--node-rank", "$(LWS_WORKER_INDEX)"),
                          ("--master-addr", "$(LWS_LEADER_ADDRESS)")):
            assert argv[argv.index(flag) + 1] == var
        assert argv[argv.index("--tensor-parallel-size") + 1] == str(desired.serving.tensor_parallel_size)
        assert ("--headless" in argv) == (role == "workerTemplate")
        assert "--distributed-executor-backend" not in argv
        env = {e["name"]: e for e in c["env"]}
        assert env["NCCL_SOCKET_IFNAME"]["value"] == "enp1s0f1np1"
        assert env["VLLM_HOST_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    leader = lwt["leaderTemplate"]["spec"]["containers"][0]
    assert leader["readinessProbe"]["tcpSocket"]["port"] == desired.serving.port
    assert {e["name"]: e.get("value") for e in lwt["workerTemplate"]["spec"]["containers"][0]["env"]}[
        "HF_HUB_OFFLINE"] == "1", "the internet-less worker keeps HF_HUB_OFFLINE=1"


def test_cli_prints_the_same_manifest():
    out = subprocess.run([str(Path(sys.executable).with_name("reconciler")), "export", str(TESTBED), "--format",
                          "lws"], capture_output=True, text=True, check=True).stdout
    assert yaml.safe_load(out) == lws_manifest(spec.load(TESTBED)) == yaml.safe_load(lws_yaml(spec.load(TESTBED)))


def test_the_format_option_is_read(monkeypatch, capsys):
    """`--format` picks the renderer (it was once accepted and ignored: every format printed LWS). A second
    format, registered here, renders through its own renderer, and the choices offered are the renderers'."""
    from reconciler.cli import offline

    monkeypatch.setitem(offline.EXPORT_FORMATS, "names", lambda desired, name: f"{desired.served_name} {name}\n")
    offline.export.callback(str(TESTBED), "names", "x")
    assert capsys.readouterr().out == f"{spec.load(TESTBED).served_name} x\n"
    choice = next(p for p in offline.export.params if p.name == "fmt").type
    assert isinstance(choice, click.Choice) and list(choice.choices) == ["lws"]


# ------------------------------------------------------------------------------------------ discover parsers

def test_ibdev2netdev_as_printed_on_a_spark():
    links = disc.parse_ibdev2netdev(text_fixture("ibdev2netdev-spark.txt"))
    assert [(r.device, r.netdev, r.active) for r in links] == [
        ("roceP2p1s0f0", "enP2p1s0f0np0", False), ("roceP2p1s0f1", "enP2p1s0f1np1", True),
        ("rocep1s0f0", "enp1s0f0np0", False), ("rocep1s0f1", "enp1s0f1np1", True)]


def test_rdma_sysfs_lines():
    links = {r.device: r for r in disc.parse_rdma_sysfs(text_fixture("rdma-sysfs-spark.txt"))}
    assert links["rocep1s0f1"].active and links["rocep1s0f1"].netdev == "enp1s0f1np1"
    assert links["rocep1s0f1"].phys_state == "5: LinkUp"
    assert not links["rocep1s0f0"].active and links["rocep1s0f0"].state == "1: DOWN"


def test_ip_addr_of_this_machine_excludes_loopback_and_reads_ipv4():
    ifaces = {i.name: i for i in disc.parse_ip_addr(json_fixture("ip-addr-devhost.json"))}
    assert "lo" not in ifaces
    assert [str(a.ip) for a in ifaces["eth0"].ipv4] == ["192.0.2.2"], "IPv6 addresses are not IPv4"
    assert ifaces["eth0"].up and ifaces["eth0"].mtu == 1400
    assert not ifaces["ifb0"].up and ifaces["ifb0"].ipv4 == ()


def spark_addr_json() -> str:
    """This machine's recorded testbed-head `ip -j addr`, with the Spark's interface names and NVIDIA's netplan
    example addresses (connect-two-sparks: enp1s0f1np1 192.168.100.10/24, enP2p1s0f1np1 192.168.101.10/24)."""
    links = json.loads(json_fixture("ip-addr-testbed-head.json"))
    fabric = next(link for link in links if link["ifname"] == "enp1s0f1np1")
    twin = json.loads(json.dumps(fabric))
    twin["ifname"], twin["ifindex"] = "enP2p1s0f1np1", 99
    for link, addr in ((fabric, "192.168.100.10"), (twin, "192.168.101.10")):
        for a in link["addr_info"]:
            if a["family"] == "inet":
                a["local"], a["prefixlen"] = addr, 24
    wifi = {"ifname": "wlP9s9", "flags": ["BROADCAST", "UP", "LOWER_UP"], "mtu": 1500, "addr_info": [
        {"family": "inet", "local": "192.168.1.50", "prefixlen": 24}]}
    return json.dumps(links + [twin, wifi])


def facts_from(addr_json: str, rdma: str = "", ibdev: str | None = None, host: str = "10.231.0.2") -> disc.NodeFacts:
    sections = ["@@hostname", "spark-a1", "@@rc 0", "@@addr", addr_json, "@@rc 0",
                "@@rdma_sysfs", rdma, "@@rc 0", "@@route", "RTNETLINK answers: Network is unreachable", "@@rc 2",
                "@@meminfo", "MemTotal:       127600748 kB", "MemAvailable:   110000000 kB", "@@rc 0"]
    if ibdev is not None:
        sections += ["@@ibdev2netdev", ibdev, "@@rc 0"]
    return disc.facts_from_sections(host, sections_of("\n".join(sections) + "\n"))


def test_fabric_prefers_the_active_roce_netdev_with_ipv4_and_notes_twins():
    f = facts_from(spark_addr_json(), ibdev=text_fixture("ibdev2netdev-spark.txt"))
    assert f.rdma_source == "ibdev2netdev" and not f.internet
    g = disc.guess_fabric(f, ["10.231.0.2"])
    assert (g.interface, g.rdma_device, str(g.address)) == ("enp1s0f1np1", "rocep1s0f1", "192.168.100.10/24")
    assert g.twins == ["roceP2p1s0f1"]
    assert any("different subnet" in n for n in g.notes)
    assert all("wlP9s9" not in n for n in g.notes) and "wlP9s9" not in {i.name for i in f.ifaces}


def test_fabric_from_sysfs_when_ibdev2netdev_is_absent_and_same_subnet_twins_warned():
    links = json.loads(spark_addr_json())
    for link in links:
        if link["ifname"] == "enP2p1s0f1np1":
            link["addr_info"][0]["local"] = "192.168.100.20"
    f = facts_from(json.dumps(links), rdma=text_fixture("rdma-sysfs-spark.txt"))
    assert f.rdma_source == "sysfs"
    g = disc.guess_fabric(f, ["10.231.0.2"])
    assert (g.interface, g.rdma_device) == ("enp1s0f1np1", "rocep1s0f1")
    assert any("SAME subnet" in n for n in g.notes)


def test_testbed_head_without_rdma_picks_the_connectx_named_port_not_management():
    f = facts_from(json_fixture("ip-addr-testbed-head.json"))
    g = disc.guess_fabric(f, ["10.231.0.2", "10.231.1.11"])
    assert g.interface == "enp1s0f1np1" and str(g.address) == "10.232.0.10/24" and g.rdma_device is None


def test_parsers_for_the_rest_of_the_script():
    assert disc.parse_meminfo("MemTotal:       127600748 kB\nMemAvailable:   52000000 kB") == (
        127600748 * 1024, 52000000 * 1024)
    imgs = disc.parse_images('{"Repository":"nvcr.io/nvidia/vllm","Tag":"26.05-py3","Size":"18.5GB"}\n'
                             '{"Repository":"<none>","Tag":"<none>","Size":"41.8MB"}')
    assert imgs == [("nvcr.io/nvidia/vllm:26.05-py3", 18_500_000_000)]
    roots, models = disc.parse_models("home\t/srv/a/models\nroot\t/home/spark/.cache/huggingface/hub\n"
                                      "hf\t/home/spark/.cache/huggingface/hub\tmodels--Qwen--Qwen3-8B\t16000000\t"
                                      + "a" * 40 + "\n")
    assert roots == ["/home/spark/.cache/huggingface/hub", "/srv/a/models/hub"]
    assert models[0].model_id == "Qwen/Qwen3-8B" and models[0].revision == "a" * 40
    _, _, listed = parse_containers(Section('{"name":"/vllm_node","id":"c0","image":"vllm-node","state":"running",'
                                            '"labels":null}', 0))
    cs = disc.running_containers(listed, disc.parse_commands('{"name":"/vllm_node","args":["infinity"],'
                                                             '"entrypoint":["sleep"]}'))
    assert disc.holds_serving_port(cs[0], 8000)
    other = disc.RunningContainer("embed", "img", ("cotenant", "--port", "8001"))
    assert not disc.holds_serving_port(other, 8000)


def test_render_validates_and_marks_guesses():
    head = facts_from(spark_addr_json(), ibdev=text_fixture("ibdev2netdev-spark.txt"))
    head.models = [disc.ModelDir("hf-cache", "/home/spark/.cache/huggingface/hub", "Qwen/Qwen3-8B", 16_000_000,
                                 "a" * 40)]
    head.model_roots = ["/home/spark/.cache/huggingface/hub"]
    worker = facts_from(json_fixture("ip-addr-testbed-worker.json"), host="10.231.1.11")
    worker.hostname = "spark-b2"
    text = disc.render([head, worker], user="spark", known_hosts="/etc/spark-reconciler/known_hosts",
                       identity=None, jump=True)
    d = spec.loads(text)
    assert [n.role for n in d.nodes] == ["head", "worker"] and d.serving.tensor_parallel_size == 2
    assert d.model.id == "Qwen/Qwen3-8B" and d.model.path == "/home/spark/.cache/huggingface/hub"
    # the worker's only fabric-like port is in another subnet: re-guessed into the head's, and said so
    assert str(d.nodes[1].fabric.address) == "192.168.100.11/24" and "not in the fabric subnet" in text
    assert d.nodes[1].ssh.jump == d.nodes[0].name and d.nodes[0].fabric.rdma_device == "rocep1s0f1"
    assert text.count("# GUESS:") >= 8


def test_discover_reserves_what_the_vllm_co_tenants_hold_from_their_own_command_lines():
    """The seed's head: GLM is another launcher's (stopped), the embeddings and the reranker run vLLM beside it.
    Each allowed vLLM co-tenant gets a reservation in the head's budget: its --gpu-memory-utilization x MemTotal
    (121.7 GiB here), rounded up to a GiB, or vLLM's default 0.92 when its command line names none; a container
    that runs no vLLM gets none."""
    from reconciler.edge.discover.guess import VLLM_DEFAULT_UTILIZATION
    head = facts_from(spark_addr_json(), ibdev=text_fixture("ibdev2netdev-spark.txt"))
    head.containers = [
        disc.RunningContainer("vllm_node", "vllm-node", ("vllm", "serve", "GLM", "--port", "8000")),
        disc.RunningContainer("vllm_embeddings", "vllm-node", ("vllm", "serve", "BAAI/bge-m3", "--port", "8001",
                                                                "--runner", "pooling", "--gpu-memory-utilization",
                                                                "0.05")),
        disc.RunningContainer("reranker", "nvcr.io/nvidia/vllm:26.05-py3", ("--model", "BAAI/bge-reranker-v2-m3")),
        disc.RunningContainer("grafana", "grafana/grafana", ())]
    worker = facts_from(json_fixture("ip-addr-testbed-worker.json"), host="10.231.1.11")
    text = disc.render([head, worker], user="spark", known_hosts="/etc/spark-reconciler/known_hosts",
                       identity=None, jump=True)
    d = spec.loads(text)
    total = 127600748 * 1024
    assert d.co_tenants.memory == {d.head.name: {
        "vllm_embeddings": -(-int(0.05 * total) // 2**30) * 2**30,
        "reranker": -(-int(VLLM_DEFAULT_UTILIZATION * total) // 2**30) * 2**30}}
    assert d.co_tenants.reserved(d.head.name)["vllm_embeddings"] == 7 * 2**30
    assert "vllm_node" not in d.co_tenants.allowed[d.head.name] and "grafana" in d.co_tenants.allowed[d.head.name]
    assert "--gpu-memory-utilization 0.05 x MemTotal 121.7 GiB" in text and "vLLM's default 0.92" in text


def test_secrets_are_exported_as_secret_key_refs_never_as_values(cluster_yaml):
    """issue 16: the token used to reach `export --format lws` in plain text. Only the node that gets a secret
    references it (VLLM_API_KEY: the leader), and the value is nowhere in the output."""
    text = cluster_yaml.read_text().replace("    VLLM_API_KEY: head", "    VLLM_API_KEY: head\n    HF_TOKEN: serving")
    desired = spec.loads(text).with_secrets({"VLLM_API_KEY": "sk-value-0123456789", "HF_TOKEN": "hf_value_abcdef"})
    out = lws_yaml(desired)
    assert "sk-value-0123456789" not in out and "hf_value_abcdef" not in out
    template = lws_manifest(desired)["spec"]["leaderWorkerTemplate"]
    env = {t: {e["name"]: e for e in template[t]["spec"]["containers"][0]["env"]}
           for t in ("leaderTemplate", "workerTemplate")}
    ref = {"valueFrom": {"secretKeyRef": {"name": "spark-reconciler-secrets", "key": "VLLM_API_KEY"}}}
    assert env["leaderTemplate"]["VLLM_API_KEY"] == {"name": "VLLM_API_KEY", **ref}
    assert "VLLM_API_KEY" not in env["workerTemplate"]
    assert env["workerTemplate"]["HF_TOKEN"]["valueFrom"]["secretKeyRef"]["key"] == "HF_TOKEN"


def _two_deployments(d: dict) -> None:
    """The testbed's model as `moe` across both nodes, and an embeddings deployment `embed` on the head."""
    moe = {"name": "moe", "model": d.pop("model"), "serving": d.pop("serving")}
    embed = json.loads(json.dumps(moe))
    embed["name"] = "embed"
    embed["serving"] |= {"container_name": "vllm_embed", "port": 8001, "nodes": ["head"], "tensor_parallel_size": 1,
                         "served_model_name": "bge-m3", "extra_args": ["--runner", "pooling"]}
    d["deployments"] = [moe, embed]


def test_every_deployment_is_its_own_leaderworkerset(schema):
    """One LWS per deployment, named by it, each fitting the CRD's fields, with its own size, port and argv."""
    d = variant(_two_deployments)
    docs = list(yaml.safe_load_all(lws_yaml(d)))
    assert [m["metadata"]["name"] for m in docs] == ["moe", "embed"]
    for m in docs:
        assert validate(schema, m) == [], m["metadata"]["name"]
    moe, embed = (m["spec"]["leaderWorkerTemplate"] for m in docs)
    assert (moe["size"], embed["size"]) == (2, 1)
    leader = embed["leaderTemplate"]["spec"]["containers"][0]
    assert leader["ports"][0]["containerPort"] == 8001 and "pooling" in leader["args"]
    assert docs[0] == lws_manifest(d.view("moe")) and docs[1] == lws_manifest(d.view("embed"))
    named = list(yaml.safe_load_all(lws_yaml(d, "spark")))
    assert [m["metadata"]["name"] for m in named] == ["spark-moe", "spark-embed"]


def test_a_file_of_the_single_form_keeps_its_served_name_and_a_named_one_takes_its_name():
    single = spec.loads(TESTBED.read_text())
    assert lws_manifest(single)["metadata"]["name"] == "tiny-moe"

    def named(d: dict) -> None:
        _two_deployments(d)
        d["deployments"].pop()
    assert lws_manifest(variant(named))["metadata"]["name"] == "moe"
    assert lws_manifest(variant(named))["spec"] == lws_manifest(single)["spec"]
