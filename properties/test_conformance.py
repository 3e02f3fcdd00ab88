"""The conformance suite: one property per check of the registry (`specaudit.checks.registry`), run
for every decoder under test (`--decoder module:attr`, default: the reference decoders) on
every built-in model. Each property states its check's sentence and calls that check by name;
the decoder contract is part of every property. A failing example is noted on the property's own
pytest item (`request.node`), where the plugin finds the shrunk one to write and to xfail."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import event, given
from hypothesis import strategies as st

from specaudit.artifacts.reproducer import remember_failure
from specaudit.checks.registry import NOT_APPLICABLE, check_named, judge
from specaudit.contracts.violation import explain
from specaudit.running.runner import Run, cached_run
from specaudit.search.strategies import cases

pytestmark = pytest.mark.specaudit


def conformance(name: str) -> Callable[[Any], Any]:
    """Mark a property as the one for registry check `name`; its docstring is the check's statement."""
    check = check_named(name)

    def mark(test: Any) -> Any:
        test.specaudit_check = check.name
        test.__doc__ = check.statement[0].upper() + check.statement[1:] + "."
        return test

    return mark


def run_drawn(specaudit_decoder: str, specaudit_model: str, data: st.DataObject) -> Run:
    return cached_run(specaudit_decoder, data.draw(cases(specaudit_model), label="case"))


def assert_check(name: str, run: Run, request: pytest.FixtureRequest) -> None:
    """The contract, then check `name`: a violation fails (noted on the test's item for the
    plugin); a check the decoder cannot be judged by skips the test, one this case does not
    allow is noted as a Hypothesis event."""
    outcome = judge("contract", run)
    if not outcome.violations:
        outcome = judge(name, run)
    if outcome.status == NOT_APPLICABLE:
        unmet = check_named(name).unmet(run)
        if unmet is not None and unmet.of_decoder:
            pytest.skip(f"{name} not applicable to {run.decoder}: {outcome.why}")
        event(f"{name} not applicable: {outcome.why}")
        return
    violations = list(outcome.violations)
    if violations:
        remember_failure(run, violations, request.node)
    assert not violations, explain(run, violations)


@conformance("contract")
@given(data=st.data())
def test_decoder_contract(
    specaudit_decoder: str, specaudit_model: str, data: st.DataObject, request: pytest.FixtureRequest
) -> None:
    assert_check("contract", run_drawn(specaudit_decoder, specaudit_model, data), request)


@conformance("I1")
@given(data=st.data())
def test_i1_rectangular_alignment(
    specaudit_decoder: str, specaudit_model: str, data: st.DataObject, request: pytest.FixtureRequest
) -> None:
    assert_check("I1", run_drawn(specaudit_decoder, specaudit_model, data), request)


@conformance("I2")
@given(data=st.data())
def test_i2_position_kv_correspondence(
    specaudit_decoder: str, specaudit_model: str, data: st.DataObject, request: pytest.FixtureRequest
) -> None:
    assert_check("I2", run_drawn(specaudit_decoder, specaudit_model, data), request)


@conformance("equivalence")
@given(data=st.data())
def test_output_equivalence(
    specaudit_decoder: str, specaudit_model: str, data: st.DataObject, request: pytest.FixtureRequest
) -> None:
    assert_check("equivalence", run_drawn(specaudit_decoder, specaudit_model, data), request)


@conformance("token-preservation")
@given(data=st.data())
def test_token_preservation(
    specaudit_decoder: str, specaudit_model: str, data: st.DataObject, request: pytest.FixtureRequest
) -> None:
    assert_check("token-preservation", run_drawn(specaudit_decoder, specaudit_model, data), request)


@conformance("liveness")
@given(data=st.data())
def test_liveness(
    specaudit_decoder: str, specaudit_model: str, data: st.DataObject, request: pytest.FixtureRequest
) -> None:
    assert_check("liveness", run_drawn(specaudit_decoder, specaudit_model, data), request)


@conformance("grouped-no-realignment")
@given(data=st.data())
def test_grouped_batches_need_no_realignment(
    specaudit_decoder: str, specaudit_model: str, data: st.DataObject, request: pytest.FixtureRequest
) -> None:
    assert_check("grouped-no-realignment", run_drawn(specaudit_decoder, specaudit_model, data), request)


@conformance("order-independence")
@given(data=st.data())
def test_order_independence(
    specaudit_decoder: str, specaudit_model: str, data: st.DataObject, request: pytest.FixtureRequest
) -> None:
    assert_check("order-independence", run_drawn(specaudit_decoder, specaudit_model, data), request)
