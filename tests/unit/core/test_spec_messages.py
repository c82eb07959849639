"""What `reconciler validate` prints for a broken file, whole: every line, its LINE:COL, its field path and its words.

The invalid-file corpus (`tests/unit/invalid/`) checks one expected problem per file by substring. These cases edit
the shipped sample (`desired-state/cluster.yaml`, the file users copy) and compare the complete output, so a
problem pointed at the wrong node, a rule that stops after the first node, a problem invented from a default the
user never wrote, or a valid value refused all fail. The expected lines are written from the sample's own text
(line numbers are those of the sample after the edit).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from reconciler.core import spec
from tests.unit.edits import edited

SAMPLE = (Path(__file__).parents[3] / "desired-state" / "cluster.yaml").read_text()
WORKER_TWIN = ("      twin:\n        interface: enP2p1s0f1np1\n        rdma_device: roceP2p1s0f1\n"
               "        address: 192.168.201.13/24\n")
LISTEN = "listen: 127.0.0.1:9464"


def validate(*edits: tuple[str, str]) -> list[str]:
    try:
        spec.loads(edited(SAMPLE, *edits), "X")
    except spec.InvalidDesiredState as exc:
        return exc.lines()
    return []


def test_the_sample_is_valid():
    assert validate() == []


# ------------------------------------------------------------------------------------------- the fabric twins


@pytest.mark.parametrize(("edits", "lines"), [
    pytest.param([(WORKER_TWIN, "")], [
        "X:38:5: nodes[1].fabric.twin: declare the fabric twin on every node or on none (NCCL pairs the devices "
        "across nodes)"], id="only-the-head-declares-one"),
    pytest.param([("interface: enP2p1s0f1np1    #", "interface: enp1s0f1np1    #")], [
        "X:23:20: nodes[0].fabric.twin.interface: enp1s0f1np1 is the fabric's first interface already"],
        id="same-netdev"),
    pytest.param([("address: 192.168.201.12/24", "address: 192.168.200.50/24")], [
        "X:25:18: nodes[0].fabric.twin.address: 192.168.200.50/24 is in the subnet of enp1s0f1np1; the twins need "
        "different subnets",
        "X:46:18: nodes[1].fabric.twin.address: 192.168.201.13/24 is not in the twins' subnet 192.168.200.0/24"],
        id="the-first-ports-subnet"),
    pytest.param([("address: 192.168.201.13/24", "address: 192.168.202.13/24")], [
        "X:46:18: nodes[1].fabric.twin.address: 192.168.202.13/24 is not in the twins' subnet 192.168.201.0/24"],
        id="another-twins-subnet"),
    pytest.param([("        rdma_device: roceP2p1s0f1\n        address: 192.168.201.13",
                   "        address: 192.168.201.13")], [
        "X:43:7: nodes[1].fabric.twin.rdma_device: an RDMA device on both twins or on neither"], id="rdma-on-one"),
    pytest.param([("        rdma_device: roceP2p1s0f1\n        address: 192.168.201.13",
                   "        rdma_device: rocep1s0f1\n        address: 192.168.201.13")], [
        "X:45:22: nodes[1].fabric.twin.rdma_device: rocep1s0f1 is the first port's RDMA device already"],
        id="rdma-twice"),
    pytest.param([("address: 192.168.201.13/24", "address: 192.168.201.12/24")], [
        "X:46:18: nodes[1].fabric.twin.address: 192.168.201.12 is used by 'spark-1a32' already"],
        id="address-twice"),
])
def test_every_twin_rule_points_at_the_twin_that_breaks_it(edits, lines):
    assert validate(*edits) == lines


# ------------------------------------------------------------------------------------------- policy.listen


@pytest.mark.parametrize("listen", ["127.0.0.1:1", "127.0.0.1:65535", "localhost:9464", "'[::1]:9464'",
                                    "0.0.0.0:9464"])
def test_listen_accepts_every_port_and_both_address_families(listen):
    assert validate((LISTEN, f"listen: {listen}")) == []


@pytest.mark.parametrize("listen", ["127.0.0.1:0", "127.0.0.1:65536", "::1:9464", "[::1:9464", "LOCALHOST:9464",
                                    "127.0.0.1", "127.0.0.1:http", "[127.0.0.1]x:9464"])
def test_listen_refuses_what_cannot_be_bound_and_says_how_to_write_it(listen):
    assert validate((LISTEN, f"listen: '{listen}'")) == [
        f"X:102:11: policy.listen: {listen!r} is not a valid HOST:PORT (an IP address or localhost, port 1-65535; "
        "IPv6 as [::1]:9464)"]


# ------------------------------------------------------------------------------------------- wrong types


def test_a_number_where_a_name_belongs_says_to_quote_it():
    assert validate(("container_name: vllm_serving", "container_name: 1234")) == [
        "X:60:19: serving.container_name: must be a string; quote the value (1234 was read as int)"]


def test_a_word_outside_a_choice_lists_the_choices():
    assert validate(("mode: enforce", "mode: enforced")) == ["X:97:9: policy.mode: must be 'enforce' or 'observe'"]


# ------------------------------------------------------------------------------------------- trust


VOLUMES = ("    ipc: host", "    ipc: host\n    volumes: [/data/x:/x:ro, /etc/ssl:/etc/ssl:ro, /home/spark/.ssh:/k]")


def test_a_volume_is_refused_under_the_system_in_a_key_directory_or_outside_the_trusted_paths():
    assert validate(VOLUMES) == [
        "X:83:15: serving.docker.volumes[0]: /data/x is not below a trusted host path: add its directory to "
        "trust.host_paths",
        "X:83:30: serving.docker.volumes[1]: /etc/ssl is under /etc: never mounted into a serving container",
        "X:83:52: serving.docker.volumes[2]: /home/spark/.ssh is a key directory: never mounted into a serving "
        "container"]


def test_a_volume_below_a_trusted_path_is_mounted_with_its_options():
    assert validate(("    ipc: host", "    ipc: host\n    volumes: [/data/x:/x:ro, /data:/d]"),
                    ("  remote_code: true", "  remote_code: true\n  host_paths: [/data]")) == []


def test_a_trusted_path_is_refused_under_the_system_and_in_a_key_directory():
    assert validate(("  remote_code: true", "  remote_code: true\n  host_paths: [/var/lib/docker/x, /root/.ssh]")) == [
        "X:87:16: trust.host_paths[0]: /var/lib/docker/x is under /var/lib/docker: never mounted",
        "X:87:35: trust.host_paths[1]: /root/.ssh is a key directory: never mounted"]


# ------------------------------------------------------------------------------------------- several at once


def test_a_field_error_does_not_hide_the_cross_field_problems_elsewhere():
    assert validate(("port: 8000", "port: 29501"), ("      host: 10.1.230.180", "      host: 10.1.230.180\n"
                                                                           "      port: 0")) == [
        "X:14:13: nodes[0].ssh.port: must be greater than or equal to 1",
        "X:64:9: serving.port: port 29501 is also serving.master_port",
        "X:65:16: serving.master_port: port 29501 is also serving.port"]


def test_no_problem_is_invented_from_the_default_of_a_broken_value():
    # serving.port is broken; its default (8000) would collide with master_port 8000, which the user never meant.
    # A problem in another section, found by a later rule, is still reported. (Every cross-field problem in the
    # broken value's own section waits: a rule cannot say which values it read.)
    assert validate(("port: 8000", "port: 99999"), ("master_port: 29501", "master_port: 8000"),
                    ("protected: {}", "protected: {spark-1a32: [vllm_*]}")) == [
        "X:63:9: serving.port: must be less than or equal to 65535",
        "X:93:28: co_tenants.protected.spark-1a32[0]: 'vllm_*' matches the managed serving container "
        "'vllm_serving'"]


def test_a_broken_list_item_holds_the_cross_field_rules_back_until_it_is_fixed():
    # An item cannot be dropped without renumbering the rest (and misplacing their problems), so the rules across
    # fields wait for the next validate: the collision of port and master_port is reported once the flag is gone.
    broken = ('extra_args: ["--load-format", "fastsafetensors"]', 'extra_args: ["--load-format", "--port=1"]')
    collision = ("master_port: 29501", "master_port: 8000")
    assert validate(broken, collision) == [
        "X:69:33: serving.extra_args[1]: --port is set by the reconciler; use serving.port instead"]
    assert validate(collision) == ["X:63:9: serving.port: port 8000 is also serving.master_port",
                                   "X:64:16: serving.master_port: port 8000 is also serving.port"]


# ------------------------------------------------------------------------------------------- what YAML allows


UNENDED = ("the file does not end with the line `...` (YAML's document end marker, required as the last line: a "
           "half-written save must never count as a desired state)")


@pytest.mark.parametrize(("edits", "lines"), [
    pytest.param([("port: 8000", "port: !!python/object 8000")], [
        "X:63:9: serving.port: YAML tag 'tag:yaml.org,2002:python/object' is not allowed in a desired state"],
        id="tagged-value"),
    pytest.param([("port: 8000", "!!python/name:os.system port: 8000")], [
        "X:63:3: serving: YAML tag 'tag:yaml.org,2002:python/name:os.system' is not allowed in a desired state"],
        id="tagged-key"),
    pytest.param([("port: 8000", "? [a, b]\n  : 1\n  port: 8000")], [
        "X:63:5: serving: mapping keys must be plain scalars"], id="sequence-as-key"),
    pytest.param([("  port: 8000", "  <<: {port: 8000}")], [
        "X:58:3: serving: merge keys (<<) are not supported; write the values out"], id="merge-key"),
    pytest.param([("env: {}", "env: " + "[" * 70 + "]" * 70)], [
        "X:73:71: serving.env" + "[0]" * 62 + ": nested deeper than 64 levels (a recursive alias?)"], id="too-deep"),
    # PyYAML's constructors raise ValueError/KeyError, not a YAMLError, for these: once a traceback, now placed
    pytest.param([("env: {}", "env: {X: !!int abc}")], ["X:73:12: serving.env.X: invalid value: 'abc' does not "
                                                         "read as !!int"], id="bad-int"),
    pytest.param([("env: {}", "env: {X: !!bool maybe}")], ["X:73:12: serving.env.X: invalid value: 'maybe' does "
                                                            "not read as !!bool"], id="bad-bool"),
    pytest.param([("env: {}", "env: {!!float x: 1}")], ["X:73:9: serving.env: invalid value: 'x' does not read as "
                                                         "!!float"], id="bad-float-key"),
    pytest.param([("...\n", "")], [f"X:102:1: {UNENDED}"], id="no-end-marker"),
    pytest.param([("...\n", "...\n# a comment after the marker\n\n")], [], id="comments-after-the-marker"),
])
def test_yaml_the_loader_refuses_is_placed_at_its_node(edits, lines):
    assert validate(*edits) == lines


def test_an_alias_bomb_is_stopped_at_the_budget():
    level = "a: &a [x, x, x, x, x, x, x, x, x, x]\n"
    for name, prev in zip("bcd", "abc", strict=True):
        level += f"{name}: &{name} [{', '.join([f'*{prev}'] * 10)}]\n"
    level += f"e: [{', '.join(['*d'] * 10)}]\n...\n"
    with pytest.raises(spec.InvalidDesiredState) as info:
        spec.loads(level, "X")
    assert info.value.lines() == ["X:1:32: e[0][6][8][8][8]: document expands to more than 20000 values "
                                  "(anchors/aliases used as a bomb?)"]


def test_an_empty_mapping_is_missing_its_sections_and_its_marker_at_the_first_line():
    with pytest.raises(spec.InvalidDesiredState) as info:
        spec.loads("{}\n", "X")
    assert info.value.lines() == ["X:1:1: nodes: required field is missing",
                                  "X:1:1: deployments: required field is missing: what the cluster serves "
                                  "(`deployments:`, or `model:` and `serving:` for one model)", f"X:1:1: {UNENDED}"]


# ------------------------------------------------------------------------------------------- each rule's words


HEAD_JUMPS = ("      host: 10.1.230.180            #", "      jump: spark-5be3\n      host: 10.1.230.180            #")
EXTRA_ARGS = 'extra_args: ["--load-format", "fastsafetensors"]'
VOLUMES_AT = ("    ipc: host", "    ipc: host\n    volumes: ")


@pytest.mark.parametrize(("edits", "lines"), [
    pytest.param([HEAD_JUMPS, ("      jump: spark-1a32 ", "      jump: nosuch     ")], [
        "X:36:13: nodes[1].ssh.jump: jump host 'nosuch' is not a node (known: spark-1a32, spark-5be3)"],
        id="a-chain-ending-nowhere"),
    pytest.param([("      host: 10.1.230.180            #", "      port: 0\n      jump: nosuch\n"
                   "      host: 10.1.230.180            #")], [
        "X:13:13: nodes[0].ssh.port: must be greater than or equal to 1"], id="beside-a-broken-value-waits"),
    pytest.param([("      host: 10.1.230.180            #", "      port: 0\n      host: 10.1.230.180            #"),
                  ("    spark-5be3: [vllm_embeddings]", "    spark-5be3: [vllm_embeddings]\n    spark-9999: [x]")], [
        "X:13:13: nodes[0].ssh.port: must be greater than or equal to 1",
        "X:94:5: co_tenants.allowed.spark-9999: 'spark-9999' is not a node"], id="a-key-elsewhere-despite"),
    pytest.param([("path: /home/spark/.cache/huggingface/hub", "path: /etc/models")], [
        "X:55:9: model.path: /etc/models is under /etc: not a data directory"], id="model-under-the-system"),
    pytest.param([("path: /home/spark/.cache/huggingface/hub", "path: /home/spark/.ssh/models")], [
        "X:55:9: model.path: /home/spark/.ssh/models is a key directory: not a data directory"], id="model-in-keys"),
    pytest.param([("master_port: 29501", "master_port: 8000\n  ray_port: 8000")], [
        "X:63:9: serving.port: port 8000 is also serving.master_port, serving.ray_port",
        "X:64:16: serving.master_port: port 8000 is also serving.port, serving.ray_port",
        "X:65:13: serving.ray_port: port 8000 is also serving.port, serving.master_port"], id="three-ports-one"),
    pytest.param([("env: {}", "env: {VLLM_HOST_IP: x, LD_PRELOAD: /x.so}")], [
        "X:73:9: serving.env.VLLM_HOST_IP: VLLM_HOST_IP is set by the reconciler from nodes[].fabric.address",
        "X:73:26: serving.env.LD_PRELOAD: LD_PRELOAD loads code into every process of the container; refused "
        "(docs/security.md)"], id="reserved-env"),
    pytest.param([(EXTRA_ARGS, 'extra_args: ["--chat-template={{ x }}", "--port-x=1"]')], [], id="spaces-are-fine"),
    pytest.param([(EXTRA_ARGS, 'extra_args: ["--x=\\x7f", "--port=1=2"]')], [
        "X:69:16: serving.extra_args[0]: '--x=\\x7f' contains control characters",
        "X:69:28: serving.extra_args[1]: --port is set by the reconciler; use serving.port instead"],
        id="delete-and-a-reserved-flag"),
    pytest.param([("  health_timeout: 1h", "  health_timeout: 1h\n  image_sources: [spark-1a32, nosuch]")], [
        "X:84:31: serving.image_sources[1]: 'nosuch' is not a node"], id="image-source-unknown"),
    pytest.param([("tensor_parallel_size: 2", "tensor_parallel_size: 1"), ("source: spark-1a32", "source: spark-5be3"),
                  ("path: /home/spark/.cache/huggingface/hub", "path: {spark-1a32: /home/spark/models}")],
                 ["X:55:9: model.path: no model path for the source node 'spark-5be3'"], id="no-path-for-the-source"),
    pytest.param([("env: {}", "env: {MY_SETTING: '1'}"), ("    VLLM_API_KEY: head", "    VLLM_API_KEY: head\n"
                                                                               "    MY_SETTING: head")], [
        "X:77:5: serving.secrets.MY_SETTING: MY_SETTING is also in serving.env"], id="a-secret-also-in-env"),
    pytest.param([(VOLUMES_AT[0], VOLUMES_AT[1] + "['/:/host', /home/spark/.gnupg/x:/g]")], [
        "X:83:15: serving.docker.volumes[0]: / is under /: never mounted into a serving container",
        "X:83:26: serving.docker.volumes[1]: /home/spark/.gnupg/x is a key directory: never mounted into a serving "
        "container"], id="root-and-gnupg"),
    pytest.param([(VOLUMES_AT[0], VOLUMES_AT[1] + "[/data/x/:/x, /X:/y]"),
                  ("  remote_code: true", "  remote_code: true\n  host_paths: [/data/, /X]")], [],
                 id="trailing-slashes-and-odd-names"),
    pytest.param([(VOLUMES_AT[0], VOLUMES_AT[1] + "[/data/z:/z]"),
                  ("  remote_code: true", "  remote_code: true\n  host_paths: [/X]")], [
        "X:83:15: serving.docker.volumes[0]: /data/z is not below a trusted host path: add its directory to "
        "trust.host_paths"], id="a-trusted-path-is-only-itself"),
    pytest.param([("devices: [/dev/infiniband]", "devices: [/dev/infiniband, /dev/foo]"),
                  ("  remote_code: true", "  remote_code: true\n  devices: ['/']")], [], id="every-device-trusted"),
    pytest.param([(LISTEN, "listen: '[::ffff:127.0.0.1]:9464'")], [], id="listen-v4-mapped-v6"),
])
def test_each_rule_says_where_and_what(edits, lines):
    assert validate(*edits) == lines


@pytest.mark.timeout(60)  # the deadline of a regression that loops: following jumps must end
def test_a_jump_chain_that_enters_a_loop_is_a_cycle_and_validation_ends():
    assert validate(HEAD_JUMPS, ("      jump: spark-1a32 ", "      jump: spark-5be3 ")) == [
        "X:13:13: nodes[0].ssh.jump: jump hosts form a cycle through 'spark-5be3'",
        "X:36:13: nodes[1].ssh.jump: a node cannot be its own jump host"]


def test_the_exception_reads_as_its_lines_and_a_nameless_text_is_called_string():
    with pytest.raises(spec.InvalidDesiredState) as info:
        spec.loads(SAMPLE.replace("mode: enforce", "mode: x").replace("port: 8000", "port: 0"))
    assert str(info.value) == "\n".join(info.value.lines())
    assert info.value.lines() == ["<string>:63:9: serving.port: must be greater than or equal to 1",
                                  "<string>:97:9: policy.mode: must be 'enforce' or 'observe'"]


# ----------------------------------------------------- a union field broken (issue 34: placing's swallowing except)

PATH = "  path: /home/spark/.cache/huggingface/hub"
TP3 = ("tensor_parallel_size: 2 ", "tensor_parallel_size: 3 ")
TP3_LINE = ("X:63:25: serving.tensor_parallel_size: tensor_parallel_size x pipeline_parallel_size = 3 exceeds the "
            "cluster's 2 GPUs")


@pytest.mark.parametrize(("value", "read"), [("5", "5 was read as int"), ("[/srv/a]", "['/srv/a'] was read as list")])
def test_a_value_that_fits_no_branch_of_a_union_is_reported(value, read):
    """`model.path` is a string or a mapping; a value that is neither once raised InvalidDesiredState with no
    line at all (every branch's "wrong type" was dropped as noise)."""
    assert validate((PATH, f"  path: {value}")) == [f"X:55:9: model.path: must be a string or a mapping ({read})"]


def test_a_broken_mapping_branch_keeps_the_cross_field_problems_and_no_noise():
    """A per-node path that is refused, and a cross-field problem elsewhere: both reported, and not the string
    branch's "must be a string". The re-check of the rules once walked into the path the string branch's error
    had dropped, and a broad `except (KeyError, IndexError, TypeError)` turned that into "no cross-field problem"."""
    per_node = "  path:\n    spark-1a32: /etc\n    spark-5be3: /home/spark/models"
    assert validate((PATH, per_node), TP3) == [
        "X:56:17: model.path.spark-1a32: /etc is under /etc: not a data directory", TP3_LINE]


def test_a_rule_that_fails_is_not_read_as_no_problem(monkeypatch):
    """The re-check of the rules over a broken file catches nothing: a rule that raises is a bug, and it shows."""
    from reconciler.core.spec import models

    def broken_rule(desired):
        raise TypeError("a bug in a rule")

    monkeypatch.setattr(models, "consistency_problems", broken_rule)
    with pytest.raises(TypeError, match="a bug in a rule"):
        validate(("port: 8000", "port: 99999"))
