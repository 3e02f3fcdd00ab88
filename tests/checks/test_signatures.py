"""Every signature is decided from the minimal case's evidence, and each has a decoder diagnosed as it.

The evidence (issue 27, point 6): whether the target was called at all (no call: contract, never
kv-drift or position-id), the minimal case's batch size (one row has no batch to drift across:
kv-drift there is bonus, "wrong even at batch size 1"), and the diverging request re-run alone
(wrong alone too: bonus; right alone with its logits read at a pad column: position-id). One set
of facts per slot feeds I2 and equivalence alike.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from specaudit.checks import check_equivalence, check_i2, equivalence
from specaudit.checks.diagnosis import diagnose
from specaudit.checks.registry import OUTPUT_LEVEL_SIGNATURES, SAMPLING_SIGNATURES, SIGNATURES
from specaudit.contracts.case import Case
from specaudit.fixtures import VOCAB_SIZE
from specaudit.reference.eqspec import EqSpec
from specaudit.reference.oracle import OracleResult
from specaudit.reference.planted.acceptance import BonusFromDraft
from specaudit.running.runner import Run, run_case

MUTANTS = "specaudit.reference.mutants"
ACCEPT, REJECT, HALF = (True,) * 40, (False,) * 40, (True, False) * 20
ONE_ROW = Case(((1, 2, 3, 4),), (REJECT,), 3, 6, None, 0)
RAGGED = Case(((1, 2, 3), (4, 5)), (ACCEPT, REJECT), 2, 5, None, 0)
SHORT_AND_LONG = Case(((1, 2, 3, 4, 5), (6, 7)), (ACCEPT, ACCEPT), 2, 6, None, 0)


@pytest.fixture(autouse=True, scope="module")
def one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ---------------------------------------------------------------------------------------
# Decoders with one defect each, written for these tests


class DraftOnly:
    """Greedy decoding with the draft alone: the target is never called (nothing is verified)."""

    name = "draft-only"

    @torch.no_grad()
    def generate(self, target: Any, draft: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                 *, num_draft_tokens: int, max_new_tokens: int, eos_token_id: int | None,
                 pad_token_id: int) -> list[list[int]]:  # fmt: skip
        out = []
        for ids, mask in zip(input_ids.tolist(), attention_mask.tolist()):
            sequence, new = [t for t, m in zip(ids, mask) if m], []
            while len(new) < max_new_tokens and (not new or new[-1] != eos_token_id):
                logits = draft(input_ids=torch.tensor([sequence + new]), use_cache=False).logits  # [1, T, V]
                new.append(int(logits[0, -1].argmax()))
            out.append(new)
        return out


class LosesAcceptedDraft(EqSpec):
    """Drops each round's first accepted draft from the output (an output filter gone wrong, as
    public code that deletes repeated tokens as duplicates); the caches keep it, rightly."""

    name = "loses-accepted-draft"

    def commit(self, out: list[list[int]], rows: torch.Tensor, new_tokens: list[list[int]], max_new_tokens: int,
               eos_token_id: int | None) -> torch.Tensor:  # type: ignore[override]  # fmt: skip
        kept = [tokens[1:] if len(tokens) > 1 else tokens for tokens in new_tokens]
        return EqSpec.commit(out, rows, kept, max_new_tokens, eos_token_id)


class OutputAndCacheDisagree(BonusFromDraft):
    """Feeds the rejected draft on as the bonus (the cache's next token is wrong) and writes yet
    another token into the output: neither is the oracle's."""

    name = "output-and-cache-disagree"

    def commit(self, out: list[list[int]], rows: torch.Tensor, new_tokens: list[list[int]], max_new_tokens: int,
               eos_token_id: int | None) -> torch.Tensor:  # type: ignore[override]  # fmt: skip
        shifted = [tokens[:-1] + [(tokens[-1] + 1) % VOCAB_SIZE] if len(out[r]) else tokens
                   for r, tokens in zip(rows.tolist(), new_tokens)]  # fmt: skip
        return EqSpec.commit(out, rows, shifted, max_new_tokens, eos_token_id)


def run_of(factory: Callable[[], Any], case: Case) -> Run:
    return run_case(f"tests.checks.test_signatures:{factory.__name__}", case, factory=factory)


class FlipsSecondBonus(EqSpec):
    """Takes the other token as the second verify round's bonus and goes on from it: consistent
    caches, a divergence the oracle's margin alone judges (a tie when that margin is nil)."""

    name = "flips-second-bonus"

    def generate(self, *args: Any, **kwargs: Any) -> list[list[int]]:
        self.rounds = 0
        return super().generate(*args, **kwargs)

    def accept(self, drafts: torch.Tensor, predicted: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        accepted, bonus = EqSpec.accept(drafts, predicted)
        self.rounds += 1
        return accepted, (bonus + 1) % VOCAB_SIZE if self.rounds == 2 else bonus


def forced_tie() -> Run:
    """Every draft rejected, so the second round's bonus is token 2; the oracle's margin there set to 0."""
    run = run_of(FlipsSecondBonus, Case(((5, 9, 2),), (REJECT,), 2, 6, None, 0, dtype="float32"))
    oracle = run.oracle[0]
    margins = tuple(0.0 if i == 2 else m for i, m in enumerate(oracle.margins))
    run.oracle[0] = OracleResult(oracle.tokens, oracle.stop, margins)
    return run


def scheduling_control() -> Run:
    from test_scheduling import OneAtATime  # tests/checks, beside this module

    return run_of(OneAtATime, RAGGED)


def pad_column_read() -> Run:
    from decoders.pad_column_read import PadColumnRead  # tests/decoders

    return run_of(PadColumnRead, SHORT_AND_LONG)


EOS_IN_PROMPT = Case(((7, 9, 2, 5), (4, 6, 8)), (HALF, HALF), 2, 6, 9, 0)

EVERY_SIGNATURE: dict[str, tuple[Callable[[], Run], str]] = {
    "position-id": (lambda: run_case(f"{MUTANTS}:verify_position_off_by_one", ONE_ROW), "I2"),
    "kv-drift": (lambda: run_case(f"{MUTANTS}:rejected_kv_attended", RAGGED), "I2"),
    "bonus": (lambda: run_case(f"{MUTANTS}:bonus_from_draft", ONE_ROW), "equivalence"),
    "numerical-tie": (forced_tie, ""),
    "output-equivalent": (lambda: run_case(f"{MUTANTS}:acceptance_one_short", RAGGED), "token-preservation"),
    "bookkeeping": (lambda: run_case(f"{MUTANTS}:eos_scans_padded_row", EOS_IN_PROMPT), "equivalence"),
    "scheduling": (scheduling_control, "liveness"),
    "contract": (lambda: run_case(f"{MUTANTS}:max_new_tokens_overrun", RAGGED), "contract"),
}
"""Per signature: a run diagnosed as it, and its first failing check ("" for a pass)."""


def test_every_signature_has_a_control() -> None:
    """Every signature a diagnosis gives has a decoder control here; the output-level one
    (`batch-only`) is a black box's, controlled in tests/adapters/test_adapters.py
    (`test_black_box_audit_catches_a_planted_bug`: attended pads, right alone); `sampling` is a
    sampling decoder's, controlled in tests/checks/test_distribution.py."""
    assert [*EVERY_SIGNATURE, *OUTPUT_LEVEL_SIGNATURES, *SAMPLING_SIGNATURES] == list(SIGNATURES)


@pytest.mark.parametrize("signature", list(EVERY_SIGNATURE))
def test_the_diagnosis_names_each_signature(signature: str) -> None:
    """Each signature's control is diagnosed as it, first by the check that owns it."""
    make, first_check = EVERY_SIGNATURE[signature]
    diagnosis = diagnose(make())
    assert (diagnosis.signature, diagnosis.first_check or "") == (signature, first_check), diagnosis.render()
    assert diagnosis.passed == (signature == "numerical-tie") and diagnosis.reason


# ---------------------------------------------------------------------------------------
# The evidence each signature is decided from


def test_a_decoder_that_never_calls_the_target_breaks_the_contract() -> None:
    """No target call attended anything: I1's target-called is a contract break, not kv-drift."""
    diagnosis = diagnose(run_of(DraftOnly, RAGGED))
    assert (diagnosis.first_check, diagnosis.first.rule if diagnosis.first else None) == ("I1", "target-called")
    assert diagnosis.signature == "contract" and "never called" in diagnosis.reason, diagnosis.render()
    assert "kv-drift" not in diagnosis.render()


@pytest.mark.parametrize(
    ("bug", "check"),
    [("rejected_kv_attended", "I2"), ("mask_not_updated_after_repad", "I1"), ("realign_off_by_one", "I2")],
)
def test_a_minimal_case_of_one_row_is_never_kv_drift(bug: str, check: str) -> None:
    """Wrong entries attended by a single row are wrong even at batch size 1 (bonus); the same bug
    in a batch of two keeps kv-drift."""
    alone = diagnose(run_case(f"{MUTANTS}:{bug}", ONE_ROW))
    assert (alone.first_check, alone.signature) == (check, "bonus"), alone.render()
    assert "wrong even at batch size 1" in alone.reason
    batch = diagnose(run_case(f"{MUTANTS}:rejected_kv_attended", RAGGED))
    assert batch.signature == "kv-drift", batch.render()


def test_logits_read_at_a_pad_column_are_a_position_error() -> None:
    """A row right alone whose wrong token was read at a (masked) pad column is signed position-id,
    naming the call and the pad columns; reading at the row's own column passes."""
    diagnosis = diagnose(pad_column_read())
    assert (diagnosis.first_check, diagnosis.signature) == ("equivalence", "position-id"), diagnosis.render()
    assert "pad column" in diagnosis.reason and diagnosis.first is not None
    assert diagnosis.first.row == 1 and diagnosis.first.request == 1  # the short row, in the call that decided
    from decoders.pad_column_read import OwnColumnRead

    assert diagnose(run_of(OwnColumnRead, SHORT_AND_LONG)).passed


def test_right_padding_reads_a_pad_column_too() -> None:
    """The planted right padding reads its first token at column -1, an attended pad: position-id."""
    case = Case(((1, 2, 3, 4, 5), (6, 7)), (HALF, HALF), 2, 4, None, 0)
    diagnosis = diagnose(run_case(f"{MUTANTS}:right_padding", case))
    assert (diagnosis.first_check, diagnosis.signature) == ("equivalence", "position-id"), diagnosis.render()


# ---------------------------------------------------------------------------------------
# One set of facts per slot


def test_an_output_that_loses_a_verified_token_is_bookkeeping() -> None:
    """The cache holds the oracle's token where the output has another: I2 passes (the cache is
    right), equivalence says what the cache holds there, and the signature is bookkeeping."""
    run = run_of(LosesAcceptedDraft, Case(((1, 2, 3),), (ACCEPT,), 2, 6, None, 0))
    assert check_i2(run) == []
    (violation,) = check_equivalence(run)
    row = equivalence(run).rows[0]
    i = row.first_divergence
    assert i is not None
    assert f"the cache holds token {row.expected[i]} there" in violation.found, violation.found
    assert violation.evidence["cache_token"] == row.expected[i] != row.found[i]
    diagnosis = diagnose(run)
    assert (diagnosis.first_check, diagnosis.signature) == ("equivalence", "bookkeeping"), diagnosis.render()


def test_i2_expects_the_oracles_token_not_the_decoders_commit() -> None:
    """The round's first input is neither the output's token nor the oracle's: I2's 'should be'
    names the oracle's token, and equivalence reads the same token in the same slot."""
    run = run_of(OutputAndCacheDisagree, Case(((3, 1, 4),), (REJECT,), 2, 5, None, 0))
    row = equivalence(run).rows[0]
    i = row.first_divergence
    assert i is not None
    first = check_i2(run)[0]
    assert first.rule in ("input-token", "attends-wrong-slot"), first
    assert first.evidence["expected_token"] == row.expected[i] != row.found[i], (first, row)
    assert f"should be token {row.expected[i]}" in first.render() or f"token {row.expected[i]}" in first.expected
    (divergence,) = check_equivalence(run)
    if divergence.evidence["cache_token"] is not None:
        assert divergence.evidence["cache_token"] == first.evidence["found_token"], (divergence, first)
