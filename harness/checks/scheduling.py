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
    """Every request finishes (EOS or the limit); with a stated bound, no request waits longer.

    A wait is counted in other target calls: from the start of `generate` to the request's
    first target call (queue time), and between two of its calls once it is under way.
    """
    if run.outputs is None:
        return []
    violations = [unfinished(run, r) for r, tokens in enumerate(run.outputs) if not finished(run, tokens)]
    if max_wait_calls is None:
        return violations
    by_request = calls_by_request(run)
    capacity = getattr(run.instance, "max_batch_size", None)
    for request, calls in by_request.items():
        violations += queue_wait(request, calls, max_wait_calls, queued_calls(by_request, calls, capacity))
        violations += gaps_between_calls(request, calls, max_wait_calls)
    return violations


def queued_calls(by_request: dict[int, list[int]], calls: list[int], capacity: int | None) -> int:
    """Target calls before the request's first one that count as waiting: all of them, or, for a
    decoder declaring `max_batch_size`, those made while fewer than that many requests were
    under way (between their first and last call): a full decoder may keep a request queued."""
    if not calls:
        return 0
    if capacity is None:
        return calls[0]
    spans = [(c[0], c[-1]) for c in by_request.values() if c]
    return sum(1 for c in range(calls[0]) if sum(first <= c <= last for first, last in spans) < capacity)


def finished(run: Run, tokens: list[int]) -> bool:
    eos = run.case.eos_token_id
    return len(tokens) >= run.case.max_new_tokens or bool(tokens and eos is not None and tokens[-1] == eos)


def unfinished(run: Run, r: int) -> Violation:
    tokens = run.outputs[r] if run.outputs is not None else []
    return Violation(
        "liveness",
        "request-finishes",
        f"{len(tokens)} tokens without EOS",
        f"EOS or {run.case.max_new_tokens} tokens",
        row=r,
        request=r,
        evidence={"tokens": len(tokens), "max_new_tokens": run.case.max_new_tokens},
    )


def queue_wait(request: int, calls: list[int], bound: int, waited: int) -> list[Violation]:
    """A request first served in target call c waited `waited` of the c calls before it."""
    if not calls or waited <= bound:
        return []
    first = calls[0]
    return [
        Violation(
            "liveness",
            "bounded-queue",
            f"{waited} target calls with room before request {request} first took part (in target call {first})",
            f"at most {bound} (the decoder's max_wait_calls), counted from the start of generate",
            call=first,
            request=request,
            evidence={"wait": waited, "since": None, "bound": bound},
        )
    ]


def gaps_between_calls(request: int, calls: list[int], bound: int) -> list[Violation]:
    """Other target calls between two consecutive calls that include the request."""
    return [
        Violation(
            "liveness",
            "bounded-wait",
            f"{after - before - 1} target calls without request {request} between calls {before} and {after}",
            f"at most {bound} (the decoder's max_wait_calls)",
            call=after,
            request=request,
            evidence={"wait": after - before - 1, "since": before, "bound": bound},
        )
        for before, after in zip(calls, calls[1:])
        if after - before - 1 > bound
    ]


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
    if not now.cache_after or not then.cache_after:
        return None
    changed = torch.zeros(past, dtype=torch.bool)
    for (k, v), (k0, v0) in zip(now.cache_after, then.cache_after):
        for a, b in ((k[row][:, :past], k0[then_row][:, :past]), (v[row][:, :past], v0[then_row][:, :past])):
            changed |= ~torch.isclose(a.double(), b.double(), rtol=rtol, atol=atol).all(dim=-1).all(dim=0)
    hits = changed.nonzero()
    return int(hits[0]) if hits.numel() else None


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
