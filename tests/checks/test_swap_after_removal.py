"""Negative control for row binding (issue 15, point 1): a decoder that swaps two remaining rows'
K/V after a row leaves the batch must fail I2, on a tiny real model and on the transparent one.

A swap is only visible once a swapped row attends a token it computed itself: until then its
calls are exactly those of a correct decoder that reordered its rows (allowed), and the
decoder's outputs may even agree with the oracle. So each case keeps both rows running for at
least two target calls after the swap. With one-token prompts and no EOS:

- gpt2, tiny draft, K = 1, 6 new tokens: request 0 finishes after 3 rounds; the two rows left
  differ in pending token and length (their K/V no longer fit their masks). With 3 new tokens
  both rows are alike and finish in the call after the swap: no check can see that swap, but
  the correct decoders must still pass (a binder reading inputs only bound those alike rows
  the wrong way round and failed them on I2).
- gpt2 and transparent, scripted draft: request 0 accepts every draft and leaves first; requests
  1 and 2 reject every draft, and their continuations agree at the index where the swap happens
  (the same pending token at the same position: alike by their inputs), then differ. Only the
  past's K/V (or, on the transparent model, the past's tokens) tell the rows apart.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from specaudit.checks import check_i2
from specaudit.checks.registry import all_violations
from specaudit.contracts.case import Case
from specaudit.running.runner import Run, run_case
from tests.decoders.swap_after_removal import SwapAfterRemoval

pytestmark = pytest.mark.usefixtures("one_thread")

SWAP = "tests.decoders.swap_after_removal:SwapAfterRemoval"
REFERENCES = (
    "specaudit.reference.eqspec:EqSpec",
    "specaudit.reference.exspec:ExSpec",
    "specaudit.reference.lazy:LazySpec",
)


def scripted(prompts: tuple[tuple[int, ...], ...], k: int, max_new: int, model: str) -> Case:
    """Row 0 accepts every draft, the others none: row 0 leaves while the others run in step."""
    width = max_new + k + 2
    accept = ("1" * width,) + ("0" * width,) * (len(prompts) - 1)
    return Case(prompts, accept, k, max_new, None, 0, 0, model, "scripted", "float64")


# name: (case, whether the swapped rows look alike by their inputs)
CASES = {
    "gpt2-tiny-draft": (Case(((0,), (56,), (81,)), ("1" * 9,) * 3, 1, 6, None, 0, 0, "gpt2", "tiny", "float64"), False),
    "gpt2-alike-rows": (scripted(((0,), (103,), (115,)), 2, 4, "gpt2"), True),
    "transparent-alike-rows": (scripted(((0,), (102,), (126,)), 1, 5, "transparent"), True),
}
CONTROLS = {
    **{name: case for name, (case, _) in CASES.items()},
    "gpt2-tiny-draft-3-new-tokens": replace(CASES["gpt2-tiny-draft"][0], max_new_tokens=3),
}


def swap_run(case: Case) -> Run:
    run = run_case(SWAP, case, factory=SwapAfterRemoval)
    assert run.outputs is not None, f"{SWAP} broke the contract on {case}: {run.error}"
    return run


@pytest.mark.parametrize("name", list(CASES))
def test_swapped_kv_after_removal_fails_i2(name: str) -> None:
    """The swap happens (alike by inputs where the case says so) and I2 reports it."""
    case, alike = CASES[name]
    run = swap_run(case)
    assert run.instance.swaps, f"{name}: no row left the batch before another two: the case no longer swaps"
    assert run.instance.swaps[0] == alike, (
        f"{name}: swapped rows alike by their inputs is {run.instance.swaps[0]}, the case expects {alike}"
    )
    assert check_i2(run), f"{name}: I2 reports nothing for rows whose K/V were swapped after a removal, on {case}"


@pytest.mark.parametrize("name", list(CONTROLS))
def test_reference_decoders_pass_the_swap_cases(name: str) -> None:
    """Control: EqSpec, ExSpec and LazySpec have no violation of any check on the same cases."""
    case = CONTROLS[name]
    for spec in REFERENCES:
        found = [f"{v.check} {v.rule} call {v.call} row {v.row}" for v in all_violations(run_case(spec, case))]
        assert not found, f"{spec} on {name}: {found}, should be none"
