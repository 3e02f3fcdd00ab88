"""Numerics: tie-aware equivalence, float32/bfloat16 runs of correct decoders, and diagnosis."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specaudit.checks import check_equivalence, equivalence
from specaudit.checks.diagnosis import all_violations, diagnose
from specaudit.contracts.case import Case
from specaudit.fixtures.pairs import target_model
from specaudit.models.compat import call_model
from specaudit.reference.eqspec import BatchState, EqSpec
from specaudit.reference.oracle import OracleResult, greedy_oracle
from specaudit.running.runner import Run, run_case
from specaudit.search.strategies import cases

PATTERN = tuple([True, False] * 20)


def run_with_forced_tie(flip_at: int, margin: float) -> Run:
    """A float32 run whose row 0 takes another token at `flip_at` and then follows the greedy
    continuation of its own prefix; the oracle's margin there is set to `margin`."""
    prompt = (5, 9, 2)
    case = Case((prompt,), (PATTERN,), 2, 6, None, 0, dtype="float32")
    run = run_case("specaudit.reference.eqspec:EqSpec", case)
    oracle = run.oracle[0]
    flipped = oracle.tokens[:flip_at] + ((oracle.tokens[flip_at] + 1) % 128,)
    rest = greedy_oracle(run.target, prompt + flipped, max_new_tokens=6 - flip_at - 1, eos_token_id=None)
    margins = tuple(margin if i == flip_at else m for i, m in enumerate(oracle.margins))
    run.oracle[0] = OracleResult(oracle.tokens, oracle.stop, margins)
    assert run.outputs is not None
    run.outputs[0] = list(flipped + rest.tokens)
    return run


def test_a_divergence_at_a_tie_resyncs_and_is_equivalent() -> None:
    """At a step whose margin is within tolerance the comparison follows the decoder's token."""
    run = run_with_forced_tie(flip_at=2, margin=0.0)
    (row,) = equivalence(run).rows
    assert row.ties == (2,) and row.equivalent and not row.exact
    assert row.verdict == "equivalent modulo 1 tie(s)"
    assert check_equivalence(run) == []


def test_a_divergence_beyond_tolerance_is_a_bug() -> None:
    """Negative control: the same flip at a clear margin is a divergence, not a tie."""
    run = run_with_forced_tie(flip_at=2, margin=0.5)
    (row,) = equivalence(run).rows
    assert row.ties == () and row.first_divergence == 2 and row.verdict == "diverged"
    assert [v.rule for v in check_equivalence(run)] == ["first-divergence"]


def test_tie_then_real_divergence_is_reported_against_the_resynced_oracle() -> None:
    """After a tie, a later wrong token is compared with the oracle re-synced onto the decoder's path."""
    run = run_with_forced_tie(flip_at=1, margin=0.0)
    assert run.outputs is not None
    run.outputs[0][4] = (run.outputs[0][4] + 7) % 128
    (row,) = equivalence(run).rows
    assert row.ties == (1,) and row.first_divergence == 4
    (violation,) = check_equivalence(run)
    assert "after 1 numerical tie(s) at [1]" in violation.found
    assert violation.expected.startswith(f"token {row.reference[4]} at index 4")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize(
    "decoder",
    ["specaudit.reference.eqspec:EqSpec", "specaudit.reference.exspec:ExSpec", "specaudit.reference.lazy:LazySpec"],
)
def test_correct_decoders_have_no_failures_in_low_precision(decoder: str, dtype: str) -> None:
    """Correct decoders pass every check on the tiny architectures in float32 and bfloat16, ties allowed."""

    @settings(max_examples=4, deadline=None, derandomize=True, database=None)
    @given(data=st.data())
    def prop(data: st.DataObject) -> None:
        model = data.draw(st.sampled_from(["llama", "qwen3", "gpt2"]), label="model")
        case = dataclasses.replace(data.draw(cases(model), label="case"), dtype=dtype)
        run = run_case(decoder, case)
        violations = all_violations(run)
        assert not violations, [v.render() for v in violations[:3]]

    prop()


class OffByOnePositions(EqSpec):
    """Verify call fed at positions shifted by one (position off by one in the verify call)."""

    def batch_verify(self, target: torch.nn.Module, state: BatchState, drafts: torch.Tensor) -> torch.Tensor:
        block = torch.cat([state.pending[:, None], drafts], dim=1)
        positions = state.lengths[:, None] + 1 + torch.arange(block.shape[1])
        mask = torch.cat([state.mask, state.mask.new_ones(block.shape)], dim=1)
        logits, state.target_cache = call_model(target, block, mask, positions, state.target_cache)
        return logits.argmax(-1)


@pytest.mark.parametrize(
    ("decoder", "signature", "first_check"),
    [
        ("specaudit.reference.mutants:bonus_from_draft", "bonus", "equivalence"),
        ("specaudit.reference.mutants:rejected_kv_attended", "kv-drift", "I2"),
        ("specaudit.reference.mutants:draft_cache_not_rolled_back", "output-equivalent", "token-preservation"),
        ("tests.numerics.test_numerics:OffByOnePositions", "position-id", "I2"),
    ],
)
def test_diagnosis_names_the_signature(decoder: str, signature: str, first_check: str) -> None:
    """Each failure class gets the paper's signature and its first violated check."""
    prompts = ((3, 1, 4), (1, 5, 9, 2, 6))
    case = Case(prompts, (PATTERN, tuple([True] * 40)), 3, 8, None, 0)
    factory = OffByOnePositions if decoder.startswith("tests.") else None
    diagnosis = diagnose(run_case(decoder, case, factory=factory))
    assert not diagnosis.passed
    assert (diagnosis.first_check, diagnosis.signature) == (first_check, signature), diagnosis.render()
    document = diagnosis.to_json()
    assert document["signature"] == signature and document["case"]["format"] == "specaudit-case"


def test_float32_oracle_matches_float64_on_clear_margins() -> None:
    """The low-precision fixtures are the same model: greedy tokens agree where margins are clear."""
    prompt = (5, 6, 7, 8)
    high = greedy_oracle(target_model("llama", "float64"), prompt, max_new_tokens=10, eos_token_id=None)
    low = greedy_oracle(target_model("llama", "float32"), prompt, max_new_tokens=10, eos_token_id=None)
    clear = next((i for i, m in enumerate(high.margins) if m < 1e-3), len(high.tokens))
    assert clear >= 5, f"got {clear} steps with a clear margin, but should be at least 5 to compare anything"
    assert low.tokens[:clear] == high.tokens[:clear]
