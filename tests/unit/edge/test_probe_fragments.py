"""The probe's fragments and parsers where the first mutation run (docs/mutation-survivors-edge.md, issue 34) found
the tests silent.

Parsers are fed recorded node output: the converged 4-node testbed's probe (`fixtures/probe-4-nodes.json`), the
classic store's `docker image inspect` (`fixtures/docker-20.10-overlay2-image-inspect.json`), the recorded vLLM
cold-start log; a field changed where the case needs it, and the expectation written from the contract (the Docker
Engine API's field names, /proc/net/tcp's columns, df's output, the Hub's model-info answer), not from the parser.

A fragment sent to a node is judged one of two ways, and each test says which:

- **run for real**: the sealed script goes through this machine's `sh -s` (the node's shell, as `read_sections`
  hands it over), with the real `df`, `head`, `tail`, `cat`, `timeout` and /proc, a HOME of its own, and stand-ins
  for the tools that would reach docker or the network (`curl`, `docker`, `ip`). A stand-in logs the argv the
  shell really gave it (so quoting is the shell's, not ours) and answers only the exact argv the tool's contract
  names (the Docker CLI, the Engine API's `/images/NAME/json`, the Hub's `/api/models/ID/revision/REV`); any
  other argv gets no answer. `docker inspect --format` is rendered from a Docker inspect object as Docker renders
  `{{json .Field}}`, so a template naming a field docker has not, or no template, fails as it would on a node.
  The serving API's part needs its port held by root (the tests run as root, as CI does: docs/testing.md).
- **exact script**: where this machine cannot stand in for the node (the RDMA port's /sys/class/infiniband, which
  only the kernel's driver makes), the script is compared with the one the kernel's sysfs layout calls for.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from reconciler.core import spec
from reconciler.core.loader import load_file
from reconciler.core.observed import Container, EngineLoad, Link, RdmaPort, ServingApi
from reconciler.core.vllm_log import MAX_TEXT
from reconciler.edge.facts.base import ProbeError, Section, read_sections
from reconciler.edge.facts.containers import (
    DOCKER_SOCKET,
    LOG_TAIL_CHARS,
    container_fact,
    containers_script,
    log_tail_fact,
    parse_containers,
)
from reconciler.edge.facts.disk import avail_fact, disk_script, parse_avail, parse_disk
from reconciler.edge.facts.host import IDENTITY_MAX_BYTES, identity_script, parse_identity
from reconciler.edge.facts.images import image_fact, image_from_inspect, image_script, parse_image
from reconciler.edge.facts.links import link_script, links_fact, parse_link
from reconciler.edge.facts.ports import listening_ports, parse_listening
from reconciler.edge.facts.serving import (
    _sample,
    api_argv,
    api_fact,
    auth_header,
    parse_engine,
    ray_nodes_fact,
    serve_processes_fact,
    start_fact,
)
from reconciler.edge.facts.weights import HubSize, hub_size, hub_size_fact, parse_hub_size
from reconciler.edge.ssh import Result
from tests.unit.recorded import RAW, load, sections_of

FIXTURES = Path(__file__).parents[1] / "fixtures"
HEAD_OUTPUT = RAW["outputs"]["head"]
HEAD = sections_of(HEAD_OUTPUT)
API_LIST = json.loads(HEAD["containers"].body[4:])  # the head's GET /containers/json?all=1, recorded
CLASSIC = json.loads((FIXTURES / "docker-20.10-overlay2-image-inspect.json").read_text())[0]
RECORDED_IMAGE = json.loads(HEAD["image"].body[4:])  # the head's GET /images/vllm-standin:latest/json, recorded
COLD_START_LOG = (FIXTURES / "vllm-0.32.0-cpu-cold-start-eager-3-shards.log").read_text()


# -- a node on this machine: the real sh, stand-ins for docker, curl and ip ---------------------------------------

STAND_IN = r'''
import json, os, re, sys
tool, argv = os.path.basename(sys.argv[0]), sys.argv[1:]
stdin = sys.stdin.read() if "@-" in argv else None
with open(os.environ["CALLS"], "a") as log:
    log.write(json.dumps({"tool": tool, "argv": argv, "stdin": stdin}) + "\n")


def field(obj, path):
    for name in path.split("."):
        if not isinstance(obj, dict) or name not in obj:
            sys.exit(f"template: :1: executing \"\" at <.{path}>: can't evaluate field {name}")
        obj = obj[name]
    return obj


for answer in json.load(open(os.environ["ANSWERS"])):
    want = answer["argv"]
    if answer["tool"] != tool or len(want) != len(argv) or any(w not in ("{FORMAT}", a) for w, a in zip(want, argv)):
        continue
    out = answer.get("stdout", "")
    if "inspect" in answer:  # docker's --format: {{json .A.B}} of the inspect object, one line
        template = argv[want.index("{FORMAT}")]
        out = re.sub(r"\{\{json \.([\w.]+)\}\}", lambda m: json.dumps(field(answer["inspect"], m.group(1))),
                     template) + "\n"
    sys.stdout.write(out)
    sys.stderr.write(answer.get("stderr", ""))
    sys.exit(answer.get("rc", 0))
sys.stderr.write(tool + ": this stand-in answers no such command\n")
sys.exit(1)
'''


class LocalNode:
    """A node on this machine (see the module doc): `run_script` as `Session.run_script` (the SSH hop left out)."""

    name = "local"

    def __init__(self, root: Path, cwd: str | None = None):
        self.bin = root / "bin"
        self.bin.mkdir()
        self.home = root / "home"
        self.home.mkdir()
        for tool in ("curl", "docker", "ip"):
            (self.bin / tool).write_text(f"#!{sys.executable}\n{STAND_IN}")
            (self.bin / tool).chmod(0o755)
        self.calls_file = root / "calls"
        self.answers_file = root / "answers.json"
        self.answers_file.write_text("[]")
        self.cwd = cwd

    def answer(self, *answers: dict) -> LocalNode:
        self.answers_file.write_text(json.dumps(list(answers)))
        return self

    def run_script(self, script: str, timeout: float, cancel: object = None) -> Result:
        env = {"PATH": f"{self.bin}:/usr/bin:/bin", "HOME": str(self.home), "CALLS": str(self.calls_file),
               "ANSWERS": str(self.answers_file)}
        p = subprocess.run(["sh", "-s"], input=script.encode(), capture_output=True, env=env, timeout=timeout,
                           cwd=self.cwd, check=False)
        return Result(p.stdout.decode("utf-8", "replace"), p.stderr.decode("utf-8", "replace"), p.returncode)

    def calls(self, tool: str | None = None) -> list[list[str]]:
        if not self.calls_file.exists():
            return []
        seen = [json.loads(line) for line in self.calls_file.read_text().splitlines()]
        return [[c["tool"], *c["argv"]] for c in seen if tool in (None, c["tool"])]

    def stdin_of(self, tool: str) -> list[str | None]:
        seen = [json.loads(line) for line in self.calls_file.read_text().splitlines()]
        return [c["stdin"] for c in seen if c["tool"] == tool]


@pytest.fixture
def node(tmp_path):
    return LocalNode(tmp_path)


def sections(node: LocalNode, lines: list[str]) -> dict[str, Section]:
    return read_sections(node, lines, timeout=60)


@pytest.fixture
def root_port():
    """A port this test's own process listens on, as root: the probe asks the API only where root alone listens."""
    with socket.create_server(("127.0.0.1", 0)) as held:
        yield held.getsockname()[1]


def container_inspect(entry: dict, started_at: str, exit_code: int) -> dict:
    """`docker inspect` of a container whose /containers/json entry is `entry`: the fields of the Engine API's
    ContainerInspectResponse that entry also has (Name, Id, Config.Image, Image, State, Config.Labels, Mounts)."""
    return {"Id": entry["Id"], "Name": entry["Names"][0], "Image": entry["ImageID"],
            "Config": {"Image": entry["Image"], "Labels": entry["Labels"], "Env": []},
            "State": {"Status": entry["State"], "Running": entry["State"] == "running", "StartedAt": started_at,
                      "ExitCode": exit_code},
            "Mounts": entry["Mounts"], "HostConfig": entry["HostConfig"]}


SERVING_ENTRY = next(e for e in API_LIST if e["Names"] == ["/vllm_serving"])
STARTED = "2026-12-06T03:00:06.412006712Z"
SERVING_MOUNTS = ["/home/spark/.cache/flashinfer", "/home/spark/.cache/vllm", "/home/spark/.tilelang",
                  "/home/spark/.triton", "/srv/spark-testbed/head/models/hub"]


# -- containers: the Engine API's list, and `docker inspect` ------------------------------------------------------


def _listed(*entries: dict) -> list[Container]:
    ok, error, found = parse_containers(Section("API " + json.dumps(list(entries)), 0))
    assert ok and error is None
    return found


def test_the_recorded_api_list_reads_names_images_mounts_and_the_creation_time():
    """Created 1796526006 is 2026-12-06T03:00:06Z (`date -u -d @1796526006`); only bind mounts are host paths."""
    serving = next(c for c in _listed(*API_LIST) if c.name == "vllm_serving")
    assert serving.image == "vllm-standin:latest"
    assert serving.image_id == "sha256:f14c9eb6b251489ab8c991d62e255b765b39fcdb3759c085e48bc4c97c83c3ad"
    assert serving.started_at == "2026-12-06T03:00:06Z"
    assert serving.mounts == SERVING_MOUNTS


@pytest.fixture
def far_east(monkeypatch):
    """This process's local time zone set to UTC+5:30: a creation time read in local time would show it."""
    monkeypatch.setenv("TZ", "Asia/Kolkata")
    time.tzset()
    yield
    monkeypatch.undo()
    time.tzset()


def test_the_creation_time_is_utc_whatever_the_reconcilers_time_zone(far_east):
    assert time.localtime(0).tm_gmtoff == 19800, "the zone took"
    assert _listed(SERVING_ENTRY)[0].started_at == "2026-12-06T03:00:06Z"


@pytest.mark.parametrize(("created", "started_at"), [
    (1, "1970-01-01T00:00:01Z"),  # the first second is a time
    (0, None),  # the Engine API's zero: not said
    (-5, None),
    (True, None),  # JSON true is no number of seconds
    ("1796526006", None),  # nor is a string
    (1796526006.5, None),
])
def test_a_creation_time_the_api_did_not_give_as_seconds_is_none(created, started_at):
    assert _listed({**SERVING_ENTRY, "Created": created})[0].started_at == started_at


def test_fields_the_api_left_out_read_as_empty():
    """The list's `Image`, `ImageID` and `Names` may be left out (omitempty); a name is read without its `/`,
    and only its `/`: a co-tenant named `XTTS` keeps its X."""
    bare = {k: v for k, v in SERVING_ENTRY.items() if k not in ("Names", "Image", "ImageID")}
    found = _listed(bare, {**SERVING_ENTRY, "Names": ["/XTTS"]})
    assert [(c.name, c.image, c.image_id) for c in found] == [
        ("", "", ""), ("XTTS", "vllm-standin:latest", SERVING_ENTRY["ImageID"])]


def test_a_volume_is_no_bind_mount_of_a_host_path():
    """A named volume's `Source` lives under docker's data root: retention must not take it for a weights tree."""
    volume = {"Type": "volume", "Name": "hf", "Source": "/var/lib/docker/volumes/hf/_data", "Destination": "/data",
              "Driver": "local", "Mode": "z", "RW": True, "Propagation": ""}
    tmpfs = {"Type": "tmpfs", "Source": "", "Destination": "/tmp", "Mode": "", "RW": True, "Propagation": ""}
    found = _listed({**SERVING_ENTRY, "Mounts": [*SERVING_ENTRY["Mounts"], volume, tmpfs]})
    assert found[0].mounts == SERVING_MOUNTS


def test_one_container_is_read_through_dockers_inspect_template(node):
    """Run for real: `docker inspect --type container --format TEMPLATE NAME`, the template rendered from the
    inspect object of the recorded serving container; the exit code travels with it."""
    inspect = container_inspect(SERVING_ENTRY, STARTED, 0)
    node.answer({"tool": "docker", "argv": ["inspect", "--type", "container", "--format", "{FORMAT}", "vllm_serving"],
                 "inspect": inspect})
    state = container_fact("vllm_serving").read(node, 60)
    assert state is not None and state.exit_code == 0
    assert (state.container.name, state.container.id, state.container.state) == (
        "vllm_serving", SERVING_ENTRY["Id"], "running")
    assert state.container.image == "vllm-standin:latest" and state.container.started_at == STARTED
    assert state.container.mounts == SERVING_MOUNTS
    assert state.container.labels["spark-reconciler.role"] == "head"


def test_the_cli_fallback_of_the_containers_list_renders_dockers_template(node):
    """Run for real: no engine socket (curl fails), so `docker ps -aq` then `docker inspect --format TEMPLATE
    IDS`: each container one JSON line of the template."""
    inspect = container_inspect(SERVING_ENTRY, STARTED, 0)
    node.answer({"tool": "docker", "argv": ["ps", "-aq", "--no-trunc"], "stdout": SERVING_ENTRY["Id"] + "\n"},
                {"tool": "docker", "argv": ["inspect", "--format", "{FORMAT}", SERVING_ENTRY["Id"]],
                 "inspect": inspect})
    ok, error, found = parse_containers(sections(node, containers_script())["containers"])
    assert (ok, error) == (True, None)
    assert [(c.name, c.state, c.started_at, c.mounts) for c in found] == [
        ("vllm_serving", "running", STARTED, SERVING_MOUNTS)]


# -- the serving image --------------------------------------------------------------------------------------------

def test_the_image_is_asked_of_the_engine_socket_first(node):
    """Run for real: the Engine API's `GET /images/NAME/json` on the socket answers; the CLI is not started."""
    node.answer({"tool": "curl", "argv": ["-sf", "--unix-socket", "/var/run/docker.sock",
                                          "http://docker/images/vllm-standin:latest/json"],
                 "stdout": json.dumps(RECORDED_IMAGE)})
    sec = sections(node, [DOCKER_SOCKET, *image_script("vllm-standin:latest")])["image"]
    assert sec.body.startswith("API ") and parse_image(sec).id == RECORDED_IMAGE["Id"]
    assert node.calls("docker") == []


def test_the_image_falls_back_to_the_docker_cli(node):
    """Run for real: no socket answer; `docker image inspect NAME` prints the array the CLI prints."""
    node.answer({"tool": "docker", "argv": ["image", "inspect", "vllm-standin:latest"],
                 "stdout": json.dumps([RECORDED_IMAGE], indent=4) + "\n"})
    sec = sections(node, [DOCKER_SOCKET, *image_script("vllm-standin:latest")])["image"]
    assert parse_image(sec) == image_from_inspect(RECORDED_IMAGE)
    assert not sec.body.startswith("API ")


def test_a_step_reads_one_image_by_its_reference(node):
    """Run for real: `docker image inspect REF`; an engine without that image says so (None)."""
    node.answer({"tool": "docker", "argv": ["image", "inspect", "vllm-standin:latest"],
                 "stdout": json.dumps([RECORDED_IMAGE], indent=4) + "\n"},
                {"tool": "docker", "argv": ["image", "inspect", "vllm-standin:old"], "stdout": "[]\n",
                 "stderr": "Error: No such image: vllm-standin:old\n", "rc": 1})
    assert image_fact("vllm-standin:latest").read(node, 60) == image_from_inspect(RECORDED_IMAGE)
    assert image_fact("vllm-standin:old").read(node, 60) is None


def test_an_inspect_object_without_a_string_id_is_refused():
    with pytest.raises(TypeError) as refused:
        image_from_inspect({**CLASSIC, "Id": 5})
    assert str(refused.value).startswith("not an image inspect object: \"{'Id': 5, 'RepoTags'")
    long = {"Id": None, "x": "a" * 200}
    with pytest.raises(TypeError) as refused:
        image_from_inspect(long)
    assert str(refused.value) == "not an image inspect object: \"{'Id': None, 'x': '" + "a" * 61 + '"', \
        "80 characters of the object, no more"


def test_an_entrypoint_that_is_no_list_of_strings_is_refused():
    odd = "/bin/" + "x" * 100
    with pytest.raises(TypeError) as refused:
        image_from_inspect({**CLASSIC, "Config": {**CLASSIC["Config"], "Entrypoint": odd}})
    assert str(refused.value) == f"not an image Entrypoint: {odd[:80]!r}"


def _without(doc: dict, *keys: str) -> dict:
    return {k: v for k, v in doc.items() if k not in keys}


@pytest.mark.parametrize("key", ["Os", "Architecture", "Variant"])
def test_a_platform_field_left_out_is_the_empty_one(key):
    """API 1.50 leaves empty fields out: the same image, with the field "" or absent, is one content."""
    empty = image_from_inspect({**CLASSIC, key: ""})
    assert image_from_inspect(_without(CLASSIC, key)).content == empty.content


def test_the_variant_is_part_of_the_content():
    arm = {**CLASSIC, "Architecture": "arm64"}
    assert image_from_inspect({**arm, "Variant": "v8"}).content != image_from_inspect(arm).content
    assert image_from_inspect({**arm, "Variant": "v8"}).platform == "linux/arm64/v8"


@pytest.mark.parametrize(("os_name", "arch"), [(None, "amd64"), ("linux", None)])
def test_a_platform_half_said_is_not_said(os_name, arch):
    doc = _without(CLASSIC, *[k for k, v in (("Os", os_name), ("Architecture", arch)) if v is None])
    assert image_from_inspect(doc).platform == ""


def test_the_store_is_the_graph_driver_or_containerd():
    """A snapshotter name, or a `Descriptor` (API 1.48+), is Docker's containerd image store; a graph driver that
    did not name itself is no store name."""
    descriptor = {"mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": "sha256:" + "ab" * 32,
                  "size": 1234}
    assert image_from_inspect({**CLASSIC, "GraphDriver": {"Name": "overlayfs", "Data": None}}).store == "containerd"
    assert image_from_inspect({**CLASSIC, "GraphDriver": {"Name": "nydus", "Data": None},
                               "Descriptor": descriptor}).store == "containerd"
    assert image_from_inspect({**CLASSIC, "GraphDriver": {"Data": None}}).store == ""
    assert image_from_inspect(_without(CLASSIC, "GraphDriver")).store == ""
    assert image_from_inspect(CLASSIC).store == "overlay2"


def test_repository_digests_are_kept_and_match_a_pin():
    pin = "sha256:" + "9f" * 32
    image = image_from_inspect({**CLASSIC, "RepoDigests": [f"nvcr.io/nvidia/vllm@{pin}", 7]})
    assert image.digests == [f"nvcr.io/nvidia/vllm@{pin}"] and image.matches_pin(pin)


@pytest.mark.parametrize(("size", "read"), [(0, 0), (41811973, 41811973), (-1, None), ("41811973", None),
                                             (None, None)])
def test_the_size_is_a_count_of_bytes_or_not_said(size, read):
    assert image_from_inspect({**CLASSIC, "Size": size}).size == read


# -- the fabric ports ---------------------------------------------------------------------------------------------

def test_the_declared_ports_are_read_with_ip_and_the_rdma_sysfs(node):
    """Run for real, on the recorded head: `ip -j addr show dev PORT` answers the recorded JSON for each port; this
    machine has no /sys/class/infiniband, so the RDMA port is not read (the testbed's veths have none either)."""
    desired = load()
    head = desired.node("head")
    ip = {name: HEAD[name].body for name in ("link", "link-twin")}
    node.answer({"tool": "ip", "argv": ["-j", "addr", "show", "dev", "enp1s0f1np1"], "stdout": ip["link"]},
                {"tool": "ip", "argv": ["-j", "addr", "show", "dev", "enP2p1s0f1np1"], "stdout": ip["link-twin"]})
    first, twin = links_fact(head).read(node, 60)
    assert first == Link(name="enp1s0f1np1", operstate="up", admin_up=True, carrier=True, mtu=9000,
                         addresses=["10.232.0.10/24"], rdma=None)
    assert twin == Link(name="enP2p1s0f1np1", operstate="up", admin_up=True, carrier=True, mtu=9000,
                        addresses=["10.232.1.10/24"], rdma=None)


def test_the_rdma_port_script_reads_the_kernels_sysfs_files(cluster_yaml):
    """Exact script: /sys/class/infiniband/DEV/ports/1/{state,phys_state}, the files drivers/infiniband/core/
    sysfs.c makes (fixtures/discover/rdma-sysfs-spark.txt holds what they print); state first, one line each; then
    the RoCE v2 entries of the port's GID table, `gid N VALUE` (tests/unit/edge/test_nccl_at_start.py runs it), the
    state's exit status kept as the section's."""
    head = spec.load(cluster_yaml).head
    rdma = [line for line in link_script(head) if "infiniband" in line]
    ports = [f"/sys/class/infiniband/{dev}/ports/1" for dev in ("rocep1s0f1", "roceP2p1s0f1")]
    gids = ("(cd {p}/gid_attrs/types 2>/dev/null && grep -lx 'RoCE v2' -- * 2>/dev/null | head -n 64 | while read -r "
            "i; do printf 'gid %s %s\\n' \"$i\" \"$(cat ../../gids/\"$i\" 2>/dev/null)\"; done)")
    assert rdma == [f"if [ -d {p} ]; then cat {p}/state {p}/phys_state; r=$?; {gids.format(p=p)}; rc $r; else rc 2; "
                    "fi" for p in ports]
    first = parse_link("enp1s0f1np1", HEAD["link"], Section("4: ACTIVE\n5: LinkUp", 0))
    assert first.rdma == RdmaPort(state="4: ACTIVE", phys_state="5: LinkUp")
    odd = parse_link("enp1s0f1np1", HEAD["link"], Section("4: ACTIVE\n5: LinkUp\ngid 3 not-a-gid\ngid x y", 0))
    assert odd.rdma == RdmaPort(state="4: ACTIVE", phys_state="5: LinkUp"), "a line that is not a GID is left out"


# -- listening ports ----------------------------------------------------------------------------------------------

def test_the_recorded_listen_rows_are_the_testbeds_ports():
    """ssh 22, the API 8000, the co-tenants 8001/8002, a loopback listener 9479, the master port 29501."""
    assert parse_listening(HEAD["listen"]) == [22, 8000, 8001, 8002, 9479, 29501]


def test_a_blank_line_between_rows_skips_only_itself():
    rows = HEAD["listen"].body.splitlines()
    assert listening_ports("\n".join([rows[0], "", "   ", *rows[1:]])) == {22, 8000, 8001, 8002, 9479, 29501}


def test_the_four_columns_a_listen_row_needs_are_enough():
    """`sl local rem st`: the state is the fourth column; the kernel's other columns are not read."""
    assert listening_ports("   0: 00000000:1F40 00000000:0000 0A") == {8000}
    assert listening_ports("   0: 00000000000000000000000000000000:1F40 00000000000000000000000000000000:0000 0A") \
        == {8000}


def test_a_row_not_in_listen_is_odd_output_named_in_80_characters():
    row = "   0: 00000000:1F40 00000000:0000 01 " + "0" * 100
    with pytest.raises(ProbeError) as odd:
        parse_listening(Section(row, 0))
    assert str(odd.value) == f"listen: ValueError: not a LISTEN row of /proc/net/tcp: {row[:80]!r}"


# -- the serving API ----------------------------------------------------------------------------------------------

def _with_port(desired: spec.Desired, port: int) -> spec.Desired:
    return desired.with_deployment(serving=desired.serving.model_copy(update={"port": port}))


ENGINE_PAGE = ("# HELP vllm:num_requests_running Number of requests in model execution batches.\n"
               "# TYPE vllm:num_requests_running gauge\n" + HEAD["engine"].body + "\n"
               'vllm:prompt_tokens_created{engine="0",model_name="tiny-moe"} 1.7965e9\n')


def _api_answers(port: int, served: str, header: list[str]) -> list[dict]:
    """The recorded head API's answers, each to the exact curl command line the probe's contract names."""
    base = f"http://127.0.0.1:{port}"
    body = '{"model": ' + f'"{served}", "prompt": "ping", "max_tokens": 1, "temperature": 0' + "}"
    models = HEAD["models"].body.replace('"tiny-moe"', json.dumps(served))
    return [
        {"tool": "curl", "argv": ["-s", "-o", "/dev/null", "-m", "2", "-w", "%{http_code}", f"{base}/health"],
         "stdout": "200"},
        {"tool": "curl", "argv": [*header, "-s", "-m", "2", f"{base}/v1/models"], "stdout": models},
        {"tool": "curl", "argv": [*header, "-s", "-m", "5", "-H", "Content-Type: application/json",
                                  "-w", "\\n%{http_code}", "-d", body, f"{base}/v1/completions"],
         "stdout": HEAD["completion"].body},
        {"tool": "curl", "argv": ["-s", "-m", "2", f"{base}/metrics"], "stdout": ENGINE_PAGE},
    ]


def test_the_api_is_asked_with_the_exact_curl_command_lines(node, root_port):
    """Run for real, the recorded head's answers: /health, then /v1/models (`-s`: no progress meter), one
    deterministic token of the served name (the OpenAI completions body), and /metrics; no API key, so no
    header is read from stdin."""
    desired = _with_port(load(), root_port)
    assert auth_header(desired) is None
    node.answer(*_api_answers(root_port, "tiny-moe", []))
    api = api_fact(desired).read(node, 60)
    assert api == ServingApi(reachable=True, healthy=True, models=["tiny-moe"], completion_error=None,
                             engine=EngineLoad(running=0, waiting=0, tokens=6))
    assert [c[1:] for c in node.calls("curl")] == [a["argv"] for a in _api_answers(root_port, "tiny-moe", [])]
    assert api_fact(desired).key == "api", "the name the step cases give its answer"


def test_with_an_api_key_the_v1_paths_read_the_header_from_stdin(node, root_port, cluster_yaml):
    """Run for real: `curl -H @-` and the header on stdin, for /v1/models and the completion only."""
    data = load_file(cluster_yaml).data
    data["serving"]["secrets"] = {"VLLM_API_KEY": "head"}
    desired = _with_port(spec.Desired.model_validate(data).with_secrets({"VLLM_API_KEY": "sk-test-1"}), root_port)
    served = desired.served_name
    answers = _api_answers(root_port, served, ["-H", "@-"])
    node.answer(*answers)
    api = api_fact(desired).read(node, 60)
    assert api.healthy and api.models == [served] and api.completion_error is None
    assert [c[1:] for c in node.calls("curl")] == [a["argv"] for a in answers]
    assert node.stdin_of("curl") == [None, "Authorization: Bearer sk-test-1\n", "Authorization: Bearer sk-test-1\n",
                                     None]


def test_the_api_fact_reads_the_engine_and_the_ports_owner():
    """The recorded head (root alone on the port): its engine counters; a user's socket on the port: named."""
    root_only = sections_of(HEAD_OUTPUT + "\n@@port_owner\n0 \n@@rc 0\n")
    assert api_fact(load()).parse(root_only).engine == EngineLoad(running=0, waiting=0, tokens=6)
    squatted = sections_of(HEAD_OUTPUT + "\n@@port_owner\n1000 \n@@rc 0\n")
    assert api_fact(load()).parse(squatted) == ServingApi(reachable=True, healthy=False, port_holder=1000)


def test_the_api_scripts_argv_has_no_key_header_without_a_key():
    assert api_argv(load(), "-s", "http://127.0.0.1:8000/v1/models") == [
        "curl", "-s", "http://127.0.0.1:8000/v1/models"]


@pytest.mark.parametrize(("line", "sample"), [
    ('vllm:num_requests_running{model_name="a{b"} 3.0', ("vllm:num_requests_running", 3.0)),  # a `{` in a label
    ('vllm:num_requests_running{model_name="a}b"} 3.0', ("vllm:num_requests_running", 3.0)),  # a `}` in a label
    ("vllm:num_requests_running{ 3.0", ("vllm:num_requests_running", None)),  # the labels never close
    ("", ("", None)),
    ("   ", ("", None)),
    ('vllm:num_requests_running{engine="0"} abc', ("vllm:num_requests_running", None)),
    ("vllm:num_requests_running abc", ("vllm:num_requests_running", None)),
])
def test_a_metrics_sample_is_its_name_and_a_finite_value_or_none(line, sample):
    """Prometheus' text format: a label value is any quoted string; the value follows the closing brace. A line
    with no value that counts gives None, never an error."""
    assert _sample(line) == sample


def test_odd_lines_among_the_recorded_counters_leave_them_read():
    body = "\n".join(["", 'vllm:num_requests_running{engine="0"} abc', HEAD["engine"].body, "   "])
    assert parse_engine(Section(body, 0)) == EngineLoad(running=0, waiting=0, tokens=6)


def test_ray_status_counts_the_active_nodes(node):
    """Run for real: `docker exec CONTAINER ray status` (its output as the testbed's Ray stand-in prints Ray's)."""
    status = ("======== Autoscaler status: 2026-12-06 03:00:10.000000 ========\nNode status\n" + "-" * 63 +
              "\nActive:\n 1 node_6b0e4c\n 1 node_91d2aa\nPending:\n (no pending nodes)\nRecent failures:\n"
              " (no failures)\n")
    node.answer({"tool": "docker", "argv": ["exec", "vllm_serving", "ray", "status"], "stdout": status})
    assert ray_nodes_fact("vllm_serving").read(node, 60) == 2


def test_ray_status_that_failed_or_was_not_asked_is_not_a_count():
    fact = ray_nodes_fact("vllm_serving")
    assert fact.parse({}) is None
    assert fact.parse({"ray": Section("Error response from daemon: container is not running", 1)}) is None


def test_the_serve_processes_are_counted_inside_the_container(node):
    """Run for real: `docker exec CONTAINER sh -c "ps -eo args | grep -c '[v]llm serve'"`."""
    node.answer({"tool": "docker", "argv": ["exec", "vllm_serving", "sh", "-c", "ps -eo args | grep -c '[v]llm serve'"],
                 "stdout": "1\n"})
    assert serve_processes_fact("vllm_serving").read(node, 60) == 1


# -- a start's log, and one poll of a cold start ------------------------------------------------------------------

def _docker_logs(tail: int) -> str:
    """`docker logs --tail N` of the recorded cold start: its last N lines."""
    return "".join(COLD_START_LOG.splitlines(keepends=True)[-tail:])


def test_a_failed_starts_log_tail_is_its_last_15_lines(node):
    """Run for real: `docker logs --tail 15 NAME | tail -c 1500`; the recorded log's last 15 lines fit."""
    node.answer({"tool": "docker", "argv": ["logs", "--tail", "15", "vllm_serving"], "stdout": _docker_logs(15)})
    assert log_tail_fact("vllm_serving").read(node, 60) == _docker_logs(15).strip()


def test_a_longer_log_tail_is_cut_to_its_last_1500_bytes_on_the_node(node):
    """Run for real: 40 lines of the recorded log are more than LOG_TAIL_CHARS bytes; `tail -c` cuts them on the
    node (bytes: a cut inside a UTF-8 character reads as U+FFFD), and a carriage return ends a line as any
    newline does when the output is split into sections."""
    node.answer({"tool": "docker", "argv": ["logs", "--tail", "40", "vllm_serving"], "stdout": _docker_logs(40)})
    cut = _docker_logs(40).encode()[-LOG_TAIL_CHARS:].decode("utf-8", "replace")
    assert len(_docker_logs(40).encode()) > LOG_TAIL_CHARS
    assert log_tail_fact("vllm_serving", 40).read(node, 60) == "\n".join(cut.splitlines()).strip()


def test_a_log_not_read_is_empty():
    assert log_tail_fact("vllm_serving").parse({}) == ""


def test_one_poll_of_a_cold_start_reads_the_container_the_api_and_the_log(node):
    """Run for real: the container's inspect, the API (nobody listens on the port here: unreachable, not asked)
    and the recorded cold start's log, whole (under MAX_TEXT bytes), as the node's shell split its lines."""
    desired = _with_port(load(), 9)
    node.answer({"tool": "docker", "argv": ["inspect", "--type", "container", "--format", "{FORMAT}", "vllm_serving"],
                 "inspect": container_inspect(SERVING_ENTRY, STARTED, 0)},
                {"tool": "docker", "argv": ["logs", "--tail", "200", "vllm_serving"], "stdout": COLD_START_LOG})
    seen = start_fact(desired, "vllm_serving").read(node, 60)
    assert seen.container is not None and seen.container.container.name == "vllm_serving"
    assert seen.api == ServingApi()
    assert len(COLD_START_LOG.encode()) < MAX_TEXT
    assert seen.log == "\n".join(COLD_START_LOG.splitlines()).strip("\n")
    assert node.calls("curl") == [["curl", "-s", "-o", "/dev/null", "-m", "2", "-w", "%{http_code}",
                                   "http://127.0.0.1:9/health"]], "only /health, its answer then dropped"


def test_a_poll_without_the_log_section_has_an_empty_log():
    inspected = {"name": "/vllm_serving", "id": SERVING_ENTRY["Id"], "image": "vllm-standin:latest",
                 "image_id": SERVING_ENTRY["ImageID"], "state": "running", "labels": None, "started_at": STARTED,
                 "mounts": [], "exit_code": 0}
    seen = start_fact(load(), "vllm_serving").parse(
        sections_of(HEAD_OUTPUT + f"\n@@container\n{json.dumps(inspected)}\n@@rc 0\n"))
    assert seen.container is not None and seen.api.healthy and seen.log == ""


# -- disk, the Hub's size -----------------------------------------------------------------------------------------

def test_df_reads_the_filesystem_of_the_path(tmp_path):
    """Run for real (the real df), from a working directory on another filesystem (/proc): the bytes free where
    the path is, as statvfs says."""
    node = LocalNode(tmp_path, cwd="/proc")
    free = avail_fact(str(tmp_path)).read(node, 60)
    assert free is not None and abs(free - os.statvfs(tmp_path).f_bavail * os.statvfs(tmp_path).f_frsize) < 1 << 28


def test_the_disk_section_reads_the_nearest_existing_parent_of_the_weights(tmp_path):
    """Run for real (the real df, dirname): the weights path does not exist yet; its nearest existing parent's
    filesystem is read, whatever the working directory (/proc here); the engine names its data root over the
    socket."""
    node = LocalNode(tmp_path, cwd="/proc")
    root = tmp_path / "docker-root"
    root.mkdir()
    node.answer({"tool": "curl", "argv": ["-sf", "--unix-socket", "/var/run/docker.sock", "http://docker/info"],
                 "stdout": json.dumps({"ID": "x", "DockerRootDir": str(root)}, separators=(",", ":"))})
    free = parse_disk(sections(node, [DOCKER_SOCKET, *disk_script(str(tmp_path / "models" / "hub"))])["disk"])
    expected = os.statvfs(tmp_path).f_bavail * os.statvfs(tmp_path).f_frsize
    assert free is not None and set(free) == {"weights", "image"}
    assert abs(free["weights"] - expected) < 1 << 28 and abs(free["image"] - expected) < 1 << 28


@pytest.mark.parametrize(("sec", "avail"), [
    (Section("        Avail\n3858202624", 0), 3858202624),
    (None, None),
    (Section("        Avail\n3858202624", 1), None),  # df failed: its number is not the answer
    (Section("", 0), None),
    (Section("Avail", 0), None),
    (Section("Avail\n-", 0), None),  # GNU df's `-`: the filesystem did not say
])
def test_df_says_a_number_or_nothing(sec, avail):
    assert parse_avail(sec) == avail


# The recorded head's weights as the Hub lists them with `blobs=true` (testbed/hub.py `_info`: rfilename, size).
HUB_FILES = {"config.json": 517, "generation_config.json": 70, "model-00001-of-00004.safetensors": 16777680,
             "model-00002-of-00004.safetensors": 16777568, "model-00003-of-00004.safetensors": 16777568,
             "model-00004-of-00004.safetensors": 16777752, "model.safetensors.index.json": 1237, "README.md": 84,
             "special_tokens_map.json": 72, "tokenizer.json": 199, "tokenizer_config.json": 116}
HUB_ANSWER = json.dumps({"id": "testorg/tiny-moe", "sha": "1" * 40,
                         "siblings": [{"rfilename": n, "size": s} for n, s in HUB_FILES.items()]})


def test_the_hub_is_asked_for_the_revision_with_its_slashes_escaped(node):
    """Run for real: `curl -fsS --max-time T -H @- URL`, the header on stdin; a revision `refs/pr/1` is one
    path segment (`refs%2Fpr%2F1`), as huggingface_hub quotes it."""
    url = "https://huggingface.co/api/models/testorg/tiny-moe/revision/refs%2Fpr%2F1?blobs=true"
    node.answer({"tool": "curl", "argv": ["-fsS", "--max-time", "30", "-H", "@-", url], "stdout": HUB_ANSWER})
    size = hub_size_fact("testorg/tiny-moe", "refs/pr/1", None, 30.0).read(node, 60)
    assert size == HubSize(67112863)
    assert node.stdin_of("curl") == ["Accept: application/json\n"]


@pytest.mark.parametrize(("payload", "problem"), [
    ('{"siblings": []}', "the Hub's answer lists no files"),
    ('{"id": "x"}', "the Hub's answer lists no files"),
    ('{"siblings": ["config.json"]}', "the Hub's answer gives no size for some files"),
    ('{"siblings": [{"rfilename": "a"}]}', "the Hub's answer gives no size for some files"),
    ('{"siblings": [{"rfilename": "a", "size": true}]}', "the Hub's answer gives no size for some files"),
])
def test_an_answer_without_every_size_is_no_size(payload, problem):
    assert parse_hub_size(Section(payload, 0)) == HubSize(None, problem)


def test_an_empty_file_counts_zero_bytes():
    assert hub_size(json.dumps({"siblings": [{"rfilename": "a", "size": 0}, {"rfilename": "b", "size": 5}]})) == 5


def test_no_answer_and_a_failed_curl_say_why():
    assert parse_hub_size(None) == HubSize(None, "no answer", -1)
    error = "x" * 100 + "curl: (22) The requested URL returned error: 404" + "y" * 300
    assert parse_hub_size(Section(error + "\n", 22)) == HubSize(None, "y" * 300, 22)


# -- the head's cluster id ----------------------------------------------------------------------------------------

def test_the_cluster_id_file_is_read_one_byte_past_the_limit(node):
    """Run for real in a HOME of its own: a file longer than IDENTITY_MAX_BYTES is printed cut at one byte more,
    so the parser sees it is too long, and no more crosses the wire."""
    made = node.home / ".spark-reconciler"
    made.mkdir(mode=0o700)
    (made / "cluster-id").write_text("a" * (2 * IDENTITY_MAX_BYTES))
    sec = sections(node, identity_script("10.231.0.2:22"))["identity"]
    assert (sec.rc, len(sec.body)) == (0, IDENTITY_MAX_BYTES + 1)
    with pytest.raises(ProbeError, match="longer than"):
        parse_identity(sec)


def test_a_cluster_id_file_one_byte_too_long_is_odd_output(node):
    made = node.home / ".spark-reconciler"
    made.mkdir(mode=0o700)
    # one id line, then a line of spaces (a blank line, skipped): IDENTITY_MAX_BYTES + 1 bytes in all
    (made / "cluster-id").write_text("2f62e727-4793-45fb-9464-67ad086b9e9d\n" + " " * (IDENTITY_MAX_BYTES - 36))
    with pytest.raises(ProbeError, match="longer than"):
        parse_identity(sections(node, identity_script("10.231.0.2:22"))["identity"])


def test_a_made_cluster_id_is_read_back(node):
    identity = parse_identity(sections(node, identity_script("10.231.0.2:22"))["identity"])
    assert identity is not None and len(identity.id) == 36 and identity.known_as == ["10.231.0.2:22"]

