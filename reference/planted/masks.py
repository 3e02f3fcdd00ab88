"""Planted bugs in attention masks and padding: the mask the models get disagrees with the cache's layout.

Ragged acceptance means re-padding every round, and every re-pad must come with a mask that marks exactly the
real slots. A stale mask, an all-ones mask, pads that accumulate with a left-padded guess, right padding for a
decoder-only model or a draft run with no mask at all attends pads or drops real tokens. The harness must catch
these by the invariants (I1 for the mask's shape against the cache, I2 for the slots attended), by equivalence
where only the output shows it, and by token preservation where only the draft's proposals suffer.
"""

from __future__ import annotations

import torch

from specaudit.reference.eqspec import BatchState, EqSpec
from specaudit.reference.planted.info import BugInfo
from specaudit.reference.planted.shared import mask_in_place


class MaskNotUpdatedAfterRepad(EqSpec):
    """The attention mask passed to the models is not recomputed after the re-pad (—).

    The caches are realigned and the decoder's own bookkeeping (positions, what to keep) is
    right, but the models keep getting the pre-realignment mask (old mask plus the whole
    K + 1 block, carried over round after round): the wrong width for the new cache (HF pads
    or slices it silently) and it marks pads and dropped slots as attended.
    """

    name = "mask_not_updated_after_repad"
    bug = BugInfo("attention mask not updated after re-pad", "—", "bonus", "I1", True, batch_signature="kv-drift")

    @staticmethod
    def model_mask(state: BatchState) -> torch.Tensor:
        """The mask the models are given for the cached slots: stale after the first re-pad."""
        return getattr(state, "stale_mask", state.mask)

    def call_mask(self, state: BatchState, mask: torch.Tensor, role: str) -> torch.Tensor | None:
        cached = (state.mask if role == "target" else state.draft_mask).shape[1]
        return torch.cat([self.model_mask(state), mask[:, cached:]], dim=1)  # stale past, right new inputs

    def realign(
        self, state: BatchState, accepted: torch.Tensor, bonus: torch.Tensor, k: int, finished: torch.Tensor
    ) -> BatchState:
        stale = torch.cat([self.model_mask(state), state.mask.new_ones(accepted.shape[0], k + 1)], dim=1)
        new = super().realign(state, accepted, bonus, k, finished)
        new.stale_mask = stale[(~finished).nonzero()[:, 0]]  # [B', S + K + 1], not the new layout's
        return new


class PadsAttended(EqSpec):
    """Mask set to all ones after the re-pad, so pads are attended (seen in DSD).

    Positions (from the mask) count the pads too. Needs rows of different lengths.
    """

    name = "pads_attended"
    bug = BugInfo("pads attended (mask all ones after re-pad)", "DSD", "kv-drift", "I2", False)

    @staticmethod
    def gather_rows(
        state: BatchState, keep: torch.Tensor, draft_keep: torch.Tensor, pending: torch.Tensor, finished: torch.Tensor
    ) -> BatchState:
        new = EqSpec.gather_rows(state, keep, draft_keep, pending, finished)
        new.mask, new.draft_mask = torch.ones_like(new.mask), torch.ones_like(new.draft_mask)
        return new


class PadsAccumulate(EqSpec):
    """Rejected slots become pads in place and pads accumulate every round, with a mask
    recomputed as if all pads were on the left (seen in DSD).

    The cache grows by K + 1 slots per round and is never compacted; the mask marks each
    row's rightmost `length` slots as real, so after a rejection it attends a rejected slot
    and drops the first prompt token.
    """

    name = "pads_accumulate"
    bug = BugInfo("pads accumulate every round, wrong mask", "DSD", "bonus", "I2", True, batch_signature="kv-drift")

    def realign(
        self, state: BatchState, accepted: torch.Tensor, bonus: torch.Tensor, k: int, finished: torch.Tensor
    ) -> BatchState:
        new = mask_in_place(state, accepted, bonus, k, finished)
        width = new.mask.shape[1]
        arange = torch.arange(width, device=new.mask.device)
        left_padded = (arange[None, :] >= width - new.mask.sum(1, keepdim=True)).long()  # [B', W]
        new.mask = new.draft_mask = left_padded
        return new


class RightPadding(EqSpec):
    """Right padding for a decoder-only model (—).

    The prompts are right-padded and prefilled with the causal mask alone ("pads after the
    prompt cannot affect it"); the first token is read at column -1, a pad for every row
    shorter than the batch. Later rounds re-pad correctly, so only the first token of short
    rows is wrong. (With a correct mask, the transparent target cannot see right padding at
    all: it ignores a masked query's own input, where a real model's hidden state does not.)
    """

    name = "right_padding"
    bug = BugInfo("right padding for a decoder-only model", "—", "position-id", "equivalence", True, True)

    def prefill(
        self, target: torch.nn.Module, draft: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor
    ) -> tuple[BatchState, torch.Tensor]:
        real_first = torch.sort((attention_mask == 0).long(), dim=1, stable=True).indices  # [B, T]
        ids, mask = input_ids.gather(1, real_first), attention_mask.gather(1, real_first).long()
        state, first = super().prefill(target, draft, ids, torch.ones_like(mask))  # causal only
        state.mask = state.draft_mask = mask
        return state, first


class DraftWithoutMask(EqSpec):
    """The draft is run without an attention mask while proposing (—).

    It attends pads, so it proposes worse drafts; the target still verifies them, so the
    output is right and only token preservation sees fewer drafts accepted. Needs padding
    at proposal time, i.e. rows of different lengths.
    """

    name = "draft_without_mask"
    bug = BugInfo("draft run without a mask", "—", "output-equivalent", "token-preservation", False)

    def call_mask(self, state: BatchState, mask: torch.Tensor, role: str) -> torch.Tensor | None:
        return None if role == "draft" else mask
