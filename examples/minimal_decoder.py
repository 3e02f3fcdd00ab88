"""A minimal correct speculative decoder to copy: each row alone, no KV cache (README, "A first audit").

    specaudit audit --decoder examples.minimal_decoder:MinimalDecoder --models transparent

Per row: the draft proposes K tokens one greedy forward each, the target scores prompt + drafts in
one forward, the longest prefix of drafts equal to the target's argmax is kept, then the target's
own next token (the correction, or the bonus after K accepted drafts). Nothing is cached, so
nothing can go stale; batching the rows, a cache and realignment are what you add (and audit).
"""

from __future__ import annotations

import torch


def greedy(model: torch.nn.Module, tokens: list[int], count: int) -> list[int]:
    """The argmax at the last `count` positions of one cache-free forward over `tokens` (one row)."""
    ids = torch.tensor([tokens])
    positions = torch.arange(len(tokens)).unsqueeze(0)
    logits = model(input_ids=ids, attention_mask=torch.ones_like(ids), position_ids=positions).logits  # [1, T, V]
    return logits[0, -count:].argmax(-1).tolist()


class MinimalDecoder:
    name = "minimal"

    @torch.no_grad()
    def generate(self, target, draft, input_ids, attention_mask, *, num_draft_tokens: int, max_new_tokens: int,
                 eos_token_id: int | None, pad_token_id: int) -> list[list[int]]:  # fmt: skip
        rows = [ids[mask.bool()].tolist() for ids, mask in zip(input_ids, attention_mask)]  # left pads dropped
        return [self.one_row(target, draft, row, num_draft_tokens, max_new_tokens, eos_token_id) for row in rows]

    def one_row(self, target, draft, prompt: list[int], k: int, limit: int, eos: int | None) -> list[int]:
        out: list[int] = []
        while len(out) < limit and (eos is None or eos not in out):
            drafts: list[int] = []
            for _ in range(k):  # the draft's proposals, one greedy step each
                drafts += greedy(draft, prompt + out + drafts, 1)
            wanted = greedy(target, prompt + out + drafts, k + 1)  # the target's argmax after each prefix
            accepted = 0
            while accepted < k and drafts[accepted] == wanted[accepted]:
                accepted += 1
            out += drafts[:accepted] + [wanted[accepted]]  # accepted drafts, then the correction or bonus
        out = out[:limit]
        return out[: out.index(eos) + 1] if eos is not None and eos in out else out
