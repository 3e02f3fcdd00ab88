"""The planted-bug catalog: every mutant is caught by a Hypothesis search over `cases("transparent")`,
first by the check its `BugInfo` names, with a small shrunk case; EQSPEC passes the same search."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from specaudit.diagnosis import diagnose
from specaudit.reference.mutants import CATALOG, CHECK_ORDER, SIGNATURES, BugInfo
from specaudit.runner import run_case
from specaudit.search import search

MAX_EXAMPLES = 200


class NotCaught(AssertionError):
    """No check reports the planted bug within the example budget: a harness false negative."""


class ShrunkTooBig(AssertionError):
    """The bug is caught, but the minimal case has more rows than the bug needs."""


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
    spec = f"specaudit.reference.mutants:{name}"
    result = search(spec, "transparent", max_examples=MAX_EXAMPLES, seed=0)
    if result.minimal is None:
        raise NotCaught(f"{name} ({bug.bug_class}): no check failed in {result.examples} examples")
    case = result.minimal
    diagnosis = diagnose(run_case(spec, case))
    print(f"{name}: found after {result.examples} examples, minimal case of {case.batch_size} row(s): {case!r}")
    rows = 1 if bug.visible_at_batch_1 and not bug.needs_padding else 2
    if case.batch_size > rows:
        raise ShrunkTooBig(f"{name}: minimal case has {case.batch_size} rows, but should have at most {rows}")
    if not bug.visible_at_batch_1:
        assert case.batch_size == 2, f"{name}: fails at batch size 1, but the catalog says it needs a batch"
    assert diagnosis.first_check == bug.first_check, (
        f"{name}: first failing check is {diagnosis.first_check}, but the catalog says {bug.first_check}\n"
        f"{diagnosis.render()}"
    )
    assert diagnosis.signature == bug.signature, (
        f"{name}: diagnosed as {diagnosis.signature} ({diagnosis.reason}), but the catalog says {bug.signature}"
    )


def test_catalog_is_complete_and_documented() -> None:
    """At least 20 uniquely named mutants, each a documented EqSpec variation with its BugInfo."""
    import specaudit.reference.mutants as mutants
    from specaudit.reference.eqspec import EqSpec

    assert len(CATALOG) >= 20, f"got {len(CATALOG)} mutants, but should be at least 20"
    classes = list(CATALOG.values())
    assert len(set(classes)) == len(classes), "a class is listed under two names"
    for name, cls in CATALOG.items():
        assert cls.name == name and getattr(mutants, name) is cls, (
            f"{name} is not reachable as specaudit.reference.mutants:{name}"
        )
        assert issubclass(cls, EqSpec) and cls is not EqSpec
        assert cls.__doc__ and cls.__doc__.strip(), f"{name} has no docstring"
        assert "__doc__" in vars(cls), f"{name} inherits its docstring instead of documenting its bug"
        bug = vars(cls).get("bug")
        assert isinstance(bug, BugInfo), f"{name} has no BugInfo of its own"
        assert bug.signature in SIGNATURES and bug.first_check in CHECK_ORDER
        assert bug.bug_class and bug.seen_in
        assert bug.output_equivalent == (bug.signature == "output-equivalent")


@pytest.mark.parametrize("spec", ["specaudit.reference.eqspec:EqSpec"])
def test_reference_passes_the_same_search(spec: str) -> None:
    """EQSPEC fails no check in 50 examples of the search that catches every planted bug."""
    result = search(spec, "transparent", max_examples=50, seed=0)
    assert result.minimal is None, repr(result.minimal)
