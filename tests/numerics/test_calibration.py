"""The measured noise floor: zero-ish where arithmetic is exact, real in bfloat16, and the
divergence witness tells a tie within it from a gap far outside it."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from specaudit.fixtures.tiny import build_tiny
from specaudit.numerics.calibration import calibrate, judge_divergence
from specaudit.reference.oracle import greedy_oracle

PROMPTS = [(5, 9, 2, 7), (11,), (3, 3, 8, 1, 4, 6, 2), (40, 41)]


def forced(dtype: torch.dtype, new_tokens: int = 6) -> tuple[list[list[int]], list[int]]:
    """Each prompt followed by the float64 batch-size-1 greedy continuation."""
    reference = build_tiny("llama", "target", dtype=torch.float64)
    sequences = [
        list(p) + list(greedy_oracle(reference, p, max_new_tokens=new_tokens, eos_token_id=None).tokens)
        for p in PROMPTS
    ]
    return sequences, [len(p) for p in PROMPTS]


def wide_llama(dtype: torch.dtype) -> torch.nn.Module:
    """Wide enough (hidden 256) that batch shape changes float32 reduction order; seeded, random."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    return LlamaForCausalLM(config).to(dtype).eval()


def test_float32_noise_is_measured_and_float64_noise_is_at_rounding_level() -> None:
    """Batched vs single in float32 differ (by rounding of other reduction orders), float64 far less."""
    sequences, lengths = forced(torch.float64)
    exact = calibrate(wide_llama(torch.float64), sequences, lengths, 0, label="wide")
    low = calibrate(wide_llama(torch.float32), sequences, lengths, 0, label="wide")
    assert exact.steps == low.steps == sum(len(s) - n for s, n in zip(sequences, lengths))
    assert 0 < low.logit_max < 1e-3 and 0 < low.kv_max < 1e-3, low.render()
    assert exact.logit_max < low.logit_max / 1000 and exact.kv_max < low.kv_max / 1000, exact.render()
    assert (low.dtype, exact.dtype) == ("float32", "float64")


def test_witness_separates_a_tie_from_a_clear_gap() -> None:
    """The oracle's own runner-up at a step is a tie under a wide bound and a bug under a tight one;
    the least likely token is never a tie under any measured bound."""
    model = build_tiny("llama", "target", dtype=torch.float64)
    sequences, lengths = forced(torch.float64)
    floor = calibrate(model, sequences, lengths, 0, label="llama")
    prefix = PROMPTS[0]
    logits = model(input_ids=torch.tensor([prefix])).logits[0, -1]
    order = logits.argsort(descending=True).tolist()
    best, runner_up, worst = order[0], order[1], order[-1]
    gap = float(logits[best] - logits[runner_up])
    wide = dataclasses.replace(floor, logit_max=gap)  # a bound of 2 * gap: the runner-up is within it
    assert judge_divergence(model, prefix, 0, runner_up, best, wide).numerical
    tight = dataclasses.replace(floor, logit_max=gap / 4)
    verdict = judge_divergence(model, prefix, 0, runner_up, best, tight)
    assert not verdict.numerical and verdict.margin == pytest.approx(gap)
    assert not judge_divergence(model, prefix, 0, worst, best, wide).numerical
