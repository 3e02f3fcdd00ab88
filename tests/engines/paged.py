"""A paged-KV engine: a block pool per model, per-request block tables, right-padded gathers.

Written from scratch (no reference code). Each model's K/V live in a pool of fixed-size blocks
(per layer [N, H, block, D]); a request owns a block table. A forward gathers its rows' blocks
into one contiguous, right-padded cache [B, H, P, D] (row r's slots 0..len_r - 1, then zeros),
passes a 2-D mask that hides the padding and explicit position ids, and afterwards scatters
only the slots worth keeping back into the request's blocks; the forward's cache is thrown away.

The draft's pool lags: before proposing, each row feeds the draft whatever of its history the
draft has not cached yet (the whole prompt for a newcomer). A newcomer is prefilled by the
target in a forward of its own, emits its first token and joins that step's round.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import DynamicCache

from specaudit.models.compat import cache_from_tensors, cache_layers, call_model
from tests.engines.ledger import Ledger, LedgerEngine, Req, device_of, greedy_accept


class BlockPool:
    """Fixed-size K/V blocks for one model; block tables and filled lengths per request."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.keys: list[torch.Tensor] = []  # per layer [N, H, block, D]
        self.values: list[torch.Tensor] = []
        self.free: list[int] = []
        self.tables: dict[int, list[int]] = {}
        self.lengths: dict[int, int] = {}

    def length(self, rid: int) -> int:
        return self.lengths.get(rid, 0)

    def gather(self, rids: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Right-padded contiguous K/V per layer, [B, H, P, D] with P the longest row."""
        width = max(self.length(r) for r in rids)
        layers = []
        for pool_k, pool_v in zip(self.keys, self.values):
            ks, vs = [], []
            for r in rids:
                ks.append(self.row(pool_k, r, width))
                vs.append(self.row(pool_v, r, width))
            layers.append((torch.stack(ks), torch.stack(vs)))
        return layers

    def row(self, pool: torch.Tensor, rid: int, width: int) -> torch.Tensor:
        """One request's slots [H, width, D], zeros past its length."""
        heads, dim = pool.shape[1], pool.shape[3]
        out = pool.new_zeros(heads, width, dim)
        n = self.length(rid)
        if n:
            blocks = pool[self.tables[rid]]  # [nb, H, block, D]
            out[:, :n] = blocks.permute(1, 0, 2, 3).reshape(heads, -1, dim)[:, :n]
        return out

    def write(self, rid: int, start: int, layers: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Store slots [start, start + n) of `rid` from per-layer (k, v), each [H, n, D]."""
        if not self.keys:
            self.keys = [k.new_zeros(0, k.shape[0], self.block_size, k.shape[2]) for k, _ in layers]
            self.values = [v.new_zeros(0, v.shape[0], self.block_size, v.shape[2]) for _, v in layers]
        n = layers[0][0].shape[1]
        table = self.tables.setdefault(rid, [])
        for j in range(n):
            slot = start + j
            while slot // self.block_size >= len(table):
                table.append(self.allocate())
            block, offset = table[slot // self.block_size], slot % self.block_size
            for layer, (k, v) in enumerate(layers):
                self.keys[layer][block, :, offset] = k[:, j]
                self.values[layer][block, :, offset] = v[:, j]
        self.lengths[rid] = start + n

    def truncate(self, rid: int, length: int) -> None:
        """Keep the first `length` slots; whole blocks past them go back to the free list."""
        table = self.tables.get(rid, [])
        needed = -(-length // self.block_size)
        self.free += table[needed:]
        del table[needed:]
        self.lengths[rid] = min(self.length(rid), length)

    def release(self, rid: int) -> None:
        self.free += self.tables.pop(rid, [])
        self.lengths.pop(rid, None)

    def allocate(self) -> int:
        if not self.free:
            grown = len(self.keys[0])
            self.keys = [torch.cat([k, k.new_zeros(4, *k.shape[1:])]) for k in self.keys]
            self.values = [torch.cat([v, v.new_zeros(4, *v.shape[1:])]) for v in self.values]
            self.free = list(range(grown, grown + 4))
        return self.free.pop(0)


class PagedEngine(LedgerEngine):
    name = "paged engine"
    max_wait_steps = 0  # every request is prefilled at its first step and advances every step after

    def __init__(
        self,
        target: Any,
        draft: Any,
        *,
        num_draft_tokens: int,
        eos_token_id: int | None,
        pad_token_id: int,
        block_size: int = 2,
    ) -> None:
        self.target, self.draft = target, draft
        self.k, self.pad = num_draft_tokens, pad_token_id
        self.ledger = Ledger(eos_token_id)
        self.pools = {"target": BlockPool(block_size), "draft": BlockPool(block_size)}

    def abort(self, request_id: int) -> None:
        if self.ledger.drop(request_id):
            self.release(request_id)

    def release(self, rid: int) -> None:
        for pool in self.pools.values():
            pool.release(rid)

    @torch.no_grad()
    def step(self) -> dict[int, list[int]]:
        result: dict[int, list[int]] = {}
        self.admit(result)
        running = sorted(self.ledger.running.values(), key=lambda r: r.rid)
        if running:
            self.round(running, result)
        return result

    def forward(self, role: str, rids: list[int], inputs: list[list[int]]) -> tuple[torch.Tensor, list[Any]]:
        """One forward of `role` over the rows' cached slots plus their (right-padded) inputs.

        Returns logits [B, T, V] and, per layer, the call's new K/V [B, H, T, D]."""
        model = self.target if role == "target" else self.draft
        pool = self.pools[role]
        lengths = [pool.length(r) for r in rids]
        past, width = max(lengths), max(len(x) for x in inputs)
        device = device_of(model)
        ids = torch.tensor([x + [self.pad] * (width - len(x)) for x in inputs], device=device)  # [B, T]
        mask = torch.tensor(
            [[1] * n + [0] * (past - n) + [1] * len(x) + [0] * (width - len(x)) for n, x in zip(lengths, inputs)],
            device=device,
        )  # [B, P + T]
        positions = torch.tensor(lengths, device=device)[:, None] + torch.arange(width, device=device)  # [B, T]
        cache = cache_from_tensors(pool.gather(rids)) if past else DynamicCache()
        logits, cache = call_model(model, ids, mask, positions, cache)
        new = [(k[:, :, past:], v[:, :, past:]) for k, v in cache_layers(cache)]
        return logits, new

    def store(self, role: str, rid: int, row: int, new: list[Any], keep: int) -> None:
        """Write the first `keep` new slots of batch row `row` after the request's cached ones."""
        pool = self.pools[role]
        if keep:
            pool.write(rid, pool.length(rid), [(k[row, :, :keep], v[row, :, :keep]) for k, v in new])

    def admit(self, result: dict[int, list[int]]) -> None:
        """Target prefill of every waiting request; the first token is emitted now."""
        newcomers = list(self.ledger.waiting)
        self.ledger.waiting.clear()
        if not newcomers:
            return
        rids = [r.rid for r in newcomers]
        logits, new = self.forward("target", rids, [r.prompt for r in newcomers])
        for row, req in enumerate(newcomers):
            self.store("target", req.rid, row, new, len(req.prompt))
            self.ledger.running[req.rid] = req
            if self.ledger.emit(req, [int(logits[row, len(req.prompt) - 1].argmax())], result):
                self.release(req.rid)

    def round(self, running: list[Req], result: dict[int, list[int]]) -> None:
        """Draft catch-up and proposals, one target verification, acceptance."""
        rids = [r.rid for r in running]
        drafts = self.propose(running)  # K per row
        pending = [r.out[-1] for r in running]
        logits, new = self.forward("target", rids, [[p] + d for p, d in zip(pending, drafts)])
        predicted = logits.argmax(-1).tolist()  # [B, K + 1]
        for row, (req, d) in enumerate(zip(running, drafts)):
            tokens = greedy_accept(d, predicted[row])
            accepted = len(tokens) - 1
            self.store("target", req.rid, row, new, accepted + 1)  # pending + accepted drafts
            known = len(req.history()) + min(accepted, self.k - 1)  # draft slots still right
            self.pools["draft"].truncate(req.rid, known)
            if self.ledger.emit(req, tokens, result):
                self.release(req.rid)

    def propose(self, running: list[Req]) -> list[list[int]]:
        """K draft tokens per row; the first forward also feeds what the draft has not cached."""
        pool = self.pools["draft"]
        rids = [r.rid for r in running]
        inputs = [r.history()[pool.length(r.rid) :] for r in running]
        drafts: list[list[int]] = [[] for _ in running]
        for _ in range(self.k):
            logits, new = self.forward("draft", rids, inputs)
            for row, (rid, x) in enumerate(zip(rids, inputs)):
                self.store("draft", rid, row, new, len(x))
                drafts[row].append(int(logits[row, len(x) - 1].argmax()))
            inputs = [[d[-1]] for d in drafts]
        return drafts
