"""docs/desired-state.md, generated from the models so the reference can never drift from the code.

`reconciler schema --markdown > docs/desired-state.md` rewrites it; a unit test fails when the file is stale.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel

from reconciler.core import spec

_SECTIONS: list[tuple[str, type[BaseModel]]] = [
    ("(top level)", spec.Desired), ("nodes[]", spec.Node), ("nodes[].ssh", spec.Ssh),
    ("nodes[].fabric", spec.Fabric), ("nodes[].fabric.twin", spec.FabricPort), ("deployments[]", spec.Deployment),
    ("deployments[].model, or model", spec.Model), ("deployments[].serving, or serving", spec.Serving),
    ("deployments[].serving.docker, or serving.docker", spec.DockerOptions),
    ("co_tenants", spec.CoTenants), ("policy", spec.Policy),
    ("policy.timeouts", spec.Timeouts), ("policy.retries", spec.Retries), ("policy.weights", spec.WeightsPolicy),
]

_HEADER = """# Desired-state reference

Generated from `reconciler/core/spec/` by `reconciler schema --markdown`; do not edit by hand (a test checks it).
Durations are written like `30s`, `5m`, `1h30m`, `250ms`; sizes like `4GiB`, `500MB` or a number of bytes.
Unknown keys are errors. Every string that reaches a remote command must match a strict pattern, listed below as
the type. Errors are reported all at once as `FILE:LINE:COL: field.path: message`.

A file declares what it serves in one of two forms: `deployments:`, a list of deployments (each with its `name`,
`model` and `serving`), or, for one model, `model:` and `serving:` at the top, which is the list form's one
deployment named `default` (every file written before the list form means what it meant). Below, `serving.port`
stands for either `serving.port` or `deployments[].serving.port`.

Rules across fields: exactly one node has role `head`; node names are unique; `ssh.jump` names another node and
jump hosts form no cycle; `tensor_parallel_size x pipeline_parallel_size` equals the GPUs of the serving nodes
(default: head first, then workers in file order) and does not exceed the cluster's; `model.source` is a node; all
fabric addresses share one subnet and differ; `serving.port`, `master_port` and `ray_port` differ; a per-node
`model.path` mapping covers the serving nodes and the source; co-tenant tables name existing nodes (or `*`) and
never match a managed serving container; `serving.extra_args` may not carry flags the reconciler sets itself.
Across deployments: names and container names are unique; two deployments on one node listen on other ports (the
API; the rendezvous port of native ranks across nodes; Ray's port); and the `gpu_memory_utilization` of the
deployments on one node add up to at most `policy.gpu_memory_utilization_ceiling` (0.90: vLLM's fraction is per
instance, of the whole GPU, and each instance and the OS hold memory beyond it). The plan also checks the bytes on
each node: every deployment's fraction of the node's memory, one `policy.memory_overhead_per_instance` per `vllm
serve` there, the `co_tenants.memory` of the allowed co-tenants running there and `policy.memory_margin` must fit in
its total, or nothing stops.
"""


def _type(prop: dict[str, Any], defs: dict[str, Any]) -> str:
    if "$ref" in prop:
        return f"[{prop['$ref'].split('/')[-1]}](#{prop['$ref'].split('/')[-1].lower()})"
    if "anyOf" in prop:
        return " or ".join(_type(p, defs) for p in prop["anyOf"])
    if "enum" in prop:
        return " or ".join(f"`{v}`" for v in prop["enum"])
    if "const" in prop:
        return f"`{prop['const']}`"
    kind = str(prop.get("type", "any"))
    if kind == "array":
        return f"list of {_type(prop.get('items', {}), defs)}"
    if kind == "object":
        inner = prop.get("additionalProperties")
        return f"mapping to {_type(inner, defs)}" if isinstance(inner, dict) else "mapping"
    if kind == "null":
        return "null"
    return kind + (f" `{prop['pattern']}`" if "pattern" in prop else "")


def markdown() -> str:
    out = [_HEADER]
    for title, model in _SECTIONS:
        schema = spec.json_schema() if model is spec.Desired else model.model_json_schema(mode="validation")
        defs = schema.get("$defs", {})
        required = set(schema.get("required", []))
        doc = (model.__doc__ or "").strip().split("\n\n")[0].replace("\n", " ")
        out.append(f"## {model.__name__}\n\n`{title}`" + (f" — {doc}" if doc else "") + "\n")
        out.append("| field | type | default | description |\n|---|---|---|---|")
        for name, prop in schema.get("properties", {}).items():
            default = "required" if name in required else (
                f"`{json.dumps(prop['default'])}`" if "default" in prop else "")
            desc = prop.get("description", "").replace("|", "\\|")
            typ = _type(prop, defs).replace("|", "\\|")
            out.append(f"| `{name}` | {typ} | {default} | {desc} |")
        out.append("")
    return "\n".join(out)
