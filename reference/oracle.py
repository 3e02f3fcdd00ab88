"""The oracle: single-sequence, batch-size-1 greedy decoding with the target.

Everything a batch decoder produces is judged against this. No padding, no batch, no
speculation: positions 0..n-1 passed explicitly, one token appended per step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from transformers import DynamicCache

from specaudit.compat import cache_layers, call_model

StopReason = Literal["eos", "length"]


@dataclass(frozen=True)
class OracleResult:
    tokens: tuple[int, ...]
    stop: StopReason
    margins: tuple[float, ...]
    """Top-1 minus top-2 logit at each generated step: how close each argmax was to a tie."""


def model_device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def top_margin(logits: torch.Tensor) -> float:
    top = logits.double().topk(2).values  # [2]
    return float(top[0] - top[1])


@torch.no_grad()
def greedy_oracle(
    target: torch.nn.Module, prompt: tuple[int, ...], *, max_new_tokens: int, eos_token_id: int | None
) -> OracleResult:
    """Greedy continuation of one prompt, stopping after EOS (included) or max_new_tokens."""
    device = model_device(target)
    ids = torch.tensor([prompt], device=device)  # [1, L]
    positions = torch.arange(len(prompt), device=device)[None]
    logits, cache = call_model(target, ids, torch.ones_like(ids), positions, DynamicCache())
    tokens: list[int] = []
    margins: list[float] = []
    while True:
        last = logits[0, -1]  # [V]
        token = int(last.argmax())
        tokens.append(token)
        margins.append(top_margin(last))
        if token == eos_token_id:
            return OracleResult(tuple(tokens), "eos", tuple(margins))
        if len(tokens) >= max_new_tokens:
            return OracleResult(tuple(tokens), "length", tuple(margins))
        length = len(prompt) + len(tokens)
        mask = torch.ones(1, length, dtype=torch.long, device=device)
        step = torch.tensor([[token]], device=device)
        logits, cache = call_model(target, step, mask, torch.tensor([[length - 1]], device=device), cache)


def truncate(
    continuation: tuple[int, ...], *, max_new_tokens: int, eos_token_id: int | None
) -> tuple[tuple[int, ...], StopReason]:
    """The oracle's output from a longer EOS-blind continuation: same tokens, same stop."""
    out = continuation[:max_new_tokens]
    if eos_token_id is not None and eos_token_id in out:
        return out[: out.index(eos_token_id) + 1], "eos"
    return out, "length"


@torch.no_grad()
def reference_kv(target: torch.nn.Module, tokens: tuple[int, ...]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per-layer (K, V) [H, n, D] of a batch-size-1 run over `tokens` at positions 0..n-1."""
    device = model_device(target)
    ids = torch.tensor([tokens], device=device)  # [1, n]
    positions = torch.arange(len(tokens), device=device)[None]
    _, cache = call_model(target, ids, torch.ones_like(ids), positions, DynamicCache())
    return [(k[0].detach().to("cpu", copy=True), v[0].detach().to("cpu", copy=True)) for k, v in cache_layers(cache)]
