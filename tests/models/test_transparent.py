"""The transparent target and the scripted draft: exact, sensitive to every I2 breach, content-addressed."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers import DynamicCache

from specaudit.checks import check_equivalence, check_i1, check_i2
from specaudit.checks.diagnosis import all_violations, diagnose
from specaudit.contracts.case import Case
from specaudit.fixtures import VOCAB_SIZE
from specaudit.fixtures.transparent import (
    RequestScript,
    Script,
    ScriptedDraft,
    TransparentLM,
    read_slots,
    scripted_draft,
    transparent_target,
)
from specaudit.models.compat import cache_layers, call_model
from specaudit.reference.oracle import greedy_oracle
from specaudit.running.runner import run_case

PROMPTS: tuple[tuple[int, ...], ...] = ((3, 1, 4, 1, 5), (9, 2), (7,), (100, 101, 102))
PAD = 1  # also a real token of PROMPTS[0]: the mask, not the id, says what a pad is


@pytest.fixture(scope="module")
def target() -> TransparentLM:
    return transparent_target()


def forward(
    model: torch.nn.Module,
    ids: list[list[int]] | torch.Tensor,
    mask: list[list[int]] | torch.Tensor | None = None,
    positions: list[list[int]] | torch.Tensor | None = None,
    cache: Any = None,
) -> tuple[torch.Tensor, Any]:
    """One forward; `positions=None` leaves position_ids out (the model's HF default applies)."""
    ids = torch.as_tensor(ids)
    mask = torch.ones_like(ids) if mask is None else torch.as_tensor(mask)
    positions = None if positions is None else torch.as_tensor(positions)
    with torch.no_grad():
        return call_model(model, ids, mask, positions, DynamicCache() if cache is None else cache)


def single(model: torch.nn.Module, sequence: tuple[int, ...] | list[int]) -> torch.Tensor:
    """Batch-size-1 logits [n, V] over `sequence` at positions 0..n-1."""
    return forward(model, [list(sequence)], positions=[list(range(len(sequence)))])[0][0]


def left_pad(prompts: tuple[tuple[int, ...], ...], extra: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask, position_ids), each [B, T], left-padded with PAD."""
    width = max(map(len, prompts)) + extra
    ids = torch.tensor([[PAD] * (width - len(p)) + list(p) for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask, (mask.cumsum(-1) - 1).clamp(min=0)


def next_token(logits: torch.Tensor) -> int:
    return int(logits[..., -1, :].argmax())


# ---------------------------------------------------------------------------------------
# The target: exact and batch-invariant


def test_batched_left_padded_equals_single_bit_for_bit(target: TransparentLM) -> None:
    """A left-padded batch with correct position ids gives every row its batch-size-1 logits exactly."""
    ids, mask, positions = left_pad(PROMPTS, extra=2)
    logits, _ = forward(target, ids, mask, positions)  # [B, T, V]
    for row, prompt in enumerate(PROMPTS):
        assert torch.equal(logits[row, ids.shape[1] - len(prompt) :], single(target, prompt))


def test_batched_decode_step_equals_single_bit_for_bit(target: TransparentLM) -> None:
    """A cached decode step on the padded batch gives every row its batch-size-1 next-token logits exactly."""
    ids, mask, positions = left_pad(PROMPTS, extra=1)
    logits, cache = forward(target, ids, mask, positions)
    step = logits[:, -1].argmax(-1, keepdim=True)  # [B, 1]
    mask2 = torch.cat([mask, torch.ones_like(step)], dim=1)
    logits2, _ = forward(target, step, mask2, mask.sum(1, keepdim=True), cache)
    for row, prompt in enumerate(PROMPTS):
        assert torch.equal(logits2[row, -1], single(target, prompt + (int(step[row, 0]),))[-1])


def test_wide_long_batch_is_exact_and_sees_positions_past_256(target: TransparentLM) -> None:
    """At the generated space's largest sizes (64 rows, prompts past 256 tokens) the batch is still
    exact, and a position taken modulo 256 (positions_wrap_at_256) changes the next token."""
    g = torch.Generator().manual_seed(3)
    prompts = tuple(tuple(torch.randint(0, VOCAB_SIZE, (n,), generator=g).tolist()) for n in [300, 5] + [9] * 62)
    ids, mask, positions = left_pad(prompts, extra=8)  # [64, 308]
    logits, _ = forward(target, ids, mask, positions)  # [64, 308, V]
    for row in (0, 1, 63):
        assert torch.equal(logits[row, -1], single(target, prompts[row])[-1]), f"row {row} differs from batch size 1"
    wrapped = forward(target, [list(prompts[0])], positions=[[p % 256 for p in range(300)]])[0]
    assert next_token(wrapped) != next_token(logits[0]), "a wrapped position past 256 should change the next token"


def test_cache_slots_hold_exact_token_and_position(target: TransparentLM) -> None:
    """Every cache slot holds exactly the token and the position id it was written with, pads included."""
    ids, mask, positions = left_pad(PROMPTS, extra=1)
    _, cache = forward(target, ids, mask, positions)
    tokens, pos = read_slots(cache_layers(cache)[0][0])
    assert torch.equal(tokens, ids) and torch.equal(pos, positions)
    step = torch.tensor([[11], [12], [13], [14]])
    _, cache = forward(
        target, step, torch.ones(4, ids.shape[1] + 1, dtype=torch.long), mask.sum(1, keepdim=True), cache
    )
    tokens, pos = read_slots(cache_layers(cache)[0][0])
    assert torch.equal(tokens[:, -1:], step) and torch.equal(pos[:, -1:], mask.sum(1, keepdim=True))
    assert torch.equal(tokens[:, :-1], ids) and torch.equal(pos[:, :-1], positions)


def test_cache_slots_record_default_positions(target: TransparentLM) -> None:
    """Without position_ids the slots record HF's default positions: past length + arange, pads counted."""
    ids, mask, _ = left_pad(PROMPTS[:2])
    _, cache = forward(target, ids, mask, None)
    _, pos = read_slots(cache_layers(cache)[0][0])
    assert torch.equal(pos, torch.arange(ids.shape[1]).expand_as(ids))


# ---------------------------------------------------------------------------------------
# The target: every I2 breach changes the next token


@pytest.mark.parametrize("prompt", PROMPTS)
def test_stale_entry_attended_changes_next_token(target: TransparentLM, prompt: tuple[int, ...]) -> None:
    """Attending a stale (rejected) slot changes the next token; masking it restores the exact logits."""
    n = len(prompt)
    right = next_token(single(target, prompt))
    stale = (right + 5) % VOCAB_SIZE
    _, cache = forward(target, [list(prompt) + [stale]], positions=[list(range(n + 1))])  # stale at position n
    clean = single(target, prompt + (right,))[-1]
    attended, _ = forward(target, [[right]], [[1] * (n + 2)], [[n]], cache)
    assert next_token(attended[0]) != int(clean.argmax())
    _, cache = forward(target, [list(prompt) + [stale]], positions=[list(range(n + 1))])
    masked, _ = forward(target, [[right]], [[1] * n + [0, 1]], [[n]], cache)
    assert torch.equal(masked[0, -1], clean)


@pytest.mark.parametrize("prompt", PROMPTS)
def test_pad_attended_changes_next_token(target: TransparentLM, prompt: tuple[int, ...]) -> None:
    """A left-padded row whose mask is 1 on a pad slot predicts a different token than batch size 1."""
    ids, mask, positions = left_pad((prompt,), extra=2)
    wrong_mask = mask.clone()
    wrong_mask[0, 1] = 1  # one pad slot attended
    logits, _ = forward(target, ids, wrong_mask, positions)
    assert next_token(logits[0]) != next_token(single(target, prompt))
    logits, _ = forward(target, ids, mask, positions)
    assert torch.equal(logits[0, -1], single(target, prompt)[-1])


@pytest.mark.parametrize("prompt", PROMPTS)
@pytest.mark.parametrize("shift", ["last+1", "all+1"])
def test_wrong_position_id_changes_next_token(target: TransparentLM, prompt: tuple[int, ...], shift: str) -> None:
    """A wrong position id on any attended slot changes the next token."""
    positions = list(range(len(prompt)))
    if shift == "last+1":
        positions[-1] += 1
    else:
        positions = [p + 1 for p in positions]
    logits, _ = forward(target, [list(prompt)], positions=[positions])
    assert next_token(logits[0]) != next_token(single(target, prompt))


@pytest.mark.parametrize("prompt", PROMPTS)
def test_omitted_positions_on_left_padded_row_change_next_token(target: TransparentLM, prompt: tuple[int, ...]) -> None:
    """Omitting position_ids on a left-padded row (HF default: arange over pads too) changes the next token."""
    ids, mask, _ = left_pad((prompt,), extra=2)
    logits, _ = forward(target, ids, mask, None)
    assert next_token(logits[0]) != next_token(single(target, prompt))


def test_omitted_positions_on_unpadded_row_are_harmless(target: TransparentLM) -> None:
    """Control: on an unpadded row the HF default positions are 0..n-1, so the logits are exact."""
    prompt = PROMPTS[0]
    logits, _ = forward(target, [list(prompt)], None, None)
    assert torch.equal(logits[0], single(target, prompt))


# ---------------------------------------------------------------------------------------
# The target: a masked query column (a pad) never passes for a real one


def right_pad(prompts: tuple[tuple[int, ...], ...], extra: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask, position_ids), each [B, T], right-padded with PAD."""
    width = max(map(len, prompts)) + extra
    ids = torch.tensor([list(p) + [PAD] * (width - len(p)) for p in prompts])
    mask = torch.tensor([[1] * len(p) + [0] * (width - len(p)) for p in prompts])
    return ids, mask, torch.arange(width).expand(len(prompts), width)


@pytest.mark.parametrize("model", ["target", "draft"])
def test_right_pad_column_never_predicts_the_rows_next_token(target: TransparentLM, model: str) -> None:
    """On a right-padded batch every real column is exact, and no pad column's top-1 is the row's next
    token (what its last real column predicts), though the pad attends exactly what that column attends."""
    lm = target if model == "target" else scripted_draft([])
    ids, mask, positions = right_pad(PROMPTS, extra=2)
    logits, _ = forward(lm, ids, mask, positions)  # [B, T, V]
    for row, prompt in enumerate(PROMPTS):
        n = len(prompt)
        assert torch.equal(logits[row, :n], single(lm, prompt)), f"row {row}: a real column changed"
        pads = logits[row, n:].argmax(-1).tolist()
        assert int(logits[row, n - 1].argmax()) not in pads, f"row {row}: pad columns predict {pads}, the next token"


def test_masked_decode_column_never_predicts_the_rows_next_token(target: TransparentLM) -> None:
    """A cached decode step whose query is masked (a finished row fed a pad) predicts another token than
    the same step unmasked; the slot it writes stays invisible to later calls."""
    for prompt in PROMPTS:
        n = len(prompt)
        _, cache = forward(target, [list(prompt)], positions=[list(range(n))])
        masked, cache = forward(target, [[PAD]], [[1] * n + [0]], [[n]], cache)
        right = next_token(single(target, prompt))  # what the masked query's context predicts at a real column
        assert next_token(masked[0]) != right, f"prompt {prompt}: a masked query predicts {right} as a real one does"
        after, _ = forward(target, [[right]], [[1] * n + [0, 1]], [[n]], cache)
        assert torch.equal(after[0, -1], single(target, prompt + (right,))[-1])


PAD_READ = "tests.decoders.pad_column_read"


def pad_read_case() -> Case:
    """Rows of different lengths whose drafts are all accepted: the short rows' bonus is read at a pad."""
    return Case(((3, 1, 4, 1, 5), (9, 2), (6, 6, 6)), ("111111", "111111", "101101"), 2, 6, None, 0)


def test_pad_column_read_fails_equivalence() -> None:
    """A decoder that reads a right-padded row's next token at the batch's last column (a pad for the short
    rows) diverges from the oracle on the transparent model; equivalence is the check that reports it."""
    run = run_case(f"{PAD_READ}:PadColumnRead", pad_read_case())
    assert run.error is None, run.error
    diverged = {v.request for v in check_equivalence(run)}
    assert diverged == {1, 2}, f"got divergent requests {sorted(diverged)}, but should be the short rows 1 and 2"
    assert not check_i1(run) and not check_i2(run), "the inputs are right: only the read is wrong"
    assert diagnose(run).first_check == "equivalence"


def test_own_column_read_passes() -> None:
    """Control: the same right-padded decoder reading each row's own last column passes every check."""
    run = run_case(f"{PAD_READ}:OwnColumnRead", pad_read_case())
    assert run.error is None, run.error
    assert [v.render() for v in all_violations(run)] == []


# ---------------------------------------------------------------------------------------
# The scripted draft

ACCEPT: dict[tuple[int, ...], tuple[bool, ...]] = {
    PROMPTS[0]: (True, False, True, True, False, True, False, False, True),
    PROMPTS[1]: (False, True, True, False, True, True, True, False, False),
    PROMPTS[3]: (True,) * 9,
}
HORIZON = 9


@pytest.fixture(scope="module")
def requests(target: TransparentLM) -> dict[tuple[int, ...], RequestScript]:
    return {
        p: RequestScript(p, greedy_oracle(target, p, max_new_tokens=HORIZON, eos_token_id=None).tokens, a)
        for p, a in ACCEPT.items()
    }


@pytest.fixture(scope="module")
def draft(requests: dict[tuple[int, ...], RequestScript]) -> ScriptedDraft:
    return scripted_draft(list(requests.values()))


def proposals(draft: ScriptedDraft, contexts: tuple[tuple[int, ...], ...]) -> list[int]:
    """The draft's next token for each context, run as one left-padded batch with correct positions."""
    ids, mask, positions = left_pad(contexts, extra=1)
    logits, _ = forward(draft, ids, mask, positions)
    return logits[:, -1].argmax(-1).tolist()


def test_draft_identifies_requests_by_content(
    draft: ScriptedDraft, requests: dict[tuple[int, ...], RequestScript]
) -> None:
    """Permuting (and duplicating) rows permutes the proposals with them: the row index never matters."""
    contexts = tuple(r.prompt + r.continuation[:2] for r in requests.values())
    base = dict(zip(contexts, proposals(draft, contexts), strict=True))
    for order in ((2, 0, 1), (1, 2, 0, 1), (0,), (2,)):
        permuted = tuple(contexts[i] for i in order)
        assert proposals(draft, permuted) == [base[c] for c in permuted]


@pytest.mark.parametrize("prompt", list(ACCEPT))
def test_draft_follows_the_schedule(
    draft: ScriptedDraft, requests: dict[tuple[int, ...], RequestScript], prompt: tuple[int, ...]
) -> None:
    """After prompt + n oracle tokens the draft proposes oracle token n iff accept[n], another token otherwise."""
    request = requests[prompt]
    contexts = tuple(prompt + request.continuation[:n] for n in range(HORIZON))
    for n, proposal in enumerate(proposals(draft, contexts)):
        assert (proposal == request.continuation[n]) == request.accept[n], f"index {n}"


def test_draft_follows_the_schedule_through_its_cache(
    draft: ScriptedDraft, requests: dict[tuple[int, ...], RequestScript]
) -> None:
    """Decoding token by token through the draft's own cache proposes what the schedule says, row by row."""
    prompts = tuple(ACCEPT)
    ids, mask, positions = left_pad(prompts)
    logits, cache = forward(draft, ids, mask, positions)
    lengths = mask.sum(1, keepdim=True)
    for n in range(HORIZON - 1):
        for row, prompt in enumerate(prompts):
            request = requests[prompt]
            assert (int(logits[row, -1].argmax()) == request.continuation[n]) == request.accept[n], (
                f"row {row} index {n}"
            )
        step = torch.tensor([[requests[p].continuation[n]] for p in prompts])  # feed the oracle token
        mask = torch.cat([mask, torch.ones_like(step)], dim=1)
        logits, cache = forward(draft, step, mask, lengths + n, cache)


@pytest.mark.parametrize("prompt", [PROMPTS[0], PROMPTS[3]])
def test_draft_is_wrong_at_wrong_positions(
    draft: ScriptedDraft, requests: dict[tuple[int, ...], RequestScript], prompt: tuple[int, ...]
) -> None:
    """Where the schedule accepts, a context not at positions 0..n-1 still gets a wrong proposal."""
    request = requests[prompt]
    n = request.accept.index(True)
    context = list(prompt + request.continuation[:n])
    right, _ = forward(draft, [context], positions=[list(range(len(context)))])
    assert next_token(right[0]) == request.continuation[n]
    shifted, _ = forward(draft, [context], positions=[list(range(1, len(context) + 1))])
    assert next_token(shifted[0]) != request.continuation[n]
    ids, mask, _ = left_pad((tuple(context),), extra=2)
    defaulted, _ = forward(draft, ids, mask, None)  # HF default positions count the pads
    assert next_token(defaulted[0]) != request.continuation[n]


def test_draft_is_wrong_after_a_stale_token(
    draft: ScriptedDraft, requests: dict[tuple[int, ...], RequestScript]
) -> None:
    """Where the schedule accepts, a context holding a token off the oracle path gets a wrong proposal."""
    request = requests[PROMPTS[3]]  # accepts everywhere
    stale = (request.continuation[0] + 1) % VOCAB_SIZE
    context = list(request.prompt) + [stale]
    logits, _ = forward(draft, [context], positions=[list(range(len(context)))])
    assert next_token(logits[0]) != request.continuation[1]


def test_script_rejects_conflicting_requests() -> None:
    """Two requests with one prompt but different scripts cannot be told apart, so Script refuses them."""
    with pytest.raises(ValueError, match="share prompt"):
        Script([RequestScript((1, 2), (3, 4), (True, True)), RequestScript((1, 2), (3, 4), (True, False))])
