"""EQSPEC and EXSPEC as step-wise engines: requests arrive, finish and leave while the batch runs.

Both are compositions of the batch references (`reference/eqspec.py`, `reference/exspec.py`):
the round is theirs (propose, batch_verify, accept, commit, realign); what is added is the
engine contract (see `specaudit.contracts.engine`) and admission between rounds.

  - EqSpecEngine: one left-padded batch. A newcomer is prefilled in a forward of its own
    (EQSPEC's prefill over the newcomers only), then repadded into the running batch: both
    caches are left-padded to the wider of the two and stacked, masks padded with zeros, so
    every row keeps its own positions (mask sums). Finished and aborted rows are gathered out
    (EQSPEC's gather_rows). Every running request advances every step.
  - ExSpecEngine: EXSPEC's pool. A newcomer is prefilled and takes a free slot of the pool
    (a slot table with a free list); EXSPEC's scheduler picks each step's batch from it.
  - LazySpecEngine: EqSpecEngine with LazySpec's rounds (`reference/lazy.py`): rejected slots
    stay in the cache, masked, and are compacted only when waste passes a threshold, so a
    newcomer is repadded into a batch whose rows are full of masked holes.

A step is: admit (prefill newcomers, emit their first token), then one round over the batch.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any

import torch
import torch.nn.functional as F

from specaudit.models.compat import cache_from_tensors, cache_layers
from specaudit.reference.eqspec import BatchState, EqSpec
from specaudit.reference.exspec import ExSpec, Sequence
from specaudit.reference.lazy import LazySpec


class EngineLedger:
    """Requests, per-request limits and emissions: the bookkeeping shared by both engines.

    `commit` replaces EQSPEC's (one limit for the batch) by a per-request limit; `out` maps a
    request id to its tokens so far, so the batch references' `out[row]` reads a request.
    """

    target: torch.nn.Module
    draft: torch.nn.Module

    def setup(
        self,
        target: torch.nn.Module,
        draft: torch.nn.Module,
        num_draft_tokens: int,
        eos_token_id: int | None,
        pad_token_id: int,
    ) -> None:
        self.target, self.draft = target, draft
        self.k, self.eos, self.pad = num_draft_tokens, eos_token_id, pad_token_id
        self.limits: dict[int, int] = {}
        self.out: dict[int, list[int]] = {}
        self.waiting: deque[tuple[int, tuple[int, ...]]] = deque()

    def add_request(self, request_id: int, prompt_ids: list[int], max_new_tokens: int) -> None:
        self.limits[request_id] = max_new_tokens
        self.out[request_id] = []
        self.waiting.append((request_id, tuple(prompt_ids)))

    def commit(
        self,
        out: dict[int, list[int]],
        rows: torch.Tensor,
        new_tokens: list[list[int]],
        max_new_tokens: int,
        eos_token_id: int | None,
    ) -> torch.Tensor:
        """EQSPEC's commit, row by row with each request's own max_new_tokens. [B] finished"""
        flags = [
            bool(EqSpec.commit(out, rows[i : i + 1], [tokens], self.limits[r], eos_token_id)[0])
            for i, (r, tokens) in enumerate(zip(rows.tolist(), new_tokens))
        ]
        return torch.tensor(flags, dtype=torch.bool)

    def emitted(self, before: dict[int, int]) -> dict[int, list[int]]:
        """What each request gained since `before` (request id -> length)."""
        return {r: self.out[r][n:] for r, n in before.items() if len(self.out[r]) > n}

    def lengths(self) -> dict[int, int]:
        return {r: len(tokens) for r, tokens in self.out.items()}

    def take_waiting(self, room: int) -> list[tuple[int, tuple[int, ...]]]:
        return [self.waiting.popleft() for _ in range(min(room, len(self.waiting)))]

    def drop_waiting(self, request_id: int) -> bool:
        kept = [w for w in self.waiting if w[0] != request_id]
        dropped = len(kept) < len(self.waiting)
        self.waiting = deque(kept)
        return dropped

    def left_padded(self, prompts: list[tuple[int, ...]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Newcomers' prompts as a left-padded batch: (input_ids, attention_mask), both [N, T]."""
        width = max(len(p) for p in prompts)
        device = next(self.target.parameters()).device
        ids = torch.tensor([[self.pad] * (width - len(p)) + list(p) for p in prompts], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
        return ids, mask


def pad_left(x: torch.Tensor, width: int, dim: int, value: int = 0) -> torch.Tensor:
    """Left-pad `x` along `dim` to `width` with `value`."""
    extra = width - x.shape[dim]
    if extra <= 0:
        return x
    pad = [0, 0] * (x.dim() - 1 - dim) + [extra, 0]
    return F.pad(x, pad, value=value)


def stack_caches(caches: list[Any], width: int) -> Any:
    """Left-pad each cache's layers to `width` slots and stack the rows. [sum B, H, width, D]"""
    per_cache = [cache_layers(c) for c in caches]
    layers = []
    for layer in range(len(per_cache[0])):
        ks = [pad_left(kv[layer][0], width, 2) for kv in per_cache]
        vs = [pad_left(kv[layer][1], width, 2) for kv in per_cache]
        layers.append((torch.cat(ks), torch.cat(vs)))
    return cache_from_tensors(layers)


class EqSpecEngine(EngineLedger, EqSpec):
    """EQSPEC with admission between rounds: newcomers are repadded into the running batch."""

    name = "EQSPEC engine"
    max_wait_steps = 0  # a request with room is admitted at the next step; every running row advances every step

    def __init__(
        self,
        target: torch.nn.Module,
        draft: torch.nn.Module,
        *,
        num_draft_tokens: int,
        eos_token_id: int | None,
        pad_token_id: int,
        max_batch_size: int = 4,
    ) -> None:
        self.setup(target, draft, num_draft_tokens, eos_token_id, pad_token_id)
        self.max_batch_size = max_batch_size
        self.state: BatchState | None = None

    def running(self) -> int:
        return 0 if self.state is None else int(self.state.rows.numel())

    def has_unfinished(self) -> bool:
        return bool(self.waiting) or self.running() > 0

    @torch.no_grad()
    def step(self) -> dict[int, list[int]]:
        before = self.lengths()
        self.admit()
        if self.running():
            self.round()
        return self.emitted(before)

    def abort(self, request_id: int) -> None:
        if self.drop_waiting(request_id) or self.state is None:
            return
        gone = self.state.rows == request_id  # [B]
        if bool(gone.any()):
            self.keep_rows(
                self.gather_rows(
                    self.state, self.state.mask.bool(), self.state.draft_mask.bool(), self.state.pending, gone
                )
            )

    # -- admission -----------------------------------------------------------------------

    def admission_room(self) -> int:
        return self.max_batch_size - self.running()

    def admit(self) -> None:
        """Prefill the newcomers that fit in a forward of their own, emit their first token,
        and repad the unfinished ones into the running batch."""
        newcomers = self.take_waiting(self.admission_room())
        if not newcomers:
            return
        ids, mask = self.left_padded([p for _, p in newcomers])  # [N, T]
        fresh, first = self.prefill(self.target, self.draft, ids, mask)
        fresh.rows = torch.tensor([r for r, _ in newcomers])
        finished = self.commit(self.out, fresh.rows, [[t] for t in first.tolist()], 0, self.eos)
        fresh = self.drop_finished(fresh, finished)
        if fresh.rows.numel():
            self.state = fresh if self.state is None else self.merge(self.state, fresh)

    def merge(self, running: BatchState, fresh: BatchState) -> BatchState:
        """Repad: left-pad both batches' caches and masks to the wider one, stack the rows."""
        width = max(running.mask.shape[1], fresh.mask.shape[1])
        draft_width = max(running.draft_mask.shape[1], fresh.draft_mask.shape[1])
        return BatchState(
            torch.cat([running.rows, fresh.rows]),
            self.merged_mask(running.mask, fresh.mask, width),
            self.merged_mask(running.draft_mask, fresh.draft_mask, draft_width),
            torch.cat([running.pending, fresh.pending]),
            stack_caches([running.target_cache, fresh.target_cache], width),
            stack_caches([running.draft_cache, fresh.draft_cache], draft_width),
        )

    def merged_mask(self, running: torch.Tensor, fresh: torch.Tensor, width: int) -> torch.Tensor:
        """[B_r + B_f, width]: each row's mask left-padded with zeros."""
        return torch.cat([pad_left(running, width, 1), pad_left(fresh, width, 1)])

    # -- one round -------------------------------------------------------------------------

    def round(self) -> None:
        """EQSPEC's round on the running batch: propose, verify, accept, commit, realign."""
        state = self.state
        assert state is not None
        drafts = self.propose(self.draft, state, self.k)  # [B, K]
        predicted = self.batch_verify(self.target, state, drafts)  # [B, K + 1]
        accepted, bonus = self.accept(drafts, predicted)
        new_tokens = [d[:a] + [b] for d, a, b in zip(drafts.tolist(), accepted.tolist(), bonus.tolist())]
        finished = self.commit(self.out, state.rows, new_tokens, 0, self.eos)
        self.keep_rows(self.realign(state, accepted, bonus, self.k, finished))

    def keep_rows(self, state: BatchState) -> None:
        self.state = state if state.rows.numel() else None


class ExSpecEngine(EngineLedger, ExSpec):
    """EXSPEC with admission between rounds: a newcomer takes a free slot of the pool."""

    name = "EXSPEC engine"

    def __init__(
        self,
        target: torch.nn.Module,
        draft: torch.nn.Module,
        *,
        num_draft_tokens: int,
        eos_token_id: int | None,
        pad_token_id: int,
        batch_size: int = 2,
        window: int = 4,
        max_wait: int = 2,
    ) -> None:
        ExSpec.__init__(self, batch_size, window, max_wait)
        self.setup(target, draft, num_draft_tokens, eos_token_id, pad_token_id)
        self.slots: list[Sequence | None] = [None] * window  # the pool, by slot
        self.free: list[int] = list(range(window))  # free slots, lowest first
        self.arrival: dict[int, int] = {}  # request id -> admission order (the scheduler's "oldest first")

    @property
    def max_wait_steps(self) -> int:
        """Steps a running request can be left out: max_wait, then behind the forced ones
        (at most window / batch_size batches of them); admission is at the next step."""
        return self.max_wait + math.ceil(self.window / self.batch_size)

    def has_unfinished(self) -> bool:
        return bool(self.waiting) or any(s is not None for s in self.slots)

    def active(self) -> list[Sequence]:
        return sorted((s for s in self.slots if s is not None), key=lambda s: self.arrival[s.row])

    @torch.no_grad()
    def step(self) -> dict[int, list[int]]:
        before = self.lengths()
        self.admit()
        active = self.active()
        if active:
            batch = self.schedule(active)
            finished = self.round(self.target, self.draft, batch, self.k, self.out, 0, self.eos)
            for s in active:
                s.waited = 0 if s in batch else s.waited + 1
            for s in batch:
                if s.row in finished:
                    self.release(s.row)
        return self.emitted(before)

    def abort(self, request_id: int) -> None:
        if not self.drop_waiting(request_id):
            self.release(request_id)

    def admit(self) -> None:
        """EXSPEC's prefill for the newcomers that fit, each into a free slot."""
        newcomers = self.take_waiting(len(self.free))
        if not newcomers:
            return
        ids, mask = self.left_padded([p for _, p in newcomers])
        rows = [r for r, _ in newcomers]
        fresh = self.prefill_rows(self.target, self.draft, ids, mask, rows)
        done = self.commit(self.out, torch.tensor(rows), [[s.pending] for s in fresh], 0, self.eos)
        for s, d in zip(fresh, done.tolist()):
            if not d:
                self.arrival[s.row] = len(self.arrival)
                self.slots[self.free.pop(0)] = s

    def release(self, request_id: int) -> None:
        """Empty the request's slot and return it to the free list."""
        for slot, s in enumerate(self.slots):
            if s is not None and s.row == request_id:
                self.slots[slot] = None
                self.free = sorted({*self.free, self.freed_slot(slot)})
                return

    def freed_slot(self, slot: int) -> int:
        """The free-list entry for an emptied slot (a planted bug's hook)."""
        return slot


class LazySpecEngine(EqSpecEngine, LazySpec):
    """EqSpecEngine whose rounds mask rejected slots instead of realigning (LazySpec's realign)."""

    name = "LazySpec engine"

    def __init__(
        self, target: torch.nn.Module, draft: torch.nn.Module, *, compact_above: float = 0.5, **engine: Any
    ) -> None:
        super().__init__(target, draft, **engine)
        LazySpec.__init__(self, compact_above)


__all__ = ["EngineLedger", "EqSpecEngine", "ExSpecEngine", "LazySpecEngine", "pad_left", "stack_caches"]
