"""Negative and positive controls for the checks: each fails on a violating input, with the right evidence,
and the EQSPEC reference passes all of them on hand-picked hard cases."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from transformers import DynamicCache

from specaudit.checks import (
    check_equivalence,
    check_i1,
    check_i2,
    check_token_preservation,
    equivalence,
    i1_call_violations,
)
from specaudit.contracts.case import Case
from specaudit.contracts.violation import Violation
from specaudit.fixtures import VOCAB_SIZE
from specaudit.fixtures.transparent import wrong_token
from specaudit.models.compat import call_model
from specaudit.reference.eqspec import BatchState, EqSpec
from specaudit.running.instrument import CallRecord
from specaudit.running.runner import Run, oracle_continuation, run_case

EQSPEC = "specaudit.reference.eqspec:EqSpec"
CHECKS: dict[str, Callable[[Run], list[Violation]]] = {
    "I1": check_i1,
    "I2": check_i2,
    "equivalence": check_equivalence,
    "token-preservation": check_token_preservation,
}


def pattern(flags: str, length: int = 40) -> tuple[bool, ...]:
    """An accept pattern from a string of 0/1, repeated to `length`."""
    return tuple(flags[i % len(flags)] == "1" for i in range(length))


def continuation(prompt: tuple[int, ...], n: int = 40, model: str = "transparent") -> tuple[int, ...]:
    """The EOS-blind oracle continuation of `prompt` (what the runner itself computes)."""
    return oracle_continuation(model, "float64", prompt, n).tokens


def violations(run: Run) -> dict[str, list[Violation]]:
    assert run.error is None, run.error
    return {name: check(run) for name, check in CHECKS.items()}


# ---------------------------------------------------------------------------------------
# I1 on hand-built calls

B, T, P = 2, 3, 4


def call(**changes: Any) -> CallRecord:
    """A valid target call (B=2 rows, T=3 inputs, P=4 cached slots in 2 layers), with `changes` applied."""
    fields: dict[str, Any] = dict(
        role="target",
        index=3,
        input_ids=torch.zeros(B, T, dtype=torch.long),
        attention_mask=torch.ones(B, P + T, dtype=torch.long),
        position_ids=(P + torch.arange(T)).expand(B, T).clone(),
        layer_lengths=(P, P),
        cache_batch=B,
    )
    fields.update(changes)
    return CallRecord(**fields)


def only(found: list[Violation], rule: str) -> Violation:
    """The single violation in `found`, which must be an I1 violation of `rule`."""
    assert [v.rule for v in found] == [rule], [v.render() for v in found]
    assert found[0].check == "I1" and found[0].call == 3
    return found[0]


@pytest.mark.parametrize(
    "changes",
    [
        {},
        {"position_ids": None},  # HF default positions
        {"attention_mask": None},  # HF attends everything
        {"position_ids": torch.arange(P, P + T)[None]},  # [1, T] broadcasts
        {"layer_lengths": (), "cache_batch": None, "attention_mask": torch.ones(B, T, dtype=torch.long)},  # prefill
        {"attention_mask": torch.tensor([[0, 0, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 0, 1]])},  # pads and one slot
    ],
    ids=["valid", "no-positions", "no-mask", "broadcast-positions", "empty-cache", "sparse-mask"],
)
def test_i1_accepts_valid_calls(changes: dict[str, Any]) -> None:
    """A rectangular call (mask [B, P + T], positions [B, T] or [1, T], every row attending) passes I1."""
    assert i1_call_violations(call(**changes)) == []


@pytest.mark.parametrize("width", [P + T - 1, P + T + 1, T])
def test_i1_mask_width(width: int) -> None:
    """A mask whose width is not P + T is reported with both shapes (HF would silently pad or slice it)."""
    v = only(i1_call_violations(call(attention_mask=torch.ones(B, width, dtype=torch.long))), "mask-shape")
    assert f"({B}, {width})" in v.found and f"[{B}, {P + T}]" in v.expected and f"P={P}" in v.expected


def test_i1_mask_rows() -> None:
    """A mask with a different row count than input_ids is reported."""
    only(i1_call_violations(call(attention_mask=torch.ones(B + 1, P + T, dtype=torch.long))), "mask-shape")


def test_i1_cache_layers_of_different_lengths() -> None:
    """Cache layers of different lengths are reported with the lengths."""
    v = only(i1_call_violations(call(layer_lengths=(P, P + 2))), "cache-length")
    assert f"[{P}, {P + 2}]" in v.found


def test_i1_cache_batch_differs_from_input_batch() -> None:
    """A cache with more rows than input_ids is reported with both counts."""
    v = only(i1_call_violations(call(cache_batch=B + 1)), "cache-batch")
    assert f"{B + 1} rows" in v.found and f"{B} rows" in v.expected


def test_i1_row_attending_nothing() -> None:
    """A row whose mask is all zeros is reported with its row index."""
    mask = torch.ones(B, P + T, dtype=torch.long)
    mask[1] = 0
    v = only(i1_call_violations(call(attention_mask=mask)), "row-attends-nothing")
    assert v.row == 1


def test_i1_all_pad_row_may_attend_nothing() -> None:
    """A row whose inputs are all the pad id (a prefill holding a one-token prompt back) may
    attend nothing; the same row holding one real token may not."""
    mask = torch.ones(B, P + T, dtype=torch.long)
    mask[1] = 0
    ids = torch.full((B, T), 5, dtype=torch.long)
    ids[1] = 0
    assert i1_call_violations(call(input_ids=ids, attention_mask=mask), pad_token_id=0) == []
    ids[1, -1] = 7
    v = only(i1_call_violations(call(input_ids=ids, attention_mask=mask), pad_token_id=0), "row-attends-nothing")
    assert v.row == 1


def test_i1_mask_values() -> None:
    """A mask holding values other than 0 and 1 is reported."""
    mask = torch.ones(B, P + T, dtype=torch.long)
    mask[0, 0] = 2
    only(i1_call_violations(call(attention_mask=mask)), "mask-values")


@pytest.mark.parametrize("ids", [torch.zeros(B, T, 1, dtype=torch.long), torch.zeros(T, dtype=torch.long), None])
def test_i1_input_ids_not_2d(ids: torch.Tensor | None) -> None:
    """input_ids that are not [B, T] are reported with their shape, and nothing else is checked."""
    v = only(i1_call_violations(call(input_ids=ids)), "input-shape")
    assert str(None if ids is None else tuple(ids.shape)) in v.found and v.expected == "[B, T]"


@pytest.mark.parametrize(
    "positions",
    [
        torch.zeros(B, T - 1, dtype=torch.long),
        torch.zeros(B + 1, T, dtype=torch.long),
        torch.zeros(T, dtype=torch.long),
        torch.zeros(1, B, T, dtype=torch.long),
    ],
    ids=["short", "rows", "1-D", "3-D"],
)
def test_i1_position_ids_shape(positions: torch.Tensor) -> None:
    """position_ids that are neither [B, T] nor [1, T] are reported with their shape."""
    v = only(i1_call_violations(call(position_ids=positions)), "position-shape")
    assert str(tuple(positions.shape)) in v.found and f"[{B}, {T}]" in v.expected


def test_i1_reports_every_rule_broken_at_once() -> None:
    """Independent I1 breaches in one call are all reported, each with the call index."""
    found = i1_call_violations(call(layer_lengths=(P, P + 1), cache_batch=5, position_ids=torch.zeros(B, 1)))
    assert {v.rule for v in found} == {"cache-length", "cache-batch", "position-shape"}
    assert all(v.call == 3 for v in found)


class NeverCallsTarget:
    """Returns without calling any model."""

    def generate(
        self, target: Any, draft: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, **kw: Any
    ) -> Any:
        return [[] for _ in range(input_ids.shape[0])]


def test_i1_requires_a_target_call() -> None:
    """A decoder that never calls the target fails I1 (and equivalence), not silently passes."""
    run = run_case(
        "tests:NeverCallsTarget", Case(((3, 1, 4),), (pattern("1"),), 2, 3, None, 0), factory=NeverCallsTarget
    )
    assert [v.rule for v in check_i1(run)] == ["target-called"]
    assert check_equivalence(run)


def test_violation_render() -> None:
    """A violation renders check, rule, place and 'got X, but should be Y' in one line."""
    v = Violation("I2", "attends-wrong-slot", "slot 2 holding token 83", "token 81 at position 2", 2, 1, 2, 0)
    assert v.render() == (
        "[I2: attends-wrong-slot] target call 2, row 1, slot 2, (request 0): "
        "got slot 2 holding token 83, but should be token 81 at position 2"
    )
    assert Violation("equivalence", "r", "a", "b").render() == "[equivalence: r] run: got a, but should be b"


# ---------------------------------------------------------------------------------------
# I2, equivalence and token preservation on small broken decoders


class VerifyWithoutPositions(EqSpec):
    """Leaves position_ids out of the verify call: HF's default positions count a row's pads."""

    name = "verify_without_positions"

    def batch_verify(self, target: torch.nn.Module, state: BatchState, drafts: torch.Tensor) -> torch.Tensor:
        block = torch.cat([state.pending[:, None], drafts], dim=1)  # [B, K + 1]
        mask = torch.cat([state.mask, state.mask.new_ones(block.shape)], dim=1)
        logits, state.target_cache = call_model(target, block, mask, None, state.target_cache)
        return logits.argmax(-1)


class StopsEarly(EqSpec):
    """Drops the last token of every row: a strict prefix of the oracle."""

    name = "stops_early"

    def generate(self, *args: Any, **kwargs: Any) -> list[list[int]]:
        return [row[:-1] for row in super().generate(*args, **kwargs)]


class NoCacheGreedy:
    """Correct greedy tokens, recomputed from scratch at batch size 1 every step: no draft, no cache reuse."""

    name = "no_cache_greedy"

    def generate(
        self, target: Any, draft: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, **kw: Any
    ) -> list[list[int]]:
        out = []
        for ids, mask in zip(input_ids.tolist(), attention_mask.tolist(), strict=True):
            sequence, generated = [t for t, m in zip(ids, mask, strict=True) if m], []
            while len(generated) < kw["max_new_tokens"] and not (generated and generated[-1] == kw["eos_token_id"]):
                x = torch.tensor([sequence + generated])  # [1, n]
                with torch.no_grad():
                    logits, _ = call_model(
                        target, x, torch.ones_like(x), torch.arange(x.shape[1])[None], DynamicCache()
                    )
                generated.append(int(logits[0, -1].argmax()))
            out.append(generated)
        return out


def test_i2_rejected_kv_attended_single_row() -> None:
    """A kept rejected draft is named by I2: call, row, slot, the stale token at its position, the right token."""
    prompt = (0,)
    cont = continuation(prompt)
    run = run_case("specaudit.reference.mutants:rejected_kv_attended", Case((prompt,), (pattern("0"),), 1, 3, None, 0))
    found = violations(run)
    first = found["I2"][0]
    # call 1 verifies [t0, d1] with d1 rejected; call 2 attends slot 2 = d1 where t1 belongs.
    assert (first.check, first.rule, first.call, first.row, first.slot) == ("I2", "attends-wrong-slot", 2, 0, 2)
    stale = wrong_token(cont[1], 1, VOCAB_SIZE)
    assert first.found == f"slot 2 holding token {stale} at position 2"
    assert first.expected == f"token {cont[1]} at position 2"
    assert "target call 2, row 0, slot 2" in first.render()
    assert found["I1"] == []


def test_i2_rejected_kv_attended_names_the_ragged_row() -> None:
    """With one row accepting everything and one rejecting, I2 blames the rejecting row at its stale slot."""
    prompts = ((5, 6, 7), (9,))
    run = run_case(
        "specaudit.reference.mutants:rejected_kv_attended", Case(prompts, (pattern("1"), pattern("0")), 2, 6, None, 0)
    )
    first = violations(run)["I2"][0]
    cont = continuation(prompts[1])
    # row 1 is [pad, pad, 9]; call 1 writes t0, d1, d2 at slots 3..5; slot 4 holds d1 at position 2
    assert (first.call, first.row, first.request, first.slot) == (2, 1, 1, 4)
    assert first.found == f"slot 4 holding token {wrong_token(cont[1], 1, VOCAB_SIZE)} at position 2"
    assert first.expected == f"token {cont[1]} at position 2"
    assert [v.request for v in check_equivalence(run)] == [1]


def test_i2_position_ids_omitted_on_a_padded_row() -> None:
    """A verify call without position_ids is caught on the left-padded row, with the position it got."""
    prompts = ((5, 6, 7), (9,))
    run = run_case(
        "tests:VerifyWithoutPositions",
        Case(prompts, (pattern("1"), pattern("1")), 2, 6, None, 0),
        factory=VerifyWithoutPositions,
    )
    first = violations(run)["I2"][0]
    t0 = continuation(prompts[1])[0]
    assert (first.check, first.rule, first.call, first.row, first.slot) == ("I2", "position-ids", 1, 1, 3)
    assert first.found == f"current input 0 (slot 3, token {t0}) at position 3"
    assert first.expected == "position 1"


def test_i2_position_ids_omitted_is_harmless_at_batch_size_1() -> None:
    """Control: without padding HF's default positions are right, so the same decoder passes every check."""
    run = run_case(
        "tests:VerifyWithoutPositions",
        Case(((5, 6, 7),), (pattern("110"),), 2, 8, None, 0),
        factory=VerifyWithoutPositions,
    )
    assert violations(run) == {name: [] for name in CHECKS}


def test_equivalence_bonus_from_draft() -> None:
    """A bonus token taken from the draft diverges at batch size 1, placed at the round that decided it."""
    prompt = (3, 1, 4)
    cont = continuation(prompt)
    run = run_case("specaudit.reference.mutants:bonus_from_draft", Case((prompt,), (pattern("0"),), 2, 5, None, 0))
    found = violations(run)
    assert found["I1"] == found["I2"] == []
    assert len(found["equivalence"]) == 1
    v = found["equivalence"][0]
    # call 1 verifies [t0, d1, d2], rejects d1 and takes d1 itself as the bonus: index 1, slot 3 + 1
    assert (v.check, v.rule, v.request, v.call, v.row, v.slot) == ("equivalence", "first-divergence", 0, 1, 0, 4)
    assert v.found.startswith(f"token {wrong_token(cont[1], 1, VOCAB_SIZE)} at index 1")
    assert "partial match 0.20" in v.found
    assert v.expected.startswith(f"token {cont[1]} at index 1")
    eq = equivalence(run)
    assert eq.exact_match == 0.0 and eq.partial_match == pytest.approx(1 / 5) and eq.rows[0].first_divergence == 1


def test_equivalence_names_the_diverging_request() -> None:
    """In a batch, only the request that diverged is reported, by its row of the case."""
    prompts = ((5, 6, 7), (9,))
    run = run_case(
        "specaudit.reference.mutants:rejected_kv_attended", Case(prompts, (pattern("1"), pattern("0")), 2, 6, None, 0)
    )
    found = violations(run)["equivalence"]
    assert [v.request for v in found] == [1]
    assert found[0].expected.startswith(f"token {continuation(prompts[1])[2]} at index 2")


def test_equivalence_never_blames_a_correct_round() -> None:
    """With a corrupted cache the origin of a wrong token is ambiguous: equivalence names no call, I2 names it."""
    run = run_case("specaudit.reference.mutants:rejected_kv_attended", Case(((0,),), (pattern("0"),), 1, 3, None, 0))
    found = violations(run)
    (v,) = found["equivalence"]
    # call 1 verifies [t0, d1] and keeps t1 correctly; call 2 attends the stale d1 and computes the wrong t2
    assert run.outputs is not None and v.found.startswith(f"token {run.outputs[0][2]} at index 2")
    assert v.call is None
    assert found["I2"][0].call == 2


def test_equivalence_strict_prefix_fails() -> None:
    """An output that is a strict prefix of the oracle's fails, naming the early end and the missing token."""
    prompts = ((3, 1, 4), (8, 8))
    run = run_case("tests:StopsEarly", Case(prompts, (pattern("1"), pattern("10")), 3, 5, None, 0), factory=StopsEarly)
    found = violations(run)["equivalence"]
    assert [v.request for v in found] == [0, 1]
    for v, prompt in zip(found, prompts, strict=True):
        assert v.found.startswith("the output ending (short) after 4 tokens")
        assert v.expected.startswith(f"token {continuation(prompt)[4]} at index 4")
    assert equivalence(run).partial_match == pytest.approx(0.8)


def test_token_preservation_draft_cache_not_rolled_back() -> None:
    """A draft cache that keeps rejected proposals is caught by token preservation only, at the next round."""
    run = run_case(
        "specaudit.reference.mutants:draft_cache_not_rolled_back",
        Case(((3, 1, 4),), (pattern("1101111111"),), 2, 6, None, 0),
    )
    found = violations(run)
    assert found["I1"] == found["I2"] == found["equivalence"] == []
    first = found["token-preservation"][0]
    # round 1 accepts 1 of 2 (indices 1, 2 -> accepted 1, bonus 2); round 2 starts at index 3 and should accept 2
    assert (first.check, first.rule, first.call, first.row) == ("token-preservation", "accepted-as-scheduled", 2, 0)
    assert first.found == "0 of 2 drafts from index 3 matching the oracle"
    assert first.expected.startswith("2 (the schedule accepts")


def test_token_preservation_recomputing_decoder() -> None:
    """A cache-free decoder that re-feeds every verified token throws none away: all checks hold."""
    run = run_case(
        "tests:NoCacheGreedy",
        Case(((3, 1, 4), (2, 7)), (pattern("1"), pattern("0")), 2, 4, None, 0),
        factory=NoCacheGreedy,
    )
    found = violations(run)
    assert found == {check: [] for check in CHECKS}


# ---------------------------------------------------------------------------------------
# Positive controls: EQSPEC passes every check on hard fixed cases


def _case_duplicates() -> Case:
    prompts = ((3, 1, 4), (9, 2), (3, 1, 4), (9, 2))
    return Case(prompts, (pattern("1101"), pattern("0"), pattern("1101"), pattern("0")), 3, 10, None, 0)


def _case_pad_is_eos() -> Case:
    prompts = ((3, 1, 4), (9, 2, 6, 5))
    eos = continuation(prompts[0])[3]
    return Case(prompts, (pattern("1110"), pattern("01")), 2, 12, eos, eos)


def _case_pad_in_prompts() -> Case:
    prompts = ((4, 4, 1), (1,), (7, 1, 1, 1, 1))
    return Case(prompts, (pattern("10"), pattern("1"), pattern("011")), 3, 9, None, 1)


def _case_eos_in_prompt() -> Case:
    prompts = ((5, 9, 5), (12, 13))
    return Case(prompts, (pattern("1"), pattern("100")), 4, 9, 5, 0)


def _case_eos_inside_accepted_block() -> Case:
    prompts = ((3, 1, 4), (11,))
    eos = continuation(prompts[0])[2]  # rounds accept 4: index 2 is inside the first accepted block
    return Case(prompts, (pattern("1"), pattern("10")), 4, 12, eos, 0)


def _case_extra_pad_columns() -> Case:
    prompts = ((3, 1, 4), (6,))
    return Case(prompts, (pattern("1011"), pattern("0111")), 2, 8, None, 0, extra_pad_columns=3)


def _case_k1() -> Case:
    prompts = ((3, 1, 4), (6, 6), (50,))
    return Case(prompts, (pattern("10"), pattern("1"), pattern("0")), 1, 8, None, 0)


def _case_k8() -> Case:
    prompts = ((3, 1, 4), (6, 6), (50,))
    return Case(prompts, (pattern("1111111110"), pattern("1"), pattern("0011")), 8, 20, None, 0)


def _case_one_token() -> Case:
    prompts = ((3, 1, 4), (6, 6))
    return Case(prompts, (pattern("1"), pattern("0")), 3, 1, None, 0)


def _case_single_row_all_reject() -> Case:
    return Case(((42,),), (pattern("0"),), 3, 7, None, 0)


EQSPEC_CASES: dict[str, Callable[[], Case]] = {
    "duplicate-prompts": _case_duplicates,
    "pad-is-eos": _case_pad_is_eos,
    "pad-in-prompts": _case_pad_in_prompts,
    "eos-in-prompt": _case_eos_in_prompt,
    "eos-inside-accepted-block": _case_eos_inside_accepted_block,
    "extra-pad-columns": _case_extra_pad_columns,
    "K=1": _case_k1,
    "K=8": _case_k8,
    "max_new_tokens=1": _case_one_token,
    "single-row-all-reject": _case_single_row_all_reject,
}


@pytest.mark.parametrize("name", list(EQSPEC_CASES))
def test_eqspec_passes_every_check(name: str) -> None:
    """The EQSPEC reference passes I1, I2, equivalence and token preservation on each hard fixed case."""
    run = run_case(EQSPEC, EQSPEC_CASES[name]())
    assert violations(run) == {check: [] for check in CHECKS}
    assert len(run.recording.target_calls) >= 1


def test_eqspec_case_features_are_real() -> None:
    """The fixed cases exercise what their names say: EOS stops a row, the pad id is a real prompt token."""
    eos_run = run_case(EQSPEC, _case_pad_is_eos())
    assert eos_run.oracle[0].stop == "eos" and len(eos_run.oracle[0].tokens) == 4
    block_run = run_case(EQSPEC, _case_eos_inside_accepted_block())
    assert block_run.oracle[0].stop == "eos" and block_run.outputs is not None and len(block_run.outputs[0]) == 3
    assert 1 in _case_pad_in_prompts().prompts[1]


def test_eqspec_on_tiny_llama_with_its_real_draft() -> None:
    """With a tiny real Llama and its real layer-skip draft, EQSPEC equals the oracle and keeps I1 and I2."""
    prompts = ((3, 1, 4, 1, 5), (9, 2), (3, 1, 4, 1, 5))
    case = Case(prompts, (pattern("1"),) * 3, 3, 8, None, 0, extra_pad_columns=1, model="llama", draft="tiny")
    run = run_case(EQSPEC, case)
    found = violations(run)
    assert found == {check: [] for check in CHECKS}
    assert all(len(out) == 8 for out in run.outputs or [])
    assert len(run.recording.target_calls) < 8  # some drafts were accepted: batches went ragged


def test_i2_catches_rejected_kv_on_tiny_llama() -> None:
    """On the real Llama, I2 compares K/V with a batch-size-1 run and still catches a kept rejected draft."""
    prompts = ((3, 1, 4, 1, 5), (9, 2))
    case = Case(prompts, (pattern("1"),) * 2, 3, 8, None, 0, model="llama", draft="tiny")
    run = run_case("specaudit.reference.mutants:rejected_kv_attended", case)
    first = violations(run)["I2"][0]
    assert first.rule == "attends-wrong-slot" and "differ from the batch-size-1 run" in first.found


def test_token_preservation_evidence_counts_are_meaningful() -> None:
    """verified-kept evidence counts cached generated tokens: never negative, fewer than the verified ones."""
    case = Case(((3, 1, 4),), (pattern("1"),), 2, 8, None, 0)
    found = check_token_preservation(run_case("specaudit.reference.mutants:acceptance_one_short", case))
    assert [v.rule for v in found] == ["verified-kept"], [v.render() for v in found]
    (v,) = found
    kept, verified = v.evidence["accepted"], v.evidence["scheduled"]
    # round 1 verifies d1, d2 (index 1, 2) but keeps only d1 in the cache: 2 generated tokens cached of 3 verified
    assert (kept, verified) == (2, 3) and (v.call, v.row, v.request) == (2, 0, 0)
    assert v.found == "a cache holding 2 generated tokens" and v.expected.startswith("at least 3:")
    control = run_case("tests:NoCacheGreedy", case, factory=NoCacheGreedy)
    assert check_token_preservation(control) == []


def test_i2_evidence_fields() -> None:
    """Every I2 violation carries the (token, position) found and expected as fields, for the diagnosis."""
    prompt = (0,)
    cont = continuation(prompt)
    run = run_case("specaudit.reference.mutants:rejected_kv_attended", Case((prompt,), (pattern("0"),), 1, 3, None, 0))
    first = check_i2(run)[0]
    assert {k: first.evidence[k] for k in ("found_token", "found_position", "expected_token", "expected_position")} == {
        "found_token": wrong_token(cont[1], 1, VOCAB_SIZE),
        "found_position": 2,
        "expected_token": cont[1],
        "expected_position": 2,
    }
    (eq,) = check_equivalence(run)
    assert set(eq.evidence) == {"index", "found_token", "expected_token", "partial", "ties", "cache_token"}
    assert eq.evidence["index"] == 2


def test_i2_first_input_is_the_pending_token() -> None:
    """A round whose first input is not the request's next token is an I2 fault at that input (the KV
    cropped to the batch's minimum acceptance: the bonus follows a shortened cache)."""
    prompts = ((5,), (7, 8, 9))
    case = Case(prompts, (pattern("1"), pattern("0")), 2, 6, None, 0)
    run = run_case("specaudit.reference.mutants:kv_cropped_to_min_acceptance", case)
    first = check_i2(run)[0]
    assert (first.rule, first.request) == ("input-token", 0)
    assert first.evidence["found_position"] == first.evidence["expected_position"]
    assert first.evidence["found_token"] != first.evidence["expected_token"]


def test_one_tie_aware_comparison_for_rows_and_requests() -> None:
    """`tie_aware` (a decoder's row and an engine's request alike): a divergence judged a tie
    re-syncs the reference onto the subject's token and goes on; one that is not a tie stops it."""
    from specaudit.checks.equivalence import tie_aware
    from specaudit.numerics.calibration import Witness
    from specaudit.reference.oracle import OracleResult

    oracle = OracleResult((5, 6, 7, 8), "length", (1.0, 1.0, 1e-12, 1.0))
    resynced = {((1, 5, 6, 9), 1): OracleResult((4,), "length", (1.0,))}

    def judge(prefix: tuple[int, ...], index: int, found: int, want: int, margin: float) -> Witness:
        return Witness(index, margin, 1e-9, "float64 oracle margin")

    def oracle_from(prefix: tuple[int, ...], n: int) -> OracleResult:
        return resynced[(prefix, n)]

    reference, judged, i = tie_aware((5, 6, 9, 4), oracle, (1,), 4, None, judge, oracle_from)
    assert reference == (5, 6, 9, 4) and [w.index for w in judged if w.numerical] == [2] and i == 4, (reference, i)
    reference, judged, i = tie_aware((5, 0, 7, 8), oracle, (1,), 4, None, judge, oracle_from)
    assert reference == oracle.tokens and i == 1 and not judged[-1].numerical, "a wide margin is a bug, not a tie"
