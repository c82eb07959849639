"""The launch carries what the field learned on GB10 (docs/troubleshooting.md "Field lessons"): eugr's memory
defaults on every node, NGC's ulimits, no --shm-size beside --ipc host, sync before drop_caches (on by default; the
commands, a sync past its deadline and a sudoers without the line: tests/unit/step_cases/serving.py)."""

from __future__ import annotations

from reconciler.core.loader import load_file
from reconciler.core.observed import Observed
from reconciler.core.spec import Desired
from reconciler.core.vllm import launch_specs


def _desired(cluster_yaml, **serving_fields) -> Desired:
    data = load_file(cluster_yaml).data
    for key, value in serving_fields.items():
        if isinstance(value, dict) and isinstance(data["serving"].get(key), dict):
            data["serving"][key] = {**data["serving"][key], **value}
        else:
            data["serving"][key] = value
    return Desired.model_validate(data)


def _flag_values(flags: tuple[str, ...], name: str) -> list[str]:
    return [flags[i + 1] for i, f in enumerate(flags) if f == name]


def test_gb10_memory_defaults_on_every_node_and_overridable(cluster_yaml):
    for spec in launch_specs(_desired(cluster_yaml)):
        assert spec.env["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
        assert spec.env["NCCL_IGNORE_CPU_AFFINITY"] == "1"
    own = launch_specs(_desired(cluster_yaml, env={"PYTORCH_CUDA_ALLOC_CONF": "garbage_collection_threshold:0.6"}))
    assert {s.env["PYTORCH_CUDA_ALLOC_CONF"] for s in own} == {"garbage_collection_threshold:0.6"}


def test_ngc_ulimits_by_default(cluster_yaml):
    for spec in launch_specs(_desired(cluster_yaml)):
        assert {"stack=67108864", "memlock=-1"} <= set(_flag_values(spec.docker_flags, "--ulimit"))


def test_a_partial_ulimits_merges_over_the_defaults_and_null_removes_one(cluster_yaml):
    """Issue 29, finding 9: naming only `nofile` used to replace the whole default map, so the containers lost
    memlock=-1 (NCCL's RDMA registration) and the 64 MiB stack without a word."""
    only_nofile = launch_specs(_desired(cluster_yaml, docker={"ulimits": {"nofile": "16384:16384"}}))[0]
    assert _flag_values(only_nofile.docker_flags, "--ulimit") == ["memlock=-1", "nofile=16384:16384",
                                                                  "stack=67108864"]
    removed = launch_specs(_desired(cluster_yaml, docker={"ulimits": {"memlock": None, "core": "0"}}))[0]
    assert _flag_values(removed.docker_flags, "--ulimit") == ["core=0", "nofile=1048576:1048576", "stack=67108864"]


def test_the_plan_shows_the_effective_ulimits_with_every_start(cluster_yaml, seed_snapshot):
    import json

    from reconciler.cli.plan_text import plan_text
    from reconciler.core.planning import plan

    desired = _desired(cluster_yaml, docker={"ulimits": {"nofile": "4096", "stack": None}})
    result = plan(desired, Observed.model_validate(json.loads(seed_snapshot.read_text())))
    assert any(s.kind == "start-serving" for s in result.steps)
    assert result.as_dict()["ulimits"] == ["memlock=-1", "nofile=4096"]
    assert "Serving starts with ulimits memlock=-1 nofile=4096 (serving.docker.ulimits merged" in plan_text(result)


def test_shm_size_only_where_docker_honours_it(cluster_yaml):
    host = launch_specs(_desired(cluster_yaml, docker={"ipc": "host", "shm_size": "64g"}))
    private = launch_specs(_desired(cluster_yaml, docker={"ipc": "private", "shm_size": "64g"}))
    assert all("--shm-size" not in s.docker_flags for s in host)
    assert all(_flag_values(s.docker_flags, "--shm-size") == ["64g"] for s in private)


def test_compile_caches_are_kept_per_node_in_the_ssh_users_home(cluster_yaml):
    desired = _desired(cluster_yaml)
    for spec in launch_specs(desired):
        user = desired.node(spec.node).ssh.user
        volumes = set(_flag_values(spec.docker_flags, "-v"))
        assert {f"/home/{user}/.cache/vllm:/root/.cache/vllm", f"/home/{user}/.triton:/root/.triton",
                f"/home/{user}/.cache/flashinfer:/root/.cache/flashinfer", f"/home/{user}/.tilelang:/root/.tilelang"} \
            <= volumes
        assert spec.env["TORCHINDUCTOR_CACHE_DIR"] == "/root/.cache/vllm/inductor"  # else /tmp, lost with it
    elsewhere = launch_specs(_desired(cluster_yaml, compile_cache="/data/compile"))
    assert "/data/compile/triton:/root/.triton" in _flag_values(elsewhere[0].docker_flags, "-v")
    off = launch_specs(_desired(cluster_yaml, compile_cache=None))
    assert all(not any(".cache/vllm" in v for v in _flag_values(s.docker_flags, "-v")) for s in off)
    assert all("TORCHINDUCTOR_CACHE_DIR" not in s.env for s in off)


def test_sleep_mode_gets_no_expandable_segments(cluster_yaml):
    """vLLM's sleep-mode allocator asserts expandable segments are off (vllm/device_allocator/cumem.py)."""
    for flag in ("--enable-sleep-mode", "--enable_sleep_mode"):
        specs = launch_specs(_desired(cluster_yaml, extra_args=[flag]))
        assert all("PYTORCH_CUDA_ALLOC_CONF" not in s.env for s in specs)
        assert all(s.env["NCCL_IGNORE_CPU_AFFINITY"] == "1" for s in specs)


def test_the_cache_is_dropped_before_every_start_by_default(cluster_yaml):
    """The trigger is the cache, not a shortage (issue 30, finding 3): on GB10 the GPU cannot use what MemAvailable
    counts as free, so the drop is on unless the file turns it off."""
    data = load_file(cluster_yaml).data
    data["policy"].pop("drop_caches", None)
    assert Desired.model_validate(data).policy.drop_caches
