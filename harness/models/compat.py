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
    """Per-layer (keys, values), each [B, H, S, D], read by either API generation (or a legacy tuple).

    S is the storage width: a StaticCache's capacity, not its filled length (see `layer_lengths`).
    """
    if hasattr(cache, "layers"):
        return [(layer.keys, layer.values) for layer in cache.layers if getattr(layer, "keys", None) is not None]
    if isinstance(cache, (tuple, list)):
        return [(layer[0], layer[1]) for layer in cache]
    return list(zip(cache.key_cache, cache.value_cache, strict=True))


def layer_lengths(cache: Any) -> tuple[int, ...]:
    """Filled slots per layer (P): what the model attends and the mask must cover.

    A DynamicCache's filled length is its width; a StaticCache preallocates its capacity and
    tracks how far it is written (`get_seq_length`), so reading the width would take capacity
    for length.
    """
    if cache is None:
        return ()
    if hasattr(cache, "layers"):
        return tuple(_layer_length(layer) for layer in cache.layers if getattr(layer, "keys", None) is not None)
    layers = cache_layers(cache)
    if hasattr(cache, "get_seq_length") and not isinstance(cache, (tuple, list)):  # 4.51-4.55 key_cache lists
        return tuple(min(int(cache.get_seq_length(i)), int(k.shape[-2])) for i, (k, _) in enumerate(layers))
    return tuple(int(k.shape[-2]) for k, _ in layers)


def _layer_length(layer: Any) -> int:
    width = int(layer.keys.shape[-2])
    filled = layer.get_seq_length() if hasattr(layer, "get_seq_length") else width
    return min(int(filled), width)


def filled_layers(cache: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per-layer (keys, values) cut to their filled length, each [B, H, P, D]."""
    return [(k[..., :n, :], v[..., :n, :]) for (k, v), n in zip(cache_layers(cache), layer_lengths(cache))]


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
    """Filled slots per row (P) of the first layer, 0 for an empty or missing cache."""
    lengths = layer_lengths(cache)
    return lengths[0] if lengths else 0


def select_rows(cache: Any, rows: torch.Tensor) -> None:
    """Keep only `rows` (a 1-D index tensor), in that order, in every layer."""
    cache.batch_select_indices(rows)


def crop_cache(cache: Any, keep: int) -> None:
    """Keep only the first `keep` slots of every layer, in place (a rollback after rejected drafts).

    Only a negative `crop(-n)` means "drop the last n" in every version: a positive argument
    means "keep n" before 5.15 and is refused from 5.20, and `crop(0)` empties the cache before
    5.15 but does nothing after; so the count to drop is computed and passed only when > 0.
    """
    drop = cache_length(cache) - keep
    if drop > 0:
        cache.crop(-drop)


@functools.lru_cache(maxsize=64)
def _cache_keyword(forward: Any) -> str:
    params = inspect.signature(forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def cache_keyword(model: torch.nn.Module) -> str:
    """`cache` from 5.24 on, `past_key_values` before: read from the model's own signature."""
    return _cache_keyword(type(model).forward)


@functools.lru_cache(maxsize=64)
def _keeps_logits(forward: Any) -> bool:
    return "logits_to_keep" in inspect.signature(forward).parameters


def last_logits(model: torch.nn.Module, input_ids: torch.Tensor, keep: int) -> torch.Tensor:
    """Logits [1, keep, V] of the last `keep` positions of one batch-size-1 forward at positions
    0..n-1, the LM head skipped over the rest where the model allows it (`logits_to_keep`)."""
    positions = torch.arange(input_ids.shape[1], device=input_ids.device)[None]  # [1, n]
    kwargs: dict[str, Any] = {"logits_to_keep": keep} if _keeps_logits(type(model).forward) else {}
    logits, _ = call_model(model, input_ids, torch.ones_like(input_ids), positions, None, **kwargs)
    return logits[:, -keep:]


def call_model(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    position_ids: torch.Tensor | None,
    cache: Any,
    **extra: Any,
) -> tuple[torch.Tensor, Any]:
    """One forward with a cache (None: without one); returns (logits [B, T, V], cache)."""
    kwargs: dict[str, Any] = {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "use_cache": cache is not None,
        **({} if cache is None else {cache_keyword(model): cache}),
        **extra,
    }
    if position_ids is not None:
        kwargs["position_ids"] = position_ids
    out = model(**kwargs)
    return out.logits, output_cache(out)


def output_cache(output: Any) -> Any:
    """The cache a forward returned: `.cache` from 5.24 on (`.past_key_values` warns there);
    with `return_dict=False`, the tuple's cache entry."""
    if "cache" in getattr(type(output), "__dataclass_fields__", {}):
        return output.cache
    if isinstance(output, tuple) and not hasattr(output, "_fields"):
        return next((x for x in output if hasattr(x, "layers") or hasattr(x, "key_cache")), None)
    return getattr(output, "past_key_values", None)


def causal_lm_output(logits: torch.Tensor, cache: Any) -> Any:
    """A CausalLMOutputWithPast under whichever field name this transformers uses."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    name = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"
    return CausalLMOutputWithPast(logits=logits, **{name: cache})


def cache_from_call(args: tuple, kwargs: dict[str, Any]) -> Any:
    """The cache object passed to a forward by keyword, under either name (positional caches:
    bind the call with `call_arguments` and use `cache_argument`)."""
    return cache_argument(kwargs)


def cache_argument(arguments: dict[str, Any]) -> Any:
    """The cache among a call's bound arguments, under any name (a decoder layer's included)."""
    for key in ("cache", "past_key_values", "past_key_value", "layer_past"):
        if arguments.get(key) is not None:
            return arguments[key]
    return None


def forward_signature(model: torch.nn.Module) -> inspect.Signature | None:
    """The signature calls of `model` bind to (decorators followed; None if unreadable)."""
    try:
        return inspect.signature(model.forward)
    except (TypeError, ValueError):
        return None


def call_arguments(signature: inspect.Signature | None, args: tuple, kwargs: dict[str, Any]) -> dict[str, Any]:
    """A forward's arguments by parameter name, positional or keyword, `**kwargs` flattened.

    `model(ids, mask, pos, cache)` is as valid a Hugging Face call as the keyword form; a
    keyword the signature only takes through `**kwargs` (`past_key_values=` on 5.24) keeps
    its own name. A call that does not bind keeps what can be placed.
    """
    if signature is None:
        return dict(kwargs, **({"input_ids": args[0]} if args else {}))
    if not args:  # what binding keywords alone gives (the common call), without inspect's cost
        return dict(kwargs)
    try:
        bound = signature.bind_partial(*args, **kwargs)
    except TypeError:
        return dict(kwargs, **({"input_ids": args[0]} if args else {}))
    arguments = dict(bound.arguments)
    for name, param in signature.parameters.items():
        if param.kind is inspect.Parameter.VAR_KEYWORD and name in arguments:
            arguments.update(arguments.pop(name))
        elif param.kind is inspect.Parameter.VAR_POSITIONAL:
            arguments.pop(name, None)
    return arguments
