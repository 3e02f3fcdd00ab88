"""One draw per stream (properties/test_conformance.py): a property whose check passes on every
case of a stream another property of its decoder x model drew and passed on has its outcome
without drawing; where its check fails on a case of the stream, it draws (and shrinks) itself."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from specaudit.contracts.case import Case
from specaudit.properties import test_conformance as suite

EQSPEC = "specaudit.reference.eqspec:EqSpec"
MUTANT = "specaudit.reference.mutants:rejected_kv_attended"
CASES = (
    Case(((5,),), ((False,) * 6,), 1, 3, None, 0),
    Case(((0,), (3, 4)), ((True,) * 8, (False,) * 8), 2, 4, None, 0),
)
"""Two small transparent cases; the first shows the planted bug's I2 fault (tests/test_public_api.py)."""


def item(check: str, decoder: str, nodeid: str) -> Any:
    """The parts of a property's pytest item the stream functions read."""
    return SimpleNamespace(
        nodeid=nodeid,
        obj=SimpleNamespace(specaudit_check=check),
        callspec=SimpleNamespace(params={"specaudit_decoder": decoder, "specaudit_model": "transparent"}),
    )


@pytest.fixture
def streams(monkeypatch: pytest.MonkeyPatch) -> None:
    """The suite's session state, empty for this test and restored after it."""
    for name in ("_JUDGED", "_DRAWN", "_STREAMS"):
        monkeypatch.setattr(suite, name, {})


@pytest.mark.usefixtures("streams")
def test_a_property_passing_on_a_known_stream_needs_no_draw() -> None:
    """The contract property passed on its stream: I2 and equivalence pass on each case of it."""
    key = ("[eqspec-transparent]", 1, len(CASES))
    suite._DRAWN["contract"] = list(CASES)
    suite.stream_passed(item("contract", EQSPEC, "contract"), key)
    assert suite._STREAMS[key] == CASES and "contract" not in suite._DRAWN
    assert suite.passes_known_stream(item("I2", EQSPEC, "i2"), key)
    assert suite.passes_known_stream(item("equivalence", EQSPEC, "equivalence"), key)


@pytest.mark.usefixtures("streams")
def test_a_property_failing_on_the_stream_draws_itself() -> None:
    """The planted bug passes the contract on the stream but fails I2 on its first case: the I2
    property must draw (and fail, and shrink); with no stream known, every property draws."""
    key = ("[mutant-transparent]", 1, len(CASES))
    assert not suite.passes_known_stream(item("I2", MUTANT, "i2"), key)  # no stream yet
    suite._DRAWN["contract"] = list(CASES)
    suite.stream_passed(item("contract", MUTANT, "contract"), key)
    assert not suite.passes_known_stream(item("I2", MUTANT, "i2"), key)
    assert not suite.passes_known_stream(item("I2", MUTANT, "i2"), ("[mutant-transparent]", 2, len(CASES)))
