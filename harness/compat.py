"""One portable layer over the transformers cache API (4.51 through 5.x).

Everything in specaudit that touches a cache goes through here, so a transformers
release that moves the API again is fixed in one place.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch
from transformers import DynamicCache


def cache_layers(cache: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per-layer (keys, values), each [B, H, S, D], read by either API generation."""
    if hasattr(cache, "layers"):
        return [(layer.keys, layer.values) for layer in cache.layers if getattr(layer, "keys", None) is not None]
    return list(zip(cache.key_cache, cache.value_cache, strict=True))


def set_cache_layers(cache: Any, kv: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Replace every layer's tensors in place (realignment writes through this)."""
    if hasattr(cache, "layers"):
        for layer, (k, v) in zip(cache.layers, kv, strict=True):
            layer.keys, layer.values = k, v
    else:
        cache.key_cache[:] = [k for k, _ in kv]
        cache.value_cache[:] = [v for _, v in kv]


def cache_from_tensors(kv: list[tuple[torch.Tensor, torch.Tensor]]) -> DynamicCache:
    """Build a DynamicCache from per-layer tensors; `DynamicCache(pairs)` works in every version."""
    return DynamicCache([(k, v) for k, v in kv])


def cache_length(cache: Any) -> int:
    """Slots per row (S), 0 for an empty or missing cache."""
    if cache is None:
        return 0
    layers = cache_layers(cache)
    return int(layers[0][0].shape[-2]) if layers else 0


def cache_batch_size(cache: Any) -> int | None:
    layers = cache_layers(cache) if cache is not None else []
    return int(layers[0][0].shape[0]) if layers else None


def drop_last(cache: Any, n: int) -> None:
    """Remove the last n slots of every row (negative crop; crop(0) differs across versions)."""
    if n > 0:
        cache.crop(-n)


def select_rows(cache: Any, rows: torch.Tensor) -> None:
    """Keep only `rows` (a 1-D index tensor), in that order, in every layer."""
    cache.batch_select_indices(rows)


@functools.lru_cache(maxsize=64)
def _cache_keyword(forward: Any) -> str:
    params = inspect.signature(forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def cache_keyword(model: torch.nn.Module) -> str:
    """`cache` from 5.24 on, `past_key_values` before: read from the model's own signature."""
    return _cache_keyword(type(model).forward)


def call_model(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    position_ids: torch.Tensor | None,
    cache: Any,
) -> tuple[torch.Tensor, Any]:
    """One forward with a cache; returns (logits [B, T, V], cache)."""
    kwargs: dict[str, Any] = {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "use_cache": True,
        cache_keyword(model): cache,
    }
    if position_ids is not None:
        kwargs["position_ids"] = position_ids
    out = model(**kwargs)
    return out.logits, output_cache(out)


def output_cache(output: Any) -> Any:
    """The cache a forward returned: `.cache` from 5.24 on (`.past_key_values` warns there)."""
    if "cache" in getattr(type(output), "__dataclass_fields__", {}):
        return output.cache
    return getattr(output, "past_key_values", None)


def causal_lm_output(logits: torch.Tensor, cache: Any) -> Any:
    """A CausalLMOutputWithPast under whichever field name this transformers uses."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    name = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"
    return CausalLMOutputWithPast(logits=logits, **{name: cache})


def cache_from_call(args: tuple, kwargs: dict[str, Any]) -> Any:
    """The cache object passed to a forward, under either keyword."""
    for key in ("cache", "past_key_values"):
        if kwargs.get(key) is not None:
            return kwargs[key]
    return None
