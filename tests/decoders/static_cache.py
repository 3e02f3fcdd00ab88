"""A correct batch speculative decoder on a fixed-capacity transformers `StaticCache`.

The cache is allocated once per generate() for the longest run the case allows (prompt width
plus K + 1 slots per round, at most max_new_tokens - 1 rounds) and never resized: rows cannot
leave it, so a finished row stays in the batch and its further tokens are not committed.
A StaticCache's storage is its capacity; the model (and the harness) read its filled length.

Models whose forward cannot take a StaticCache (the transparent fixtures, which append to
their cache) get a DynamicCache and the same fixed-row discipline.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import DynamicCache, StaticCache

from tests.decoders.positional import MaskedSpec


def takes_static_cache(model: torch.nn.Module) -> bool:
    """HF marks the architectures whose forward runs on a static cache as compilable."""
    return bool(getattr(model, "_can_compile_fullgraph", False))


class StaticCacheSpec(MaskedSpec):
    """MaskedSpec on a StaticCache of fixed capacity, rows fixed for the whole run."""

    name = "static-cache"

    def new_cache(self, model: torch.nn.Module, capacity: int) -> Any:
        if not takes_static_cache(model):
            return DynamicCache()
        return StaticCache(config=model.config, max_cache_len=capacity)

    def retire(
        self, rows: torch.Tensor, mask: torch.Tensor, pending: torch.Tensor, caches: list[Any], done: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[Any]]:
        """A static cache keeps its rows: finished rows ride along, their tokens ignored by commit."""
        return rows, mask, pending, caches
