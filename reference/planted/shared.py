"""Pieces more than one family of planted bugs builds on."""

from __future__ import annotations

import torch

from specaudit.models.compat import select_rows
from specaudit.reference.eqspec import BatchState


def mask_in_place(
    state: BatchState, accepted: torch.Tensor, bonus: torch.Tensor, k: int, finished: torch.Tensor
) -> BatchState:
    """Realignment by masking: nothing moves, rejected slots stay in the cache with mask 0, the
    cache grows by K + 1 slots per round; finished rows are dropped."""
    block = (torch.arange(k + 1, device=accepted.device)[None, :] <= accepted[:, None]).long()  # [B, K + 1]
    active = (~finished).nonzero()[:, 0]  # [B']
    mask = torch.cat([state.mask, block], dim=1)[active]  # [B', S + K + 1]
    draft_mask = torch.cat([state.draft_mask, block], dim=1)[active]
    if active.numel() < finished.numel():
        select_rows(state.target_cache, active)
        select_rows(state.draft_cache, active)
    return BatchState(state.rows[active], mask, draft_mask, bonus[active], state.target_cache, state.draft_cache)
