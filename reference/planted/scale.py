"""Planted bugs that only the larger generated space reaches: batch size, sequence length, dtype and draft.

Each is exact on small cases and wrong past a boundary: a per-row buffer of 16 rows, position ids that wrap at
256 or round in bfloat16, acceptance that counts matches after the first rejection (which a scripted draft rarely
produces but a real one does), a bonus read from a window sized for K = 3. They exist to prove that the search
space (rows, lengths, real models in low precision, real drafts, deep K) is wide enough: the harness must catch
them there, and tests/test_mutants.py checks that each passes just inside the old, narrower space and fails
just past it.
"""

from __future__ import annotations

import torch

from specaudit.reference.eqspec import BatchState, EqSpec
from specaudit.reference.planted.info import BugInfo


class RowBufferOf16(EqSpec):
    """Each round's bonus tokens are staged in a buffer of 16 rows (a serving default's max
    batch size) and copied into the next round's inputs; rows past 16 keep the zero the fresh
    input tensor was allocated with (—).

    Exact for up to 16 running rows; with more, row 17 onwards continues from token 0 instead
    of its bonus. Needs 17 rows still running after a round.
    """

    name = "row_buffer_of_16"
    bug = BugInfo("fixed-size per-row buffer (16 rows)", "—", "kv-drift", "I2", False, min_rows=17)
    capacity = 16

    def realign(
        self, state: BatchState, accepted: torch.Tensor, bonus: torch.Tensor, k: int, finished: torch.Tensor
    ) -> BatchState:
        pending = bonus.new_zeros(bonus.shape)  # [B], fresh
        pending[: self.capacity] = bonus[: self.capacity]  # only the buffer's 16 rows are copied
        return super().realign(state, accepted, pending, k, finished)


class PositionsWrapAt256(EqSpec):
    """Position ids of the rounds held in a uint8 buffer, so they wrap at 256 (—).

    The prefill's positions are right; every round's are taken modulo 256. Exact while a row
    is shorter than 256 tokens, wrong from position 256 on, like a cache with a fixed
    position capacity.
    """

    name = "positions_wrap_at_256"
    bug = BugInfo("position ids wrap at 256", "—", "position-id", "I2", True)

    def positions(self, state: BatchState, mask: torch.Tensor, width: int, role: str) -> torch.Tensor | None:
        return super().positions(state, mask, width, role).to(torch.uint8).long()  # [B, width], modulo 256


class PositionsInModelDtype(EqSpec):
    """Position ids of the rounds computed in the model's dtype and cast back (—).

    Exact in float64 and in float32 below 2^24; in bfloat16 (8 significant bits) every
    position above 256 that is not a multiple of 2 rounds to a neighbour, so two tokens share a
    position or a position is skipped. Needs a tiny real model in bfloat16 and a row past
    position 256.
    """

    name = "positions_in_model_dtype"
    bug = BugInfo("position ids computed in the model's dtype", "—", "position-id", "I2", True, models=("llama",))

    def prefill(
        self, target: torch.nn.Module, draft: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor
    ) -> tuple[BatchState, torch.Tensor]:
        self.position_dtype = next(target.parameters()).dtype
        return super().prefill(target, draft, input_ids, attention_mask)

    def positions(self, state: BatchState, mask: torch.Tensor, width: int, role: str) -> torch.Tensor | None:
        return super().positions(state, mask, width, role).to(self.position_dtype).long()  # rounded in low precision


class MatchesAfterRejectionAccepted(EqSpec):
    """Acceptance counts every draft that matches the target, not the leading run
    (`matches.sum` for `matches.cumprod(...).sum`; —).

    A draft that matches after the first rejection (the target's prediction given the rejected
    draft) is accepted too. The scripted draft proposes a wrong token after every rejection,
    so on the transparent model it shows only when that token happens to equal the target's
    prediction (1 in 128 per draft); a real draft agrees with its target after a rejection as
    often as before one.
    """

    name = "matches_after_rejection_accepted"
    bug = BugInfo(
        "drafts matching after the first rejection accepted", "—", "bonus", "equivalence", True, models=("gpt2",)
    )

    @staticmethod
    def accept(drafts: torch.Tensor, predicted: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        k = drafts.shape[1]
        accepted = (drafts == predicted[:, :k]).long().sum(dim=1)  # [B], every match counted
        return accepted, predicted.gather(1, accepted[:, None])[:, 0]


class BonusWindowOfThree(EqSpec):
    """Rows with a rejection read their bonus from a window of the first 3 predictions, a
    buffer sized for K = 3 (—).

    Right after 0, 1 or 2 accepted drafts and when all K are accepted; after 3 or more
    accepted drafts and then a rejection (K >= 4), the bonus is the target's prediction for
    the 3rd draft's position. Needs deep acceptance followed by a rejection.
    """

    name = "bonus_window_of_three"
    bug = BugInfo("bonus read from a 3-wide window after a deep acceptance", "—", "bonus", "equivalence", True)

    @staticmethod
    def accept(drafts: torch.Tensor, predicted: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        accepted, bonus = EqSpec.accept(drafts, predicted)
        window = predicted[:, :3]  # [B, 3], sized for K = 3
        partial = window.gather(1, accepted.clamp(max=2)[:, None])[:, 0]  # [B]
        return accepted, torch.where(accepted < drafts.shape[1], partial, bonus)
