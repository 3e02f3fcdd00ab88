"""A correct batch speculative decoder that runs the target as body then head:
`target.model(...)` (the base model: embeddings, attention, cache, final norm) and then
`target.lm_head(hidden)`, as serving code that post-processes hidden states does.

The harness observes this: a base model called outside a top-level target call is recorded as
a target call (it holds all the attention and the cache); the head alone attends nothing.
Models without a separate body and head (the transparent fixtures) are called whole.
"""

from __future__ import annotations

from typing import Any

import torch

from specaudit.models.compat import cache_keyword
from tests.decoders.positional import MaskedSpec


def body_and_head(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Module] | None:
    body, head = getattr(model, "base_model", model), model.get_output_embeddings()
    return None if body is model or head is None else (body, head)


class SplitCall(MaskedSpec):
    """MaskedSpec whose target calls are `target.model(...)` then `target.lm_head(...)`."""

    name = "split-call"

    def forward(
        self, model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache: Any
    ) -> torch.Tensor:
        parts = body_and_head(model) if getattr(self, "_target", None) is model else None
        if parts is None:
            return super().forward(model, ids, mask, positions, cache)
        body, head = parts
        hidden = body(
            input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, **{cache_keyword(body): cache}
        ).last_hidden_state  # [B, T, H]
        return head(hidden)  # [B, T, V]

    def generate(self, target: torch.nn.Module, draft: torch.nn.Module, *args: Any, **kwargs: Any) -> list[list[int]]:
        self._target = target  # only the target is split; the draft is called whole
        try:
            return super().generate(target, draft, *args, **kwargs)
        finally:
            self._target = None
