"""The noise floor of batched arithmetic, measured per model, dtype and device, never assumed.

A calibration run decodes the same token sequences twice without speculation: once as one
left-padded batch, once one sequence at a time. Both are teacher-forced along the same tokens
(each row's prompt followed by its batch-size-1 greedy continuation), so every step sees
identical prefixes and any difference is arithmetic: other GEMM shapes, other reduction
orders, padding in the batch. The spread of the final logits and of every cached K/V entry
between the two is the noise a correct batch decoder may show; a synchronization bug moves
logits and K/V by far more than that.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import DynamicCache

from specaudit.models.compat import cache_layers, call_model


@dataclass(frozen=True)
class NoiseFloor:
    """Batched against batch-size-1 differences of one model in one dtype on one device."""

    model: str
    dtype: str
    device: str
    steps: int  # decoded positions compared
    logit_p50: float  # median over steps of max |batched - single| over the vocabulary
    logit_p99: float
    logit_max: float
    kv_p99: float  # over cached slots: max |batched - single| over layers, heads and features
    kv_max: float
    kv_scale: float  # median |K/V| entry: what the K/V noise is relative to
    margin_p50: float  # median top-1/top-2 logit margin of the batch-size-1 run, for scale
    witness: Any = field(default=None, compare=False, repr=False)  # the target in a higher precision, if made

    @property
    def logit_bound(self) -> float:
        """Two logits closer than this may swap order between batched and single runs."""
        return 2.0 * self.logit_max

    def render(self) -> str:
        return (
            f"{self.model} {self.dtype} on {self.device}: {self.steps} steps; logit noise p50 {self.logit_p50:.3g}, "
            f"p99 {self.logit_p99:.3g}, max {self.logit_max:.3g}; K/V noise p99 {self.kv_p99:.3g}, "
            f"max {self.kv_max:.3g} (|K/V| median {self.kv_scale:.3g}); margin p50 {self.margin_p50:.3g}"
        )


def quantile(values: torch.Tensor, q: float) -> float:
    return float(torch.quantile(values.double().flatten(), q)) if values.numel() else math.nan


@torch.no_grad()
def decode_forced(
    model: torch.nn.Module, sequences: Sequence[Sequence[int]], prompt_lengths: Sequence[int], pad_token_id: int
) -> tuple[list[torch.Tensor], list[list[tuple[torch.Tensor, torch.Tensor]]]]:
    """Prefill the left-padded prompts, then feed each row's next token one step at a time.

    Returns per row the logits of every decoded step [steps, V] and per row the final cache
    layers as [H, L, D] pairs over the row's real slots (pads cut out). Rows stop feeding at
    their own length; the batch runs until the longest ends (finished rows are fed pads, masked).
    """
    device = next(model.parameters()).device
    rows = len(sequences)
    width = max(prompt_lengths)
    ids = torch.full((rows, width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((rows, width), dtype=torch.long)
    for r, (seq, n) in enumerate(zip(sequences, prompt_lengths)):
        ids[r, width - n :] = torch.tensor(seq[:n])
        mask[r, width - n :] = 1
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    logits, cache = call_model(model, ids.to(device), mask.to(device), positions.to(device), DynamicCache())
    steps = [[logits[r, -1].float().cpu()] for r in range(rows)]  # the first decoded step: after the prompt
    horizon = max(len(s) - n for s, n in zip(sequences, prompt_lengths))
    for t in range(horizon - 1):
        nxt = torch.full((rows, 1), pad_token_id, dtype=torch.long)
        live = torch.zeros((rows, 1), dtype=torch.long)
        for r, (seq, n) in enumerate(zip(sequences, prompt_lengths)):
            if n + t < len(seq) - 1:
                nxt[r, 0], live[r, 0] = seq[n + t], 1
        mask = torch.cat([mask, live], dim=1)  # [B, S + 1]
        pos = (mask.sum(1, keepdim=True) - 1).clamp(min=0)  # [B, 1]
        logits, cache = call_model(model, nxt.to(device), mask.to(device), pos.to(device), cache)
        for r in range(rows):
            if live[r, 0]:
                steps[r].append(logits[r, -1].float().cpu())
    kept = [mask[r].bool() for r in range(rows)]
    layers = [
        [(k[r][:, kept[r]].float().cpu(), v[r][:, kept[r]].float().cpu()) for k, v in cache_layers(cache)]
        for r in range(rows)
    ]
    return [torch.stack(s) for s in steps], layers


def calibrate(
    model: torch.nn.Module,
    sequences: Sequence[Sequence[int]],
    prompt_lengths: Sequence[int],
    pad_token_id: int,
    *,
    label: str,
) -> NoiseFloor:
    """The noise floor of `model` (in its own dtype and device) on these sequences."""
    batched_logits, batched_kv = decode_forced(model, sequences, prompt_lengths, pad_token_id)
    logit_noise, kv_noise, scales, margins = [], [], [], []
    for r, (seq, n) in enumerate(zip(sequences, prompt_lengths)):
        single_logits, single_kv = decode_forced(model, [seq], [n], pad_token_id)
        logit_noise.append((batched_logits[r] - single_logits[0]).abs().amax(-1))  # [steps]
        top = single_logits[0].topk(2, dim=-1).values  # [steps, 2]
        margins.append(top[:, 0] - top[:, 1])
        per_layer = [
            torch.maximum((k - k1).abs().amax((0, 2)), (v - v1).abs().amax((0, 2)))  # [L] from [H, L, D]
            for (k, v), (k1, v1) in zip(batched_kv[r], single_kv[0])
        ]
        kv_noise.append(torch.stack(per_layer).amax(0))  # [L]: the worst layer per slot
        scales.append(batched_kv[r][0][0].abs().flatten())
    logits, kv = torch.cat(logit_noise), torch.cat(kv_noise)
    first = next(model.parameters())
    return NoiseFloor(
        model=label,
        dtype=str(first.dtype).removeprefix("torch."),
        device=str(first.device),
        steps=int(logits.numel()),
        logit_p50=quantile(logits, 0.5),
        logit_p99=quantile(logits, 0.99),
        logit_max=float(logits.max()) if logits.numel() else math.nan,
        kv_p99=quantile(kv, 0.99),
        kv_max=float(kv.max()) if kv.numel() else math.nan,
        kv_scale=quantile(torch.cat(scales)[:100_000], 0.5) if scales else math.nan,
        margin_p50=quantile(torch.cat(margins), 0.5),
    )


@dataclass(frozen=True)
class Witness:
    """A divergence judged against a higher-precision teacher-forced score of the same prefix."""

    index: int  # generated index of the divergence
    margin: float  # logit(oracle token) - logit(decoder token), in the witness's precision
    bound: float  # the measured noise bound it is held to
    witness_dtype: str

    @property
    def numerical(self) -> bool:
        """Within the measured noise: the two tokens are a tie batched arithmetic can swap."""
        return self.margin <= self.bound


@torch.no_grad()
def judge_divergence(
    witness: torch.nn.Module, prefix: Sequence[int], index: int, found: int, expected: int, floor: NoiseFloor
) -> Witness:
    """Score `prefix` (prompt + the tokens both runs agree on) once in the witness's precision and
    compare the oracle's token with the decoder's: a gap wider than the noise is a bug, not a tie."""
    device = next(witness.parameters()).device
    ids = torch.tensor([list(prefix)], device=device)  # [1, L]
    logits = call_model(witness, ids, torch.ones_like(ids), torch.arange(ids.shape[1], device=device)[None], None)[0]
    last = logits[0, -1].double()  # [V]
    dtype = str(next(witness.parameters()).dtype).removeprefix("torch.")
    return Witness(index, float(last[expected] - last[found]), floor.logit_bound, dtype)
