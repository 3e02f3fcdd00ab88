"""Search for a failing case: the engine behind `specaudit audit`, the gate and the kill table.

Hypothesis generates cases until the first failure (its example count and time are
recorded) and shrinks it within a budget; delta debugging (specaudit.search.ddmin) then takes the
shrunk case further, keeping its failure class. The result is what gets diagnosed.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hseed
from hypothesis import strategies as st

from specaudit.checks.registry import all_violations
from specaudit.contracts.case import Case
from specaudit.contracts.decoder import load_decoder
from specaudit.contracts.violation import Violation
from specaudit.running.runner import Run, run_case
from specaudit.search.ddmin import minimize_case
from specaudit.search.determinism import without_local_constants
from specaudit.search.strategies import cases

SHRINK_BUDGET = 150
"""Decoder runs Hypothesis's shrinker may make after the first failure."""
MINIMIZE_BUDGET = 150
"""Decoder runs delta debugging may make on the shrunk case."""


@dataclass
class SearchResult:
    examples: int = 0  # cases run before and including the first failure (all, if none failed)
    seconds_to_first: float | None = None
    seconds: float = 0.0
    minimal: Case | None = None  # the shrunk failing case, None when every case passed
    shrink_runs: int = 0

    @property
    def found(self) -> bool:
        return self.minimal is not None


class _Failed(Exception):
    def __init__(self, case: Case) -> None:
        self.case = case


class _BudgetSpent(BaseException):
    """Ends Hypothesis's shrinker once the shrink budget is spent. Left alone, it would go on
    trying candidates that now pass unrun, for up to its own five-minute limit on long cases
    (most of a slow planted bug's time, and a wall-clock bound that made the result depend on
    the machine's speed). A BaseException, so Hypothesis does not take it for a failure."""


def search(
    spec: str,
    model: str,
    *,
    max_examples: int,
    seed: int,
    factory: Any = None,
    shrink: bool = True,
    shrink_budget: int = SHRINK_BUDGET,
    minimize_budget: int = MINIMIZE_BUDGET,
    on_run: Callable[[Run], None] | None = None,
    counts: Callable[[Violation], bool] | None = None,
) -> SearchResult:
    """Run generated cases until one fails a check (or the budget ends), then shrink it.

    A case fails when it has a violation that `counts` (default: any violation; the gate
    passes "not a known failure", so a known failure never stops the search and a new one
    cannot hide behind it). `on_run` sees every run up to and including the first failure.
    After the first failure the shrinker gets `shrink_budget` more decoder runs (replays of
    failures already seen are free); then it stops, and the smallest failure found (the
    shrinker's latest: it only moves to smaller ones) is delta-debugged with up to
    `minimize_budget` more runs, keeping a violation that counts.
    """
    factory = factory or load_decoder(spec)
    result = SearchResult()
    failing: set[Case] = set()
    latest: list[Case] = []  # the last failing case run: the shrinker's current smallest
    start = time.perf_counter()
    phases = [Phase.generate, Phase.shrink] if shrink else [Phase.generate]

    @hseed(seed)
    @settings(
        max_examples=max_examples,
        derandomize=False,  # the seed decides, not the environment (Hypothesis's ci profile derandomizes)
        deadline=None,
        database=None,
        phases=phases,
        suppress_health_check=list(HealthCheck),
        print_blob=False,
        report_multiple_bugs=False,
    )
    @given(data=st.data())
    def prop(data: st.DataObject) -> None:
        case = data.draw(cases(model), label="case")
        if result.seconds_to_first is not None and case not in failing:
            if result.shrink_runs >= shrink_budget:
                raise _BudgetSpent
            result.shrink_runs += 1
        run = run_case(spec, case, factory=factory)
        if result.seconds_to_first is None:
            result.examples += 1
            if on_run is not None:
                on_run(run)
        if any(counts is None or counts(v) for v in all_violations(run)):
            if result.seconds_to_first is None:
                result.seconds_to_first = time.perf_counter() - start
            failing.add(case)
            latest[:] = [case]
            raise _Failed(case)

    try:
        with without_local_constants():
            prop()
    except _Failed as failed:  # Hypothesis re-raises the minimal case's failure last
        result.minimal = failed.case
    except _BudgetSpent:
        result.minimal = latest[0]
    if result.minimal is not None and minimize_budget > 0:
        result.minimal = minimize_case(spec, result.minimal, factory, budget=minimize_budget, counts=counts).case
    result.seconds = time.perf_counter() - start
    return result
