"""Forward hooks that record every call a decoder makes on the models it was given.

The decoder needs no cooperation: anything built on HF-style `model(...)` calls is seen.
Target calls keep a snapshot of the cache after the call, since decoders mutate caches in
place and the checks run after the decoder returns.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from specaudit.compat import cache_from_call, cache_layers, output_cache


@dataclass
class CallRecord:
    role: str  # "target" or "draft"
    index: int  # order among this role's calls
    input_ids: torch.Tensor | None  # [B, T] as passed
    attention_mask: torch.Tensor | None  # [B, P + T] as passed (None: HF attends everything)
    position_ids: torch.Tensor | None  # [B, T] as passed (None: HF uses P + arange(T))
    layer_lengths: tuple[int, ...]  # P of every cache layer before the call
    cache_batch: int | None  # rows in the cache before the call (None: empty cache)
    cache_after: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # [B, H, S, D]
    sampled: bool = True  # False: I1 only, no snapshot, I2 skipped (bounds the cost on real models)
    seconds: float = 0.0  # wall time of the forward itself

    @property
    def past_length(self) -> int:
        return self.layer_lengths[0] if self.layer_lengths else 0


@dataclass
class Recording:
    target_calls: list[CallRecord] = field(default_factory=list)
    draft_calls: list[CallRecord] = field(default_factory=list)


def _clone(x: Any) -> torch.Tensor | None:
    return _to_cpu(x) if isinstance(x, torch.Tensor) else None


def _to_cpu(x: torch.Tensor) -> torch.Tensor:
    return x.detach().to("cpu", copy=True)


def _pre_hook(role: str, calls: list[CallRecord], sample: Callable[[int], bool]) -> Any:
    def hook(module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        cache = cache_from_call(args, kwargs)
        layers = cache_layers(cache) if cache is not None else []
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        calls.append(
            CallRecord(
                role=role,
                index=len(calls),
                input_ids=_clone(input_ids),
                attention_mask=_clone(kwargs.get("attention_mask")),
                position_ids=_clone(kwargs.get("position_ids")),
                layer_lengths=tuple(int(k.shape[-2]) for k, _ in layers),
                cache_batch=int(layers[0][0].shape[0]) if layers else None,
                sampled=sample(len(calls)),
                seconds=-time.perf_counter(),
            )
        )

    return hook


def _post_hook(calls: list[CallRecord], snapshot: bool) -> Any:
    def hook(module: torch.nn.Module, args: tuple, kwargs: dict[str, Any], output: Any) -> None:
        if not calls:
            return
        call = calls[-1]
        cache = output_cache(output)
        if snapshot and call.sampled and cache is not None:
            # snapshots live on the CPU: a GPU model's full cache per call would not fit beside it
            call.cache_after = [(_to_cpu(k), _to_cpu(v)) for k, v in cache_layers(cache)]
        call.seconds += time.perf_counter()

    return hook


def every_call(index: int) -> bool:
    return True


@contextmanager
def instrument(
    target: torch.nn.Module, draft: torch.nn.Module | None, sample: Callable[[int], bool] = every_call
) -> Iterator[Recording]:
    """Record target and draft calls while the block runs; hooks are removed afterwards.

    `sample(i)` says whether target call i keeps a cache snapshot for I2; unsampled calls
    are still recorded and checked for I1.
    """
    recording = Recording()
    handles = [
        target.register_forward_pre_hook(_pre_hook("target", recording.target_calls, sample), with_kwargs=True),
        target.register_forward_hook(_post_hook(recording.target_calls, snapshot=True), with_kwargs=True),
    ]
    if draft is not None and draft is not target:
        handles += [
            draft.register_forward_pre_hook(_pre_hook("draft", recording.draft_calls, every_call), with_kwargs=True),
            draft.register_forward_hook(_post_hook(recording.draft_calls, snapshot=False), with_kwargs=True),
        ]
    try:
        yield recording
    finally:
        for handle in handles:
            handle.remove()
