"""Real-model numerics: a divergence is excused only within the measured noise, judged by a
higher-precision witness; the noise floor is measured once and kept; the control is batched."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from specaudit.checks import check_equivalence, equivalence
from specaudit.contracts.case import Case
from specaudit.fixtures.tiny import build_tiny
from specaudit.numerics.calibration import NoiseFloor
from specaudit.numerics.noise import measure_noise, witness_for
from specaudit.reference.oracle import greedy_oracle
from specaudit.running.runner import Run, run_case

PATTERN = tuple([True, False] * 20)


def floor(logit_max: float, witness: torch.nn.Module | None = None) -> NoiseFloor:
    return NoiseFloor("test", "float32", "cpu", 1, 0.0, 0.0, logit_max, 0.0, 0.0, 1.0, 1.0, witness=witness)


def flipped_run(flip_at: int) -> Run:
    """A float32 run on the tiny Llama whose row 0 takes the oracle's runner-up at `flip_at` and
    then follows the greedy continuation of its own prefix."""
    prompt = (5, 9, 2)
    case = Case((prompt,), (PATTERN,), 2, 6, None, 0, model="llama", dtype="float32")
    run = run_case("specaudit.reference.eqspec:EqSpec", case)
    assert run.outputs is not None and tuple(run.outputs[0]) == run.oracle[0].tokens
    ids = torch.tensor([prompt + run.oracle[0].tokens[:flip_at]])
    logits = run.target(input_ids=ids).logits[0, -1]  # [V]
    runner_up = int(logits.topk(2).indices[1])
    flipped = run.oracle[0].tokens[:flip_at] + (runner_up,)
    rest = greedy_oracle(run.target, prompt + flipped, max_new_tokens=6 - flip_at - 1, eos_token_id=None)
    run.outputs[0] = list(flipped + rest.tokens)
    return run


def test_a_divergence_within_the_measured_noise_is_a_tie_judged_by_the_witness() -> None:
    """With a bound above the witness's gap the runner-up is a tie: re-synced, equivalent, and the
    verdict says modulo numerics, with the step, the gap and who judged it."""
    run = flipped_run(2)
    witness = witness_for(run.target)
    assert witness.dtype == torch.float64
    run.noise = floor(1e6, witness)
    (row,) = equivalence(run).rows
    assert row.ties == (2,) and row.equivalent and check_equivalence(run) == []
    assert equivalence(run).verdict == "equivalent modulo numerics (1 tie(s) in 1 row(s))"
    assert "step 2 (gap" in row.numerics() and "float64" in row.numerics()


def test_the_same_divergence_beyond_the_measured_noise_is_a_bug() -> None:
    """Negative control: the same flip against a bound below the witness's gap is a divergence."""
    run = flipped_run(2)
    run.noise = floor(0.0, witness_for(run.target))
    (row,) = equivalence(run).rows
    assert row.ties == () and row.first_divergence == 2 and row.judged[0].margin > 0
    assert [v.rule for v in check_equivalence(run)] == ["first-divergence"]


def test_the_noise_floor_is_measured_once_and_kept(tmp_path: Path) -> None:
    """A second audit of the same model, dtype and prompts reads the stored floor; its witness is
    the model in the next higher precision."""
    model = build_tiny("llama", "target", dtype=torch.bfloat16)
    prompts = [(5, 9, 2, 7), (11, 3), (3, 3, 8, 1, 4)]
    said: list[str] = []
    first = measure_noise(model, prompts, label="tiny", steps=4, pad_token_id=0, store=tmp_path, say=said.append)
    again = measure_noise(model, prompts, label="tiny", steps=4, pad_token_id=0, store=tmp_path, say=said.append)
    assert len(said) == 1 and len(list(tmp_path.glob("noise-*.json"))) == 1
    assert dataclasses.replace(first, witness=None) == dataclasses.replace(again, witness=None)
    assert first.dtype == "bfloat16" and first.steps == 3 * 4 and again.witness.dtype == torch.float32


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_the_witness_is_one_precision_up(dtype: torch.dtype) -> None:
    model = build_tiny("gpt2", "target", dtype=dtype)
    want = {torch.float16: torch.float32, torch.bfloat16: torch.float32}.get(dtype, torch.float64)
    assert witness_for(model).dtype == want
