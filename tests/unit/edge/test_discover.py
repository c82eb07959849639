"""discover's address guess for a node without an address in the fabric subnet: the next free host address,
wrapping around, and a clear "no free address" (not an endless loop) when the subnet is full."""

from __future__ import annotations

import ipaddress

from reconciler.edge.discover import next_free_address


def _next(ref: str, *taken: str) -> str | None:
    iface = ipaddress.IPv4Interface(ref)
    used = {iface.ip, *(ipaddress.IPv4Address(t) for t in taken)}
    free = next_free_address(iface, int(iface.ip), used)
    return None if free is None else str(ipaddress.IPv4Address(free))


def test_the_next_free_host_above_the_reference():
    assert _next("192.168.200.12/24") == "192.168.200.13"
    assert _next("192.168.200.12/24", "192.168.200.13") == "192.168.200.14"


def test_wraps_around_below_the_reference_never_the_broadcast():
    assert _next("10.0.0.254/24") == "10.0.0.1"


def test_a_full_subnet_has_no_free_address():
    assert _next("10.0.0.1/30", "10.0.0.2") is None
    assert _next("10.0.0.1/31", "10.0.0.0") is None


def test_a_head_that_cannot_lock_memory_gets_a_starter_without_memlock():
    """The defaults ask for memlock=-1; a head whose hard limit is finite would refuse every start with it
    (docker: "setrlimit ... operation not permitted"), so the starter removes it, and keeps it where it can be had."""
    from reconciler.core.spec.models import DockerOptions
    from reconciler.edge.discover.facts import NodeFacts
    from reconciler.edge.discover.render import _docker

    def effective(**facts):
        ulimits = dict(_docker(NodeFacts(host="h", **facts))["ulimits"])
        return DockerOptions(ulimits=ulimits).effective_ulimits

    limited = effective(nofile_hard=20000, memlock_unlimited=False)
    assert "memlock" not in limited and limited["nofile"] == "20000:20000"
    assert effective(nofile_hard=None, memlock_unlimited=True)["memlock"] == "-1"


def test_what_the_command_line_names_is_written_as_given_and_validates():
    """`discover --model --revision --image --api-key-secret` on a fresh head (neither the model nor the image
    there yet: `apply` fetches both): the file names them without a GUESS and validates, so the runbook needs no
    hand edit for them."""
    import ipaddress

    from reconciler.core import spec
    from reconciler.edge.discover import ModelChoice, render
    from reconciler.edge.discover.facts import Iface, NodeFacts

    def node(host: str, name: str, fabric: str | None) -> NodeFacts:
        mgmt = Iface("enP7s7", True, 1500, (ipaddress.IPv4Interface(f"{host}/24"),))
        port = Iface("enp1s0f1np1", fabric is not None, 9000,
                     (ipaddress.IPv4Interface(fabric),) if fabric else ())
        return NodeFacts(host=host, hostname=name, ifaces=[mgmt, port], mem_total=128 * 2**30,
                         mem_available=120 * 2**30, nofile_hard=1048576, memlock_unlimited=True)

    asked = ModelChoice("Qwen/Qwen3.5-122B-A10B-FP8", "0" * 40, "nvcr.io/nvidia/vllm:26.05-py3", True)
    text = render([node("10.1.230.180", "spark-1a32", "192.168.200.12/24"), node("10.1.230.181", "spark-5be3", None)],
                  user="spark", known_hosts="/etc/spark-reconciler/known_hosts",
                  identity="/etc/spark-reconciler/id_ed25519", jump=True, asked=asked)
    desired = spec.loads(text)
    assert desired.model.id == "Qwen/Qwen3.5-122B-A10B-FP8" and desired.model.revision == "0" * 40
    assert desired.model.source == "spark-1a32"
    assert desired.model.path == "/home/spark/.cache/huggingface/hub"
    assert desired.serving.image == "nvcr.io/nvidia/vllm:26.05-py3"
    assert desired.serving.served_model_name == "Qwen3.5-122B-A10B-FP8"
    assert dict(desired.serving.secrets) == {"VLLM_API_KEY": "head"}
    for marker in ("id: \"Qwen/", "revision:", "image:"):
        line = next(line for line in text.splitlines() if marker in line)
        assert "GUESS" not in line, line
    assert "`reconciler apply` downloads it there" in text and "`reconciler apply` pulls it there" in text


def test_the_script_reads_only_what_discover_uses():
    """Every section of discover's script feeds a fact the render reads: a node's listening ports were read,
    parsed and never used (issue 34), so the `listen` section is not in it."""
    from reconciler.edge.discover.facts import SCRIPT_LINES

    sections = {line.split()[1] for line in "\n".join(SCRIPT_LINES).splitlines() if line.startswith("sec ")}
    assert "listen" not in sections
    assert {"containers", "meminfo", "gpu"} <= sections, "the shared fragments are still joined"


def test_the_guessed_utilization_is_the_files_own_memory_check_inverted():
    """discover sized gpu_memory_utilization with a 4 GiB margin of its own while the file it writes runs with the
    policy's defaults (core/spec/models.py: memory_margin 6 GiB, memory_overhead_per_instance 8 GiB): it guessed
    a start the file's own memory check then refused. Two GB10s (MemTotal 127535220 kB, test_budget's
    /proc/meminfo of a DGX Spark, 121.6 GiB), the tighter with 92 GiB available, called as the CLI calls render
    (no margin). By hand: (92 - 6 - 8) / 121.6 = 0.641, less 0.05 = 0.591, in steps of 0.05: 0.55. With 4 GiB:
    (92 - 4 - 8) / 121.6 - 0.05 = 0.608, so 0.60, whose step more (0.65 x 121.6 + 8 + 6 = 93.1 GiB) is more
    than the node has."""
    import ipaddress

    from reconciler.core import spec
    from reconciler.core.vllm import memory_for
    from reconciler.edge.discover import render
    from reconciler.edge.discover.facts import Iface, NodeFacts

    total, gib = 127535220 * 1024, 2**30

    def node(host: str, name: str, available: int) -> NodeFacts:
        mgmt = Iface("enP7s7", True, 1500, (ipaddress.IPv4Interface(f"{host}/24"),))
        port = Iface("enp1s0f1np1", True, 9000, (ipaddress.IPv4Interface(f"192.168.200.{host[-2:]}/24"),))
        return NodeFacts(host=host, hostname=name, ifaces=[mgmt, port], mem_total=total, mem_available=available,
                         nofile_hard=1048576, memlock_unlimited=True)

    text = render([node("10.1.230.80", "spark-1a32", 120 * gib), node("10.1.230.81", "spark-5be3", 92 * gib)],
                  user="spark", known_hosts="/etc/spark-reconciler/known_hosts",
                  identity="/etc/spark-reconciler/id_ed25519", jump=True)
    desired = spec.loads(text)
    policy, guess = desired.policy, desired.serving.gpu_memory_utilization
    assert (policy.memory_margin, policy.memory_overhead_per_instance) == (6 * gib, 8 * gib)
    assert guess == 0.55

    def needs(utilization: float) -> int:  # the file's own memory check (memory_needed without extra flags)
        return memory_for(utilization, total, policy.memory_margin, policy.memory_overhead_per_instance)

    assert needs(guess + 0.05) <= 92 * gib < needs(guess + 0.10), "the guess keeps one step of 0.05, no more"
    line = next(line for line in text.splitlines() if line.lstrip().startswith("gpu_memory_utilization:"))
    assert "GUESS: MemAvailable now allows ~0.64 of MemTotal" in line
