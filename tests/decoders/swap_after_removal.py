"""A planted bug for row binding: EQSPEC that swaps two rows' K/V after a row leaves the batch.

When a finished row is dropped, the first two remaining rows trade their target and draft KV
caches; masks, pending tokens and row order stay. Each row then attends the other's past. Two
remaining rows with the same pending token at the same position look alike by their inputs, so
only a row binder that reads the past's K/V (against each request's batch-size-1 entries) can
tell that a row's past is not its own: I2 must report it (issue 15, the negative control).
"""

from __future__ import annotations

from typing import Any

import torch

from specaudit.models.compat import cache_layers, set_cache_layers
from specaudit.reference.eqspec import BatchState, EqSpec


def swap_rows(cache: Any, first: int, second: int) -> None:
    """Exchange two batch rows of every layer's keys and values, in place."""
    order = torch.arange(cache_layers(cache)[0][0].shape[0])
    order[[first, second]] = order[[second, first]]
    set_cache_layers(cache, [(k[order], v[order]) for k, v in cache_layers(cache)])


class SwapAfterRemoval(EqSpec):
    """EqSpec, but each removal of a finished row swaps the KV caches of the first two rows left."""

    name = "swap_kv_after_removal"

    def __init__(self) -> None:
        self.swaps: list[bool] = []  # per swap: whether the two rows looked alike by their inputs

    def gather_rows(
        self,
        state: BatchState,
        keep: torch.Tensor,
        draft_keep: torch.Tensor,
        pending: torch.Tensor,
        finished: torch.Tensor,
    ) -> BatchState:
        kept = EqSpec.gather_rows(state, keep, draft_keep, pending, finished)
        if bool(finished.any()) and kept.rows.numel() >= 2:
            alike = bool(kept.pending[0] == kept.pending[1]) and bool((kept.mask[0] == kept.mask[1]).all())
            self.swaps.append(alike)  # same pending token, same layout (so the same position)
            swap_rows(kept.target_cache, 0, 1)
            swap_rows(kept.draft_cache, 0, 1)
        return kept
