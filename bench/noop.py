"""1. The no-op reconcile cycle on a converged cluster, and 7. its scaling with the node count.

cycle = observe every node (the batched probe over the persistent sessions, in parallel) + drift + plan, with
nothing to do (the plan must be empty; the benchmark fails otherwise). Measured in-process, sessions open
(as in the daemon). Alternatives in the same run:
  (a) Ansible: `ansible-playbook` (ansible-core, gather_facts: false) running the same checks as the probe over
      the same SSH (testbed key and known_hosts, strict host keys, the worker via ProxyJump through the head),
      OpenSSH ControlPersist and pipelining on (the fast Ansible set-up).
  (b) the floor: the same probe script (reconciler.edge.observe.probe_script) run locally on each node at once via
      `testbed exec` (nsenter; no SSH), wall time until both are done.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

from bench import sim
from bench.common import (
    ROOT,
    Options,
    Result,
    converge,
    on_testbed,
    ratio,
    save,
    scratch_dir,
    summary,
    testbed_down,
    testbed_lock,
    testbed_up,
)

if TYPE_CHECKING:
    from reconciler.core.spec import Desired, Node
    from reconciler.edge.ssh import Sessions

ANSIBLE_PLAYBOOK = ROOT / ".venv" / "bin" / "ansible-playbook"


def _cycle_fn(desired: Desired, sessions: Sessions) -> Callable[[], tuple[float, float]]:
    """One no-op cycle: (wall seconds, CPU seconds of this whole process, every thread: the head's own cost)."""
    from reconciler.core import planning
    from reconciler.edge import observe as obs

    def cycle() -> tuple[float, float]:
        t, c = time.perf_counter(), time.process_time()
        observed, _ = obs.observe(desired, sessions, timeout=20)
        p = planning.plan(desired, observed)
        took, cpu = time.perf_counter() - t, time.process_time() - c
        if p.steps or any(not n.reachable for n in observed.nodes.values()):
            raise RuntimeError(f"not a no-op cycle: steps {[s.id for s in p.steps]}, "
                               f"drift {[d.as_dict() for d in p.drift][:5]}")
        return took, cpu
    return cycle


def measure_cycles(desired_path: Path, cycles: int) -> tuple[list[float], list[float]]:
    """(wall, head CPU) of `cycles` no-op cycles over open sessions, after 3 warm-ups that connect them."""
    from reconciler.core import spec
    from reconciler.edge.ssh import Sessions
    desired = spec.load(desired_path)
    sessions = Sessions(desired)
    try:
        cycle = _cycle_fn(desired, sessions)
        for _ in range(3):
            cycle()
        walls, cpus = zip(*(cycle() for _ in range(cycles)), strict=True)
        return list(walls), list(cpus)
    finally:
        sessions.close()


def measure_floor(desired_path: Path, cycles: int) -> list[float]:
    from reconciler.core import spec
    from reconciler.edge.observe import parse_probe, probe_script
    from testbed import api
    desired = spec.load(desired_path)
    scripts = {n.name: probe_script(desired, n) for n in desired.nodes}

    def local(node: Node) -> None:
        p = api.exec_(node.name, "sh -s", input=scripts[node.name].script, timeout=30)
        parse_probe(desired, node, p.stdout, scripts[node.name].nonce)

    out = []
    with ThreadPoolExecutor(max_workers=len(desired.nodes)) as pool:
        for i in range(cycles + 2):
            t = time.perf_counter()
            list(pool.map(local, desired.nodes))
            if i >= 2:
                out.append(time.perf_counter() - t)
    return out


def section_costs(desired_path: Path, node: str = "head", repeat: int = 5) -> dict[str, float]:
    """Where the probe's time goes: each section of the script run alone, locally (median ms)."""
    import statistics

    from reconciler.core import spec
    from reconciler.edge.observe import probe_script
    from testbed import api
    desired = spec.load(desired_path)
    n = desired.node(node)
    script = probe_script(desired, n).script
    parts: dict[str, list[str]] = {}
    current = "setup"
    for line in script.splitlines():
        if line.startswith("sec "):
            current = line.split()[1]
        parts.setdefault(current, []).append(line)
    setup = "\n".join(parts.pop("setup"))
    costs: dict[str, float] = {}
    for name, lines in parts.items():
        body = setup + "\n" + "\n".join(lines) + "\n"
        times = []
        for _ in range(repeat):
            t = time.perf_counter()
            api.exec_(node, "sh -s", input=body, timeout=30)
            times.append(time.perf_counter() - t)
        costs[name] = round(statistics.median(times) * 1000, 1)
    overhead: list[float] = []
    for _ in range(repeat):
        s = time.perf_counter()
        api.exec_(node, "true", timeout=30)
        overhead.append(time.perf_counter() - s)
    costs["(exec overhead)"] = round(statistics.median(overhead) * 1000, 1)
    return costs


# -- Ansible ----------------------------------------------------------------------------------------------------

def write_ansible(desired_path: Path, where: Path) -> Path:
    """Inventory, ssh config and a playbook doing the probe's checks, task by task (what a user would write)."""
    from reconciler.core import spec
    desired = spec.load(desired_path)
    head = desired.head
    ssh_cfg = where / "ssh_config"
    lines = []
    for n in desired.nodes:
        lines += [f"Host {n.name}", f"  HostName {n.ssh.host}", f"  User {n.ssh.user}",
                  f"  IdentityFile {n.ssh.identity_file}", "  IdentitiesOnly yes",
                  f"  UserKnownHostsFile {n.ssh.known_hosts}", "  StrictHostKeyChecking yes",
                  "  BatchMode yes"]
        if n.ssh.jump:
            lines.append(f"  ProxyJump {n.ssh.jump}")
    ssh_cfg.write_text("\n".join(lines) + "\n")
    inv = ["[nodes]"] + [f"{n.name} ansible_python_interpreter=/usr/bin/python3" for n in desired.nodes]
    (where / "inventory.ini").write_text("\n".join(inv) + "\n")
    (where / "ansible.cfg").write_text(
        "[defaults]\nhost_key_checking = True\nretry_files_enabled = False\ninterpreter_python = /usr/bin/python3\n"
        f"local_tmp = {where}/tmp\nforks = 10\nstdout_callback = default\n"
        "[ssh_connection]\npipelining = True\n"
        f"ssh_args = -F {ssh_cfg} -o ControlMaster=auto -o ControlPersist=60s\n"
        f"control_path_dir = {where}/cp\n")
    roots = {n.name: desired.weights_root(n.name) for n in desired.nodes}
    tasks = f"""- hosts: nodes
  gather_facts: false
  vars:
    roots: {roots!r}
  tasks:
    - name: containers
      ansible.builtin.command: !unsafe "docker ps -a --no-trunc --format '{{{{json .}}}}'"
      changed_when: false
    - name: serving image
      ansible.builtin.command: !unsafe "docker image inspect --format '{{{{.Id}}}}' {desired.serving.image}"
      changed_when: false
    - name: fabric link
      ansible.builtin.command: ip -j addr show dev {head.fabric.interface}
      changed_when: false
    - name: memory
      ansible.builtin.command: grep -E '^(MemTotal|MemAvailable):' /proc/meminfo
      changed_when: false
    - name: weights manifest
      ansible.builtin.shell: find {{{{ roots[inventory_hostname] }}}} -mindepth 1 -printf '%P %y %s %T@ %l\\n'
      changed_when: false
    - name: health
      ansible.builtin.command: curl -s -o /dev/null -w '%{{http_code}}' http://127.0.0.1:{desired.serving.port}/health
      changed_when: false
      when: inventory_hostname == '{head.name}'
    - name: models
      ansible.builtin.command: curl -s http://127.0.0.1:{desired.serving.port}/v1/models
      changed_when: false
      when: inventory_hostname == '{head.name}'
"""
    (where / "playbook.yml").write_text(tasks)
    return where


def measure_ansible(desired_path: Path, runs: int) -> list[float]:
    if not ANSIBLE_PLAYBOOK.exists():
        raise RuntimeError("ansible-core is not installed: pip install -e '.[bench]'")
    where = write_ansible(desired_path, scratch_dir("ansible"))
    env = {**os.environ, "ANSIBLE_CONFIG": str(where / "ansible.cfg"), "ANSIBLE_NOCOLOR": "1",
           "ANSIBLE_LOCALHOST_WARNING": "False", "ANSIBLE_HOME": str(where / "home")}
    out = []
    try:
        for i in range(runs + 1):
            t = time.perf_counter()
            p = subprocess.run([str(ANSIBLE_PLAYBOOK), "-i", str(where / "inventory.ini"), str(where / "playbook.yml")],
                               capture_output=True, text=True, env=env, timeout=120, cwd=where, check=False)
            took = time.perf_counter() - t
            if p.returncode != 0:
                raise RuntimeError(f"ansible-playbook failed: {p.stdout[-1500:]} {p.stderr[-800:]}")
            if i >= 1:  # the first run opens the ControlPersist masters
                out.append(took)
    finally:
        for sock in (where / "cp").glob("*"):
            subprocess.run(["ssh", "-F", str(where / "ssh_config"), "-o", f"ControlPath={sock}", "-O", "exit",
                            "x"], capture_output=True, timeout=10, check=False)
        subprocess.run(["rm", "-rf", str(where)], check=False)
    return out


def two_deployments(single: Path, dest: Path) -> Path:
    """The testbed's desired state with a second deployment beside the first (testbed.api.with_embeddings: the
    stand-in as an embeddings server on the head), written to `dest`: the no-op cycle of the seed owner's mix."""
    import yaml

    from testbed.api import with_embeddings
    dest.write_text(yaml.safe_dump(with_embeddings(yaml.safe_load(single.read_text())), sort_keys=False,
                                   explicit_end=True))
    return dest


# -- the benchmarks ---------------------------------------------------------------------------------------------

def run_noop(opts: Options) -> Result:
    cycles, ansible_runs = opts.n(100, 3), opts.n(10, 1)
    with on_testbed(2, "converged", serving=True) as run:
        tb = run.tb
        d = tb.desired_state
        opts.log(f"noop: {cycles} cycles (project)")
        project, cpu = measure_cycles(d, cycles)
        opts.log("noop: floor (local probe via nsenter)")
        floor = measure_floor(d, cycles)
        costs = section_costs(d, repeat=opts.n(5, 1))
        opts.log(f"noop: ansible x{ansible_runs}")
        ansible = measure_ansible(d, ansible_runs)
        opts.log(f"noop: {cycles} cycles, two deployments")
        two = two_deployments(d, scratch_dir("noop") / "two.yaml")
        converge(two)
        both, both_cpu = measure_cycles(two, cycles)
    tb_left = run.leftovers
    s_p, s_a, s_fl, s_two = summary(project), summary(ansible), summary(floor), summary(both)
    data: Result = {"project": s_p, "ansible": s_a, "floor": s_fl, "section_ms_head": costs, "head_cpu": summary(cpu),
            "ansible_over_project": ratio(s_a["median"], s_p["median"]),
            "project_over_floor": ratio(s_p["median"], s_fl["median"]), "two_deployments": s_two,
            "two_deployments_head_cpu": summary(both_cpu), "two_over_one": ratio(s_two["median"], s_p["median"]),
            "leftovers": tb_left}
    save(opts, "noop", data)
    return data


def run_scaling(opts: Options) -> Result:
    sizes = [2, 4] if opts.quick else [2, 4, 8]
    cycles = opts.n(30, 3)
    rows: dict[int, Result] = {}
    with testbed_lock():
        try:
            for n in sizes:
                t = time.monotonic()
                tb = testbed_up(n, "converged")
                up_s = time.monotonic() - t
                conv = converge(tb.desired_state, timeout=600)
                opts.log(f"scaling: {n} nodes up in {up_s:.0f}s, converged in {conv:.0f}s; {cycles} cycles")
                walls, cpus = measure_cycles(tb.desired_state, cycles)
                if n == sim.RECORDED_NODES:
                    sim.save_recording(opts, tb.desired_state)
                rows[n] = {"project": summary(walls), "head_cpu": summary(cpus),
                           "up_seconds": up_s, "converge_seconds": conv}
        finally:
            left = testbed_down()
    base = rows[sizes[0]]["project"]["median"]
    for n in sizes:
        rows[n]["over_2_nodes"] = rows[n]["project"]["median"] / base
    data: Result = {"rows": rows, "leftovers": left}
    save(opts, "scaling", data)
    return data


if __name__ == "__main__":
    print(run_noop(Options(quick="--quick" in sys.argv)))
