"""Scheduler checks: liveness, no realignment for grouped batches, order independence.

All observed through the instrumentation (which rows each target call holds, and what its
cache slots hold), never taken from the decoder's account of itself.
"""

from __future__ import annotations

import torch

from specaudit.case import Case
from specaudit.checks import RowView, row_views
from specaudit.fixtures.pairs import DTYPES, KV_TOLERANCE, is_exact
from specaudit.instrument import CallRecord
from specaudit.runner import Run
from specaudit.violation import Violation


def _calls_by_prompt(run: Run) -> dict[tuple[int, ...], list[tuple[int, bool]]]:
    """Target calls including each distinct prompt, and whether a row of it was already under
    way (attended past beyond the prompt) rather than just admitted. Duplicates cannot be told
    apart by content, so waits are measured per distinct prompt."""
    calls: dict[tuple[int, ...], dict[int, bool]] = {}
    for view in row_views(run)[0]:
        prompt = run.case.prompts[view.request]
        seen = calls.setdefault(prompt, {})
        seen[view.call] = seen.get(view.call, False) or view.past >= len(prompt)
    return {prompt: sorted(seen.items()) for prompt, seen in calls.items()}


def check_liveness(run: Run, max_wait_calls: int | None) -> list[Violation]:
    """Every request finishes (EOS or the limit); with a stated bound, no request waits longer.

    The wait is the number of other target calls between two calls that include a request
    already under way; time spent queued before admission is not a wait.
    """
    if run.outputs is None:
        return []
    violations = []
    for r, tokens in enumerate(run.outputs):
        done = len(tokens) >= run.case.max_new_tokens or (tokens and tokens[-1] == run.case.eos_token_id)
        if not done:
            violations.append(
                Violation(
                    "liveness",
                    "request-finishes",
                    f"{len(tokens)} tokens without EOS",
                    f"EOS or {run.case.max_new_tokens} tokens",
                    row=r,
                    request=r,
                )
            )
    if max_wait_calls is None:
        return violations
    for prompt, calls in _calls_by_prompt(run).items():
        for (before, _), (after, under_way) in zip(calls, calls[1:]):
            if under_way and after - before - 1 > max_wait_calls:
                violations.append(
                    Violation(
                        "liveness",
                        "bounded-wait",
                        f"{after - before - 1} target calls without prompt {list(prompt)[:8]} between calls "
                        f"{before} and {after}",
                        f"at most {max_wait_calls} (the decoder's max_wait_calls)",
                        call=after,
                    )
                )
    return violations


def is_grouped(run: Run, call: int) -> bool:
    """A grouped batch: every row attends every slot (no pad, no hole), equal lengths."""
    record = run.recording.target_calls[call]
    mask = record.attention_mask
    return mask is not None and bool((mask == 1).all())


def check_grouped_no_realignment(run: Run) -> list[Violation]:
    """Between two grouped calls of a request its cache slots stay put: the later call's past
    holds what the same slots held after the earlier call (only the tail may be cut), so no
    padding, shifting or gathering happened in between."""
    if run.outputs is None:
        return []
    calls = run.recording.target_calls
    rtol, atol = (0.0, 0.0) if is_exact(run.case.model) else KV_TOLERANCE[DTYPES[run.case.dtype]]
    last: dict[int, RowView] = {}
    violations = []
    for view in row_views(run)[0]:
        previous, last[view.request] = last.get(view.request), view
        if previous is None or not (is_grouped(run, previous.call) and is_grouped(run, view.call)):
            continue
        moved = first_moved_slot(calls[view.call], view.row, calls[previous.call], previous.row, rtol, atol)
        if moved is not None:
            violations.append(
                Violation(
                    "grouped-no-realignment",
                    "slots-stay",
                    f"slot {moved} changed since target call {previous.call}",
                    "the same contents at the same slot (a grouped batch needs no realignment)",
                    call=view.call,
                    row=view.row,
                    slot=moved,
                    request=view.request,
                )
            )
    return violations


def first_moved_slot(
    now: CallRecord, row: int, then: CallRecord, then_row: int, rtol: float, atol: float
) -> int | None:
    """First slot of `now`'s past, among those already past in `then`, whose K/V differ.

    Slots that were `then`'s own inputs are left out: drafts there may be rejected and
    replaced, and duplicate prompts at different progress hold the same committed prefix only.
    """
    past = min(now.past_length, then.past_length)
    if not now.cache_after or not then.cache_after:
        return None
    changed = torch.zeros(past, dtype=torch.bool)
    for (k, v), (k0, v0) in zip(now.cache_after, then.cache_after):
        for a, b in ((k[row][:, :past], k0[then_row][:, :past]), (v[row][:, :past], v0[then_row][:, :past])):
            changed |= ~torch.isclose(a.double(), b.double(), rtol=rtol, atol=atol).all(dim=-1).all(dim=0)
    hits = changed.nonzero()
    return int(hits[0]) if hits.numel() else None


def permuted(case: Case, order: list[int]) -> Case:
    """The same requests in another pool order."""
    return Case(
        tuple(case.prompts[i] for i in order),
        tuple(case.accept[i] for i in order),
        case.num_draft_tokens,
        case.max_new_tokens,
        case.eos_token_id,
        case.pad_token_id,
        case.extra_pad_columns,
        case.model,
        case.draft,
        case.dtype,
    )


def check_order_independence(run: Run, other: Run, order: list[int]) -> list[Violation]:
    """Row i of the permuted run must equal row order[i] of the original run."""
    if run.outputs is None or other.outputs is None:
        return []
    violations = []
    for i, source in enumerate(order):
        if other.outputs[i] != run.outputs[source]:
            violations.append(
                Violation(
                    "order-independence",
                    "same-output",
                    f"{other.outputs[i]} for request {source} placed at row {i}",
                    f"{run.outputs[source]} as in the original order",
                    row=i,
                    request=source,
                )
            )
    return violations
