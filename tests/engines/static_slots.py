"""A fixed-slot static batch (CUDA-graph style): every forward runs all `max_batch_size` rows.

Written from scratch (no reference code). Each model has one contiguous buffer per layer,
[slots, H, capacity, D]; slot s holds its request's slots 0..len_s - 1, left-aligned. Every
forward, prefill and decode alike, has exactly `max_batch_size` rows: rows with nothing to
do this forward (an empty slot, or a running request while newcomers are prefilled) are idle
rows fed the pad token. The cache passed is the buffer cut to the longest row (right-padded);
the new K/V a forward wrote are copied back into the buffer, only as far as they are kept.

Idle rows come in two flavours, one class each:
  - FixedSlotEngine: an idle row's attention mask is all zeros (it attends nothing);
  - FixedSlotPadEngine: an idle row attends its own pad input (one slot, position 0).

The draft is kept in lockstep with the target: K + 1 draft forwards per round (the last one
caches d_K, so a fully accepted round leaves the draft complete).
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import DynamicCache

from specaudit.models.compat import cache_from_tensors, cache_layers, call_model
from tests.engines.ledger import Ledger, LedgerEngine, Req, device_of, greedy_accept


class SlotBuffer:
    """One model's static per-slot K/V: per layer [slots, H, capacity, D], lengths per slot."""

    def __init__(self, slots: int) -> None:
        self.lengths = [0] * slots
        self.layers: list[tuple[torch.Tensor, torch.Tensor]] = []

    def view(self, width: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Every slot's first `width` entries, per layer [slots, H, width, D]."""
        return [(k[:, :, :width].clone(), v[:, :, :width].clone()) for k, v in self.layers]

    def write(self, slot: int, new: list[tuple[torch.Tensor, torch.Tensor]], keep: int) -> None:
        """Append the first `keep` of `new` (per layer [slots, H, T, D]) for `slot`."""
        if not keep:
            return
        start = self.lengths[slot]
        self.reserve(new, start + keep)
        for (k, v), (nk, nv) in zip(self.layers, new):
            k[slot, :, start : start + keep] = nk[slot, :, :keep]
            v[slot, :, start : start + keep] = nv[slot, :, :keep]
        self.lengths[slot] = start + keep

    def reserve(self, new: list[tuple[torch.Tensor, torch.Tensor]], needed: int) -> None:
        """Grow the capacity (doubling) so `needed` entries fit."""
        if not self.layers:
            self.layers = [(widened(k[:, :, :0], 8), widened(v[:, :, :0], 8)) for k, v in new]
        capacity = self.layers[0][0].shape[2]
        if needed > capacity:
            grow = max(needed, 2 * capacity) - capacity
            self.layers = [(widened(k, grow), widened(v, grow)) for k, v in self.layers]


def widened(x: torch.Tensor, extra: int) -> torch.Tensor:
    """`x` [S, H, C, D] with `extra` zero entries appended along C."""
    return torch.cat([x, x.new_zeros(*x.shape[:2], extra, x.shape[3])], 2)


class FixedSlotEngine(LedgerEngine):
    name = "fixed-slot engine"
    idle_attends_pad = False
    max_wait_steps = 0  # with a free slot a request is prefilled at once; every slot advances every step

    def __init__(
        self,
        target: Any,
        draft: Any,
        *,
        num_draft_tokens: int,
        eos_token_id: int | None,
        pad_token_id: int,
        max_batch_size: int = 3,
    ) -> None:
        self.target, self.draft = target, draft
        self.k, self.pad = num_draft_tokens, pad_token_id
        self.max_batch_size = max_batch_size
        self.ledger = Ledger(eos_token_id)
        self.slots: list[Req | None] = [None] * max_batch_size
        self.buffers = {"target": SlotBuffer(max_batch_size), "draft": SlotBuffer(max_batch_size)}

    def abort(self, request_id: int) -> None:
        self.ledger.drop(request_id)
        for s, req in enumerate(self.slots):
            if req is not None and req.rid == request_id:
                self.vacate(s)

    def vacate(self, slot: int) -> None:
        self.slots[slot] = None
        for buffer in self.buffers.values():
            buffer.lengths[slot] = 0

    @torch.no_grad()
    def step(self) -> dict[int, list[int]]:
        result: dict[int, list[int]] = {}
        self.admit(result)
        if any(req is not None for req in self.slots):
            self.round(result)
        return result

    def forward(self, role: str, inputs: dict[int, list[int]]) -> tuple[torch.Tensor, list[Any]]:
        """All slots in one forward; slots not in `inputs` are idle rows.

        Returns logits [slots, T, V] and the new K/V per layer [slots, H, T, D]."""
        model = self.target if role == "target" else self.draft
        buffer = self.buffers[role]
        rows = range(self.max_batch_size)
        past = max(buffer.lengths[s] for s in inputs)
        width = max(len(x) for x in inputs.values())
        ids, mask, positions = [], [], []
        for s in rows:
            x, n = inputs.get(s, []), buffer.lengths[s] if s in inputs else 0
            ids.append(x + [self.pad] * (width - len(x)))
            mask.append([1] * n + [0] * (past - n) + [1] * len(x) + [0] * (width - len(x)))
            positions.append(list(range(n, n + width)))
            if s not in inputs and self.idle_attends_pad:
                mask[-1][past] = 1  # the idle row's own pad input
        device = device_of(model)
        cache = cache_from_tensors(buffer.view(past)) if past else DynamicCache()
        logits, cache = call_model(
            model,
            torch.tensor(ids, device=device),  # [slots, T]
            torch.tensor(mask, device=device),  # [slots, P + T]
            torch.tensor(positions, device=device),  # [slots, T]
            cache,
        )
        return logits, [(k[:, :, past:], v[:, :, past:]) for k, v in cache_layers(cache)]

    def admit(self, result: dict[int, list[int]]) -> None:
        """Newcomers take free slots; both models prefill them (other slots idle)."""
        inputs: dict[int, list[int]] = {}
        for s in range(self.max_batch_size):
            if self.slots[s] is None and self.ledger.waiting:
                req = self.ledger.waiting.popleft()
                self.slots[s] = req
                self.ledger.running[req.rid] = req
                inputs[s] = req.prompt
        if not inputs:
            return
        logits, new = self.forward("target", inputs)
        _, draft_new = self.forward("draft", inputs)
        for s, prompt in inputs.items():
            self.buffers["target"].write(s, new, len(prompt))
            self.buffers["draft"].write(s, draft_new, len(prompt))
            req = self.slots[s]
            assert req is not None
            if self.ledger.emit(req, [int(logits[s, len(prompt) - 1].argmax())], result):
                self.vacate(s)

    def round(self, result: dict[int, list[int]]) -> None:
        """K + 1 draft forwards (the last caches d_K), one target forward, acceptance."""
        live = {s: req for s, req in enumerate(self.slots) if req is not None}
        inputs = {s: [req.out[-1]] for s, req in live.items()}
        drafts: dict[int, list[int]] = {s: [] for s in live}
        draft_new = []
        for i in range(self.k + 1):
            logits, new = self.forward("draft", inputs)
            draft_new.append(new)
            if i < self.k:
                for s in live:
                    drafts[s].append(int(logits[s, -1].argmax()))
                inputs = {s: [drafts[s][-1]] for s in live}
        verify = {s: [req.out[-1]] + drafts[s] for s, req in live.items()}
        logits, new = self.forward("target", verify)
        predicted = logits.argmax(-1).tolist()  # [slots, K + 1]
        for s, req in live.items():
            tokens = greedy_accept(drafts[s], predicted[s])
            keep = len(tokens)  # pending + accepted drafts
            self.buffers["target"].write(s, new, keep)
            for i in range(keep):  # draft forward i cached input i of [pending, d_1 .. d_K]
                self.buffers["draft"].write(s, draft_new[i], 1)
            if self.ledger.emit(req, tokens, result):
                self.vacate(s)


class FixedSlotPadEngine(FixedSlotEngine):
    name = "fixed-slot engine (idle rows attend a pad slot)"
    idle_attends_pad = True
