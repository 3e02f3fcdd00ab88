"""The sampling property: a decoder that samples (`samples = True`) is lossless in distribution.

Run for every sampling decoder under test (`--decoder module:attr` naming one that samples;
default: the reference sampling designs). Hypothesis draws whole sampling cases
(`specaudit.search.sampling.sampling_cases`: settings, batch, pads, EOS, K, the draft's
disagreement, runs); each case's seeded runs are judged by every check of the sampling-decoder
subject, in the registry's order. A failing case shrinks to the fewest rows, prompts, tokens
and runs at which the verdict still rejects, at its stated false-alarm rate.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings

from specaudit.checks.registry import SAMPLER, check_named, evaluate
from specaudit.contracts.sampling import SamplingCase
from specaudit.contracts.violation import render
from specaudit.running.sampling import run_sampling_case
from specaudit.search.sampling import sampling_cases

pytestmark = pytest.mark.specaudit

SAMPLING_EXAMPLES = 6
"""Sampling cases per decoder (each is several seeded runs of a batch): about 10 s on one core; the audit draws more."""


@settings(max_examples=SAMPLING_EXAMPLES, deadline=None)
@given(scase=sampling_cases())
def test_lossless_in_distribution(sampling_decoder: str, scase: SamplingCase) -> None:
    sampled = run_sampling_case(sampling_decoder, scase)
    evaluation = evaluate(SAMPLER, sampled)
    assert evaluation.passed, f"decoder {sampling_decoder} on {scase!r}\n{render(evaluation.violations)}"


test_lossless_in_distribution.__doc__ = check_named("distribution").statement[0].upper() + (
    check_named("distribution").statement[1:] + "; every forward keeps the contract, I1 and I2, and rows are "
    "independent samples."
)
