"""EXSPEC and LazySpec: correct for any scheduler settings (every check of the registry),
grouping observed through the instrumentation. The scheduler checks' negative controls live
in tests/checks/test_scheduling.py."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specaudit.checks import check_i2
from specaudit.checks.registry import FAIL, evaluate, outcome_of
from specaudit.checks.scheduling import calls_by_request
from specaudit.contracts.case import Case
from specaudit.contracts.violation import explain
from specaudit.models.compat import call_model
from specaudit.reference.eqspec import BatchState
from specaudit.reference.exspec import ExSpec
from specaudit.reference.lazy import LazySpec
from specaudit.running.runner import Run, run_case
from specaudit.search.strategies import cases

ALL_ACCEPT = tuple([True] * 40)
ALL_REJECT = tuple([False] * 40)


def all_checks(run: Run, *, but: tuple[str, ...] = ()) -> None:
    """Every check of the registry passes or does not apply (the ones named in `but` aside)."""
    evaluation = evaluate(run)
    assert run.error is None, run.error
    violations = [v for o in evaluation.outcomes if o.check not in but for v in o.violations]
    assert not violations, explain(run, violations)


@settings(max_examples=25, deadline=None)
@given(
    data=st.data(),
    batch_size=st.integers(1, 5),
    extra_window=st.integers(0, 6),
    max_wait=st.integers(1, 4),
)
def test_exspec_is_correct_for_any_pool_batch_and_window(
    data: st.DataObject, batch_size: int, extra_window: int, max_wait: int
) -> None:
    """EXSPEC passes every check, liveness included, for any B, window >= B and max_wait."""
    case = data.draw(cases("transparent"), label="case")
    window = batch_size + extra_window
    decoder = ExSpec(batch_size, window, max_wait)
    run = run_case("exspec", case, factory=lambda: decoder)
    all_checks(run)


def test_exspec_bound_covers_queue_time() -> None:
    """A pool of 10 behind a window of 4 keeps the declared max_wait_calls from the start of generate:
    a request queues only while the window (its max_batch_size) is full."""
    prompts = tuple(tuple(range(i, i + 3 + i % 2)) for i in range(10))
    case = Case(prompts, (ALL_REJECT,) * 10, 2, 12, None, 0)
    run = run_case("exspec", case, factory=lambda: ExSpec(2, 4, 2))
    outcome = outcome_of("liveness", run)
    assert outcome.status != FAIL, explain(run, list(outcome.violations))
    assert calls_by_request(run)[9][0] > 0  # the last request did queue, behind a full window


def grouped_calls(run: Run) -> list[bool]:
    return [bool((c.attention_mask == 1).all()) for c in run.recording.target_calls]


def test_identical_lengths_are_always_grouped() -> None:
    """On an identical-length pool with uniform acceptance every EXSPEC target call is pad-free."""
    prompts = tuple(tuple(range(i, i + 6)) for i in range(8))
    case = Case(prompts, (ALL_REJECT,) * 8, 3, 6, None, 0)
    run = run_case("specaudit.reference.exspec:ExSpec", case)
    all_checks(run)
    assert all(grouped_calls(run)), grouped_calls(run)
    assert run.instance.fallback_rounds == 0 and run.instance.grouped_rounds > 0


def test_ragged_pool_falls_back_to_padding() -> None:
    """With every length distinct, no group forms: EXSPEC pads (observed as mask zeros) and stays correct."""
    prompts = tuple(tuple(range(1, n + 1)) for n in (2, 5, 9))
    case = Case(prompts, (ALL_ACCEPT,) * 3, 2, 5, None, 0)
    run = run_case("exspec", case, factory=lambda: ExSpec(batch_size=3, window=3))
    all_checks(run)
    assert not all(grouped_calls(run))
    assert run.instance.fallback_rounds > 0


def test_lazyspec_keeps_rejected_entries_masked_and_compacts() -> None:
    """LazySpec leaves rejected slots in the cache (masked) and passes I2; it compacts past its threshold."""
    prompts = ((1, 2, 3), (4, 5, 6, 7, 8))
    case = Case(prompts, (ALL_REJECT, ALL_ACCEPT), 4, 12, None, 0)
    run = run_case("lazy", case, factory=lambda: LazySpec(compact_above=0.6))
    all_checks(run)
    masks = [c.attention_mask for c in run.recording.target_calls[1:]]
    assert any(bool((m[:, -1] == 1).all()) and bool((m == 0).any()) for m in masks)  # holes are attended around
    assert run.instance.compactions > 0
    never = run_case("lazy", case, factory=lambda: LazySpec(compact_above=1.0))
    all_checks(never)
    assert never.instance.compactions == 0
    widths = [c.past_length for c in never.recording.target_calls]
    assert widths == sorted(widths)  # the cache only grows without compaction


class LazyCountingMaskedSlots(LazySpec):
    """BSP's bug: rejected KV kept masked, but position ids count every slot."""

    def batch_verify(self, target: torch.nn.Module, state: BatchState, drafts: torch.Tensor) -> torch.Tensor:
        width = state.mask.shape[1]
        positions = torch.full_like(state.mask[:, :1], width)  # every slot counted, holes included
        block = torch.cat([state.pending[:, None], drafts], dim=1)
        mask = torch.cat([state.mask, state.mask.new_ones(block.shape)], dim=1)
        logits, state.target_cache = call_model(
            target, block, mask, positions + torch.arange(block.shape[1]), state.target_cache
        )
        return logits.argmax(-1)


def test_masking_with_slot_count_positions_fails_i2() -> None:
    """Negative control: masking without correct position ids is caught by I2 at the first hole."""
    prompts = ((1, 2, 3),)
    case = Case(prompts, (ALL_REJECT,), 3, 6, None, 0)
    run = run_case("bsp", case, factory=LazyCountingMaskedSlots)
    violations = check_i2(run)
    assert violations and violations[0].rule == "position-ids", violations
