"""A correct engine that verifies each round in two target forwards: [pending, first drafts], then
the remaining drafts on top of the cache the first piece wrote (as engines do to bound a step's
memory). The second piece attends the round's still unverified drafts, which is right."""

from __future__ import annotations

import torch

from specaudit.models.compat import call_model
from specaudit.reference.engines import EqSpecEngine
from specaudit.reference.eqspec import BatchState


class SplitVerifyEngine(EqSpecEngine):
    name = "split-verify engine"

    def batch_verify(self, target: torch.nn.Module, state: BatchState, drafts: torch.Tensor) -> torch.Tensor:
        block = torch.cat([state.pending[:, None], drafts], dim=1)  # [B, K + 1]
        width = block.shape[1]
        positions = self.positions(state, state.mask, width, "target")  # [B, K + 1]
        cut = max(1, width // 2)
        predicted = []
        for lo, hi in ((0, cut), (cut, width)):
            if lo == hi:
                continue
            mask = torch.cat([state.mask, state.mask.new_ones(block.shape[0], hi)], dim=1)  # [B, S + hi]
            logits, state.target_cache = call_model(
                target, block[:, lo:hi], mask, positions[:, lo:hi], state.target_cache
            )
            predicted.append(logits.argmax(-1))  # [B, hi - lo]
        return torch.cat(predicted, dim=1)  # [B, K + 1]
