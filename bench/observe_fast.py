"""A scratch copy of the probe with the fixes this benchmark proposes for reconciler/observe.py (not used by the
product; bench/noop.py measures it side by side with the real probe so the proposal carries numbers).

1. containers: ONE request to the Docker Engine API over its unix socket (`curl --unix-socket`,
   GET /containers/json?all=1) instead of `docker ps -aq` + `docker inspect` (two Go CLI start-ups, ~40-60 ms
   each on this machine). The list endpoint carries every field drift.py uses (name, id, image, image id, state,
   labels); `started_at`/`restart_count` are not used by drift and are left at their defaults.
2. image: GET /images/REF/json on the same socket instead of `docker image inspect` (a third CLI start-up).
3. the docker CLI stays the fallback when DOCKER_HOST is not a unix socket or curl fails, so a DGX OS without
   curl or with a TCP docker host still works.
4. (measured, not proposed: on 2 cores it was slower, 73 vs 68 ms) sections that wait on something (the two docker requests, /health, /v1/models, the weights `find`) run
   concurrently into a private temp dir and are printed in order afterwards.
"""
from __future__ import annotations

import json

from reconciler import observe as base
from reconciler.observed import Container, NodeObservation
from reconciler.remote import RemoteError, Sessions, quote
from reconciler.spec import Desired, Node

_SOCK = 'sock=/var/run/docker.sock; case "${DOCKER_HOST:-}" in unix://*) sock=${DOCKER_HOST#unix://};; esac'


def _curl(path: str) -> str:
    return f"curl -sf --unix-socket \"$sock\" {quote(['http://docker' + path])}"


def probe_script(desired: Desired, node: Node, concurrent: bool = False) -> str:
    q = lambda *argv: quote(argv)  # noqa: E731
    iface = node.fabric.interface
    image_path = "/images/" + desired.serving.image + "/json"
    sections: list[tuple[str, str]] = [
        ("containers", f"{_CONTAINERS}"),
        ("image", f"{_curl(image_path)} || docker image inspect --format '{{{{json .}}}}' "
                  f"{q(desired.serving.image)} 2>/dev/null; echo; echo \"@@rc $?\""),
        ("link", f"ip -j addr show dev {q(iface)} 2>&1; echo \"@@rc $?\""),
        ("rdma", "echo '@@rc 2'"),
        ("meminfo", "grep -E '^(MemTotal|MemAvailable):' /proc/meminfo; echo \"@@rc $?\""),
    ]
    weights = base.manifest_script(base.weights_root(desired, node.name)).split("\n", 1)[1]
    sections.append(("weights", weights))
    if node.role == "head":
        port = desired.serving.port
        sections += [
            ("health", f"curl -s -o /dev/null -m 2 -w '%{{http_code}}' {q(f'http://127.0.0.1:{port}/health')}; "
                       "echo; echo \"@@rc $?\""),
            ("models", f"curl -s -m 2 {q(f'http://127.0.0.1:{port}/v1/models')}; echo; echo \"@@rc $?\""),
        ]
    lines = ["export LC_ALL=C", _SOCK]
    if concurrent:
        lines += ['d=$(mktemp -d) || exit 1', "trap 'rm -rf \"$d\"' EXIT"]
        for name, body in sections:
            lines.append(f"( printf '\\n@@{name}\\n'; {body} ) > \"$d/{name}\" 2>&1 &")
        lines.append("wait")
        lines.append("cat " + " ".join(f'"$d/{name}"' for name, _ in sections))
    else:
        for name, body in sections:
            lines.append(f"printf '\\n@@{name}\\n'; {body}")
    return "\n".join(lines) + "\n"


_CONTAINERS = (
    "out=$(curl -sf --unix-socket \"$sock\" 'http://docker/containers/json?all=1'); rc=$?; "
    "if [ $rc -eq 0 ]; then printf 'API %s\\n' \"$out\"; else "
    f"ids=$(docker ps -aq --no-trunc 2>&1); rc=$?; "
    f"if [ $rc -eq 0 ] && [ -n \"$ids\" ]; then docker inspect --format {quote([base._INSPECT])} $ids 2>&1; "
    "elif [ $rc -ne 0 ]; then printf '%s\\n' \"$ids\"; fi; fi; echo \"@@rc $rc\""
)


def _parse_containers(sec):
    if sec is not None and sec.body.startswith("API "):
        found = []
        for c in json.loads(sec.body[4:]):
            name = (c.get("Names") or ["/"])[0].lstrip("/")
            found.append(Container(name=name, id=c["Id"], image=c.get("Image", ""), image_id=c.get("ImageID", ""),
                                   state=c["State"], labels=c.get("Labels") or {}))
        return True, None, sorted(found, key=lambda c: c.name)
    return base.parse_containers(sec)


def parse_probe(desired: Desired, node: Node, output: str) -> NodeObservation:
    sections = base.split_sections(output)
    image = sections.get("image")
    if image is not None and image.body.strip().startswith("{"):
        image.body = json.loads(image.body.strip().splitlines()[0]).get("Id", "")
    obs = base.parse_probe(desired, node, output.replace("@@containers", "@@containers-raw"))
    ok, err, containers = _parse_containers(sections.get("containers"))
    images = {desired.serving.image: image.body.strip()} if image and image.rc == 0 and image.body.strip() else {}
    return obs.model_copy(update={"docker_reachable": ok, "docker_error": err, "containers": containers,
                                  "images": images})


def observe(desired: Desired, sessions: Sessions, timeout: float = 20.0, concurrent: bool = False):
    from concurrent.futures import ThreadPoolExecutor

    from reconciler.observed import Observed

    def one(node: Node) -> NodeObservation:
        try:
            result = sessions[node.name].run_script(probe_script(desired, node, concurrent), timeout=timeout)
        except RemoteError as exc:
            return NodeObservation(name=node.name, reachable=False, error=exc.message)
        return parse_probe(desired, node, result.stdout)

    with ThreadPoolExecutor(max_workers=max(1, len(desired.nodes))) as pool:
        results = list(pool.map(one, desired.nodes))
    return Observed(nodes={r.name: r for r in results}), {}
