"""A correct batch speculative decoder that calls both models positionally: `model(ids, mask, pos, cache)`.

`MaskedSpec` is the algorithm, written independently of the references: rows never move.
Every round appends K + 1 slots to each row (the pending token and the K drafts) in both
caches; the slots a row rejects stay where they are with mask 0, and position ids count the
attended slots only, so each row attends exactly its own tokens at positions 0, 1, 2, ...

    round for row b, attended length L_b = mask_b.sum():
      draft:   d_1..d_K greedy from [x_b, p_b]            (K + 1 draft forwards, 1 slot each)
      verify:  y = argmax target([p_b, d_1..d_K])         (positions L_b .. L_b + K)
      accept:  a_b = max{a : d_i = y_i for i <= a},  bonus = y_{a_b + 1}
      mask:    append [1] * (a_b + 1) + [0] * (K - a_b)   (pending + accepted kept, rest masked)

Subclasses change how a model is called (`forward`), which cache holds the slots
(`new_cache`) and whether finished rows leave the batch (`retire`).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from transformers import DynamicCache

from specaudit.models.compat import cache_keyword, output_cache, select_rows

CACHE_NAMES = ("cache", "past_key_values")


class MaskedSpec:
    """Greedy batch speculative decoding over a masked, never-realigned cache (keyword calls)."""

    name = "masked-spec"
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
        k = num_draft_tokens
        batch, width = input_ids.shape
        capacity = width + (k + 1) * max(max_new_tokens - 1, 0)  # each round commits at least one token
        caches = [self.new_cache(target, capacity), self.new_cache(draft, capacity)]
        mask = attention_mask.long().clone()  # [B, S]; the caller's mask stays untouched
        out: list[list[int]] = [[] for _ in range(batch)]
        rows = torch.arange(batch)  # [B'] original row of each batch row
        pending = self.prefill(target, draft, caches, input_ids, mask)  # [B]
        done = self.commit(out, rows, pending[:, None].tolist(), max_new_tokens, eos_token_id)
        while not bool(done.all()):
            rows, mask, pending, caches = self.retire(rows, mask, pending, caches, done)
            drafts = self.propose(draft, caches, mask, pending, k)  # [B', K]
            predicted = self.verify(target, caches, mask, pending, drafts)  # [B', K + 1]
            accepted = (drafts == predicted[:, :k]).long().cumprod(1).sum(1)  # [B']
            bonus = predicted.gather(1, accepted[:, None])[:, 0]  # [B']
            kept = [d[:a] + [b] for d, a, b in zip(drafts.tolist(), accepted.tolist(), bonus.tolist())]
            done = self.commit(out, rows, kept, max_new_tokens, eos_token_id)
            block = (torch.arange(k + 1)[None, :] <= accepted[:, None]).long()  # [B', K + 1]
            mask, pending = torch.cat([mask, block], dim=1), bonus
        return out

    # -- model calls ---------------------------------------------------------------------

    def new_cache(self, model: torch.nn.Module, capacity: int) -> Any:
        return DynamicCache()

    def forward(
        self, model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache: Any
    ) -> torch.Tensor:
        """One forward; returns logits [B, T, V] (the cache is updated in place)."""
        out = model(
            input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, **{cache_keyword(model): cache}
        )
        return out.logits

    # -- algorithm steps -----------------------------------------------------------------

    def prefill(
        self, target: torch.nn.Module, draft: torch.nn.Module, caches: list[Any], ids: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        """Both models over the left-padded prompts; the target's last argmax is pending. [B]"""
        positions = (mask.cumsum(-1) - 1).clamp(min=0)  # [B, T] count real tokens only
        logits = self.forward(target, ids, mask, positions, caches[0])  # [B, T, V]
        self.forward(draft, ids, mask, positions, caches[1])
        return logits[:, -1].argmax(-1)

    def propose(
        self, draft: torch.nn.Module, caches: list[Any], mask: torch.Tensor, pending: torch.Tensor, k: int
    ) -> torch.Tensor:
        """K greedy draft tokens, then dK itself, so the draft cache gains the same K + 1 slots. [B, K]"""
        token, drafts, step_mask = pending[:, None], [], mask
        for step in range(k + 1):
            position = step_mask.sum(1, keepdim=True)  # [B, 1]
            step_mask = torch.cat([step_mask, step_mask.new_ones(step_mask.shape[0], 1)], dim=1)
            logits = self.forward(draft, token, step_mask, position, caches[1])  # [B, 1, V]
            if step < k:
                token = logits[:, -1].argmax(-1, keepdim=True)  # [B, 1]
                drafts.append(token)
        return torch.cat(drafts, dim=1) if drafts else pending.new_zeros(pending.shape[0], 0)

    def verify(
        self,
        target: torch.nn.Module,
        caches: list[Any],
        mask: torch.Tensor,
        pending: torch.Tensor,
        drafts: torch.Tensor,
    ) -> torch.Tensor:
        """One target forward over [pending, drafts]; its argmax at every slot. [B, K + 1]"""
        block = torch.cat([pending[:, None], drafts], dim=1)  # [B, K + 1]
        positions = mask.sum(1, keepdim=True) + torch.arange(block.shape[1])  # [B, K + 1]
        full = torch.cat([mask, torch.ones_like(block)], dim=1)  # [B, S + K + 1]
        return self.forward(target, block, full, positions, caches[0]).argmax(-1)

    def retire(
        self, rows: torch.Tensor, mask: torch.Tensor, pending: torch.Tensor, caches: list[Any], done: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[Any]]:
        """Drop finished rows from the batch and both caches."""
        if not bool(done.any()):
            return rows, mask, pending, caches
        active = (~done).nonzero()[:, 0]  # [B']
        for cache in caches:
            select_rows(cache, active)
        return rows[active], mask[active], pending[active], caches

    @staticmethod
    def commit(
        out: list[list[int]], rows: torch.Tensor, new: list[list[int]], max_new_tokens: int, eos: int | None
    ) -> torch.Tensor:
        """Append new tokens up to EOS or the limit; True where a row is finished. [B']"""
        finished = []
        for row, tokens in zip(rows.tolist(), new):
            for token in tokens:
                if len(out[row]) >= max_new_tokens or (out[row] and out[row][-1] == eos):
                    break
                out[row].append(token)
            finished.append(len(out[row]) >= max_new_tokens or (bool(out[row]) and out[row][-1] == eos))
        return torch.tensor(finished, dtype=torch.bool)


def leading_positional(model: torch.nn.Module, given: dict[str, Any]) -> tuple[list[Any], dict[str, Any]]:
    """Split `given` into the longest run of leading positional parameters and keywords.

    Llama: (input_ids, attention_mask, position_ids, cache) all positional; GPT-2:
    (input_ids, cache, attention_mask) positional, position_ids by keyword.
    """
    args, rest = [], dict(given)
    for param in list(inspect.signature(type(model).forward).parameters.values())[1:]:
        if param.kind is not inspect.Parameter.POSITIONAL_OR_KEYWORD or param.name not in rest:
            break
        args.append(rest.pop(param.name))
    return args, rest


class Positional(MaskedSpec):
    """MaskedSpec whose calls are positional: `model(ids, mask, pos, cache)` where the forward
    signature puts them in that order, as many leading arguments as it allows otherwise."""

    name = "positional"

    def forward(
        self, model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache: Any
    ) -> torch.Tensor:
        params = inspect.signature(type(model).forward).parameters
        cache_name = next((n for n in params if n in CACHE_NAMES), cache_keyword(model))  # the earliest one
        given = {"input_ids": ids, "attention_mask": mask, "position_ids": positions, cache_name: cache}
        args, kwargs = leading_positional(model, given)
        out = model(*args, use_cache=True, **kwargs)
        assert output_cache(out) is not None, "the model returned no cache"
        return out.logits
