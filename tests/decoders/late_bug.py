"""A held-back planted decoder whose bug needs a row to grow past 40 tokens (issue 27, point 7).

Not in the catalog: it measures how far the conformance suite explores. `MaskedSpec`
(`tests.decoders.positional`) is correct; `LateBug` books each row's generated tokens in a
buffer of BUFFER slots, and once a row has generated more than that (its sequence, prompt plus
generated, is then past 40 tokens too), the verify call's position ids lag by one: the grown
buffer's offset forgets the slot the first one reserved. A long prompt does not show it, nor a
batch of short generations; only a row that generates more than 40 tokens does, which takes a
`max_new_tokens` past 40 (beyond the small shape's 24) and no early EOS.
"""

from __future__ import annotations

from typing import Any

import torch

from tests.decoders.positional import MaskedSpec

BUFFER = 40
"""Generated tokens a row may hold before the planted bug fires."""


class LateBug(MaskedSpec):
    """MaskedSpec whose verify positions are one short once a row has generated more than `BUFFER` tokens."""

    name = "late-bug"
    max_wait_calls = 0

    def __init__(self) -> None:
        self.prompt_lengths = torch.zeros(0, dtype=torch.long)  # [B'] each batch row's prompt length

    def prefill(
        self, target: torch.nn.Module, draft: torch.nn.Module, caches: list[Any], ids: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        self.prompt_lengths = mask.sum(1)  # [B]
        return super().prefill(target, draft, caches, ids, mask)

    def retire(
        self, rows: torch.Tensor, mask: torch.Tensor, pending: torch.Tensor, caches: list[Any], done: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[Any]]:
        if bool(done.any()):
            self.prompt_lengths = self.prompt_lengths[(~done).nonzero()[:, 0]]  # follows the rows that stay
        return super().retire(rows, mask, pending, caches, done)

    def verify(
        self,
        target: torch.nn.Module,
        caches: list[Any],
        mask: torch.Tensor,
        pending: torch.Tensor,
        drafts: torch.Tensor,
    ) -> torch.Tensor:
        """MaskedSpec's verify, but a row past BUFFER generated tokens gets positions one short. [B, K + 1]"""
        block = torch.cat([pending[:, None], drafts], dim=1)  # [B, K + 1]
        length = mask.sum(1, keepdim=True)  # [B, 1] the row's committed sequence, pending token excluded
        generated = length - self.prompt_lengths[:, None] + 1  # [B, 1] pending token included
        spilled = (generated > BUFFER).long()  # [B, 1]
        positions = length - spilled + torch.arange(block.shape[1])  # [B, K + 1] planted: one short once spilled
        full = torch.cat([mask, torch.ones_like(block)], dim=1)  # [B, S + K + 1]
        return self.forward(target, block, full, positions, caches[0]).argmax(-1)
