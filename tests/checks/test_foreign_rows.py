"""Correct decoders built differently from the references pass every check; planted bugs still fail.

The decoders in tests/decoders/ were written from scratch: verification split over several
target forwards (`chunked`), a prefill that keeps each prompt's last token pending
(`pending`), and no KV cache at all (`recompute`). Row identity must follow each of them
through their own call patterns, on hand-picked hard cases (coinciding histories above all)
and on generated ones; the negative controls show that the allowances made for them (a
chunk attending unverified drafts, a pending prompt token) hide no bug.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specaudit.checks import check_equivalence, check_i1, check_i2, check_token_preservation, row_views
from specaudit.checks.diagnosis import diagnose
from specaudit.contracts.case import Case
from specaudit.contracts.violation import Violation
from specaudit.reference.mutants import CATALOG
from specaudit.running.runner import Run, oracle_continuation, run_case
from specaudit.search.strategies import cases
from tests.decoders.chunked import ChunkedSpec
from tests.decoders.pending import PendingPadRows, PendingSpec
from tests.decoders.recompute import RecomputeSpec, RecomputeUnpadsByValue

CHECKS: dict[str, Callable[[Run], list[Violation]]] = {
    "I1": check_i1,
    "I2": check_i2,
    "equivalence": check_equivalence,
    "token-preservation": check_token_preservation,
}
DECODERS: dict[str, Any] = {"chunked": ChunkedSpec, "pending": PendingSpec, "recompute": RecomputeSpec}
EQSPEC = "specaudit.reference.eqspec:EqSpec"


def pattern(flags: str, length: int = 40) -> tuple[bool, ...]:
    """An accept pattern from a string of 0/1, repeated to `length`."""
    return tuple(flags[i % len(flags)] == "1" for i in range(length))


def first_token(prompt: tuple[int, ...], model: str) -> int:
    return oracle_continuation(model, "float64", prompt, 1).tokens[0]


def run_decoder(name: str, case: Case) -> Run:
    factory = DECODERS[name]
    run = run_case(f"tests.decoders.{name}:{factory.__name__}", case, factory=factory)
    assert run.error is None, run.error
    return run


def found(run: Run) -> dict[str, list[str]]:
    """Each check's violations, rendered (empty lists when the run passes)."""
    return {name: [v.render() for v in check(run)] for name, check in CHECKS.items()}


PASSING = {name: [] for name in CHECKS}


# ---------------------------------------------------------------------------------------
# Hard cases


def prefix_case(model: str = "transparent") -> Case:
    """Problem 1: one prompt is another's prompt plus its continuation; every draft rejected."""
    head = (118,)
    cont = oracle_continuation(model, "float64", head, 3).tokens
    return Case((head, head + cont), (pattern("0"), pattern("0")), 2, 6, None, 0, model=model)


def zeros_case(model: str = "transparent") -> Case:
    """Problem 2's prompts: [0] and [0, 0] with pad 0 (the pad id is a real prompt token)."""
    return Case(((0,), (0, 0)), (pattern("1"), pattern("10")), 2, 6, None, 0, model=model)


def coinciding_case(model: str = "transparent") -> Case:
    """Request 0's history becomes request 1's prompt after one token, under different schedules."""
    head = (0,)
    return Case((head, head + (first_token(head, model),)), (pattern("1"), pattern("10")), 2, 6, None, 0, model=model)


def duplicates_case(model: str = "transparent") -> Case:
    prompts = ((3, 1, 4), (9, 2), (3, 1, 4), (9, 2))
    return Case(prompts, (pattern("1101"), pattern("0"), pattern("1101"), pattern("0")), 3, 8, None, 0, model=model)


def prefix_chain_case(model: str = "transparent") -> Case:
    """Prompts that are prefixes of each other (without being each other's continuation)."""
    prompts = ((5,), (5, 6), (5, 6, 7))
    return Case(prompts, (pattern("10"), pattern("1"), pattern("011")), 3, 7, None, 6, model=model)


def pad_in_prompts_case(model: str = "transparent") -> Case:
    prompts = ((4, 4, 1), (1,), (7, 1, 1, 1, 1))
    return Case(prompts, (pattern("10"), pattern("1"), pattern("011")), 3, 9, None, 1, 2, model=model)


def eos_case(model: str = "transparent") -> Case:
    """EOS inside an accepted block for one row, EOS as a prompt token and as the pad id for another."""
    prompts = ((3, 1, 4), (11,))
    eos = oracle_continuation(model, "float64", prompts[0], 3).tokens[2]
    return Case(prompts + ((eos, 2),), (pattern("1"), pattern("10"), pattern("0")), 4, 9, eos, eos, model=model)


HARD_CASES: dict[str, Callable[[str], Case]] = {
    "prefix-continuation": prefix_case,
    "zeros-pad-zero": zeros_case,
    "coinciding-histories": coinciding_case,
    "duplicate-prompts": duplicates_case,
    "prefix-chain": prefix_chain_case,
    "pad-in-prompts": pad_in_prompts_case,
    "eos": eos_case,
}
REAL_CASES = ("zeros-pad-zero", "coinciding-histories", "duplicate-prompts")


@pytest.mark.parametrize("case_name", list(HARD_CASES))
@pytest.mark.parametrize("decoder", list(DECODERS))
def test_foreign_decoder_passes_hard_cases(decoder: str, case_name: str) -> None:
    """Each independently written decoder passes I1, I2, equivalence and token preservation on the transparent model."""
    run = run_decoder(decoder, HARD_CASES[case_name]("transparent"))
    assert found(run) == PASSING
    assert len(row_views(run)[0]) > 0


@pytest.mark.parametrize("case_name", REAL_CASES)
@pytest.mark.parametrize("decoder", list(DECODERS))
def test_foreign_decoder_passes_on_tiny_llama(decoder: str, case_name: str) -> None:
    """The same decoders pass every check on the tiny Llama (K/V compared with batch-size-1 runs)."""
    run = run_decoder(decoder, HARD_CASES[case_name]("llama"))
    assert found(run) == PASSING


def test_hard_cases_are_what_they_say() -> None:
    """The coinciding cases really coincide: a prompt plus its first tokens is the other prompt."""
    prefix = prefix_case().prompts
    assert (
        prefix[1][:1] == prefix[0] and prefix[1][1:] == oracle_continuation("transparent", "float64", (118,), 3).tokens
    )
    for model in ("transparent", "llama"):
        short, long = coinciding_case(model).prompts
        assert long == short + (first_token(short, model),)
    eos = eos_case()
    run = run_case(EQSPEC, eos)
    assert run.oracle[0].stop == "eos" and eos.prompts[2][0] == eos.eos_token_id == eos.pad_token_id


# ---------------------------------------------------------------------------------------
# The false alarms, as regressions


def test_eqspec_prefix_prompts_keep_token_preservation() -> None:
    """Problem 1: EQSPEC on prompts [118] and [118] + its continuation is judged against each row's own schedule."""
    run = run_case(EQSPEC, prefix_case())
    assert found(run) == PASSING
    views = row_views(run)[0]
    for call in {v.call for v in views}:  # one request per row: never two rows bound to one request
        requests = [v.request for v in views if v.call == call]
        assert len(requests) == len(set(requests)), f"target call {call}: rows bound to requests {requests}"


@pytest.mark.parametrize("model", ["transparent", "llama"])
def test_cache_free_decoder_on_zero_prompts(model: str) -> None:
    """Problem 2: a cache-free decoder on prompts [0] and [0, 0] with pad 0 passes token preservation."""
    run = run_decoder("recompute", zeros_case(model))
    assert found(run) == PASSING
    assert all(call.past_length == 0 for call in run.recording.target_calls)  # it really keeps no cache


def test_coinciding_histories_follow_the_draft_schedule() -> None:
    """Where request 0's history equals request 1's prompt, each round is judged by the schedule the
    draft applies to that content, and both rows keep their own identity."""
    case = coinciding_case()
    run = run_decoder("recompute", case)
    assert found(run) == PASSING
    per_row = {(v.call, v.row): v.request for v in row_views(run)[0]}
    assert sorted(set(per_row.values())) == [0, 1]


# ---------------------------------------------------------------------------------------
# The decoders do what their names say


def test_chunked_decoder_verifies_in_several_forwards() -> None:
    """ChunkedSpec's rounds take two target forwards; the second attends the first's unverified drafts."""
    run = run_decoder("chunked", duplicates_case())
    chunks = [v for v in row_views(run)[0] if v.chunk]
    assert chunks, "no call was read as a chunk of a round"
    rounds = len(run.recording.target_calls) - 1
    assert rounds >= 2 * len({v.call for v in chunks})


def test_pending_decoder_prefills_all_but_the_last_token() -> None:
    """PendingSpec's prefill sees one column fewer than the prompts; the first round feeds the last one."""
    case = pad_in_prompts_case()
    run = run_decoder("pending", case)
    width = case.batch()[0].shape[1]
    calls = run.recording.target_calls
    assert calls[0].input_ids is not None and calls[0].input_ids.shape[1] == width - 1
    assert calls[1].past_length == width - 1


# ---------------------------------------------------------------------------------------
# Generated cases


def small(case: Case) -> bool:
    """Cases a cache-free decoder and the Python scripted draft get through in seconds."""
    return case.batch_size <= 8 and max(map(len, case.prompts)) <= 32 and case.max_new_tokens <= 16


@pytest.mark.parametrize("decoder", list(DECODERS))
def test_foreign_decoder_passes_generated_cases(decoder: str) -> None:
    """A few small Hypothesis cases on the transparent model: every check holds."""

    @settings(max_examples=6, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
    @given(data=st.data())
    def prop(data: st.DataObject) -> None:
        run = run_decoder(decoder, data.draw(cases("transparent").filter(small), label="case"))
        assert found(run) == PASSING

    prop()


# ---------------------------------------------------------------------------------------
# Negative controls


class ChunkedKeepsRejected(ChunkedSpec):
    """ChunkedSpec whose compaction keeps every slot of the round, rejected drafts included."""

    name = "chunked-keeps-rejected"

    @staticmethod
    def kept(accepted: torch.Tensor, k: int) -> torch.Tensor:
        return torch.ones(accepted.shape[0], k + 1, dtype=torch.bool)


@pytest.mark.parametrize("name", ["rejected_kv_attended", "cache_rows_permuted", "kv_cropped_to_min_acceptance"])
def test_planted_bugs_still_caught_first_by_their_catalog_check(name: str) -> None:
    """Planted bugs that live next to the allowances (stale slots, mixed rows, dropped KV) are still
    caught, first by the check their catalog entry names."""
    case = Case(((5,), (7, 8, 9)), (pattern("1"), pattern("0")), 2, 6, None, 0)
    diagnosis = diagnose(run_case(f"specaudit.reference.mutants:{name}", case))
    assert diagnosis.first_check == CATALOG[name].bug.first_check, diagnosis.render()


def test_rejected_drafts_kept_after_a_chunked_round_are_caught() -> None:
    """A chunk may attend its round's unverified drafts; the next round attending a rejected one is an I2 fault."""
    case = Case(((5, 6), (9,)), (pattern("0"), pattern("10")), 3, 6, None, 0)
    run = run_case("tests:ChunkedKeepsRejected", case, factory=ChunkedKeepsRejected)
    assert run.error is None, run.error
    i2 = check_i2(run)
    assert i2 and i2[0].rule == "attends-wrong-slot", [v.render() for v in i2]


# ---------------------------------------------------------------------------------------
# Degenerate inputs and cache-free history (issue 15, points 5 and 9)

PAD_ROW_CASES = {
    "one-row-pad-column": lambda model: Case(((0,),), (pattern("1"),), 2, 4, None, 0, 1, model, DRAFTS[model]),
    "zeros": lambda model: Case(((0,), (0, 0)), (pattern("1"),) * 2, 2, 4, None, 0, 0, model, DRAFTS[model]),
}
DRAFTS = {"transparent": "scripted", "llama": "tiny", "gpt2": "tiny"}


@pytest.mark.parametrize("model", list(DRAFTS))
@pytest.mark.parametrize("shape", list(PAD_ROW_CASES))
def test_all_pad_prefill_rows_are_judged_not_crashed(shape: str, model: str) -> None:
    """A prefill of `input_ids[:, :-1]` whose one-token-prompt rows are all pads (an empty stream,
    a zero-width one-row stream) passes every check: such a row may attend nothing."""
    case = PAD_ROW_CASES[shape](model)
    run = run_case("tests.decoders.pending:PendingPadRows", case, factory=PendingPadRows)
    assert run.error is None, run.error
    diagnosis = diagnose(run)
    assert diagnosis.passed, diagnosis.render()


@pytest.mark.parametrize("model", list(DRAFTS))
def test_cache_free_history_with_a_dropped_token_is_an_i2_fault(model: str) -> None:
    """A cache-free decoder whose re-fed history drops a real token equal to the pad id fails I2
    (`history-token`, at the slot where the history goes wrong), diagnosed as kv-drift; the same
    decoder unpadding by the mask passes."""
    accept = (pattern("1101"), pattern("0111")) if model == "transparent" else ((), ())
    case = Case(((3, 0, 4), (5, 6)), accept, 2, 4, None, 0, 0, model, DRAFTS[model])
    good = run_case("tests.decoders.recompute:RecomputeSpec", case, factory=RecomputeSpec)
    assert diagnose(good).passed, diagnose(good).render()
    bad = run_case("tests.decoders.recompute:RecomputeUnpadsByValue", case, factory=RecomputeUnpadsByValue)
    first = check_i2(bad)[0] if check_i2(bad) else None
    found = None if first is None else (first.rule, first.row, first.slot, first.evidence["expected_token"])
    assert found == ("history-token", 0, 1, 0), f"got {found}, but should be ('history-token', row 0, slot 1, token 0)"
    diagnosis = diagnose(bad)
    assert (diagnosis.first_check, diagnosis.signature) == ("I2", "kv-drift"), diagnosis.render()
