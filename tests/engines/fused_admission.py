"""Fused admission: a newcomer's prefill and first verification are one target forward, in the
same forward as the running requests' verification (a mixed prefill/decode batch).

Written from scratch (no reference code). K/V are kept per request (per model, per layer a
[H, L, D] tensor of exactly the request's cached slots); each forward stacks its rows' pasts
left-padded to the longest (right-aligned) and right-aligns the rows' inputs too, so every
row's last input sits in the last column. Per step:

  draft:  forward 1 feeds each row what the draft has not cached yet (a newcomer: its prompt;
          a running request: its pending token and any accepted tokens the draft missed) and
          proposes d_1 from the last column; K - 1 single-token forwards propose d_2 .. d_K;
  target: one forward over [prompt, d_1..d_K] (newcomer, empty past) or [pending, d_1..d_K]
          (running); the last K + 1 columns predict y_0..y_K for every row;
  accept: d_1..d_a, y_a. A newcomer emits a + 1 tokens in its first step.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import DynamicCache

from specaudit.models.compat import cache_from_tensors, cache_layers, call_model
from tests.engines.ledger import Ledger, LedgerEngine, Req, device_of, greedy_accept

KV = list[tuple[torch.Tensor, torch.Tensor]]  # per layer (keys, values), each [H, L, D]


def stack_left_padded(stores: list[KV | None], width: int) -> KV:
    """Rows' K/V right-aligned in a zero-filled [B, H, width, D] per layer."""
    template = next(s for s in stores if s is not None)
    layers = []
    for layer, (k0, v0) in enumerate(template):
        ks = k0.new_zeros(len(stores), k0.shape[0], width, k0.shape[2])
        vs = v0.new_zeros(len(stores), v0.shape[0], width, v0.shape[2])
        for row, store in enumerate(stores):
            if store is not None and store[layer][0].shape[1]:
                n = store[layer][0].shape[1]
                ks[row, :, width - n :] = store[layer][0]
                vs[row, :, width - n :] = store[layer][1]
        layers.append((ks, vs))
    return layers


class FusedAdmissionEngine(LedgerEngine):
    name = "fused-admission engine"
    max_wait_steps = 0  # a request is admitted at its first step and advances every step

    def __init__(
        self, target: Any, draft: Any, *, num_draft_tokens: int, eos_token_id: int | None, pad_token_id: int
    ) -> None:
        self.models = {"target": target, "draft": draft}
        self.k, self.pad = num_draft_tokens, pad_token_id
        self.ledger = Ledger(eos_token_id)
        self.kv: dict[str, dict[int, KV]] = {"target": {}, "draft": {}}

    def abort(self, request_id: int) -> None:
        self.ledger.drop(request_id)
        self.forget(request_id)

    def forget(self, rid: int) -> None:
        for store in self.kv.values():
            store.pop(rid, None)

    def cached(self, role: str, rid: int) -> int:
        store = self.kv[role].get(rid)
        return 0 if store is None else int(store[0][0].shape[1])

    @torch.no_grad()
    def step(self) -> dict[int, list[int]]:
        while self.ledger.waiting:
            req = self.ledger.waiting.popleft()
            self.ledger.running[req.rid] = req
        rows = sorted(self.ledger.running.values(), key=lambda r: r.rid)
        result: dict[int, list[int]] = {}
        if not rows:
            return result
        drafts = self.propose(rows)
        verify = [self.uncached("target", r) + d for r, d in zip(rows, drafts)]
        logits, new = self.forward("target", rows, verify)
        predicted = logits[:, -(self.k + 1) :].argmax(-1).tolist()  # [B, K + 1]
        for row, (req, d, x) in enumerate(zip(rows, drafts, verify)):
            tokens = greedy_accept(d, predicted[row])
            rejected = self.k - (len(tokens) - 1)
            self.append("target", req.rid, [(k[row], v[row]) for k, v in new], len(x), len(x) - rejected)
            known = len(req.history()) + min(len(tokens) - 1, self.k - 1)
            self.trim("draft", req.rid, known)
            if self.ledger.emit(req, tokens, result):
                self.forget(req.rid)
        return result

    def uncached(self, role: str, req: Req) -> list[int]:
        """The request's known tokens the model has not cached: prompt, or pending (and more)."""
        history = req.history() if req.out else req.prompt
        return history[self.cached(role, req.rid) :]

    def propose(self, rows: list[Req]) -> list[list[int]]:
        inputs = [self.uncached("draft", r) for r in rows]
        drafts: list[list[int]] = [[] for _ in rows]
        for _ in range(self.k):
            logits, new = self.forward("draft", rows, inputs)
            for row, (req, x) in enumerate(zip(rows, inputs)):
                self.append("draft", req.rid, [(k[row], v[row]) for k, v in new], len(x), len(x))
                drafts[row].append(int(logits[row, -1].argmax()))
            inputs = [[d[-1]] for d in drafts]
        return drafts

    def forward(self, role: str, rows: list[Req], inputs: list[list[int]]) -> tuple[torch.Tensor, KV]:
        """Pasts left-padded, inputs right-aligned; returns logits [B, T, V] and the new K/V
        per layer [B, H, T, D]."""
        model = self.models[role]
        lengths = [self.cached(role, r.rid) for r in rows]
        past, width = max(lengths), max(len(x) for x in inputs)
        device = device_of(model)
        ids = torch.tensor([[self.pad] * (width - len(x)) + x for x in inputs], device=device)  # [B, T]
        mask = torch.tensor(
            [[0] * (past - n) + [1] * n + [0] * (width - len(x)) + [1] * len(x) for n, x in zip(lengths, inputs)],
            device=device,
        )  # [B, P + T]
        positions = torch.tensor(
            [[max(n, n + i - (width - len(x))) for i in range(width)] for n, x in zip(lengths, inputs)], device=device
        )  # [B, T]
        stores = [self.kv[role].get(r.rid) for r in rows]
        cache = cache_from_tensors(stack_left_padded(stores, past)) if past else DynamicCache()
        logits, cache = call_model(model, ids, mask, positions, cache)
        return logits, [(k[:, :, past:], v[:, :, past:]) for k, v in cache_layers(cache)]

    def append(self, role: str, rid: int, new: KV, width: int, keep: int) -> None:
        """Append the first `keep` of the row's real inputs (the last `width` columns of `new`)."""
        start = new[0][0].shape[1] - width
        piece = [(k[:, start : start + keep], v[:, start : start + keep]) for k, v in new]
        old = self.kv[role].get(rid)
        self.kv[role][rid] = (
            piece
            if old is None
            else [(torch.cat([ok, k], 1), torch.cat([ov, v], 1)) for (ok, ov), (k, v) in zip(old, piece)]
        )

    def trim(self, role: str, rid: int, length: int) -> None:
        store = self.kv[role].get(rid)
        if store is not None:
            self.kv[role][rid] = [(k[:, :length], v[:, :length]) for k, v in store]
