"""Issue 7: the one quoting function and the border validators. Whatever text a field holds, it is either
rejected by `spec` or becomes exactly one word of the remote command line (the e2e half, tests/e2e/test_security.py,
records what a real sshd-side program receives)."""

from __future__ import annotations

import shlex

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import TypeAdapter, ValidationError

from reconciler.core import spec
from reconciler.edge import ssh
from tests.unit.examples import examples

TEXT = st.text(st.characters(exclude_characters="\x00", exclude_categories=("Cs",)), max_size=60)
SHELLY = st.lists(st.sampled_from(list("a-_./:=$`'\"\\;|&<>(){}[]*?!~# \t\n") + ["$(id)", "`id`"]),
                  max_size=20).map("".join)


@settings(**examples(400))
@given(argv=st.lists(st.one_of(TEXT, SHELLY), min_size=1, max_size=6))
def test_quote_round_trips_through_a_posix_shell_split(argv):
    assert shlex.split(ssh.quote(argv)) == argv


@settings(**examples(200))
@given(value=st.one_of(TEXT, SHELLY))
def test_a_quoted_value_is_one_word_even_next_to_others(value):
    line = ssh.quote(["cmd", value, "--flag"])
    assert shlex.split(line) == ["cmd", value, "--flag"]


SAFE = {
    "container_name": spec.ContainerName, "interface": spec.InterfaceName, "path": spec.AbsPath,
    "model_id": spec.ModelId, "revision": spec.Revision, "image": spec.ImageRef, "node": spec.NodeName,
    "user": spec.SshUser, "host": spec.HostName, "served_name": spec.ServedName, "env_name": spec.EnvName,
}
META = set("$`'\"\\;|&<>(){}*?!~# \t\n")


@settings(**examples(300))
@given(field=st.sampled_from(sorted(SAFE)), value=st.one_of(TEXT, SHELLY))
def test_names_paths_and_refs_accept_no_shell_metacharacter(field, value):
    try:
        accepted = TypeAdapter(SAFE[field]).validate_python(value)
    except ValidationError:
        return
    assert not (set(accepted) & META), (field, accepted)
    assert shlex.quote(accepted) == accepted, "needs no quoting at all"
    assert not accepted.startswith("-") or field == "path", "cannot be taken for an option"


@settings(**examples(300))
@given(value=st.one_of(TEXT, SHELLY))
def test_env_values_and_extra_args_are_free_text_but_one_word(value):
    for kind in (spec.EnvValue, spec.ExtraArg):
        try:
            accepted = TypeAdapter(kind).validate_python(value)
        except ValidationError:
            continue
        assert "\n" not in accepted and "\r" not in accepted if kind is spec.EnvValue else True
        assert shlex.split(ssh.quote(["vllm", accepted])) == ["vllm", accepted]


def test_env_values_cannot_inject_a_second_env_file_line():
    with pytest.raises(ValidationError):
        TypeAdapter(spec.EnvValue).validate_python("x\nLD_PRELOAD=/tmp/evil.so")


def test_path_traversal_is_rejected():
    with pytest.raises(ValidationError):
        TypeAdapter(spec.AbsPath).validate_python("/srv/models/../../etc")


def _allowed(base_yaml: str) -> list[tuple[str, ...]]:
    from reconciler.core import spec

    desired = spec.loads(base_yaml.replace("  resync_interval: 30s", "  resync_interval: 30s\n  drop_caches: true"))
    return ssh.sudo_commands(desired, desired.nodes[1])


@pytest.mark.parametrize("argv", [
    ["/usr/sbin/ip", "link", "set", "dev", "enp1s0f1np1", "mtu", "9000"],
    ["/usr/sbin/ip", "link", "set", "dev", "enp1s0f1np1", "up"],
    ["/usr/sbin/ip", "addr", "add", "192.168.200.13/24", "dev", "enp1s0f1np1"],
    ["/usr/sbin/sysctl", "-w", "vm.drop_caches=3"],
])
def test_sudo_allows_exactly_the_nodes_commands(argv, base_yaml):
    assert ssh.sudo_argv(argv, _allowed(base_yaml)) == ["sudo", "-n", *argv]


@pytest.mark.parametrize("argv", [
    ["/usr/sbin/ip", "link", "set", "dev"],
    ["/usr/sbin/ip", "link", "set", "dev", "enP7s7", "down"],                 # the management port (issue 16)
    ["/usr/sbin/ip", "link", "set", "dev", "enp1s0f1np1", "down"],
    ["/usr/sbin/ip", "link", "set", "dev", "enp1s0f1np1", "mtu", "1500"],     # not the declared MTU
    ["/usr/sbin/ip", "addr", "add", "10.0.0.99/24", "dev", "enp1s0f1np1"],   # not the declared address
    ["/usr/sbin/ip", "addr", "add", "192.168.200.13/24", "dev", "enP7s7"],
    ["/usr/sbin/ip", "link", "delete", "enp1s0f1np1"],
    ["/usr/sbin/sysctl", "-w", "vm.drop_caches=3", "kernel.panic=1"],
    ["/usr/sbin/sysctl", "-w", "kernel.panic=1"],
    ["ip", "link", "set", "dev", "enp1s0f1np1", "up"],                       # not the absolute path sudoers has
    ["/bin/sh", "-c", "/usr/sbin/ip link set dev enp1s0f1np1 up"],
    ["sudo", "/usr/sbin/ip", "link", "set", "dev", "enp1s0f1np1", "up"],
])
def test_sudo_refuses_anything_else(argv, base_yaml):
    with pytest.raises(PermissionError):
        ssh.sudo_argv(argv, _allowed(base_yaml))


def test_the_sudoers_lines_are_the_commands_the_code_may_send(base_yaml):
    from reconciler.core import spec

    desired = spec.loads(base_yaml)
    text = ssh.sudoers_snippet(desired)
    assert "*" not in text.split("\n", 3)[3]
    for node in desired.nodes:
        line = next(t for t in text.splitlines() if t.startswith(f"{node.ssh.user} ALL=(root) NOPASSWD: ")
                    and text.splitlines()[text.splitlines().index(t) - 1] == f"# on {node.name}")
        assert line.split("NOPASSWD: ", 1)[1].split(", ") == [" ".join(c) for c in ssh.sudo_commands(desired, node)]


def test_launch_argv_carries_no_env_value_with_an_env_file():
    from pathlib import Path

    from reconciler.core.vllm import launch_specs

    text = (Path(__file__).resolve().parents[3] / "desired-state" / "testbed.yaml").read_text()
    desired = spec.loads(text.replace("  docker:\n", "  secrets: {HF_TOKEN: serving}\n  docker:\n", 1)
                         ).with_secrets({"HF_TOKEN": "hf_secret_value"})
    for s in launch_specs(desired):
        with_file = s.run_argv(1, env_file="/tmp/spark-reconciler-env.abc")
        assert "hf_secret_value" not in " ".join(with_file)
        assert with_file[with_file.index("--env-file") + 1] == "/tmp/spark-reconciler-env.abc"
        assert "HF_TOKEN=hf_secret_value\n" in s.env_file_text()
        assert s.env_file_text().count("\n") == len(s.env)
        # the same launch otherwise: only how the env travels differs (and the hash is over the env itself)
        legacy = s.run_argv(1)
        i = legacy.index("-e")
        assert legacy[:i] == with_file[:i] and legacy[i + 2 * len(s.env):] == with_file[i + 2:]
