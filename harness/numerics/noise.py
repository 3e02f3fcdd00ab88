"""Real-model mode's numerics: the measured noise floor, the higher-precision witness and the
batched non-speculative control, prepared once per audit and shared by every decoder.

- The noise floor (`specaudit.numerics.calibration.calibrate`) is measured on the audit's own first
  prompts, teacher-forced along a plain batched greedy continuation, and kept on disk per
  (model, dtype, device, tokens), so a second audit of the same model does not pay for it.
- The witness is the target in the next higher precision (float32 for float16/bfloat16,
  float64 for float32 on the CPU): equivalence scores a divergence's shared prefix with it.
- The control is `BatchedGreedy` (no speculation) on every batch: its exact-match rate is the
  divergence batching alone causes, printed beside each decoder's (the paper's control).
"""

from __future__ import annotations

import copy
import hashlib
import json
from collections.abc import Callable, Sequence
from dataclasses import asdict, fields, replace
from pathlib import Path

import torch

from specaudit.numerics.calibration import NoiseFloor, calibrate
from specaudit.reference.batched import BatchedGreedy

CALIBRATION_PROMPTS = 4
"""Prompts the noise floor is measured on (the audit's first ones): enough rows for a padded
batch of varied lengths, few enough that the batch-size-1 replays stay cheap."""

WITNESS_DTYPE = {torch.float16: torch.float32, torch.bfloat16: torch.float32, torch.float32: torch.float64}


def witness_for(target: torch.nn.Module) -> torch.nn.Module:
    """The target in the next higher precision: itself when already float64, and a float32 model
    on a GPU judges itself (a float64 copy would double its memory for a few scoring forwards)."""
    dtype = WITNESS_DTYPE.get(target.dtype)
    if dtype is None or (dtype == torch.float64 and next(target.parameters()).device.type != "cpu"):
        return target
    return copy.deepcopy(target).to(dtype).eval()


@torch.no_grad()
def batched_continuations(
    target: torch.nn.Module, prompts: Sequence[tuple[int, ...]], steps: int, pad_token_id: int
) -> list[list[int]]:
    """Each prompt followed by `steps` tokens of plain batched greedy decoding (no EOS stop)."""
    device = next(target.parameters()).device
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for r, p in enumerate(prompts):
        ids[r, width - len(p) :], mask[r, width - len(p) :] = torch.tensor(p), 1
    out = BatchedGreedy().generate(
        target,
        target,
        ids.to(device),  # [B, T]
        mask.to(device),
        num_draft_tokens=1,
        max_new_tokens=steps,
        eos_token_id=None,
        pad_token_id=pad_token_id,
    )
    return [list(p) + o for p, o in zip(prompts, out)]


def calibration_key(label: str, target: torch.nn.Module, prompts: Sequence[tuple[int, ...]], steps: int) -> str:
    device = next(target.parameters()).device
    text = json.dumps([label, str(target.dtype), device.type, steps, [list(p) for p in prompts]])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def load_floor(path: Path) -> NoiseFloor | None:
    try:
        data = json.loads(path.read_text())
        return NoiseFloor(**{f.name: data[f.name] for f in fields(NoiseFloor) if f.name != "witness"})
    except (OSError, ValueError, KeyError, TypeError):
        return None  # absent or from another version: measure again


def measure_noise(
    target: torch.nn.Module,
    prompts: Sequence[tuple[int, ...]],
    *,
    label: str,
    steps: int,
    pad_token_id: int,
    store: Path | None,
    say: Callable[[str], None] = lambda text: print(text, flush=True),
) -> NoiseFloor:
    """The target's noise floor on the first prompts, from `store` if measured before."""
    chosen = list(prompts[:CALIBRATION_PROMPTS])
    path = None if store is None else store / f"noise-{calibration_key(label, target, chosen, steps)}.json"
    floor = None if path is None else load_floor(path)
    if floor is None:
        say(f"  measuring the noise floor: {len(chosen)} prompt(s), {steps} steps, batched against batch size 1")
        sequences = batched_continuations(target, chosen, steps, pad_token_id)
        floor = calibrate(target, sequences, [len(p) for p in chosen], pad_token_id, label=label)
        if path is not None:
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(json.dumps({k: v for k, v in asdict(floor).items() if k != "witness"}) + "\n")
            except OSError:
                pass  # a read-only cache only costs a re-measurement next time
    return replace(floor, witness=witness_for(target))
