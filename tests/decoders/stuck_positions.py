"""A batch speculative decoder that hands `generate` position ids which stop at the prompt.

Written the way it is found in public code: no cache between rounds; each round re-pads the
running rows on the left, the draft proposes with `generate`, and the target verifies by
decoding K + 1 greedy tokens itself with `generate`, given the position ids of the padded
context ("always pass position_ids for left-padded batches"):

    x, m:    running rows' committed tokens, left-padded; p = cumsum(m) - 1   (p is [B, W])
    draft:   d_1..d_K     = draft.generate(x, m, max_new_tokens=K)
    verify:  y_1..y_{K+1} = target.generate(x, m, position_ids=p, max_new_tokens=K + 1)
    accept:  a = max{a : d_i = y_i for all i <= a},  commit y_1..y_{a+1}

The defect: `p` covers the context only. transformers 4.51 keeps the position ids it is given
for the whole `generate` and slices their last column at each decode step, so y_2.. are
computed at the last context position, again and again (stuck). transformers 5.x extends given
position ids by one per generated token, so there the same code is correct.
"""

from __future__ import annotations

import torch

Row = list[int]


def pad_left(rows: list[Row], pad: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask, position_ids), each [B, W]: real tokens on the right, at 0, 1, 2, ..."""
    width = max(map(len, rows))
    ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    return ids, mask, (mask.cumsum(-1) - 1).clamp(min=0)


def decode(model: torch.nn.Module, rows: list[Row], pad: int, steps: int, **extra: torch.Tensor) -> list[Row]:
    """`steps` greedy tokens per row from HF `generate` (EOS is the caller's business)."""
    ids, mask, _ = pad_left(rows, pad)
    out = model.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=steps,
        min_new_tokens=steps,
        do_sample=False,
        num_beams=1,
        pad_token_id=pad,
        eos_token_id=None,
        **extra,
    )  # [B, W + steps]
    return out[:, ids.shape[1] :].tolist()


def accepted(drafts: Row, verified: Row) -> int:
    """How many leading drafts equal the target's own tokens."""
    n = 0
    while n < len(drafts) and drafts[n] == verified[n]:
        n += 1
    return n


class StuckPositions:
    """Greedy speculative decoding by two `generate` calls a round; the target's given positions stop."""

    name = "stuck-positions"
    pass_positions = True

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
        pairs = zip(input_ids.tolist(), attention_mask.tolist())
        history = [[t for t, m in zip(ids, mask) if m] for ids, mask in pairs]  # the prompts, unpadded
        out: list[Row] = [[] for _ in history]
        running = [r for r in range(len(history)) if max_new_tokens > 0]
        while running:
            rows = [history[r] + out[r] for r in running]
            drafts = decode(draft, rows, pad_token_id, k) if k else [[] for _ in rows]
            verified = decode(target, rows, pad_token_id, k + 1, **self.positions(rows, pad_token_id))
            running = [
                r
                for r, d, y in zip(running, drafts, verified)
                if self.commit(out[r], y[: accepted(d, y) + 1], max_new_tokens, eos_token_id)
            ]
        return out

    def positions(self, rows: list[Row], pad: int) -> dict[str, torch.Tensor]:
        """The context's position ids [B, W], for `generate` (the defect: they cover the context only)."""
        return {"position_ids": pad_left(rows, pad)[2]} if self.pass_positions else {}

    @staticmethod
    def commit(row: Row, tokens: Row, limit: int, eos: int | None) -> bool:
        """Append up to EOS or the limit; True while the row still runs."""
        for token in tokens:
            row.append(token)
            if token == eos or len(row) >= limit:
                return False
        return True


class AdvancingPositions(StuckPositions):
    """The control: hands `generate` no position ids, so it derives them from the mask and advances them."""

    name = "advancing-positions"
    pass_positions = False
