"""A correct batch speculative decoder without any KV cache: every forward sees whole sequences.

Written independently of the references. Each round re-pads the running rows' full
sequences (prompt plus committed tokens) on the left and

    draft:   d_1..d_K, each from one forward over [x, d_1..d_{i-1}]      (K draft forwards)
    verify:  y = argmax target([x, d_1..d_K]) read at the last |x| - 1 .. |x| - 1 + K columns
    accept:  a = max{a : d_i = y_i for all i <= a},  commit d_1..d_a and the bonus y_{a + 1}

The first round has no drafts: the target's last logits over the prompts give t_0. Nothing is
cached, so nothing can go stale; the price is recomputing every sequence every round.
"""

from __future__ import annotations

import torch

from specaudit.models.compat import cache_keyword


def left_pad(sequences: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask, position_ids), each [B, W], real tokens on the right."""
    width = max(map(len, sequences))
    ids = torch.tensor([[pad] * (width - len(s)) + s for s in sequences])
    mask = torch.tensor([[0] * (width - len(s)) + [1] * len(s) for s in sequences])
    return ids, mask, (mask.cumsum(1) - 1).clamp(min=0)


def last_logits(model: torch.nn.Module, sequences: list[list[int]], pad: int, count: int) -> torch.Tensor:
    """Argmax [B, count] at each row's last `count` tokens, from one cache-free forward."""
    ids, mask, positions = left_pad(sequences, pad)
    out = model(
        input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, **{cache_keyword(model): None}
    )
    return out.logits[:, -count:].argmax(-1)


class RecomputeSpec:
    """Greedy batch speculative decoding that re-runs both models over whole sequences every round."""

    name = "recompute"
    max_wait_calls = 0

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
        prompts = self.unpad(input_ids, attention_mask, pad_token_id)
        out: list[list[int]] = [[] for _ in prompts]
        running = list(range(len(prompts)))
        first = last_logits(target, prompts, pad_token_id, 1)[:, 0].tolist()
        running = self.commit(out, running, [[t] for t in first], max_new_tokens, eos_token_id)
        while running:
            sequences = [prompts[r] + out[r] for r in running]
            drafts = self.propose(draft, sequences, num_draft_tokens, pad_token_id)  # [B][K]
            k = num_draft_tokens
            predicted = last_logits(target, [s + d for s, d in zip(sequences, drafts)], pad_token_id, k + 1).tolist()
            new = []
            for d, y in zip(drafts, predicted):
                a = 0
                while a < k and d[a] == y[a]:
                    a += 1
                new.append(d[:a] + [y[a]])
            running = self.commit(out, running, new, max_new_tokens, eos_token_id)
        return out

    @staticmethod
    def unpad(input_ids: torch.Tensor, attention_mask: torch.Tensor, pad: int) -> list[list[int]]:
        """Each row's prompt: its tokens under the mask."""
        return [[t for t, m in zip(ids, mask) if m] for ids, mask in zip(input_ids.tolist(), attention_mask.tolist())]

    @staticmethod
    def propose(draft: torch.nn.Module, sequences: list[list[int]], k: int, pad: int) -> list[list[int]]:
        """K greedy drafts per row, each from a cache-free forward over the sequence and the drafts so far."""
        drafts: list[list[int]] = [[] for _ in sequences]
        for _ in range(k):
            tokens = last_logits(draft, [s + d for s, d in zip(sequences, drafts)], pad, 1)[:, 0].tolist()
            for d, t in zip(drafts, tokens):
                d.append(t)
        return drafts

    @staticmethod
    def commit(
        out: list[list[int]], running: list[int], tokens: list[list[int]], max_new_tokens: int, eos: int | None
    ) -> list[int]:
        """Append each row's new tokens up to EOS or the limit; returns the rows still running."""
        still = []
        for row, new in zip(running, tokens):
            for token in new:
                if len(out[row]) >= max_new_tokens or (out[row] and out[row][-1] == eos):
                    break
                out[row].append(token)
            if len(out[row]) < max_new_tokens and out[row][-1] != eos:
                still.append(row)
        return still


class RecomputeUnpadsByValue(RecomputeSpec):
    """Planted: unpads by value (`ids != pad`) instead of by the mask, so a prompt's real tokens
    equal to the pad id vanish from the history every round re-feeds: the I2 control for
    cache-free calls (rule `history-token`)."""

    name = "recompute-unpads-by-value"

    @staticmethod
    def unpad(input_ids: torch.Tensor, attention_mask: torch.Tensor, pad: int) -> list[list[int]]:
        return [[t for t in ids if t != pad] or ids[-1:] for ids in input_ids.tolist()]
