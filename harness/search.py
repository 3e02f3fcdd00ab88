"""Search for a failing case: the engine behind `specaudit audit`, the gate and the kill table.

Hypothesis generates cases until the first failure (its example count and time are
recorded) and shrinks it within a budget; delta debugging (specaudit.ddmin) then takes the
shrunk case further, keeping its failure class. The result is what gets diagnosed.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from specaudit.case import Case
from specaudit.diagnosis import all_violations
from specaudit.runner import Run, run_case


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


def search(
    spec: str,
    model: str,
    *,
    max_examples: int,
    seed: int,
    factory: Any = None,
    shrink: bool = True,
    shrink_budget: int = 150,
    minimize_budget: int = 150,
    on_run: Callable[[Run], None] | None = None,
) -> SearchResult:
    """Run generated cases until one fails a check (or the budget ends), then shrink it.

    After the first failure the shrinker gets `shrink_budget` more decoder runs; past that,
    untried cases count as passing (known failures still fail, so replays stay reliable), and
    the smallest failure found is delta-debugged with up to `minimize_budget` more runs.
    """
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as hseed
    from hypothesis import strategies as st

    from specaudit.contract import load_decoder
    from specaudit.strategies import cases

    factory = factory or load_decoder(spec)
    result = SearchResult()
    failing: set[Case] = set()
    start = time.perf_counter()
    phases = [Phase.generate, Phase.shrink] if shrink else [Phase.generate]

    @hseed(seed)
    @settings(
        max_examples=max_examples,
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
            result.shrink_runs += 1
            if result.shrink_runs > shrink_budget:
                return
        run = run_case(spec, case, factory=factory)
        if result.seconds_to_first is None:
            result.examples += 1
            if on_run is not None:
                on_run(run)
        if all_violations(run):
            if result.seconds_to_first is None:
                result.seconds_to_first = time.perf_counter() - start
            failing.add(case)
            raise _Failed(case)

    try:
        prop()
    except _Failed as failed:  # Hypothesis re-raises the minimal case's failure last
        result.minimal = failed.case
    if result.minimal is not None and minimize_budget > 0:
        from specaudit.ddmin import minimize_case

        result.minimal = minimize_case(spec, result.minimal, factory, budget=minimize_budget).case
    result.seconds = time.perf_counter() - start
    return result
