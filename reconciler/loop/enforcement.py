"""Which desired state the daemon enforces, across reconciles: the file's generation, or the one a rollback
brought back while the file's is held.

An invalid file never stops the loop nor triggers steps: the last valid generation keeps being enforced and
`file_error` says what is wrong, with line and column. A generation that cannot be recorded is observed, never
enforced (`generations.observe_only`). A failed change is rolled back as `rollback.decide` says, and the rollback
is kept across a restart (`history.HistoryStore`) until the file changes. The numbers are `generations`'; the kept
texts and the hold are `history`'s; this module applies them, and the Controller asks it what is in force.

What a new generation means for the work in flight is `end_generation`: it cancels only what the new one makes
wrong (`operations.stale`, `verify.verify_stale`), before the manager adopts it.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from reconciler.core import spec
from reconciler.core.observed import Observed
from reconciler.core.planning import Plan, Step
from reconciler.core.restore import AS_FOUND, restore_plan
from reconciler.edge import log, trusted_files
from reconciler.edge.trusted_files import Secrets
from reconciler.loop import metrics, rollback
from reconciler.loop.backoff import Backoff
from reconciler.loop.generations import GenerationStore, observe_only
from reconciler.loop.history import HistoryStore, Hold
from reconciler.loop.operations import Operations, stale
from reconciler.loop.reasons import Reason
from reconciler.loop.verify import Verifier, verify_stale


class Enforcement:
    """The desired state in force and how it got there. `ending(old, new)` is told before a new one is taken (what
    was started for the old one and is wrong for the new one ends: `end_generation`), `adopt(new)` after (the
    manager's sessions, lease and streams follow it)."""

    def __init__(self, path: Path, store: GenerationStore, history: HistoryStore, secrets: Callable[[], Secrets], *,
                 clock: Callable[[], float], logger: Any, ending: Callable[[spec.Desired, spec.Desired], None],
                 adopt: Callable[[spec.Desired], None]) -> None:
        self.path = path
        self.store = store
        self.history = history
        self.secrets = secrets
        self.clock = clock
        self.log = logger
        self._ending = ending
        self._adopt = adopt
        self.desired: spec.Desired | None = None
        self.file_error: str | None = None
        self.backoff: Backoff | None = None
        self.held: Hold | None = None  # a failed change rolled back: the file's generation is not enforced
        self.read_only: str | None = None  # the fingerprint observed, not enforced, while no generation is recorded
        self._said: set[tuple[int, str]] = set()  # (generation, what) said once: not every reconcile

    @property
    def enforced_generation(self) -> int:
        """The generation whose state the daemon enforces: the file's, or the one a rollback brought back."""
        return self.held.to if self.held is not None else self.store.generation

    # -- the file -----------------------------------------------------------------------------------------------

    def reread(self, reasons: set[Reason], trigger: list[str]) -> None:
        """Read the file again when it changed or SIGHUP asked (said either way: a SIGHUP that finds the file as it
        was is news too), and every reconcile while there is no valid one or its generation could not be
        recorded."""
        if any(r.kind in ("file", "sighup") for r in reasons):
            taken = self.reload()
            self.log.info("desired_state.reread", trigger=trigger, new_generation=taken,
                          generation=self.store.generation)
        elif self.desired is None or self.store.pending is not None:
            self.reload()

    def _load(self) -> tuple[spec.Desired | None, list[str]]:
        """The file as `validate` judges it (trusted_files.load: the file, its secrets, the files it trusts); every
        secret value registered for redaction before anything can log it."""
        try:
            loaded, unsafe = trusted_files.load(self.path, self.secrets())
        except trusted_files.EnvironmentFileError as exc:
            return None, [str(exc)]
        for value in loaded.secret_values() if loaded is not None else []:
            log.register_secret(value)
        return loaded, unsafe

    def reload(self) -> bool:
        """Re-read the file; True when a new valid generation was taken. Invalid: keep the last good one."""
        loaded, unsafe = self._load()
        if loaded is None:  # a file others may change is as bad as an invalid one: keep the last good
            self.file_error = "\n".join(unsafe)
            metrics.desired_state_valid.set(0)
            self.log.warning("desired_state.invalid", errors=unsafe, keeping_generation=self.store.generation)
            return False
        desired, self.file_error = loaded, None
        metrics.desired_state_valid.set(1)
        digest = desired.fingerprint()
        if self.store.take(digest):
            if self._kept_rollback(desired, digest):
                return True
        elif self.store.pending is None or digest == self.read_only:
            return False  # the content in force, or the one observed already
        elif self.desired is not None and self.read_only is None:  # the recorded generation stays in force
            self.log.warning("desired_state.not_recorded", error=self.store.pending)
            return False  # and the edit is retried every reconcile
        else:  # nothing recorded is in force: observe what the file says, change nothing (generations.observe_only)
            desired, self.read_only = observe_only(desired), digest
            self.log.warning("state.read_only", error=self.store.pending)
        self._enforce(desired)
        self.log.info("desired_state.loaded", generation=self.store.generation, mode=desired.policy.mode,
                      paused=desired.policy.paused)
        return True

    def _kept_rollback(self, desired: spec.Desired, digest: str) -> bool:
        """A new generation was recorded: into the history. True when a rollback of it is kept (a restart keeps
        the rollback: the failed change is not tried again) and what it brought back is enforced already."""
        self.read_only = None
        self.history.keep = desired.policy.history
        hold = self.history.taken(self.store.generation, digest, desired.source, self.clock())
        if self.store.observed_generation == self.store.generation:  # it converged before this daemon
            self.history.served(self.store.generation, self.store.last_converged or self.clock())
        if self.held is not None and hold is None:
            self.log.info("rollback.ended", generation=self.store.generation, was=self.held.to)
        self.held = None
        if hold is None:
            return False
        if hold.to == 0:  # back to what ran before it: the same file, restored
            self._enforce(desired, held=hold)
            self.log.warning("rollback.kept", generation=hold.generation, to=AS_FOUND, error=hold.why)
            return True
        if (back := self._brought_back(hold.generation, hold.to)) is not None:
            self._enforce(back, held=hold)
            self.log.warning("rollback.kept", generation=hold.generation, to=hold.to, error=hold.why)
            return True
        self.history.release()  # what it brought back can no longer be taken: the file's generation is tried
        return False

    def _enforce(self, desired: spec.Desired, held: Hold | None = None) -> None:
        """Make `desired` the state in force: the file's generation, or (`held`) the one a rollback brought back
        while the file's is held. What the old one started and the new one makes wrong is cancelled."""
        if self.desired is not None:
            self._ending(self.desired, desired)
        self.desired, self.held = desired, held
        metrics.desired_state_generation.set(self.store.generation)
        metrics.rolled_back.set(1 if held else 0)
        metrics.rolled_back_to.set(held.to if held else 0)
        self.backoff = Backoff(desired.policy.retries)  # a new generation: try everything again now
        self._adopt(desired)

    # -- a failed change ----------------------------------------------------------------------------------------

    def _brought_back(self, generation: int, to: int) -> spec.Desired | None:
        """Generation `to`, to be enforced in the place of `generation`, judged as the file would be today (its text
        kept in the history, and that copy's owner and mode); None, said once at error, when it is not kept or is
        no longer valid: the file's generation is enforced then."""
        text = self.history.text(to)
        kept = self.history.dir / f"{to}.yaml"
        desired, problems = (None, [f"generation {to} is not kept in {self.history.dir}"]) if text is None \
            else trusted_files.load_text(text, self.path, self.secrets(), kept)
        if desired is None:
            self._say_once(generation, "impossible", lambda: self.log.error(
                "rollback.impossible", generation=generation, to=to, errors=problems))
            return None
        for value in desired.secret_values():
            log.register_secret(value)
        return desired

    def _say_once(self, generation: int, what: str, say: Callable[[], object]) -> None:
        if (generation, what) not in self._said:
            self._said.add((generation, what))
            say()

    def failed_start(self, failed: tuple[int, str | None, str] | None) -> None:
        """A start of the file's generation that failed since the last reconcile (the generation it was started
        for, its deployment, why) is a failed change; one of an earlier generation is not (an edit since: that one
        is tried instead)."""
        if failed is not None and failed[0] == self.store.generation:
            self.failed_change(failed[2], failed[1])

    def failed_change(self, why: str, deployment: str | None) -> None:
        """The file's generation failed before it ever served (a start of `deployment`'s failed, or the image
        refused it): carry out `rollback.decide` while the file's generation is enforced. Said once either way."""
        desired, generation = self.desired, self.store.generation
        if (desired is None or self.held is not None or self.read_only is not None
                or desired.policy.mode != "enforce" or desired.policy.paused):
            return
        decision = rollback.decide(self.history.history, generation, desired, deployment,
                                   lambda to: self._brought_back(generation, to))
        why = rollback.first_line(log.redact_text(why))  # kept on disk and shown by `reconciler history`
        match decision.action:
            case "as-found":  # a first generation that stopped co-tenants: what ran before it comes back
                self._roll_back(generation, 0, desired, why)
            case "roll-back":
                assert decision.brought is not None
                self._roll_back(generation, decision.to, decision.brought, why)
            case "failed":
                self.history.failed(generation, why)
                self._say_once(generation, "failed", lambda: self.log.warning(
                    "change.failed", generation=generation, error=why, rollback=decision.why_not))
            case "none":
                pass

    def _roll_back(self, generation: int, to: int, brought: spec.Desired, why: str) -> None:
        """Hold `generation` and enforce `brought` (generation `to`; 0: the file's own, restoring what ran before
        it, core/restore) in its place."""
        hold = self.history.rolled_back(generation, to, why, self.clock())
        self._enforce(brought, held=hold)
        metrics.rollbacks.inc()
        self.log.warning("change.rolled_back", generation=generation, to=to or AS_FOUND, error=why)

    def restored(self, desired: spec.Desired, observed: Observed, current: Plan) -> Plan:
        """The plan in force: the file's (`current`), or while a first generation is held back to what ran before
        it, the restore plan of the co-tenants that generation stopped."""
        if self.held is None or self.held.to != 0:
            return current
        entry = self.history.history.entry(self.held.generation)
        return restore_plan(desired, observed, entry.stopped if entry is not None else (), self.held.generation)


def end_generation(old: spec.Desired, new: spec.Desired, operations: Operations, verifier: Verifier,
                   logger: Any) -> None:
    """Steps of the old generation that the new one makes wrong (a 12 h sync of a model no longer wanted) must
    not hold it: cancelled, they end at their next check; all steps are idempotent and rsync resumes from its
    partial data. The others run on: an edit of max_model_len keeps the weight sync (`operations.stale`). A
    verify goes on unless the weights it checks changed (`verify.verify_stale`)."""
    def judge(step: Step) -> str | None:
        try:
            return stale(step, old, new)
        except Exception as exc:  # noqa: BLE001 - the generation is recorded already: it must be taken in
            return f"not judged ({type(exc).__name__}: {exc}): cancelled to be safe"

    for step, why in operations.cancel_stale(judge).items():
        logger.info("operation.cancelled", step=step, reason=why)
    request = verifier.pending()
    if request is not None and (wrong := verify_stale(old, new, verifier.nodes(), request.repair)):
        logger.info("verify.cancelled", request=request.id, reason=wrong)
        verifier.cancel_all(wrong)
