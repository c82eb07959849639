"""Properties of the launch specs (reconciler/core/vllm.py), each judged by an oracle that does not call the code under
test: a node's own fabric section, and the `docker run` the spec renders.

Two mutants of record (tests/named_mutants.py) survived the example tests: every node taking the head's interface
name (what breaks asymmetric cabling, sparkrun #135), and env left out of the spec hash (an edit of serving.env
silently not applied).
"""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from reconciler.core import spec
from reconciler.core.observed import LABEL_INSTANCE, LABEL_LAUNCH, parse_launch_label
from reconciler.core.vllm import launch_specs
from tests.unit.examples import examples
from tests.unit.strategies import desired_dict, desireds

SETTINGS = settings(**examples(100), deadline=None, suppress_health_check=[HealthCheck.too_slow])
INTERFACE_ENV = ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "TP_SOCKET_IFNAME", "UCX_NET_DEVICES",
                 "OMPI_MCA_btl_tcp_if_include")


@SETTINGS
@given(desireds())
def test_each_rank_is_configured_with_its_own_nodes_fabric(desired):
    for s in launch_specs(desired):
        node = desired.node(s.node)
        assert {s.env[k] for k in INTERFACE_ENV} == {node.fabric.interface}, (s.node, s.env)
        assert s.env["VLLM_HOST_IP"] == str(node.fabric.address.ip)
        assert s.env["MASTER_ADDR"] == str(desired.head.fabric.address.ip)
        if node.fabric.rdma_device:
            assert s.env["NCCL_IB_HCA"] == node.fabric.rdma_device
        if desired.serving.launcher == "ray":
            ip = s.command[s.command.index("--node-ip-address") + 1]
            assert ip == str(node.fabric.address.ip)


def what_runs(s) -> tuple:
    """Everything a started container runs with, read off the `docker run` argv it is started with (env inline,
    labels dropped: they carry the hash itself and the owner), plus the Ray head's serve command and list."""
    argv = s.run_argv(generation=0)
    kept = [a for i, a in enumerate(argv) if a != "--label" and (i == 0 or argv[i - 1] != "--label")]
    return tuple(kept), s.serve_exec, s.keep_local


def _set(path: tuple, value):
    def edit(raw: dict) -> dict:
        at = raw
        for key in path[:-1]:
            at = at[key] if isinstance(at, list) else at.setdefault(key, {})
        at[path[-1]] = value
        return raw
    return edit


EDITS = {
    "env": _set(("serving", "env"), {"VLLM_LOGGING_LEVEL": "INFO", "EXTRA": "1"}),
    "served_model_name": _set(("serving", "served_model_name"), "renamed"),
    "image": _set(("serving", "image"), "vllm-standin:next"),
    "ipc": _set(("serving", "docker", "ipc"), "private"),
    "ulimits": _set(("serving", "docker", "ulimits"), {"nofile": "65536"}),
    "extra_args": _set(("serving", "extra_args"), ["--enforce-eager"]),
    "gpu_memory_utilization": _set(("serving", "gpu_memory_utilization"), 0.7),
    "max_model_len": _set(("serving", "max_model_len"), 2048),
    "port": _set(("serving", "port"), 8001),
    "revision": _set(("model", "revision"), "2" * 40),
    "model path": _set(("model", "path"), "/srv/other/hub"),
    "compile_cache": _set(("serving", "compile_cache"), "/var/cache/vllm-compile"),
    "head address": _set(("nodes", 0, "fabric", "address"), "10.232.0.99/24"),
    "worker interface": _set(("nodes", 1, "fabric", "interface"), "enP2p1s0f1np1"),
}


@SETTINGS
@given(n=st.integers(2, 4), launcher=st.sampled_from(["native", "ray"]),
       layout=st.sampled_from(["hf-cache", "plain"]), edit=st.sampled_from(sorted(EDITS)))
def test_the_spec_hash_changes_exactly_when_what_runs_changes(n, launcher, layout, edit):
    raw = desired_dict(n_nodes=n, tp=n, launcher=launcher, layout=layout, env={"VLLM_LOGGING_LEVEL": "DEBUG"})
    before = {s.node: s for s in launch_specs(spec.Desired.model_validate(raw))}
    after = {s.node: s for s in launch_specs(spec.Desired.model_validate(EDITS[edit](raw)))}
    for node, old in before.items():
        new = after[node]
        assert (old.spec_hash == new.spec_hash) == (what_runs(old) == what_runs(new)), (edit, node)


def test_every_edit_changes_what_some_rank_runs():
    """The edits above are real changes (else the property would hold vacuously)."""
    raw = desired_dict(n_nodes=2, tp=2, env={"VLLM_LOGGING_LEVEL": "DEBUG"})
    base = {s.node: what_runs(s) for s in launch_specs(spec.Desired.model_validate(raw))}
    for name, edit in EDITS.items():
        changed = {s.node: what_runs(s) for s in launch_specs(spec.Desired.model_validate(edit(desired_dict(
            n_nodes=2, tp=2, env={"VLLM_LOGGING_LEVEL": "DEBUG"}))))}
        assert changed != base, name


def test_the_owner_is_a_label_not_part_of_the_hash():
    """Who owns a container (the instance) names it; it is not part of what runs, so moving the head's SSH
    port does not restart serving."""
    raw = desired_dict()
    a = launch_specs(spec.Desired.model_validate(raw))
    raw["nodes"][0]["ssh"]["port"] = 2222
    b = launch_specs(spec.Desired.model_validate(raw))
    assert [s.spec_hash for s in a] == [s.spec_hash for s in b]
    labels = [x for s in b for x in s.run_argv(0) if x.startswith(LABEL_INSTANCE)]
    assert labels and all(x.endswith(":2222") for x in labels)


def docker_run(argv: list[str]) -> dict:
    """The parts of a `docker run` argv the reconciler relies on, read the way the docker CLI reads them: options
    before the image, `--label K=V` and `-e K=V` repeatable, then the image and its command."""
    assert argv[0] == "run"
    out: dict = {"labels": {}, "env": {}, "flags": []}
    i = 1
    takes_value = {"--name", "--label", "-e", "--env-file"}
    while argv[i].startswith("-"):
        flag = argv[i]
        if flag in takes_value:
            value = argv[i + 1]
            if flag == "--label":
                out["labels"].__setitem__(*value.split("=", 1))
            elif flag == "-e":
                out["env"].__setitem__(*value.split("=", 1))
            else:
                out[flag] = value
            i += 2
        else:
            out["flags"].append(flag)
            i += 1 if flag in ("-d", "--privileged") else 2  # docker run's boolean options used here
    out["image"], out["command"] = argv[i], argv[i + 1:]
    return out


@SETTINGS
@given(desireds(), st.integers(min_value=0, max_value=99))
def test_docker_runs_each_rank_detached_named_and_labelled_for_the_next_observe(desired, generation):
    """What the next observe and diff read back off the container: its name, the owner, the spec hash, the
    launch inputs, the generation, the role and the ports rank 0 listens on (read off its own argv: every
    `--port` and, with more than one node, `--master-port`); detached, so the step returns; env inline or from
    the file, never both."""
    for s in launch_specs(desired):
        run = docker_run(s.run_argv(generation))
        assert "-d" in run["flags"] and run["--name"] == s.container_name
        argv = [*s.command, *(s.serve_exec or ())]
        listens = {argv[i + 1] for i, a in enumerate(argv) if a in ("--port", "--master-port")} if s.rank == 0 \
            else set()
        ports = run["labels"].pop("spark-reconciler.ports")
        assert set(filter(None, ports.split(","))) == listens
        # the tree it serves: the read-only model mount itself (plain), or the model's own tree in the mounted hub
        served = run["labels"].pop("spark-reconciler.weights")
        flags = list(s.docker_flags)
        mounted = [flags[i + 1].split(":")[0] for i, f in enumerate(flags)
                   if f == "-v" and flags[i + 1].endswith(":ro")]
        hub_tree = f"models--{desired.model.id.replace('/', '--')}"
        assert served in mounted or any(served == f"{m}/{hub_tree}" for m in mounted)
        # what the launch was rendered from, for the next plan's field diff: read back as written
        assert parse_launch_label(run["labels"].pop(LABEL_LAUNCH)) == s.inputs
        assert run["labels"] == {"spark-reconciler.managed": "true", "spark-reconciler.spec-hash": s.spec_hash,
                                 "spark-reconciler.generation": str(generation),
                                 "spark-reconciler.role": "head" if s.rank == 0 else "worker",
                                 LABEL_INSTANCE: desired.instance}
        assert run["env"] == s.env and (run["image"], tuple(run["command"])) == (s.image, s.command)
        from_file = docker_run(s.run_argv(generation, env_file="/dev/stdin"))
        assert from_file["env"] == {} and from_file["--env-file"] == "/dev/stdin"
        lines = s.env_file_text().splitlines()
        assert dict(line.split("=", 1) for line in lines) == s.env and len(lines) == len(s.env)
