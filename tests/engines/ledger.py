"""Request bookkeeping shared by the independent test engines (not by their caches or rounds).

Each engine keeps its own KV layout; what they share is only the contract's ledger: limits,
outputs cut at EOS or max_new_tokens, a FIFO of waiting requests, and greedy acceptance.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch


@dataclass
class Req:
    """One request: its prompt, limit and output so far."""

    rid: int
    prompt: list[int]
    limit: int
    out: list[int] = field(default_factory=list)

    def history(self) -> list[int]:
        """Prompt + output: every token whose next token is known."""
        return self.prompt + self.out


class Ledger:
    """Waiting queue, running requests and emission with each request's own limit and EOS."""

    def __init__(self, eos_token_id: int | None) -> None:
        self.eos = eos_token_id
        self.waiting: deque[Req] = deque()
        self.running: dict[int, Req] = {}

    def add(self, request_id: int, prompt_ids: list[int], max_new_tokens: int) -> None:
        self.waiting.append(Req(request_id, list(prompt_ids), max_new_tokens))

    def drop(self, request_id: int) -> bool:
        """Forget a waiting or running request; True if it was known."""
        kept = deque(r for r in self.waiting if r.rid != request_id)
        known = len(kept) < len(self.waiting) or request_id in self.running
        self.waiting = kept
        self.running.pop(request_id, None)
        return known

    def unfinished(self) -> bool:
        return bool(self.waiting) or bool(self.running)

    def done(self, req: Req) -> bool:
        return len(req.out) >= req.limit or (bool(req.out) and req.out[-1] == self.eos)

    def emit(self, req: Req, tokens: list[int], result: dict[int, list[int]]) -> bool:
        """Append `tokens` up to the limit or EOS, record them in `result`; True if finished
        (a finished request leaves `running`)."""
        new = []
        for t in tokens:
            if self.done(req):
                break
            req.out.append(t)
            new.append(t)
        if new:
            result.setdefault(req.rid, []).extend(new)
        finished = self.done(req)
        if finished:
            self.running.pop(req.rid, None)
        return finished


def greedy_accept(drafts: list[int], predicted: list[int]) -> list[int]:
    """d_1..d_a plus the target's bonus y_a, a the longest prefix with d_i = y_{i-1}."""
    a = 0
    while a < len(drafts) and drafts[a] == predicted[a]:
        a += 1
    return drafts[:a] + [predicted[a]]


def device_of(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


class LedgerEngine:
    """The contract's request-side methods, answered by the engine's `ledger`."""

    ledger: Ledger

    def add_request(self, request_id: int, prompt_ids: list[int], max_new_tokens: int) -> None:
        self.ledger.add(request_id, prompt_ids, max_new_tokens)

    def has_unfinished(self) -> bool:
        return self.ledger.unfinished()
