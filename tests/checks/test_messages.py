"""Messages say one thing each (issue 38, point 7): a one-row kv-drift signed bonus does not glue the
batch explanation onto the batch-size-1 one; coverage of a verdict that observed no forward says so
instead of "B<=0, pos<=-1"; a per-call check that saw no forward reads n/a, not pass."""

from __future__ import annotations

import logging

import pytest

from specaudit.audits.transformers_cb import PAGED_LOGGER, quiet_paged_api
from specaudit.audits.verdict import run_statuses
from specaudit.checks.coverage import NO_CALL, Coverage
from specaudit.checks.diagnosis import diagnose
from specaudit.checks.registry import evaluate
from specaudit.contracts.case import Case
from specaudit.running.runner import run_case

pytestmark = pytest.mark.usefixtures("one_thread")


def test_a_one_row_drift_signed_bonus_gives_one_explanation() -> None:
    """`rejected_kv_attended` on one row: signed bonus, and the reason no longer says the mask or
    cache "does not fit the batch" (there is no batch)."""
    case = Case(((3, 4),), ("0101010",), 2, 5, None, 0)
    d = diagnose(run_case("specaudit.reference.mutants:rejected_kv_attended", case))
    assert d.case.batch_size == 1 and d.signature == "bonus", d.render()
    assert "does not fit the batch" not in d.reason and d.reason.startswith("wrong even at batch size 1"), d.reason


def test_coverage_without_an_observed_forward_says_so() -> None:
    """No batch size seen: the summary and the flag say no target call was observed, never B<=0 or pos<=-1."""
    nothing = Coverage(runs=3, requests=6)
    assert nothing.summary().startswith(NO_CALL) and "B<=0" not in nothing.summary(), nothing.summary()
    assert "pos<=-1" not in nothing.summary() and nothing.flags == [NO_CALL]
    seen = Coverage(runs=1, requests=2, batch_sizes=(2,), k_values=(1,), target_calls=3, rounds=2, highest_position=5)
    assert "B<=2" in seen.summary() and "pos<=5" in seen.summary() and NO_CALL not in seen.flags


def test_per_call_checks_read_na_on_a_run_without_target_calls() -> None:
    """I1 and I2 judged nothing when no target call was seen: n/a; with calls, pass."""
    evaluation = evaluate(run_case("specaudit.reference.eqspec:EqSpec", Case(((3, 4),), ("0101",), 1, 3, None, 0)))
    unseen = run_statuses(evaluation, lambda v: False, target_calls=0)
    assert (unseen["I1"], unseen["I2"], unseen["equivalence"]) == ("n/a", "n/a", "pass"), unseen
    seen = run_statuses(evaluation, lambda v: False, target_calls=4)
    assert (seen["I1"], seen["I2"]) == ("pass", "pass"), seen


def test_transformers_paged_api_logs_are_quiet_during_a_run() -> None:
    """transformers' continuous-batching loggers below ERROR are off inside a run, back after."""
    logger = logging.getLogger(PAGED_LOGGER + ".continuous_api")
    before = logger.isEnabledFor(logging.WARNING)
    with quiet_paged_api():
        assert not logger.isEnabledFor(logging.WARNING) and logger.isEnabledFor(logging.ERROR)
    assert logger.isEnabledFor(logging.WARNING) == before


def test_exact_match_states_the_cases_it_was_measured_on() -> None:
    """Issue 38, point 6: when some cases raised, the cases column reads returned/run, so "exact 1.00"
    says what it is over; when all returned, the plain count."""
    from specaudit.audits.decoders import DecoderVerdict, format_table

    v = DecoderVerdict("mypkg.mod:Mine", "transparent", examples=3, measured=2, exact_rows=4, rows=4)
    row = format_table([v]).splitlines()[2]
    assert " 2/3 " in row and " 1.00 " in row, row
    assert v.to_json()["measured_cases"] == 2 and v.to_json()["rows"] == 4
    v.measured = 3
    assert " 2/3 " not in format_table([v]).splitlines()[2]


def test_a_prompts_own_token_equal_to_the_pad_id_is_not_called_a_pad() -> None:
    """ "(the pad id)" labels a pad; a slot holding the request's own prompt token that equals the pad id
    is named as that, so the message does not send the user after padding."""
    from specaudit.checks.i2 import violation
    from specaudit.checks.rows import Fault

    found = {"found_token": 0, "found_position": 0, "expected_token": 7, "expected_position": 1}
    fault = Fault("attends-wrong-slot", 2, 0, 0, 1, **found)
    own = violation(fault, pad=0, prompts=((0, 7),))
    assert "(the pad id)" not in own.found and "prompt also holds" in own.found, own.found
    padded = violation(fault, pad=0, prompts=((5, 7),))
    assert "(the pad id)" in padded.found, padded.found
    shifted = violation(fault, pad=0, prompts=((5, 0),))  # the prompt's pad-id token, found at another position
    assert "(the pad id)" not in shifted.found and "prompt token at position 1" in shifted.found, shifted.found
