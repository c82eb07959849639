"""The trust boundary's low findings (issue 31, items 11-17), each reproduced on today's code the way it bites.

A secret holding a newline became a variable of its own in docker's `--env-file`; a trusted host path could hold
the system paths refused below it; a world-readable private key was accepted; retention removed through a link;
the fabric hop's ssh read the source's own configuration and global known_hosts; `reconciler status` crashed on an
answer that was not its document. Real files, real links, the real shell, the real ssh and the installed console
script; no node, no testbed.
"""

from __future__ import annotations

import json
import pwd
import shutil
import stat
import subprocess
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace

import pytest

from reconciler.core import spec
from reconciler.core.planning import Step
from reconciler.core.vllm import launch_specs
from reconciler.edge import ledger, trusted_files
from reconciler.edge.facts.base import Section
from reconciler.edge.steps import hop
from reconciler.edge.steps import retention as prune
from tests.unit.steps.test_retention import containers_now

# ---------------------------------------------------------------------------------------------- 11: secrets

SECRETS = "  secrets: {VLLM_API_KEY: head, HF_TOKEN: internet}\n"
INJECTED = "sk-real-key-0123456789\nLD_PRELOAD=/tmp/evil.so"


@pytest.fixture
def with_secrets(tmp_path, base_yaml) -> Path:
    path = tmp_path / "cluster.yaml"
    path.write_text(base_yaml.replace("  env:\n", SECRETS + "  env:\n", 1))
    return path


@pytest.mark.parametrize("value", [INJECTED, "sk-key\r0123456789", "sk-key\t0123456789", "sk-key\x1b[2J012345"])
def test_a_secret_value_with_a_control_character_is_refused_by_name_never_shown(with_secrets, value):
    """Before, the value went as it was into `env_file_text`, and its second line was a variable of its own:
    `LD_PRELOAD`, which serving.env and serving.secrets both refuse by name."""
    with pytest.raises(spec.InvalidDesiredState) as info:
        spec.load(with_secrets, {"VLLM_API_KEY": value, "HF_TOKEN": "hf_token_value_0123"})
    [line] = info.value.lines()
    assert "serving.secrets.VLLM_API_KEY: VLLM_API_KEY has a control character" in line
    assert "--env-file" in line
    assert value not in str(info.value) and "evil" not in str(info.value) and "sk-" not in str(info.value)


def test_the_pure_check_refuses_it_too_and_a_clean_value_still_reaches_the_env_file(with_secrets):
    """`Desired.with_secrets` is where the values enter: what it accepts is one line of `--env-file` each."""
    desired = spec.load(with_secrets)
    with pytest.raises(spec.MissingSecrets) as info:
        desired.with_secrets({"VLLM_API_KEY": INJECTED, "HF_TOKEN": "hf_token_value_0123"})
    assert (info.value.names, info.value.unusable, str(info.value)) == ([], ["VLLM_API_KEY"], "VLLM_API_KEY")
    clean = desired.with_secrets({"VLLM_API_KEY": "sk-real-key-0123456789", "HF_TOKEN": "hf_token_value_0123"})
    head = launch_specs(clean)[0]
    names = [line.split("=", 1)[0] for line in head.env_file_text().splitlines()]
    assert names == sorted(head.started_env()) and "LD_PRELOAD" not in names


# ---------------------------------------------------------------------------------------------- 13: host paths


def _trust(base_yaml: str, lines: str) -> str:
    return base_yaml.replace("policy:\n", "trust:\n" + lines + "policy:\n", 1)


@pytest.mark.parametrize("trusted,holds", [
    ("/var", "/var/lib/docker"), ("/var/lib", "/var/lib/docker"), ("/var/lib/", "/var/lib/docker"),
    ("/home", "a home's key directories"), ("/home/spark", "a home's key directories"),
])
def test_a_trusted_host_path_may_not_hold_what_is_refused_below_it(base_yaml, problems, trusted, holds):
    """`trust.host_paths: [/var]` passed, and a volume `/var:/host` with it: /var/lib/docker and the docker
    socket (/var/run) in the container, which `volumes: [/var/lib/docker:/x]` alone is refused for."""
    [line] = problems(_trust(base_yaml, f"  host_paths: [{trusted}]\n"))
    assert f"trust.host_paths[0]: {trusted} holds {holds}" in line and line.endswith(": never mounted")


def test_a_volume_holding_a_refused_path_is_refused_whatever_is_trusted(base_yaml, problems):
    text = base_yaml.replace("co_tenants:\n", "  docker:\n    volumes: [/var/lib:/host]\n" "co_tenants:\n", 1)
    assert [line.split(": ", 1)[1] for line in problems(text)] == [
        "serving.docker.volumes[0]: /var/lib holds /var/lib/docker: never mounted into a serving container"]


def test_the_model_directory_may_not_hold_a_refused_path(edit, problems):
    """The model is mounted into every serving container, read-only: `/var/lib` would show it Docker's own
    state, the environments of every container on the node among it."""
    [line] = problems(edit(("  path: /home/spark/.cache/huggingface/hub", "  path: /var/lib")))
    assert "model.path: /var/lib holds /var/lib/docker: not a data directory" in line


@pytest.mark.parametrize("trusted", ["/data", "/srv/models", "/home/spark/models", "/var/cache/models", "/mnt"])
def test_directories_of_their_own_stay_trustable(base_yaml, problems, trusted):
    assert problems(_trust(base_yaml, f"  host_paths: [{trusted}]\n")) == []


# ---------------------------------------------------------------------------------------------- 14: private keys


def _key_file(tmp_path: Path, mode: int) -> Path:
    d = tmp_path / "etc"
    d.mkdir(mode=0o755, exist_ok=True)
    d.chmod(0o755)
    key = d / "id_ed25519"
    key.write_text("-----BEGIN OPENSSH PRIVATE KEY-----\nnot a real key\n")
    key.chmod(mode)
    return key


@pytest.mark.parametrize("mode,who", [(0o644, "others"), (0o604, "others"), (0o640, "its group"),
                                      (0o610, "its group")])
def test_a_private_key_anyone_else_may_read_is_refused(tmp_path, base_yaml, mode, who):
    """The identity file of the desired state, checked as `reconciler apply` and the daemon check it: 0644 passed
    (nobody else could *write* it), and paramiko loads such a key without a word; ssh ignores it."""
    key = _key_file(tmp_path, mode)
    desired = spec.loads(base_yaml.replace("      host: 10.0.0.1\n", f"      host: 10.0.0.1\n"
                                           f"      identity_file: {key}\n", 1))
    found = trusted_files.problems(trusted_files.trusted_paths(desired, tmp_path / "cluster.yaml"))
    assert found == [f"{key}: the private key is accessible by {who} (mode {mode:04o}); chmod 600 (ssh ignores "
                     "such a key: \"UNPROTECTED PRIVATE KEY FILE\")"]


def test_a_key_readable_by_its_owner_alone_passes_and_a_public_file_may_be_read(tmp_path, base_yaml):
    key = _key_file(tmp_path, 0o600)
    known_hosts = tmp_path / "etc" / "known_hosts"
    known_hosts.write_text("")
    known_hosts.chmod(0o644)
    desired = spec.loads(base_yaml.replace("      host: 10.0.0.1\n", f"      host: 10.0.0.1\n"
                                           f"      identity_file: {key}\n      known_hosts: {known_hosts}\n", 1))
    paths = [t for t in trusted_files.trusted_paths(desired, tmp_path / "cluster.yaml") if tmp_path in t.path.parents]
    assert [(str(t), t.private) for t in paths] == [(str(tmp_path / "cluster.yaml"), False),
                                                   (str(known_hosts), False), (str(key), True)]
    assert trusted_files.problems(paths) == []
    key.chmod(0o400)
    assert trusted_files.problems(paths) == []
    assert stat.S_IMODE(known_hosts.stat().st_mode) == 0o644


# ---------------------------------------------------------------------------------------------- 12: removal


def _synced_tree(tmp_path: Path, nodes) -> Path:
    from tests.unit.steps.test_weights_tree import hf_tree, sync

    repo = hf_tree(tmp_path / "src", shards=2, shard_bytes=10_000)
    sync(tmp_path, nodes)
    dst = tmp_path / "dst" / "hub" / repo.name
    [record] = ledger.parse_copies(Section((nodes["dst"].home / ledger.LEDGER).read_text(), 0), "dst")
    assert record.key == str(dst)
    return dst


def _prune(tmp_path, nodes, root: Path) -> list[str]:
    """Retention's step on `root` as the plan would start it; the reasons it kept anything."""
    from tests.unit.steps.test_retention import _prune_ctx, prune_weights
    from tests.unit.steps.test_weights_tree import _desired

    events: list = []
    prune_weights(_prune_ctx(tmp_path, nodes, _desired, events),
                        Step("prune-weights", "dst", "test", remove=(str(root),)))
    return [f["why"] for e, f in events if e == "retention.kept"]


def _listing(tree: Path) -> list[tuple[str, int]]:
    return sorted((str(p.relative_to(tree)), p.lstat().st_size) for p in tree.rglob("*"))


def test_retention_never_removes_through_a_linked_parent(tmp_path, nodes, monkeypatch):
    """The copy's hub became a link to another directory holding a tree that lists the same (another person's
    copy of the model): `rm -rf` on the recorded path removed *that* tree, through the link."""
    containers_now(monkeypatch)
    dst = _synced_tree(tmp_path, nodes)
    theirs = tmp_path / "theirs" / "hub"
    theirs.parent.mkdir()
    (tmp_path / "dst" / "hub").rename(theirs)
    (tmp_path / "dst" / "hub").symlink_to(theirs)
    before = _listing(theirs / dst.name)
    [why] = _prune(tmp_path, nodes, dst)
    assert "is a link now: never removed through a link" in why
    assert _listing(theirs / dst.name) == before, "retention removed a tree through a linked parent"
    assert ledger.parse_copies(Section((nodes["dst"].home / ledger.LEDGER).read_text(), 0), "dst") == []


def test_retention_keeps_a_tree_that_became_a_link(tmp_path, nodes, monkeypatch):
    """The recorded tree itself is a link now: the listing (`cd -P`) read the tree it leads to, its digest
    matched, and the step said `removed` for a tree it never touched (only the link went)."""
    containers_now(monkeypatch)
    dst = _synced_tree(tmp_path, nodes)
    moved = tmp_path / "moved" / dst.name
    moved.parent.mkdir()
    dst.rename(moved)
    dst.symlink_to(moved)
    [why] = _prune(tmp_path, nodes, dst)
    assert "is a link now" in why
    assert dst.is_symlink() and moved.is_dir() and _listing(moved)


def test_retention_still_removes_a_tree_reached_without_a_link(tmp_path, nodes, monkeypatch):
    containers_now(monkeypatch)
    dst = _synced_tree(tmp_path, nodes)
    assert _prune(tmp_path, nodes, dst) == []
    assert not dst.exists() and (tmp_path / "dst" / "hub").is_dir()


@pytest.mark.parametrize("linked", ["a", "a/b", "a/b/c"])
def test_the_unlinked_check_refuses_a_link_anywhere_on_the_path(tmp_path, linked):
    """`IN_UNLINKED_DIR`, the one check every removal on a node goes through, on real links at each depth."""
    real = tmp_path / "real"
    (real / "a" / "b" / "c").mkdir(parents=True)
    path = tmp_path / "p"
    shutil.copytree(real, path)
    shutil.rmtree(path / linked)
    (path / linked).symlink_to(real / linked)

    def enter(where: Path) -> int:
        return subprocess.run(["sh", "-c", prune.IN_UNLINKED_DIR, "sh", str(where)], check=False).returncode

    assert enter(real / "a" / "b" / "c") == 0
    assert enter(path / "a" / "b" / "c") == prune.LINK_ON_THE_WAY
    assert enter(tmp_path / "nowhere") == 2


# ---------------------------------------------------------------------------------------------- 16: the hop


HOSTILE_SSH_CONFIG = """\
Host *
  ProxyCommand /bin/false %h
  IdentityFile /nonexistent/someone-elses-key
  GlobalKnownHostsFile /nonexistent/accepts-any-key
  UserKnownHostsFile /nonexistent/also-any-key
"""


def _evaluated(argv: list[str], home: Path) -> dict[str, list[str]]:
    """What the source node's ssh would do with `argv` (`ssh -G`: the configuration evaluated, nothing sent),
    with `home` as the user's home: a private mount namespace puts it over the real home, as ssh takes the home
    from the password database, not from $HOME."""
    real_home = pwd.getpwuid(0).pw_dir  # who ssh is in the namespace (`unshare -r`: root)
    script = 'mount --bind "$1" "$2" && shift 2 && exec "$@"'
    out = subprocess.run(["unshare", "-rm", "sh", "-c", script, "sh", str(home), real_home, argv[0], "-G",
                          *argv[1:]], capture_output=True, text=True, check=True, timeout=30).stdout
    seen: dict[str, list[str]] = {}
    for line in out.splitlines():
        key, _, value = line.partition(" ")
        seen.setdefault(key, []).append(value)
    return seen


def test_the_fabric_hop_reads_no_configuration_of_the_source_and_still_offers_its_node_key(tmp_path):
    """A `Host *` block in the source's ~/.ssh/config gave the hop a ProxyCommand, another key and known_hosts
    files that accept any host key; now only the hop's own options count. With IdentitiesOnly and no IdentityFile,
    ssh still offers the default identities, ~/.ssh/id_ed25519 among them: the node key the runbook authorizes
    (docs/operations.md, step 4)."""
    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True, mode=0o700)
    (home / ".ssh" / "config").write_text(HOSTILE_SSH_CONFIG)
    (home / ".ssh" / "config").chmod(0o600)
    target = SimpleNamespace(ssh=SimpleNamespace(port=22, connect_timeout=10.0))
    ctx = SimpleNamespace(desired=SimpleNamespace(node=lambda name: target))
    seen = _evaluated([*hop.ssh_options(ctx.desired, "worker1"), "spark@192.168.200.13", "true"], home)
    assert "proxycommand" not in seen, seen.get("proxycommand")
    assert seen["globalknownhostsfile"] == ["/dev/null"]
    assert seen["userknownhostsfile"] == [f"{pwd.getpwuid(0).pw_dir}/.ssh/spark-reconciler_fabric_known_hosts_worker1"]
    assert seen["identitiesonly"] == ["yes"] and seen["stricthostkeychecking"] == ["true"]
    assert "~/.ssh/id_ed25519" in seen["identityfile"]
    assert not [f for f in seen["identityfile"] if "someone-elses" in f]


# ---------------------------------------------------------------------------------------------- 17: status


class _Answer(BaseHTTPRequestHandler):
    body = b""

    def do_GET(self):
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(self.body)))
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args):
        pass


@pytest.fixture
def answering() -> Iterator[Callable[[object], str]]:
    """A listener on a free loopback port that answers every GET with the JSON given (bytes: as they are);
    yields `url_for(doc)`."""
    servers: list[ThreadingHTTPServer] = []

    def url_for(doc: object) -> str:
        body = doc if isinstance(doc, bytes) else json.dumps(doc).encode()
        handler = type("Answer", (_Answer,), {"body": body})
        server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}"

    yield url_for
    for server in servers:
        server.shutdown()
        server.server_close()


NOT_A_STATUS = [
    pytest.param({"phase": "Converged", "conditions": [{"type": "Ready"}]}, "KeyError", id="condition-without-node"),
    pytest.param({"phase": "Converging", "conditions": ["x"]}, "TypeError", id="condition-not-a-mapping"),
    pytest.param({"phase": "Converged", "operations": [{"step": "s", "state": "r", "seconds": "x",
                                                        "deadlineIn": 1}]}, "ValueError", id="seconds-not-a-number"),
    pytest.param([1, 2, 3], "no phase", id="a-list"),
    pytest.param("Converged", "no phase", id="a-string"),
    pytest.param({"status": "ok"}, "no phase", id="another-programs-document"),
]


@pytest.mark.parametrize("as_json", [False, True], ids=["text", "json"])
@pytest.mark.parametrize("doc,why", NOT_A_STATUS)
def test_status_says_the_answer_is_not_its_document_and_exits_1(console_script, answering, doc, why, as_json):
    """docs/cli.md: status exits 0 converged, 1 not (or unreachable); never a traceback, whatever answered."""
    url = answering(doc)
    result = subprocess.run([console_script, "status", "--url", url, "--state-dir", "/nonexistent",
                             *(["--json"] if as_json else [])],
                            capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 1, result
    assert "Traceback" not in result.stderr, result.stderr
    assert f"{url}/status did not answer a reconciler status document ({why}" in result.stderr
    assert result.stdout == ""


REAL_STATUS = {"phase": "Converged", "generation": 3, "observedGeneration": 3, "conditions": [
    {"node": "", "type": "Ready", "status": "True", "reason": "Converged", "message": ""}]}


def test_status_still_reads_a_real_document(console_script, answering, tmp_path):
    """With no status key to read (not the daemon's user) the answer is read, and said to be unverified."""
    result = subprocess.run([console_script, "status", "--url", answering(REAL_STATUS), "--state-dir",
                             str(tmp_path / "not-mine")], capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0 and "phase Converged" in result.stdout
    assert "not verified that the daemon of" in result.stderr


def test_status_believes_only_the_daemon_that_keeps_the_state_dir(console_script, answering, tmp_path):
    """Issue 31, item 4: a local user who bound the port first served a fake Converged that `status` believed
    (exit 0). Now the daemon proves its answer with the key in its state dir (an HMAC of status's fresh
    challenge): the real listener's answer passes, the squatter's identical document does not."""
    from reconciler.loop.server import make_status_key, serve

    key = make_status_key(tmp_path)
    assert key is not None and oct((tmp_path / "status.key").stat().st_mode & 0o777) == "0o600"
    real = serve("127.0.0.1:0", lambda: REAL_STATUS, key=key)
    try:
        url = f"http://127.0.0.1:{real.server_address[1]}"
        ours = subprocess.run([console_script, "status", "--url", url, "--state-dir", str(tmp_path)],
                              capture_output=True, text=True, timeout=60, check=False)
    finally:
        real.shutdown()
    squatter = answering(REAL_STATUS)
    fake = subprocess.run([console_script, "status", "--url", squatter, "--state-dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=60, check=False)
    assert ours.returncode == 0 and "phase Converged" in ours.stdout and ours.stderr == "", ours.stderr
    assert fake.returncode == 1 and fake.stdout == ""
    assert f"{squatter}/status answered without the proof of the daemon that keeps {tmp_path}" in fake.stderr


def test_status_on_a_nesting_bomb_says_it_cannot_read_the_answer(console_script, answering):
    """200,000 `[`: json's parser gives up with a RecursionError, which was a traceback."""
    url = answering(b"[" * 200_000)
    result = subprocess.run([console_script, "status", "--url", url], capture_output=True, text=True, timeout=60,
                            check=False)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert f"cannot read the answer of {url}/status: maximum recursion depth exceeded" in result.stderr


def test_the_compile_cache_directories_are_the_ssh_user_s_alone(tmp_path):
    """Issue 31, item 18: no `nosuid` for a bind mount in Docker, so the host directories a root container writes
    into are 0700, new or already there (the real command, by a real sh)."""
    from reconciler.edge.steps.serving import cache_dirs_argv

    old = tmp_path / "home" / ".triton"
    old.mkdir(parents=True, mode=0o755)
    old.chmod(0o755)
    new = tmp_path / "home" / ".cache" / "vllm"
    subprocess.run(cache_dirs_argv([str(old), str(new)]), check=True, timeout=30)
    assert [oct(d.stat().st_mode & 0o777) for d in (old, new)] == ["0o700", "0o700"]
