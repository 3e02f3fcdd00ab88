"""One failure does not hide the rest (issue 27, point 3): after a failure is shrunk its class is
set aside and the search goes on, so a decoder with three independent defects is reported with
three distinct failures, each with a minimal case of its own, within one budget of cases."""

from __future__ import annotations

import pytest

from specaudit.checks.diagnosis import diagnose
from specaudit.contracts.violation import Violation
from specaudit.running.runner import run_case
from specaudit.search.driver import derived_seed, first_class, nearer_the_cause, search

pytestmark = pytest.mark.usefixtures("one_thread")

SPEC = "tests.decoders.three_defects:ThreeDefects"
CLASSES = [("I2", "history-token"), ("equivalence", "first-divergence"), ("contract", "ends-at-eos")]
"""The three defects' classes, in the order seed 0 finds them."""


@pytest.mark.slow  # a search of a cache-free decoder: about 20 s
def test_the_search_finds_every_distinct_failure_class() -> None:
    """Seed 0, 10 cases: three failures, one per defect, each minimal case failing in its own class
    (before: the search stopped at the first)."""
    result = search(SPEC, "transparent", max_examples=10, seed=0, shrink_budget=10, minimize_budget=20, max_failures=8)
    assert [f.failure_class for f in result.failures] == CLASSES, result.failures
    assert result.minimal == result.failures[0].minimal and result.cases_run <= 10
    for found in result.failures:
        d = diagnose(run_case(SPEC, found.minimal))
        assert d.first is not None and (d.first.check, d.first.rule) == found.failure_class, d.render()
    assert [f.examples for f in result.failures] == sorted(f.examples for f in result.failures)


def test_one_failure_is_the_default() -> None:
    """`max_failures=1` (the kill table's, a planted bug's) stops at the first failure, as before."""
    result = search(SPEC, "transparent", max_examples=25, seed=0, shrink_budget=5, minimize_budget=0)
    assert [f.failure_class for f in result.failures] == CLASSES[:1]


def test_a_class_set_aside_is_no_new_failure() -> None:
    """A run fails anew only by its first counted violation, and only in a class not set aside."""
    i2 = Violation("I2", "history-token", "found", "expected")
    eq = Violation("equivalence", "first-divergence", "found", "expected")
    assert first_class([i2, eq], None, set()) == ("I2", "history-token")
    assert first_class([i2, eq], None, {("I2", "history-token")}) is None  # shows a found failure first
    assert first_class([i2, eq], lambda v: v.check != "I2", {("I2", "history-token")}) == CLASSES[1]


def test_rounds_after_the_first_draw_from_seeds_derived_from_it() -> None:
    """Round 0 keeps the seed (a first failure as before); later rounds differ, deterministically."""
    assert derived_seed(7, 0) == 7
    assert derived_seed(7, 1) == derived_seed(7, 1) != derived_seed(7, 2) != 7


def test_the_shrinker_moves_toward_the_cause_only() -> None:
    """A shrink candidate may fail an earlier check of the registry than the class being shrunk (an
    I2 break behind an order-independence one: `cache_rows_permuted`), never a later one."""
    cause, effect = ("I2", "attends-wrong-slot"), ("order-independence", "same-output")
    assert nearer_the_cause(cause, effect) and nearer_the_cause(effect, effect)
    assert not nearer_the_cause(effect, cause)
    assert not nearer_the_cause(("contract", "generate-returns"), effect), "a hang is a failure of its own"
