"""Issue 7, security, end to end: strict host keys (a changed key is refused and reported), every value reaches
the node as exactly one argv element (recorded by a real program behind the real sshd), sudo only for the
sudoers rules, the listener on localhost, and a secret never on a command line, in a log, in /metrics or /status.
"""

from __future__ import annotations

import json
import re
import subprocess
import threading
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from reconciler.core import spec
from reconciler.edge import ssh
from reconciler.edge.ssh import Sessions
from testbed.proc import wait_for
from tests.e2e.daemon import CLI, Daemon
from tests.e2e.test_reliability import assert_nothing_lost, converged, daemon, managed, write_desired

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
RECORDER = "/srv/spark-testbed/worker/models/argv-recorder"
RECORDED = "/srv/spark-testbed/worker/models/argv-recorded.jsonl"


# -- host keys ------------------------------------------------------------------------------------------------

def test_no_trust_on_first_use_anywhere_in_the_code():
    offenders = []
    for path in (REPO / "reconciler").rglob("*.py"):
        text = path.read_text()
        for bad in ("AutoAddPolicy", "WarningPolicy", "StrictHostKeyChecking=no",  # allowed: the words forbidden
                    "accept-new", "UserKnownHostsFile=/dev/null"):
            if bad in text:
                offenders.append(f"{path.relative_to(REPO)}: {bad}")
    assert offenders == []
    assert "RejectPolicy()" in (REPO / "reconciler" / "edge" / "ssh" / "session.py").read_text()
    hop = REPO / "reconciler" / "edge" / "steps" / "hop.py"
    assert "StrictHostKeyChecking=yes" in hop.read_text()  # weights, image


def test_changed_host_key_is_refused_and_reported(seed_testbed, tmp_path):
    tb = seed_testbed
    fake = tmp_path / "fake_key"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(fake)], check=True)
    fake_pub = fake.with_suffix(".pub").read_text().split()
    lines = []
    for line in tb.known_hosts.read_text().splitlines():
        host = line.split()[0]
        lines.append(f"{host} {fake_pub[0]} {fake_pub[1]}" if host == tb.node("worker").ssh_host else line)
    known = tmp_path / "known_hosts"
    known.write_text("\n".join(lines) + "\n")

    def wrong_key(data):
        data["nodes"][1]["ssh"]["known_hosts"] = str(known)

    desired = write_desired(tmp_path / "cluster.yaml", wrong_key, mode="observe")
    d = daemon(desired, tmp_path / "state")
    try:
        t = time.monotonic()
        reach = wait_for(lambda: (lambda c: c if c and c["status"] == "False" else None)(
            d.condition("worker", "Reachable")), 30, "Reachable False")
        assert reach["message"].startswith("HostKeyRejected:") and "CHANGED" in reach["message"], reach
        assert d.metric("reconciler_node_reachable", node="worker") == 0
        assert d.condition("head", "Reachable")["status"] == "True"
        print(f"FIGURE host-key: detected {time.monotonic() - t:.1f}s")
        # and it stays refused: no later reconcile accepts the key
        n = d.metric("reconciler_reconciles_total")
        wait_for(lambda: d.metric("reconciler_reconciles_total") >= n + 2, 20, "two more reconciles")
        assert d.condition("worker", "Reachable")["status"] == "False"
    finally:
        d.close()
    assert known.read_text().count(fake_pub[1]) == 1, "known_hosts was not rewritten"


# -- injection: what the node really receives ------------------------------------------------------------------

@pytest.fixture(scope="module")
def recorder(testbed):
    """A program on the worker that appends its argv as JSON: the ground truth of what sshd ran."""
    tb = testbed
    tb.exec("worker", f"cat > {RECORDER} && chmod 755 {RECORDER}", user="root", check=True, input=(
        "#!/usr/bin/python3\nimport json, sys\n"
        f"with open({RECORDED!r}, 'a') as f:\n"
        "    f.write(json.dumps(sys.argv[1:]) + '\\n')\n"))
    desired = spec.load(tb.desired_state)
    sessions = Sessions(desired)
    yield sessions["worker"]
    sessions.close()
    tb.exec("worker", f"rm -f {RECORDER} {RECORDED}", user="root")


def recorded(session, argv: list[str]) -> list[str]:
    session.run(["sh", "-c", f": > {RECORDED}"], timeout=10)
    session.run([RECORDER, *argv], timeout=10)
    out = session.run(["cat", RECORDED], timeout=10).stdout
    return json.loads(out.splitlines()[-1])


# Any text a YAML file could carry (no NUL: it cannot be in an argv; no lone surrogates: not encodable)
TEXT = st.text(st.characters(exclude_characters="\x00", exclude_categories=("Cs",)), max_size=40)
SHELLY = st.lists(st.sampled_from(list("a-_./:=$`'\"\\;|&<>(){}[]*?!~# \t\n") + ["$(id)", "`id`", "'$HOME'"]),
                  max_size=20).map("".join)


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(values=st.lists(st.one_of(TEXT, SHELLY), min_size=1, max_size=4))
def test_any_string_reaches_the_node_as_one_argv_element(recorder, values):
    assert recorded(recorder, values) == values


FIELDS = {
    # field -> (a pydantic type from spec, how the product puts it in an argv)
    "container_name": (spec.ContainerName, lambda v: ["docker", "inspect", "--type", "container", v]),
    "interface": (spec.InterfaceName, lambda v: ["/usr/sbin/ip", "link", "set", "dev", v, "up"]),
    "path": (spec.AbsPath, lambda v: ["mkdir", "-p", v]),
    "model_id": (spec.ModelId, lambda v: ["vllm", "serve", v]),
    "revision": (spec.Revision, lambda v: ["--revision", v]),
    "image": (spec.ImageRef, lambda v: ["docker", "image", "inspect", "--format", "{{.Id}}", v]),
    "env_value": (spec.EnvValue, lambda v: ["-e", f"HF_TOKEN={v}"]),
    "extra_arg": (spec.ExtraArg, lambda v: ["vllm", "serve", "m", v]),
    "served_name": (spec.ServedName, lambda v: ["--served-model-name", v]),
}


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(field=st.sampled_from(sorted(FIELDS)), value=st.one_of(TEXT, SHELLY))
def test_every_remote_field_is_rejected_or_one_argv_element(recorder, field, value):
    from pydantic import TypeAdapter, ValidationError

    kind, render = FIELDS[field]
    try:
        accepted = TypeAdapter(kind).validate_python(value)
    except ValidationError:
        return  # rejected at the border: never reaches a node
    argv = render(accepted)
    assert recorded(recorder, argv) == argv


def test_the_real_launch_argv_arrives_intact(recorder, testbed, tmp_path):
    """The product's own `docker run` argv, with hostile-but-valid env and extra args, recorded on the node."""
    from reconciler.core.vllm import launch_specs

    def hostile(data):
        data["serving"]["env"] = {"HOSTILE": "hf_$(id) `x` ; rm -rf / 'q' \"d\"", "A": "  spaced  "}
        data["serving"]["extra_args"] = ["--chat-template-content-format=string", "--max-num-seqs=8"]

    desired = spec.load(write_desired(tmp_path / "d.yaml", hostile))
    for s in launch_specs(desired):
        argv = s.run_argv(generation=3)
        assert recorded(recorder, argv) == argv


# -- privilege ------------------------------------------------------------------------------------------------

def test_each_node_grants_exactly_what_the_code_may_send(testbed):
    """`reconciler.edge.ssh.sudo_commands` is both `reconciler sudoers FILE` and the check before sending: each of
    the node's commands is permitted by the node's real sudo (`sudo -n -l CMD` asks without running it)."""
    desired = spec.load(testbed.desired_state)
    for node in desired.nodes:
        allowed = ssh.sudo_commands(desired, node)
        assert allowed, node.name
        for argv in allowed:
            asked = testbed.exec(node.name, "sudo -n -l " + ssh.quote(argv), check=False)
            assert asked.returncode == 0, (node.name, argv, asked.stderr)


def test_sudo_refuses_anything_else_before_it_is_sent(recorder, testbed):
    """Another interface, another MTU or address, another command: refused in the reconciler, before sudo."""
    fabric = spec.load(testbed.desired_state).node(recorder.name).fabric
    for argv in (["/usr/sbin/ip", "link", "del", fabric.interface], ["/usr/sbin/ip", "link", "set", "dev"],
                 ["/usr/sbin/ip", "link", "set", "dev", "eth0", "down"],
                 ["/usr/sbin/ip", "link", "set", "dev", fabric.interface, "mtu", "1500"],
                 ["/usr/sbin/ip", "addr", "add", "10.9.9.9/24", "dev", fabric.interface],
                 ["/usr/sbin/sysctl", "-w", "vm.drop_caches=3", "kernel.panic=1"], ["ip", "link", "set", "dev", "x"],
                 ["/bin/sh", "-c", "id"], [RECORDER, "x"]):
        with pytest.raises(PermissionError):
            recorder.run(argv, sudo=True, timeout=10)
    # what is listed really works on the node, under sudo -n; what is not is refused by sudo itself too
    assert recorder.run(["/usr/sbin/ip", "link", "set", "dev", fabric.interface, "up"], sudo=True, timeout=10).ok
    denied = recorder.run(["sudo", "-n", "/usr/sbin/ip", "link", "del", "enp1s0f1np1"], timeout=10, check=False)
    assert denied.exit_code != 0 and "password" in denied.stderr


def test_every_sudo_call_in_the_code_is_one_of_the_exact_commands(testbed):
    """Each `Run(node, (...), sudo=True)` in the code starts like one of the node's exact commands (its literal
    words up to the first computed value), so nothing the code sends as root is missing from `reconciler
    sudoers`."""
    text = testbed.desired_state.read_text().replace("policy:\n", "policy:\n  drop_caches: true\n", 1)
    desired = spec.loads(text)  # every optional sudo command on (drop_caches)
    shapes = {argv for node in desired.nodes for argv in ssh.sudo_commands(desired, node)}
    calls = []
    for path in (REPO / "reconciler").rglob("*.py"):
        for line in path.read_text().splitlines():  # a step's `Run(node, (argv...), sudo=True)` (steps as data)
            if "sudo=True" in line and (m := re.search(r"Run\(\w+, \(([^)]*)", line)):
                calls.append(m.group(1))
    assert calls, "the link and serving steps use sudo"
    for call in calls:
        prefix: list[str] = []
        for word in (w.strip() for w in call.split(",")):
            if word == "IP":
                prefix.append("/usr/sbin/ip")
            elif word[:1] in "\"'":
                prefix.append(word.strip("\"'"))
            else:
                break
        assert any(list(shape[: len(prefix)]) == prefix for shape in shapes), call


# -- exposure -------------------------------------------------------------------------------------------------

def listening(pid: int) -> list[str]:
    out = subprocess.run(["ss", "-Hltnp"], capture_output=True, text=True, check=True).stdout
    return [line.split()[3] for line in out.splitlines() if f"pid={pid}," in line]


def test_metrics_and_status_bind_localhost_by_default(seed_testbed, tmp_path):
    def no_listen(data):
        data["policy"].pop("listen", None)

    desired = write_desired(tmp_path / "cluster.yaml", no_listen, mode="observe")
    proc = subprocess.Popen([CLI, "run", str(desired), "--state-dir", str(tmp_path / "state"), "--log-format",
                             "json"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        socks = wait_for(lambda: listening(proc.pid), 20, "the daemon's listener")
        assert socks == ["127.0.0.1:9464"], socks
    finally:
        proc.terminate()
        proc.wait(30)


SECRET = "hf_" + "S3cr3tT0ken" * 3


def test_secret_env_never_in_logs_metrics_status_argv_or_ps(seed_testbed, tmp_path):
    tb = seed_testbed.reset("converged")

    def token(data):  # an API key too: the health checks must send it, and it must not leak either
        data["serving"]["secrets"] = {"HF_TOKEN": "internet", "VLLM_API_KEY": "head"}

    desired = write_desired(tmp_path / "cluster.yaml", token)
    assert SECRET not in desired.read_text(), "the values come from the daemon's environment, not the file"
    seen: list[str] = []
    stop = threading.Event()

    def sample_ps():
        while not stop.is_set():
            out = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True, check=False).stdout
            if SECRET in out:
                seen.append(next(line for line in out.splitlines() if SECRET in line))
            stop.wait(0.02)

    sampler = threading.Thread(target=sample_ps, daemon=True)
    sampler.start()
    d = Daemon(desired, tmp_path / "state", environ={"HF_TOKEN": SECRET, "VLLM_API_KEY": f"{SECRET}-api"}).start()
    try:
        converged(d, 90)
        stop.set()
        sampler.join()
        assert seen == [], seen
        with urllib_open(f"{d.url}/metrics") as m, urllib_open(f"{d.url}/status") as s:
            assert SECRET not in m and SECRET not in s
        assert SECRET not in d.log_path.read_text(errors="replace")
        port = 8000
        refused = tb.exec("head", f"curl -s -o /dev/null -w '%{{http_code}}' http://127.0.0.1:{port}/v1/models").stdout
        assert refused == "401", "the API does want the key the reconciler's health checks sent"
        for node in ("head", "worker"):
            info = managed(tb, node)[0]
            # HF_TOKEN is scoped `internet`: the head gets it, the internet-less worker never holds it
            assert (f"HF_TOKEN={SECRET}" in info["Config"]["Env"]) == (node == "head"), node
            assert any(e.startswith("VLLM_API_KEY=") for e in info["Config"]["Env"]) == (node == "head"), node
            exposed = dict(info)
            exposed["Config"] = {k: v for k, v in info["Config"].items() if k != "Env"}
            assert SECRET not in json.dumps(exposed), f"{node}: the token is in docker inspect outside Config.Env"
            # the nodes share the host's /tmp, where this test's own desired-state file lives
            left = tb.exec(node, f"grep -rlsF --exclude-dir='pytest-of-*' {SECRET} /tmp /var/tmp || true",
                           user="root").stdout
            assert left.strip() == "", f"the token is in a file on {node}: {left}"
        assert_nothing_lost(tb, d)
    finally:
        stop.set()
        d.close()


def urllib_open(url: str):
    import contextlib
    import urllib.request

    @contextlib.contextmanager
    def body():
        with urllib.request.urlopen(url, timeout=5) as r:
            yield r.read().decode()

    return body()


def test_the_environment_reaches_the_container_through_stdin_exactly(recorder):
    """What the serving step does (`docker run --env-file /dev/stdin`, the text on the channel's stdin): every
    value arrives byte for byte, spaces, quotes and `#` included, and no file on the node holds the secret after it
    (only the files changed since are read: the testbed's nodes share the machine's /tmp with whatever else runs)."""
    from reconciler.core.vllm import LaunchSpec

    env = {"HF_TOKEN": SECRET, "A": "  spaced  ", "B": "it's \"q\" # not a comment", "C": "x=y"}
    launch = LaunchSpec(node="worker", rank=1, container_name="env-probe", image="cotenant-standin:latest",
                        docker_flags=("--rm", "--entrypoint", "env"), env=env, command=())
    argv = ["docker", *launch.run_argv(1, env_file="/dev/stdin")]
    argv.remove("-d")  # wait for `env` and read its output
    since = recorder.run(["date", "+%s.%N"], timeout=10).stdout.strip()
    out = recorder.run(argv, stdin=launch.env_file_text().encode(), timeout=60).stdout
    seen = dict(line.split("=", 1) for line in out.splitlines() if "=" in line)
    assert {k: seen.get(k) for k in env} == env
    written = ('files=$(find /tmp /var/tmp -xdev -type f -newermt "@$1" 2>/dev/null); '
               '[ -z "$files" ] || grep -lsF -f - $files; true')  # the secret as the pattern, on stdin
    holders = recorder.run(["sh", "-c", written, "sh", since], stdin=SECRET.encode(), timeout=60).stdout
    assert holders == "", f"files on the node that hold the secret: {holders}"
