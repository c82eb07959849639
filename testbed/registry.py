"""The testbed's "internet", part 2: a real container registry the head can pull the serving image from.

Debian's `docker-registry` package: distribution 2.8 (github.com/distribution/distribution, the reference
implementation of the registry API, what `registry:2` runs), its binary run by the testbed with its own config
(never the package's unit: testbed/install-deps.sh stops and disables it) inside the head's network namespace on
127.0.0.1:5000. Like the Hub stand-in (testbed/hub.py), only the head reaches it: a worker's 127.0.0.1 is its own
loopback, where nothing listens.

No TLS: dockerd treats 127.0.0.0/8 as an insecure registry without being told (moby registry/config.go
`LoadInsecureRegistries`: "Localhost is by default considered as an insecure registry",
`registries = append(registries, "127.0.0.0/8")`; `docker info` lists it under Insecure Registries), so
`docker pull 127.0.0.1:5000/...` speaks plain HTTP, as distribution's docs/insecure.md describes for a registry on
localhost.

At `up` the head's engine pushes the serving stand-in there as `IMAGE` (`docker tag` + `docker push`). The
storage (/var/lib/spark-testbed/registry) is kept across `down`/`up` like the engines' data roots, and the push
is skipped when the registry's manifest for the tag already names the head's image (its config digest is the
image id), so a warm `up` pays one HTTP request for it.
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

from .layout import DATA_ROOT, Node, state_dir
from .proc import TestbedError, alive, load_pids, run, spawn, stop_recorded, wait_for

REGISTRY = "127.0.0.1:5000"
REPOSITORY = "testorg/vllm-standin"
IMAGE = f"{REGISTRY}/{REPOSITORY}:latest"
SOURCE_IMAGE = "vllm-standin:latest"     # what is pushed (testbed/images)
BINARY = "/usr/bin/docker-registry"
PID_NAME = "registry"
MANIFEST_V2 = "application/vnd.docker.distribution.manifest.v2+json"


def storage_dir() -> Path:
    return DATA_ROOT / "registry"


def _config() -> str:
    return f"""# spark-testbed: distribution 2.8 on the head's loopback (testbed/registry.py)
version: 0.1
log:
  level: warn
  accesslog:
    disabled: false
storage:
  filesystem:
    rootdirectory: {storage_dir()}
  delete:
    enabled: true
http:
  addr: {REGISTRY}
  headers:
    X-Content-Type-Options: [nosniff]
health:
  storagedriver:
    enabled: false
"""


def _curl(head: Node, *args: str, timeout: float = 10) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", "netns", "exec", head.netns, "curl", "-sf", "-m", str(timeout), *args],
                          capture_output=True, text=True, timeout=timeout + 5, check=False)


def running() -> bool:
    e = load_pids().get(PID_NAME)
    return bool(e and alive(e["pid"], e.get("starttime")))


def start(head: Node) -> None:
    """Start the registry in the head's network namespace (kept while it runs)."""
    if running():
        return
    conf = state_dir() / "registry.yml"
    conf.write_text(_config())
    storage_dir().mkdir(parents=True, exist_ok=True)
    spawn(PID_NAME, ["nsenter", f"--net=/run/netns/{head.netns}", "--", BINARY, "serve", str(conf)],
          log=state_dir() / "registry.log")
    wait_for(lambda: _curl(head, f"http://{REGISTRY}/v2/").returncode == 0, timeout=20,
             what=f"the registry on the head's {REGISTRY}")


def stop() -> None:
    stop_recorded(PID_NAME)


def manifest_config_digest(head: Node, repository: str = REPOSITORY, tag: str = "latest") -> str | None:
    """The image id the registry's manifest for repository:tag names (None: no such tag)."""
    r = _curl(head, "-H", f"Accept: {MANIFEST_V2}", f"http://{REGISTRY}/v2/{repository}/manifests/{tag}")
    if r.returncode != 0:
        return None
    try:
        digest: str = json.loads(r.stdout)["config"]["digest"]
    except (ValueError, KeyError, TypeError):
        return None
    return digest


def publish(head: Node) -> float:
    """Make the registry hold the head's serving stand-in as IMAGE; returns the seconds the push took (0: it already
    held that image). The head's engine keeps no IMAGE tag afterwards: a scenario says whether the head has it."""
    from . import dockerd
    want = dockerd.image_id(head, SOURCE_IMAGE)
    if want is None:
        raise TestbedError(f"{SOURCE_IMAGE} is not on the head: nothing to push")
    if manifest_config_digest(head) == want:
        return 0.0
    t = time.monotonic()
    dockerd.docker(head, "tag", SOURCE_IMAGE, IMAGE)
    try:
        run(["docker", "-H", head.docker_host, "push", "-q", IMAGE], timeout=300)
    finally:
        dockerd.docker(head, "rmi", IMAGE, check=False)
    if manifest_config_digest(head) != want:
        raise TestbedError(f"pushed {IMAGE}, but the registry's manifest does not name {want}")
    return time.monotonic() - t
