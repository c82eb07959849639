"""The probe of a file of several deployments (issue 35): the nodes' own fragments once, each deployment's
image, weights and API under its own section prefix, read back into `NodeObservation.deployments`.

The oracle is the recorded single-deployment probe of the four-node testbed (tests/unit/fixtures/
probe-4-nodes.json): the same bytes, sectioned per deployment, must read as the file of one reads them.
"""

from __future__ import annotations

import subprocess

from reconciler.core.observed import ServingApi
from reconciler.edge.facts.base import SECTION_FUNCTION
from reconciler.edge.observe import parse_probe, probe_script
from testbed.recordings import reseal
from tests.unit.core.test_deployments_plan import _two
from tests.unit.recorded import NONCE, RAW, load, parsed

#: The sections a deployment's fragments write (observe._deployment_facts reads them).
OWN = ("image", "disk", "weights", "health", "models", "completion", "engine", "port_owner", "ray")


def _per_deployment(kept: str, names: tuple[str, ...], drop: tuple[str, ...] = ()) -> str:
    """A recorded output with each deployment's sections repeated under `NAME/` (the probe of a file of several
    prints them so), the nodes' own sections once; `drop`: deployments whose sections are left out."""
    out, own, current = [], {n: [] for n in names}, None
    for line in kept.split("\n"):
        if line.startswith("@@") and not line.startswith("@@rc"):
            current = line[2:] if line[2:] in OWN else None
        if current is None:
            out.append(line)
        else:
            for name in names:
                own[name].append(f"@@{name}/{line[2:]}" if line == f"@@{current}" else line)
    return "\n".join(out + [line for name in names if name not in drop for line in own[name]])


def test_a_section_takes_the_deployments_prefix_in_a_real_shell():
    script = "\n".join([f"SEAL=@@{NONCE}", SECTION_FUNCTION, "sec plain; rc 0", "PFX='small/'", "sec weights; rc 0",
                        "PFX=", "sec after; rc 0", ""])
    out = subprocess.run(["sh", "-c", script], capture_output=True, text=True, timeout=10, check=True).stdout
    marks = [line.split(" ", 1)[1] for line in out.splitlines() if line.startswith(f"@@{NONCE} ")]
    assert marks == ["plain", "rc 0", "small/weights", "rc 0", "after", "rc 0"]


def test_the_script_runs_each_deployments_fragments_under_its_prefix_and_the_nodes_once():
    two = _two()
    head = probe_script(two, two.node("head")).script
    assert subprocess.run(["sh", "-n"], input=head, text=True, timeout=10, check=False).returncode == 0
    assert head.count("sec containers") == 1 and head.count("sec meminfo") == 1
    assert head.count("sec health") == 2 and head.count("sec weights") == 2
    big, small = head.index("PFX=big/"), head.index("PFX=small/")
    assert big < head.index("127.0.0.1:8000/health") < small < head.index("127.0.0.1:8003/health")
    assert head.rstrip().endswith("PFX=")
    worker = probe_script(two, two.node("worker1")).script
    assert "sec health" not in worker and worker.count("sec weights") == 2
    one = load()
    assert "PFX" not in probe_script(one, one.node("head")).script.replace("${PFX:-}", "")


def test_each_deployments_sections_read_as_the_file_of_one_reads_them():
    two, one = _two(), load()
    kept = _per_deployment(RAW["outputs"]["head"], ("big", "small"))
    seen = parse_probe(two, two.node("head"), reseal(kept, NONCE), NONCE)
    alone = parsed(one, "head")
    assert seen.weights is None and seen.serving is None and set(seen.deployments) == {"big", "small"}
    for name in ("big", "small"):
        facts = seen.deployments[name]
        assert (facts.weights, facts.serving, facts.disk_free) == (alone.weights, alone.serving, alone.disk_free)
    assert seen.images == alone.images and seen.containers == alone.containers and seen.memory == alone.memory


def test_a_deployment_whose_sections_are_missing_reads_as_not_answering():
    """The probe was cut before small's fragments ran: small's API reads as not answering, big's as before."""
    two = _two()
    kept = _per_deployment(RAW["outputs"]["head"], ("big", "small"), drop=("small",))
    seen = parse_probe(two, two.node("head"), reseal(kept, NONCE), NONCE)
    assert seen.deployments["small"].serving == ServingApi() and not seen.deployments["small"].weights.present
    assert seen.deployments["big"].serving == parsed(load(), "head").serving


def test_two_deployments_copies_to_one_node_write_their_own_file_lists():
    """Two deployments' weights copies to one node run at once: each stream's file list on the source is named by
    the tree it fills (the testbed's mix found them sharing one name: rsync then looked for one model's files in
    the other's tree)."""
    from reconciler.edge.steps.weights import _upload_file_list

    def listed(tree: str) -> str:
        run = next(_upload_file_list("head", "worker", tree, 0, ["a"]))
        return run.argv[-1]
    moe, embed = listed("/hub/models--org--moe"), listed("/hub/models--org--embed")
    assert moe != embed and moe.startswith(".spark-reconciler/rsync-worker-") and moe.endswith("-0.list")
    assert listed("/hub/models--org--moe") == moe, "the same tree, the same list (a resumed copy rewrites it)"
