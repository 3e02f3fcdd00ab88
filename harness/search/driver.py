"""Search for failing cases: the engine behind `specaudit audit`, the gate and the kill table.

Hypothesis generates cases until the first failure (its example count and time are
recorded) and shrinks it within a budget; delta debugging (specaudit.search.ddmin) then takes the
shrunk case further, keeping its failure class. The result is what gets diagnosed.

One failure must not hide the rest (as Hypothesis reports several distinct bugs): with
`max_failures` > 1, once a failure is shrunk its class, the (check, rule) of the first violation
that counts, is set aside and the search goes on, from a seed derived from the first, with what
is left of the same `max_examples`. A run fails anew only when its first counted violation is of
a class not yet set aside, so a case that shows a found bug first is no new failure. Every
distinct failure keeps its own minimal case.

A hang is a class of its own and the dearest to search: every run of it waits out the watchdog's
idle limit. Once the runner has seen a decoder hang it gives that decoder a short idle limit
(`specaudit.running.runner.hang_limit`); here a hang is shrunk waiting out at most `HANG_WAITS`
more hangs in each of the two shrinkers, its replays are not run again, and once its class is
set aside, hangs met again stop the search after `HANG_RERUNS` of them.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hseed
from hypothesis import strategies as st

from specaudit.checks.registry import CHECK_ORDER, violations_in_order
from specaudit.contracts.case import Case
from specaudit.contracts.decoder import load_decoder
from specaudit.contracts.violation import Violation
from specaudit.running.runner import Run, is_hang, run_case
from specaudit.search.ddmin import CasePasses, minimize_case
from specaudit.search.determinism import without_local_constants
from specaudit.search.strategies import cases

SHRINK_BUDGET = 150
"""Decoder runs Hypothesis's shrinker may make after the first failure."""
MINIMIZE_BUDGET = 150
"""Decoder runs delta debugging may make on the shrunk case."""
HANG_WAITS = 4
"""Runs that hang the shrinker, and then delta debugging, may each wait out (the short idle limit,
`specaudit.running.runner.hang_limit`) while shrinking a hang; runs that return stay on the budgets above."""
HANG_RERUNS = 2
"""Hangs of a class already set aside after which the search stops: the decoder keeps hanging,
and the rest of the budget would be spent waiting on it."""

FailureClass = tuple[str, str]
"""(check, rule) of a run's first violation that counts: what one failure is told apart by."""


@dataclass(frozen=True)
class Found:
    """One distinct failure: its class, its minimal case and what finding it cost."""

    failure_class: FailureClass
    minimal: Case
    examples: int  # cases run before and including the one that found it, over all rounds
    seconds_to_find: float
    shrink_runs: int
    hang: bool  # a 'generate-returns' hang (shrunk with the small budgets)


@dataclass
class SearchResult:
    examples: int = 0  # cases run before and including the first failure (all, if none failed)
    seconds_to_first: float | None = None
    seconds: float = 0.0
    minimal: Case | None = None  # the first failure's shrunk case, None when every case passed
    shrink_runs: int = 0  # the first failure's
    failures: list[Found] = field(default_factory=list)  # every distinct failure, the first first
    cases_run: int = 0  # generated cases run over all rounds (the budget `max_examples` bounds)

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


class _KeepsHanging(BaseException):
    """Ends the whole search: the decoder hung again `HANG_RERUNS` times on a class set aside."""


def first_class(
    violations: Iterable[Violation], counts: Callable[[Violation], bool] | None, set_aside: set[FailureClass]
) -> FailureClass | None:
    """The class of a run's first counted violation, or None when nothing counts or that class
    is set aside (a case that shows a found failure first is no new one)."""
    first = next((v for v in violations if counts is None or counts(v)), None)
    if first is None or (first.check, first.rule) in set_aside:
        return None
    return first.check, first.rule


def derived_seed(seed: int, round_: int) -> int:
    """The seed of a search's `round_`-th round: `seed` itself first, then one derived from it."""
    if round_ == 0:
        return seed
    return int.from_bytes(hashlib.sha256(f"{seed}:{round_}".encode()).digest()[:8], "big")


@dataclass
class _Round:
    """One round of the search: generate until a new class fails, then shrink within it."""

    target: FailureClass | None = None  # the class being shrunk, once found
    hang: bool = False
    examples: int = 0
    shrink_runs: int = 0
    hang_waits: int = 0  # shrink runs that hung
    seconds_to_find: float = 0.0
    latest: Case | None = None  # the last failing case run: the shrinker's current smallest
    failing: set[Case] = field(default_factory=set)


@dataclass
class _Search:
    """What the rounds of one search share: the decoder, the budgets, and the classes set aside."""

    spec: str
    model: str
    factory: Any
    shrink: bool
    shrink_budget: int
    minimize_budget: int
    on_run: Callable[[Run], None] | None
    counts: Callable[[Violation], bool] | None
    start: float = field(default_factory=time.perf_counter)
    set_aside: set[FailureClass] = field(default_factory=set)
    hangs_again: int = 0  # hangs of a class set aside, met in later rounds

    def new(self, v: Violation) -> bool:
        """A violation that counts and is of no class set aside."""
        return (self.counts is None or self.counts(v)) and (v.check, v.rule) not in self.set_aside


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
    max_failures: int = 1,
) -> SearchResult:
    """Run generated cases until one fails a check (or the budget ends), then shrink it; with
    `max_failures` > 1 go on past it for up to that many distinct failures.

    A case fails when it has a violation that `counts` (default: any violation; the gate
    passes "not a known failure", so a known failure never stops the search and a new one
    cannot hide behind it). `on_run` sees every generated run (not the shrinker's). After a
    failure the shrinker gets `shrink_budget` more decoder runs (replays of failures already
    seen are free); then it stops, and the smallest failure found (the shrinker's latest: it
    only moves to smaller ones) is delta-debugged with up to `minimize_budget` more runs,
    keeping a violation that counts. Then its class is set aside and the next round starts
    (see the module docstring); all rounds together run at most `max_examples` generated cases.
    """
    s = _Search(spec, model, factory or load_decoder(spec), shrink, shrink_budget, minimize_budget, on_run, counts)
    result = SearchResult()
    for index in range(max_failures):
        if result.cases_run >= max_examples:
            break
        state = _Round()
        try:
            minimal = search_round(s, state, max_examples - result.cases_run, derived_seed(seed, index))
        except _KeepsHanging:
            minimal = None
        result.cases_run += state.examples
        if minimal is None or state.target is None:
            break
        found = shrunk_failure(s, minimal, state, result.cases_run)
        s.set_aside.update({state.target, found.failure_class})
        if all(f.failure_class != found.failure_class for f in result.failures):
            result.failures.append(found)
    result.examples = result.failures[0].examples if result.failures else result.cases_run
    if result.failures:  # the first failure's figures, as a search that stopped there gave them
        first = result.failures[0]
        result.minimal, result.shrink_runs = first.minimal, first.shrink_runs
        result.seconds_to_first = first.seconds_to_find
    result.seconds = time.perf_counter() - s.start
    return result


def search_round(s: _Search, state: _Round, max_examples: int, seed: int) -> Case | None:
    """Hypothesis on one seed until a case fails in a class not set aside, then its shrinker
    within that class or toward an earlier check's (`nearer_the_cause`), for `shrink_budget` runs,
    `HANG_WAITS` of them hanging; the smallest failing case, or None when none failed."""

    @hseed(seed)
    @settings(
        max_examples=max_examples,
        derandomize=False,  # the seed decides, not the environment (Hypothesis's ci profile derandomizes)
        deadline=None,
        database=None,
        phases=[Phase.generate, Phase.shrink] if s.shrink else [Phase.generate],
        suppress_health_check=list(HealthCheck),
        print_blob=False,
        report_multiple_bugs=False,
    )
    @given(data=st.data())
    def prop(data: st.DataObject) -> None:
        case = data.draw(cases(s.model), label="case")
        # A failure seen is not run again: a hang would be waited out anew, and a case of a class the
        # shrinker has since moved past must still fail when Hypothesis replays it (else: Flaky).
        if case not in state.failing and not fails(s, state, case):
            return
        state.failing.add(case)
        state.latest = case
        raise _Failed(case)  # in one place: Hypothesis tells failures apart by where they are raised

    try:
        with without_local_constants():
            prop()
    except _Failed as failed:  # Hypothesis re-raises the minimal case's failure last
        return failed.case
    except _BudgetSpent:
        return state.latest
    return None


def fails(s: _Search, state: _Round, case: Case) -> bool:
    """Run `case`: True when it fails in a class not set aside (the round's class, once found)."""
    if state.target is not None:
        if state.shrink_runs >= s.shrink_budget or state.hang_waits >= HANG_WAITS:
            raise _BudgetSpent
        state.shrink_runs += 1
    run = run_case(s.spec, case, factory=s.factory)
    state.hang_waits += state.target is not None and is_hang(run)
    if state.target is None:
        state.examples += 1
        if s.on_run is not None:
            s.on_run(run)
        note_hang_again(s, run)
    # While shrinking, a failure only counts at the class's check or before it (`nearer_the_cause`)
    through = state.target[0] if state.target is not None else None
    found = first_class(violations_in_order(run, through), s.counts, s.set_aside)
    if found is None or (state.target is not None and not nearer_the_cause(found, state.target)):
        return False  # passing, or failing only in a class set aside or one reported after the one shrunk
    if state.target is None:
        state.target, state.hang, state.seconds_to_find = found, is_hang(run), time.perf_counter() - s.start
    state.target = found
    return True


def nearer_the_cause(found: FailureClass, target: FailureClass) -> bool:
    """May the shrinker move from a failure of class `target` to one of class `found`? Within the
    class, or to an earlier invariant or output check of the registry (an I2 break behind an
    order-independence one): the checks are ordered cause first, so the minimal case then names
    the cause. Never into a contract break (a crash, a hang, a malformed return): that is a
    failure of its own, found in its own round. The class left behind is not set aside, so if it
    was a bug of its own a later round finds it again."""
    if found == target:
        return True
    return found[0] != "contract" and CHECK_ORDER.index(found[0]) < CHECK_ORDER.index(target[0])


def note_hang_again(s: _Search, run: Run) -> None:
    """Count a hang of a class set aside; after `HANG_RERUNS` of them, end the search."""
    if is_hang(run) and first_class(violations_in_order(run), s.counts, set()) in s.set_aside:
        s.hangs_again += 1
        if s.hangs_again >= HANG_RERUNS:
            raise _KeepsHanging


class HangWaits:
    """`run_case` for delta debugging, refusing to run once `HANG_WAITS` runs have hung (a run it
    refuses counts as not reproducing, so delta debugging winds down on the smallest hang so far)."""

    def __init__(self, spec: str, factory: Any) -> None:
        self.spec, self.factory, self.hangs = spec, factory, 0

    def __call__(self, case: Case) -> Run:
        if self.hangs >= HANG_WAITS:
            raise RuntimeError(f"not run: {self.hangs} runs hung already")
        run = run_case(self.spec, case, factory=self.factory)
        self.hangs += is_hang(run)
        return run


def shrunk_failure(s: _Search, case: Case, state: _Round, examples: int) -> Found:
    """The round's failure delta-debugged (keeping a violation that counts and is of no class set
    aside), with the class of its minimal case's first such violation. `examples`: cases run so far."""
    assert state.target is not None
    failure_class = state.target
    if s.minimize_budget > 0:
        runner = HangWaits(s.spec, s.factory)
        try:
            minimized = minimize_case(s.spec, case, s.factory, budget=s.minimize_budget, counts=s.new, runner=runner)
        except CasePasses:  # it failed under Hypothesis but not now (a nondeterministic decoder): keep it
            minimized = None
        if minimized is not None:
            case = minimized.case
            failure_class = first_class(list(minimized.diagnosis.violations), s.new, set()) or failure_class
    return Found(failure_class, case, examples, state.seconds_to_find, state.shrink_runs, state.hang)
