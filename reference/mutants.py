"""Planted bugs: small named variations of EqSpec that the suite must catch.

Each is a negative control for a check. `CATALOG` maps name to class, and every entry can be
run with `--decoder reference.mutants:NAME`.
"""

from __future__ import annotations

import torch

from reference.eqspec import BatchState, EqSpec


class BonusFromDraft(EqSpec):
    """Bonus token taken from the draft instead of the target (seen in DSD).

    Signature: sampling/bonus error, diverges even at batch size 1; output-visible.
    """

    name = "bonus_from_draft"

    @staticmethod
    def accept(drafts: torch.Tensor, predicted: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        accepted, bonus = EqSpec.accept(drafts, predicted)
        k = drafts.shape[1]
        from_draft = drafts.gather(1, accepted.clamp(max=k - 1)[:, None])[:, 0]  # the rejected draft itself
        return accepted, torch.where(accepted < k, from_draft, bonus)


class RejectedKvAttended(EqSpec):
    """Rejected drafts' KV kept in the cache and attended in the next round (seen in BSP).

    Signature: KV drift; I2 names the slot holding the rejected draft.
    """

    name = "rejected_kv_attended"

    def realign(
        self, state: BatchState, accepted: torch.Tensor, bonus: torch.Tensor, k: int, finished: torch.Tensor
    ) -> BatchState:
        everything = torch.ones(accepted.shape[0], k + 1, dtype=torch.bool)  # rejected slots stay attended
        keep = torch.cat([state.mask.bool(), everything], dim=1)
        draft_keep = torch.cat([state.draft_mask.bool(), everything], dim=1)
        return self.gather_rows(state, keep, draft_keep, bonus, finished)


class DraftCacheNotRolledBack(EqSpec):
    """The draft's cache keeps its rejected proposals (seen in BSP).

    Output unchanged; only token preservation catches it (fewer drafts accepted than allowed).
    """

    name = "draft_cache_not_rolled_back"

    def realign(
        self, state: BatchState, accepted: torch.Tensor, bonus: torch.Tensor, k: int, finished: torch.Tensor
    ) -> BatchState:
        block = torch.arange(k + 1)[None, :] <= accepted[:, None]
        keep = torch.cat([state.mask.bool(), block], dim=1)
        draft_keep = torch.cat([state.draft_mask.bool(), torch.ones_like(block)], dim=1)  # nothing rolled back
        return self.gather_rows(state, keep, draft_keep, bonus, finished)


CATALOG: dict[str, type[EqSpec]] = {
    cls.name: cls for cls in (BonusFromDraft, RejectedKvAttended, DraftCacheNotRolledBack)
}
globals().update(CATALOG)
