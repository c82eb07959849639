"""Drive a step's actions (reconciler/edge/steps/actions.py) from recorded facts, with no node, no thread, no clock.

As pyinfra tests an operation from JSON (the facts it sees, the commands it must yield), a step case gives:

- `facts`: per fact (`"NODE KEY"`, KEY as `facts.base.Fact.key` names it: `"head container vllm"`), the answers of its
  successive reads (the last one repeats). An answer is either node output (`Raw`: a section's body and rc, parsed
  by the fact's own parser, as the probe would) or an already parsed value;
- `results`: per command (`"NODE argv..."` as `shlex.join` writes it), the results of its successive runs (default:
  exit 0, no output). A failing result of a checked command is raised into the step as `CommandFailed`.

`drive` returns the transcript: one line per action, `read NODE KEY`, `run NODE [sudo] ARGV`, `wait NODE KEY|ARGV`
(the reads of a wait are not repeated in it), `report EVENT`; and the exception the step ended with, if any. A
wait whose condition the answers never meet ends as the executor ends it at its deadline: `StepFailed` into the
step.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from reconciler.core.spec import Desired
from reconciler.edge import steps
from reconciler.edge.facts.base import Fact, ProbeError, Section
from reconciler.edge.ssh import CommandFailed, Result
from reconciler.edge.steps.actions import (
    Action,
    Actions,
    Given,
    Parallel,
    Read,
    Report,
    Run,
    Start,
    StepFailed,
    StepTimedOut,
    Stop,
    Wait,
    advance,
)

#: A step that yields more actions than this never ends (a mutant whose wait returns at once): the case fails
#: instead of hanging the run (`make mutation`).
MAX_ACTIONS = 10_000


@dataclass(frozen=True)
class Raw:
    """A fact's section as the node printed it; parsed by the fact's own parser."""

    body: str
    rc: int = 0


def _sections(fact: Fact[Any]) -> list[str]:
    return [line.split(" ", 1)[1] for line in fact.lines if re.fullmatch(r"sec [\w-]+", line)]


def _parsed(fact: Fact[Any], answer: object) -> object:
    if isinstance(answer, Raw):
        names = _sections(fact)
        assert len(names) == 1, f"{fact.key}: a Raw answer needs a one-section fact, it has {names}"
        return fact.parse({names[0]: Section(answer.body, answer.rc)})
    if isinstance(answer, dict) and answer and all(isinstance(v, Section) for v in answer.values()):
        return fact.parse(answer)
    return answer


_HELPERS = {path.read_text(): f"<{path.name}>" for path in Path(steps.__file__).parent.glob("*_helper.py")}


def command_key(action: Run | Start) -> str:
    """`NODE [sudo] ARGV`; a helper's source sent as `python3 -c SOURCE` shows as `<NAME_helper.py>`."""
    words = [_HELPERS.get(word, word) for word in action.argv]
    return f"{action.node} " + ("sudo " if isinstance(action, Run) and action.sudo else "") + shlex.join(words)


@dataclass
class Driver:
    facts: Mapping[str, Sequence[object]] = field(default_factory=dict)
    results: Mapping[str, Sequence[Result]] = field(default_factory=dict)
    transcript: list[str] = field(default_factory=list)
    stdin: dict[str, bytes] = field(default_factory=dict)  # what each command was fed (never in the transcript)
    outputs: Mapping[str, Sequence[bytes]] = field(default_factory=dict)  # chunks fed to a Run's on_output
    timeouts: dict[str, float | None] = field(default_factory=dict)  # each command's own deadline (None: the policy's)
    _reads: dict[str, int] = field(default_factory=dict)
    _helpers: dict[Start, Result] = field(default_factory=dict)

    def _next(self, table: Mapping[str, Sequence[Any]], key: str, default: Any = None) -> Any:
        answers = table.get(key)
        if answers is None:
            if default is not None:
                return default
            raise AssertionError(f"the case gives no answer for {key!r}")
        index = self._reads.get(key, 0)
        self._reads[key] = index + 1
        return answers[min(index, len(answers) - 1)]

    def _exhausted(self, table: Mapping[str, Sequence[Any]], key: str) -> bool:
        return self._reads.get(key, 0) >= len(table.get(key) or [None])

    def read(self, action: Read) -> object:
        """As the executor reads: a fact that does not parse fails the step (`Performer._read`)."""
        try:
            return _parsed(action.fact, self._next(self.facts, f"{action.node} {action.fact.key}"))
        except ProbeError as exc:
            raise StepFailed(f"{action.node}: {exc}") from None

    def run(self, action: Run) -> Result:
        key = command_key(action)
        self.timeouts[key] = action.timeout
        if action.stdin is not None:
            self.stdin[key] = action.stdin
        if action.on_output is not None:
            for chunk in self.outputs.get(key, ()):
                if (report := action.on_output(chunk)) is not None:
                    self.transcript.append(f"report {report.event}")
        result: Result = self._next(self.results, key, Result("", "", 0))
        if action.check and result.exit_code != 0:
            raise CommandFailed(action.node, list(action.argv), result.exit_code, result.stdout, result.stderr)
        return result

    def wait(self, action: Wait) -> object:
        inner = action.action
        key = f"{inner.node} {inner.fact.key}" if isinstance(inner, Read) else command_key(inner)
        table = self.facts if isinstance(inner, Read) else self.results
        self.transcript.append(f"wait {key}")
        while True:
            value = self.read(inner) if isinstance(inner, Read) else self.run(inner)
            if action.until(value):
                return value
            if self._exhausted(table, key):
                raise StepTimedOut(f"timed out after {action.timeout:g}s waiting for {action.what}")

    def do(self, action: Action) -> object:
        assert len(self.transcript) < MAX_ACTIONS, f"the step never ends: {self.transcript[-3:]}"
        if isinstance(action, Report):
            self.transcript.append(f"report {action.event}")
            return None
        if isinstance(action, Read):
            self.transcript.append(f"read {action.node} {action.fact.key}")
            return self.read(action)
        if isinstance(action, Run):
            self.transcript.append(f"run {command_key(action)}")
            return self.run(action)
        if isinstance(action, Parallel):
            return self.parallel(action)
        if isinstance(action, Start):
            return self.start(action)
        if isinstance(action, Stop):
            return self.stop(action)
        assert isinstance(action, Wait), action
        return self.wait(action)

    def parallel(self, action: Parallel) -> list[Result]:
        """As `Performer._parallel`: each run to its end (here one after the other), then the first error."""
        self.transcript.append(f"parallel {len(action.runs)}")
        results, errors = [], []
        for run in action.runs:
            self.transcript.append(f"run {command_key(run)}")
            try:
                results.append(self.run(run))
            except Exception as exc:  # noqa: BLE001 - raised once all ended, as the executor does
                errors.append(exc)
        if errors:
            raise errors[0]
        return results

    def start(self, action: Start) -> str | None:
        """A helper's whole run is one `results` entry under `start NODE ARGV`: its stdout's first line is what
        the Start is sent, the Result what its Stop is (default: exit 0, no output)."""
        key = command_key(action)
        self.transcript.append(f"start {key}")
        self.stdin[f"start {key}"] = action.stdin
        said: Result = self._next(self.results, f"start {key}", Result("", "", 0))
        self._helpers[action] = said
        return said.stdout.split("\n", 1)[0] if said.stdout else None

    def stop(self, action: Stop) -> Result | None:
        self.transcript.append(f"stop {action.how} {command_key(action.helper)}")
        said = self._helpers.pop(action.helper)
        if action.how == "close":
            return None
        rest = said.stdout.split("\n", 1)[1] if "\n" in said.stdout else ""
        return Result(rest, said.stderr, said.exit_code)

    def drive(self, actions: Actions) -> BaseException | None:
        """Run the step to its end, as the executor does (`actions.advance`); the exception it ended with (None:
        it reached its goal). A case that gives no answer for what the step asks is the test's error, not the
        step's."""
        try:
            advance(actions, self.do)
        except AssertionError:
            raise
        except Exception as exc:  # noqa: BLE001 - the step's end is the case's result
            return exc
        return None


def drive(actions: Actions, facts: Mapping[str, Sequence[object]] | None = None,
          results: Mapping[str, Sequence[Result]] | None = None,
          outputs: Mapping[str, Sequence[bytes]] | None = None) -> tuple[list[str], BaseException | None]:
    driver = Driver(facts or {}, results or {}, outputs=outputs or {})
    error = driver.drive(actions)
    return driver.transcript, error


def root_runs(case: Any) -> tuple[Desired, list[tuple[str, tuple[str, ...]]]]:
    """The desired state a step case (tests/unit/step_cases/) runs over, and each command its step sends as root
    (`run NODE sudo ARGV` in its transcript) as (node, argv): what `reconciler sudoers` must allow, asked per kind
    (test_step_kinds) and per node (test_step_cases) from one reading of the transcript."""
    desired = case.desired()
    given = Given(desired, case.observed(), case.generation)
    transcript, _ = drive(steps.plan_of(case.step.kind)(given, case.step), case.facts, case.results)
    runs: list[tuple[str, tuple[str, ...]]] = []
    for line in transcript:
        _, node, *rest = line.split(" ", 3) if line.startswith("run ") else ("", "", "")
        if rest and rest[0] == "sudo":
            runs.append((node, tuple(shlex.split(rest[1]))))
    return desired, runs
