"""Row binding on a real (non-transparent) model: a row's past longer than a request's whole
sequence cannot be that request.

Guards the fix in `RowFollower.scores` (the `fits = m <= lengths` lines). A real model's past
slots are K/V, not tokens; before the binder read them against each request's batch-size-1
entries (`KVReader.past_prefixes`), it counted them as matching every request. A finished
request shorter than a row's past then looked "fresh" for that row (its whole sequence
matched), while the row's own request did not (its first input sat at a wrong position), so the
row was bound to the short request. First seen on SmolLM2-135M in bfloat16 with
`positions_in_model_dtype` and a 315-token prompt among short ones: the long row's first fault
was reported as the short request's K/V mismatch, I2 "kv-drift", instead of I2 "position-ids"
(signature position-id). Here the tiny Llama reproduces it with two rows.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from specaudit.checks.diagnosis import diagnose
from specaudit.checks.i2 import row_views
from specaudit.checks.observe import Observation
from specaudit.checks.rows import RowFollower, RowView
from specaudit.contracts.case import Case
from specaudit.running.runner import Run, run_case

pytestmark = pytest.mark.usefixtures("one_thread")

EQSPEC = "specaudit.reference.eqspec:EqSpec"
MUTANT = "specaudit.reference.mutants:positions_in_model_dtype"
K, MAX_NEW = 3, 9
LONG = tuple((3 * i + 1) % 128 for i in range(250))
SHORT = (7,)


def long_then_short_case() -> Case:
    """A 250-token prompt beside a 1-token one, tiny Llama in bfloat16.

    The long row rejects its first draft in 3 rounds (past 250 -> 253), then accepts all K = 3
    drafts, so its next round starts at past 257, which bfloat16 rounds to 256: its first input
    is at a wrong position and it is not "fresh" for its own request. The short row accepts
    every draft and is complete (1 + 9 tokens, shorter than 257) after 2 rounds.
    """
    width = MAX_NEW + K + 2
    accept = ("0000".ljust(width, "1"), "1" * width)
    return Case((LONG, SHORT), accept, K, MAX_NEW, None, 0, 0, "llama", dtype="bfloat16")


def sequences(run: Run) -> list[tuple[int, ...]]:
    """Per request, its prompt plus the decoder's output."""
    assert run.outputs is not None, f"{run.decoder} broke the contract: {run.error}"
    return [tuple(p) + tuple(o) for p, o in zip(run.case.prompts, run.outputs)]


def overlong(run: Run) -> list[RowView]:
    """Views whose attended past is longer than their request's whole sequence (impossible bindings)."""
    lengths = [len(s) for s in sequences(run)]
    return [v for v in row_views(run)[0] if v.past > lengths[v.request]]


def without_fits(self: RowFollower, obs: Observation) -> torch.Tensor:
    """`RowFollower.fits` as before the fix: every request may fill every row's past. [B, R]"""
    return torch.ones(obs.past.shape[0], len(self.state), dtype=torch.bool)


@pytest.fixture(scope="module")
def mutant_run() -> Iterator[Run]:
    yield run_case(MUTANT, long_then_short_case())


def test_long_row_stays_bound_to_its_request(mutant_run: Run) -> None:
    """No row is bound to a request shorter than its past, and every row past the short request's
    length is the long request's."""
    short_length = len(sequences(mutant_run)[1])
    views = row_views(mutant_run)[0]
    long_rows = [v for v in views if v.past > short_length]
    assert long_rows, f"no row's past passes the short request's {short_length} tokens: the case no longer tests this"
    wrong = [v for v in long_rows if v.request != 0]
    assert not wrong, f"rows past {short_length} entries bound to {[(v.call, v.row, v.request) for v in wrong]}, not 0"
    bad = overlong(mutant_run)
    found = [(v.call, v.row, v.request, v.past) for v in bad]
    assert not bad, f"(call, row, request, past) bound to a request shorter than the past: {found}, should be none"


def test_mutant_is_diagnosed_by_its_position_ids(mutant_run: Run) -> None:
    """The first fault is the long row's input at a wrong position, not a K/V mismatch of the short request."""
    diagnosis = diagnose(mutant_run)
    found = (diagnosis.first_check, diagnosis.signature, diagnosis.first and diagnosis.first.rule)
    assert found == ("I2", "position-id", "position-ids"), (
        f"got {found}, but should be ('I2', 'position-id', 'position-ids')\n{diagnosis.render()}"
    )
    liveness = dict(diagnosis.checks).get("liveness")
    assert liveness == "pass", f"liveness {liveness}, but should pass (a misbound row starves its request)"


def test_correct_decoder_passes_the_case() -> None:
    """Control: EqSpec passes the same case, so the faults above are the mutant's."""
    run = run_case(EQSPEC, long_then_short_case())
    diagnosis = diagnose(run)
    assert diagnosis.passed, diagnosis.render()
    assert not overlong(run), f"EqSpec rows bound past their request: {overlong(run)}"


def test_case_needs_the_fits_condition(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the `fits` lines and without reading the past's K/V for binding (either alone
    binds the long row right), the same case binds the long row to the short request and is
    misdiagnosed as kv-drift: the tests above fail if both are removed."""
    monkeypatch.setattr(RowFollower, "fits", without_fits)
    monkeypatch.setattr(RowFollower, "past_match", lambda self, call, obs: None)
    run = run_case(MUTANT, long_then_short_case())
    bad = overlong(run)
    assert [v.request for v in bad] == [1], f"expected one row misbound to request 1 without the fix, got {bad}"
    diagnosis = diagnose(run)
    assert diagnosis.signature == "kv-drift", f"got {diagnosis.signature} without the fix\n{diagnosis.render()}"
