"""The cause first (issue 38, point 7): a run's violations are shown with those whose effect reaches
a committed token first, and the first violated check is the first of those. A target mask one
column too long, which the model trims to the very mask it should have had, changes no logit: it
is still reported (I1 fails), after the cause, marked as changing no committed token."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from specaudit.checks.diagnosis import SILENT, diagnose, first_cause, reaches_output
from specaudit.contracts.case import Case
from specaudit.reference.eqspec import BatchState, EqSpec
from specaudit.reference.planted.acceptance import BonusFromDraft
from specaudit.reference.planted.kv_cache import RejectedKvAttended
from specaudit.running.runner import Run, run_case

pytestmark = pytest.mark.usefixtures("one_thread")

RAGGED = Case(((3, 4, 5), (6, 7)), ("0101010", "1100"), 2, 6, None, 0)


def one_column_longer(mask: torch.Tensor) -> torch.Tensor:
    """[B, S] -> [B, S + 1]: the first column again in front. The built-in models keep a wrong-width
    mask's last S columns (`fixtures.transparent.fit_mask`), so nothing attended changes."""
    return torch.cat([mask[:, :1], mask], dim=1)


class LongMask(EqSpec):
    """A correct decoder but for a target mask one column longer than the keys."""

    name = "long_mask"

    def call_mask(self, state: BatchState, mask: torch.Tensor, role: str) -> torch.Tensor | None:
        return one_column_longer(mask) if role == "target" else mask


class LongMaskBonusFromDraft(BonusFromDraft):
    """The over-long mask, and the bonus taken from the draft: only the second changes the output."""

    name = "long_mask_bonus_from_draft"
    call_mask = LongMask.call_mask


class LongMaskRejectedKv(RejectedKvAttended):
    """The over-long mask on the calls where rejected drafts' KV is attended too."""

    name = "long_mask_rejected_kv"
    call_mask = LongMask.call_mask


def run_of(decoder: type, case: Case = RAGGED, model: str = "transparent") -> Run:
    return run_case(decoder.name, replace(case, model=model), factory=decoder)


def masks(violations: tuple) -> list:
    return [v for v in violations if (v.check, v.rule) == ("I1", "mask-shape")]


def test_the_cause_is_shown_before_a_mask_that_changes_no_logit() -> None:
    """The issue's run: I1 fails on every verification's mask, the bonus from the draft changes the
    output. The divergence is the first violation, its signature the bonus's; the masks follow, each
    saying it changes no committed token."""
    d = diagnose(run_of(LongMaskBonusFromDraft))
    assert dict(d.checks)["I1"] == "fail" and dict(d.checks)["equivalence"] == "fail", d.render()
    assert (d.first_check, d.first.rule, d.signature) == ("equivalence", "first-divergence", "bonus"), d.render()
    assert d.violations[0] is d.first and len(masks(d.violations)) >= 3, d.render()
    assert d.silent == tuple(masks(d.violations)) and d.violations[-len(d.silent) :] == d.silent
    shown = [line.strip() for line in d.render().splitlines()]
    at = next(i for i, line in enumerate(shown) if "first violated check" in line)
    assert "[equivalence: first-divergence]" in shown[at + 1], d.render()
    assert all(line.endswith(f"({SILENT})") for line in shown if line.startswith("[I1: mask-shape]")), d.render()
    assert not any(SILENT in line for line in shown if line.startswith("[equivalence")), d.render()
    silent = d.to_json()["changes_no_committed_token"]
    assert [d.violations[i] for i in silent] == list(d.silent)


def test_the_shrinkers_class_is_the_diagnosis_class() -> None:
    """`first_cause`, what a shrinker keeping the class reads, names the diagnosis's first violation
    and signature; through I1 alone, nothing reaches, so it is the registry's first."""
    run = run_of(LongMaskBonusFromDraft)
    d = diagnose(run)
    found = first_cause(run)
    assert found is not None and found[0].violations[0] == d.first and found[1] == (d.signature, d.reason)
    through_i1 = first_cause(run, through="I1")
    assert through_i1 is not None and through_i1[0].violations[0].rule == "mask-shape"


def test_a_long_mask_alone_still_fails_and_says_it_changes_nothing() -> None:
    """Nothing else broken: the output is exact, I1 still fails the run (first: I1), every mask marked."""
    d = diagnose(run_of(LongMask))
    assert not d.passed and d.verdict == "violated" and d.first_check == "I1", d.render()
    assert d.silent and d.silent == d.violations, d.render()


def test_a_mask_at_a_call_whose_rows_attend_wrongly_is_not_cleared() -> None:
    """Where I2 finds a row of the call attending wrongly, the mask may be why: it stays among the
    violations that reach the output (first, in the registry's order); only the calls I2 clears are marked."""
    run = run_of(LongMaskRejectedKv)
    d = diagnose(run)
    faulty = {v.call for v in d.violations if v.check == "I2"}
    assert faulty and d.first_check == "I1" and d.first.call in faulty, d.render()
    for v in masks(d.violations):
        assert reaches_output(run, v) == (v.call in faulty), (v.render(), faulty)


def test_a_real_models_mask_is_never_cleared() -> None:
    """A real model's mask is applied by transformers, not as the row views read it: no mask-shape
    on the tiny Llama is called silent, whatever I2 says."""
    run = run_of(LongMask, Case(((3, 4), (5,)), ("01", "1"), 1, 2, None, 0), model="llama")
    found = masks(diagnose(run).violations)
    assert found and all(reaches_output(run, v) for v in found)
