"""Planted bugs in acceptance and the bonus token: which drafts a round keeps, and what it commits after them.

The acceptance scan and the bonus choice are the heart of speculative decoding, and the easiest place for an
off-by-one: a wrong comparison, a shifted logit, a bonus from the wrong model or the wrong window. Most of these
change the output even at batch size 1, so the equivalence check must catch them; the rest (acceptance one
short, cropping every row to the shortest) keep the output right and discard verified drafts, which only token
preservation can see; a missing bonus stalls a round that accepts nothing (a liveness bug), which shows as a
short output that equivalence must catch.
"""

from __future__ import annotations

import torch

from specaudit.reference.eqspec import BatchState, EqSpec
from specaudit.reference.planted.info import BugInfo


class BonusFromDraft(EqSpec):
    """Bonus token taken from the draft instead of the target (seen in DSD).

    Signature: sampling/bonus error, diverges even at batch size 1; output-visible.
    """

    name = "bonus_from_draft"
    bug = BugInfo("bonus token taken from the draft", "DSD", "bonus", "equivalence", True)

    @staticmethod
    def accept(drafts: torch.Tensor, predicted: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        accepted, bonus = EqSpec.accept(drafts, predicted)
        k = drafts.shape[1]
        from_draft = drafts.gather(1, accepted.clamp(max=k - 1)[:, None])[:, 0]  # the rejected draft itself
        return accepted, torch.where(accepted < k, from_draft, bonus)


class FirstMismatchAccepted(EqSpec):
    """The first mismatching draft is accepted too (`<=` for `<` in the acceptance scan; seen in DSD).

    The cache keeps what the output says, so I2 is satisfied; the output carries the wrong
    draft at once, even at batch size 1.
    """

    name = "first_mismatch_accepted"
    bug = BugInfo("first mismatching draft accepted", "DSD", "bonus", "equivalence", True)

    @staticmethod
    def accept(drafts: torch.Tensor, predicted: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        accepted, _ = EqSpec.accept(drafts, predicted)
        accepted = (accepted + 1).clamp(max=drafts.shape[1])  # one past the longest matching prefix
        return accepted, predicted.gather(1, accepted[:, None])[:, 0]


class AcceptanceOneShort(EqSpec):
    """Acceptance scans only the first K - 1 drafts, so the K-th is never accepted (—).

    The bonus is still the target's token after the accepted prefix, so the output is right;
    only token preservation can see fewer drafts accepted than the schedule allows. (Today it
    does not on generated cases: check_token_preservation stops following a row once v < b,
    before its verified-kept test.)
    """

    name = "acceptance_one_short"
    bug = BugInfo("acceptance computed one draft short", "—", "output-equivalent", "token-preservation", True)

    @staticmethod
    def accept(drafts: torch.Tensor, predicted: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return EqSpec.accept(drafts[:, :-1], predicted)  # range(K - 1) where range(K) was meant


class LogitsShiftedByOne(EqSpec):
    """Draft d_i compared with the target's prediction one input later (logits[:, 1:]; —).

    The classic shift between "logits at input i" and "prediction for token i + 1", made in
    the wrong direction; diverges at once, even at batch size 1.
    """

    name = "logits_shifted_by_one"
    bug = BugInfo("logits shifted by one", "—", "bonus", "equivalence", True)

    def batch_verify(self, target: torch.nn.Module, state: BatchState, drafts: torch.Tensor) -> torch.Tensor:
        predicted = super().batch_verify(target, state, drafts)  # [B, K + 1]
        return torch.cat([predicted[:, 1:], predicted[:, -1:]], dim=1)


class NoBonusToken(EqSpec):
    """No bonus token: a round commits only its accepted drafts (—).

    The last accepted draft becomes the next pending token, so the state stays consistent
    and the output is right while drafts are accepted; but a round that accepts nothing makes
    no progress, and the same drafts are proposed again forever (liveness). This mutant caps
    its own loop at 4 * max_new_tokens rounds and returns what it has, so it fails with a
    short output instead of hanging.
    """

    name = "no_bonus_token"
    bug = BugInfo("no bonus token (liveness)", "—", "bookkeeping", "equivalence", True)

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
        for _ in range(4 * max_new_tokens):  # the cap that stands in for a hang
            if not state.rows.numel():
                break
            drafts = self.propose(draft, state, num_draft_tokens)  # [B, K]
            predicted = self.batch_verify(target, state, drafts)  # [B, K + 1]
            accepted, _ = self.accept(drafts, predicted)  # the target's bonus is never taken
            new_tokens = [d[:a] for d, a in zip(drafts.tolist(), accepted.tolist())]
            finished = self.commit(out, state.rows, new_tokens, max_new_tokens, eos_token_id)
            last = drafts.gather(1, (accepted - 1).clamp(min=0)[:, None])[:, 0]
            pending = torch.where(accepted > 0, last, state.pending)  # nothing accepted: nothing changes
            state = self.realign(state, accepted - 1, pending, num_draft_tokens, finished)
        return out


class CropToShortest(EqSpec):
    """Every row keeps only the batch's minimum accepted count and re-drafts the rest (—).

    The "rollback" strategy for ragged acceptance (paper, section 2: it discards verified
    tokens): no re-padding is ever needed because all rows advance equally. Output-equivalent
    (the token after the kept prefix is the target's own prediction); only token preservation
    can see verified tokens thrown away.
    Needs rows with different acceptance.
    """

    name = "crop_to_shortest"
    bug = BugInfo(
        "crop every row to the batch's shortest acceptance", "—", "output-equivalent", "token-preservation", False
    )

    @staticmethod
    def accept(drafts: torch.Tensor, predicted: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        accepted, _ = EqSpec.accept(drafts, predicted)
        accepted = accepted.min().expand_as(accepted)  # every row advances like the slowest one
        return accepted, predicted.gather(1, accepted[:, None])[:, 0]
