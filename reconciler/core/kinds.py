"""What a step kind is, one row per kind (issue 54). Pure.

Every fact about a kind that more than one module asks (its sign in the plan's text, whether the plan says it once
for the whole node, whether it stages, fetches, belongs to the serving chain, starts a generation, has a long
deadline, and which rule judges it stale under a new desired state) is a column of `KINDS`. Before, they were eleven
tables in seven modules, and a new kind missed from one of them was a KeyError at run time or a wrong `admit`.
What must stay in its own layer is keyed by kind there, each with a test that it covers every kind
(tests/unit/core/test_step_kinds.py): the step's body (`edge.steps.plan_of`), the root commands
(`edge.ssh.commands.ROOT_COMMANDS`), the stale rules (`loop.operations.STALE_RULES`, by `StepKindInfo.stale`) and the
promised effect (`core.simulate.EFFECTS`, which needs the plan: `core.planning` imports this module).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Literal, get_args

StepKind = Literal["stop-container", "start-container", "link", "prune-weights", "prune-images", "download",
                   "pull-image", "image", "weights", "stop-serving",
                   "start-serving", "launch-model", "await-health"]
STEP_KINDS: tuple[StepKind, ...] = get_args(StepKind)

#: `+` starts or copies, `~` changes in place, `-` stops or removes, `?` waits (counted in none of the three).
Sign = Literal["+", "~", "-", "?"]

#: The `policy.timeouts` field that bounds a long step instead of `timeouts.step`.
LongTimeout = Literal["weights_sync", "image_sync"]

#: The rule that says whether a new desired state makes a step in flight wrong (`loop.operations.STALE_RULES`).
StaleRule = Literal["weights", "image", "serving", "co-tenant", "restore", "link", "retention"]


@dataclass(frozen=True)
class StepKindInfo:
    """One step kind's facts (docs/architecture.md, "Where a change goes")."""

    sign: Sign
    stale: StaleRule
    #: The node's own, for the whole file (links, co-tenants): a plan of several deployments says it once, untagged.
    node_own: bool = False
    #: Puts the weights or the image where the start needs them: long, harmless to what runs, so a start from
    #: nothing of ours stops the co-tenants only after these (they serve through the copies).
    staging: bool = False
    #: Fetches from the internet (the Hub's tree, the registry's image) on a node with `internet: true`: what it
    #: brings only the next observation sees, so the next pass plans the copies and the start from it (the restart
    #: waits for it; `simulate.settle` plans again after it), and it cannot go on once its node loses the internet.
    fetches: bool = False
    #: Part of one ordered serving restart: one waits, all wait (backoff), one in flight holds the others (`admit`).
    serving_chain: bool = False
    #: Starts a vLLM engine: a start waits for the health of the deployments before it, and co-tenant stops make
    #: room for it.
    engine_start: bool = False
    #: Brings a new generation up (its start and its wait for health): one that fails is a failed generation.
    start: bool = False
    long_timeout: LongTimeout | None = None


KINDS: Mapping[StepKind, StepKindInfo] = MappingProxyType({
    "stop-container": StepKindInfo("-", "co-tenant", node_own=True),
    "start-container": StepKindInfo("+", "restore", node_own=True),
    "link": StepKindInfo("~", "link", node_own=True),
    "prune-weights": StepKindInfo("-", "retention"),
    "prune-images": StepKindInfo("-", "retention"),
    "download": StepKindInfo("+", "weights", staging=True, fetches=True, long_timeout="weights_sync"),
    "pull-image": StepKindInfo("+", "image", staging=True, fetches=True, long_timeout="image_sync"),
    "image": StepKindInfo("+", "image", staging=True, long_timeout="image_sync"),
    "weights": StepKindInfo("+", "weights", staging=True, long_timeout="weights_sync"),
    "stop-serving": StepKindInfo("-", "serving", serving_chain=True),
    "start-serving": StepKindInfo("+", "serving", serving_chain=True, engine_start=True, start=True),
    "launch-model": StepKindInfo("+", "serving", serving_chain=True, engine_start=True, start=True),
    "await-health": StepKindInfo("?", "serving", serving_chain=True, start=True),
})


NODE_STEPS = frozenset(kind for kind, info in KINDS.items() if info.node_own)
STAGING = frozenset(kind for kind, info in KINDS.items() if info.staging)
FETCHES = frozenset(kind for kind, info in KINDS.items() if info.fetches)
SERVING_CHAIN = frozenset(kind for kind, info in KINDS.items() if info.serving_chain)
ENGINE_STARTS = frozenset(kind for kind, info in KINDS.items() if info.engine_start)
START_KINDS = frozenset(kind for kind, info in KINDS.items() if info.start)
