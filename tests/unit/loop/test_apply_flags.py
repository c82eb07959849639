"""`reconciler apply` asks the serving image (`vllm serve --help=all`, which imports torch: ~26 s on the testbed)
beside the first pass's copies instead of before them (issue 36: it was the seed's largest cost on the path to
its first completion, bench/downtime.py), and still never plans a start the image has not judged.

The world is the seed snapshot, moved on by the simulator as the steps "run" (core.simulate.apply_plan): the
plans are the real planner's, the question and the steps stand-ins that record when they ran."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from reconciler.cli.plan_text import plan_text
from reconciler.core.exits import Exit
from reconciler.core.observed import Observed, ServeFlags
from reconciler.core.simulate import apply_plan
from reconciler.core.spec import load
from reconciler.core.vllm import parse_serve_help
from reconciler.edge.execute import Outcome, StepResult
from reconciler.loop import apply

KNOWN = parse_serve_help((Path(__file__).parents[1] / "fixtures" / "vllm-0.32.0-cpu-serve-help-all.txt").read_text())


class World:
    """The seed, each pass's plan applied by the simulator; what each pass ran and whether the image had answered
    by then."""

    def __init__(self, desired, seed_snapshot: Path, answer_after_first_pass: bool):
        self.desired = desired
        self.observed = Observed.model_validate(json.loads(seed_snapshot.read_text()))
        self.answered = threading.Event()
        self.asked: list[str] = []
        self.passes: list[tuple[list[str], bool]] = []
        self.answer_after_first_pass = answer_after_first_pass

    def observe(self, desired, sessions, timeout, ask_flags):
        assert ask_flags is False, "apply asks the image itself, beside its steps"
        return self.observed, {}

    def ask(self, view, sessions, holder, image_id):
        self.asked.append(image_id)
        if self.answer_after_first_pass:
            assert self.answered.wait(10), "the first pass never ended"
        return ServeFlags(image_id=image_id, flags=KNOWN, has_ray=True)

    def execute(self, plan, ctx, on_event):
        self.passes.append(([s.kind for s in plan.steps], bool(ctx.observed.serve_flags and
                                                               not ctx.observed.serve_flags.pending)))
        self.observed = apply_plan(self.desired, self.observed, plan)
        self.answered.set()
        return Outcome([StepResult(s, "success", 0.0) for s in plan.steps])


@pytest.fixture
def world(monkeypatch, cluster_yaml, seed_snapshot, request):
    w = World(load(cluster_yaml), seed_snapshot, request.param)
    monkeypatch.setattr(apply, "observe", w.observe)
    monkeypatch.setattr(apply, "ask_serve_flags", w.ask)
    monkeypatch.setattr(apply, "execute", w.execute)
    monkeypatch.setattr(apply.click, "confirm", lambda *_a, **_k: True)
    return w


def _apply(world: World, yes: bool) -> int:
    return apply._apply(world.desired, sessions=None, show=plan_text, yes=yes, dry_run=False, max_passes=3,  # type: ignore[arg-type]
                        generation=1)


@pytest.mark.parametrize("world", [True], indirect=True)
def test_with_yes_the_copies_run_while_the_image_is_asked_and_the_start_waits_for_its_answer(world):
    assert _apply(world, yes=True) == Exit.OK
    (first, judged_first), *later = world.passes
    assert {"image", "weights"} <= set(first) and not judged_first, "the copies ran beside the question"
    assert "start-serving" not in first, "no start is planned before the image has judged it"
    starts = [judged for kinds, judged in later if "start-serving" in kinds]
    assert starts == [True], "the start came in a later pass, judged"
    assert len(world.asked) == 1, "asked once per image id"


@pytest.mark.parametrize("world", [False], indirect=True)
def test_a_plan_to_confirm_waits_for_the_answer_so_what_a_person_confirms_includes_the_start(world):
    assert _apply(world, yes=False) == Exit.OK
    first, judged = world.passes[0]
    assert judged and {"image", "weights", "start-serving"} <= set(first)
    assert len(world.asked) == 1
