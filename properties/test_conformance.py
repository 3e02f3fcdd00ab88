"""The conformance suite: one property per test, run for every decoder under test
(`--decoder module:attr`, default: the reference decoders) on every built-in model."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from specaudit.checks import check_contract, check_equivalence, check_i1, check_i2, check_token_preservation
from specaudit.reproducer import remember_failure
from specaudit.runner import Run, cached_run
from specaudit.strategies import cases
from specaudit.violation import Violation, explain

pytestmark = pytest.mark.specaudit


def run_drawn(specaudit_decoder: str, specaudit_model: str, data: st.DataObject) -> Run:
    return cached_run(specaudit_decoder, data.draw(cases(specaudit_model), label="case"))


def assert_holds(run: Run, violations: list[Violation]) -> None:
    violations = check_contract(run) or violations
    if violations:
        remember_failure(run, violations)
    assert not violations, explain(run, violations)


@given(data=st.data())
def test_i1_rectangular_alignment(specaudit_decoder: str, specaudit_model: str, data: st.DataObject) -> None:
    """Every target call sees one rectangular batch: mask [B, P + T], positions [B, T], no empty row."""
    run = run_drawn(specaudit_decoder, specaudit_model, data)
    assert_holds(run, check_i1(run))


@given(data=st.data())
def test_i2_position_kv_correspondence(specaudit_decoder: str, specaudit_model: str, data: st.DataObject) -> None:
    """Every row of every target call attends exactly its own tokens, at positions 0, 1, 2, ..."""
    run = run_drawn(specaudit_decoder, specaudit_model, data)
    assert_holds(run, check_i2(run))


@given(data=st.data())
def test_output_equivalence(specaudit_decoder: str, specaudit_model: str, data: st.DataObject) -> None:
    """Every row equals the batch-size-1 greedy oracle: same tokens, same length, same stop."""
    run = run_drawn(specaudit_decoder, specaudit_model, data)
    assert_holds(run, check_equivalence(run))


@given(data=st.data())
def test_token_preservation(specaudit_decoder: str, specaudit_model: str, data: st.DataObject) -> None:
    """Each round keeps exactly the drafts the schedule allows: none thrown away, none extra."""
    run = run_drawn(specaudit_decoder, specaudit_model, data)
    assert_holds(run, check_token_preservation(run))
