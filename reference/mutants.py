"""Planted bugs: small named variations of EqSpec that the suite must catch.

Each is a negative control for a check. `CATALOG` maps name to class, and every entry can be
run with `--decoder specaudit.reference.mutants:NAME`. Every class documents the bug class and where it
was seen ("—": nowhere in particular), and carries a `bug: BugInfo` whose `first_check`
and `visible_at_batch_1` were measured with the harness on generated cases
(tests/test_mutants.py keeps them honest).

Checks run in the registry's order (`specaudit.checks.registry.CHECKS`: contract, I1, I2, equivalence,
token-preservation, liveness, grouped-no-realignment, order-independence); `first_check` is the
first of those that reports a violation on the shrunk failing case.

Signatures:
  position-id        wrong position ids, or slots written at wrong positions (I2 position rule)
  kv-drift           a stale, pad, garbage or rejected entry attended
  bonus              a wrong token choice, visible even at batch size 1
  output-equivalent  output unchanged; only token preservation or an invariant catches it
  bookkeeping        EOS, length or row-order errors in the output
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache

from specaudit.models.compat import cache_keyword, cache_layers, call_model, output_cache, select_rows, set_cache_layers
from specaudit.reference.eqspec import BatchState, EqSpec, left_pad_positions


@dataclass(frozen=True)
class BugInfo:
    bug_class: str  # short description
    seen_in: str  # "DSD", "BSP", "HF defaults", "several" or "—"
    signature: str  # one of SIGNATURES: what specaudit.checks.diagnosis names it
    first_check: str  # first failing check, in the registry's order
    visible_at_batch_1: bool  # True if it fails even with a single row
    needs_padding: bool = False  # at batch size 1 only with extra pad columns: its smallest case may use a 2nd row
    models: tuple[str, ...] = ("transparent",)  # where tests/test_mutants.py searches for it (the first one)
    min_rows: int = 0  # rows its smallest failing case needs; 0: 1 or 2, as visible_at_batch_1 and needs_padding say


# ---------------------------------------------------------------------------------------
# Shared pieces


def mask_in_place(
    state: BatchState, accepted: torch.Tensor, bonus: torch.Tensor, k: int, finished: torch.Tensor
) -> BatchState:
    """Realignment by masking: nothing moves, rejected slots stay in the cache with mask 0, the
    cache grows by K + 1 slots per round; finished rows are dropped."""
    block = (torch.arange(k + 1, device=accepted.device)[None, :] <= accepted[:, None]).long()  # [B, K + 1]
    active = (~finished).nonzero()[:, 0]  # [B']
    mask = torch.cat([state.mask, block], dim=1)[active]  # [B', S + K + 1]
    draft_mask = torch.cat([state.draft_mask, block], dim=1)[active]
    if active.numel() < finished.numel():
        select_rows(state.target_cache, active)
        select_rows(state.draft_cache, active)
    return BatchState(state.rows[active], mask, draft_mask, bonus[active], state.target_cache, state.draft_cache)


# ---------------------------------------------------------------------------------------
# Bonus / acceptance


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


# ---------------------------------------------------------------------------------------
# KV cache: rejected, cropped, stale or garbage entries


class RejectedKvAttended(EqSpec):
    """Rejected drafts' KV kept in the cache and attended in the next round (seen in BSP).

    Signature: KV drift; I2 names the slot holding the rejected draft.
    """

    name = "rejected_kv_attended"
    bug = BugInfo("rejected drafts' KV kept and attended", "BSP", "kv-drift", "I2", True)

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
    bug = BugInfo("realignment range off by one", "—", "kv-drift", "I2", True)

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


# ---------------------------------------------------------------------------------------
# Masks and padding


class MaskNotUpdatedAfterRepad(EqSpec):
    """The attention mask passed to the models is not recomputed after the re-pad (—).

    The caches are realigned and the decoder's own bookkeeping (positions, what to keep) is
    right, but the models keep getting the pre-realignment mask (old mask plus the whole
    K + 1 block, carried over round after round): the wrong width for the new cache (HF pads
    or slices it silently) and it marks pads and dropped slots as attended.
    """

    name = "mask_not_updated_after_repad"
    bug = BugInfo("attention mask not updated after re-pad", "—", "kv-drift", "I1", True)

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
    bug = BugInfo("pads accumulate every round, wrong mask", "DSD", "kv-drift", "I2", True)

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
    bug = BugInfo("right padding for a decoder-only model", "—", "bookkeeping", "equivalence", True, True)

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


# ---------------------------------------------------------------------------------------
# Position ids


class PositionsFromArange(EqSpec):
    """Position ids from past length + arange, offset by each row's padding at prefill and
    never updated (seen in BSP; HF's default arange positions).

    Right at first; wrong as soon as a re-pad changes a row's padding (at batch size 1, when
    the prompt had extra pad columns, which the first re-pad removes).
    """

    name = "positions_from_arange"
    bug = BugInfo("position ids from arange, ignoring padding", "BSP, HF defaults", "position-id", "I2", True)

    def prefill(
        self, target: torch.nn.Module, draft: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor
    ) -> tuple[BatchState, torch.Tensor]:
        self.prefill_pads = (attention_mask == 0).sum(1)  # [B], frozen from here on
        return super().prefill(target, draft, input_ids, attention_mask)

    def positions(self, state: BatchState, mask: torch.Tensor, width: int, role: str) -> torch.Tensor | None:
        return mask.shape[1] - self.prefill_pads[state.rows][:, None] + torch.arange(width, device=mask.device)


class BatchUniformCacheOffset(EqSpec):
    """One cache offset for the whole batch: every row's new positions start at the cache
    width, like HF's batch-wide `cache_position` (HF defaults).

    Right for the longest row only; wrong for every row with pads at the time of the call.
    """

    name = "batch_uniform_cache_offset"
    bug = BugInfo("batch-uniform cache offset", "HF defaults", "position-id", "I2", False)

    def positions(self, state: BatchState, mask: torch.Tensor, width: int, role: str) -> torch.Tensor | None:
        return (mask.shape[1] + torch.arange(width, device=mask.device)).expand(mask.shape[0], width)


class VerifyPositionOffByOne(EqSpec):
    """The verify call's positions start one too late: length + 1 + arange (several).

    Diverges at once, even at batch size 1.
    """

    name = "verify_position_off_by_one"
    bug = BugInfo("position off by one in the verify call", "several", "position-id", "I2", True)

    def positions(self, state: BatchState, mask: torch.Tensor, width: int, role: str) -> torch.Tensor | None:
        shift = 1 if role == "target" else 0
        return mask.sum(1, keepdim=True) + shift + torch.arange(width, device=mask.device)


# ---------------------------------------------------------------------------------------
# Bookkeeping: EOS and length


class EosScansPaddedRow(EqSpec):
    """The EOS test scans the whole padded row, input included: `(ids == eos).any(-1)` (—).

    A row whose padded input holds the EOS id anywhere (a pad id equal to EOS, or EOS as a
    real prompt token) is finished after its first token.
    """

    name = "eos_scans_padded_row"
    bug = BugInfo("EOS check scans the padded row", "—", "bookkeeping", "equivalence", True, True)

    def prefill(
        self, target: torch.nn.Module, draft: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor
    ) -> tuple[BatchState, torch.Tensor]:
        self.padded_input = input_ids  # [B, T], pads included
        return super().prefill(target, draft, input_ids, attention_mask)

    def commit(
        self,
        out: list[list[int]],
        rows: torch.Tensor,
        new_tokens: list[list[int]],
        max_new_tokens: int,
        eos_token_id: int | None,
    ) -> torch.Tensor:
        finished = EqSpec.commit(out, rows, new_tokens, max_new_tokens, eos_token_id)
        if eos_token_id is None:
            return finished
        return finished | (self.padded_input[rows] == eos_token_id).any(1)


class MaxNewTokensOverrun(EqSpec):
    """The length limit is checked once per round, before the round's tokens go in (—).

    The last round appends all its accepted drafts and the bonus, overrunning
    max_new_tokens (the contract rejects the output).
    """

    name = "max_new_tokens_overrun"
    bug = BugInfo("max_new_tokens not respected in the last round", "—", "contract", "contract", True)

    def commit(
        self,
        out: list[list[int]],
        rows: torch.Tensor,
        new_tokens: list[list[int]],
        max_new_tokens: int,
        eos_token_id: int | None,
    ) -> torch.Tensor:
        for row, tokens in zip(rows.tolist(), new_tokens):  # below the limit: the whole round goes in
            EqSpec.commit(out, torch.tensor([row]), [tokens], len(out[row]) + len(tokens), eos_token_id)
        return torch.tensor(
            [len(out[r]) >= max_new_tokens or out[r][-1] == eos_token_id for r in rows.tolist()], dtype=torch.bool
        )


# ---------------------------------------------------------------------------------------
# Scale, dtype and draft: bugs only the larger generated space reaches


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


CATALOG: dict[str, type[EqSpec]] = {
    cls.name: cls
    for cls in (
        BonusFromDraft,
        FirstMismatchAccepted,
        RejectedKvAttended,
        RejectedKvMaskedNoPositionIds,
        PositionsFromArange,
        VerifyPositionOffByOne,
        MaskNotUpdatedAfterRepad,
        PadsAttended,
        PadsAccumulate,
        KvCroppedToMinAcceptance,
        RealignOffByOne,
        NoBonusToken,
        LogitsShiftedByOne,
        RightPadding,
        DraftCacheNotRolledBack,
        AcceptanceOneShort,
        CacheRowsPermuted,
        UninitialisedPadSlots,
        BatchUniformCacheOffset,
        EosScansPaddedRow,
        MaxNewTokensOverrun,
        DraftWithoutMask,
        CropToShortest,
        RowBufferOf16,
        PositionsWrapAt256,
        PositionsInModelDtype,
        MatchesAfterRejectionAccepted,
        BonusWindowOfThree,
    )
}
globals().update(CATALOG)


# ---------------------------------------------------------------------------------------
# Contract: side effects and unobserved calls (output right, the decoder contract broken)


def forward_directly(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    cache: Any,
) -> tuple[torch.Tensor, Any]:
    """`compat.call_model`, through `model.forward(...)`: the module's hooks never run."""
    kwargs = {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids}
    out = model.forward(**kwargs, use_cache=True, **{cache_keyword(model): cache})
    return out.logits, output_cache(out)


class ForwardBypass(EqSpec):
    """Every target call goes through `target.forward(...)` instead of `target(...)`, as
    wrappers do that want to skip hook overhead (—).

    The tokens are right, but no forward hook of the target runs: not accelerate's device
    placement or offloading, not an instrumentation. The harness refuses such a run as
    unobserved instead of judging it on the calls it happened to see.
    """

    name = "forward_bypass"
    bug = BugInfo("target called through forward(), bypassing its hooks", "—", "contract", "contract", True)

    def prefill(
        self, target: torch.nn.Module, draft: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor
    ) -> tuple[BatchState, torch.Tensor]:
        mask = attention_mask.long()
        positions = left_pad_positions(mask)  # [B, T]
        logits, target_cache = forward_directly(target, input_ids, mask, positions, DynamicCache())  # [B, T, V]
        _, draft_cache = call_model(draft, input_ids, mask, positions, DynamicCache())
        first = logits[:, -1].argmax(-1)  # [B]
        rows = torch.arange(input_ids.shape[0])
        return BatchState(rows, mask, mask, first, target_cache, draft_cache), first

    def batch_verify(self, target: torch.nn.Module, state: BatchState, drafts: torch.Tensor) -> torch.Tensor:
        block = torch.cat([state.pending[:, None], drafts], dim=1)  # [B, K + 1]
        positions = self.positions(state, state.mask, block.shape[1], "target")  # [B, K + 1]
        mask = torch.cat([state.mask, state.mask.new_ones(block.shape)], dim=1)  # [B, S + K + 1]
        logits, state.target_cache = forward_directly(target, block, mask, positions, state.target_cache)
        return logits.argmax(-1)


class MutatesInputs(EqSpec):
    """Prefill position ids computed in place on `attention_mask.long()`, meant as a copy (—).

    For an int64 mask `.long()` is the tensor itself, so the caller's attention_mask now holds
    position ids. The decoder kept a clone for itself and its tokens are right; the caller's
    tensor is not.
    """

    name = "mutates_inputs"
    bug = BugInfo("writes into the caller's attention_mask", "—", "contract", "contract", True)

    def prefill(
        self, target: torch.nn.Module, draft: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor
    ) -> tuple[BatchState, torch.Tensor]:
        mask = attention_mask.clone()  # the decoder's own copy of the layout
        positions = attention_mask.long().cumsum_(-1).sub_(1).clamp_(min=0)  # [B, T], in the caller's tensor
        logits, target_cache = call_model(target, input_ids, mask, positions, DynamicCache())  # [B, T, V]
        _, draft_cache = call_model(draft, input_ids, mask, positions, DynamicCache())
        first = logits[:, -1].argmax(-1)  # [B]
        rows = torch.arange(input_ids.shape[0])
        return BatchState(rows, mask, mask, first, target_cache, draft_cache), first


class MutatesModel(EqSpec):
    """A forward hook registered on the target (to keep the last logits for an acceptance
    statistic) and never removed (—).

    The tokens are right, but the shared target leaves generate() with one more hook each
    run: every later run of any decoder, and the oracle, runs through it.
    """

    name = "mutates_model"
    bug = BugInfo("forward hook left on the target", "—", "contract", "contract", True)

    def generate(self, target: torch.nn.Module, draft: torch.nn.Module, *args: Any, **kwargs: Any) -> list[list[int]]:
        target.register_forward_hook(self.keep_logits)
        return super().generate(target, draft, *args, **kwargs)

    def keep_logits(self, module: torch.nn.Module, args: tuple, output: Any) -> None:
        self.last_logits = output.logits[:, -1]  # [B, V]


CATALOG.update({cls.name: cls for cls in (ForwardBypass, MutatesInputs, MutatesModel)})
globals().update(CATALOG)
