"""LazySpec: masking instead of realigning, with correct positions, compacted lazily.

The paper argues that masking rejected entries desynchronises the cache. It does when
position ids keep counting the masked slots (BSP). Here rejected slots stay in the cache
with mask 0, position ids count attended slots only (mask.sum), so every row still attends
exactly its own tokens at positions 0, 1, 2, ... (I2). The cache grows by K + 1 slots per
round; it is compacted with EQSPEC's gather only when the wasted fraction passes a
threshold, so most rounds pay no realignment at all.
"""

from __future__ import annotations

import torch

from specaudit.models.compat import select_rows
from specaudit.reference.eqspec import BatchState, EqSpec


class LazySpec(EqSpec):
    """EQSPEC's rounds; realignment replaced by a mask update plus occasional compaction."""

    name = "LazySpec"

    def __init__(self, compact_above: float = 0.5) -> None:
        self.compact_above = compact_above
        self.compactions = 0

    def realign(
        self, state: BatchState, accepted: torch.Tensor, bonus: torch.Tensor, k: int, finished: torch.Tensor
    ) -> BatchState:
        """Mask the rejected slots instead of moving anything; compact when waste is high."""
        block = (
            torch.arange(k + 1, device=accepted.device)[None, :] <= accepted[:, None]
        ).long()  # [B, K + 1] pending + accepted
        mask = torch.cat([state.mask, block], dim=1)  # [B, S + K + 1]
        draft_mask = torch.cat([state.draft_mask, block], dim=1)
        active = (~finished).nonzero()[:, 0]  # [B']
        wasted = 1.0 - float(mask[active].float().mean()) if active.numel() else 0.0
        if wasted > self.compact_above:
            self.compactions += 1
            return self.gather_rows(state, mask.bool(), draft_mask.bool(), bonus, finished)
        if active.numel() < finished.numel():
            select_rows(state.target_cache, active)
            select_rows(state.draft_cache, active)
        return BatchState(
            state.rows[active], mask[active], draft_mask[active], bonus[active], state.target_cache, state.draft_cache
        )
