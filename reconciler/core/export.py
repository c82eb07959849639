"""`reconciler export --format lws`: the desired state's serving as a Kubernetes LeaderWorkerSet.

The bridge out of this tool (docs/scaling.md): the same image, environment and `vllm serve` argv that
reconciler/core/vllm.py renders for the native (multiprocessing) launcher, in the shape of the vLLM docs' LWS example
(docs.vllm.ai deployment/frameworks/lws, MP variant): `--nnodes $(LWS_GROUP_SIZE) --node-rank $(LWS_WORKER_INDEX)
--master-addr $(LWS_LEADER_ADDRESS)`. Kubernetes expands `$(VAR)` in `args` from the container's environment,
which LWS fills in on every pod, so no shell is needed. `args`, not `command`: `command` replaces the image's
ENTRYPOINT, and NGC's (`/opt/nvidia/nvidia_entrypoint.sh`) sets up CUDA forward compatibility before it runs the
argv it is given (Kubernetes "Define a Command and Arguments for a Container"; issue 29, finding 8).
Pure: desired state in, manifest (dict / YAML) out.
"""

from __future__ import annotations

import re
from typing import Any

import yaml

from reconciler.core import vllm
from reconciler.core.spec import SINGLE, Desired

API_VERSION = "leaderworkerset.x-k8s.io/v1"
#: set per pod by LWS or by the template; the reconciler's own values for these make no sense in a pod template
_PER_POD = {"VLLM_HOST_IP", "MASTER_ADDR", "RAY_NODE_IP_ADDRESS"}
_RANK_FLAGS = {"--nnodes": "$(LWS_GROUP_SIZE)", "--node-rank": "$(LWS_WORKER_INDEX)",
               "--master-addr": "$(LWS_LEADER_ADDRESS)"}


def _dns_name(text: str) -> str:
    name = re.sub(r"[^a-z0-9-]+", "-", text.lower()).strip("-")[:63].strip("-")
    return name or "vllm"


def _k8s_quantity(docker_size: str) -> str:
    """docker's `64g` -> Kubernetes `64Gi` (docker's suffixes are binary)."""
    m = re.fullmatch(r"(\d+)([bkmgBKMG]?)", docker_size)
    if not m:
        return docker_size
    return m.group(1) + {"": "", "b": "", "k": "Ki", "m": "Mi", "g": "Gi"}[m.group(2).lower()]


def _serve_command(spec: vllm.LaunchSpec, size: int, worker: bool) -> list[str]:
    """The native launcher's argv with the rank flags taken from LWS; workers keep `--headless`."""
    argv = list(spec.command)
    out, i = [], 0
    while i < len(argv):
        a = argv[i]
        if a in _RANK_FLAGS:
            out += [a, _RANK_FLAGS[a]]
            i += 2
            continue
        if a == "--headless":
            i += 1
            continue
        out.append(a)
        i += 1
    if size > 1 and "--nnodes" not in out:
        out += ["--nnodes", _RANK_FLAGS["--nnodes"], "--node-rank", _RANK_FLAGS["--node-rank"],
                "--master-addr", _RANK_FLAGS["--master-addr"]]
    if worker:
        out.append("--headless")
    return out


#: A Kubernetes object (or a part of one) as YAML writes it: nested mappings of any JSON value.
Manifest = dict[str, Any]

# The Kubernetes Secret the exported pods read serving.secrets from (`kubectl create secret generic ...`).
SECRET_OBJECT = "spark-reconciler-secrets"


def _env(desired: Desired, spec: vllm.LaunchSpec) -> list[Manifest]:
    """Plain values as values; serving.secrets as secretKeyRef (the export never holds a secret's value: it is
    built from the file alone)."""
    secrets = desired.secret_names_for(desired.node(spec.node))
    env: list[Manifest] = [{"name": "VLLM_HOST_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
                       {"name": "MASTER_ADDR", "value": "$(LWS_LEADER_ADDRESS)"}]
    env += [{"name": k, "value": v} for k, v in sorted(spec.env.items()) if k not in _PER_POD and k not in secrets]
    env += [{"name": k, "valueFrom": {"secretKeyRef": {"name": SECRET_OBJECT, "key": k}}} for k in sorted(secrets)]
    return env


def _pod_template(desired: Desired, spec: vllm.LaunchSpec, size: int, leader: bool) -> Manifest:
    s, node = desired.serving, desired.node(spec.node)
    mount_path = vllm.HF_CACHE_IN_CONTAINER if desired.model.layout == "hf-cache" else vllm.PLAIN_MODEL_IN_CONTAINER
    container: Manifest = {
        "name": "vllm-leader" if leader else "vllm-worker",
        "image": s.image,
        "args": _serve_command(spec, size, worker=not leader),  # the image's ENTRYPOINT stays
        "env": _env(desired, spec),
        "resources": {"limits": {"nvidia.com/gpu": str(node.gpus)}},
        "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"},
                         {"name": "model", "mountPath": mount_path}],
    }
    if s.docker.privileged:
        container["securityContext"] = {"privileged": True}
    if leader:
        container["ports"] = [{"name": "http", "containerPort": s.port, "protocol": "TCP"}]
        container["readinessProbe"] = {"tcpSocket": {"port": s.port}, "initialDelaySeconds": 15,
                                       "periodSeconds": 10}
    shm = {"medium": "Memory"}
    if s.docker.shm_size:
        shm["sizeLimit"] = _k8s_quantity(s.docker.shm_size)
    pod = {
        "hostNetwork": True,
        "dnsPolicy": "ClusterFirstWithHostNet",
        "containers": [container],
        "volumes": [{"name": "dshm", "emptyDir": shm},
                    {"name": "model", "hostPath": {"path": desired.model.path_on(spec.node),
                                                   "type": "Directory"}}],
    }
    return {"metadata": {"labels": {"role": "leader" if leader else "worker"}}, "spec": pod}


def lws_manifest(desired: Desired, name: str | None = None) -> Manifest:
    """The LeaderWorkerSet of one deployment's serving nodes (one group: replicas 1). `desired` is a file of one
    deployment, or a view of one (`Desired.view`)."""
    native = desired.with_deployment(serving=desired.serving.model_copy(update={"launcher": "native"}))
    # ^ LWS MP variant; Ray would be the multi-node-serving.sh one
    specs = vllm.launch_specs(native)
    size = len(specs)
    template: Manifest = {"size": size, "restartPolicy": "RecreateGroupOnPodRestart",
                      "leaderTemplate": _pod_template(native, specs[0], size, leader=True)}
    # every worker pod shares one template: rank 1's (per-node interface names must agree; see docs/scaling.md)
    template["workerTemplate"] = _pod_template(native, specs[1] if size > 1 else specs[0], size, leader=False)
    return {
        "apiVersion": API_VERSION,
        "kind": "LeaderWorkerSet",
        "metadata": {"name": _dns_name(name or _default_name(desired)),
                     "labels": {"app.kubernetes.io/managed-by": "spark-reconciler-export"}},
        "spec": {"replicas": 1, "leaderWorkerTemplate": template},
    }


def _default_name(view: Desired) -> str:
    """A deployment's LeaderWorkerSet name: its own name, or for a file of the single form (whose one deployment
    is `default` only inside) the served model name, as before the list form."""
    if view.deployment.name != SINGLE:
        return view.deployment.name
    return view.serving.served_model_name or view.model.id.split("/", 1)[1]


def lws_yaml(desired: Desired, name: str | None = None) -> str:
    """One LeaderWorkerSet per deployment, as YAML documents (`---` between them); `name` is the one
    deployment's name, or with several the prefix of each (`NAME-DEPLOYMENT`)."""
    views = desired.views()
    if len(views) == 1:
        return _lws_document(views[0], name)
    return "---\n".join(_lws_document(v, f"{name}-{v.deployment.name}" if name else None) for v in views)


def _lws_document(desired: Desired, name: str | None) -> str:
    manifest = lws_manifest(desired, name)
    notes = ["# LeaderWorkerSet equivalent of the desired state (reconciler export --format lws).",
             "# Not applied by spark-reconciler. Review: hostPath model directories must exist on the nodes LWS",
             "# schedules onto; per-node fabric interface names are the worker template's (rank 1's)."]
    if desired.deployment.name != SINGLE:
        notes.append(f"# Deployment {desired.deployment.name}.")
    if desired.serving.launcher == "ray":
        notes.append("# The desired state uses the Ray launcher; this manifest is the multiprocessing (MP) variant.")
    if desired.serving.secrets:
        notes.append(f"# serving.secrets come from the Secret {SECRET_OBJECT}: kubectl create secret generic "
                     f"{SECRET_OBJECT} " + " ".join(f"--from-literal={k}=..." for k in desired.serving.secrets))
    diff = sorted({desired.node(n.name).fabric.interface for n in desired.serving_nodes})
    if len(diff) > 1:
        notes.append(f"# WARNING: the serving nodes use different fabric interfaces ({', '.join(diff)}); one pod "
                     "template cannot express that.")
    return "\n".join(notes) + "\n" + yaml.safe_dump(manifest, sort_keys=False, width=120)
