"""`reconciler doctor` on the testbed: the seed as it is (its expected warnings), then each prerequisite broken in
turn on a real node (testbed/faults.py: a binary hidden from the worker's SSH sessions, its sudo rules narrowed, its
user out of the docker group, its model disk filled, its `date` skewed by a PATH shadow) or in a copy of the
desired state (weights missing on the source, a secret missing from the environment file, a loose known_hosts, an
unknown host key): each named with its exact fix, and put back. One testbed for the module; `converged` once, for
the hop that only a live fabric can show."""

from __future__ import annotations

import json
import os
import shutil
import time

import pytest
from click.testing import CliRunner

from reconciler.cli import main

pytestmark = pytest.mark.e2e


def doctor(file, env_file=None) -> tuple[int, list[dict]]:
    args = ["doctor", "--json", str(file)] + (["--env-file", str(env_file)] if env_file else [])
    result = CliRunner().invoke(main, args, catch_exceptions=False)
    assert result.exit_code in (0, 1), result.output
    return result.exit_code, json.loads(result.stdout)["checks"]


def doctor_with(tb, kind: str, node: str, **kw) -> tuple[int, list[dict]]:
    """doctor on the seed's file with one testbed fault in place; the fault cleared whatever happens."""
    tb.fault(kind, node, **kw)
    try:
        return doctor(tb.desired_state)
    finally:
        tb.fault(kind, node, **kw, clear=True)


def one(checks: list[dict], name: str, node: str) -> dict:
    found = [c for c in checks if c["name"] == name and c["node"] == node]
    assert len(found) == 1, (name, node, checks)
    return found[0]


def not_ok(checks: list[dict]) -> set[tuple[str, str, str]]:
    return {(c["name"], c["node"], c["status"]) for c in checks if c["status"] != "ok"}


SEED_WARNINGS = {("hop/worker", "head", "warn"), ("gpu", "head", "warn"), ("gpu", "worker", "warn")}


@pytest.fixture(scope="module")
def seed(testbed):
    tb = testbed.reset("seed")
    yield tb
    tb.reset("seed")


def variant(tb, tmp_path, *replacements: tuple[str, str], name: str = "variant.yaml"):
    text = tb.desired_state.read_text()
    for old, new in replacements:
        assert old in text, old
        text = text.replace(old, new)
    path = tmp_path / name
    path.write_text(text)
    return path


def test_the_seed_is_named_with_its_expected_warnings(seed):
    start = time.monotonic()
    code, checks = doctor(seed.desired_state)
    took = time.monotonic() - start
    print(f"doctor on the seed: {took:.2f}s")
    assert code == 0
    # the worker's fabric port is down in the seed: the hop waits for apply; the testbed's docker has no `nvidia`
    # runtime registered (its `--gpus` goes through the hook stand-in, as moby's nvidia driver does)
    assert not_ok(checks) == SEED_WARNINGS
    hop = one(checks, "hop/worker", "head")
    assert "cannot be checked until `reconciler apply` brings the fabric port up" in hop["message"]
    assert "worker's enp1s0f1np1" in hop["message"]
    assert one(checks, "rsync", "worker")["message"].startswith("rsync 3.")
    assert one(checks, "image", "head")["status"] == "ok"
    assert "within 1 s" in one(checks, "clock", "worker")["message"]
    names = {(c["name"], c["node"]) for c in checks}
    for want in [("ssh", "head"), ("ssh", "worker"), ("sudo", "worker"), ("docker", "worker"),
                 ("binaries", "worker"), ("disk", "worker"), ("weights", "head"), ("files", "the reconciler's host"),
                 ("secrets", "the reconciler's host")]:
        assert want in names


def test_a_missing_binary_is_named_with_its_package(seed):
    code, checks = doctor_with(seed, "hide-binary", "worker", name="rsync")
    assert code == 1
    c = one(checks, "binaries", "worker")
    assert c["status"] == "fail" and "rsync (the weights' copy (the receiving end))" in c["message"]
    assert c["fix"] == {"command": "apt-get install -y rsync", "user": "root", "node": "worker"}
    assert not_ok(checks) == SEED_WARNINGS | {("binaries", "worker", "fail")}
    assert doctor(seed.desired_state)[0] == 0  # put back


def test_a_removed_sudo_rule_is_named_with_the_sudoers_line(seed):
    code, checks = doctor_with(seed, "sudo-rule", "worker")
    assert code == 1
    c = one(checks, "sudo", "worker")
    assert c["status"] == "fail"
    assert "refuses 6 of 7 commands, first `/usr/sbin/ip link set dev enp1s0f1np1 up`" in c["message"]
    assert c["fix"]["user"] == "root" and c["fix"]["node"] == "worker"
    assert c["fix"]["command"] == (
        "echo 'spark ALL=(root) NOPASSWD: /usr/sbin/ip link set dev enp1s0f1np1 up, /usr/sbin/ip link set dev "
        "enp1s0f1np1 mtu 9000, /usr/sbin/ip addr add 10.232.0.11/24 dev enp1s0f1np1, /usr/sbin/ip link set dev "
        "enP2p1s0f1np1 up, /usr/sbin/ip link set dev enP2p1s0f1np1 mtu 9000, /usr/sbin/ip addr add 10.232.1.11/24 "
        "dev enP2p1s0f1np1, /usr/sbin/sysctl -w vm.drop_caches=3' | EDITOR='tee' visudo -f "
        "/etc/sudoers.d/spark-reconciler")
    assert one(checks, "sudo", "head")["status"] == "ok"


def test_a_user_out_of_the_docker_group_is_named(seed):
    code, checks = doctor_with(seed, "docker-group", "worker")
    assert code == 1
    c = one(checks, "docker", "worker")
    assert c["status"] == "fail" and "spark is not in the docker group" in c["message"]
    assert "permission denied" in c["message"].lower()
    assert c["fix"]["command"].startswith("usermod -aG docker spark")
    assert (c["fix"]["user"], c["fix"]["node"]) == ("root", "worker")


def test_a_full_disk_is_named_with_what_the_copy_needs(seed):
    seed.fault("fill-disk", "worker", leave=64 << 20)
    try:
        code, checks = doctor(seed.desired_state)
    finally:
        seed.fault("free-disk", "worker")
    assert code == 1
    c = one(checks, "disk", "worker")
    assert c["status"] == "fail"
    assert c["message"].startswith("weights (/srv/spark-testbed/worker/models/hub): only 0.1 GiB free: the copy "
                                   "would fill the disk")
    assert c["fix"]["command"].startswith("df -h /srv/spark-testbed/worker/models/hub; du -xsh")


def test_clock_skew_warns_then_fails(seed):
    """A `date` shadow first on the worker's PATH (the kernel clock is one for all namespaces): what doctor reads
    is what the node's sessions read."""
    try:
        seed.fault("clock-skew", "worker", value=5)
        code, checks = doctor(seed.desired_state)
        c = one(checks, "clock", "worker")
        assert code == 0 and c["status"] == "warn" and "ahead of head" in c["message"]
        seed.fault("clock-skew", "worker", value=-90)
        code, checks = doctor(seed.desired_state)
        c = one(checks, "clock", "worker")
        assert code == 1 and c["status"] == "fail" and "behind head: over 30 s" in c["message"]
        assert c["fix"]["command"].startswith("timedatectl set-ntp true")
    finally:
        seed.fault("clock-skew", "worker", clear=True)


def test_weights_missing_on_the_source(seed, tmp_path):
    offline = variant(seed, tmp_path, ("id: testorg/tiny-moe", "id: testorg/absent"),
                      ("internet: true", "internet: false"))
    code, checks = doctor(offline)
    c = one(checks, "weights", "head")
    assert code == 1 and c["status"] == "fail"
    assert c["message"].startswith("testorg/absent: missing in /srv/spark-testbed/head/models/hub, and head has no "
                                   "internet in the file")
    assert c["fix"]["command"].startswith(f"hf download testorg/absent --revision {'1' * 40} "
                                          "--cache-dir /srv/spark-testbed/head/models/hub")
    assert (c["fix"]["user"], c["fix"]["node"]) == ("spark", "head")
    online = variant(seed, tmp_path, ("id: testorg/tiny-moe", "id: testorg/absent"), name="online.yaml")
    code, checks = doctor(online)
    assert one(checks, "weights", "head")["status"] == "warn"
    assert "`reconciler apply` downloads them there first" in one(checks, "weights", "head")["message"]
    assert one(checks, "hf", "head")["status"] in ("ok", "fail")  # asked: the download step runs `hf` there


def test_a_secret_missing_from_the_environment_file(seed, tmp_path):
    path = variant(seed, tmp_path, ("serving:\n", "serving:\n  secrets: {HF_TOKEN: internet, VLLM_API_KEY: head}\n"))
    env = tmp_path / "environment"
    env.write_text("# the daemon's\nVLLM_API_KEY='sk-do-not-print-me'\nHF_TOKEN=\n")
    env.chmod(0o600)
    code, checks = doctor(path, env)
    c = one(checks, "secrets", "the reconciler's host")
    assert code == 1 and c["status"] == "fail"
    assert c["message"] == f"{env} does not set HF_TOKEN (declared in serving.secrets)"
    assert c["fix"]["command"].startswith(f"systemd-ask-password HF_TOKEN: | sed 's/^/HF_TOKEN=/' >> {env}")
    assert "sk-do-not-print-me" not in json.dumps(checks)
    env.chmod(0o644)
    c = one(doctor(path, env)[1], "secrets", "the reconciler's host")
    assert c["status"] == "fail" and "mode 0644" in c["message"]
    assert c["fix"]["command"].startswith("chown root:") and c["fix"]["command"].endswith(f" {env} && chmod 0640 {env}")


def test_a_loose_known_hosts_and_an_unknown_host_key(seed, tmp_path):
    loose = tmp_path / "known_hosts"
    shutil.copy(seed.known_hosts, loose)
    loose.chmod(0o666)
    path = variant(seed, tmp_path, (f"known_hosts: {seed.known_hosts}", f"known_hosts: {loose}"))
    code, checks = doctor(path)
    c = one(checks, "files", "the reconciler's host")
    assert code == 1 and c["status"] == "fail" and "is writable by others (mode 0666)" in c["message"]
    assert c["fix"] == {"command": f"chmod go-w {loose}", "user": "root", "node": "the reconciler's host"}
    loose.chmod(0o644)
    loose.write_text("".join(line for line in seed.known_hosts.read_text().splitlines(keepends=True)
                             if not line.startswith("10.231.1.11 ")))
    code, checks = doctor(path)
    c = one(checks, "ssh", "worker")
    assert code == 1 and c["status"] == "fail" and "HostKeyRejected" in c["message"]
    assert c["fix"]["command"].startswith("ssh-keyscan -p 22 10.231.1.11 | ssh-keygen -lf -")
    assert (c["fix"]["user"], c["fix"]["node"]) == ("spark", "head")  # the worker is reached through the head


def test_the_hop_over_a_live_fabric(seed):
    tb = seed.reset("converged")
    try:
        code, checks = doctor(tb.desired_state)
        c = one(checks, "hop/worker", "head")
        assert c["status"] == "ok", c
        assert "reaches spark@10.232.0.11 over the fabric" in c["message"]
        # nothing left behind on the head: the hop's known_hosts is removed after the try
        assert not [p for p in os.listdir("/home/spark/.spark-reconciler") if p.startswith("doctor_known_hosts")]
    finally:
        seed.reset("seed")


def test_reset_undoes_every_session_fault(seed):
    """A test killed before its `finally` leaves no hidden binary, narrowed sudoers, lost group or skewed `date`
    behind: `reset` (probe-restore) takes them all back."""
    for kind, kw in [("hide-binary", {"name": "flock"}), ("sudo-rule", {}), ("docker-group", {}),
                     ("clock-skew", {"value": 300})]:
        seed.fault(kind, "head", **kw)
    assert not_ok(doctor(seed.desired_state)[1]) >= {("binaries", "head", "fail"), ("sudo", "head", "fail"),
                                                     ("docker", "head", "fail"), ("clock", "worker", "fail")}
    seed.reset("seed")
    assert not_ok(doctor(seed.desired_state)[1]) == SEED_WARNINGS
