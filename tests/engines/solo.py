"""No batching at all: every request is its own batch-size-1 forward sequence with its own cache
objects (one target and one draft cache per request), cut back after each round.

Written from scratch (no reference code). A newcomer is prefilled by both models at its first
step and emits its first token there (no verification that step); afterwards each step runs,
per request in turn, K draft forwards then one target forward over [pending, d_1..d_K]. Rejected
slots are cut off by rebuilding the request's cache from its kept slices; the draft cache is
cut to what it got right and catches up (pending and a fully accepted d_K) at the next round.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import DynamicCache

from specaudit.models.compat import cache_from_tensors, call_model, filled_layers
from tests.engines.ledger import Ledger, LedgerEngine, Req, device_of, greedy_accept


def cut(cache: Any, length: int) -> Any:
    """A new cache holding the first `length` slots of `cache`."""
    return cache_from_tensors([(k[:, :, :length].clone(), v[:, :, :length].clone()) for k, v in filled_layers(cache)])


class SoloEngine(LedgerEngine):
    name = "solo engine"
    max_wait_steps = 0  # every request advances every step

    def __init__(
        self, target: Any, draft: Any, *, num_draft_tokens: int, eos_token_id: int | None, pad_token_id: int
    ) -> None:
        self.target, self.draft = target, draft
        self.k = num_draft_tokens
        self.ledger = Ledger(eos_token_id)
        self.caches: dict[int, dict[str, Any]] = {}  # request id -> {"target": cache, "draft": cache}
        self.lengths: dict[int, dict[str, int]] = {}

    def abort(self, request_id: int) -> None:
        self.ledger.drop(request_id)
        self.forget(request_id)

    def forget(self, rid: int) -> None:
        self.caches.pop(rid, None)
        self.lengths.pop(rid, None)

    @torch.no_grad()
    def step(self) -> dict[int, list[int]]:
        result: dict[int, list[int]] = {}
        veterans = sorted(self.ledger.running.values(), key=lambda r: r.rid)
        while self.ledger.waiting:
            self.prefill(self.ledger.waiting.popleft(), result)
        for req in veterans:
            if req.rid in self.ledger.running:
                self.round(req, result)
        return result

    def call(self, role: str, rid: int, tokens: list[int]) -> torch.Tensor:
        """One batch-size-1 forward of `tokens` after the request's cache; logits [T, V]."""
        model = self.target if role == "target" else self.draft
        start = self.lengths[rid][role]
        device = device_of(model)
        ids = torch.tensor([tokens], device=device)  # [1, T]
        mask = torch.ones(1, start + len(tokens), dtype=torch.long, device=device)  # [1, P + T]
        positions = torch.arange(start, start + len(tokens), device=device)[None]  # [1, T]
        logits, self.caches[rid][role] = call_model(model, ids, mask, positions, self.caches[rid][role])
        self.lengths[rid][role] = start + len(tokens)
        return logits[0]

    def trim(self, role: str, rid: int, length: int) -> None:
        if self.lengths[rid][role] > length:
            self.caches[rid][role] = cut(self.caches[rid][role], length)
            self.lengths[rid][role] = length

    def prefill(self, req: Req, result: dict[int, list[int]]) -> None:
        self.ledger.running[req.rid] = req
        self.caches[req.rid] = {"target": DynamicCache(), "draft": DynamicCache()}
        self.lengths[req.rid] = {"target": 0, "draft": 0}
        first = int(self.call("target", req.rid, req.prompt)[-1].argmax())
        self.call("draft", req.rid, req.prompt)
        if self.ledger.emit(req, [first], result):
            self.forget(req.rid)

    def round(self, req: Req, result: dict[int, list[int]]) -> None:
        history = req.history()
        feed = history[self.lengths[req.rid]["draft"] :]  # pending, plus d_K if the draft missed it
        drafts: list[int] = []
        for _ in range(self.k):
            drafts.append(int(self.call("draft", req.rid, feed)[-1].argmax()))
            feed = drafts[-1:]
        predicted = self.call("target", req.rid, [history[-1]] + drafts).argmax(-1).tolist()  # [K + 1]
        tokens = greedy_accept(drafts, predicted)
        accepted = len(tokens) - 1
        self.trim("target", req.rid, len(history) + accepted)
        self.trim("draft", req.rid, len(history) + min(accepted, self.k - 1))
        if self.ledger.emit(req, tokens, result):
            self.forget(req.rid)
