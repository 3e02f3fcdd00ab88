"""EQSPEC: batch speculative decoding on a contiguous KV cache, realigned every round.

Per round (paper, section 3.1):

  1. propose:      the draft proposes K tokens per row (its cache kept in step with the target's);
  2. batch_verify: one target forward over [pending, d_1..d_K] scores every draft at once;
  3. accept:       the longest prefix with d_i == argmax target wins, plus the target's bonus;
  4. realign:      unpad, append, repad: rejected slots are dropped, rows are left-padded again
                   to the longest row, one vectorized gather per layer; mask and position ids
                   are recomputed from the new layout.

Invariants kept: I1 (mask is [B, P + T], positions [B, T]) and I2 (each row attends its prompt
and verified tokens at positions 0, 1, 2, ... and nothing else).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache

from specaudit.models.compat import cache_layers, call_model, set_cache_layers


@dataclass
class BatchState:
    """The ragged batch after realignment: every tensor is rectangular, rows left-padded."""

    rows: torch.Tensor  # [B] original row of each active row
    mask: torch.Tensor  # [B, S] 1 on real slots of the target cache
    draft_mask: torch.Tensor  # [B, S_d] 1 on real slots of the draft cache (equal to mask in EQSPEC)
    pending: torch.Tensor  # [B] last committed token, not yet in either cache
    target_cache: Any
    draft_cache: Any

    @property
    def lengths(self) -> torch.Tensor:
        """Real tokens per row in the target cache = position id of the pending token. [B]"""
        return self.mask.sum(1)


def left_pad_positions(mask: torch.Tensor) -> torch.Tensor:
    """Position ids that count real tokens only: 0, 1, 2, ... after the left pads. [B, T]"""
    return (mask.long().cumsum(-1) - 1).clamp(min=0)


class EqSpec:
    """Reference EQSPEC decoder (greedy)."""

    name = "EQSPEC"
    max_wait_calls = 0  # every unfinished row is in every target call

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
        out: list[list[int]] = [[] for _ in range(input_ids.shape[0])]
        state, first = self.prefill(target, draft, input_ids, attention_mask)
        finished = self.commit(out, state.rows, [[t] for t in first.tolist()], max_new_tokens, eos_token_id)
        state = self.drop_finished(state, finished)
        while state.rows.numel():
            drafts = self.propose(draft, state, num_draft_tokens)  # [B, K]
            predicted = self.batch_verify(target, state, drafts)  # [B, K + 1]
            accepted, bonus = self.accept(drafts, predicted)
            new_tokens = [d[:a] + [b] for d, a, b in zip(drafts.tolist(), accepted.tolist(), bonus.tolist())]
            finished = self.commit(out, state.rows, new_tokens, max_new_tokens, eos_token_id)
            state = self.realign(state, accepted, bonus, num_draft_tokens, finished)
        return out

    def prefill(
        self, target: torch.nn.Module, draft: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor
    ) -> tuple[BatchState, torch.Tensor]:
        """Run both models over the left-padded prompts; the target's argmax is the first token."""
        state, last = self.prefill_logits(target, draft, input_ids, attention_mask)
        state.pending = last.argmax(-1)  # [B]
        return state, state.pending

    def prefill_logits(
        self, target: torch.nn.Module, draft: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor
    ) -> tuple[BatchState, torch.Tensor]:
        """The prefill's state (pending not yet chosen) and the target's last logits [B, V]."""
        mask = attention_mask.long()
        positions = left_pad_positions(mask)  # [B, T]
        logits, target_cache = call_model(target, input_ids, mask, positions, DynamicCache())  # [B, T, V]
        _, draft_cache = call_model(draft, input_ids, mask, positions, DynamicCache())
        rows = torch.arange(input_ids.shape[0])
        return BatchState(rows, mask, mask, torch.zeros_like(rows), target_cache, draft_cache), logits[:, -1]

    def positions(self, state: BatchState, mask: torch.Tensor, width: int, role: str) -> torch.Tensor | None:
        """Position ids [B, width] of `width` new inputs after a cache whose real slots are
        `mask` [B, S]: they count real tokens only. `role` is "draft" or "target"; variants
        (the planted bugs) override this one hook instead of copying the round."""
        return mask.sum(1, keepdim=True) + torch.arange(width, device=mask.device)

    def call_mask(self, state: BatchState, mask: torch.Tensor, role: str) -> torch.Tensor | None:
        """The attention mask passed to the model, given the right one `mask` [B, S + T]."""
        return mask

    def propose(self, draft: torch.nn.Module, state: BatchState, k: int) -> torch.Tensor:
        """K greedy draft steps from the pending token, then one more so the draft cache holds
        the same K + 1 new slots as the target's will after verification. Returns [B, K]."""
        batch = state.rows.numel()
        mask, token, drafts = state.draft_mask, state.pending[:, None], []
        for step in range(k + 1):
            position = self.positions(state, mask, 1, "draft")  # [B, 1]
            mask = torch.cat([mask, mask.new_ones(batch, 1)], dim=1)  # [B, S + step + 1]
            logits, state.draft_cache = call_model(
                draft, token, self.call_mask(state, mask, "draft"), position, state.draft_cache
            )
            if step < k:
                token = logits[:, -1].argmax(-1, keepdim=True)  # [B, 1]
                drafts.append(token)
        return torch.cat(drafts, dim=1)

    def batch_verify(self, target: torch.nn.Module, state: BatchState, drafts: torch.Tensor) -> torch.Tensor:
        """One target forward over [pending, drafts]; returns the target's argmax [B, K + 1]."""
        return self.verify_logits(target, state, drafts).argmax(-1)

    def verify_logits(self, target: torch.nn.Module, state: BatchState, drafts: torch.Tensor) -> torch.Tensor:
        """The verify forward over [pending, drafts]; returns its logits [B, K + 1, V]."""
        block = torch.cat([state.pending[:, None], drafts], dim=1)  # [B, K + 1]
        positions = self.positions(state, state.mask, block.shape[1], "target")  # [B, K + 1]
        mask = torch.cat([state.mask, state.mask.new_ones(block.shape)], dim=1)  # [B, S + K + 1]
        logits, state.target_cache = call_model(
            target, block, self.call_mask(state, mask, "target"), positions, state.target_cache
        )
        return logits

    @staticmethod
    def accept(drafts: torch.Tensor, predicted: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Greedy acceptance.

        a_b = max{a : d_{b,i} = argmax p_target(. | x_b, d_{b,<i}) for all i < a}
        bonus_b = argmax p_target(. | x_b, d_{b,<a_b})   (from the target, never the draft)
        """
        k = drafts.shape[1]
        matches = (drafts == predicted[:, :k]).long()  # [B, K]
        accepted = matches.cumprod(dim=1).sum(dim=1)  # [B]
        bonus = predicted.gather(1, accepted[:, None])[:, 0]  # [B]
        return accepted, bonus

    @staticmethod
    def commit(
        out: list[list[int]],
        rows: torch.Tensor,
        new_tokens: list[list[int]],
        max_new_tokens: int,
        eos_token_id: int | None,
    ) -> torch.Tensor:
        """Append each row's new tokens, cut at EOS or the length limit; returns finished [B]."""
        finished = []
        for row, tokens in zip(rows.tolist(), new_tokens):
            for token in tokens:
                if len(out[row]) >= max_new_tokens or (out[row] and out[row][-1] == eos_token_id):
                    break
                out[row].append(token)
            finished.append(len(out[row]) >= max_new_tokens or out[row][-1] == eos_token_id)
        return torch.tensor(finished, dtype=torch.bool)

    def drop_finished(self, state: BatchState, finished: torch.Tensor) -> BatchState:
        """Prefill-time only: nothing to realign, just remove rows that are already done."""
        return self.gather_rows(state, state.mask.bool(), state.draft_mask.bool(), state.pending, finished)

    def realign(
        self, state: BatchState, accepted: torch.Tensor, bonus: torch.Tensor, k: int, finished: torch.Tensor
    ) -> BatchState:
        """Unpad, append, repad: keep the prompt, verified slots, pending and accepted drafts."""
        block = (
            torch.arange(k + 1, device=accepted.device)[None, :] <= accepted[:, None]
        )  # [B, K + 1] pending + accepted
        keep = torch.cat([state.mask.bool(), block], dim=1)  # [B, S + K + 1]
        draft_keep = torch.cat([state.draft_mask.bool(), block], dim=1)
        return self.gather_rows(state, keep, draft_keep, bonus, finished)

    @staticmethod
    def gather_rows(
        state: BatchState, keep: torch.Tensor, draft_keep: torch.Tensor, pending: torch.Tensor, finished: torch.Tensor
    ) -> BatchState:
        """Drop finished rows and repad both caches to their kept slots."""
        active = (~finished).nonzero()[:, 0]  # [B']
        mask = repad(state.target_cache, keep, active)
        draft_mask = repad(state.draft_cache, draft_keep, active)
        return BatchState(state.rows[active], mask, draft_mask, pending[active], state.target_cache, state.draft_cache)


def repad(cache: Any, keep: torch.Tensor, active: torch.Tensor) -> torch.Tensor:
    """Move each active row's kept slots to the right end of a new [B', W] layout, in place.

    One gather per layer and tensor; no Python loop over rows. Returns the new mask [B', W].
    """
    keep = keep[active]  # [B', S_old]
    lengths = keep.sum(1)  # [B']
    width = int(lengths.max()) if active.numel() else 0
    order = torch.sort((~keep).long(), dim=1, stable=True).indices  # kept slots first, in order
    rank = torch.arange(width, device=keep.device)[None, :] - (width - lengths)[:, None]  # [B', W]; < 0 on pads
    source = order.gather(1, rank.clamp(min=0))  # [B', W]
    layers = []
    for k, v in cache_layers(cache):  # [B, H, S_old, D]
        index = source[:, None, :, None].expand(-1, k.shape[1], -1, k.shape[-1])  # [B', H, W, D]
        layers.append((k[active].gather(2, index), v[active].gather(2, index)))
    set_cache_layers(cache, layers)
    return (rank >= 0).long()
