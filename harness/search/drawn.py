"""One search over drawn workloads for every engine adapter: vLLM's and transformers-cb's paged
white boxes and OpenVINO's output level.

Hypothesis draws up to `examples` workloads from the adapter's strategy within a time budget, after
the adapter's `first` (fixed workloads built to reach what a handful of draws may all miss; one
that fails is kept until a draw fails the same way and is shrunk); the adapter judges each
(`Judge`: the violations that count, None when it passes or a known defect explains it). The
first failure is shrunk to the smallest workload that fails the same way: the same first check
and rule, and `keep` true of its first violation (a margin over a tolerance, so the minimal case
fails again on another machine). Shrinking stops when Hypothesis is done or the budget is spent.
Seeded and without a database, so a search is the same on every machine.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st

from specaudit.contracts.violation import Violation

W = TypeVar("W")

Judge = Callable[[Any, bool], tuple[list[Violation] | None, Any]]
"""(workload, shrinking) -> (the violations that count, None when it passes or is explained; the
adapter's evidence of the run, kept with the failure)."""


@dataclass(frozen=True)
class Shrunk(Generic[W]):
    """The smallest failing workload the search kept, its violations and the adapter's evidence."""

    workload: W
    violations: list[Violation]
    evidence: Any = None


@dataclass(frozen=True)
class Found(Generic[W]):
    """What a search ended with: the failure shrunk (None: none), and Hypothesis's own error (its
    Flaky: a workload that failed once and not again, or the budget ran out mid-shrink)."""

    failure: Shrunk[W] | None
    error: Exception | None = None  # Hypothesis's own, with or without a failure kept


class _Failed(Exception):
    """A failing workload raised out of the property, so Hypothesis shrinks it."""


class _BudgetSpent(BaseException):
    """Ends Hypothesis's shrinker once the budget is spent (a BaseException: not a failure)."""


def key_of(violations: list[Violation]) -> tuple[str, str] | None:
    """The failure's class: its first violation's check and rule."""
    return (violations[0].check, violations[0].rule) if violations else None


def drawn_search(
    strategy: st.SearchStrategy[W],
    judge: Judge,
    examples: int,
    seed: int,
    seconds: float | None = None,
    keep: Callable[[Violation], bool] = lambda v: True,
    first: Sequence[W] = (),
) -> Found[W]:
    """Judge `first`, then draw, judge and shrink (see the module docstring); `examples` counts
    both; `seconds`: the budget (None: none). A fixed workload that fails is the failure kept until
    a draw fails the same way, which is then shrunk in its place."""
    deadline = None if seconds is None else time.monotonic() + seconds
    kept: dict[str, Any] = {"key": None, "failure": None}
    for workload in first:
        if deadline is not None and time.monotonic() > deadline:
            return Found(None)
        violations, evidence = judge(workload, False)
        if violations is not None:
            kept["key"], kept["failure"] = key_of(violations), Shrunk(workload, violations, evidence)
            break
    if examples <= len(first):
        return Found(kept["failure"])

    def probe(workload: W) -> None:
        shrinking = kept["failure"] is not None
        if deadline is not None and time.monotonic() > deadline:
            if shrinking:
                raise _BudgetSpent
            return  # drawing stops: the remaining draws pass at once
        violations, evidence = judge(workload, shrinking)
        if violations is None:
            return
        key = key_of(violations)
        if shrinking and (key != kept["key"] or (violations and not keep(violations[0]))):
            return  # fails another way, or too close to its tolerance to replay: not the failure shrunk
        kept["key"], kept["failure"] = key, Shrunk(workload, violations, evidence)
        raise _Failed

    checked = settings(max_examples=examples - len(first), deadline=None, database=None,
                       phases=[Phase.generate, Phase.shrink], suppress_health_check=list(HealthCheck),
                       print_blob=False)  # fmt: skip
    test = hypothesis_seed(seed)(checked(given(strategy)(probe)))
    try:
        test()
    except (_Failed, _BudgetSpent):
        pass
    except Exception as exc:  # Hypothesis's own (Flaky): the smallest failure seen is kept beside it
        return Found(kept["failure"], exc)
    return Found(kept["failure"])


__all__ = ["Found", "Judge", "Shrunk", "drawn_search", "key_of"]
