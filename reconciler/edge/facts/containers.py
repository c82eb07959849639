"""The containers on a node: the engine's list (the probe's `DOCKER`, a step's `CONTAINERS`), one container by
name (`container_fact`), and a container's last log lines. The Docker API over its socket (`DOCKER_SOCKET`), the
CLI as the fallback."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from reconciler.core.observed import (
    Container,
)
from reconciler.edge.facts.base import Fact, ProbeError, Section, each_line, node_json, node_output
from reconciler.edge.ssh import quote_word

# The Docker API over its unix socket: one curl instead of two or three Go CLI start-ups (85 -> 49 ms per no-op
# cycle, docs/benchmarks.md); the CLI stays the fallback (TCP DOCKER_HOST, no curl).
DOCKER_SOCKET = 'sock=/var/run/docker.sock; case "${DOCKER_HOST:-}" in unix://*) sock=${DOCKER_HOST#unix://};; esac'


_INSPECT = ('{"name":{{json .Name}},"id":{{json .Id}},"image":{{json .Config.Image}},"image_id":{{json .Image}},'
            '"state":{{json .State.Status}},"labels":{{json .Config.Labels}},"started_at":{{json .State.StartedAt}},'
            '"mounts":{{json .Mounts}}}')


def containers_script() -> list[str]:
    """The `containers` section: every container, running or not (`parse_containers`)."""
    return [
        DOCKER_SOCKET,
        "sec containers",
        "if out=$(curl -sf --unix-socket \"$sock\" 'http://docker/containers/json?all=1' 2>/dev/null); then "
        "printf 'API %s\\n' \"$out\"; rc=0; else "
        "ids=$(docker ps -aq --no-trunc 2>&1); rc=$?; "
        f"if [ $rc -eq 0 ] && [ -n \"$ids\" ]; then docker inspect --format {quote_word(_INSPECT)} $ids 2>&1; "
        "elif [ $rc -ne 0 ]; then printf '%s\\n' \"$ids\"; fi; fi",
        "rc $rc",
    ]


def _bind_sources(mounts: object) -> list[str] | None:
    """The host paths of a container's bind mounts (Docker's `Mounts`, in /containers/json and inspect alike);
    volumes live in docker's own data root. None when the engine did not say (retention then keeps every tree)."""
    if not isinstance(mounts, list):
        return None
    return sorted({m["Source"] for m in mounts if isinstance(m, dict) and m.get("Type") == "bind"
                   and isinstance(m.get("Source"), str)})


def _created(raw: dict[str, Any]) -> str | None:
    """The API's `Created` (unix seconds: the list has no `State.StartedAt`) as the RFC 3339 time the CLI path
    reads from inspect. For the serving containers it is their start: `docker run` creates and starts in one, with
    `--restart no`, and they are never started again in place (a stopped one is removed before the next run). So
    the health watch can tell a container older than the cold-start allowance after a daemon restart (issue 30)."""
    created = raw.get("Created")
    if isinstance(created, bool) or not isinstance(created, int) or created <= 0:
        return None
    return datetime.fromtimestamp(created, tz=UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _api_container(raw: dict[str, Any]) -> Container:
    return Container(name=(raw.get("Names") or ["/"])[0].lstrip("/"), id=raw["Id"], image=raw.get("Image", ""),
                     image_id=raw.get("ImageID", ""), state=raw["State"], labels=raw.get("Labels") or {},
                     mounts=_bind_sources(raw.get("Mounts")), started_at=_created(raw))


#: Containers a node's `containers` section may list (running or not): a model each, ~1.5 KB, so a section of 250,000
#: minimal ones (`{"Id":"a","State":"running"}`, under MAX_JSON_VALUES) would cost hundreds of MiB (issue 53).
MAX_CONTAINERS = 20_000


@node_output("containers")
def parse_containers(sec: Section | None) -> tuple[bool, str | None, list[Container]]:
    if sec is None:
        return False, "probe did not report containers", []
    too_many = ValueError(f"more than {MAX_CONTAINERS} containers")
    if sec.rc == 0 and sec.body.startswith("API "):
        listed = node_json(sec.body, 4)
        if isinstance(listed, list) and len(listed) > MAX_CONTAINERS:
            raise too_many
        found = [_api_container(raw) for raw in listed]
        return True, None, sorted(found, key=lambda c: c.name)
    found = []
    for line in each_line(sec.body):
        if line.startswith("{"):
            if len(found) == MAX_CONTAINERS:
                raise too_many
            raw = node_json(line)
            raw["name"] = raw["name"].lstrip("/")
            raw["labels"] = raw.get("labels") or {}
            raw["mounts"] = _bind_sources(raw.get("mounts"))
            found.append(Container.model_validate(raw))
    if sec.rc != 0 and not found:
        return False, sec.body.strip()[-500:] or f"docker exited {sec.rc}", []
    return True, None, sorted(found, key=lambda c: c.name)


@dataclass(frozen=True)
class ContainerState:
    """One container as `docker inspect` tells it: the probe's model of it and the exit code its state has (the
    list of containers carries no exit code; a step's failure message does)."""

    container: Container
    exit_code: int | None


_INSPECT_ONE = _INSPECT[:-1] + ',"exit_code":{{json .State.ExitCode}}}'


@node_output("container")
def parse_container(sec: Section | None) -> ContainerState | None:
    """None when there is no such container; any other failure of `docker inspect` is a ProbeError (the step
    cannot judge what it cannot see)."""
    if sec is None:
        raise ProbeError("docker inspect did not answer")
    if sec.rc != 0:
        if "no such" in sec.body.lower():
            return None
        raise ProbeError(f"docker inspect failed: {sec.body.strip()[-300:]}")
    raw = node_json(sec.body)
    exit_code = raw.pop("exit_code", None)
    raw["name"] = str(raw["name"]).lstrip("/")
    raw["labels"] = raw.get("labels") or {}
    raw["mounts"] = _bind_sources(raw.get("mounts"))
    return ContainerState(Container.model_validate(raw), exit_code if isinstance(exit_code, int) else None)


def container_fact(name: str) -> Fact[ContainerState | None]:
    """One container by name, running or not (None: no such container)."""
    return Fact(f"container {name}",
                ("sec container", f"docker inspect --type container --format {quote_word(_INSPECT_ONE)} "
                                  f"{quote_word(name)} 2>&1; rc $?"),
                lambda sections: parse_container(sections.get("container")))


def _all_containers(sections: dict[str, Section]) -> list[Container]:
    ok, error, found = parse_containers(sections.get("containers"))
    if not ok:
        raise ProbeError(f"the containers could not be read: {error}")
    return found


#: Every container on the node now, with its bind mounts; unreadable is a ProbeError (a step cannot judge what it
#: cannot see).
CONTAINERS: Fact[list[Container]] = Fact("containers", tuple(containers_script()), _all_containers)


LOG_TAIL_CHARS = 1500  # of a failed container's last lines, in the step's failure message


def log_tail_fact(container: str, lines: int = 15) -> Fact[str]:
    """A container's last `lines` log lines (stdout and stderr), for the message of a start that failed."""
    return Fact(f"logs {container}",
                ("sec logs", f"docker logs --tail {lines} {quote_word(container)} 2>&1 | tail -c {LOG_TAIL_CHARS}; "
                             "rc 0"),
                lambda sections: (sections["logs"].body if "logs" in sections else "").strip()[-LOG_TAIL_CHARS:])


#: The engine's list of containers as the probe reads it: (docker answered, why not, the containers).
DOCKER: Fact[tuple[bool, str | None, list[Container]]] = Fact(
    "docker", tuple(containers_script()), lambda sections: parse_containers(sections.get("containers")))
