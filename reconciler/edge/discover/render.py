"""The starter desired state, written as a commented YAML document by ruamel.yaml.

Why a YAML library rather than lines of text: the file mixes values a node sent (hostnames, container names,
image references, paths) with comments that explain every guess, and it must parse back to exactly the values
meant. Built as a CommentedMap, every value is a node of the document that the emitter quotes, and every comment
is attached to the key it explains (`# GUESS:` on the guessed value's own line, notes above a section), so no
text from a node is ever spliced into YAML by hand and no line break it sends can start a line of live YAML.

Node text still goes through `text.printable` first (reconciler/core/text.py): a value read back from the file
holds no control character (the spec's patterns then refuse what a node should never have sent), and a comment
is one printable line. The text is checked once more, line by line, after the dump.

The document ends with `...`, the end marker the loader requires (a half-written save is then refused).
"""

from __future__ import annotations

import io
from dataclasses import dataclass

from ruamel.yaml import YAML
from ruamel.yaml.comments import CommentedMap, CommentedSeq
from ruamel.yaml.nodes import ScalarNode
from ruamel.yaml.representer import RoundTripRepresenter
from ruamel.yaml.scalarstring import DoubleQuotedScalarString

from reconciler.core.spec import Policy
from reconciler.core.text import printable
from reconciler.edge.discover.facts import ModelDir, NodeFacts
from reconciler.edge.discover.guess import (
    NodeDraft,
    draft_nodes,
    guess_gmu,
    holds_serving_port,
    model_root_for,
    pick_image,
    pick_model,
    vllm_reservation,
)

HEADER = ("Starter desired state written by `reconciler discover` (read-only probe of each node over SSH).\n"
          "Review every `# GUESS:` line, then: reconciler validate FILE && reconciler plan FILE.\n"
          "Values without a GUESS comment were read from the nodes as they are now.\n"
          "Keep the end marker `...` the last line: a half-written save is then refused.")
#: Where end-of-line comments start (after a longer line: one space after it).
COMMENT_COLUMN = 36
#: The policy the starter file runs with: `_policy()` names neither policy.memory_margin nor
#: policy.memory_overhead_per_instance, so they are the policy model's defaults (core/spec/models.py, the one place
#: that defines them), and the gpu_memory_utilization guess reads the same two figures the file's memory check will.
STARTER_POLICY = Policy()
#: Longest node text kept in a comment.
COMMENT_TEXT_MAX = 300


def quoted(value: object) -> DoubleQuotedScalarString:
    """Node or operator text as a double-quoted scalar of printable text: a `#` or a quote stays inside the value."""
    scalar: DoubleQuotedScalarString = DoubleQuotedScalarString(printable(str(value)))
    return scalar


def comment_text(text: object) -> str:
    """Node text made safe for a comment: one line, printable, at most COMMENT_TEXT_MAX characters."""
    return printable(str(text))[:COMMENT_TEXT_MAX]


def _flow(collection: CommentedMap | CommentedSeq) -> CommentedMap | CommentedSeq:
    """`collection` written on one line: `[IPC_LOCK]`, `{nofile: "1048576:1048576"}`, `{}`."""
    collection.fa.set_flow_style()
    return collection


def _eol(collection: CommentedMap | CommentedSeq, key: object, text: str) -> None:
    """`text` as the comment at the end of `key`'s line."""
    collection.yaml_add_eol_comment(printable(text), key, column=COMMENT_COLUMN)


def _above(mapping: CommentedMap, key: str, lines: list[str], indent: int, blank: bool = False) -> None:
    """Comment lines above `key` (at `indent`), after an empty line when `blank`."""
    if not lines and not blank:
        return
    text = "\n".join(["", *map(printable, lines)] if blank else map(printable, lines))
    mapping.yaml_set_comment_before_after_key(key, before=text, indent=indent)


class _Representer(RoundTripRepresenter):
    """ruamel's round-trip representer, but None written `null` (not an empty value): `gpus: null` says "no
    --gpus" in the file itself."""

    def represent_none(self, data: None) -> ScalarNode:
        return self.represent_scalar("tag:yaml.org,2002:null", "null")


_Representer.add_representer(type(None), _Representer.represent_none)


def _dump(document: CommentedMap) -> str:
    yaml = YAML()
    yaml.Representer = _Representer
    yaml.indent(mapping=2, sequence=4, offset=2)
    yaml.width = 1 << 20          # never fold a long value onto a second line
    yaml.explicit_end = True
    stream = io.StringIO()
    yaml.dump(document, stream)
    return stream.getvalue()


@dataclass(frozen=True)
class SshChoice:
    """How the operator asked to reach the nodes (discover's own options), repeated in every node's `ssh`."""

    user: str
    known_hosts: str
    identity: str | None
    jump: bool


# --------------------------------------------------------------------------------------------------- nodes

def _ssh(node: NodeDraft, is_head: bool, head_name: str, choice: SshChoice) -> CommentedMap:
    ssh = CommentedMap([("host", quoted(node.facts.host)), ("user", quoted(choice.user))])
    if not is_head and choice.jump:
        ssh["jump"] = quoted(head_name)
        _eol(ssh, "jump", "through the head (--jump-through-head)")
    ssh["known_hosts"] = quoted(choice.known_hosts)
    if choice.identity:
        ssh["identity_file"] = quoted(choice.identity)
    return ssh


def _fabric(node: NodeDraft) -> tuple[CommentedMap, list[str]]:
    """The fabric section, and the notes that go above it (why this interface, the twins)."""
    guess, facts = node.fabric, node.facts
    notes = [comment_text(note) for note in guess.notes]
    if guess.twins:
        hca = ",".join([guess.rdma_device or "", *guess.twins])
        notes.append(f"twins with IPv4 and an ACTIVE port: {comment_text(', '.join(guess.twins))}; for both rails "
                     f"set serving.env.NCCL_IB_HCA: \"{comment_text(hca)}\"")
    fabric = CommentedMap([("interface", quoted(guess.interface))])
    _eol(fabric, "interface", "GUESS: see the note above")
    if guess.rdma_device:
        fabric["rdma_device"] = quoted(guess.rdma_device)
        _eol(fabric, "rdma_device", f"its RDMA port as read ({facts.rdma_source})")
    fabric["address"] = quoted(node.address)
    if not guess.rdma_device:
        _above(fabric, "address", ["rdma_device: omitted, no RDMA device maps to this netdev here"], indent=6)
    if node.address_note:
        _eol(fabric, "address", f"GUESS: {comment_text(node.address_note)}")
    fabric["mtu"] = 9000
    if guess.observed_mtu != 9000:
        _eol(fabric, "mtu", f"GUESS: observed {guess.observed_mtu or 'nothing'}; 9000 is the Spark recipes' value "
                            f"(set by the link step)")
    return fabric, notes


def _node(node: NodeDraft, is_head: bool, head_name: str, choice: SshChoice) -> CommentedMap:
    facts = node.facts
    entry = CommentedMap([("name", quoted(node.name)), ("role", "head" if is_head else "worker")])
    if not facts.hostname:
        _eol(entry, "name", "GUESS: hostname unreadable")
    if is_head:
        _eol(entry, "role", "GUESS: the first --head host runs rank 0 and the API")
    entry["ssh"] = _ssh(node, is_head, head_name, choice)
    entry["fabric"], notes = _fabric(node)
    _above(entry, "fabric", notes, indent=4)
    entry["internet"] = facts.internet
    memory = (f"MemTotal {facts.mem_total / 2**30:.1f} GiB, MemAvailable {facts.mem_available / 2**30:.1f} GiB"
              if facts.mem_total else "memory unknown")
    running = comment_text(", ".join(c.name for c in facts.containers) or "nothing")
    _above(entry, "internet", [f"{memory}; running: {running}",
                               *(f"problem while reading this node: {comment_text(e)}" for e in facts.errors)],
           indent=4)
    _eol(entry, "internet", "from the routing table (`ip route get 1.1.1.1`); "
                            + ("a route exists" if facts.internet else "no route: gets HF_HUB_OFFLINE=1"))
    entry["gpus"] = 1
    _eol(entry, "gpus", "GUESS: a DGX Spark has one GB10")
    return entry


# --------------------------------------------------------------------------------------------------- model

def _placeholder_model(document: CommentedMap, user: str) -> None:
    model = CommentedMap([("id", quoted("org/model")), ("revision", "main"), ("layout", "hf-cache"),
                          ("path", quoted(f"/home/{user}/.cache/huggingface/hub"))])
    _eol(model, "id", "GUESS: placeholder")
    _eol(model, "path", "GUESS: the default cache")
    document["model"] = model
    _above(document, "model", ["GUESS: no Hugging Face cache directory found under $HF_HOME/hub, "
                               "~/.cache/huggingface/hub,", "/srv/*/models or /srv/*/*/models/hub: put the model's "
                               "id, revision and path here."], indent=0, blank=True)


def _found_model(document: CommentedMap, nodes: list[NodeDraft], found: ModelDir, source_index: int,
                 asked: ModelChoice | None = None) -> None:
    """The model found on node `source_index` (or the one `--model` asked for, which the source may not hold yet:
    `apply` downloads it there); its path as one value when every node would use the same, else per node."""
    paths = [model_root_for(n.facts, n.name, found, found.root) for n in nodes]
    source = nodes[source_index]
    revision = (asked.revision if asked and asked.revision else None) or found.revision or "main"
    model = CommentedMap([("id", quoted(found.model_id)), ("revision", quoted(revision)),
                          ("layout", "hf-cache"), ("source", quoted(source.name))])
    _say_model_origin(model, found, source.name, asked)
    _model_path(model, paths, nodes)
    document["model"] = model
    seen = ", ".join(f"{m.model_id} ({m.size_kib / 2**20:.1f} GiB, {m.layout})" for m in source.facts.models)
    _above(document, "model", [f"models on {source.name}: {comment_text(seen or 'none')}"], indent=0, blank=True)


def _say_model_origin(model: CommentedMap, found: ModelDir, source: str, asked: ModelChoice | None) -> None:
    """The comments on the model's id, revision and source: where each came from (a guess, or the command line)."""
    if asked is None:
        _eol(model, "id", f"GUESS: the largest Hugging Face cache directory on {source}")
        _eol(model, "revision", "refs/main of the cache" if found.revision else "GUESS: no refs/main")
    else:
        _eol(model, "id", "--model" + (f"; in the cache on {source}" if found.size_kib else
                                       f"; not on {source} yet: `reconciler apply` downloads it there"))
        _eol(model, "revision", "--revision" if asked.revision else
             "refs/main of the cache" if found.revision else "GUESS: no --revision: pin a commit hash")
    _eol(model, "source", "the node that holds the weights" if found.size_kib else
         "the node that downloads the weights (the head: it has the internet)")


def _model_path(model: CommentedMap, paths: list[tuple[str, str]], nodes: list[NodeDraft]) -> None:
    """model.path: one value when every node would use the same path, else one per node; each with its guess."""
    if len({path for path, _ in paths}) == 1:
        model["path"] = quoted(paths[0][0])
        _eol(model, "path", f"GUESS: {comment_text(paths[0][1])}")
    else:
        model["path"] = per_node = CommentedMap()
        for (path, why), node in zip(paths, nodes):
            per_node[quoted(node.name)] = quoted(path)
            _eol(per_node, quoted(node.name), f"GUESS: {comment_text(why)}")


@dataclass(frozen=True)
class ModelChoice:
    """What the operator named on discover's command line (`--model`, `--revision`, `--image`,
    `--api-key-secret`): written as given, without a GUESS, so the file needs no hand edit for them."""

    model: str | None = None
    revision: str | None = None
    image: str | None = None
    api_key_secret: bool = False


def _asked_model(all_facts: list[NodeFacts], asked: ModelChoice, user: str) -> tuple[ModelDir, int]:
    """The model `--model` names: where a node's cache holds it (the head first), else on the head, to be
    downloaded there by `apply`, in the head's Hugging Face cache (the default one when it has none yet)."""
    assert asked.model is not None
    for i, facts in enumerate(all_facts):
        held = [m for m in facts.models if m.layout == "hf-cache" and m.model_id == asked.model]
        if held:
            return max(held, key=lambda m: m.size_kib), i
    return ModelDir("hf-cache", f"/home/{user}/.cache/huggingface/hub", asked.model, 0, ""), 0


# --------------------------------------------------------------------------------------------------- serving

def _serving(all_facts: list[NodeFacts], model: ModelDir | None, port: int, asked: ModelChoice) -> CommentedMap:
    if asked.image:
        image, image_why = asked.image, ""
    else:
        image, image_why = pick_image(all_facts[0])
    gmu, gmu_why = guess_gmu(all_facts, STARTER_POLICY)
    serving = CommentedMap([("image", quoted(image)), ("launcher", "native"), ("container_name", "vllm_serving"),
                            ("tensor_parallel_size", len(all_facts)), ("pipeline_parallel_size", 1), ("port", port),
                            ("master_port", 29501), ("gpu_memory_utilization", gmu)])
    if asked.image:
        present = any(ref == asked.image for ref, _ in all_facts[0].images)
        _eol(serving, "image", "--image" + ("" if present else
                                            "; not on the head yet: `reconciler apply` pulls it there"))
    else:
        _eol(serving, "image", f"GUESS: {comment_text(image_why)}")
    _eol(serving, "tensor_parallel_size", "GUESS: one GPU per node, every node serves")
    _eol(serving, "gpu_memory_utilization", f"GUESS: {comment_text(gmu_why)}")
    if model is not None:
        serving["served_model_name"] = quoted(model.model_id.split("/", 1)[1])
        _eol(serving, "served_model_name", "GUESS: the model's name")
    if asked.api_key_secret:
        serving["secrets"] = CommentedMap([("VLLM_API_KEY", "head")])
        _eol(serving["secrets"], "VLLM_API_KEY", "--api-key-secret: the API's key, its value in the "
                                                 "daemon's environment (/etc/spark-reconciler/environment)")
    serving["docker"] = _docker(all_facts[0])
    return serving


def _docker(head: NodeFacts) -> CommentedMap:
    """serving.docker from the head's docker runtimes and hard limits."""
    nofile = min(1048576, head.nofile_hard) if head.nofile_hard else 1048576
    ulimits = CommentedMap([("nofile", quoted(f"{nofile}:{nofile}"))])
    if not head.memlock_unlimited:
        ulimits["memlock"] = None   # removes the default memlock=-1, which docker could not grant here
    gpus = head.nvidia_runtime or head.gpu_hook
    docker = CommentedMap([("gpus", quoted("all") if gpus else None), ("privileged", False)])
    _eol(docker, "gpus", "the NVIDIA container toolkit is installed" if gpus
         else "GUESS: no NVIDIA container toolkit on the head (no nvidia runtime, no hook): no --gpus")
    _eol(docker, "privileged", "true needs trust.privileged: root over the node (docs/security.md)")
    if head.rdma_source != "none":
        docker["devices"] = _flow(CommentedSeq(["/dev/infiniband"]))
        _eol(docker, "devices", "NCCL's RoCE transport without privileged (eugr --non-privileged)")
        docker["cap_add"] = _flow(CommentedSeq(["IPC_LOCK"]))
    docker["ipc"] = "host"
    docker["shm_size"] = quoted("64g")
    docker["ulimits"] = _flow(ulimits)
    _eol(docker, "ulimits", f"GUESS: capped by the head's hard limits (nofile {head.nofile_hard or 'unlimited'}, "
                            f"memlock {'unlimited' if head.memlock_unlimited else 'limited'})")
    return docker


# --------------------------------------------------------------------------------------------------- co-tenants

def _co_tenants(nodes: list[NodeDraft], port: int) -> CommentedMap:
    """What runs now may keep running, except another launcher's serving container or one on the serving port:
    those are listed as comments, to be stopped."""
    allowed, memory = CommentedMap(), CommentedMap()
    stopped: list[str] = []
    for node in nodes:
        others = [c for c in node.facts.containers if not c.managed]
        keep, held = CommentedSeq(), CommentedMap()
        for container in others:
            if holds_serving_port(container, port):
                stopped.append(f"{node.name}: {comment_text(container.name)} is NOT allowed   # GUESS: another "
                               f"launcher's serving container or it holds :{port}; the reconciler STOPS it "
                               f"(never removes)")
                continue
            keep.append(quoted(container.name))
            _eol(keep, len(keep) - 1, f"image {comment_text(container.image)}")
            if (reserved := vllm_reservation(container, node.facts.mem_total)) is not None:
                held[quoted(container.name)] = quoted(f"{reserved[0] // 2**30}GiB")
                _eol(held, quoted(container.name), f"GUESS: {reserved[1]}; a deployment of its own once this "
                                                   "version serves several")
        if keep:
            allowed[quoted(node.name)] = keep
            _eol(allowed, quoted(node.name), "GUESS: running now, allowed to keep running (remove to have it "
                                             "stopped)")
        if held:
            memory[quoted(node.name)] = held
    co_tenants = CommentedMap([("allowed", allowed if allowed else _flow(CommentedMap())),
                               ("protected", _flow(CommentedMap())), ("unlisted", "stop")])
    if memory:
        co_tenants["memory"] = memory
        _above(co_tenants, "memory", ["the vLLM co-tenants' unified memory, reserved in each node's budget beside "
                                      "the deployment (docs/operations.md, \"Several models\")"], indent=2)
    _above(co_tenants, "protected", stopped, indent=2)
    _eol(co_tenants, "unlisted", "GUESS: unlisted containers are stopped to free unified memory; `report` only "
                                 "reports")
    return co_tenants


def _policy() -> CommentedMap:
    policy = CommentedMap([("mode", "enforce"), ("resync_interval", "30s"), ("listen", quoted("127.0.0.1:9464"))])
    _eol(policy, "mode", "`observe` to only report drift for a first look")
    return policy


# --------------------------------------------------------------------------------------------------- the file

def render(heads_and_workers: list[NodeFacts], *, user: str, known_hosts: str, identity: str | None,
           jump: bool, port: int = 8000, asked: ModelChoice | None = None) -> str:
    """The starter desired state. Node 0 is the head. Every inferred value carries `# GUESS:`; what `asked`
    names (discover's `--model`, `--revision`, `--image`, `--api-key-secret`) is written as given."""
    all_facts = heads_and_workers
    asked = asked or ModelChoice()
    nodes = draft_nodes(all_facts)
    choice = SshChoice(user, known_hosts, identity, jump)
    document = CommentedMap()
    document.yaml_set_start_comment(HEADER)
    document["nodes"] = CommentedSeq(_node(node, i == 0, nodes[0].name, choice) for i, node in enumerate(nodes))
    if asked.model:
        model: ModelDir | None
        model, source_index = _asked_model(all_facts, asked, user)
        _found_model(document, nodes, model, source_index, asked)
    else:
        model, source_index = pick_model(all_facts)
        if model is None:
            _placeholder_model(document, user)
        else:
            _found_model(document, nodes, model, source_index)
    document["serving"] = _serving(all_facts, model, port, asked)
    document["co_tenants"] = _co_tenants(nodes, port)
    document["policy"] = _policy()
    for section in ("serving", "co_tenants", "policy"):
        _above(document, section, [], indent=0, blank=True)
    return "\n".join(map(printable, _dump(document).split("\n")))
