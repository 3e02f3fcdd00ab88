"""Scheduler checks: liveness, no realignment for grouped batches, order independence.

Liveness counts queue time too: a request's wait runs from the start of `generate` to its
first target call, and then between two of its calls. All observed through the
instrumentation (which rows each target call holds, and what its cache slots hold), never
taken from the decoder's account of itself.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from specaudit.checks import RowView, row_views
from specaudit.checks.kv import flat_cache
from specaudit.checks.liveness import WaitLedger, overdue, settle, unfinished
from specaudit.contracts.case import Case
from specaudit.contracts.violation import Violation
from specaudit.fixtures.pairs import is_exact
from specaudit.numerics.tolerance import DTYPES, KV_TOLERANCE
from specaudit.running.instrument import CallRecord
from specaudit.running.runner import Run


def calls_by_request(run: Run) -> dict[int, list[int]]:
    """Per request of the case, the target calls that include it, in order. Rows are bound to
    requests by construction (`specaudit.checks.rows`), so duplicate prompts are told apart."""
    calls: dict[int, set[int]] = {}
    for view in row_views(run)[0]:
        calls.setdefault(view.request, set()).add(view.call)
    return {request: sorted(seen) for request, seen in sorted(calls.items())}


def declared_bound(run: Run) -> int | None:
    """The decoder's `max_wait_calls`, read from the object that ran (None: no bound declared)."""
    bound = getattr(run.instance, "max_wait_calls", None)
    return None if bound is None else int(bound)


def check_liveness(run: Run, max_wait_calls: int | None) -> list[Violation]:
    """Every request finishes (EOS or the limit); with a stated bound, no request waits longer
    (`specaudit.checks.liveness` over the run's ledger)."""
    if run.outputs is None:
        return []
    ledger = decoder_ledger(run, max_wait_calls)
    return unfinished(ledger) + overdue(ledger)


def decoder_ledger(run: Run, max_wait_calls: int | None) -> WaitLedger:
    """A decoder run's ledger, in target calls. A request waits from the start of `generate` to
    its first call (queue time), counting only calls with room for it (all of them, or, for a
    decoder declaring `max_batch_size`, those made while fewer than that many requests were
    under way: a full decoder may keep a request queued), then every call it misses until its last."""
    assert run.outputs is not None
    by_request = calls_by_request(run)
    capacity = getattr(run.instance, "max_batch_size", None)
    spans = [(c[0], c[-1]) for c in by_request.values() if c]
    ledger = settle(WaitLedger("target calls", max_wait_calls, "max_wait_calls"), run.record)
    for r, tenure in ledger.tenures.items():
        calls = tenure.served = by_request.get(r, [])
        if calls:
            room = [c for c in range(calls[0]) if capacity is None or sum(a <= c <= b for a, b in spans) < capacity]
            tenure.waiting = set(room) | set(range(calls[0], calls[-1])) - set(calls)
    return ledger


def is_grouped(run: Run, call: int) -> bool:
    """A grouped batch: every row attends every slot (no pad, no hole), equal lengths."""
    record = run.recording.target_calls[call]
    mask = record.attention_mask
    return mask is not None and bool((mask == 1).all())


def grouped_pairs(run: Run) -> list[tuple[RowView, RowView]]:
    """Consecutive views of one request, (earlier, later), where both target calls are grouped."""
    last: dict[int, RowView] = {}
    pairs = []
    for view in row_views(run)[0]:
        previous, last[view.request] = last.get(view.request), view
        if previous is not None and is_grouped(run, previous.call) and is_grouped(run, view.call):
            pairs.append((previous, view))
    return pairs


def check_grouped_no_realignment(run: Run) -> list[Violation]:
    """Between two grouped calls of a request its cache slots stay put: the later call's past
    holds what the same slots held after the earlier call (only the tail may be cut), so no
    padding, shifting or gathering happened in between."""
    if run.outputs is None:
        return []
    calls = run.recording.target_calls
    rtol, atol = (0.0, 0.0) if is_exact(run.case.model) else KV_TOLERANCE[DTYPES[run.case.dtype]]
    violations = []
    for previous, view in grouped_pairs(run):
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
                    evidence={"since": previous.call, "slot": moved},
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
    if not now.cache_after or not then.cache_after or past <= 0:
        return None
    found = flat_cache(now.cache_after, now.cache_after[0][0].dtype)[row, :past]  # [P, F], on its device
    kept = flat_cache(then.cache_after, then.cache_after[0][0].dtype)[then_row, :past].to(found.device)
    changed = ~torch.isclose(found.double(), kept.double(), rtol=rtol, atol=atol).all(dim=-1)  # [P]
    first = torch.where(changed.any(), changed.int().argmax(), -1)  # one value crosses to the host
    return None if (slot := int(first)) < 0 else slot


def permuted(case: Case, order: list[int]) -> Case:
    """The same requests in another pool order: row i of the result is request order[i]."""
    return replace(case, prompts=tuple(case.prompts[i] for i in order), accept=tuple(case.accept[i] for i in order))


def rotation(batch: int) -> list[int]:
    """The registry's permutation: row i holds request i + 1 (mod B), so every request moves.

    A reversal would not do: it commutes with a decoder that returns its rows reversed.
    """
    return [(i + 1) % batch for i in range(batch)]


def permuted_run(run: Run) -> tuple[list[int], Run]:
    """The same decoder on the case in rotated order (made by the run, once)."""
    order = rotation(run.case.batch_size)
    return order, run.again(permuted(run.case, order))


def order_independence(run: Run) -> list[Violation]:
    """The registry's check: the case again in rotated order, compared row by row."""
    if run.outputs is None or run.case.batch_size < 2:
        return []
    order, other = permuted_run(run)
    return check_order_independence(run, other, order)


def check_order_independence(run: Run, other: Run, order: list[int]) -> list[Violation]:
    """Row i of the permuted run must equal row order[i] of the original run."""
    if run.outputs is None:
        return []
    if other.outputs is None:
        assert other.error is not None
        return [
            Violation(
                "order-independence",
                "keeps-contract",
                f"the run in pool order {order} breaking the contract rule '{other.error.rule}': {other.error.detail}",
                "the same outputs, permuted",
                evidence={"order": list(order), "rule": other.error.rule},
            )
        ]
    violations = []
    for i, source in enumerate(order):
        if other.outputs[i] != run.outputs[source]:
            violations.append(
                Violation(
                    "order-independence",
                    "same-output",
                    f"{other.outputs[i]} for request {source} placed at row {i} (pool order {order})",
                    f"{run.outputs[source]} as in the original order",
                    row=i,
                    request=source,
                    evidence={"order": list(order), "found": other.outputs[i], "expected": run.outputs[source]},
                )
            )
    return violations
