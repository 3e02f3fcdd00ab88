"""The planted-bug catalog: every mutant is caught by a Hypothesis search over `cases("transparent")`,
first by the check its `BugInfo` names, with a small shrunk case; EQSPEC passes the same search."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings

from harness.case import Case
from harness.checks import (
    Violation,
    check_contract,
    check_equivalence,
    check_i1,
    check_i2,
    check_token_preservation,
    explain,
)
from harness.diagnosis import diagnose
from harness.runner import Run, run_case
from harness.strategies import cases
from reference.mutants import CATALOG, CHECK_ORDER, SIGNATURES, BugInfo

CHECKS = dict(
    zip(CHECK_ORDER, (check_contract, check_i1, check_i2, check_equivalence, check_token_preservation), strict=True)
)

MAX_EXAMPLES = 200
SHRINK_RUNS = 120
"""Decoder runs the shrinker may spend after the first failure; past it, unexplored candidates
count as passing, so shrinking stops and Hypothesis reports the smallest failure found."""

SEARCH = dict(
    derandomize=True,
    deadline=None,
    database=None,
    phases=(Phase.generate, Phase.shrink),
    report_multiple_bugs=False,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large],
)


class NotCaught(AssertionError):
    """No check reports the planted bug within the example budget: a harness false negative."""


class ShrunkTooBig(AssertionError):
    """The bug is caught, but the shrunk case has more rows than the bug needs."""


KNOWN_GAPS: dict[str, tuple[type[AssertionError], str]] = {}
"""Mutants the harness does not yet handle as DESIGN.md requires; each expected failure is
strict and tied to its exception type, so a fix (or any other failure) shows up."""


@pytest.fixture(autouse=True, scope="module")
def one_thread() -> Iterator[None]:
    """Tiny exact models gain nothing from intra-op threads; on two shared cores they cost ~1.5x."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def first_violation(run: Run) -> tuple[str, list[Violation]] | None:
    """The first check, in the order contract, I1, I2, equivalence, token-preservation, that fails."""
    for name, check in CHECKS.items():
        violations = check(run)
        if violations:
            return name, violations
    return None


class Counterexample(Exception):
    def __init__(self, run: Run, check: str, violations: list[Violation]) -> None:
        super().__init__(explain(run, violations))
        self.run, self.check, self.violations = run, check, violations


@dataclass
class Search:
    """What one search did: decoder runs, the run that first failed, and the failing cases."""

    runs: int = 0
    found_at: int | None = None
    failing: set[Case] = field(default_factory=set)
    counterexample: Counterexample | None = None


def search(spec: str, max_examples: int = MAX_EXAMPLES, shrink_runs: int = SHRINK_RUNS) -> Search:
    """Hypothesis search for a case on which `spec` fails a check; the shrunk failure, if any."""
    result = Search()

    @settings(max_examples=max_examples, **SEARCH)
    @given(case=cases("transparent"))
    def find_failure(case: Case) -> None:
        spent = result.found_at is not None and result.runs - result.found_at >= shrink_runs
        if spent and case not in result.failing:
            return
        result.runs += 1
        run = run_case(spec, case)
        failure = first_violation(run)
        if failure is not None:
            result.failing.add(case)
            result.found_at = result.found_at or result.runs
            raise Counterexample(run, *failure)

    try:
        find_failure()
    except Counterexample as exc:
        result.counterexample = exc
    return result


def catalog_params() -> list:
    params = []
    for name in CATALOG:
        gap = KNOWN_GAPS.get(name)
        marks = [pytest.mark.xfail(raises=gap[0], reason=gap[1], strict=True)] if gap else []
        params.append(pytest.param(name, marks=marks, id=name))
    return params


@pytest.mark.parametrize("name", catalog_params())
def test_mutant_is_caught_with_a_small_case(name: str) -> None:
    """The search finds a failing case, its first failing check is the one the catalog names,
    and it shrinks to one row (bugs visible at batch size 1) or two (bugs that need a batch)."""
    bug: BugInfo = CATALOG[name].bug
    result = search(f"reference.mutants:{name}")
    found = result.counterexample
    if found is None:
        raise NotCaught(f"{name} ({bug.bug_class}): no check failed in {result.runs} examples")
    case = found.run.case
    print(f"{name}: found at run {result.found_at}, {result.runs} runs, shrunk to {case.batch_size} row(s): {case!r}")
    rows = 1 if bug.visible_at_batch_1 and not bug.needs_padding else 2
    if case.batch_size > rows:
        raise ShrunkTooBig(
            f"{name}: shrunk case has {case.batch_size} rows, but should have at most {rows} "
            f"(found at run {result.found_at}, {result.runs} runs)\n{found}"
        )
    if not bug.visible_at_batch_1:
        assert case.batch_size == 2, f"{name}: fails at batch size 1, but the catalog says it needs a batch\n{found}"
    assert found.check == bug.first_check, (
        f"{name}: first failing check is {found.check}, but the catalog says {bug.first_check}\n{found}"
    )
    diagnosis = diagnose(run_case(f"reference.mutants:{name}", case))
    assert diagnosis.signature == bug.signature, (
        f"{name}: diagnosed as {diagnosis.signature} ({diagnosis.reason}), but the catalog says {bug.signature}"
    )


def test_catalog_is_complete_and_documented() -> None:
    """At least 20 uniquely named mutants, each a documented EqSpec variation with its BugInfo."""
    import reference.mutants as mutants
    from reference.eqspec import EqSpec

    assert len(CATALOG) >= 20, f"got {len(CATALOG)} mutants, but should be at least 20"
    classes = list(CATALOG.values())
    assert len(set(classes)) == len(classes), "a class is listed under two names"
    for name, cls in CATALOG.items():
        assert cls.name == name and getattr(mutants, name) is cls, (
            f"{name} is not reachable as reference.mutants:{name}"
        )
        assert issubclass(cls, EqSpec) and cls is not EqSpec
        assert cls.__doc__ and cls.__doc__.strip(), f"{name} has no docstring"
        assert "__doc__" in vars(cls), f"{name} inherits its docstring instead of documenting its bug"
        bug = vars(cls).get("bug")
        assert isinstance(bug, BugInfo), f"{name} has no BugInfo of its own"
        assert bug.signature in SIGNATURES and bug.first_check in CHECK_ORDER
        assert bug.bug_class and bug.seen_in
        assert bug.output_equivalent == (bug.signature == "output-equivalent")


@pytest.mark.parametrize("spec", ["reference.eqspec:EqSpec", "reference.mutants:RoundHooks"])
def test_reference_passes_the_same_search(spec: str) -> None:
    """EQSPEC (and the mutants' hook base, which must be EQSPEC itself) fails no check in 50 examples."""
    result = search(spec, max_examples=50, shrink_runs=0)
    assert result.counterexample is None, str(result.counterexample)
