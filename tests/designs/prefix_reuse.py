"""Cross-request prefix reuse: one cache carried from request to request, a correct design.

Requests run one at a time (batch size 1) on a single cache. Before a request starts, the cache
is cropped to the prefix its prompt shares with what the cache holds (the previous request's
prompt and output) and only the rest of the prompt is forwarded: a prefix cache in one tensor.
Each round verifies [s[n-1], d_1..d_K] at positions n-1.. over the cache of s[:n-1].
`PrefixReuseRecompute` also crops one verified token more than the rejection needs and forwards
it again (cache s[:n-2], verify [s[n-2], s[n-1], d_1..d_K]): wasted work, never a wrong token.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from specaudit.checks.agreement import common_prefix
from specaudit.models.compat import cache_length, crop_cache
from tests.designs.split_verify import SplitVerify, accepted, cut, draft_tokens, finished, greedy_next


class PrefixReuse(SplitVerify):
    """One cache for all requests, cropped to the shared prefix before each."""

    name = "prefix-reuse"
    redo = 0  # verified tokens cropped and recomputed every round

    @torch.no_grad()
    def generate(self, target: torch.nn.Module, draft: torch.nn.Module, *args, **kwargs) -> list[list[int]]:  # noqa: ANN002, ANN003
        self.cache, self.held = DynamicCache(), []  # the cache and the tokens in its slots
        try:
            return super().generate(target, draft, *args, **kwargs)
        finally:
            self.cache, self.held = None, []

    def one(
        self, target: torch.nn.Module, draft: torch.nn.Module, prompt: list[int], k: int, limit: int, eos: int | None
    ) -> list[int]:
        cache = self.cache
        shared = min(common_prefix(self.held, prompt), len(prompt) - 1, cache_length(cache))
        crop_cache(cache, shared)  # the prefix this prompt shares with the previous request's history
        if len(prompt) - 1 > shared:
            greedy_next(target, prompt[shared:-1], shared, cache)
        sequence, out = list(prompt), []
        while not finished(out, limit, eos):
            n = len(sequence)
            redo = min(self.redo, n - 1)
            crop_cache(cache, n - 1 - redo)
            drafts = draft_tokens(draft, sequence, min(k, limit - len(out)))
            predicted = greedy_next(target, sequence[n - 1 - redo :] + drafts, n - 1 - redo, cache)[redo:]
            new = accepted(drafts, predicted)
            crop_cache(cache, n + len(new) - 1)
            sequence += new
            out += new
        self.held = sequence[: cache_length(cache)]
        return cut(out, limit, eos)


class PrefixReuseRecompute(PrefixReuse):
    """PrefixReuse that also crops one verified token every round and forwards it again: exact
    output, wasted work (an efficiency finding of token preservation, never a wrong output)."""

    name = "prefix-reuse-recompute"
    redo = 1
