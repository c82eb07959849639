"""`reconciler doctor`: the pure judgement (`core.preflight`) from constructed facts, every check's ok and fail with
its exact fix; the edge's script and its reading of a node's answer (`edge.doctor`), odd output included; the
CLI's exit codes. The testbed run is tests/e2e/test_doctor.py."""

from __future__ import annotations

import dataclasses
import threading
from pathlib import Path

import pytest
from click.testing import CliRunner

from reconciler.cli import main
from reconciler.core import preflight
from reconciler.core.observed import GpuStack, Image, Link, NodeObservation, WeightFile, Weights
from reconciler.core.preflight import (
    HERE,
    Check,
    EnvFile,
    FileProblem,
    Fix,
    HopAnswer,
    HubEntry,
    HubFacts,
    LocalFacts,
    NodeFacts,
    SudoAnswer,
    checks,
    env_file_names,
    exit_code,
    needed_binaries,
    report_text,
)
from reconciler.core.spec import load
from reconciler.edge import doctor as edge
from reconciler.edge import trusted_files
from reconciler.edge.facts.base import ProbeError
from reconciler.edge.ssh import sudo_commands, sudoers_line

REPO = Path(__file__).resolve().parents[3]
GIB = 2**30
REV = "1111111111111111111111111111111111111111"
DESIRED = load(REPO / "desired-state" / "testbed.yaml")
HEAD, WORKER = DESIRED.node("head"), DESIRED.node("worker")
ENV = "/etc/spark-reconciler/environment"
FILE = "/etc/spark-reconciler/cluster.yaml"


def _link(node) -> Link:
    return Link(name=node.fabric.interface, operstate="up", admin_up=True, carrier=True, mtu=9000,
                addresses=[str(node.fabric.address)])


IMAGE = Image(id="sha256:" + "a" * 64, content="sha256:" + "c" * 64, size=2 * GIB, platform="linux/arm64")
WEIGHTS = Weights(root="/srv/spark-testbed/head/models/hub/models--testorg--tiny-moe", present=True,
                  files=[WeightFile(path=f"snapshots/{REV}/model.safetensors", size=3 * GIB)])


def _obs(node, **kw) -> NodeObservation:
    base = {"name": node.name, "reachable": True, "docker_reachable": True,
            "disk_free": {"weights": 100 * GIB, "image": 100 * GIB},
            "gpu_stack": GpuStack(gpu="NVIDIA GB10", driver="580.95.05", hook=True), "fabric": _link(node),
            "images": {DESIRED.serving.image: IMAGE} if node.role == "head" else {},
            "weights": WEIGHTS if node.role == "head" else Weights(root="/w", present=False)}
    return NodeObservation(**{**base, **kw})


def _facts(node, **kw) -> NodeFacts:
    wanted = edge.looked_for(DESIRED, node)
    base = {"name": node.name, "observation": _obs(node), "clock_offset": 0.02,
            "binaries": {b: f"/usr/bin/{b}" for b in wanted}, "rsync_version": "rsync  version 3.2.7  protocol "
            "version 31", "sudo": tuple(SudoAnswer(a, 0, " ".join(a)) for a in sudo_commands(DESIRED, node)),
            "sudoers_line": sudoers_line(DESIRED, node), "uid": 1000, "groups": ("spark", "docker"),
            "runtimes": ("nvidia", "runc"), "hops": (HopAnswer("worker", 0),) if node.role == "head" else (),
            "hub": HubFacts(True, 1000, (HubEntry("above", "/", 0, 0o755),), tree=True) if node.role == "head"
            else None}
    return NodeFacts(**{**base, **kw})


LOCAL = LocalFacts(user="spark", env=EnvFile(ENV, uid=0, mode=0o600, names=frozenset()), desired_path=FILE)


def run(head=None, worker=None, local=LOCAL, desired=DESIRED) -> list[Check]:
    return checks(desired, {"head": head or _facts(HEAD), "worker": worker or _facts(WORKER)}, local)


def one(found: list[Check], name: str, node: str) -> Check:
    hits = [c for c in found if c.name == name and c.node == node]
    assert len(hits) == 1, (name, node, found)
    return hits[0]


def with_obs(node, **kw) -> NodeFacts:
    return _facts(node, observation=_obs(node, **kw))


# -- all well ----------------------------------------------------------------------------------------------------

def test_a_ready_cluster_is_all_ok_and_exits_0():
    found = run()
    assert [c for c in found if c.status != "ok"] == []
    assert exit_code(found) == 0
    assert [(c.name, c.node) for c in found] == [
        ("ssh", "head"), ("sudo", "head"), ("docker", "head"), ("binaries", "head"), ("gpu", "head"),
        ("weights", "head"), ("hub", "head"), ("disk", "head"), ("hop/worker", "head"),
        ("ssh", "worker"), ("clock", "worker"), ("sudo", "worker"), ("docker", "worker"), ("binaries", "worker"),
        ("rsync", "worker"), ("gpu", "worker"), ("disk", "worker"),
        ("image", "head"), ("files", HERE), ("secrets", HERE)]
    assert "0 fail" in report_text(found)


def test_the_binaries_each_node_needs():
    assert list(needed_binaries(DESIRED, HEAD)) == ["timeout", "curl", "docker", "ip", "ping", "find", "df", "flock",
                                                   "awk", "sudo", "rsync", "python3", "bash", "dd", "ssh"]
    assert list(needed_binaries(DESIRED, WORKER)) == ["timeout", "curl", "docker", "ip", "ping", "find", "df",
                                                     "sudo", "rsync", "python3"]
    assert edge.looked_for(DESIRED, HEAD)[-1] == "hf" and "hf" not in edge.looked_for(DESIRED, WORKER)


# -- ssh ---------------------------------------------------------------------------------------------------------

def test_an_unknown_host_key_names_the_keyscan_on_the_jump_host():
    found = run(worker=NodeFacts("worker", error="HostKeyRejected: host 10.231.1.11 is not in /run/spark-testbed/"
                                 "known_hosts", error_kind="host-key"))
    c = one(found, "ssh", "worker")
    assert c.status == "fail" and c.message.startswith("spark@10.231.1.11:22 via head: HostKeyRejected")
    assert c.fix == Fix("ssh-keyscan -p 22 10.231.1.11 | ssh-keygen -lf -  # compare with `ssh-keygen -lf "
                        "/etc/ssh/ssh_host_ed25519_key.pub` on worker's console; only if it matches: ssh-keyscan -p "
                        "22 -t ed25519 10.231.1.11 >> /run/spark-testbed/known_hosts (run where 10.231.1.11 is "
                        "reachable; the file lives on the reconciler's host)", "spark", "head")
    assert [c.name for c in found if c.node == "worker"] == ["ssh"]  # nothing more is read of it
    assert exit_code(found) == 1


def test_a_refused_login_names_ssh_copy_id_and_an_unreachable_node_sshd():
    c = one(run(worker=NodeFacts("worker", error="authentication failed", error_kind="auth")), "ssh", "worker")
    assert c.fix == Fix("ssh-copy-id -i /run/spark-testbed/id_ed25519.pub -o ProxyJump=spark@10.231.0.2:22 -p 22 "
                        "spark@10.231.1.11", "spark", HERE)
    c = one(run(head=NodeFacts("head", error="cannot reach", error_kind="unreachable")), "ssh", "head")
    assert c.status == "fail" and c.fix is not None and c.fix.command.startswith("systemctl status ssh")
    assert (c.fix.user, c.fix.node) == ("root", "head")


def test_odd_output_is_the_nodes_failed_check():
    found = run(worker=NodeFacts("worker", probe_error="sudo: ValueError: invalid literal"))
    c = one(found, "probe", "worker")
    assert c.status == "fail" and "did not parse: sudo: ValueError" in c.message
    assert exit_code(found) == 1


# -- clock -------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("offset", "status", "said"), [
    (0.9, "ok", "0.9 s ahead of head (within 1 s)"),
    (-4.0, "warn", "4.0 s behind head: time sync is not keeping it (over 1 s)"),
    (45.0, "fail", "45.0 s ahead of head: over 30 s, its timestamps (container ages, the copy ledger, logs) are off "
                   "by more than a reconcile cycle"),
])
def test_clock_skew_against_the_head(offset, status, said):
    head = _facts(HEAD, clock_offset=10.0)  # the reconciler's own clock cancels out
    c = one(run(head=head, worker=_facts(WORKER, clock_offset=10.0 + offset)), "clock", "worker")
    assert (c.status, c.message) == (status, said)
    if status != "ok":
        assert c.fix == Fix("timedatectl set-ntp true && timedatectl timesync-status  # or chronyc makestep with "
                            "chrony", "root", "worker")


def test_clock_not_measured_without_the_heads_time():
    c = one(run(head=_facts(HEAD, clock_offset=None)), "clock", "worker")
    assert c.status == "warn" and "skew not measured" in c.message


# -- sudo, docker, binaries, rsync, hf ---------------------------------------------------------------------------

def test_a_refused_sudo_command_names_the_sudoers_line():
    answers = tuple(SudoAnswer(a, 1 if "ip" in a[0] else 0) for a in sudo_commands(DESIRED, WORKER))
    c = one(run(worker=_facts(WORKER, sudo=answers)), "sudo", "worker")
    assert c.status == "fail"
    assert c.message == "`sudo -n` refuses 6 of 7 commands, first `/usr/sbin/ip link set dev enp1s0f1np1 up` (exit 1)"
    assert c.fix == Fix(f"echo '{sudoers_line(DESIRED, WORKER)}' | EDITOR='tee' visudo -f "
                        "/etc/sudoers.d/spark-reconciler", "root", "worker")


def test_docker_out_of_the_group_or_down():
    down = "permission denied while trying to connect to the Docker daemon socket"
    c = one(run(worker=_facts(WORKER, groups=("spark",), observation=_obs(WORKER, docker_reachable=False,
                                                                         docker_error=down))), "docker", "worker")
    assert c.status == "fail" and c.message == f"spark is not in the docker group (groups: spark); docker: {down}"
    assert c.fix == Fix("usermod -aG docker spark  # then restart the reconciler: a session keeps the groups it "
                        "logged in with", "root", "worker")
    c = one(run(worker=with_obs(WORKER, docker_reachable=False, docker_error="Cannot connect")), "docker", "worker")
    assert c.message == "the engine does not answer: Cannot connect"
    assert c.fix == Fix("systemctl start docker && systemctl status docker", "root", "worker")
    c = one(run(worker=_facts(WORKER, groups=("spark",))), "docker", "worker")
    assert c.status == "ok" and "not in the docker group, yet the socket answers" in c.message


def test_missing_binaries_name_their_packages():
    binaries = {**_facts(HEAD).binaries, "flock": None, "rsync": None}
    c = one(run(head=_facts(HEAD, binaries=binaries)), "binaries", "head")
    assert c.status == "fail"
    assert c.message == ("not on spark's PATH over ssh: flock (the cluster's lease); rsync (the weights' copy "
                         "(the sending end))")
    assert c.fix == Fix("apt-get install -y util-linux rsync", "root", "head")


@pytest.mark.parametrize(("version", "munged", "status", "said"), [
    ("rsync  version 3.0.9  protocol version 30", False, "fail", "rsync 3.0.9 is older than 3.1.0"),
    ("rsync  version v3.4.1  protocol version 32", True, "fail", "rsync 3.4.1, but /rsyncd-munged exists"),
    ("sh: rsync: oops", False, "fail", "`rsync --version` said 'sh: rsync: oops'"),
    ("rsync  version 3.1.0  protocol version 31", False, "ok", "rsync 3.1.0 (>= 3.1.0)"),
])
def test_the_receiving_rsync(version, munged, status, said):
    c = one(run(worker=_facts(WORKER, rsync_version=version, rsync_munged=munged)), "rsync", "worker")
    assert c.status == status and c.message.startswith(said)
    if munged:
        assert c.fix == Fix("rm -rf /rsyncd-munged", "root", "worker")
    elif status == "fail":
        assert c.fix == Fix("apt-get install -y rsync  # 3.1.0 or newer", "root", "worker")


def test_hf_is_asked_only_where_apply_downloads():
    missing = Weights(root=WEIGHTS.root, present=False)
    binaries = {**_facts(HEAD).binaries, "hf": None}
    found = run(head=_facts(HEAD, binaries=binaries, observation=_obs(HEAD, weights=missing)))
    c = one(found, "hf", "head")
    assert c.status == "fail"
    assert c.fix == Fix("pipx install huggingface_hub  # or: python3 -m pip install --user huggingface_hub (either "
                        "puts `hf` in ~/.local/bin, where the download step looks too)", "spark", "head")
    assert "hf" not in [c.name for c in run(head=_facts(HEAD, binaries=binaries))]  # the weights are there


# -- gpu ---------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("stack", "runtimes", "status", "fix"), [
    (GpuStack(error="Failed to initialize NVML: Driver/library version mismatch", status=18, hook=True), None,
     "fail", "systemctl reboot  # once the running generation can be spared"),
    (GpuStack(error="nvidia-smi: command not found", status=127, hook=True), None, "fail",
     "apt-get update && apt-get full-upgrade  # DGX OS's own update restores the driver, signed; not a "
     "hand-installed nvidia-driver package (Secure Boot would need a MOK enrolled at the console)"),
    (GpuStack(gpu="NVIDIA GB10", driver="580.95.05", hook=False), None, "fail",
     "apt-get install -y nvidia-container-toolkit && systemctl restart docker"),
    (GpuStack(gpu="NVIDIA GB10", driver="580.95.05", hook=True), ("runc",), "warn",
     "nvidia-ctk runtime configure --runtime=docker && systemctl restart docker"),
    (GpuStack(gpu="NVIDIA GB10", driver="580.95.05", hook=True), ("nvidia", "runc"), "ok", None),
])
def test_the_gpu_runtime(stack, runtimes, status, fix):
    c = one(run(worker=_facts(WORKER, runtimes=runtimes, observation=_obs(WORKER, gpu_stack=stack))), "gpu", "worker")
    assert c.status == status
    assert (c.fix.command if c.fix else None) == fix


# -- weights, image, disk ----------------------------------------------------------------------------------------

def test_weights_on_the_source():
    c = one(run(), "weights", "head")
    assert c.message == f"testorg/tiny-moe: 1 files, 3.0 GiB in {WEIGHTS.root}"
    missing = _facts(HEAD, observation=_obs(HEAD, weights=Weights(root=WEIGHTS.root, present=False)))
    c = one(run(head=missing), "weights", "head")
    assert c.status == "warn" and c.fix == Fix(f"reconciler apply {FILE}", "spark", HERE)
    assert "`reconciler apply` downloads them there first (hf download testorg/tiny-moe" in c.message
    offline = DESIRED.model_copy(update={"nodes": [HEAD.model_copy(update={"internet": False}), WORKER]})
    c = one(checks(offline, {"head": missing, "worker": _facts(WORKER)}, LOCAL), "weights", "head")
    assert c.status == "fail"
    assert c.fix == Fix(f"hf download testorg/tiny-moe --revision {REV} --cache-dir /srv/spark-testbed/head/models/hub"
                        "  # where the Hub is reachable, then copy the tree to /srv/spark-testbed/head/models/hub",
                        "spark", "head")
    unresolved = Weights(root=WEIGHTS.root, present=True, files=[WeightFile(path="snapshots/other/x", size=1)])
    c = one(run(head=with_obs(HEAD, weights=unresolved)), "weights", "head")
    assert c.status == "warn" and f"neither refs/{REV} nor snapshots/{REV}/" in c.message


def test_the_image_on_its_source():
    assert one(run(), "image", "head").message.startswith("vllm-standin:latest present on head (sha256:aaaa")
    c = one(run(head=with_obs(HEAD, images={})), "image", "head")
    assert c.status == "warn" and "`reconciler apply` pulls it on head" in c.message
    offline = DESIRED.model_copy(update={"nodes": [HEAD.model_copy(update={"internet": False}), WORKER]})
    c = one(checks(offline, {"head": with_obs(HEAD, images={}), "worker": _facts(WORKER)}, LOCAL), "image", "head")
    assert c.status == "fail" and c.fix is not None
    assert (c.fix.user, c.fix.node) == ("spark", "head") and c.fix.command.startswith("docker pull vllm-standin")


def test_disk_short_of_the_copy_uses_the_drifts_formula():
    c = one(run(), "disk", "worker")
    assert c.message == "weights: 100.0 GiB free, 4.0 GiB needed; image: 100.0 GiB free, 3.0 GiB needed"
    short = with_obs(WORKER, disk_free={"weights": 3 * GIB, "image": 100 * GIB})
    c = one(run(worker=short), "disk", "worker")
    assert c.status == "fail"
    assert c.message == ("weights (/srv/spark-testbed/worker/models/hub): only 3.0 GiB free: the copy would fill the "
                         "disk; free 1.0 GiB there (nothing is copied, stopped or started)")
    assert c.fix == Fix("df -h /srv/spark-testbed/worker/models/hub; du -xsh /srv/spark-testbed/worker/models/hub/* "
                        "| sort -h  # remove what is not needed, or let policy.retention.prune remove older copies",
                        "root", "worker")
    c = one(run(worker=with_obs(WORKER, disk_free={"weights": 100 * GIB, "image": GIB})), "disk", "worker")
    assert c.status == "fail" and c.message.startswith("image (docker's data root): only 1.0 GiB free")
    assert one(run(worker=with_obs(WORKER, disk_free=None)), "disk", "worker").status == "warn"


# -- the hop -----------------------------------------------------------------------------------------------------

def test_the_hop_waits_for_a_port_that_is_down():
    down = Link(name="enp1s0f1np1", admin_up=False, mtu=1500)
    c = one(run(worker=with_obs(WORKER, fabric=down), head=_facts(HEAD, hops=(HopAnswer("worker", 255, "No route"),))),
            "hop/worker", "head")
    assert (c.status, c.fix) == ("warn", None)
    assert c.message == ("cannot be checked until `reconciler apply` brings the fabric port up (worker's "
                         "enp1s0f1np1: down)")
    c = one(run(head=_facts(HEAD, hops=(HopAnswer("worker", edge.NO_CARRIER, no_carrier=True),))),
            "hop/worker", "head")
    assert c.status == "warn" and "head's enp1s0f1np1: no carrier" in c.message


def test_a_refused_hop_names_the_key_to_authorize():
    answer = HopAnswer("worker", 255, "spark@10.232.0.11: Permission denied (publickey).\n")
    c = one(run(head=_facts(HEAD, hops=(answer,))), "hop/worker", "head")
    assert c.status == "fail"
    assert c.message == ("spark on head cannot ssh to spark@10.232.0.11 over the fabric: spark@10.232.0.11: "
                         "Permission denied (publickey).")
    assert c.fix == Fix("ssh-keygen -y -f ~/.ssh/id_ed25519  # (ssh-keygen -t ed25519 first if there is none) then "
                        "add that line to ~spark/.ssh/authorized_keys on worker", "spark", "head")
    c = one(run(head=_facts(HEAD, hops=(HopAnswer("worker", 255, "Host key verification failed."),))),
            "hop/worker", "head")
    assert c.fix is not None and c.fix.command.startswith("ip -br addr | grep 10.232.0.11")


# -- the reconciler's host ---------------------------------------------------------------------------------------

def test_loose_trusted_files_name_their_fix():
    problem = ("/run/spark-testbed/known_hosts: the file is writable by others (mode 0666); chmod go-w")
    assert edge.file_fix(problem) == "chmod go-w /run/spark-testbed/known_hosts"
    assert edge.file_fix("/k: the private key is accessible by others (mode 0644); chmod 600 (ssh ...)") == \
        "chmod 600 /k"
    assert edge.file_fix("/a b: the file is owned by uid 7, not root or the reconciler's user (uid 0)") == \
        "chown root:root '/a b'"
    local = dataclasses.replace(LOCAL, file_problems=(FileProblem(problem, edge.file_fix(problem)),))
    c = one(run(local=local), "files", HERE)
    assert c.status == "fail" and c.fix == Fix("chmod go-w /run/spark-testbed/known_hosts", "root", HERE)


SECRETS = DESIRED.with_deployment(serving=DESIRED.serving.model_copy(
    update={"secrets": {"HF_TOKEN": "internet", "VLLM_API_KEY": "head"}}))


@pytest.mark.parametrize(("env", "status", "said", "fix"), [
    (EnvFile(ENV, exists=False), "fail", f"{ENV} does not exist; the daemon would lack HF_TOKEN, VLLM_API_KEY",
     f"install -m 0640 -o root -g spark /dev/null {ENV}"),
    (EnvFile(ENV, uid=1000, mode=0o644, names=frozenset({"HF_TOKEN", "VLLM_API_KEY"})), "fail",
     f"{ENV} is owned by uid 1000, mode 0644: it must be root's, mode 0640 or 0600 (it holds the secrets; spark's "
     "group may read it)", f"chown root:spark {ENV} && chmod 0640 {ENV}"),
    (EnvFile(ENV, uid=0, mode=0o644, names=frozenset({"HF_TOKEN", "VLLM_API_KEY"})), "fail",
     f"{ENV} is owned by uid 0, mode 0644: it must be root's, mode 0640 or 0600 (it holds the secrets; spark's "
     "group may read it)", f"chown root:spark {ENV} && chmod 0640 {ENV}"),
    (EnvFile(ENV, uid=0, mode=0o640, names=frozenset({"HF_TOKEN", "VLLM_API_KEY"})), "ok",
     f"{ENV} sets HF_TOKEN, VLLM_API_KEY (values not shown)", None),
    (EnvFile(ENV, uid=0, mode=0o600, names=None, error="Permission denied"), "warn",
     f"{ENV} cannot be read as spark (Permission denied): the names were not checked",
     f"reconciler doctor {FILE} --env-file {ENV}"),
    (EnvFile(ENV, uid=0, mode=0o600, names=frozenset({"VLLM_API_KEY"})), "fail",
     f"{ENV} does not set HF_TOKEN (declared in serving.secrets)",
     f"systemd-ask-password HF_TOKEN: | sed 's/^/HF_TOKEN=/' >> {ENV}  # then systemctl reload spark-reconciler"),
    (EnvFile(ENV, uid=0, mode=0o600, names=frozenset({"VLLM_API_KEY", "HF_TOKEN"})), "ok",
     f"{ENV} sets HF_TOKEN, VLLM_API_KEY (values not shown)", None),
])
def test_the_secrets_in_the_environment_file(env, status, said, fix):
    c = one(run(local=dataclasses.replace(LOCAL, env=env), desired=SECRETS), "secrets", HERE)
    assert (c.status, c.message, c.fix.command if c.fix else None) == (status, said, fix)


def test_the_environment_file_syntax_and_no_value_kept(tmp_path):
    text = ("# comment\n; also\n\nA=1\n  B = 'two words'  \nC=\"\"\nD=\nexport E=5\nF=con\\\ntinued\nbad line\n"
            "G='x'\n")
    assert env_file_names(text) == {"A", "B", "F", "G"}
    path = tmp_path / "environment"
    path.write_text("HF_TOKEN=hf_secret_value\n")
    path.chmod(0o600)
    env = edge.env_file(path)
    assert env.names == {"HF_TOKEN"} and env.mode == 0o600 and "hf_secret_value" not in repr(env)
    assert edge.env_file(tmp_path / "absent").exists is False


# -- the edge: the script and its reading ------------------------------------------------------------------------

def test_the_script_quotes_every_value_and_asks_sudo_without_running():
    script = edge.doctor_script(DESIRED, WORKER).script
    assert script.index("sec clock") < script.index("sec containers")  # the clock first
    assert "sudo -n -l /usr/sbin/ip addr add 10.232.0.11/24 dev enp1s0f1np1 2>&1" in script
    assert "sudo -n /usr" not in script  # asked, never run
    assert "for b in timeout curl docker ip ping find df sudo rsync python3; do" in script


def _answer(nonce: str, sections: dict[str, tuple[str, int]]) -> str:
    return "".join(f"\n@@{nonce} {name}\n{body}\n@@{nonce} rc {rc}\n" for name, (body, rc) in sections.items())


WORKER_ANSWER = {
    "clock": ("1765000000.250000000", 0),
    "containers": ("API []", 0),
    "docker_info": ('{"ServerVersion": "20.10.24", "Runtimes": {"runc": {}, "nvidia": {"path": "x"}}}', 0),
    "id": ("1000\nspark docker", 0),
    "bins": ("have timeout /usr/bin/timeout\nhave curl /usr/bin/curl\nhave docker /usr/bin/docker\n"
             "have ip /usr/sbin/ip\nhave ping /usr/bin/ping\nhave find /usr/bin/find\nhave df /usr/bin/df\n"
             "have sudo /usr/bin/sudo\nmissing rsync\nhave python3 /usr/bin/python3", 0),
    "rsync": ("sh: 1: rsync: not found\nmunged", 0),
    "sudo": ("0 0 /usr/sbin/ip link set dev enp1s0f1np1 up\n1 1 \n2 1 sudo: a password is required", 0),
    "link": ("[]", 0),
    "disk": ("weights /dev/loop1 2147483648 1048576 2146435072 1% /srv\n", 0),
    "gpu": ("NVIDIA GB10, 580.95.05", 0), "gpu_hook": ("/usr/bin/nvidia-container-runtime-hook", 0),
    "os": ("6.17.0-1014-nvidia", 0),
}


def test_a_recorded_answer_reads_into_facts():
    facts = edge.parse_doctor(DESIRED, WORKER, _answer("n0nce", WORKER_ANSWER), "n0nce", sent=1765000000.0)
    assert facts.clock_offset == pytest.approx(0.25)
    assert facts.binaries["rsync"] is None and facts.binaries["ip"] == "/usr/sbin/ip"
    assert facts.rsync_munged and facts.groups == ("spark", "docker") and facts.uid == 1000
    assert facts.runtimes == ("nvidia", "runc")
    assert [a.rc for a in facts.sudo[:3]] == [0, 1, 1] and facts.sudo[2].said == "sudo: a password is required"
    assert facts.sudo[3].said == "no answer"  # a command the node did not answer for is refused
    assert facts.observation is not None and facts.observation.disk_free == {"weights": 2146435072}
    assert facts.observation.fabric is not None and not facts.observation.fabric.exists


@pytest.mark.parametrize("section", ["clock", "sudo", "bins", "id", "docker_info"])
def test_odd_output_in_any_section_is_a_probe_error(section):
    odd = {**WORKER_ANSWER, section: ("{not: a fact}\x1b[31m\xff", 0)}
    with pytest.raises(ProbeError, match=section):
        edge.parse_doctor(DESIRED, WORKER, _answer("n", odd), "n", sent=0.0)


def test_a_node_past_its_deadline_reads_unreachable_and_the_others_are_read(monkeypatch):
    release = threading.Event()

    def read(desired, sessions, node, timeout):
        if node.name == "worker":
            release.wait(5)
        return NodeFacts(node.name)

    monkeypatch.setattr(edge, "read_node", read)
    monkeypatch.setattr(edge, "node_deadline", lambda desired, node, timeout: 0.3)
    found = edge.read_nodes(DESIRED, sessions=None, timeout=1)  # type: ignore[arg-type]
    release.set()
    assert found["head"] == NodeFacts("head")
    assert found["worker"].error_kind == "unreachable" and "no answer within 0.3s" in str(found["worker"].error)


def test_the_cli_exits_3_on_an_invalid_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("nodes: []\n")
    result = CliRunner().invoke(main, ["doctor", str(bad)])
    assert result.exit_code == 3


def test_the_cli_exits_1_on_a_failed_check_and_0_on_warnings(monkeypatch, tmp_path):
    warn = [Check("hop/worker", "head", "warn", "cannot be checked")]
    monkeypatch.setattr(edge, "doctor", lambda *args: warn)
    path = REPO / "desired-state" / "testbed.yaml"
    result = CliRunner().invoke(main, ["doctor", str(path)])
    assert result.exit_code == 0 and "[WARN] head  hop/worker   cannot be checked" in result.output
    monkeypatch.setattr(edge, "doctor", lambda *args: [*warn, Check("sudo", "worker", "fail", "x",
                                                                    Fix("y", "root", "worker"))])
    result = CliRunner().invoke(main, ["doctor", "--json", str(path)])
    assert result.exit_code == 1 and '"summary": {\n    "ok": 0,\n    "warn": 1,\n    "fail": 1' in result.output


def test_preflight_knows_no_io():
    source = Path(preflight.__file__).read_text()
    for word in ("import os", "import subprocess", "open(", "time.time"):
        assert word not in source


def test_the_hop_doctor_tries_is_the_hop_the_image_copy_runs(tmp_path):
    """The same ssh options as `steps.hop.ssh_options` (no configuration, BatchMode, strict host key, keepalive),
    only the known_hosts file is doctor's own, holding the same verified key under the fabric address."""
    import shlex

    from reconciler.edge.steps import hop

    known = tmp_path / "known_hosts"
    known.write_text("10.231.1.11 ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOZ9kXyYF4Qw1pW0Wm4g0eQyVY3b0kq1o0rVq7mZ2h1a\n")
    nodes = [n.model_copy(update={"ssh": n.ssh.model_copy(update={"known_hosts": str(known)})}) for n in DESIRED.nodes]
    desired = DESIRED.model_copy(update={"nodes": nodes})
    script = edge.doctor_script(desired, desired.node("head")).script
    line = next(x for x in script.splitlines() if "ssh -F /dev/null" in x)
    step = hop.ssh_options(desired, "worker")
    mine = shlex.split(line[line.index("timeout 15 ") + len("timeout 15 "):line.index(" 2>&1")])
    assert [w for w in mine if "UserKnownHostsFile" not in w] == [w for w in step if "UserKnownHostsFile" not in w] + \
        ["spark@10.232.0.11", "true"]
    assert "UserKnownHostsFile=~/.spark-reconciler/doctor_known_hosts_worker" in mine
    assert "'10.232.0.11 ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOZ9kXyYF4Qw1pW0Wm4g0eQyVY3b0kq1o0rVq7mZ2h1a\n'" in script
    assert "/sys/class/net/enp1s0f1np1/carrier" in script and 'rm -f -- "$d/doctor_known_hosts_worker"' in line
    assert "sec hop-worker" not in edge.doctor_script(desired, desired.node("worker")).script


def test_files_are_judged_as_the_daemons_user(tmp_path, monkeypatch):
    """Run as root (to read the environment file), doctor judges the files as the daemon's user would: a key that
    user owns is fine, as `reconciler run` finds it; `--daemon-user` names another user."""
    import os

    key = tmp_path / "id_ed25519"
    key.write_text("key")
    key.chmod(0o600)
    owner = os.geteuid()
    if owner == 0:  # root's own files are always accepted: give the key to another user, as the daemon's key is
        owner = 4242
        os.chown(key, owner, owner)
    nodes = [n.model_copy(update={"ssh": n.ssh.model_copy(update={"identity_file": str(key)})}) for n in DESIRED.nodes]
    desired = DESIRED.model_copy(update={"nodes": nodes})
    monkeypatch.setattr(trusted_files, "daemon_user", lambda name=None: ("someone", owner + 1))
    local = edge.local_facts(desired, str(tmp_path / "cluster.yaml"), tmp_path / "environment")
    assert local.user == "someone"
    assert [p.text for p in local.file_problems if str(key) in p.text] == [
        f"{key}: the file is owned by uid {owner}, not root or the reconciler's user (uid {owner + 1})"]
    monkeypatch.setattr(trusted_files, "daemon_user", lambda name=None: ("owner", owner))
    assert not [p for p in edge.local_facts(desired, str(key), tmp_path / "environment").file_problems
                if str(key) in p.text]


def test_the_daemon_user_defaults():
    import os
    import pwd

    name, uid = trusted_files.daemon_user()
    if os.geteuid() == 0:
        assert (name, uid) in (("root", 0), ("spark", pwd.getpwnam("spark").pw_uid))
    else:
        assert uid == os.geteuid()
    with pytest.raises(KeyError):
        trusted_files.daemon_user("no-such-user-here")
