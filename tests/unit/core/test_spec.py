"""The desired-state model: every validation rule, the defaults, the derived views, and the invalid-file corpus."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import TypeAdapter, ValidationError

from reconciler.core import spec
from reconciler.core.spec import values

INVALID_DIR = Path(__file__).parents[1] / "invalid"
CORPUS = sorted(INVALID_DIR.glob("*.yaml"))
_EXPECT = re.compile(r"# expect: (\d+):(\d+): (.+)")
_FIELD_PATH = re.compile(r"[A-Za-z_][A-Za-z0-9_.\[\]*-]*")


def _expectation(path: Path) -> tuple[int, int, str, str]:
    """(line, col, field path or '', message substring) from the file's first line."""
    first = path.read_bytes().split(b"\n", 1)[0].decode("utf-8")
    match = _EXPECT.fullmatch(first.strip())
    assert match, f"{path.name}: first line must be '# expect: LINE:COL: [path: ]message', got {first!r}"
    line, col, rest = int(match[1]), int(match[2]), match[3]
    head, sep, tail = rest.partition(": ")
    if sep and _FIELD_PATH.fullmatch(head):
        return line, col, head, tail
    return line, col, "", rest


# ---------------------------------------------------------------------------------------------- the corpus


def test_corpus_is_large_enough():
    assert len(CORPUS) >= 30, [p.name for p in CORPUS]


@pytest.mark.parametrize("path", CORPUS, ids=lambda p: p.stem)
def test_invalid_corpus_file_reports_its_expected_problem(path: Path):
    line, col, field, substring = _expectation(path)
    with pytest.raises(spec.InvalidDesiredState) as info:
        spec.load(path)
    rendered = info.value.lines()
    prefix = f"{path}:{line}:{col}: " + (f"{field}: " if field else "")
    hits = [r for r in rendered if r.startswith(prefix) and substring in r[len(prefix):]]
    assert hits, f"expected a line starting {prefix!r} containing {substring!r}; got:\n" + "\n".join(rendered)
    # The path is exactly the field path (or none for file-level problems), not just a prefix of a longer one.
    exact = [p for p in info.value.problems
             if (p.position.line, p.position.column) == (line, col) and p.path == field and substring in p.message]
    assert exact, rendered


def _assert_reported(lines: list[str], wanted: list[tuple[str, str, str]]) -> None:
    for where, field, message in wanted:
        assert any(l.startswith(f"X:{where}: {field}: ") and message in l for l in lines), (where, field, lines)
    positions = [tuple(int(x) for x in l.split(":")[1:3]) for l in lines]
    assert positions == sorted(positions), "problems must be sorted by position"


def test_several_independent_field_errors_are_all_reported_at_once(edit, problems):
    text = edit(
        ("port: 8000", "port: 70000"),
        ("gpu_memory_utilization: 0.8", "gpu_memory_utilization: 0"),
        ("id: Qwen/Qwen3.5-122B-A10B-FP8", "id: ../x"),
        ("image: nvcr.io/nvidia/vllm:26.05-py3", "image: \"nvcr.io/nvidia/vllm;rm -rf /\""),
        ("resync_interval: 30s", "resync_interval: 30"),
        ("listen: 127.0.0.1:9464", "listen: junk"),
        ("  unlisted: stop\n", "  unlisted: stop\n  colour: blue\n"),
        ("interface: enp1s0f1np1", "interface: enp1s0f1np1abcdefgh"),
    )
    lines = problems(text)
    _assert_reported(lines, [
        ("7:18", "nodes[0].fabric.interface", "longer than 15 characters"),
        ("21:7", "model.id", "is not a valid model id"),
        ("24:10", "serving.image", "is not a valid image reference"),
        ("26:9", "serving.port", "less than or equal to 65535"),
        ("27:27", "serving.gpu_memory_utilization", "greater than 0"),
        ("35:3", "co_tenants.colour", "unknown field"),
        ("37:20", "policy.resync_interval", "is not a duration"),
        ("38:11", "policy.listen", "is not a valid HOST:PORT"),
    ])
    assert len(lines) == 8, lines


def test_several_independent_cross_field_errors_are_all_reported_at_once(edit, problems):
    text = edit(
        ("    role: worker", "    role: head"),
        ("jump: head-a", "jump: ghost-node"),
        ("address: 192.168.200.13/24", "address: 10.9.9.9/24"),
        ("  path: /home", "  source: nobody\n  path: /home"),
        ("  port: 8000", "  port: 8000\n  ray_port: 8000"),
        ("[vllm_embeddings, reranker]", "[vllm_serving]"),
    )
    lines = problems(text)
    _assert_reported(lines, [
        ("11:11", "nodes[1].role", "exactly one node must have role head (found 2)"),
        ("14:13", "nodes[1].ssh.jump", "'ghost-node' is not a node"),
        ("18:16", "nodes[1].fabric.address", "is not in the fabric subnet"),
        ("22:11", "model.source", "weights source 'nobody' is not a node"),
        ("28:13", "serving.ray_port", "port 8000 is also serving.port"),
        ("35:14", "co_tenants.allowed.head-a[0]", "matches the managed serving container"),
    ])


def test_field_errors_do_not_hide_cross_field_errors(edit, problems):
    """Every error at once: the cross-field rules once lived in a pydantic `mode="after"` model validator, which
    never runs when any field failed, so two heads went unreported next to a typo in policy."""
    lines = problems(edit(("    role: worker", "    role: head"), ("resync_interval: 30s", "resync_interval: 30")))
    _assert_reported(lines, [
        ("11:11", "nodes[1].role", "exactly one node must have role head (found 2)"),
        ("36:20", "policy.resync_interval", "is not a duration"),
    ])


# ---------------------------------------------------------------------------------------------- the seed file


def test_cluster_yaml_validates_and_matches_the_seed(cluster_yaml):
    d = spec.load(cluster_yaml)
    assert [n.name for n in d.nodes] == ["spark-1a32", "spark-5be3"]
    head, worker = d.nodes
    assert d.head is head and head.role == "head" and worker.role == "worker"
    assert head.ssh.host == "10.1.230.180"
    assert str(head.fabric.address) == "192.168.200.12/24"
    assert head.internet is True
    assert str(worker.fabric.address) == "192.168.200.13/24"
    assert worker.internet is False
    assert worker.ssh.jump == "spark-1a32"
    assert head.ssh.jump is None
    assert head.fabric.interface == worker.fabric.interface == "enp1s0f1np1"
    assert head.fabric.rdma_device == worker.fabric.rdma_device == "rocep1s0f1"
    assert head.fabric.mtu == worker.fabric.mtu == 9000
    assert d.model.id == "Qwen/Qwen3.5-122B-A10B-FP8"
    assert d.source_node == "spark-1a32"
    assert d.serving.engine == "vllm"
    assert d.serving.tensor_parallel_size == 2 and d.serving.pipeline_parallel_size == 1
    assert [n.name for n in d.serving_nodes] == ["spark-1a32", "spark-5be3"]
    assert d.co_tenants.is_allowed("spark-1a32", "vllm_embeddings")
    assert d.co_tenants.is_allowed("spark-1a32", "reranker")
    assert not d.co_tenants.is_allowed("spark-1a32", "vllm_node")  # the GLM-4.7-Flash container
    assert not d.co_tenants.is_protected("spark-1a32", "vllm_node")
    assert d.co_tenants.unlisted == "stop"
    assert d.policy.mode == "enforce" and not d.policy.paused
    assert d.policy.listen.startswith("127.0.0.1:")


def test_cluster_yaml_round_trips_through_model_dump(cluster_yaml):
    d = spec.load(cluster_yaml)
    again = spec.Desired.model_validate(d.model_dump(mode="json"))
    assert again == d
    assert spec.Desired.model_validate(d.model_dump()) == d


def test_base_used_by_the_tests_is_valid(problems, base_yaml):
    assert problems(base_yaml) == []


# ---------------------------------------------------------------------------------------------- every rule


RULES = [
    # (name, substitutions, rendered prefix "LINE:COL: path", message substring)
    ("two heads", [("    role: worker", "    role: head")], "11:11: nodes[1].role", "(found 2)"),
    ("no head", [("    role: head", "    role: worker")], "2:3: nodes", "(found 0)"),
    ("duplicate names", [("name: worker-b", "name: head-a"), ("      jump: head-a\n", "")], "10:11: nodes[1].name",
     "duplicate node name 'head-a'"),
    ("jump unknown", [("jump: head-a", "jump: nobody")], "14:13: nodes[1].ssh.jump", "'nobody' is not a node"),
    ("jump self", [("jump: head-a", "jump: worker-b")], "14:13: nodes[1].ssh.jump", "its own jump host"),
    ("jump cycle", [("      host: 10.0.0.1\n", "      host: 10.0.0.1\n      jump: worker-b\n")],
     "6:13: nodes[0].ssh.jump", "cycle"),
    ("tp > gpus", [("tensor_parallel_size: 2", "tensor_parallel_size: 8")], "25:25: serving.tensor_parallel_size",
     "exceeds the cluster's 2 GPUs"),
    ("tp x pp > gpus", [("  port: 8000", "  pipeline_parallel_size: 2\n  port: 8000")],
     "25:25: serving.tensor_parallel_size", "= 4 exceeds"),
    ("tp not whole nodes", [("    role: head\n", "    role: head\n    gpus: 2\n"),
                            ("    internet: false\n", "    internet: false\n    gpus: 2\n"),
                            ("tensor_parallel_size: 2", "tensor_parallel_size: 3")],
     "27:25: serving.tensor_parallel_size", "whole nodes"),
    ("tp vs explicit nodes", [("  tensor_parallel_size: 2", "  nodes: [head-a]\n  tensor_parallel_size: 2")],
     "26:25: serving.tensor_parallel_size", "the serving nodes have 1 GPUs"),
    ("serving node twice", [("  tensor_parallel_size: 2", "  nodes: [head-a, head-a]\n  tensor_parallel_size: 1")],
     "25:19: serving.nodes[1]", "listed twice"),
    ("weights source", [("  path: /home", "  source: nobody\n  path: /home")], "22:11: model.source",
     "weights source 'nobody' is not a node"),
    ("model path key", [("  path: /home/spark/.cache/huggingface/hub",
                         "  path: {head-a: /d/a, worker-b: /d/b, nobody: /d/c}")], "model.path.nobody",
     "'nobody' is not a node"),
    ("model path for source", [("  path: /home/spark/.cache/huggingface/hub",
                                "  source: worker-b\n  path: {head-a: /d/a}")], "model.path",
     "no model path for"),
    ("subnet", [("address: 192.168.200.13/24", "address: 192.168.100.13/24")], "18:16: nodes[1].fabric.address",
     "not in the fabric subnet 192.168.200.0/24 of node 'head-a'"),
    ("subnet by prefix", [("address: 192.168.200.13/24", "address: 192.168.200.13/16")],
     "18:16: nodes[1].fabric.address", "not in the fabric subnet"),
    ("duplicate address", [("address: 192.168.200.13/24", "address: 192.168.200.12/24")],
     "18:16: nodes[1].fabric.address", "used by another node"),
    ("port > 65535", [("port: 8000", "port: 65536")], "26:9: serving.port", "less than or equal to 65535"),
    ("port 0", [("port: 8000", "port: 0")], "26:9: serving.port", "greater than or equal to 1"),
    ("port collision", [("  port: 8000", "  port: 8000\n  ray_port: 8000")], "27:13: serving.ray_port",
     "port 8000 is also serving.port"),
    ("gmu 0", [("gpu_memory_utilization: 0.8", "gpu_memory_utilization: 0")], "27:27: serving.gpu_memory_utilization",
     "greater than 0"),
    ("gmu > 1", [("gpu_memory_utilization: 0.8", "gpu_memory_utilization: 1.01")],
     "27:27: serving.gpu_memory_utilization", "less than or equal to 1"),
    ("container space", [("  port: 8000", "  port: 8000\n  container_name: a b")], "27:19: serving.container_name",
     "not a valid container name"),
    ("container semicolon", [("  port: 8000", "  port: 8000\n  container_name: a;b")],
     "27:19: serving.container_name", "not a valid container name"),
    ("interface long", [("interface: enp1s0f1np1", "interface: abcdefghijklmnop")],
     "7:18: nodes[0].fabric.interface", "longer than 15 characters"),
    ("interface slash", [("interface: enp1s0f1np1", "interface: a/b")], "7:18: nodes[0].fabric.interface",
     "not a valid interface name"),
    ("rdma", [("rdma_device: rocep1s0f1", "rdma_device: mlx5 0")], "8:20: nodes[0].fabric.rdma_device",
     "not a valid RDMA device name"),
    ("relative path", [("path: /home/spark/.cache/huggingface/hub", "path: hub")], "22:9: model.path",
     "not a valid absolute path"),
    ("dotdot path", [("path: /home/spark/.cache/huggingface/hub", "path: /home/..")], "22:9: model.path",
     "must not contain '..'"),
    ("identity dotdot", [("      host: 10.0.0.1\n", "      host: 10.0.0.1\n      identity_file: /root/../x\n")],
     "6:22: nodes[0].ssh.identity_file", "must not contain '..'"),
    ("env value newline", [("\"3600\"\n", "\"36\\n00\"\n")], "30:34: serving.env.VLLM_ENGINE_READY_TIMEOUT_S",
     "newlines are not allowed"),
    ("env value list", [("\"3600\"\n", "[1, 2]\n")], "30:34: serving.env.VLLM_ENGINE_READY_TIMEOUT_S",
     "must be a string"),
    ("model id ../x", [("id: Qwen/Qwen3.5-122B-A10B-FP8", "id: ../x")], "21:7: model.id", "not a valid model id"),
    ("model id no org", [("id: Qwen/Qwen3.5-122B-A10B-FP8", "id: Qwen3")], "21:7: model.id", "(ORG/NAME)"),
    ("model id three parts", [("id: Qwen/Qwen3.5-122B-A10B-FP8", "id: a/b/c")], "21:7: model.id",
     "not a valid model id"),
    ("revision", [("  path: /home", "  revision: main;x\n  path: /home")], "22:13: model.revision",
     "not a valid revision"),
    ("image upper", [("image: nvcr.io/nvidia/vllm:26.05-py3", "image: Nvcr.io/nvidia/vllm:1")], "24:10: serving.image",
     "not a valid image reference"),
    ("image spaces", [("image: nvcr.io/nvidia/vllm:26.05-py3", "image: nvcr.io/nvidia/vllm latest")],
     "24:10: serving.image", "not a valid image reference"),
    ("image rm", [("image: nvcr.io/nvidia/vllm:26.05-py3", "image: \"vllm;rm -rf /\"")], "24:10: serving.image",
     "not a valid image reference"),
    ("image subshell", [("image: nvcr.io/nvidia/vllm:26.05-py3", "image: \"vllm:$(id)\"")], "24:10: serving.image",
     "not a valid image reference"),
    ("duration 30", [("resync_interval: 30s", "resync_interval: 30")], "36:20: policy.resync_interval",
     "30 is not a duration"),
    ("duration words", [("resync_interval: 30s", "resync_interval: 5 minutes")], "36:20: policy.resync_interval",
     "'5 minutes' is not a duration"),
    ("duration bool", [("resync_interval: 30s", "resync_interval: yes")], "36:20: policy.resync_interval",
     "is not a duration"),
    ("nested duration", [("  resync_interval: 30s", "  resync_interval: 30s\n  timeouts: {step: 2 hours}")],
     "37:20: policy.timeouts.step", "is not a duration"),
    ("size", [("  resync_interval: 30s", "  resync_interval: 30s\n  memory_margin: lots")],
     "37:18: policy.memory_margin", "is not a size"),
    ("size negative", [("  resync_interval: 30s", "  resync_interval: 30s\n  memory_margin: -1")],
     "37:18: policy.memory_margin", "is not a size"),
    ("unknown top", [("policy:\n", "extra: 1\npolicy:\n")], "35:1: extra", "unknown field"),
    ("unknown nested", [("      host: 10.0.0.1\n", "      host: 10.0.0.1\n      password: hunter2\n")],
     "6:7: nodes[0].ssh.password", "unknown field (check the spelling"),
    ("wrong type", [("tensor_parallel_size: 2", "tensor_parallel_size: two")], "25:25: serving.tensor_parallel_size",
     "must be a valid integer"),
    ("wrong type bool", [("internet: false", "internet: [no]")], "19:15: nodes[1].internet", "must be a valid boolean"),
    ("missing", [("      host: 10.0.0.1\n", "      user: spark\n")], "4:5: nodes[0].ssh.host",
     "required field is missing"),
    ("missing image", [("  image: nvcr.io/nvidia/vllm:26.05-py3\n", "")], "23:1: serving.image",
     "required field is missing"),
    ("reserved flag =", [("[\"--enforce-eager\"]", "[\"--tensor-parallel-size=4\"]")],
     "28:16: serving.extra_args[0]", "--tensor-parallel-size is set by the reconciler"),
    ("reserved flag -tp", [("[\"--enforce-eager\"]", "[\"-tp\", \"4\"]")], "28:16: serving.extra_args[0]",
     "use serving.tensor_parallel_size"),
    ("extra arg control char", [("[\"--enforce-eager\"]", "[\"--x\\ty\"]")], "28:16: serving.extra_args[0]",
     "control characters"),
    ("co-tenant unknown node", [("    head-a: [vllm_embeddings, reranker]",
                                 "    head-a: [vllm_embeddings, reranker]\n    nobody: [x]")],
     "co_tenants.allowed.nobody", "'nobody' is not a node"),
    ("protected unknown node", [("  unlisted: stop", "  protected: {nobody: [x]}\n  unlisted: stop")],
     "co_tenants.protected.nobody", "'nobody' is not a node"),
    ("co-tenant matches serving", [("[vllm_embeddings, reranker]", "[vllm_serving]")],
     "33:14: co_tenants.allowed.head-a[0]", "matches the managed serving container 'vllm_serving'"),
    ("co-tenant glob ? matches serving", [("[vllm_embeddings, reranker]", "[\"vllm?serving\"]")],
     "33:14: co_tenants.allowed.head-a[0]", "matches the managed serving container"),
    ("co-tenant bad pattern", [("[vllm_embeddings, reranker]", "[\"a b\"]")], "33:14: co_tenants.allowed.head-a[0]",
     "not a valid container name or glob"),
    ("listen no port", [("listen: 127.0.0.1:9464", "listen: 127.0.0.1")], "37:11: policy.listen", "HOST:PORT"),
    ("listen hostname", [("listen: 127.0.0.1:9464", "listen: example.com:80")], "37:11: policy.listen", "HOST:PORT"),
    ("listen injection", [("listen: 127.0.0.1:9464", "listen: \"127.0.0.1:9464;id\"")], "37:11: policy.listen",
     "HOST:PORT"),
    ("mode", [("  resync_interval: 30s", "  resync_interval: 30s\n  mode: yolo")], "37:9: policy.mode",
     "must be 'enforce' or 'observe'"),
    ("launcher", [("  port: 8000", "  port: 8000\n  launcher: mpi")], "27:13: serving.launcher",
     "must be 'native' or 'ray'"),
    ("layout", [("  path: /home", "  layout: flat\n  path: /home")], "22:11: model.layout",
     "must be 'hf-cache' or 'plain'"),
    ("mtu", [("      address: 192.168.200.12/24\n", "      address: 192.168.200.12/24\n      mtu: 100\n")],
     "10:12: nodes[0].fabric.mtu", "greater than or equal to 576"),
    ("gpus 0", [("    role: head\n", "    role: head\n    gpus: 0\n")], "4:11: nodes[0].gpus",
     "greater than or equal to 1"),
    ("node name", [("name: worker-b", "name: worker_b")], "10:11: nodes[1].name", "not a valid node name"),
    ("ssh host", [("host: 10.0.0.1", "host: \"10.0.0.1 -oProxyCommand=x\"")], "5:13: nodes[0].ssh.host",
     "not a valid host name or address"),
    ("empty nodes", [], "nodes", "at least 1 item"),
]


@pytest.mark.parametrize("name,subs,where,message", RULES, ids=[r[0] for r in RULES])
def test_rule(name, subs, where, message, edit, problems, base_yaml):
    text = edit(*subs) if subs else base_yaml.replace(base_yaml[:base_yaml.index("model:")], "nodes: []\n")
    lines = problems(text)
    if where[0].isdigit():  # LINE:COL: path
        hits = [l for l in lines if l.startswith(f"X:{where}: ") and message in l]
    else:  # path only (its position is tested elsewhere)
        hits = [l for l in lines if f": {where}: " in l and message in l]
    assert hits, "\n".join(lines)


def test_unknown_node_key_in_model_path_is_reported_at_the_key(edit, problems):
    """A problem about a mapping *key* is placed at the key, not at its value, which in block style is the next
    line (same for invalid env var names and co_tenants node keys: see the corpus)."""
    lines = problems(edit(("  path: /home/spark/.cache/huggingface/hub",
                           "  path:\n    head-a: /d/a\n    worker-b: /d/b\n    nobody:\n      /d/c")))
    assert any(l.startswith("X:25:5: model.path.nobody: ") for l in lines), lines


def test_port_collision_points_at_the_field_that_was_written(edit, problems):
    """`master_port: 8000` with the default port 8000 was once reported as serving.port and placed on the
    `serving:` line (serving.port is not in the file); it points at the master_port line the operator wrote."""
    lines = problems(edit(("  port: 8000\n", "  master_port: 8000\n")))
    assert any(l.startswith("X:26:16: serving.master_port: ") and "8000" in l for l in lines), lines


@pytest.mark.parametrize("listen", ["999.1.1.1:9464", "127.0.0.1:70000", "1.2.3:80", "[::1]:99999"])
def test_listen_rejects_impossible_addresses_and_ports(listen, edit, problems):
    """The HOST:PORT pattern once accepted any digits and dots and any 5-digit port."""
    lines = problems(edit(("listen: 127.0.0.1:9464", f"listen: \"{listen}\"")))
    assert any(l.startswith("X:37:11: policy.listen: ") for l in lines), lines


@pytest.mark.parametrize("flag", sorted(values._RESERVED_SERVE_FLAGS))
def test_every_reserved_serve_flag_is_refused_bare_and_with_value(flag):
    adapter = TypeAdapter(spec.ExtraArg)
    for arg in (flag, f"{flag}=1"):
        with pytest.raises(ValidationError, match="is set by the reconciler"):
            adapter.validate_python(arg)
    assert adapter.validate_python("--load-format") == "--load-format"
    assert adapter.validate_python("--enable-prefix-caching=true") == "--enable-prefix-caching=true"


# ---------------------------------------------------------------------------------------------- patterns


PATTERNS = {
    "ContainerName": (["vllm_serving", "a", "A.b-c_9", "x" * 128], ["", "a b", "a;b", "-a", "_a", "a/b", "x" * 129,
                                                                    "$(id)", "a\nb"]),
    "ContainerPattern": (["vllm_*", "*", "reranker?", "[ab]x", "x[!y]"], ["a b", "a;b", "$x", "`id`", "a/b", ""]),
    "InterfaceName": (["enp1s0f1np1", "eth0", "a" * 15, "br-lan.10"], ["a" * 16, "a/b", "a b", "", "-x", "a;b"]),
    "RdmaDevice": (["rocep1s0f1", "mlx5_0"], ["mlx5-0", "a b", "", "a/b", "../x"]),
    "AbsPath": (["/", "/home/spark", "/a/b/", "/x/.cache/y@z+1"], ["home", "./x", "/a/../b", "/..", "/a b", "/a;b",
                                                                     "/a//b", "~/x", "/$HOME"]),
    "EnvName": (["HF_HUB_OFFLINE", "_X", "a1"], ["1A", "A-B", "A B", "", "A=B"]),
    "ModelId": (["Qwen/Qwen3.5-122B-A10B-FP8", "a/b", "org/name_v1.0"], ["../x", "Qwen", "a/b/c", "/a", "a/", "a/..",
                                                                         ".a/b", "a b/c", "a/b;c"]),
    "ImageRef": (["nvcr.io/nvidia/vllm:26.05-py3", "vllm/vllm-openai:latest", "localhost:5000/a/b:t", "ubuntu",
                  "a@sha256:" + "0" * 64], ["NVCR.io/x", "a b", "a;rm -rf /", "a:$(id)", "", "a:", "a@sha256:xyz",
                                             "x" * 256]),
    "SshUser": (["spark", "root", "_svc"], ["Spark", "a b", "a;b", "-x", ""]),
    "HostName": (["10.1.230.180", "spark-1a32.local", "fe80::1"], ["a b", "-oProxyCommand=x", "a;b", "", "a_b"]),
    "NodeName": (["spark-1a32", "a", "n1"], ["Spark", "a_b", "-a", "a-", "a.b", ""]),
}


@pytest.mark.parametrize("type_name", sorted(PATTERNS))
def test_safe_patterns(type_name):
    adapter = TypeAdapter(getattr(spec, type_name))
    good, bad = PATTERNS[type_name]
    for value in good:
        assert adapter.validate_python(value) == value, value
    for value in bad:
        with pytest.raises(ValidationError):
            adapter.validate_python(value)
            pytest.fail(f"{type_name} accepted {value!r}")


def test_env_values_coerce_scalars_and_refuse_control_characters():
    adapter = TypeAdapter(spec.EnvValue)
    assert adapter.validate_python(True) == "1"
    assert adapter.validate_python(False) == "0"
    assert adapter.validate_python(3600) == "3600"
    assert adapter.validate_python("a b=c") == "a b=c"
    for bad in ("a\nb", "a\rb", "a\x00b", "a\x7fb", "\tx"):
        with pytest.raises(ValidationError, match="control characters"):
            adapter.validate_python(bad)


# ---------------------------------------------------------------------------------------------- durations, sizes


@pytest.mark.parametrize("text,seconds", [("30s", 30), ("5m", 300), ("1h30m", 5400), ("250ms", 0.25), ("1d", 86400),
                                          ("2h", 7200), ("1m30s", 90)])
def test_durations_parse_and_round_trip_through_model_dump(text, seconds):
    timeouts = spec.Timeouts(stop_grace=text)
    assert timeouts.stop_grace == pytest.approx(seconds)
    dumped = timeouts.model_dump()["stop_grace"]
    assert dumped == text
    assert timeouts.model_dump(mode="json")["stop_grace"] == text
    assert spec.Timeouts(stop_grace=dumped) == timeouts


@pytest.mark.parametrize("text", ["1500ms", "2s500ms", "1m250ms"])
def test_durations_with_milliseconds_above_a_second_round_trip(text):
    """format_duration once dropped the sub-second part of values >= 1 s ("1500ms" dumped as "1s")."""
    policy = spec.Policy(resync_interval=text)
    again = spec.Policy.model_validate(policy.model_dump(mode="json"))
    assert again.resync_interval == pytest.approx(policy.resync_interval)


@given(st.integers(min_value=0, max_value=10**10))
def test_every_duration_is_shown_in_a_form_that_parses_back(millis):
    """What `schema`, `plan` and the dumped file show for a duration reads back as the same value, zero too."""
    shown = spec.format_duration(millis / 1000)
    assert spec.parse_duration(shown) == pytest.approx(millis / 1000)
    assert shown == "0s" if millis == 0 else not shown.startswith("0")


@pytest.mark.parametrize("bad", [30, "30", "5 minutes", "", "s", "1.5s", "-5s", "5M", True, None, "30 s"])
def test_bad_durations_are_refused(bad):
    with pytest.raises(ValueError, match="is not a duration"):
        spec.parse_duration(bad)


@pytest.mark.parametrize("text,size", [("4GiB", 4 * 2**30), ("500MB", 500 * 10**6), (1048576, 1048576),
                                       ("1048576", 1048576), ("1.5GiB", int(1.5 * 2**30)), ("2 MiB", 2 * 2**20),
                                       ("10B", 10), ("1TB", 10**12), (0, 0)])
def test_sizes(text, size):
    assert spec.parse_size(text) == size
    assert spec.Policy(memory_margin=text).memory_margin == size


@pytest.mark.parametrize("bad", ["4 gigs", "-1", -1, "4gib", True, 1.5, "GiB", ""])
def test_bad_sizes_are_refused(bad):
    with pytest.raises(ValueError, match="is not a size"):
        spec.parse_size(bad)


def test_duration_json_schema_is_a_string_pattern():
    schema = spec.Desired.model_json_schema(mode="validation")
    policy = schema["$defs"]["Policy"]["properties"]["resync_interval"]
    assert policy.get("type") == "string" and "ms|s|m|h|d" in policy.get("pattern", "")


# ---------------------------------------------------------------------------------------------- defaults


def test_defaults(base_yaml):
    d = spec.loads(base_yaml)
    head, worker = d.nodes
    assert head.gpus == worker.gpus == 1
    assert head.internet is True and worker.internet is False
    assert head.ssh.user == "spark" and head.ssh.port == 22 and head.ssh.jump is None
    assert head.ssh.known_hosts == "/etc/spark-reconciler/known_hosts"
    assert head.ssh.connect_timeout == 10
    assert head.fabric.mtu == 9000
    assert d.model.revision == "main" and d.model.layout == "hf-cache" and d.model.source is None
    s = d.serving
    assert (s.engine, s.launcher, s.container_name) == ("vllm", "native", "vllm_serving")
    assert (s.port, s.master_port, s.ray_port) == (8000, 29501, 6379)
    assert s.pipeline_parallel_size == 1 and s.nodes is None
    assert s.gpu_memory_utilization == 0.8 and s.max_model_len is None and s.served_model_name is None
    assert s.docker.gpus == "all" and s.docker.ipc == "host" and s.docker.privileged is False
    assert s.health_timeout == 3600
    assert d.co_tenants.protected == {} and d.co_tenants.unlisted == "stop"
    p = d.policy
    assert p.mode == "enforce" and p.paused is False and p.resync_interval == 30
    assert p.listen == "127.0.0.1:9464"
    assert p.memory_margin == 6 * 2**30 and p.drop_caches is True
    assert p.timeouts.step == 120 and p.timeouts.stop_grace == 30
    assert p.retries.attempts == 3 and p.retries.hold_after == 5
    assert p.weights.bandwidth_limit is None


def test_minimal_single_node_file_takes_all_defaults():
    d = spec.loads("nodes:\n"
                   "  - {name: solo, role: head, ssh: {host: h}, fabric: {interface: e0, address: 10.0.0.1/24}}\n"
                   "model: {id: a/b, path: /d/m}\nserving: {image: vllm}\n...\n")
    assert d.head.name == "solo" and [n.name for n in d.serving_nodes] == ["solo"]
    assert d.source_node == "solo" and d.policy.listen.startswith("127.0.0.1:")


# ---------------------------------------------------------------------------------------------- derived views


def test_serving_nodes_put_the_head_first_whatever_the_file_order(edit):
    text = edit(("  - name: head-a\n    role: head", "  - name: head-a\n    role: worker"),
                ("  - name: worker-b\n    role: worker", "  - name: worker-b\n    role: head"),
                ("      jump: head-a\n", ""))
    d = spec.loads(text)
    assert d.head.name == "worker-b"
    assert [n.name for n in d.serving_nodes] == ["worker-b", "head-a"]
    assert d.source_node == "worker-b"


def test_serving_nodes_explicit_list_is_reordered_head_first(edit):
    d = spec.loads(edit(("  tensor_parallel_size: 2", "  nodes: [worker-b, head-a]\n  tensor_parallel_size: 2")))
    assert [n.name for n in d.serving_nodes] == ["head-a", "worker-b"]


def test_serving_nodes_take_only_as_many_nodes_as_needed(edit):
    d = spec.loads(edit(("tensor_parallel_size: 2", "tensor_parallel_size: 1")))
    assert [n.name for n in d.serving_nodes] == ["head-a"]


def test_three_nodes_serving_span_follows_file_order_of_workers():
    nodes = "".join(
        f"  - {{name: n{i}, role: {'head' if i == 0 else 'worker'}, ssh: {{host: h{i}}}, "
        f"fabric: {{interface: e0, address: 10.0.0.{i + 1}/24}}}}\n" for i in range(3))
    d = spec.loads(f"nodes:\n{nodes}model: {{id: a/b, path: /d/m}}\n"
                   "serving: {image: vllm, tensor_parallel_size: 2}\n...\n")
    assert [n.name for n in d.serving_nodes] == ["n0", "n1"]


def test_path_on_single_path_and_per_node_mapping(edit):
    d = spec.loads(edit())
    assert d.model.path_on("head-a") == d.model.path_on("worker-b") == "/home/spark/.cache/huggingface/hub"
    d = spec.loads(edit(("  path: /home/spark/.cache/huggingface/hub", "  path: {head-a: /d/a, worker-b: /d/b}")))
    assert d.model.path_on("head-a") == "/d/a" and d.model.path_on("worker-b") == "/d/b"


def test_co_tenant_globs_per_node_and_star(edit):
    d = spec.loads(edit(("    head-a: [vllm_embeddings, reranker]",
                         "    head-a: [\"embed-*\", \"rerank[0-9]\"]\n    \"*\": [\"monitor?\"]"),
                        ("  unlisted: stop", "  protected:\n    worker-b: [\"db*\"]\n    \"*\": [node-exporter]\n"
                                             "  unlisted: report")))
    ct = d.co_tenants
    assert ct.is_allowed("head-a", "embed-small") and ct.is_allowed("head-a", "rerank7")
    assert not ct.is_allowed("head-a", "rerank10")
    assert not ct.is_allowed("worker-b", "embed-small")  # node-specific
    assert ct.is_allowed("worker-b", "monitor1") and ct.is_allowed("head-a", "monitor2")  # `*` applies everywhere
    assert not ct.is_allowed("head-a", "Monitor1")  # case-sensitive
    assert ct.is_protected("worker-b", "db-main") and not ct.is_protected("head-a", "db-main")
    assert ct.is_protected("head-a", "node-exporter") and ct.is_protected("worker-b", "node-exporter")
    assert not ct.is_allowed("head-a", "vllm_serving") and not ct.is_protected("head-a", "vllm_serving")
    assert ct.unlisted == "report"


# ---------------------------------------------------------------------------------------------- model config


def test_models_are_frozen(cluster_yaml):
    d = spec.load(cluster_yaml)
    with pytest.raises(ValidationError, match="frozen"):
        d.serving.port = 9000
    with pytest.raises(ValidationError, match="frozen"):
        d.nodes[0].name = "other"
    with pytest.raises(ValidationError, match="frozen"):
        d.policy = spec.Policy()
    assert d.serving.port == 8000


@pytest.mark.parametrize("model", [spec.Desired, spec.Node, spec.Ssh, spec.Fabric, spec.Model, spec.Serving,
                                   spec.DockerOptions, spec.CoTenants, spec.Policy, spec.Timeouts, spec.Retries,
                                   spec.WeightsPolicy])
def test_every_model_is_frozen_and_forbids_extra_fields(model):
    assert model.model_config.get("frozen") is True
    assert model.model_config.get("extra") == "forbid"


def test_extra_field_raises_on_construction():
    with pytest.raises(ValidationError, match="extra_forbidden|Extra inputs"):
        spec.Timeouts(step="1s", stpe="2s")


def test_consistency_problems_returns_all_problems_with_paths(edit):
    d = spec.loads(edit())
    assert spec.consistency_problems(d) == []


@pytest.mark.parametrize(("section", "field", "floor"), [
    ("policy", "resync_interval", "1s"), ("serving", "health_timeout", "10s"),
    ("serving", "unhealthy_grace", "10s"), ("retries", "backoff_initial", "100ms"),
    ("retries", "backoff_max", "100ms")])
def test_a_duration_at_its_documented_minimum_is_allowed_and_a_millisecond_less_is_not(section, field, floor):
    """The minimums docs/desired-state.md states: exactly the minimum is valid, anything below says why."""
    from tests.unit.strategies import desired_dict

    def with_value(value: str) -> dict:
        raw = desired_dict()
        at = raw.setdefault("policy", {}).setdefault("retries", {}) if section == "retries" else raw[section]
        at[field] = value
        return raw

    spec.Desired.model_validate(with_value(floor))
    below = spec.format_duration(spec.parse_duration(floor) - 0.001)
    with pytest.raises(ValidationError, match=f"{below} is below the minimum {floor}: "):
        spec.Desired.model_validate(with_value(below))


def test_cross_field_problems_read_as_paths_and_messages():
    """What pydantic shows for a Desired built in code (not through the loader, which places each problem)."""
    err = spec.ConsistencyError([(("nodes", 1, "name"), "duplicate node name 'a'"),
                                 (("co_tenants", "allowed", "ghost", spec.KEY), "no such node")])
    assert str(err) == "nodes[1].name: duplicate node name 'a'; co_tenants.allowed.ghost: no such node"
    assert str(spec.MissingSecrets(["HF_TOKEN", "VLLM_API_KEY"])) == "HF_TOKEN, VLLM_API_KEY"


def test_a_rotated_secret_is_a_new_desired_state():
    """The daemon takes a new generation when the fingerprint changes: a key rotated by SIGHUP (same file, new
    value in the environment) must change it, the same value must not."""
    from tests.unit.strategies import desired_dict

    raw = desired_dict()
    raw["serving"]["secrets"] = {"VLLM_API_KEY": "serving"}
    base = spec.Desired.model_validate(raw)
    one = base.with_secrets({"VLLM_API_KEY": "sk-one-0123456789"})
    assert one.fingerprint() == base.with_secrets({"VLLM_API_KEY": "sk-one-0123456789"}).fingerprint()
    assert one.fingerprint() != base.with_secrets({"VLLM_API_KEY": "sk-two-0123456789"}).fingerprint()


def test_the_schema_carries_the_length_limits_the_validation_enforces():
    """`reconciler schema` (and editors using it) must refuse what the loader refuses: an interface name is at
    most 15 characters (the kernel's IFNAMSIZ - 1)."""
    port = spec.Desired.model_json_schema()["$defs"]["FabricPort"]["properties"]["interface"]
    assert port["maxLength"] == 15 and port["pattern"].startswith("^(?:")
