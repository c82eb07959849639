"""The launch carries what the field learned on GB10 (docs/troubleshooting.md "Field lessons"): eugr's memory
defaults on every node, NGC's ulimits, no --shm-size beside --ipc host, sync before drop_caches."""

from __future__ import annotations

from types import SimpleNamespace

from reconciler.core.loader import load_file
from reconciler.core.observed import Observed
from reconciler.core.spec import Desired
from reconciler.core.vllm import launch_specs
from reconciler.edge.steps import serving
from testbed.recordings import answer


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

    from reconciler.core.observed import Observed
    from reconciler.core.planning import plan
    from reconciler.core.render import plan_text

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


def test_dirty_pages_are_written_and_the_cache_dropped_before_every_start(cluster_yaml):
    """The trigger is the cache, not a shortage (issue 30, finding 3): with MemAvailable ample, the cache is still
    dropped first, because on GB10 the GPU cannot use what MemAvailable counts as free. On by default."""
    data = load_file(cluster_yaml).data
    data["policy"].pop("drop_caches", None)
    desired = Desired.model_validate(data)
    assert desired.policy.drop_caches, "on by default"
    calls = []
    free = iter([100])  # GiB available: plenty, and one read only (after the drop)

    class Session:
        def run(self, argv, timeout, sudo=False, check=True):
            calls.append((argv, sudo))
            return SimpleNamespace(stdout="", exit_code=0)

        def run_script(self, script, timeout):  # the meminfo fragment of reconciler.edge.probes
            assert "/proc/meminfo" in script
            return SimpleNamespace(stdout=answer(script, f"@@meminfo\nMemTotal: {120 << 20} kB\n"
                                          f"MemAvailable: {next(free) << 20} kB\n@@rc 0\n"), exit_code=0)

    ctx = SimpleNamespace(desired=desired, sessions={"n": Session()}, command_timeout=5, remaining=lambda t=None: 60,
                          observed=Observed(nodes={}))
    serving.memory_preflight(ctx, "n")
    ran = [argv[0] for argv, _ in calls]
    assert ran == ["sync", "/usr/sbin/sysctl"]
    assert [sudo for argv, sudo in calls if argv[0] == "sync"] == [False], "sync needs no root (no sudo rule)"


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


def test_a_sync_past_its_deadline_does_not_hold_the_start(cluster_yaml):
    from reconciler.edge.ssh import CommandTimeout

    data = load_file(cluster_yaml).data
    data["policy"]["drop_caches"] = True
    desired = Desired.model_validate(data)
    free = iter([100])
    ran, events = [], []

    class Session:
        def run(self, argv, timeout, sudo=False, check=True):
            ran.append(argv[0])
            if argv[0] == "sync":
                assert argv[1:] == ["-f", desired.model.path_on("n")], "only the weights' filesystem"
                raise CommandTimeout("n", "sync did not finish")
            return SimpleNamespace(stdout="", exit_code=0)

        def run_script(self, script, timeout):  # the meminfo fragment of reconciler.edge.probes
            return SimpleNamespace(stdout=answer(script, f"@@meminfo\nMemTotal: {120 << 20} kB\n"
                                          f"MemAvailable: {next(free) << 20} kB\n@@rc 0\n"), exit_code=0)

    ctx = SimpleNamespace(desired=desired, sessions={"n": Session()}, command_timeout=5, remaining=lambda t=None: 60,
                          progress=lambda event, fields: events.append(event), observed=Observed(nodes={}))
    serving.memory_preflight(ctx, "n")
    assert ran == ["sync", "/usr/sbin/sysctl"] and events == ["serving.sync-skipped"]


def test_a_node_whose_sudoers_refuses_the_drop_is_said_and_starts(cluster_yaml):
    from reconciler.edge.ssh import CommandFailed

    desired = Desired.model_validate(load_file(cluster_yaml).data)
    events = []

    class Session:
        def run(self, argv, timeout, sudo=False, check=True):
            if sudo:
                raise CommandFailed("n", ["sudo", "-n", *argv], 1, "",
                                    "sudo: a password is required")
            return SimpleNamespace(stdout="", exit_code=0)

        def run_script(self, script, timeout):
            return SimpleNamespace(stdout=answer(script, f"@@meminfo\nMemTotal: {120 << 20} kB\n"
                                                                f"MemAvailable: {100 << 20} kB\n@@rc 0\n"), exit_code=0)

    ctx = SimpleNamespace(desired=desired, sessions={"n": Session()}, command_timeout=5, remaining=lambda t=None: 60,
                          progress=lambda event, fields: events.append(event), observed=Observed(nodes={}))
    serving.memory_preflight(ctx, "n")
    assert events == ["serving.drop-caches-refused"]


def test_without_drop_caches_nothing_is_dropped(cluster_yaml):
    data = load_file(cluster_yaml).data
    data["policy"]["drop_caches"] = False
    desired = Desired.model_validate(data)

    class Session:
        def run(self, argv, timeout, sudo=False, check=True):
            raise AssertionError(f"nothing but meminfo is run: {argv}")

        def run_script(self, script, timeout):
            return SimpleNamespace(stdout=answer(script, f"@@meminfo\nMemTotal: {120 << 20} kB\n"
                                                                f"MemAvailable: {100 << 20} kB\n@@rc 0\n"), exit_code=0)

    ctx = SimpleNamespace(desired=desired, sessions={"n": Session()}, command_timeout=5, remaining=lambda t=None: 60,
                          observed=Observed(nodes={}))
    serving.memory_preflight(ctx, "n")
