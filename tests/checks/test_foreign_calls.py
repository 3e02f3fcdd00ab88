"""Correct decoders built differently from the references (positional calls, a fixed-capacity
StaticCache, a split body and head) pass every check; the same algorithm calling the target
through `forward(...)` is refused as unobserved."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from specaudit.checks.diagnosis import all_violations, diagnose
from specaudit.contracts.case import Case
from specaudit.running.runner import run_case
from specaudit.search.driver import search
from tests.decoders.positional import MaskedSpec

FOREIGN = (
    "tests.decoders.positional:Positional",
    "tests.decoders.static_cache:StaticCacheSpec",
    "tests.decoders.split_call:SplitCall",
)


@pytest.fixture(autouse=True, scope="module")
def one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def ragged(model: str, eos: int | None = None) -> Case:
    """Three rows, different padding and acceptance, so rows turn ragged from the first round."""
    prompts = ((3, 1, 4, 1, 5), (9, 2), (6, 5, 3))
    accept = (
        (True, False, True, True, False, True, True, False),
        (False, True, True, False, True, True, True, True),
        (True, True, True, False, False, True, False, True),
    )
    draft = "scripted" if model == "transparent" else "tiny"
    return Case(prompts, accept, 3, 7, eos, 0, 1, model, draft)


@pytest.mark.parametrize("model", ["transparent", "llama"])
@pytest.mark.parametrize("spec", FOREIGN, ids=lambda s: s.rsplit(":", 1)[1])
def test_foreign_decoder_passes_every_check(spec: str, model: str) -> None:
    """On a ragged batch, every check passes and every row is exact."""
    diagnosis = diagnose(run_case(spec, ragged(model)))
    assert diagnosis.passed and diagnosis.verdict == "exact", diagnosis.render()


@pytest.mark.slow  # a search of 25 cases each
@pytest.mark.parametrize("spec", FOREIGN, ids=lambda s: s.rsplit(":", 1)[1])
def test_foreign_decoder_survives_the_search(spec: str) -> None:
    """No generated transparent case (padding, duplicates, EOS, ragged acceptance) fails a check."""
    result = search(spec, "transparent", max_examples=25, seed=1, minimize_budget=0)
    assert result.minimal is None, repr(result.minimal)


def test_static_cache_decoder_uses_a_static_cache_and_finishes_rows_in_place() -> None:
    """On llama the target cache keeps its capacity while the recorded P grows; rows never leave the batch."""
    run = run_case("tests.decoders.static_cache:StaticCacheSpec", ragged("llama", eos=None))
    calls = run.recording.target_calls
    assert [c.past_length for c in calls] == sorted(c.past_length for c in calls) and calls[-1].past_length > 0
    assert {c.input_ids.shape[0] for c in calls} == {3}
    assert all(c.attention_mask.shape[1] == c.past_length + c.input_ids.shape[1] for c in calls)


def test_split_call_is_recorded_at_the_base_model() -> None:
    """target.model(...) then target.lm_head(...): every target call is recorded, from the base model."""
    run = run_case("tests.decoders.split_call:SplitCall", ragged("llama"))
    assert run.error is None and {c.entry for c in run.recording.target_calls} == {"base"}
    assert run.recording.forwards == len(run.recording.target_calls) and not run.recording.unobserved


class ThroughForward(MaskedSpec):
    """The same algorithm, calling the target as `target.forward(...)`."""

    def forward(self, model, ids, mask, positions, cache):  # type: ignore[no-untyped-def]
        from specaudit.models.compat import cache_keyword

        kw = {"input_ids": ids, "attention_mask": mask, "position_ids": positions, cache_keyword(model): cache}
        return model.forward(**kw, use_cache=True).logits


@pytest.mark.parametrize("model", ["transparent", "llama"])
def test_forward_calls_are_refused_as_unobserved(model: str) -> None:
    """Every call through forward() is unseen by hooks: one 'unobserved-forward' violation, not kv-drift."""
    diagnosis = diagnose(run_case("tests:through-forward", ragged(model), factory=ThroughForward))
    assert (diagnosis.first_check, diagnosis.signature) == ("contract", "contract"), diagnosis.render()
    assert diagnosis.first.rule == "unobserved-forward" and [v.rule for v in diagnosis.violations] == [
        "unobserved-forward"
    ]
    assert diagnosis.first.evidence["observed"] == 0 and diagnosis.first.evidence["forwards"] > 1


def test_forward_bypass_mutant_is_a_contract_break() -> None:
    """The planted forward_bypass is refused as unobserved on its first case, with outputs withheld."""
    run = run_case("specaudit.reference.mutants:forward_bypass", ragged("transparent"))
    assert run.outputs is None and run.error is not None and run.error.rule == "unobserved-forward"
    assert all_violations(run)[0].rule == "unobserved-forward"
