"""The engine property: a continuous-batching engine (`--engine module:attr`, default the
reference engines) matches the oracle after every step of a Hypothesis state machine whose
rules add requests at any step, step the engine and abort requests (`specaudit.search.engine_machine`),
on every built-in model of `--models` (the transparent one, and the tiny real ones in float64,
whose past slots I2 reads as K/V)."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import settings
from hypothesis.stateful import run_state_machine_as_test

from specaudit.commands.pytest_notes import remember_engine_failure
from specaudit.contracts.engine import EngineLoadError, load_engine
from specaudit.search.engine_machine import event_shares, machine_failure, machine_for, machine_settings

pytestmark = pytest.mark.specaudit

ENGINE_STEPS = 12
"""Rules per generated run (the drain at the end adds the steps it takes to finish)."""


def test_engine_matches_oracle_at_every_step(
    engine_spec: str, specaudit_model: str, record_property: Any, request: pytest.FixtureRequest
) -> None:
    """After every step, every target forward keeps I1 and I2 with rows bound to live requests, every
    request's tokens are a prefix of its oracle output (equal once finished), aborted requests stay
    silent, and no request waits longer than the engine's declared max_wait_steps."""
    try:
        load_engine(engine_spec)
    except EngineLoadError as exc:
        pytest.fail(str(exc), pytrace=False)
    machine = machine_for(engine_spec, specaudit_model)
    try:
        run_state_machine_as_test(machine, settings=machine_settings(settings.default.max_examples, ENGINE_STEPS))
    except Exception as exc:  # what Hypothesis raises last is the shrunk rule sequence's failure
        failure = machine_failure(exc, engine_spec, specaudit_model)
        if failure is not None:  # the plugin writes it to --specaudit-out and applies --specaudit-xfails
            remember_engine_failure(failure.reproducer.to_json(), failure.violations, request.node, failure.diagnosis)
        raise
    finally:
        shares = event_shares(machine)
        for what, share in shares.items():
            record_property(what, f"{share:.2f}")
        print(
            f"{engine_spec} on {specaudit_model}: {machine.tally['runs']} runs; "
            + ", ".join(f"{w}: {s:.0%}" for w, s in shares.items())
        )
