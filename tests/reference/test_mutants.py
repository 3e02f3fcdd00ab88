"""The planted-bug catalog: every mutant is caught by a Hypothesis search over `cases(model)` on the
model its `BugInfo.models` names first (the transparent one unless the bug needs a real model, dtype
or draft), first by the check its `BugInfo` names, with a small shrunk case; EQSPEC passes the same
search. The bugs that only the scale, dtype and draft ranges reach pass just inside them."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from specaudit.audits.decoders import PLANTED_SHRINK_BUDGET
from specaudit.checks.diagnosis import diagnose
from specaudit.checks.registry import CHECK_ORDER, SIGNATURES
from specaudit.contracts.builtins import MODELS
from specaudit.contracts.case import Case
from specaudit.reference.mutants import CATALOG, BugInfo
from specaudit.running.runner import run_case
from specaudit.search.driver import search
from specaudit.search.strategies import pattern_from_rounds

MAX_EXAMPLES = 200


class NotCaught(AssertionError):
    """No check reports the planted bug within the example budget: a harness false negative."""


class ShrunkTooBig(AssertionError):
    """The bug is caught, but the minimal case has more rows than the bug needs."""


@pytest.fixture(autouse=True, scope="module")
def one_thread() -> Iterator[None]:
    """Tiny exact models gain nothing from intra-op threads; on two shared cores they cost ~1.5x."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CATALOG))
def test_mutant_is_caught_with_a_small_case(name: str) -> None:
    """The search finds a failing case, its first failing check is the one the catalog names,
    and it shrinks to one row (bugs visible at batch size 1), two (bugs that need a batch) or the
    rows its BugInfo says it needs."""
    bug: BugInfo = CATALOG[name].bug
    spec = f"specaudit.reference.mutants:{name}"
    shrink = PLANTED_SHRINK_BUDGET  # the audit's: what it shrinks each planted bug with must be enough
    result = search(
        spec, bug.models[0], max_examples=MAX_EXAMPLES, seed=0, shrink_budget=shrink, minimize_budget=shrink
    )
    if result.minimal is None:
        raise NotCaught(f"{name} ({bug.bug_class}): no check failed in {result.examples} examples")
    case = result.minimal
    diagnosis = diagnose(run_case(spec, case))
    print(f"{name}: found after {result.examples} examples, minimal case of {case.batch_size} row(s): {case!r}")
    rows = bug.min_rows or (1 if bug.visible_at_batch_1 and not bug.needs_padding else 2)
    if case.batch_size > rows:
        raise ShrunkTooBig(f"{name}: minimal case has {case.batch_size} rows, but should have at most {rows}")
    if not bug.visible_at_batch_1:
        assert case.batch_size == rows, f"{name}: fails at batch size {case.batch_size}, but the catalog says {rows}"
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
        assert bug.models and set(bug.models) <= set(MODELS), f"{name}: searched on {bug.models}, not built-in models"
        assert bug.min_rows == 0 or (bug.min_rows > 2 and not bug.visible_at_batch_1), f"{name}: {bug.min_rows} rows"


@pytest.mark.slow
@pytest.mark.parametrize("spec", ["specaudit.reference.eqspec:EqSpec"])
def test_reference_passes_the_same_search(spec: str) -> None:
    """EQSPEC fails no check in 50 examples of the search that catches every planted bug."""
    result = search(spec, "transparent", max_examples=50, seed=0)
    assert result.minimal is None, repr(result.minimal)


def scheduled_case(
    rows: int, prompt_len: int, max_new: int, k: int, rounds: tuple[int, ...], model: str = "transparent", **kw: str
) -> Case:
    """`rows` distinct prompts of `prompt_len` tokens, each accepting `rounds` drafts per round (cycled)."""
    prompts = tuple(tuple((7 * r + 3 * i + 1) % 128 for i in range(prompt_len)) for r in range(rows))
    accept = tuple(pattern_from_rounds(True, rounds, max_new + k + 2) for _ in prompts)
    return Case(prompts, accept, k, max_new, None, 5, 0, model, **kw)


RANGE_EDGES = {
    # name: (a case just inside the old generated space, the same just past its edge)
    "row_buffer_of_16": (scheduled_case(16, 4, 8, 3, (1, 2)), scheduled_case(17, 4, 8, 3, (1, 2))),
    "positions_wrap_at_256": (scheduled_case(1, 230, 16, 3, (1,)), scheduled_case(1, 250, 16, 3, (1,))),
    "positions_in_model_dtype": (
        scheduled_case(1, 300, 8, 3, (1,), "llama", dtype="float32"),
        scheduled_case(1, 250, 12, 3, (1,), "llama", dtype="bfloat16"),
    ),
    "matches_after_rejection_accepted": (
        scheduled_case(2, 10, 16, 4, (1,)),  # scripted: a draft after a rejection matches 1 time in 128
        scheduled_case(2, 10, 16, 4, (1,), "gpt2", draft="tiny"),
    ),
    "bonus_window_of_three": (scheduled_case(1, 8, 16, 4, (2, 4)), scheduled_case(1, 8, 16, 4, (3,))),
}


@pytest.mark.parametrize("name", list(RANGE_EDGES))
def test_new_range_bug_passes_inside_the_old_space(name: str) -> None:
    """Each bug the wider space was made for passes a case inside the old limits (16 rows, positions
    below 256, float32, the scripted draft on the exact model, at most 2 accepted drafts before a
    rejection) and fails a case just past them, as its BugInfo says."""
    inside, past = RANGE_EDGES[name]
    spec = f"specaudit.reference.mutants:{name}"
    assert diagnose(run_case(spec, inside)).passed, f"{name} fails inside the old space on {inside!r}"
    diagnosis = diagnose(run_case(spec, past))
    bug: BugInfo = CATALOG[name].bug
    assert (diagnosis.first_check, diagnosis.signature) == (bug.first_check, bug.signature), (
        f"{name}: got {diagnosis.first_check}/{diagnosis.signature} just past the old space, "
        f"but should be {bug.first_check}/{bug.signature}\n{diagnosis.render()}"
    )
