"""A correct batch speculative decoder that verifies each round in several target forwards.

Written independently of the references. Per round, for the left-padded batch:

    draft:    d_1..d_K greedy from the pending token p      (K + 1 draft forwards, so the draft
                                                           cache holds p, d_1..d_K like the target's)
    verify:   y = argmax target([p, d_1..d_K]) in `pieces` forwards; piece j attends every earlier
              piece's entries, still unverified (positions L .. L + K, L = attended length)
    accept:   a = max{a : d_i = y_i for all i <= a},  bonus = y_{a + 1}
    compact:  keep the attended slots plus p, d_1..d_a; each row's kept slots move to the right
              end of a new left-padded layout (one gather per layer and cache)

`PendingSpec` (tests/decoders/pending.py) reuses the helpers below with another prefill.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache

from specaudit.models.compat import cache_from_tensors, cache_keyword, cache_layers, output_cache


@dataclass
class Batch:
    """The running rows: caches left-padded to one width, `mask` 1 on their real slots."""

    rows: list[int]  # original row of each batch row
    mask: torch.Tensor  # [B, S]
    pending: torch.Tensor  # [B] last committed token, in neither cache yet
    target_cache: Any
    draft_cache: Any


def forward(
    model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache: Any
) -> tuple[torch.Tensor, Any]:
    """One HF-style call with a cache; returns (logits [B, T, V], the cache)."""
    out = model(
        input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, **{cache_keyword(model): cache}
    )
    return out.logits, output_cache(out)


def commit(
    out: list[list[int]], rows: list[int], tokens: list[list[int]], max_new_tokens: int, eos: int | None
) -> list[bool]:
    """Append each row's new tokens up to EOS or the limit; returns which rows still run."""
    running = []
    for row, new in zip(rows, tokens):
        for token in new:
            if len(out[row]) >= max_new_tokens or (out[row] and out[row][-1] == eos):
                break
            out[row].append(token)
        running.append(len(out[row]) < max_new_tokens and out[row][-1] != eos)
    return running


def accept(drafts: torch.Tensor, predicted: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy acceptance: (accepted [B], bonus [B]) from drafts [B, K] and target argmax [B, K + 1]."""
    k = drafts.shape[1]
    accepted = (drafts == predicted[:, :k]).long().cumprod(1).sum(1)
    return accepted, predicted.gather(1, accepted[:, None])[:, 0]


def compact(cache: Any, keep: torch.Tensor, alive: list[int]) -> tuple[Any, torch.Tensor]:
    """Move the kept slots [B, S] of the rows in `alive` to the right end of a new layout.

    Returns the new cache and its mask [B', W]. The gather index is built row by row (a test
    decoder favours plainness); the gather itself is one per layer.
    """
    lengths = [int(keep[i].sum()) for i in alive]
    width = max(lengths, default=0)
    source = torch.zeros(len(alive), width, dtype=torch.long)
    mask = torch.zeros(len(alive), width, dtype=torch.long)
    for j, (i, n) in enumerate(zip(alive, lengths)):
        source[j, width - n :] = keep[i].nonzero()[:, 0]
        mask[j, width - n :] = 1
    layers = []
    index = torch.tensor(alive, dtype=torch.long)
    for k, v in cache_layers(cache):  # [B, H, S, D]
        gather = source.to(k.device)[:, None, :, None].expand(-1, k.shape[1], -1, k.shape[-1])  # [B', H, W, D]
        layers.append((k[index.to(k.device)].gather(2, gather), v[index.to(v.device)].gather(2, gather)))
    return cache_from_tensors(layers), mask.to(keep.device)


def propose(draft: torch.nn.Module, batch: Batch, k: int) -> torch.Tensor:
    """K greedy drafts [B, K]; K + 1 forwards so the draft cache holds p, d_1..d_K."""
    mask, token, drafts = batch.mask, batch.pending[:, None], []
    for step in range(k + 1):
        position = mask.sum(1, keepdim=True)  # [B, 1]
        mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)
        logits, batch.draft_cache = forward(draft, token, mask, position, batch.draft_cache)
        if step < k:
            token = logits[:, -1].argmax(-1, keepdim=True)  # [B, 1]
            drafts.append(token)
    return torch.cat(drafts, dim=1)


def kept_block(accepted: torch.Tensor, k: int) -> torch.Tensor:
    """Which of the round's K + 1 new slots stay: the pending token and the accepted drafts. [B, K + 1]"""
    return torch.arange(k + 1, device=accepted.device)[None, :] <= accepted[:, None]


def advance(
    batch: Batch,
    drafts: torch.Tensor,
    predicted: torch.Tensor,
    out: list[list[int]],
    limits: dict,
    kept: Callable[[torch.Tensor, int], torch.Tensor] = kept_block,
) -> Batch:
    """Accept, commit, and compact both caches for the rows still running."""
    accepted, bonus = accept(drafts, predicted)
    new = [d[:a] + [x] for d, a, x in zip(drafts.tolist(), accepted.tolist(), bonus.tolist())]
    running = commit(out, batch.rows, new, limits["max_new_tokens"], limits["eos_token_id"])
    block = kept(accepted, drafts.shape[1])  # [B, K + 1]
    keep = torch.cat([batch.mask.bool(), block], dim=1)  # [B, S + K + 1]
    alive = [i for i, r in enumerate(running) if r]
    target_cache, mask = compact(batch.target_cache, keep, alive)
    draft_cache, _ = compact(batch.draft_cache, keep, alive)
    return Batch([batch.rows[i] for i in alive], mask, bonus[alive], target_cache, draft_cache)


class ChunkedSpec:
    """Greedy batch speculative decoding whose verification takes `pieces` target forwards per round."""

    name = "chunked-verify"
    max_wait_calls = 0

    def __init__(self, pieces: int = 2) -> None:
        self.pieces = pieces

    @torch.no_grad()
    def generate(
        self,
        target: torch.nn.Module,
        draft: torch.nn.Module,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        *,
        num_draft_tokens: int,
        max_new_tokens: int,
        eos_token_id: int | None,
        pad_token_id: int,
    ) -> list[list[int]]:
        out: list[list[int]] = [[] for _ in range(input_ids.shape[0])]
        limits = {"max_new_tokens": max_new_tokens, "eos_token_id": eos_token_id}
        batch = self.prefill(target, draft, input_ids, attention_mask, out, limits)
        while batch.rows:
            drafts = propose(draft, batch, num_draft_tokens)  # [B, K]
            predicted = self.verify(target, batch, drafts)  # [B, K + 1]
            batch = advance(batch, drafts, predicted, out, limits, self.kept)
        return out

    @staticmethod
    def kept(accepted: torch.Tensor, k: int) -> torch.Tensor:
        """The round's slots to keep (a hook for the negative control in tests/checks/test_foreign_rows.py)."""
        return kept_block(accepted, k)

    @staticmethod
    def prefill(
        target: torch.nn.Module,
        draft: torch.nn.Module,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        out: list[list[int]],
        limits: dict,
    ) -> Batch:
        """Both models over the whole prompts; the target's last logits give the first token."""
        mask = attention_mask.long()
        positions = (mask.cumsum(1) - 1).clamp(min=0)  # [B, T]
        logits, target_cache = forward(target, input_ids, mask, positions, DynamicCache())
        _, draft_cache = forward(draft, input_ids, mask, positions, DynamicCache())
        first = logits[:, -1].argmax(-1)  # [B]
        rows = list(range(input_ids.shape[0]))
        running = commit(out, rows, [[t] for t in first.tolist()], limits["max_new_tokens"], limits["eos_token_id"])
        alive = [i for i, r in enumerate(running) if r]
        keep = mask.bool()
        target_cache, new_mask = compact(target_cache, keep, alive)
        draft_cache, _ = compact(draft_cache, keep, alive)
        return Batch(alive, new_mask, first[alive], target_cache, draft_cache)

    def verify(self, target: torch.nn.Module, batch: Batch, drafts: torch.Tensor) -> torch.Tensor:
        """Target argmax [B, K + 1] over [p, d_1..d_K], scored piece by piece."""
        block = torch.cat([batch.pending[:, None], drafts], dim=1)  # [B, K + 1]
        start = batch.mask.sum(1, keepdim=True)  # [B, 1] position of p
        mask, logits, offset = batch.mask, [], 0
        for piece in torch.tensor_split(block, min(self.pieces, block.shape[1]), dim=1):
            width = piece.shape[1]
            mask = torch.cat([mask, mask.new_ones(mask.shape[0], width)], dim=1)  # earlier pieces attended
            positions = start + offset + torch.arange(width, device=block.device)  # [B, width]
            scores, batch.target_cache = forward(target, piece, mask, positions, batch.target_cache)
            logits.append(scores)
            offset += width
        return torch.cat(logits, dim=1).argmax(-1)
