"""A correct batch speculative decoder whose target verifies by decoding greedily itself.

Written independently of the references, the way it is often written in public code: no
cache is kept between rounds, and both models run Hugging Face `generate` from the committed
context every round. Per round, for the running rows left-padded to one width:

    draft:   d_1..d_K = draft.generate(x, max_new_tokens=K)          (greedy)
    verify:  y_1..y_{K+1} = target.generate(x, max_new_tokens=K + 1) (greedy)
    accept:  a = max{a : d_i = y_i for all i <= a},  commit d_1..d_a and y_{a+1}

The target's own tokens y are never drafts: the target re-decodes what the draft proposed,
which costs K + 1 forwards per round where one would do, and is slower, not wrong. Position
ids are left to `generate`, which derives them from the attention mask as for any HF model.
"""

from __future__ import annotations

import torch
from transformers import GenerationConfig


def left_pad(sequences: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask), each [B, W], real tokens on the right."""
    width = max(len(s) for s in sequences)
    ids = torch.tensor([[pad] * (width - len(s)) + s for s in sequences])
    mask = torch.tensor([[0] * (width - len(s)) + [1] * len(s) for s in sequences])
    return ids, mask


def greedy(model: torch.nn.Module, sequences: list[list[int]], pad: int, eos: int | None, n: int) -> list[list[int]]:
    """`n` greedy tokens per row from HF `generate` (fewer where a row stops at EOS)."""
    ids, mask = left_pad(sequences, pad)
    config = GenerationConfig(
        max_new_tokens=n, min_new_tokens=0, do_sample=False, num_beams=1, pad_token_id=pad, eos_token_id=eos
    )
    out = model.generate(ids.to(model.device), attention_mask=mask.to(model.device), generation_config=config)
    new = out[:, ids.shape[1] :].tolist()  # [B, <= n]
    return [row[: row.index(eos) + 1] if eos in row else row for row in new]


class GenerateVerify:
    """Greedy batch speculative decoding where the target verifies with its own `generate`."""

    name = "generate-verify"
    max_wait_calls = 0  # every running row is in every target call

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
        k = num_draft_tokens
        prompts = [
            [t for t, m in zip(ids, mask) if m] for ids, mask in zip(input_ids.tolist(), attention_mask.tolist())
        ]
        out: list[list[int]] = [[] for _ in prompts]
        running = list(range(len(prompts)))
        while running:
            context = [prompts[r] + out[r] for r in running]
            drafts = greedy(draft, [self.draft_context(c) for c in context], pad_token_id, eos_token_id, k)
            verified = greedy(target, context, pad_token_id, eos_token_id, k + 1)
            still = []
            for r, d, y in zip(running, drafts, verified):
                a = 0
                while a < len(d) and a < len(y) - 1 and d[a] == y[a]:
                    a += 1
                if self.commit(out[r], d[:a] + y[a : a + 1], max_new_tokens, eos_token_id):
                    still.append(r)
            running = still
        return out

    @staticmethod
    def draft_context(context: list[int]) -> list[int]:
        """What the draft drafts from: the committed sequence."""
        return context

    @staticmethod
    def commit(row: list[int], tokens: list[int], max_new_tokens: int, eos: int | None) -> bool:
        """Append up to EOS or the limit; True while the row still runs."""
        for token in tokens:
            if len(row) >= max_new_tokens:
                break
            row.append(token)
            if token == eos:
                return False
        return len(row) < max_new_tokens


class GenerateVerifyStaleDraft(GenerateVerify):
    """Planted: the draft drafts from the committed sequence without its last token (an
    off-by-one slice), so it never sees the target's newest token. The target still verifies,
    so the output is right and only token preservation sees fewer drafts accepted: the
    negative control of judging a `generate`-verifying target by what the draft proposed."""

    name = "generate-verify-stale-draft"

    @staticmethod
    def draft_context(context: list[int]) -> list[int]:
        return context[:-1] or context
