"""A correct continuous-batching engine with no cache at all: every step recomputes everything.

Written independently of the reference engines. Each step every unfinished request (newcomers
included: they join at once) is one row of a left-padded batch holding its whole sequence
x = prompt + output so far, and

    draft:   d_1..d_K, d_i = argmax draft(x, d_<i) at the last position    (K cache-free forwards)
    verify:  y = argmax target(x, d_1..d_K) at positions |x| - 1 .. |x| - 1 + K   (one forward)
    accept:  a = max{a : d_i = y_i for all i <= a};  new tokens d_1..d_a, y_{a+1}

so a request advances every step, and its first token comes at its first step (max_wait_steps 0).
"""

from __future__ import annotations

from typing import Any

import torch


class RecomputeEngine:
    name = "recompute engine"
    max_wait_steps = 0

    def __init__(
        self, target: Any, draft: Any, *, num_draft_tokens: int, eos_token_id: int | None, pad_token_id: int
    ) -> None:
        self.target, self.draft = target, draft
        self.k, self.eos, self.pad = num_draft_tokens, eos_token_id, pad_token_id
        self.requests: dict[int, tuple[list[int], int, list[int]]] = {}  # id -> (prompt, limit, output)

    def add_request(self, request_id: int, prompt_ids: list[int], max_new_tokens: int) -> None:
        self.requests[request_id] = (list(prompt_ids), max_new_tokens, [])

    def abort(self, request_id: int) -> None:
        self.requests.pop(request_id, None)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    @torch.no_grad()
    def step(self) -> dict[int, list[int]]:
        if not self.requests:
            return {}
        ids = list(self.requests)
        sequences = [self.requests[r][0] + self.requests[r][2] for r in ids]
        drafts = self.propose(sequences)  # K per row
        predicted = self.verify(sequences, drafts)  # K + 1 per row
        out: dict[int, list[int]] = {}
        for r, d, y in zip(ids, drafts, predicted):
            a = 0
            while a < self.k and d[a] == y[a]:
                a += 1
            out[r] = self.take(r, d[:a] + [y[a]])
        return out

    def take(self, request_id: int, tokens: list[int]) -> list[int]:
        """Append up to the limit or EOS; a finished request leaves the engine."""
        prompt, limit, output = self.requests[request_id]
        new = []
        for t in tokens:
            if len(output) >= limit or (output and output[-1] == self.eos):
                break
            output.append(t)
            new.append(t)
        if len(output) >= limit or output[-1] == self.eos:
            del self.requests[request_id]
        return new

    def forward(self, model: Any, rows: list[list[int]]) -> torch.Tensor:
        """One cache-free forward over left-padded rows; returns argmax ids [B, W]."""
        width = max(len(r) for r in rows)
        ids = torch.tensor([[self.pad] * (width - len(r)) + r for r in rows])  # [B, W]
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])  # [B, W]
        positions = (mask.cumsum(1) - 1).clamp(min=0)
        logits = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False).logits
        return logits.argmax(-1)  # [B, W]

    def propose(self, sequences: list[list[int]]) -> list[list[int]]:
        drafts: list[list[int]] = [[] for _ in sequences]
        for _ in range(self.k):
            best = self.forward(self.draft, [s + d for s, d in zip(sequences, drafts)])
            for d, b in zip(drafts, best[:, -1].tolist()):
                d.append(b)
        return drafts

    def verify(self, sequences: list[list[int]], drafts: list[list[int]]) -> list[list[int]]:
        best = self.forward(self.target, [s + d for s, d in zip(sequences, drafts)])  # [B, W]
        return [row[-(self.k + 1) :] for row in best.tolist()]
