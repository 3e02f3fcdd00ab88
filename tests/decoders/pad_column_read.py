"""A batch speculative decoder on right-padded rows that takes the bonus token from the last column.

Written the way it is found in public code: no cache is kept between rounds; the draft
proposes with its own `generate`, and the target verifies in one forward over each running
row's committed tokens c_b and drafts, padded on the right to one width W, pads masked, and
position ids counted per row (0, 1, 2, ... on the real tokens):

    draft:   d_1..d_K = draft.generate(c_b, max_new_tokens=K)        (greedy, left-padded)
    verify:  y_i = argmax target([c_b, d_1..d_K])[L_b - 1 + i]       i = 0..K - 1  (L_b = len(c_b))
    accept:  a = max{a : d_i = y_{i-1} for all i <= a}
    next:    y_a if a < K, else argmax target(...)[W - 1]            <- the defect

When every draft is accepted the next token is read at the batch's last column, which is the
row's own last token only for the longest row; for a shorter row it is a pad column. A model
whose pad column repeats the last real column's output (the pad attends exactly what that
column attends) hides the defect; a real model's pad column, and the transparent one's, do not.
"""

from __future__ import annotations

import torch

Row = list[int]


def pad_right(rows: list[Row], pad: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask, position_ids), each [B, W]: real tokens on the left, at 0, 1, 2, ..."""
    width = max(map(len, rows))
    ids = torch.tensor([r + [pad] * (width - len(r)) for r in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    return ids, mask, torch.arange(width).expand(len(rows), width)


def argmax_columns(model: torch.nn.Module, rows: list[Row], pad: int) -> torch.Tensor:
    """Greedy token [B, W] at every column of one cache-free forward over the right-padded rows."""
    ids, mask, positions = pad_right(rows, pad)
    return model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False).logits.argmax(-1)


class PadColumnRead:
    """Greedy speculative decoding over right-padded, cache-free rounds; the bonus is read at column -1."""

    name = "pad-column-read"

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
        pairs = zip(input_ids.tolist(), attention_mask.tolist())
        prompts = [[t for t, m in zip(ids, mask) if m] for ids, mask in pairs]  # unpadded
        out: list[Row] = [[] for _ in prompts]
        running = [r for r in range(len(prompts)) if max_new_tokens > 0]
        while running:
            context = [prompts[r] + out[r] for r in running]
            drafts = self.propose(draft, context, num_draft_tokens, pad_token_id)
            kept = self.verify(target, context, drafts, pad_token_id)
            running = [r for r, row in zip(running, kept) if self.commit(out[r], row, max_new_tokens, eos_token_id)]
        return out

    def propose(self, draft: torch.nn.Module, context: list[Row], k: int, pad: int) -> list[Row]:
        """K greedy draft tokens per row from the draft's own `generate` (left-padded, as it wants)."""
        if k == 0:
            return [[] for _ in context]
        width = max(map(len, context))
        ids = torch.tensor([[pad] * (width - len(c)) + c for c in context])  # [B, W]
        mask = torch.tensor([[0] * (width - len(c)) + [1] * len(c) for c in context])
        out = draft.generate(
            ids, attention_mask=mask, max_new_tokens=k, min_new_tokens=k, do_sample=False, pad_token_id=pad
        )  # [B, W + K]
        return out[:, width:].tolist()

    def verify(self, target: torch.nn.Module, context: list[Row], drafts: list[Row], pad: int) -> list[Row]:
        """Per row the accepted drafts and the target's next token."""
        greedy = argmax_columns(target, [c + d for c, d in zip(context, drafts)], pad)  # [B, W]
        kept = []
        for b, (c, d) in enumerate(zip(context, drafts)):
            y = greedy[b, len(c) - 1 : len(c) - 1 + len(d)].tolist()  # the target's token after each prefix
            a = next((i for i, (x, z) in enumerate(zip(d, y)) if x != z), len(d))
            bonus = int(greedy[b, -1])  # the defect: the row's last real column is len(c) + len(d) - 1
            kept.append(d[:a] + [y[a] if a < len(d) else bonus])
        return kept

    @staticmethod
    def commit(row: Row, tokens: Row, limit: int, eos: int | None) -> bool:
        """Append up to EOS or the limit; True while the row still runs."""
        for token in tokens:
            row.append(token)
            if token == eos or len(row) >= limit:
                return False
        return True


class OwnColumnRead(PadColumnRead):
    """The control: the bonus read at the row's own last real column."""

    name = "own-column-read"

    def verify(self, target: torch.nn.Module, context: list[Row], drafts: list[Row], pad: int) -> list[Row]:
        greedy = argmax_columns(target, [c + d for c, d in zip(context, drafts)], pad)  # [B, W]
        kept = []
        for b, (c, d) in enumerate(zip(context, drafts)):
            y = greedy[b, len(c) - 1 : len(c) + len(d)].tolist()  # K + 1 tokens: the last is the bonus
            a = next((i for i, (x, z) in enumerate(zip(d, y)) if x != z), len(d))
            kept.append(d[:a] + [y[a]])
        return kept
