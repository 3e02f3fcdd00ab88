"""Split verification that speculates past a known correction: a correct, wasteful design.

Each request runs alone (batch size 1). Per round, with the committed sequence s (its last
token x pending, not yet in the cache):

    call A:  target([x]) at position |s| - 1           -> y_1 (the target's next token)
    draft:   d_1..d_K after s, one cache-free draft forward each (y_1 is known, and ignored)
    call B:  target([d_1..d_K]) at positions |s|..     -> y_2..y_{K+1}
    accept:  a = max{a : d_i = y_i for i <= a};  commit d_1..d_a and y_{a+1}; crop to |s| + a

When d_1 != y_1 the correction is known before call B runs, and call B's logits are thrown
away: a wasted forward over a draft at a position whose token is not committed (call B is
skipped only when y_1 ends the request: EOS or the last token allowed). Every output
is the target's greedy output. `SplitVerifyUncached` does the same without a cache: call A
re-feeds s, call B re-feeds s + d.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from specaudit.models.compat import cache_keyword, crop_cache


def greedy_next(model: torch.nn.Module, tokens: list[int], start: int, cache: DynamicCache | None) -> list[int]:
    """Argmax at every input of one forward of `tokens` at positions start.. (batch size 1)."""
    ids = torch.tensor([tokens])  # [1, T]
    positions = torch.arange(start, start + len(tokens))[None]  # [1, T]
    mask = torch.ones(1, start + len(tokens), dtype=torch.long)  # [1, P + T]
    out = model(
        input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, **{cache_keyword(model): cache}
    )
    return out.logits[0].argmax(-1).tolist()  # [T]


def draft_tokens(draft: torch.nn.Module, sequence: list[int], k: int) -> list[int]:
    """K greedy drafts after `sequence`, each from a cache-free forward."""
    drafts: list[int] = []
    for _ in range(k):
        drafts.append(greedy_next(draft, sequence + drafts, 0, None)[-1])
    return drafts


def accepted(drafts: list[int], predicted: list[int]) -> list[int]:
    """The drafts the target agrees with, then its own token after them."""
    a = 0
    while a < len(drafts) and drafts[a] == predicted[a]:
        a += 1
    return drafts[:a] + [predicted[a]]


def finished(out: list[int], max_new_tokens: int, eos: int | None) -> bool:
    return len(out) >= max_new_tokens or (eos is not None and eos in out)


def cut(out: list[int], max_new_tokens: int, eos: int | None) -> list[int]:
    out = out[:max_new_tokens]
    return out[: out.index(eos) + 1] if eos is not None and eos in out else out


class SplitVerify:
    """Per request: the pending token alone, then the drafts alone, each in its own target call."""

    name = "split-verify"

    @torch.no_grad()
    def generate(
        self,
        target: torch.nn.Module,
        draft: torch.nn.Module,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        *,
        num_draft_tokens: int,
        max_new_tokens: int,
        eos_token_id: int | None,
        pad_token_id: int,
    ) -> list[list[int]]:
        prompts = [ids[m.bool()].tolist() for ids, m in zip(input_ids, attention_mask)]
        return [self.one(target, draft, p, num_draft_tokens, max_new_tokens, eos_token_id) for p in prompts]

    def one(
        self, target: torch.nn.Module, draft: torch.nn.Module, prompt: list[int], k: int, limit: int, eos: int | None
    ) -> list[int]:
        sequence, out = list(prompt), []
        cache = DynamicCache()
        if len(prompt) > 1:
            greedy_next(target, prompt[:-1], 0, cache)  # the prompt's last token stays pending
        while not finished(out, limit, eos):
            n = len(sequence)
            first = greedy_next(target, sequence[-1:], n - 1, cache)  # call A: [1]
            if finished(out + first, limit, eos):
                out += first
                break
            drafts = draft_tokens(draft, sequence, k)  # the correction `first` is known; speculate anyway
            rest = greedy_next(target, drafts, n, cache)  # call B: [K]
            new = accepted(drafts, first + rest)
            crop_cache(cache, n + len(new) - 1)
            sequence += new
            out += new
        return cut(out, limit, eos)


class SplitVerifyUncached(SplitVerify):
    """The same rounds without a cache: call A re-feeds the sequence, call B the sequence and drafts."""

    name = "split-verify-uncached"

    def one(
        self, target: torch.nn.Module, draft: torch.nn.Module, prompt: list[int], k: int, limit: int, eos: int | None
    ) -> list[int]:
        sequence, out = list(prompt), []
        while not finished(out, limit, eos):
            n = len(sequence)
            first = greedy_next(target, sequence, 0, None)[-1:]  # call A: the committed sequence
            if finished(out + first, limit, eos):
                out += first
                break
            drafts = draft_tokens(draft, sequence, k)
            rest = greedy_next(target, sequence + drafts, 0, None)[n:]  # call B: sequence + drafts
            new = accepted(drafts, first + rest)
            sequence += new
            out += new
        return cut(out, limit, eos)


class SplitVerifyKeepsWasted(SplitVerify):
    """Planted: after a rejected first draft, also commits call B's first token, which the target
    chose after the rejected draft. Call B's logits now choose a committed token, so its input at
    the rejected draft's position is an I2 fault again ('input-token'), and the output diverges."""

    name = "split-verify-keeps-wasted"

    def one(
        self, target: torch.nn.Module, draft: torch.nn.Module, prompt: list[int], k: int, limit: int, eos: int | None
    ) -> list[int]:
        sequence, out = list(prompt), []
        cache = DynamicCache()
        if len(prompt) > 1:
            greedy_next(target, prompt[:-1], 0, cache)
        while not finished(out, limit, eos):
            n = len(sequence)
            first = greedy_next(target, sequence[-1:], n - 1, cache)
            drafts = draft_tokens(draft, sequence, k)
            rest = greedy_next(target, drafts, n, cache)
            new = accepted(drafts, first + rest)
            if len(new) == 1:  # the bug: the wasted call's first token kept after the correction
                new = new + rest[:1]
                crop_cache(cache, n)
                greedy_next(target, new[:1], n, cache)  # the correction into the cache, its logits unused
            crop_cache(cache, n + len(new) - 1)
            sequence += new
            out += new
        return cut(out, limit, eos)
