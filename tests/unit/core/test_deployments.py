"""`deployments:`, a list, and the single form it grew from (issue 35): every file written before the list means
what it meant, and a file of several deployments is held to the rules across them.

The oracle for "means what it meant" is the file's single form itself: the same file rewritten as a list of one
`default` deployment must render the same launches, the same plan against the recorded seed, the same
fingerprint (so an upgrade makes no new generation) and the same dump.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from ruamel.yaml import YAML

from reconciler.core import spec
from reconciler.core.observed import Observed
from reconciler.core.planning import plan
from reconciler.core.vllm import launch_specs
from tests.unit.conftest import BASE_YAML

REPO = Path(__file__).resolve().parents[3]
SAMPLES = {p.relative_to(REPO).as_posix(): p.read_text() for p in
           [*(REPO / "desired-state").glob("*.yaml"), *(REPO / "reconciler" / "files" / "examples").glob("*.yaml")]}
SAMPLES["tests/unit/conftest.py:BASE_YAML"] = BASE_YAML


def _text(data: dict) -> str:
    out = io.StringIO()
    YAML().dump(data, out)
    return out.getvalue() + "...\n"


def _data(text: str) -> dict:
    data = YAML(typ="safe").load(text)
    assert isinstance(data, dict)
    return data


def as_list(text: str, name: str = spec.SINGLE) -> str:
    """The single-form file `text` rewritten in the list form, its model and serving the one deployment `name`."""
    data = _data(text)
    one = {"name": name, "model": data.pop("model"), "serving": data.pop("serving")}
    return _text({"nodes": data.pop("nodes"), "deployments": [one], **data})


def _seed(seed_snapshot: Path) -> Observed:
    return Observed.model_validate(json.loads(seed_snapshot.read_text()))


@pytest.mark.parametrize("sample", sorted(SAMPLES))
def test_every_sample_means_in_the_list_form_what_it_meant(sample, seed_snapshot):
    single = spec.loads(SAMPLES[sample], sample)
    listed = spec.loads(as_list(SAMPLES[sample]), sample)
    assert listed.deployment_names == [spec.SINGLE] == single.deployment_names
    assert launch_specs(listed) == launch_specs(single)
    assert listed.fingerprint() == single.fingerprint()
    assert listed.model_dump() == single.model_dump()
    assert "deployments" not in single.model_dump() and {"model", "serving"} <= single.model_dump().keys()
    seed = _seed(seed_snapshot)
    if {n.name for n in single.nodes} <= set(seed.nodes):
        assert plan(listed, seed) == plan(single, seed)


def test_a_named_single_deployment_renders_the_same_launches_and_dumps_as_a_list():
    single = spec.loads(BASE_YAML)
    named = spec.loads(as_list(BASE_YAML, "glm"))
    assert named.deployment_names == ["glm"]
    assert launch_specs(named) == launch_specs(single)
    assert [d["name"] for d in named.model_dump()["deployments"]] == ["glm"]
    assert "model" not in named.model_dump()


def _two(**second: object) -> str:
    """BASE_YAML's deployment as `big`, with a second one `small` on the head beside it."""
    data = _data(as_list(BASE_YAML, "big"))
    big = data["deployments"][0]
    small = json.loads(json.dumps(big))
    small["name"] = "small"
    small["serving"] |= {"container_name": "vllm_small", "port": 8001, "nodes": [data["nodes"][0]["name"]],
                         "tensor_parallel_size": 1, "gpu_memory_utilization": 0.1, "master_port": 29511,
                         "ray_port": 6389}
    small["serving"] |= second
    data["deployments"].append(small)
    return _text(data)


def _line_of(text: str, needle: str, after: str = "") -> int:
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if after in line) if after else 0
    return next(i for i, line in enumerate(lines) if i >= start and needle in line) + 1


def test_two_deployments_validate_and_each_has_its_view():
    d = spec.loads(_two())
    assert d.deployment_names == ["big", "small"]
    assert [v.deployment.name for v in d.views()] == ["big", "small"]
    assert d.view("small").serving.port == 8001 and [n.name for n in d.view("small").serving_nodes] == ["head-a"]
    with pytest.raises(spec.SeveralDeployments, match="big, small"):
        _ = d.serving
    with pytest.raises(KeyError, match="no deployment 'nope'"):
        d.view("nope")


def test_a_second_deployment_on_the_same_port_is_refused_at_its_line(problems):
    text = _two(port=8000)
    line = _line_of(text, "port: 8000", after="name: small")
    assert problems(text) == [f"X:{line}:11: deployments[1].serving.port: port 8000 is deployment 'big''s serving.port "
                              "on head-a (the host network: one listener a port)"]


def test_ports_a_deployment_does_not_bind_are_free_to_repeat(problems):
    """The single-node deployment starts no rendezvous and no Ray: its defaults may equal the big one's."""
    assert problems(_two(master_port=29501, ray_port=6379)) == []


def test_deployments_on_other_nodes_may_share_ports(problems, edit):
    data = _data(_two(port=8000))
    data["deployments"][0]["serving"] |= {"nodes": [data["nodes"][0]["name"]], "tensor_parallel_size": 1}
    data["deployments"][1]["serving"] |= {"nodes": [data["nodes"][1]["name"]]}
    if data["deployments"][0]["model"].get("source") == data["nodes"][1]["name"]:
        pytest.fail("the base file's source is the head")
    found = problems(_text(data))
    assert not any("port" in p for p in found), found


def test_an_over_committed_node_is_refused_with_the_numbers(problems):
    text = _two(gpu_memory_utilization=0.5)
    base = spec.loads(BASE_YAML).serving.gpu_memory_utilization
    line = _line_of(text, "gpu_memory_utilization: 0.5", after="name: small")
    assert problems(text) == [f"X:{line}:29: deployments[1].serving.gpu_memory_utilization: node 'head-a' is "
                              f"over-committed: big {base:g} + small 0.5 = {base + 0.5:g} of its memory (at most 0.9, "
                              "policy.gpu_memory_utilization_ceiling: a GB10 also holds each instance's memory "
                              "outside its pool and the OS's)"]


def test_fractions_that_add_up_to_the_ceiling_pass_and_a_hair_more_does_not(problems):
    base = spec.loads(BASE_YAML).serving.gpu_memory_utilization
    assert problems(_two(gpu_memory_utilization=round(0.9 - base, 6))) == []
    assert problems(_two(gpu_memory_utilization=round(0.9 - base + 0.001, 6)))


def test_names_and_container_names_are_unique(problems):
    data = _data(_two(container_name="vllm_serving"))
    data["deployments"][1]["name"] = "big"
    found = problems(_text(data))
    assert any("deployments[1].name: duplicate deployment name 'big'" in p for p in found), found


def test_a_container_name_twice_is_refused(problems):
    found = problems(_two(container_name=spec.loads(BASE_YAML).serving.container_name))
    assert len(found) == 1 and "container name 'vllm_serving' is deployment 'big''s already" in found[0], found


def test_both_forms_at_once_are_refused_at_the_single_forms_key(problems):
    data = _data(_two())
    data["model"] = data["deployments"][0]["model"]
    text = _text(data)
    top = next(i for i, line in enumerate(text.splitlines()) if line.startswith("model:")) + 1
    assert problems(text) == [f"X:{top}:1: model: declare either `model:` and `serving:` "
                              "(one deployment) or `deployments:`, not both"]


def test_a_single_forms_problem_is_placed_at_its_own_path(problems, edit):
    """The single form's one deployment is `deployments.0` inside; the operator's file says `serving.port`."""
    found = problems(edit(("port: 8000", "port: 0")))
    assert len(found) == 1 and ": serving.port: " in found[0] and "deployments" not in found[0], found
    found = problems(edit(("tensor_parallel_size: 2", "tensor_parallel_size: 3")))
    assert found and all(": serving.tensor_parallel_size: " in p for p in found), found


def test_a_bad_deployment_name_is_refused(problems):
    data = _data(_two())
    data["deployments"][1]["name"] = "Small_One"
    found = problems(_text(data))
    assert len(found) == 1 and "deployments[1].name: 'Small_One' is not a valid deployment name" in found[0], found


def test_secrets_of_every_deployment_come_from_the_environment_and_a_missing_one_is_placed(tmp_path):
    data = _data(_two())
    data["deployments"][1]["serving"]["secrets"] = {"EMBED_KEY": "head"}
    path = tmp_path / "c.yaml"
    path.write_text(text := _text(data))
    d = spec.load(path, {"EMBED_KEY": "k"})
    assert d.secret("EMBED_KEY") == "k" and d.view("small").secret_names_for(d.head) == ["EMBED_KEY"]
    assert d.view("big").secret_names_for(d.head) == []
    with pytest.raises(spec.InvalidDesiredState) as info:
        spec.load(path, {})
    assert info.value.lines()[0].startswith(f"{path}:{_line_of(text, 'EMBED_KEY')}:")
    assert "deployments[1].serving.secrets.EMBED_KEY: EMBED_KEY is not set" in info.value.lines()[0]


def test_the_schema_takes_either_form():
    schema = spec.json_schema()
    assert schema["required"] == ["nodes"]
    forms = [set(f["required"]) for f in schema["oneOf"]]
    assert forms == [{"deployments"}, {"model", "serving"}]
    assert schema["properties"]["model"]["$ref"] == "#/$defs/Model" and "Model" in schema["$defs"]
    assert schema["properties"]["serving"]["$ref"] == "#/$defs/Serving" and "Serving" in schema["$defs"]


def test_validate_takes_a_file_of_several_deployments_as_the_daemon_does(tmp_path, console_script):
    """A file of several deployments is served: `validate` (which judges as the daemon takes a file) passes it,
    and refuses the same file over-committed, at its line."""
    import subprocess

    path = tmp_path / "two.yaml"
    path.write_text(_two())
    result = subprocess.run([console_script, "validate", "--skip-secrets", str(path)], capture_output=True,
                            text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stderr
    path.write_text(text := _two(gpu_memory_utilization=0.5))
    result = subprocess.run([console_script, "validate", "--skip-secrets", str(path)], capture_output=True,
                            text=True, timeout=60, check=False)
    line = _line_of(text, "gpu_memory_utilization: 0.5", after="name: small")
    assert result.returncode == 3 and f"{path}:{line}:29: deployments[1].serving.gpu_memory_utilization: node " \
        "'head-a' is over-committed" in result.stderr


def test_the_testbeds_mix_validates_and_each_deployment_keeps_its_launch():
    """testbed.api.with_embeddings (the e2e's and the bench's mix): the testbed's file plus an embeddings server
    on the worker validates, and the first deployment renders exactly the launch it had alone (no restart)."""
    from testbed.api import EMBED_PORT, with_embeddings

    single = spec.loads(SAMPLES["desired-state/testbed.yaml"])
    mix = spec.loads(_text(with_embeddings(_data(SAMPLES["desired-state/testbed.yaml"]))))
    assert mix.deployment_names == ["moe", "embed"]
    assert launch_specs(mix.view("moe")) == launch_specs(single)
    [embed] = launch_specs(mix.view("embed"))
    assert embed.node == "worker" and f"--port {EMBED_PORT}" in " ".join(embed.command)
    assert "--runner pooling" in " ".join(embed.command)
