"""The file's rule on a node's fractions (issue 52, item 4): the gpu_memory_utilization of the deployments on a node
add up to at most policy.gpu_memory_utilization_ceiling (0.90 by default), one deployment alone included; the
problem is said at the line and column of the last deployment's fraction on that node, as every rule says its
problems. Before, a node's fractions could reach 1.0 (a head of 0.85 + 0.05 + 0.08 = 0.98 validated)."""

from __future__ import annotations

import io
import json

from ruamel.yaml import YAML

from tests.unit.conftest import BASE_YAML

TAIL = ("of its memory (at most 0.9, policy.gpu_memory_utilization_ceiling: a GB10 also holds each instance's memory "
        "outside its pool and the OS's)")


def _line_col(text: str, needle: str, after: str = "") -> tuple[int, int]:
    """1-based line and column of the value after `needle` (the first after a line holding `after`)."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if after in line) if after else 0
    i = next(i for i, line in enumerate(lines) if i >= start and needle in line)
    return i + 1, lines[i].index(needle) + len(needle) + 1


def _the_issues_head(big: float = 0.85, embed: float = 0.05, rerank: float = 0.08) -> str:
    """BASE_YAML as three deployments: the TP-2 model across both nodes, embeddings and a reranker beside it on
    the head (the issue's head: 0.85 + 0.05 + 0.08)."""
    data = YAML(typ="safe").load(BASE_YAML)
    model, serving = data.pop("model"), data.pop("serving")

    def one(name: str, gmu: float, port: int | None = None) -> dict:
        s = json.loads(json.dumps(serving)) | {"gpu_memory_utilization": gmu}
        if port:
            s |= {"container_name": f"vllm_{name}", "port": port, "nodes": ["head-a"], "tensor_parallel_size": 1}
        return {"name": name, "model": model, "serving": s}

    out = io.StringIO()
    YAML().dump({"nodes": data.pop("nodes"), "deployments": [one("big", big), one("embed", embed, 8001),
                                                             one("rerank", rerank, 8002)], **data}, out)
    return out.getvalue() + "...\n"


def test_the_issues_head_is_refused_at_the_last_fraction_on_it(problems):
    text = _the_issues_head()
    line, col = _line_col(text, "gpu_memory_utilization: ", after="name: rerank")
    assert problems(text) == [f"X:{line}:{col}: deployments[2].serving.gpu_memory_utilization: node 'head-a' is "
                              f"over-committed: big 0.85 + embed 0.05 + rerank 0.08 = 0.98 {TAIL}"]


def test_fractions_up_to_the_ceiling_pass_and_the_worker_counts_its_own(problems):
    """0.77 + 0.05 + 0.08 = 0.9 on the head; the worker holds the big one only."""
    assert problems(_the_issues_head(big=0.77)) == []


def test_one_deployment_alone_is_held_to_the_ceiling_in_the_single_form(problems, edit):
    text = edit(("  gpu_memory_utilization: 0.8", "  gpu_memory_utilization: 0.95"))
    line, col = _line_col(text, "gpu_memory_utilization: ")
    assert problems(text) == [f"X:{line}:{col}: serving.gpu_memory_utilization: node 'head-a' is over-committed: "
                              f"default 0.95 {TAIL}", f"X:{line}:{col}: serving.gpu_memory_utilization: node "
                              f"'worker-b' is over-committed: default 0.95 {TAIL}"]


def test_an_owner_who_measured_may_raise_the_ceiling(problems, edit):
    """policy.gpu_memory_utilization_ceiling is the file's: 0.95 on a node measured to hold it."""
    text = edit(("  gpu_memory_utilization: 0.8", "  gpu_memory_utilization: 0.95"),
                ("  resync_interval: 30s", "  resync_interval: 30s\n  gpu_memory_utilization_ceiling: 0.95"))
    assert problems(text) == []
    assert problems(text.replace("ceiling: 0.95", "ceiling: 0.94")) != []


def test_the_ceiling_is_a_fraction(problems, edit):
    text = edit(("  resync_interval: 30s", "  resync_interval: 30s\n  gpu_memory_utilization_ceiling: 1.2"))
    [problem] = problems(text)
    assert problem.endswith(": policy.gpu_memory_utilization_ceiling: must be less than or equal to 1"), problem
