"""The serving API on the node of a deployment's rank 0: /health, the served names, one completion, vLLM's
counters, Ray (`api_fact`), and the head while it starts (`start_fact`). The API key travels in the script, never
in an argv."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

from reconciler.core.observed import (
    EngineLoad,
    ServingApi,
)
from reconciler.core.spec import Desired
from reconciler.core.vllm import pools
from reconciler.edge.facts.base import Fact, Section, node_json, node_output
from reconciler.edge.facts.containers import ContainerState, container_fact
from reconciler.edge.facts.ports import parse_port_holder, parse_port_neighbours, port_owner_script
from reconciler.edge.ssh import quote, quote_word

COMPLETION_DEADLINE = 5  # seconds: one token of a loaded model answers in milliseconds; a wedged rank never does


def auth_header(desired: Desired) -> bytes | None:
    """The header the OpenAI API wants when serving.secrets holds VLLM_API_KEY (vLLM then guards every /v1 path;
    /health stays open). Callers hand it to `curl -H @-` on stdin: the key is never on a command line."""
    key = desired.secret("VLLM_API_KEY")
    return f"Authorization: Bearer {key}\n".encode() if key else None


def api_argv(desired: Desired, *argv: str) -> list[str]:
    """`curl ARGV`, reading the API key's header from stdin when there is one."""
    return ["curl", *(["-H", "@-"] if auth_header(desired) else []), *argv]


def completion_argv(desired: Desired) -> list[str]:
    """One short completion through the head's OpenAI API (`curl`, body then the HTTP code on its own line).

    /health only says the API process is up: with a rank unreachable over the fabric, vLLM's /health kept
    answering 200 while completions hung (docs/testbed.md). One token through the whole tensor-parallel group is
    the check that cannot be fooled. The served name is validated by spec; the body is JSON, quoted once.
    A pooling model (`--runner pooling`: embeddings, a reranker) has no completions API; vLLM's Pooling API
    (`POST /pooling` with `input`, every pooling model: vllm/entrypoints/pooling/pooling/serving.py) takes the
    same one pass through every rank."""
    name = desired.served_name
    if pools(desired.serving):  # an embeddings model or a reranker answers no completion: its own request
        body, path = json.dumps({"model": name, "input": "ping"}), "/pooling"
    else:
        body, path = json.dumps({"model": name, "prompt": "ping", "max_tokens": 1, "temperature": 0}), "/v1/completions"
    url = f"http://127.0.0.1:{desired.serving.port}{path}"
    return api_argv(desired, "-s", "-m", str(COMPLETION_DEADLINE), "-H", "Content-Type: application/json",
                    "-w", "\\n%{http_code}", "-d", body, url)


def api_script(desired: Desired) -> list[str]:
    """The `health`, `models` and `completion` sections of the head's API (`parse_serving`).

    /v1/models and the completion only when /health answered 200: a frozen API would cost their whole deadlines
    (2 s + 5 s) on every probe, and what they say of an unhealthy API is never used. The API key travels in the
    script (stdin of `sh -s`) and into curl by a builtin's pipe: never in an argv."""
    port = desired.serving.port
    header = auth_header(desired)
    auth = f"printf %s {quote_word(header.decode())} | " if header else ""
    return [
        *port_owner_script(port, desired.serving.host),
        "sec health",
        f"code=$(curl -s -o /dev/null -m 2 -w '%{{http_code}}' {quote_word(f'http://127.0.0.1:{port}/health')}); "
        "rc=$?; [ \"$owners\" = \"0 \" ] || code=; printf '%s\\n' \"$code\"; rc $rc",
        "sec models",
        f"rc=0; if [ \"$code\" = 200 ]; then {auth}"
        f"{quote(api_argv(desired, '-s', '-m', '2', f'http://127.0.0.1:{port}/v1/models'))}; rc=$?; "
        "fi; echo; rc $rc",
        "sec completion",
        f"rc=0; if [ \"$code\" = 200 ]; then {auth}{quote(completion_argv(desired))}; rc=$?; fi; echo; "
        "rc $rc",
        "sec engine",
        f"rc=0; if [ \"$code\" = 200 ]; then curl -s -m 2 {quote_word(f'http://127.0.0.1:{port}/metrics')} | "
        f"grep -E {quote_word(_ENGINE_LINES)}; rc=$?; fi; rc $rc",
    ]


#: The lines of vLLM's /metrics the engine section keeps (read after the completion, so its own token counts):
#: a real vLLM's page is tens of KB of histograms, filtered on the node.
ENGINE_METRICS = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:prompt_tokens_total",
                  "vllm:generation_tokens_total")
#: Read when the image exports it: what moves while a long chunked prefill is the only work (core.observed.EngineLoad).
KV_USAGE = "vllm:kv_cache_usage_perc"
_ENGINE_LINES = "^(" + "|".join((*ENGINE_METRICS, KV_USAGE)) + ")[{ ]"


def _sample(line: str) -> tuple[str, float | None]:
    """A Prometheus text sample line: its name and value (the first field after the name and its labels; an
    optional timestamp follows). A line cut short by `curl -m` on a busy server, or a value that is no count (NaN,
    Inf), gives None: skipped, and a metric missing in the end makes the whole answer None."""
    head, brace, rest = line.partition("{")
    if brace:
        labels, closed, after = rest.rpartition("}")
        fields = after.split() if closed else []
    else:
        parts = line.split()
        head, fields = (parts[0], parts[1:]) if parts else ("", [])
    try:
        value = float(fields[0]) if fields else None
    except ValueError:
        value = None
    return head.strip(), value if value is not None and math.isfinite(value) else None


@node_output("engine")
def parse_engine(sec: Section | None) -> EngineLoad | None:
    """vLLM's counters, summed over label sets (one engine per API server here; several with data parallel).
    None: not read (an unhealthy API, no /metrics, a page without them)."""
    if sec is None or sec.rc not in (0, 1):  # grep's 1: no such line
        return None
    sums: dict[str, float] = {}
    for line in sec.body.splitlines():
        name, value = _sample(line)
        if (name in ENGINE_METRICS or name == KV_USAGE) and value is not None:
            sums[name] = sums.get(name, 0.0) + value
    if not all(m in sums for m in ENGINE_METRICS):
        return None
    return EngineLoad(running=sums[ENGINE_METRICS[0]], waiting=sums[ENGINE_METRICS[1]],
                      tokens=sums[ENGINE_METRICS[2]] + sums[ENGINE_METRICS[3]], kv_usage=sums.get(KV_USAGE))


@node_output("completion")
def parse_completion(sec: Section | None) -> str | None:
    """None when the completion answered with a choice (a pooling model's /pooling: with data); else a short
    reason (node bytes never raise)."""
    if sec is None:
        return "not tried"
    body, _, code = sec.body.strip().rpartition("\n")
    if sec.rc == 28:
        return f"no answer within {COMPLETION_DEADLINE}s"
    if code.strip() != "200":
        return f"HTTP {code.strip() or 'none'} (curl exit {sec.rc})"
    try:
        answer = node_json(body)
        choices = answer.get("choices", answer.get("data"))
    except (ValueError, AttributeError):
        return "the answer is not JSON"
    return None if isinstance(choices, list) and choices else "the answer has no choices"


@node_output("serving API")
def parse_serving(health: Section | None, models: Section | None, ray: Section | None,
                  completion: Section | None = None, engine: Section | None = None,
                  port_owner: Section | None = None) -> ServingApi:
    holder, neighbours = parse_port_holder(port_owner), parse_port_neighbours(port_owner)
    if holder is not None:
        return ServingApi(reachable=True, healthy=False, port_holder=holder, port_neighbours=neighbours)
    code = health.body.strip() if health else ""
    served: list[str] = []
    if models is not None and models.body.strip().startswith("{"):
        try:
            served = [m["id"] for m in node_json(models.body).get("data", [])]
        except (ValueError, KeyError, TypeError):
            served = []
    ray_nodes = None
    if ray is not None and ray.rc == 0:
        ray_nodes = count_ray_nodes(ray.body)
    healthy = code == "200"
    return ServingApi(reachable=code not in ("", "000"), healthy=healthy, models=served, ray_nodes=ray_nodes,
                      completion_error=parse_completion(completion) if healthy and served else None,
                      engine=parse_engine(engine) if healthy else None, port_neighbours=neighbours)


def ray_script(container: str) -> list[str]:
    """The `ray` section: `ray status` inside the head's serving container (`count_ray_nodes`)."""
    return ["sec ray", f"docker exec {quote_word(container)} ray status 2>&1; rc $?"]


def count_ray_nodes(status: str) -> int:
    """Nodes alive in `ray status` output: one `1 node_<id>` line per node under "Active:"."""
    return sum(1 for line in status.splitlines() if line.strip().split(" ")[-1].startswith("node_"))


@node_output("vllm_serve")
def parse_serve_processes(sec: Section | None) -> int:
    """How many `vllm serve` processes the container runs; 0 when that cannot be read (a container without `ps`,
    one not running): the launch then runs, and a second `vllm serve` fails on the taken port, loudly."""
    body = sec.body.strip() if sec is not None else ""
    return int(body) if body.isdigit() else 0


_SERVE_COUNT = "ps -eo args | grep -c '[v]llm serve'"


def serve_processes_fact(container: str) -> Fact[int]:
    """The `vllm serve` processes inside `container` (the Ray launcher's exec: already launched?)."""
    return Fact(f"vllm-serve {container}",
                ("sec vllm_serve", f"docker exec {quote_word(container)} sh -c {quote_word(_SERVE_COUNT)} "
                                   "2>/dev/null; rc $?"),
                lambda sections: parse_serve_processes(sections.get("vllm_serve")))


def ray_nodes_fact(container: str) -> Fact[int | None]:
    """Nodes alive in the head container's `ray status`; None when it did not answer."""
    def parse(sections: dict[str, Section]) -> int | None:
        status = sections.get("ray")
        return count_ray_nodes(status.body) if status is not None and status.rc == 0 else None
    return Fact(f"ray {container}", tuple(ray_script(container)), parse)


def api_fact(desired: Desired, ray: bool = False) -> Fact[ServingApi]:
    """The API of `desired`'s rank 0 now: health, the served names and one completion, as the probe reads them;
    with `ray` (the probe, for a Ray launcher) also the nodes alive in its `ray status`."""
    def parse(sections: dict[str, Section]) -> ServingApi:
        return parse_serving(sections.get("health"), sections.get("models"), sections.get("ray") if ray else None,
                             sections.get("completion"), sections.get("engine"), sections.get("port_owner"))
    lines = (*api_script(desired), *(ray_script(desired.serving.container_name) if ray else ()))
    return Fact("api", lines, parse)


@dataclass(frozen=True)
class StartSeen:
    """One poll of a cold start on the head, in one round trip: its serving container, the API, and the tail of
    the container's log (`core.vllm_log.start_progress` reads where the start is from it; "" when unread)."""

    container: ContainerState | None
    api: ServingApi
    log: str


START_LOG_LINES = 200  # the head's last log lines each poll of the health wait reads, at most MAX_TEXT bytes of them
START_LOG_DEADLINE = 10  # seconds: a `docker logs` that hangs leaves the poll's other sections answered


def start_fact(desired: Desired, container: str) -> Fact[StartSeen]:
    """The head while it starts (`container_fact`, `api_fact` and its log's tail, cut on the node: tqdm redraws a
    bar on one ever longer line)."""
    from reconciler.core.vllm_log import MAX_TEXT

    one, api = container_fact(container), api_fact(desired)

    def parse(sections: dict[str, Section]) -> StartSeen:
        log = sections.get("start_log")
        return StartSeen(one.parse(sections), api.parse(sections), log.body if log is not None else "")
    return Fact(f"start {container}",
                (*one.lines, *api.lines, "sec start_log",
                 f"timeout {START_LOG_DEADLINE} docker logs --tail {START_LOG_LINES} {quote_word(container)} 2>&1 | "
                 f"tail -c {MAX_TEXT}; rc 0"), parse)
