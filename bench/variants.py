"""Decoder variants for the cost benchmark: a per-row-loop EQSPEC, timers, and a call counter.

Nothing here changes what a reference decoder computes: `EqSpecLoop` is EQSPEC with the
vectorized repad replaced by the paper-style Python loop over layers and rows, and the `Timed`
mixin only wraps methods with a (synchronizing) wall clock.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F

from specaudit.models.compat import cache_from_call, cache_from_tensors, cache_layers, cache_length, set_cache_layers
from specaudit.reference.batched import BatchedGreedy
from specaudit.reference.eqspec import BatchState, EqSpec, repad
from specaudit.reference.exspec import ExSpec
from specaudit.reference.lazy import LazySpec


def repad_loop(cache: Any, keep: torch.Tensor, active: torch.Tensor) -> torch.Tensor:
    """Unpad, append, repad, one row and one layer at a time (the paper's EQSPEC style).

    For every layer and every active row: slice the row's kept slots out ([H, n_b, D]), left-pad
    them with zeros to the new width W, then stack the rows. Same result as `specaudit.reference.eqspec.repad`
    on every kept slot; pad slots hold zeros instead of whatever the gather copied there (both
    are masked). Returns the new mask [B', W].
    """
    rows = active.tolist()
    lengths = [int(keep[b].sum()) for b in rows]
    width = max(lengths, default=0)
    layers = []
    for k, v in cache_layers(cache):  # [B, H, S_old, D]
        ks, vs = [], []
        for b, n in zip(rows, lengths):
            ks.append(F.pad(k[b][:, keep[b]], (0, 0, width - n, 0)))  # [H, W, D]
            vs.append(F.pad(v[b][:, keep[b]], (0, 0, width - n, 0)))
        if ks:
            layers.append((torch.stack(ks), torch.stack(vs)))  # [B', H, W, D]
        else:
            layers.append((k[:0, :, :0], v[:0, :, :0]))
    set_cache_layers(cache, layers)
    if not rows:
        return keep.new_zeros(0, 0, dtype=torch.long)
    return torch.stack([torch.cat([keep.new_zeros(width - n), keep.new_ones(n)]) for n in lengths]).long()


class EqSpecLoop(EqSpec):
    """EQSPEC whose realignment is a Python loop over layers and rows instead of one gather."""

    name = "EQSPEC-loop"

    @staticmethod
    def gather_rows(
        state: BatchState, keep: torch.Tensor, draft_keep: torch.Tensor, pending: torch.Tensor, finished: torch.Tensor
    ) -> BatchState:
        active = (~finished).nonzero()[:, 0]  # [B']
        mask = repad_loop(state.target_cache, keep, active)
        draft_mask = repad_loop(state.draft_cache, draft_keep, active)
        return BatchState(state.rows[active], mask, draft_mask, pending[active], state.target_cache, state.draft_cache)


def synchronizer(device: torch.device) -> Callable[[], None]:
    """What to call before reading a wall clock: waits for queued kernels on CUDA."""
    if device.type == "cuda":
        return torch.cuda.synchronize
    return lambda: None


class Timed:
    """Mixin: per-phase wall time of the last generate call (synchronized on CUDA).

    Phases: prefill, propose, verify, realign (EQSPEC-style decoders) and round (EXSPEC), all in
    seconds; `total` is the whole generate call. Reset with `reset_timers()`.
    """

    sync: Callable[[], None] = staticmethod(lambda: None)

    def reset_timers(self) -> None:
        self.times: dict[str, float] = defaultdict(float)
        self.counts: dict[str, int] = defaultdict(int)

    @contextmanager
    def timed(self, phase: str) -> Iterator[None]:
        self.sync()
        start = time.perf_counter()
        try:
            yield
        finally:
            self.sync()
            self.times[phase] += time.perf_counter() - start
            self.counts[phase] += 1

    def generate(self, *args: Any, **kwargs: Any) -> list[list[int]]:
        with self.timed("total"):
            return super().generate(*args, **kwargs)

    def prefill(self, *args: Any, **kwargs: Any) -> Any:
        with self.timed("prefill"):
            return super().prefill(*args, **kwargs)

    def propose(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        with self.timed("propose"):
            return super().propose(*args, **kwargs)

    def batch_verify(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        with self.timed("verify"):
            return super().batch_verify(*args, **kwargs)

    def realign(self, *args: Any, **kwargs: Any) -> BatchState:
        with self.timed("realign"):
            return super().realign(*args, **kwargs)

    def round(self, *args: Any, **kwargs: Any) -> set[int]:
        with self.timed("round"):
            return super().round(*args, **kwargs)


class TimedEqSpec(Timed, EqSpec):
    name = "EQSPEC"


class TimedEqSpecLoop(Timed, EqSpecLoop):
    name = "EQSPEC-loop"


class TimedLazySpec(Timed, LazySpec):
    name = "LazySpec"


class TimedExSpec(Timed, ExSpec):
    name = "EXSPEC"


class TimedBatchedGreedy(Timed, BatchedGreedy):
    name = "batched-greedy"


class CallCounter:
    """Counts a model's forward calls through a pre-hook: prefill (empty cache) apart from the rest."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.prefill = 0
        self.decode = 0
        self._handle = model.register_forward_pre_hook(self._hook, with_kwargs=True)

    def _hook(self, module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        if cache_length(cache_from_call(args, kwargs)) == 0:
            self.prefill += 1
        else:
            self.decode += 1

    def reset(self) -> None:
        self.prefill = self.decode = 0

    def remove(self) -> None:
        self._handle.remove()


def check_repad_loop(device: torch.device, seed: int = 0, trials: int = 20) -> dict[str, Any]:
    """`repad_loop` against `repad` on random caches and keep masks: same mask, same kept slots."""
    gen = torch.Generator().manual_seed(seed)
    for _ in range(trials):
        # drawn on the CPU (the generator's device) even under a CUDA default-device context
        cpu = {"generator": gen, "device": "cpu"}
        batch, slots = int(torch.randint(1, 9, (1,), **cpu)), int(torch.randint(1, 20, (1,), **cpu))
        keep = torch.rand(batch, slots, **cpu) < 0.7
        keep[:, -1] = True  # every row keeps at least its last slot
        finished = torch.rand(batch, **cpu) < 0.3
        active = (~finished).nonzero()[:, 0]
        layers = [
            (torch.randn(batch, 2, slots, 4, **cpu).to(device), torch.randn(batch, 2, slots, 4, **cpu).to(device))
        ]
        vec, loop = cache_from_tensors(layers), cache_from_tensors(layers)
        mask_vec = repad(vec, keep.to(device), active.to(device))
        mask_loop = repad_loop(loop, keep.to(device), active.to(device))
        if not torch.equal(mask_vec, mask_loop):
            return {"ok": False, "why": f"mask differs: got {mask_loop.tolist()}, but should be {mask_vec.tolist()}"}
        real = mask_vec.bool()[:, None, :, None]
        for (kv, vv), (kl, vl) in zip(cache_layers(vec), cache_layers(loop)):
            if kv.shape != kl.shape or not torch.equal(kv * real, kl * real) or not torch.equal(vv * real, vl * real):
                return {"ok": False, "why": "kept K/V slots differ between repad and repad_loop"}
    return {"ok": True, "trials": trials}
