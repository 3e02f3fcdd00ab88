"""Planted bugs in the KV cache: rejected, cropped, stale or garbage entries attended after a round.

After verification each row keeps a different number of drafts, and the caches must be rolled back and re-padded
to match. Keeping rejected drafts, cropping the whole batch to the shortest acceptance, keeping one slot too
many, attending uninitialised pad slots or permuting cache rows relative to their sequences leaves the models
attending a context that is not the committed one. The harness must name the slot at fault (I2), even where the
output stays right for a while; a draft cache never rolled back keeps the output right and must be seen by
token preservation.
"""

from __future__ import annotations

import torch

from specaudit.models.compat import cache_layers, select_rows, set_cache_layers
from specaudit.reference.eqspec import BatchState, EqSpec
from specaudit.reference.planted.info import BugInfo
from specaudit.reference.planted.shared import mask_in_place


class RejectedKvAttended(EqSpec):
    """Rejected drafts' KV kept in the cache and attended in the next round (seen in BSP).

    Signature: KV drift; I2 names the slot holding the rejected draft.
    """

    name = "rejected_kv_attended"
    bug = BugInfo("rejected drafts' KV kept and attended", "BSP", "bonus", "I2", True, batch_signature="kv-drift")

    def realign(
        self, state: BatchState, accepted: torch.Tensor, bonus: torch.Tensor, k: int, finished: torch.Tensor
    ) -> BatchState:
        everything = torch.ones(accepted.shape[0], k + 1, dtype=torch.bool, device=accepted.device)  # all attended
        keep = torch.cat([state.mask.bool(), everything], dim=1)
        draft_keep = torch.cat([state.draft_mask.bool(), everything], dim=1)
        return self.gather_rows(state, keep, draft_keep, bonus, finished)


class RejectedKvMaskedNoPositionIds(EqSpec):
    """Rejected KV kept in the cache with mask 0, and no position ids passed (seen in BSP).

    Masking the rejected slots would be fine (see LazySpec) if positions counted attended
    slots only; without position ids the model uses past length + arange, which counts the
    masked rejected slots: position gaps after the first round with a rejection. The prefill
    passes correct positions; the rounds also count any pads the post-prefill re-pad leaves.
    """

    name = "rejected_kv_masked_no_position_ids"
    bug = BugInfo("rejected KV kept masked, no position ids passed", "BSP", "position-id", "I2", True)

    def positions(self, state: BatchState, mask: torch.Tensor, width: int, role: str) -> torch.Tensor | None:
        return None

    def realign(
        self, state: BatchState, accepted: torch.Tensor, bonus: torch.Tensor, k: int, finished: torch.Tensor
    ) -> BatchState:
        return mask_in_place(state, accepted, bonus, k, finished)


class KvCroppedToMinAcceptance(EqSpec):
    """Every row's cache cropped to the batch's minimum acceptance (seen in DSD).

    One `crop` for the whole batch: rows that accepted more commit their tokens but lose
    their KV, so the next round attends a context with tokens missing. Needs B >= 2 with
    different acceptance.
    """

    name = "kv_cropped_to_min_acceptance"
    bug = BugInfo("KV cropped to the batch's minimum acceptance", "DSD", "kv-drift", "I2", False)

    def realign(
        self, state: BatchState, accepted: torch.Tensor, bonus: torch.Tensor, k: int, finished: torch.Tensor
    ) -> BatchState:
        return super().realign(state, accepted.min().expand_as(accepted), bonus, k, finished)


class RealignOffByOne(EqSpec):
    """Realignment keeps one slot too many: range(a + 2) for range(a + 1) (—).

    The first rejected draft survives the re-pad and is attended next round (unless the whole
    block was accepted).
    """

    name = "realign_off_by_one"
    bug = BugInfo("realignment range off by one", "—", "bonus", "I2", True, batch_signature="kv-drift")

    def realign(
        self, state: BatchState, accepted: torch.Tensor, bonus: torch.Tensor, k: int, finished: torch.Tensor
    ) -> BatchState:
        return super().realign(state, (accepted + 1).clamp(max=k), bonus, k, finished)


class DraftCacheNotRolledBack(EqSpec):
    """The draft's cache keeps its rejected proposals (seen in BSP).

    Output unchanged; only token preservation catches it (fewer drafts accepted than allowed).
    """

    name = "draft_cache_not_rolled_back"
    bug = BugInfo("draft cache never rolled back", "BSP", "output-equivalent", "token-preservation", True)

    def realign(
        self, state: BatchState, accepted: torch.Tensor, bonus: torch.Tensor, k: int, finished: torch.Tensor
    ) -> BatchState:
        block = torch.arange(k + 1, device=accepted.device)[None, :] <= accepted[:, None]
        keep = torch.cat([state.mask.bool(), block], dim=1)
        draft_keep = torch.cat([state.draft_mask.bool(), torch.ones_like(block)], dim=1)  # nothing rolled back
        return self.gather_rows(state, keep, draft_keep, bonus, finished)


class UninitialisedPadSlots(EqSpec):
    """Realignment into `torch.empty`: only real slots are written, pads hold whatever the
    allocator returned, and the mask is then set to all ones (—).

    Garbage in masked pad slots is harmless (a correct decoder may leave it); the bug is
    the mask, written on the belief that a fresh buffer is zeros and a zero K/V "contributes
    nothing" (neither holds). Needs rows of different lengths after a re-pad.
    """

    name = "uninitialised_pad_slots"
    bug = BugInfo("re-pad leaves uninitialised pad slots, then attends them", "—", "kv-drift", "I2", False)

    @staticmethod
    def gather_rows(
        state: BatchState, keep: torch.Tensor, draft_keep: torch.Tensor, pending: torch.Tensor, finished: torch.Tensor
    ) -> BatchState:
        new = EqSpec.gather_rows(state, keep, draft_keep, pending, finished)
        for cache, mask in ((new.target_cache, new.mask), (new.draft_cache, new.draft_mask)):
            real = mask.bool()[:, None, :, None]  # [B', 1, W, 1]
            layers = []
            for k, v in cache_layers(cache):  # [B', H, W, D]
                fresh_k, fresh_v = torch.empty_like(k), torch.empty_like(v)  # uninitialised
                layers.append((torch.where(real, k, fresh_k), torch.where(real, v, fresh_v)))  # real slots only
            set_cache_layers(cache, layers)
        new.mask, new.draft_mask = torch.ones_like(new.mask), torch.ones_like(new.draft_mask)
        return new


class CacheRowsPermuted(EqSpec):
    """Cache rows re-ordered relative to the sequences (—).

    The re-pad packs the caches longest row first (with their masks), but the row
    bookkeeping (`rows`, `pending`) keeps the old order: a row's pending token is appended to
    another request's cache. Needs two rows whose lengths order differently from their rows.
    """

    name = "cache_rows_permuted"
    bug = BugInfo("cache rows permuted relative to sequences", "—", "kv-drift", "I2", False)

    @staticmethod
    def gather_rows(
        state: BatchState, keep: torch.Tensor, draft_keep: torch.Tensor, pending: torch.Tensor, finished: torch.Tensor
    ) -> BatchState:
        new = EqSpec.gather_rows(state, keep, draft_keep, pending, finished)
        order = torch.sort(new.mask.sum(1), descending=True, stable=True).indices  # longest first
        select_rows(new.target_cache, order)
        select_rows(new.draft_cache, order)
        new.mask, new.draft_mask = new.mask[order], new.draft_mask[order]  # rows and pending not permuted
        return new
