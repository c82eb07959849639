"""What the desired-state file may ask for (issue 16, findings 2, 10 and 11; docs/security.md "The file").

By default nothing reaches beyond the container; what does (privileged, capabilities, devices, host paths, the
model repository's code) needs its `trust` entry, which `plan` lists; the node's system, `/` and key directories
are never mounted; what the reconciler sets itself cannot be overridden; durations that would make a busy loop
or an unreachable cluster are refused.
"""

from __future__ import annotations

import os
import stat

import pytest

from reconciler.core import spec
from reconciler.core.vllm import launch_specs
from reconciler.edge import trusted_files

DOCKER = "  docker:\n    gpus: all\n"


def _docker(base_yaml: str, lines: str) -> str:
    return base_yaml.replace("co_tenants:\n", DOCKER + lines + "co_tenants:\n", 1)


def _trust(text: str, lines: str) -> str:
    return text.replace("policy:\n", "trust:\n" + lines + "policy:\n", 1)


@pytest.mark.parametrize("lines,where,message", [
    ("    privileged: true\n", "serving.docker.privileged", "allow it with trust.privileged: true"),
    ("    cap_add: [SYS_ADMIN]\n", "serving.docker.cap_add[0]", "SYS_ADMIN is not allowed: add it to trust.capab"),
    ("    devices: [/dev/sda]\n", "serving.docker.devices[0]", "/dev/sda is not allowed: add it to trust.devices"),
    ("    volumes: [/data/x:/x]\n", "serving.docker.volumes[0]", "/data/x is not below a trusted host path"),
])
def test_what_reaches_beyond_the_container_needs_its_trust_entry(base_yaml, problems, lines, where, message):
    text = _docker(base_yaml, lines)
    [line] = problems(text)
    assert f": {where}: " in line and message in line
    granted = {"privileged": "  privileged: true\n", "cap_add": "  capabilities: [SYS_ADMIN]\n",
               "devices": "  devices: [/dev/sda]\n", "volumes": "  host_paths: [/data]\n"}
    key = next(k for k in granted if k in where)
    assert problems(_trust(text, granted[key])) == []


def test_the_safe_set_needs_no_trust(base_yaml, problems):
    assert problems(_docker(base_yaml, "    devices: [/dev/infiniband, /dev/infiniband/uverbs0]\n"
                                       "    cap_add: [IPC_LOCK]\n")) == []


@pytest.mark.parametrize("host", ["/", "/etc", "/etc/ssl", "/root", "/var/run/docker.sock", "/run/docker.sock",
                                  "/proc", "/sys/fs", "/home/spark/.ssh", "/usr/lib", "/var/lib/docker/volumes"])
def test_system_paths_are_never_mounted_even_when_trusted(base_yaml, problems, host):
    text = _trust(_docker(base_yaml, f"    volumes: [{host}:/host]\n"), "  host_paths: [/data]\n")
    [line] = problems(text)
    assert "serving.docker.volumes[0]" in line and "never mounted into a serving container" in line
    assert any("never mounted" in p for p in problems(_trust(base_yaml, f"  host_paths: [{host}]\n")))


@pytest.mark.parametrize("path", ["/", "/home", "/data", "/home/spark", "/root/models", "/etc/models/x",
                                  "/home/spark/.ssh/m"])
def test_the_model_path_is_a_directory_of_its_own(edit, problems, path):
    [line] = problems(edit(("  path: /home/spark/.cache/huggingface/hub", f"  path: {path}")))
    assert "model.path:" in line and ("too shallow" in line or "not a data directory" in line)


def test_remote_code_is_an_opt_in_that_renders_the_flag(base_yaml, problems):
    [line] = problems(base_yaml.replace('["--enforce-eager"]', '["--trust-remote-code"]'))
    assert "--trust-remote-code is set by the reconciler; use trust.remote_code instead" in line
    desired = spec.loads(_trust(base_yaml, "  remote_code: true\n"))
    assert all("--trust-remote-code" in s.command for s in launch_specs(desired))
    assert desired.trust.granted() == ["the model repository's code (--trust-remote-code)"]
    assert not any("--trust-remote-code" in s.command for s in launch_specs(spec.loads(base_yaml)))


def test_the_default_container_is_not_privileged(base_yaml):
    for s in launch_specs(spec.loads(base_yaml)):
        assert "--privileged" not in s.docker_flags and "--cap-add" not in s.docker_flags


# ---------------------------------------------------------------------------------------------- finding 10


@pytest.mark.parametrize("old,new,where", [
    ("resync_interval: 30s", "resync_interval: 0s", "policy.resync_interval"),
    ("resync_interval: 30s", "resync_interval: 500ms", "policy.resync_interval"),
    ("listen: 127.0.0.1:9464", "listen: 127.0.0.1:9464\n  timeouts: {command: 0s}", "policy.timeouts.command"),
    ("listen: 127.0.0.1:9464", "listen: 127.0.0.1:9464\n  timeouts: {step: 0s}", "policy.timeouts.step"),
    ("listen: 127.0.0.1:9464", "listen: 127.0.0.1:9464\n  retries: {backoff_initial: 0s}",
     "policy.retries.backoff_initial"),
    ("  port: 8000", "  port: 8000\n  unhealthy_grace: 0s", "serving.unhealthy_grace"),
    ("      host: 10.0.0.1", "      host: 10.0.0.1\n      connect_timeout: 0s", "nodes[0].ssh.connect_timeout"),
])
def test_durations_that_break_the_loop_are_refused(edit, problems, old, new, where):
    [line] = problems(edit((old, new)))
    assert f": {where}: " in line and "below the minimum" in line


@pytest.mark.parametrize("flag", ["--tensor_parallel_size=4", "--tensor-parallel-size", "--model", "--model=x",
                                  "--config=/etc/x.yaml", "--served_model_name=x", "--trust_remote_code"])
def test_flags_the_reconciler_sets_are_refused_in_any_spelling(base_yaml, problems, flag):
    [line] = problems(base_yaml.replace('["--enforce-eager"]', f'["{flag}"]'))
    assert "is set by the reconciler" in line


@pytest.mark.parametrize("name", sorted(spec.RESERVED_ENV) + ["LD_PRELOAD", "PYTHONPATH"])
def test_env_the_reconciler_owns_or_that_injects_code_is_refused(base_yaml, problems, name):
    [line] = problems(base_yaml.replace('    VLLM_ENGINE_READY_TIMEOUT_S: "3600"', f"    {name}: x", 1))
    assert f"serving.env.{name}" in line or "serving.env" in line


def test_every_variable_the_launch_sets_is_reserved_except_the_gb10_defaults(base_yaml):
    """The oracle is the launch itself: whatever it sets, an override in serving.env must be refused."""
    from reconciler.core.vllm import GB10_ENV

    ray = spec.loads(base_yaml.replace("  tensor_parallel_size: 2", "  tensor_parallel_size: 2\n  launcher: ray"))
    for desired in (spec.loads(base_yaml), ray):
        for s in launch_specs(desired):
            assert set(s.env) - set(GB10_ENV) - set(desired.serving.env) <= set(spec.RESERVED_ENV)


def test_the_fabric_is_never_loopback(edit, problems):
    first = "      interface: enp1s0f1np1\n      rdma_device: rocep1s0f1\n      address: 192.168.200.12"
    [line] = problems(edit((first, first.replace("enp1s0f1np1", "lo"))))
    assert "nodes[0].fabric.interface: lo is the loopback interface" in line


# ---------------------------------------------------------------------------------------------- finding 11


def test_the_api_binds_loopback_unless_told(base_yaml):
    def host_of(desired: spec.Desired) -> str:
        command = launch_specs(desired)[0].command
        return command[command.index("--host") + 1]

    assert host_of(spec.loads(base_yaml)) == "127.0.0.1"
    assert host_of(spec.loads(base_yaml.replace("  port: 8000", "  port: 8000\n  host: 0.0.0.0"))) == "0.0.0.0"


# ---------------------------------------------------------------------------------------------- local files


def test_files_others_may_change_are_refused_as_sshd_strict_modes_does(tmp_path):
    d = tmp_path / "etc"
    d.mkdir(mode=0o755)
    f = d / "cluster.yaml"
    f.write_text("x")
    f.chmod(0o644)
    uid = os.geteuid()
    assert trusted_files.problems([f], uid) == []
    f.chmod(0o664)
    assert trusted_files.problems([f], uid) == [f"{f}: the file is writable by its group (mode 0664); chmod go-w"]
    f.chmod(0o600)
    d.chmod(0o777)
    assert trusted_files.problems([f], uid) == [
        f"{d}: a directory above cluster.yaml is writable by others (mode 0777); chmod go-w"]
    d.chmod(0o755)
    os.chown(f, 65534, -1)
    assert trusted_files.problems([f], uid) == [
        f"{f}: the file is owned by uid 65534, not root or the reconciler's user (uid {uid})"]


def test_a_sticky_root_directory_like_tmp_is_accepted(tmp_path):
    assert stat.S_IMODE(os.stat("/tmp").st_mode) & stat.S_ISVTX
    f = tmp_path / "known_hosts"
    f.write_text("")
    f.chmod(0o644)
    assert trusted_files.problems([f]) == []


def test_the_trusted_paths_are_the_file_the_keys_and_the_known_hosts(base_yaml, tmp_path):
    desired = spec.loads(base_yaml.replace("      host: 10.0.0.1", "      host: 10.0.0.1\n"
                                           "      identity_file: /etc/spark-reconciler/id_ed25519"))
    assert [str(p) for p in trusted_files.trusted_paths(desired, tmp_path / "c.yaml")] == [
        str(tmp_path / "c.yaml"), "/etc/spark-reconciler/known_hosts", "/etc/spark-reconciler/id_ed25519"]


def test_the_mtu_of_the_interface_carrying_the_ssh_session_is_never_changed(base_yaml):
    """A fabric interface that is in fact the management port: MTU 9000 there could cut the node off. With no
    other declared path to the node and the peer's end not at the target either, nothing is run (the repair over
    the twin and the peer's-end rule: tests/unit/steps/test_link_over_twin.py)."""
    from reconciler.core.observed import Link, NodeObservation, Observed
    from reconciler.core.planning import Step
    from reconciler.edge.steps import link
    from reconciler.edge.steps.actions import Given
    from tests.unit.step_driver import Driver, Raw

    desired = spec.loads(base_yaml)
    at_1500 = Link(name="enp1s0f1np1", exists=True, admin_up=True, carrier=True, mtu=1500,
                   addresses=["192.168.200.13/24"])
    head_at_1500 = Link(name="enp1s0f1np1", exists=True, admin_up=True, carrier=True, mtu=1500,
                        addresses=["192.168.200.12/24"])
    driver = Driver(facts={"worker-b links": [(at_1500, at_1500)],
                           "worker-b session-address": [Raw("10.0.0.5 51234 192.168.200.13 22")],
                           "head-a links": [(head_at_1500, None)]})
    given = Given(desired, Observed(nodes={n.name: NodeObservation(name=n.name, reachable=True)
                                           for n in desired.nodes}))
    error = driver.drive(link.converge_link(given, Step("link", "worker-b", "test", ())))
    assert "the reconciler's SSH session arrives on it" in str(error)
    assert not [line for line in driver.transcript if line.startswith("run ")], "nothing was run"


def test_every_plan_lists_what_the_file_trusts(base_yaml, seed_snapshot):
    import json

    from reconciler.cli.plan_text import plan_text
    from reconciler.core.observed import Observed
    from reconciler.core.planning import plan

    observed = Observed.model_validate(json.loads(seed_snapshot.read_text()))
    quiet = plan(spec.loads(base_yaml), observed)
    assert "Trusted" not in plan_text(quiet) and quiet.as_dict()["trusted"] == []
    text = _trust(_docker(base_yaml, "    privileged: true\n"), "  privileged: true\n  remote_code: true\n")
    loud = plan(spec.loads(text), observed)
    assert plan_text(loud).startswith("Trusted beyond the default (trust): privileged containers, the model "
                                      "repository's code (--trust-remote-code).\n")
    assert loud.as_dict()["trusted"] == ["privileged containers", "the model repository's code (--trust-remote-code)"]


@pytest.mark.parametrize("host", ["192.168.1.10", "10.1.230.180", "::1", "localhost"])
def test_the_api_binds_only_where_the_health_checks_can_ask(base_yaml, problems, host):
    [line] = problems(base_yaml.replace("  port: 8000", f"  port: 8000\n  host: \"{host}\""))
    assert "serving.host" in line
