"""EXSPEC: a pool of ragged sequences, batched by equal length so no realignment is needed.

Paper, section 3.2. Each sequence keeps its own unpadded caches ([1, H, S, D] per layer).
Every round the scheduler looks at a sliding window of more than B sequences:

  - group:    if at least `min_group` (default half of B, at least 2) sequences in the window
              have the same length S, up to B of them
              are stacked as they are: no pad, no mask zeros, identical positions, and after
              verification each row's cache is only cut at its own tail (no slot moves);
  - fallback: otherwise the oldest B are left-padded into one rectangle (EQSPEC's repad) and
              unpadded again after the round.

Liveness: a sequence left out of `max_wait` rounds in a row is forced into the next batch,
oldest first. New requests enter the window (and are prefilled, in one call) as others
finish, so between two target calls that include a request there are at most
`max_wait_calls` other target calls.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from specaudit.models.compat import cache_from_tensors, cache_layers
from specaudit.reference.eqspec import BatchState, EqSpec

Layers = list[tuple[torch.Tensor, torch.Tensor]]


@dataclass
class Sequence:
    """One request in the pool: its own caches, unpadded, and its scheduling state."""

    row: int
    pending: int  # last committed token, not yet in either cache
    target_kv: Layers  # per layer [1, H, S, D]
    draft_kv: Layers
    waited: int = 0  # rounds in a row left out of the batch

    @property
    def length(self) -> int:
        return int(self.target_kv[0][0].shape[2])


def stack(sequences: list[Sequence], which: str) -> tuple[DynamicCache, torch.Tensor]:
    """Stack per-sequence caches into one batch cache, left-padding shorter rows. Returns the
    cache and its mask [B, S_max]; with equal lengths nothing is padded."""
    width = max(s.length for s in sequences)
    device = sequences[0].target_kv[0][0].device
    mask = torch.tensor([[0] * (width - s.length) + [1] * s.length for s in sequences], device=device)
    per_seq = [getattr(s, which) for s in sequences]
    layers = []
    for layer in range(len(per_seq[0])):
        ks = [F.pad(kv[layer][0], (0, 0, width - kv[layer][0].shape[2], 0)) for kv in per_seq]  # [1, H, W, D]
        vs = [F.pad(kv[layer][1], (0, 0, width - kv[layer][1].shape[2], 0)) for kv in per_seq]
        layers.append((torch.cat(ks), torch.cat(vs)))
    return cache_from_tensors(layers), mask


def unstack(cache: DynamicCache, row: int, start: int, stop: int) -> Layers:
    """Row `row`'s slots [start, stop) of a batch cache: slicing only, no slot moves."""
    return [(k[row : row + 1, :, start:stop], v[row : row + 1, :, start:stop]) for k, v in cache_layers(cache)]


class ExSpec(EqSpec):
    """Reference EXSPEC decoder (greedy); EQSPEC's propose / verify / accept per round."""

    name = "EXSPEC"

    def __init__(self, batch_size: int = 4, window: int = 8, max_wait: int = 3, min_group: int | None = None) -> None:
        if batch_size < 1 or window < batch_size or max_wait < 1:
            raise ValueError("need batch_size >= 1, window >= batch_size and max_wait >= 1")
        self.batch_size, self.window, self.max_wait = batch_size, window, max_wait
        # a group thinner than this is not worth a verification call of its own: pad instead
        self.min_group = min_group if min_group is not None else max(2, (batch_size + 1) // 2)
        self.grouped_rounds = 0
        self.fallback_rounds = 0

    @property
    def max_batch_size(self) -> int:
        """Requests under way at once: the window (a request beyond it queues until a row frees up)."""
        return self.window

    @property
    def max_wait_calls(self) -> int:
        """Target calls that can pass between two calls including one request: up to
        max_wait rounds left out, plus the rounds forced sequences ahead of it take, each
        round possibly preceded by one prefill call for newly admitted requests."""
        rounds = self.max_wait + math.ceil(self.window / self.batch_size)
        return 2 * rounds + 1

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
        waiting = list(range(input_ids.shape[0]))  # arrival order
        active: list[Sequence] = []
        while waiting or active:
            admitted, waiting = waiting[: self.window - len(active)], waiting[self.window - len(active) :]
            if admitted:
                fresh = self.prefill_rows(target, draft, input_ids[admitted], attention_mask[admitted], admitted)
                done = self.commit(
                    out, torch.tensor(admitted), [[s.pending] for s in fresh], max_new_tokens, eos_token_id
                )
                active += [s for s, d in zip(fresh, done.tolist()) if not d]
            if not active:
                continue
            batch = self.schedule(active)
            finished = self.round(target, draft, batch, num_draft_tokens, out, max_new_tokens, eos_token_id)
            for s in active:
                s.waited = 0 if s in batch else s.waited + 1
            active = [s for s in active if s.row not in finished]
        return out

    def prefill_rows(
        self,
        target: torch.nn.Module,
        draft: torch.nn.Module,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        rows: list[int],
    ) -> list[Sequence]:
        """One padded prefill for the admitted requests, then unpad each row's caches."""
        state, first = self.prefill(target, draft, input_ids, attention_mask)
        width = attention_mask.shape[1]
        lengths = attention_mask.sum(1).tolist()
        return [
            Sequence(
                row,
                int(first[b]),
                unstack(state.target_cache, b, width - n, width),
                unstack(state.draft_cache, b, width - n, width),
            )
            for b, (row, n) in enumerate(zip(rows, lengths))
        ]

    def schedule(self, active: list[Sequence]) -> list[Sequence]:
        """Pick this round's batch from the window (the active sequences, oldest first)."""
        # longest wait first: serving forced sequences in pool order could starve a late one
        forced = sorted((s for s in active if s.waited >= self.max_wait), key=lambda s: -s.waited)
        by_length = Counter(s.length for s in active)
        anchor = forced[0] if forced else max(active, key=lambda s: by_length[s.length])
        group = [s for s in active if s.length == anchor.length]
        if len(group) >= min(self.min_group, len(active)):
            self.grouped_rounds += 1
            return ([anchor] + [s for s in group if s is not anchor])[: self.batch_size]
        self.fallback_rounds += 1
        rest = [s for s in active if s not in forced]
        return (forced + rest)[: self.batch_size]

    def round(
        self,
        target: torch.nn.Module,
        draft: torch.nn.Module,
        batch: list[Sequence],
        k: int,
        out: list[list[int]],
        max_new_tokens: int,
        eos_token_id: int | None,
    ) -> set[int]:
        """One EQSPEC round on the stacked batch; returns the rows that finished."""
        target_cache, mask = stack(batch, "target_kv")
        draft_cache, _ = stack(batch, "draft_kv")
        rows = torch.tensor([s.row for s in batch])
        pending = torch.tensor([s.pending for s in batch], device=mask.device)
        state = BatchState(rows, mask, mask, pending, target_cache, draft_cache)
        drafts = self.propose(draft, state, k)  # [B, K]
        predicted = self.batch_verify(target, state, drafts)  # [B, K + 1]
        accepted, bonus = self.accept(drafts, predicted)
        new_tokens = [d[:a] + [b] for d, a, b in zip(drafts.tolist(), accepted.tolist(), bonus.tolist())]
        finished = self.commit(out, rows, new_tokens, max_new_tokens, eos_token_id)
        width = mask.shape[1]
        for b, s in enumerate(batch):
            keep = slice(width - s.length, width + 1 + int(accepted[b]))  # prompt .. last accepted draft
            s.target_kv = unstack(state.target_cache, b, keep.start, keep.stop)
            s.draft_kv = unstack(state.draft_cache, b, keep.start, keep.stop)
            s.pending = int(bonus[b])
        return {s.row for s, f in zip(batch, finished.tolist()) if f}
