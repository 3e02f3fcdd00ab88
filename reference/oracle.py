"""The oracle: single-sequence, batch-size-1 greedy decoding with the target.

Everything a batch decoder produces is judged against this. No padding, no batch, no
speculation: positions 0..n-1 passed explicitly, one token appended per step.

With `keep_kv` the oracle also keeps its own final cache (prompt and every generated token,
the last one fed once more) on the CPU, flattened one row per slot (`kv_rows`). I2 slices it
as the batch-size-1 reference K/V of any row whose tokens are a prefix of the oracle's, so
a row that matches the oracle costs no second batch-size-1 run.
"""

from __future__ import annotations

from dataclasses import dataclass, field
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
    kv: torch.Tensor | None = field(default=None, compare=False, repr=False, hash=False)
    """With `keep_kv`: the K/V of prompt + tokens, [n, F] (`kv_rows`), on the CPU, in the model's dtype."""


def model_device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def top_margin(logits: torch.Tensor) -> float:
    top = logits.double().topk(2).values  # [2]
    return float(top[0] - top[1])


def kv_rows(layers: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """One row per slot: per-layer (K, V) [H, n, D] (or [1, H, n, D]) as [n, F], F = layers x 2 x H x D,
    ordered K0, V0, K1, V1, ... (what I2 compares slot by slot)."""
    flat = []
    for k, v in layers:
        for x in (k, v):
            x = x[0] if x.dim() == 4 else x  # [H, n, D]
            flat.append(x.transpose(0, 1).reshape(x.shape[1], -1))  # [n, H * D]
    return torch.cat(flat, dim=1)


@torch.no_grad()
def greedy_oracle(
    target: torch.nn.Module,
    prompt: tuple[int, ...],
    *,
    max_new_tokens: int,
    eos_token_id: int | None,
    keep_kv: bool = False,
) -> OracleResult:
    """Greedy continuation of one prompt, stopping after EOS (included) or max_new_tokens.

    `keep_kv`: feed the last token once more and keep the final cache as `OracleResult.kv`."""
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
        stop: StopReason | None = (
            "eos" if token == eos_token_id else "length" if len(tokens) >= max_new_tokens else None
        )
        if stop is not None and not keep_kv:
            return OracleResult(tuple(tokens), stop, tuple(margins))
        length = len(prompt) + len(tokens)
        mask = torch.ones(1, length, dtype=torch.long, device=device)
        step = torch.tensor([[token]], device=device)
        logits, cache = call_model(target, step, mask, torch.tensor([[length - 1]], device=device), cache)
        if stop is not None:
            kv = kv_rows([(k[:1, :, :length], v[:1, :, :length]) for k, v in cache_layers(cache)])  # [n, F]
            return OracleResult(tuple(tokens), stop, tuple(margins), kv.detach().to("cpu", copy=True))


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
