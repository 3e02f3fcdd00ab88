"""Scheduler properties, run for every decoder under test: liveness, grouped batches need no
realignment, and results do not depend on the order of requests in the pool."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from specaudit.checks import check_contract
from specaudit.properties.test_conformance import assert_holds
from specaudit.runner import cached_run
from specaudit.scheduling import check_grouped_no_realignment, check_liveness, check_order_independence, permuted
from specaudit.strategies import cases

pytestmark = pytest.mark.specaudit


@given(data=st.data())
def test_liveness(specaudit_decoder: str, specaudit_model: str, data: st.DataObject) -> None:
    """Every request finishes, and none waits more target calls than the decoder's max_wait_calls."""
    run = cached_run(specaudit_decoder, data.draw(cases(specaudit_model), label="case"))
    assert_holds(run, check_liveness(run, getattr(run.instance, "max_wait_calls", None)))


@given(data=st.data())
def test_grouped_batches_need_no_realignment(specaudit_decoder: str, specaudit_model: str, data: st.DataObject) -> None:
    """Between two grouped (pad-free) target calls of a request, its cache slots do not move."""
    run = cached_run(specaudit_decoder, data.draw(cases(specaudit_model), label="case"))
    assert_holds(run, check_grouped_no_realignment(run))


@given(data=st.data())
def test_order_independence(specaudit_decoder: str, specaudit_model: str, data: st.DataObject) -> None:
    """Permuting the requests in the pool permutes the outputs and changes nothing else."""
    case = data.draw(cases(specaudit_model), label="case")
    order = data.draw(st.permutations(range(case.batch_size)), label="order")
    run, other = cached_run(specaudit_decoder, case), cached_run(specaudit_decoder, permuted(case, order))
    assert_holds(other, check_contract(run) or check_order_independence(run, other, order))
