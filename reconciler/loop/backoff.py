"""Per-step backoff and holds across reconciles (CrashLoopBackOff for steps). Pure: the clock is passed in.

A step that fails waits `initial x 2^(failures-1)` (capped, with jitter from tenacity's formula) before the next
reconcile may run it again; after `hold_after` consecutive failures it is *held*: it runs at most once per
`backoff_max`, a condition and `reconciler_step_hold` say so, and the node is not hammered. Success forgets the
step; a new desired-state generation forgets everything (the operator changed something: try again now).

`now` is the loop's monotonic clock (Controller.monotonic), never the wall clock: a step of the wall clock is not
time passing, and the first version, on `time.time`, held a failed step a day longer after a day's step back and
let it run again at once after a step forward (issue 31, finding 10).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from reconciler.core.kinds import SERVING_CHAIN
from reconciler.core.planning import Plan
from reconciler.core.spec import Retries


@dataclass
class _Record:
    failures: int = 0
    next_try: float = 0.0
    message: str = ""


@dataclass
class Backoff:
    retries: Retries
    rng: random.Random = field(default_factory=random.Random)
    records: dict[str, _Record] = field(default_factory=dict)

    def delay(self, failures: int) -> float:
        base = min(self.retries.backoff_max, self.retries.backoff_initial * 2 ** max(0, failures - 1))
        if failures >= self.retries.hold_after:
            base = self.retries.backoff_max
        return float(base) * (0.8 + 0.4 * self.rng.random())

    def failed(self, step_id: str, message: str, now: float) -> None:
        rec = self.records.setdefault(step_id, _Record())
        rec.failures += 1
        rec.message = message
        rec.next_try = now + self.delay(rec.failures)

    def succeeded(self, step_id: str) -> None:
        self.records.pop(step_id, None)

    def wait_reason(self, step_id: str, now: float) -> str | None:
        """Why the step must not run now (backing off or held), or None when it may."""
        rec = self.records.get(step_id)
        if rec is None or now >= rec.next_try:
            return None
        state = "held" if self.is_held(step_id) else "backing off"
        return (f"{state} after {rec.failures} failure(s), next try in {rec.next_try - now:.0f}s; "
                f"last error: {rec.message[:300]}")

    def is_held(self, step_id: str) -> bool:
        rec = self.records.get(step_id)
        return rec is not None and rec.failures >= self.retries.hold_after

    def failures(self) -> dict[str, int]:
        """step id -> its consecutive failures, for every step that failed since it last succeeded."""
        return {sid: rec.failures for sid, rec in self.records.items()}

    def held(self) -> dict[str, str]:
        return {sid: rec.message for sid, rec in self.records.items() if rec.failures >= self.retries.hold_after}

    def next_due(self, now: float) -> float | None:
        """When the next backoff ends, if one is still running. A record whose backoff has ended stays (its
        failure count makes the next failure's backoff longer) but is due no more: counting it made the loop
        reconcile back to back, ~13 times a second, until that step ran again."""
        return min((r.next_try for r in self.records.values() if r.next_try > now), default=None)


def vetoes(plan: Plan, backoff: Backoff, now: float) -> dict[str, str]:
    """step id -> why it must not run in this reconcile (its own backoff/hold, or its serving chain's: the steps of
    one ordered serving restart (`StepKindInfo.serving_chain`) wait together, as running the others while one waits
    would restart serving on some nodes over and over, a restart storm)."""
    out = {s.id: r for s in plan.steps if (r := backoff.wait_reason(s.id, now))}
    chain_wait = next((f"{s.id}: {out[s.id]}" for s in plan.steps if s.id in out and s.kind in SERVING_CHAIN), None)
    if chain_wait:
        for s in plan.steps:
            if s.kind in SERVING_CHAIN:
                out.setdefault(s.id, f"the serving restart waits: {chain_wait}")
    return out
