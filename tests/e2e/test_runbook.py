"""Issue 32: the runbook, docs/operations.md, walked literally on the testbed, from an empty head to an answered
completion. Every block marked `run` runs in order, as its user on its node; a block that ends otherwise than
its mark says (`exit=N`, default 0) fails the test with its line in operations.md, its text and its output.

How the runbook's world maps onto the testbed:

* **nodes**: `node=head` runs in `sb-head`'s network namespace, `node=worker` in `sb-worker`'s
  (`ip netns exec`), `node=both` on the head, then the worker. Each node also gets a private mount namespace
  (`unshare --mount`, held by a `sleep` for the test's duration, entered with `nsenter`) with a throw-away overlay
  over `/etc`, `/opt`, `/root`, `/usr/local` and `/var/lib`: there the head starts EMPTY (no
  /etc/spark-reconciler, /opt/spark-reconciler, /var/lib/spark-reconciler, whatever the host has), and what the
  runbook writes (the venv, the keys, /etc/sudoers.d, the units, /usr/local/bin/reconciler, /etc/group) is each
  node's own and gone afterwards; the host's files are never touched. The nodes' sshd and dockerd are the
  testbed's, outside these namespaces, as a real node's daemons are outside an operator's shell.
* **users**: `user=root` is root; `user=spark` is `runuser -u spark` with spark's HOME. `/home/spark` is one
  directory for every testbed node (docs/testbed.md): its `.ssh` is saved before and put back after, so the test
  starts (and leaves spark) with no authorized key for the runbook's new key.
* **values**: the runbook's `vars` block is replaced by the testbed's: HEAD and WORKER_MGMT the management
  addresses (10.231.0.2, 10.231.1.11, the worker reached from the head), HEAD_NAME/WORKER_NAME the hostnames
  (spark-head, spark-worker), MODEL/REVISION/IMAGE the scenario's, SRC this checkout.
* **scenario**: `fresh-head` (the head holds neither the model nor the serving image; the Hub stand-in and the
  registry on the head's loopback stand for the internet) when the testbed has it, else `seed`.
* **no network**: pip gets PIP_NO_INDEX=1 and PIP_FIND_LINKS=the wheelhouse of `make wheelhouse` in its
  environment; the runbook's text stays literal.

The blocks marked `skip` and what the test does instead (the only substitutions):

1. `apt-get install python3-venv git pipx`: nothing; Debian 12's /usr/bin/python3 has venv.
2. `git clone`: nothing; SRC is this checkout.
3. `passwd spark`: nothing; `ssh-copy-id` logs in with spark's node key, which the testbed authorizes.
4. `netplan apply`: nothing; the reconciler configures the fabric veths itself (its link step).
5. `pipx install huggingface_hub` (as spark): nothing; the testbed's head has its pinned `hf` on spark's PATH
   and HF_ENDPOINT pointing at the Hub stand-in (testbed/hub.py), both set by its sshd.
6. the fingerprint check on each node's console: every key `ssh-keyscan` wrote must be the node's key in the
   testbed's own known_hosts (the testbed's host keys live in /run/spark-testbed).
7. `systemctl enable --now`: the unit the runbook wrote is read back and its `ExecStart=` run in the
   background as its `User=` with its `EnvironmentFile=` (and its `StateDirectory=` made), until the test ends;
   the test waits until its /status says Converged (Type=notify's READY=1 comes after the first reconcile).

9. the review of the discovered file (step 5, "Review every GUESS line with an editor"): the testbed's nodes
   have 8 GiB and serve the stand-in, which holds 128 MiB beyond its pool, not a GB10's vLLM, so the file gets the
   testbed's `policy.memory_overhead_per_instance` and `memory_margin` (desired-state/testbed.yaml's), as an owner
   tunes them from their own numbers; the GB10 defaults would not fit an 8 GiB node.

One thing a real Spark has and the testbed does not, added for the test's own duration and taken away after:

8. a head whose routing table has a way out (discover reads `internet` from `ip route get 1.1.1.1`, a lookup
   that sends nothing): `default dev lo` in sb-head, where a packet to outside dies (no forwarding, no other
   link). Not the testbed's own: there an unknown address fails at once, which the other tests' timings rely on.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from testbed.proc import TestbedError, wait_for
from tests.e2e import runbook

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
OPERATIONS = ROOT / "docs" / "operations.md"
WHEELHOUSE = Path(os.environ.get("WHEELHOUSE", ROOT / ".venv" / "wheelhouse"))
PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
HOMES = {"root": "/root", "spark": "/home/spark"}
#: Overlaid per node: the runbook's writes stay in the node's namespace.
OVERLAID = ("/etc", "/opt", "/root", "/usr/local", "/var/lib")
#: Must not exist on the head when the runbook starts.
EMPTY = ("/etc/spark-reconciler", "/opt/spark-reconciler", "/var/lib/spark-reconciler")
BLOCK_TIMEOUT = 900


class Node:
    """One runbook node: a private mount namespace (held by a sleep) over the testbed node's network namespace."""

    def __init__(self, name: str, netns: str, stage: Path) -> None:
        self.name, self.netns = name, netns
        stage.mkdir(parents=True)
        self.holder = subprocess.Popen(["unshare", "--mount", "--propagation", "slave", "sleep", "infinity"],
                                       start_new_session=True)
        ours = os.readlink("/proc/self/ns/mnt")
        wait_for(lambda: os.readlink(f"/proc/{self.holder.pid}/ns/mnt") != ours, 10,
                 "unshare to make a mount namespace", interval=0.01)
        script = [f"mount -t tmpfs -o mode=0700 runbook {shlex.quote(str(stage))}"]
        for i, d in enumerate(OVERLAID):
            up, work = stage / f"up{i}", stage / f"work{i}"
            script += [f"mkdir {up} {work}",
                       f"mount -t overlay overlay -o lowerdir={d},upperdir={up},workdir={work} {d}",
                       f'[ "$(findmnt -no FSTYPE --mountpoint {d})" = overlay ]']
        if name == "head":   # only now, on the overlays: a whiteout in this namespace, never the host's files
            script.append("rm -rf " + " ".join(EMPTY))
        self.sh(" && ".join(script))

    def sh(self, script: str) -> str:
        """Root, in this namespace but the host's network: the set-up only."""
        return subprocess.run(["nsenter", "-t", str(self.holder.pid), "-m", "sh", "-ec", script],
                              capture_output=True, text=True, check=True, timeout=60).stdout

    def argv(self, user: str, script: str, env: dict[str, str]) -> list[str]:
        """`script` in bash as `user` on this node, with only `env` (and the user's HOME, USER, PATH)."""
        home = HOMES[user]
        full = {"PATH": PATH, "HOME": home, "USER": user, "LOGNAME": user, "LANG": "C.UTF-8", **env}
        inner = ["env", "-i", *(f"{k}={v}" for k, v in full.items()), "bash", "-c", f'cd "$HOME"\n{script}']
        as_user = ["runuser", "-u", user, "--", *inner] if user != "root" else inner
        return ["nsenter", "-t", str(self.holder.pid), "-m", "--", "ip", "netns", "exec", self.netns, *as_user]

    def close(self) -> None:
        self.holder.kill()
        self.holder.wait(timeout=10)


def scenario_values(tb) -> tuple[str, dict[str, str]]:
    """The scenario, and the runbook values that are the scenario's (the model, its revision, the image)."""
    from testbed import scenarios
    from testbed.layout import MODELS

    model = "testorg/tiny-moe"
    if "fresh-head" in scenarios.SCENARIOS:
        from testbed import registry

        return "fresh-head", {"MODEL": model, "REVISION": MODELS[model], "IMAGE": registry.IMAGE}
    return "seed", {"MODEL": model, "REVISION": MODELS[model], "IMAGE": "vllm-standin:latest"}


def fingerprints_match(tb, head: Node) -> None:
    """Substitution 6: every host key ssh-keyscan wrote is the node's own (the testbed's known_hosts)."""
    testbed_keys = {tuple(line.split()[:3]) for line in Path(tb.known_hosts).read_text().splitlines() if line}
    scanned = [tuple(line.split()[:3]) for line in head.sh("cat /etc/spark-reconciler/known_hosts").splitlines()
               if line and not line.startswith("#")]
    assert scanned, "ssh-keyscan wrote no key"
    for entry in scanned:
        assert entry in testbed_keys, f"scanned {entry[0]} {entry[1]}: not the node's key in {tb.known_hosts}"


def start_unit(head: Node, log: Path) -> subprocess.Popen:
    """Substitution 7: the unit's ExecStart= as its User=, with its EnvironmentFile= and StateDirectory=."""
    unit = head.sh("cat /etc/systemd/system/spark-reconciler.service")
    fields: dict[str, str] = {}
    for line in unit.splitlines():
        key, eq, value = line.partition("=")
        if eq and not line.startswith("#"):
            fields.setdefault(key.strip(), value.strip())
    user, execstart = fields["User"], fields["ExecStart"]
    env_file = fields.get("EnvironmentFile", "").lstrip("-")
    state = fields.get("StateDirectory")
    script = ["set -e"]
    if state:
        script.append(f"install -d -o {user} -g {user} -m {fields.get('StateDirectoryMode', '0755')} "
                      f"/var/lib/{state}")
    if env_file:
        script.append(f"set -a; . {shlex.quote(env_file)}; set +a")
    script.append(f"exec runuser -u {user} -- {execstart}")
    argv = head.argv("root", "\n".join(script), {})
    return subprocess.Popen(argv, stdout=log.open("wb"), stderr=subprocess.STDOUT, start_new_session=True)


def wait_converged(head: Node, daemon: subprocess.Popen, log: Path, timeout: float = 300) -> None:
    last = [""]

    def converged() -> bool:
        assert daemon.poll() is None, f"the daemon exited {daemon.returncode}:\n{log.read_text()[-4000:]}"
        result = subprocess.run(head.argv("root", "curl -s -m 2 http://127.0.0.1:9464/status", {}),
                                capture_output=True, text=True, timeout=30, check=False)
        with contextlib.suppress(ValueError):
            last[0] = json.loads(result.stdout).get("phase", "")
        return last[0] == "Converged"

    try:
        wait_for(converged, timeout, "the daemon's phase Converged", interval=1)
    except TestbedError:  # not fatal here: the runbook's `reconciler status` block says what is wrong, with its line
        print(f"the daemon's phase after {timeout:.0f}s: {last[0] or 'no answer'}")


@contextlib.contextmanager
def head_route_out(tb):
    """Substitution 8, while the testbed's head has no route out in its routing table."""
    netns = tb.head.netns
    probe = subprocess.run(["ip", "netns", "exec", netns, "ip", "route", "get", "1.1.1.1"], capture_output=True,
                           check=False)
    added = probe.returncode != 0
    if added:
        subprocess.run(["ip", "netns", "exec", netns, "ip", "route", "add", "default", "dev", "lo"], check=True)
    try:
        yield
    finally:
        if added:
            subprocess.run(["ip", "netns", "exec", netns, "ip", "route", "del", "default", "dev", "lo"], check=False)


@contextlib.contextmanager
def spark_ssh_kept():
    """/home/spark/.ssh as it was (the testbed's node key, no authorized_keys): saved, and put back."""
    ssh = Path("/home/spark/.ssh")
    saved = Path(f"/run/spark-runbook-ssh.{os.getpid()}")
    shutil.rmtree(saved, ignore_errors=True)
    shutil.copytree(ssh, saved, symlinks=True)
    try:
        yield
    finally:
        shutil.rmtree(ssh)
        shutil.copytree(saved, ssh, symlinks=True)
        shutil.copystat(saved, ssh)
        for path in [ssh, *ssh.rglob("*")]:
            os.chown(path, Path("/home/spark").stat().st_uid, Path("/home/spark").stat().st_gid, follow_symlinks=False)
        shutil.rmtree(saved)
        Path("/home/spark/spark-reconciler.sudoers").unlink(missing_ok=True)


#: Substitution 9: the testbed's memory physics into the discovered file (desired-state/testbed.yaml's values).
TESTBED_MEMORY = ("set -e; f=/etc/spark-reconciler/cluster.yaml; grep -qx 'policy:' \"$f\"; "
                  "sed -i 's/^policy:$/policy:\\n  memory_overhead_per_instance: 128MiB\\n  memory_margin: 1GiB/' "
                  "\"$f\"; grep -q 'memory_overhead_per_instance: 128MiB' \"$f\"\n")


def test_the_runbook_from_an_empty_head_to_an_answered_completion(testbed, tmp_path):
    scenario, values = scenario_values(testbed)
    tb = testbed.reset(scenario)
    assert WHEELHOUSE.is_dir(), f"no wheelhouse at {WHEELHOUSE}: make wheelhouse"
    blocks = runbook.blocks(OPERATIONS)
    [values_block] = [b for b in blocks if b.attrs.get("vars")]
    variables = values_block.variables()
    variables.update(HEAD=tb.head.ssh_host, WORKER_MGMT=tb.workers[0].ssh_host, HEAD_NAME="spark-head",
                     WORKER_NAME="spark-worker", SRC=str(ROOT), **values)
    assert set(variables) == set(values_block.variables()), "a testbed value for every runbook value"
    env = {**variables, "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(WHEELHOUSE),
           "PIP_DISABLE_PIP_VERSION_CHECK": "1"}

    nodes: dict[str, Node] = {}
    daemon: subprocess.Popen | None = None
    log = tmp_path / "daemon.log"
    started = time.monotonic()
    ran: list[str] = []
    with spark_ssh_kept(), head_route_out(tb):
        try:
            nodes["head"] = Node("head", tb.head.netns, tmp_path / "ns-head")
            nodes["worker"] = Node("worker", tb.workers[0].netns, tmp_path / "ns-worker")
            for block in blocks:
                if block.skip is not None and "ssh_host_ed25519_key" in block.text:
                    fingerprints_match(tb, nodes["head"])
                elif block.skip is not None and "systemctl enable --now" in block.text:
                    daemon = start_unit(nodes["head"], log)
                    wait_converged(nodes["head"], daemon, log)
                if not block.runnable:
                    continue
                for where in (("head", "worker") if block.node == "both" else (block.node,)):
                    t0 = time.monotonic()
                    result = subprocess.run(nodes[where].argv(block.user, "set -e -o pipefail\n" + block.text, env),
                                            capture_output=True, text=True, timeout=BLOCK_TIMEOUT, check=False)
                    ran.append(f"{block.where} {block.user}@{where}: {time.monotonic() - t0:.1f}s")
                    if result.returncode != block.expected_exit:
                        pytest.fail(f"docs/operations.md:{block.line} ({block.user} on {where}) exited "
                                    f"{result.returncode}, the runbook expects {block.expected_exit}\n"
                                    f"--- the block ---\n{block.text}--- its output ---\n{result.stdout}"
                                    f"{result.stderr}" + (f"\n--- the daemon's log ---\n{log.read_text()[-4000:]}"
                                                          if daemon else ""))
                    if "reconciler discover" in block.text:  # substitution 9: the review, the testbed's memory
                        tuned = subprocess.run(nodes["head"].argv("root", TESTBED_MEMORY, env), capture_output=True,
                                               text=True, timeout=BLOCK_TIMEOUT, check=False)
                        assert tuned.returncode == 0, tuned.stdout + tuned.stderr
            assert daemon is not None, "the runbook never started the daemon"
            last = [b for b in blocks if b.runnable][-1]
            assert "/v1/completions" in last.text, "the runbook ends with a completion"
            completion = json.loads(result.stdout)
            assert completion["choices"], completion
        finally:
            print(f"runbook on the testbed ({scenario}): {time.monotonic() - started:.0f}s\n" + "\n".join(ran))
            if daemon is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(daemon.pid, signal.SIGTERM)
                try:
                    daemon.wait(timeout=95)
                except subprocess.TimeoutExpired:
                    os.killpg(daemon.pid, signal.SIGKILL)
                    daemon.wait()
            for node in nodes.values():
                node.close()
