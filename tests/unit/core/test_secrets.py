"""Named secrets (issue 16, finding 5): values from the reconciler's environment, never from the file; only to the
nodes that need them; on docker's stdin, never in an argv; a rotated value restarts serving."""

from __future__ import annotations

import pytest

from reconciler.core import spec
from reconciler.core.vllm import launch_specs

SECRETS = "  secrets: {VLLM_API_KEY: head, HF_TOKEN: internet, WANDB_API_KEY: serving}\n"
VALUES = {"VLLM_API_KEY": "sk-api-0123456789", "HF_TOKEN": "hf_tokenvalue0123456789", "WANDB_API_KEY": "wb-0123456789"}


@pytest.fixture
def text(base_yaml) -> str:
    return base_yaml.replace("  env:\n", SECRETS + "  env:\n", 1)


def test_each_secret_reaches_only_the_nodes_that_need_it(text):
    desired = spec.loads(text).with_secrets(VALUES)
    env = {s.node: s.env for s in launch_specs(desired)}
    assert {k: env["head-a"].get(k) for k in VALUES} == VALUES
    # worker-b is the internet-less worker: no HF token, no API key; the serving-wide one it gets
    assert "HF_TOKEN" not in env["worker-b"] and "VLLM_API_KEY" not in env["worker-b"]
    assert env["worker-b"]["WANDB_API_KEY"] == VALUES["WANDB_API_KEY"]


def test_values_travel_on_stdin_never_in_the_argv(text):
    desired = spec.loads(text).with_secrets(VALUES)
    for s in launch_specs(desired):
        argv = " ".join(s.run_argv(1, env_file="/dev/stdin") + list(s.serve_exec or ()))
        assert not [v for v in VALUES.values() if v in argv]
        assert all(f"{k}={v}\n" in s.env_file_text() for k, v in desired.secrets_for(desired.node(s.node)).items())


def test_a_rotated_value_changes_the_spec_hash_and_the_label_never_holds_it(text):
    desired = spec.loads(text)
    before = launch_specs(desired.with_secrets(VALUES))[0]
    after = launch_specs(desired.with_secrets(VALUES | {"VLLM_API_KEY": "sk-api-rotated-999"}))[0]
    assert before.spec_hash != after.spec_hash
    assert VALUES["VLLM_API_KEY"] not in " ".join(before.run_argv(1, env_file="/dev/stdin"))
    assert desired.with_secrets(VALUES) != desired.with_secrets(VALUES | {"HF_TOKEN": "hf_other_value_0000"})


def test_a_missing_secret_is_a_placed_problem_and_nothing_loads(tmp_path, text):
    path = tmp_path / "cluster.yaml"
    path.write_text(text)
    with pytest.raises(spec.InvalidDesiredState) as info:
        spec.load(path, {"VLLM_API_KEY": "sk-api-0123456789", "HF_TOKEN": ""})
    line = next(i for i, t in enumerate(text.splitlines(), 1) if "secrets:" in t)
    why = "is not set in the reconciler's environment (systemd: EnvironmentFile=, see docs/security.md)"
    assert info.value.lines() == [
        f"{path}:{line}:{SECRETS.index(name) + 1}: serving.secrets.{name}: {name} {why}"
        for name in ("HF_TOKEN", "WANDB_API_KEY")]
    assert spec.load(path, VALUES).secret("HF_TOKEN") == VALUES["HF_TOKEN"]


@pytest.mark.parametrize("name", ["HF_TOKEN", "VLLM_API_KEY", "hf_token", "MY_SECRET", "DB_PASSWORD"])
def test_a_secret_in_plain_env_is_refused(problems, base_yaml, name):
    """The documented path used to be `env: {HF_TOKEN: ...}` in the file: on every node, in every export."""
    lines = problems(base_yaml.replace('    VLLM_ENGINE_READY_TIMEOUT_S: "3600"', f"    {name}: x", 1))
    assert len(lines) == 1 and f"{name} looks like a secret; declare it in serving.secrets" in lines[0]


def test_the_model_dump_never_holds_a_value(text):
    desired = spec.loads(text).with_secrets(VALUES)
    dumped = str(desired.model_dump(mode="json"))
    assert not [v for v in VALUES.values() if v in dumped]
