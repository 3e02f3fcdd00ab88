"""Chunked prefill and round-robin scheduling over a bounded batch.

Written from scratch (no reference code). Up to `window` requests hold a slot of a per-model
pool (per layer [window, H, capacity, D], each slot's entries left-aligned); each step runs at
most `max_batch_size` of them, least recently served first. A request's prompt is prefilled
two tokens per step, by both models, before it decodes: its first token comes with its last
chunk. A forward gathers its rows' slots left-padded (pasts right-aligned to the longest),
inputs left-aligned after them with trailing pads masked, explicit positions; the kept new
K/V are copied back into the pool.

Declared honestly: at most `max_batch_size` rows per step, and while no more than that many
requests are unfinished each is served every step, so a request waits at most
ceil(len(prompt) / 2) - 1 steps for its first token: `max_wait_steps` = 2 holds for prompts of
up to 6 tokens (the engine machine draws at most 5).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache

from specaudit.models.compat import cache_from_tensors, cache_layers, call_model
from tests.engines.ledger import Ledger, LedgerEngine, Req, device_of, greedy_accept

CHUNK = 2


@dataclass
class Slot:
    req: Req
    admitted: int  # admission order
    served: int = -1  # step last run
    cursor: int = 0  # prompt tokens prefilled


class Pool:
    """One model's K/V by slot, [window, H, capacity, D] per layer, and filled lengths."""

    def __init__(self, window: int) -> None:
        self.lengths = [0] * window
        self.layers: list[tuple[torch.Tensor, torch.Tensor]] = []

    def gather(self, slots: list[int], width: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The slots' entries right-aligned in zeros, [B, H, width, D] per layer."""
        out = []
        for k, v in self.layers:
            ks = k.new_zeros(len(slots), k.shape[1], width, k.shape[3])
            vs = torch.zeros_like(ks)
            for row, s in enumerate(slots):
                n = self.lengths[s]
                if n:
                    ks[row, :, width - n :] = k[s, :, :n]
                    vs[row, :, width - n :] = v[s, :, :n]
            out.append((ks, vs))
        return out

    def put(self, slot: int, new: list[tuple[torch.Tensor, torch.Tensor]], keep: int) -> None:
        """Append the first `keep` entries of `new` (per layer [H, T, D]) to `slot`."""
        start = self.lengths[slot]
        if not self.layers:
            window = len(self.lengths)
            self.layers = [
                (x.new_zeros(window, x.shape[0], 16, x.shape[2]), y.new_zeros(window, y.shape[0], 16, y.shape[2]))
                for x, y in new
            ]
        while start + keep > self.layers[0][0].shape[2]:  # double the capacity
            self.layers = [(doubled(k), doubled(v)) for k, v in self.layers]
        for (k, v), (nk, nv) in zip(self.layers, new):
            k[slot, :, start : start + keep] = nk[:, :keep]
            v[slot, :, start : start + keep] = nv[:, :keep]
        self.lengths[slot] = start + keep


def doubled(x: torch.Tensor) -> torch.Tensor:
    """`x` [W, H, C, D] with its capacity C doubled (zeros appended)."""
    return torch.cat([x, torch.zeros_like(x)], 2)


class ChunkedRoundRobinEngine(LedgerEngine):
    name = "chunked round-robin engine"
    max_wait_steps = 2

    def __init__(
        self,
        target: Any,
        draft: Any,
        *,
        num_draft_tokens: int,
        eos_token_id: int | None,
        pad_token_id: int,
        max_batch_size: int = 2,
        window: int = 4,
    ) -> None:
        self.models = {"target": target, "draft": draft}
        self.k, self.pad = num_draft_tokens, pad_token_id
        self.max_batch_size = max_batch_size
        self.ledger = Ledger(eos_token_id)
        self.slots: list[Slot | None] = [None] * window
        self.pools = {"target": Pool(window), "draft": Pool(window)}
        self.steps = 0
        self.admissions = 0

    def abort(self, request_id: int) -> None:
        self.ledger.drop(request_id)
        for s, slot in enumerate(self.slots):
            if slot is not None and slot.req.rid == request_id:
                self.vacate(s)

    def vacate(self, s: int) -> None:
        self.slots[s] = None
        for pool in self.pools.values():
            pool.lengths[s] = 0

    @torch.no_grad()
    def step(self) -> dict[int, list[int]]:
        self.steps += 1
        for s in range(len(self.slots)):
            if self.slots[s] is None and self.ledger.waiting:
                req = self.ledger.waiting.popleft()
                self.ledger.running[req.rid] = req
                self.slots[s] = Slot(req, self.admissions)
                self.admissions += 1
        occupied = {s: slot for s, slot in enumerate(self.slots) if slot is not None}
        chosen = sorted(occupied, key=lambda s: (occupied[s].served, occupied[s].admitted))[: self.max_batch_size]
        for s in chosen:
            occupied[s].served = self.steps
        result: dict[int, list[int]] = {}
        prefilling = [s for s in chosen if occupied[s].cursor < len(occupied[s].req.prompt)]
        decoding = [s for s in chosen if s not in prefilling]
        if prefilling:
            self.chunk([(s, occupied[s]) for s in prefilling], result)
        if decoding:
            self.round([(s, occupied[s].req) for s in decoding], result)
        return result

    def forward(self, role: str, slots: list[int], inputs: list[list[int]]) -> tuple[torch.Tensor, list[Any]]:
        """Logits [B, T, V] and the new K/V per layer [B, H, T, D]."""
        model, pool = self.models[role], self.pools[role]
        lengths = [pool.lengths[s] for s in slots]
        past, width = max(lengths), max(len(x) for x in inputs)
        device = device_of(model)
        ids = torch.tensor([x + [self.pad] * (width - len(x)) for x in inputs], device=device)  # [B, T]
        mask = torch.tensor(
            [[0] * (past - n) + [1] * n + [1] * len(x) + [0] * (width - len(x)) for n, x in zip(lengths, inputs)],
            device=device,
        )  # [B, P + T]
        positions = torch.tensor(lengths, device=device)[:, None] + torch.arange(width, device=device)  # [B, T]
        cache = cache_from_tensors(pool.gather(slots, past)) if past else DynamicCache()
        logits, cache = call_model(model, ids, mask, positions, cache)
        return logits, [(k[:, :, past:], v[:, :, past:]) for k, v in cache_layers(cache)]

    def keep(self, role: str, slot: int, row: int, new: list[Any], n: int) -> None:
        if n:
            self.pools[role].put(slot, [(k[row], v[row]) for k, v in new], n)

    def chunk(self, rows: list[tuple[int, Slot]], result: dict[int, list[int]]) -> None:
        """The next CHUNK prompt tokens of each row, through both models; the last chunk emits."""
        slots = [s for s, _ in rows]
        inputs = [e.req.prompt[e.cursor : e.cursor + CHUNK] for _, e in rows]
        logits, new = self.forward("target", slots, inputs)
        _, draft_new = self.forward("draft", slots, inputs)
        for row, ((s, e), x) in enumerate(zip(rows, inputs)):
            self.keep("target", s, row, new, len(x))
            self.keep("draft", s, row, draft_new, len(x))
            e.cursor += len(x)
            if e.cursor < len(e.req.prompt):
                continue
            if self.ledger.emit(e.req, [int(logits[row, len(x) - 1].argmax())], result):
                self.vacate(s)

    def round(self, rows: list[tuple[int, Req]], result: dict[int, list[int]]) -> None:
        """Draft catch-up and K proposals, one target verification, acceptance."""
        slots, reqs = [s for s, _ in rows], [r for _, r in rows]
        inputs = [r.history()[self.pools["draft"].lengths[s] :] for s, r in zip(slots, reqs)]
        drafts: list[list[int]] = [[] for _ in slots]
        for _ in range(self.k):
            logits, new = self.forward("draft", slots, inputs)
            for row, (s, x) in enumerate(zip(slots, inputs)):
                self.keep("draft", s, row, new, len(x))
                drafts[row].append(int(logits[row, len(x) - 1].argmax()))
            inputs = [[d[-1]] for d in drafts]
        logits, new = self.forward("target", slots, [[r.out[-1]] + d for r, d in zip(reqs, drafts)])
        predicted = logits.argmax(-1).tolist()  # [B, K + 1]
        for row, (s, req, d) in enumerate(zip(slots, reqs, drafts)):
            tokens = greedy_accept(d, predicted[row])
            self.keep("target", s, row, new, len(tokens))
            right = len(req.history()) + min(len(tokens) - 1, self.k - 1)  # draft entries still right
            self.pools["draft"].lengths[s] = min(self.pools["draft"].lengths[s], right)
            if self.ledger.emit(req, tokens, result):
                self.vacate(s)
