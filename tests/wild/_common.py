"""What the wild adapters share: the contract's plumbing, kept apart from the transcribed sampling logic.

Every adapter calls its models cache-free (a fresh forward over whole sequences), so the KV-cache handling of
the public code is not what is audited here: its sampling path is.
"""

from __future__ import annotations

import torch
from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper


def forward_logits(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """A cache-free forward of [B, W] columns where `mask` marks the attended ones; each row's attended tokens
    get positions 0, 1, 2, ... wherever they sit. Returns the logits [B, W, V]."""
    mask = mask.long()
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    return model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False).logits


def left_pad(rows: list[list[int]], pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token lists left-padded to the longest: (input_ids, attention_mask), each [B, W]."""
    width = max(map(len, rows))
    ids = torch.tensor([[pad_token_id] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    return ids, mask


def unpad(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> list[list[int]]:
    """Each row's real tokens (the contract's prompts are left-padded)."""
    return [ids[m.bool()].tolist() for ids, m in zip(input_ids, attention_mask)]


def hf_warp(logits: torch.Tensor, temperature: float, top_k: int | None, top_p: float | None) -> torch.Tensor:
    """Hugging Face's temperature, top-k and top-p warpers in their order, on float64 logits [N, V]: the
    processing an adapter adds where the public code has none (filtered tokens at -inf)."""
    z = TemperatureLogitsWarper(temperature)(None, logits.double())
    if top_k and top_k < z.shape[-1]:
        z = TopKLogitsWarper(top_k)(None, z)
    if top_p is not None and top_p < 1:
        z = TopPLogitsWarper(top_p)(None, z)
    return z


def cut(tokens: list[int], max_new_tokens: int, eos_token_id: int | None) -> list[int]:
    """A row's output as the contract wants it: at most `max_new_tokens`, ending at its first EOS."""
    tokens = tokens[:max_new_tokens]
    if eos_token_id is not None and eos_token_id in tokens:
        tokens = tokens[: tokens.index(eos_token_id) + 1]
    return tokens
