"""Plain batched greedy decoding, no speculation: the paper's control.

It shows how far batching alone (padding, batched floating point) moves a decoder from the
batch-size-1 oracle, so that numerical divergence is measured apart from speculative
synchronisation errors. It ignores the draft.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from specaudit.models.compat import call_model
from specaudit.reference.eqspec import EqSpec, left_pad_positions


class BatchedGreedy:
    name = "batched-greedy"
    max_wait_calls = 0

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
        mask = attention_mask.long()
        logits, cache = call_model(target, input_ids, mask, left_pad_positions(mask), DynamicCache())
        rows = torch.arange(input_ids.shape[0])
        while True:
            token = logits[:, -1].argmax(-1)  # [B]
            finished = EqSpec.commit(out, rows, [[t] for t in token.tolist()], max_new_tokens, eos_token_id)
            if bool(finished.all()):
                return out
            # finished rows stay in the batch (masked out of nothing, ignored): no realignment at all
            position = mask.sum(1, keepdim=True)  # [B, 1]
            mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)
            logits, cache = call_model(target, token[:, None], mask, position, cache)
