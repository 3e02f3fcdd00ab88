"""A hang is reported fast (issue 27, point 8): once a decoder has hung, the runner waits a short
idle limit on it, the search shrinks the hang waiting out few more runs, and the suite's shared
runs stop waiting on it. Idle limits are made small here so each test takes seconds."""

from __future__ import annotations

import time
import warnings
from collections.abc import Iterator

import pytest
from hypothesis.errors import HypothesisDeprecationWarning, UnsatisfiedAssumption

from specaudit.audits.decoders import audit_model
from specaudit.contracts.case import Case
from specaudit.running import runner

pytestmark = pytest.mark.usefixtures("one_thread")

ALWAYS = "tests.decoders.hangs:HangsAlways"
THREE_ROWS = "tests.decoders.hangs:HangsOnThreeRows"
IDLE_S, SHORT_S = 1.5, 0.3
WAITS = 1 + 2 * 4 + 2 + 2
"""Hangs an audit may wait out: the first, 4 in each shrinker (`driver.HANG_WAITS`), 2 in the
rounds after (`driver.HANG_RERUNS`), 2 replays. Before: 28 for HangsAlways, each of its cases."""


@pytest.fixture(autouse=True)
def small_limits(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """An idle limit of IDLE_S, a short one of SHORT_S, and no hang remembered from another test."""
    monkeypatch.setattr(runner, "IDLE_FLOOR_S", IDLE_S)
    monkeypatch.setattr(runner, "HANG_IDLE_FLOOR_S", SHORT_S)
    monkeypatch.setattr(runner, "_HANGS", {})
    yield


def one_row(rows: int = 1) -> Case:
    return Case(tuple((5 + r,) for r in range(rows)), ((False,) * 5,) * rows, 1, 2, None, 0)


def test_after_a_hang_the_decoder_gets_the_short_idle_limit() -> None:
    """The first hang waits the idle limit; later runs of that decoder wait the short one; another
    decoder, an explicit limit and a run without hooks keep theirs."""
    case = one_row()
    start = time.monotonic()
    first = runner.run_case(ALWAYS, case)
    assert runner.is_hang(first) and time.monotonic() - start >= IDLE_S
    assert runner.hang_limit(ALWAYS, case) == SHORT_S
    start = time.monotonic()
    again = runner.run_case(ALWAYS, one_row(2))
    assert runner.is_hang(again) and time.monotonic() - start < IDLE_S, first.error
    assert runner.hangs(ALWAYS) == 2
    assert runner.hang_limit(THREE_ROWS, case) == IDLE_S


def test_a_decoder_slow_between_forwards_keeps_a_longer_short_limit() -> None:
    """The short limit is at least HANG_GAP_MULTIPLE x the longest gap seen in a run that returned."""
    runner.note_run(ALWAYS, None, longest_gap=0.25)
    runner.note_run(ALWAYS, runner.run_case(ALWAYS, one_row()).error, longest_gap=0.0)
    assert runner.hang_limit(ALWAYS, one_row()) == pytest.approx(max(SHORT_S, runner.HANG_GAP_MULTIPLE * 0.25))


def test_the_suite_stops_running_a_decoder_that_keeps_hanging() -> None:
    """After HANG_RUNS hangs, a case not run yet is rejected (not judged) instead of waited on; a
    case already run is still served from the cache."""
    seen = runner.cached_run(ALWAYS, one_row())
    runner._HANGS[ALWAYS].hangs = runner.HANG_RUNS
    assert runner.cached_run(ALWAYS, one_row()) is seen
    with pytest.raises(UnsatisfiedAssumption), warnings.catch_warnings():
        warnings.simplefilter("ignore", HypothesisDeprecationWarning)  # `reject` outside a property
        runner.cached_run(ALWAYS, one_row(2))


@pytest.mark.parametrize("spec", [ALWAYS, THREE_ROWS])
def test_a_hanging_decoder_is_audited_in_a_few_idle_limits(spec: str) -> None:
    """The audit of a decoder that hangs reports 'generate-returns' after waiting out one idle
    limit and a bounded number of short ones (before: each of up to 300 shrink runs waited out
    the whole idle limit); a decoder hanging on three rows shrinks to a case of three rows."""
    start = time.monotonic()
    verdict = audit_model(spec, "transparent", 25, 0)
    seconds = time.monotonic() - start
    d = verdict.diagnosis
    assert d is not None and d.first is not None and d.first.rule == "generate-returns", verdict
    assert runner.hangs(spec) <= WAITS, runner.hangs(spec)
    assert seconds < IDLE_S + WAITS * (SHORT_S + 0.5) + 30, seconds
    if spec == THREE_ROWS:
        assert d.case.batch_size == 3, d.case
