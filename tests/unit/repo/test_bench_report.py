"""docs/benchmarks.md says why each missed target missed: a reason per row, not per benchmark, where one
benchmark's rows miss for different reasons (bench/report.py)."""

from __future__ import annotations

from bench import report
from bench.common import RESULTS


def test_a_benchmark_whose_rows_miss_for_different_reasons_gives_each_row_its_own():
    two = report._why_missed("noop", "1 no-op cycle, 2 nodes, two deployments (p50 / p95)")
    ansible = report._why_missed("noop", "1 no-op cycle, 2 nodes (p50 / p95)")
    assert "each deployment is parsed" in two
    assert "process start-ups" in ansible


def test_a_benchmark_with_one_reason_gives_it_to_every_row_and_one_without_gives_none():
    assert report._why_missed("image", "4b image to the worker") == report.MISSED["image"]
    assert report._why_missed("edit", "3 edit -> first step") == ""


def test_the_wedges_reason_is_not_given_to_a_change_row():
    assert "frozen API" in report._why_missed("downtime", "10 wedge: freeze -> first completion again")
    assert report._why_missed("downtime", "10 API outage of a model change") == ""


def test_every_row_the_committed_results_miss_says_why():
    text = report.missed(report._load(RESULTS))
    lines = [line for line in text.splitlines() if line.startswith("- **")]
    assert lines or text == "None in this run."
    for line in lines:
        assert len(line.split("): ", 1)[1]) > 40, line
