"""Planted bugs in position ids: new inputs placed at the wrong positions after padding changes.

Position ids must count each row's real tokens, not the padded width: HF's defaults (past length + arange, one
batch-wide cache offset) are right for an unpadded row and wrong as soon as a row carries pads, and a verify call
that starts one position late is wrong everywhere. The harness must catch each by the I2 position rule on the
call where the first wrong position is written.
"""

from __future__ import annotations

import torch

from specaudit.reference.eqspec import BatchState, EqSpec
from specaudit.reference.planted.info import BugInfo


class PositionsFromArange(EqSpec):
    """Position ids from past length + arange, offset by each row's padding at prefill and
    never updated (seen in BSP; HF's default arange positions).

    Right at first; wrong as soon as a re-pad changes a row's padding (at batch size 1, when
    the prompt had extra pad columns, which the first re-pad removes).
    """

    name = "positions_from_arange"
    bug = BugInfo("position ids from arange, ignoring padding", "BSP, HF defaults", "position-id", "I2", True)

    def prefill(
        self, target: torch.nn.Module, draft: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor
    ) -> tuple[BatchState, torch.Tensor]:
        self.prefill_pads = (attention_mask == 0).sum(1)  # [B], frozen from here on
        return super().prefill(target, draft, input_ids, attention_mask)

    def positions(self, state: BatchState, mask: torch.Tensor, width: int, role: str) -> torch.Tensor | None:
        return mask.shape[1] - self.prefill_pads[state.rows][:, None] + torch.arange(width, device=mask.device)


class BatchUniformCacheOffset(EqSpec):
    """One cache offset for the whole batch: every row's new positions start at the cache
    width, like HF's batch-wide `cache_position` (HF defaults).

    Right for the longest row only; wrong for every row with pads at the time of the call.
    """

    name = "batch_uniform_cache_offset"
    bug = BugInfo("batch-uniform cache offset", "HF defaults", "position-id", "I2", False)

    def positions(self, state: BatchState, mask: torch.Tensor, width: int, role: str) -> torch.Tensor | None:
        return (mask.shape[1] + torch.arange(width, device=mask.device)).expand(mask.shape[0], width)


class VerifyPositionOffByOne(EqSpec):
    """The verify call's positions start one too late: length + 1 + arange (several).

    Diverges at once, even at batch size 1.
    """

    name = "verify_position_off_by_one"
    bug = BugInfo("position off by one in the verify call", "several", "position-id", "I2", True)

    def positions(self, state: BatchState, mask: torch.Tensor, width: int, role: str) -> torch.Tensor | None:
        shift = 1 if role == "target" else 0
        return mask.sum(1, keepdim=True) + shift + torch.arange(width, device=mask.device)
