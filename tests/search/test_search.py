"""The search's shrink budget ends Hypothesis's shrinker: past it no candidate is even drawn, so
a slow shrink costs the budget's runs, not Hypothesis's own five-minute limit."""

from __future__ import annotations

from typing import Any

import pytest

import specaudit.search.driver as search_module
from specaudit.checks.diagnosis import diagnose
from specaudit.running.runner import run_case

pytestmark = pytest.mark.usefixtures("one_thread")

PADS = "specaudit.reference.mutants:pads_attended"  # first caught on a wide case: much to shrink


def test_shrinking_stops_when_its_budget_is_spent(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every case drawn is run once (a failure Hypothesis replays is not run again), but for the
    one that finds the budget spent; the smallest failure seen is still the result, and it fails."""
    counts = {"drawn": 0, "run": 0}
    drawn: list[Any] = []
    real_cases, real_run = search_module.cases, search_module.run_case

    def counted(case: Any) -> Any:
        counts["drawn"] += 1
        drawn.append(case)
        return case

    def run(*args: Any, **kwargs: Any) -> Any:
        counts["run"] += 1
        return real_run(*args, **kwargs)

    monkeypatch.setattr(search_module, "cases", lambda model: real_cases(model).map(counted))
    monkeypatch.setattr(search_module, "run_case", run)
    result = search_module.search(PADS, "transparent", max_examples=20, seed=0, shrink_budget=4, minimize_budget=0)
    assert result.shrink_runs == 4, result
    assert len(set(drawn)) == counts["run"] + 1, counts
    assert result.minimal is not None and not diagnose(run_case(PADS, result.minimal)).passed
