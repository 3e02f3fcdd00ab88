"""Equivalence with the batch-size-1 oracle: identical tokens, length and stop reason.

The comparison itself (tie-aware, re-synced at numerical ties) lives in
`specaudit.checks.agreement`, which the row follower reads too; this module places each
divergence at the target call that decided it and the slot the cache holds it in, reading that
slot's token from the row views I2 judges (one set of facts per slot).
"""

from __future__ import annotations

from dataclasses import replace

from specaudit.checks.agreement import (
    Equivalence,
    RowEquivalence,
    TieJudge,
    compare_request,
    compare_row,
    equivalence,
    margin_witness,
    stop_reason,
    tie_aware,
    witness,
)
from specaudit.checks.contract import check_contract
from specaudit.checks.i2 import row_views
from specaudit.checks.rows import RowView, common_prefix
from specaudit.contracts.violation import Violation
from specaudit.fixtures.transparent import fit_mask
from specaudit.running.runner import Run

__all__ = [
    "Equivalence",
    "TieJudge",
    "RowEquivalence",
    "check_equivalence",
    "compare_request",
    "compare_row",
    "divergence",
    "equivalence",
    "witness",
    "locate",
    "margin_witness",
    "pad_columns_read",
    "stop_reason",
    "tie_aware",
]


def locate(run: Run, request: int, index: int) -> tuple[int | None, RowView | None]:
    """Where generated token `index` of `request` came from.

    Returns the target call that decided it (the last call before the token sits in the
    cache, not counting a call that merely feeds it back as the pending token) and the first
    view that holds it in the cache (or, for a last token, the last view that attends it).
    """
    views = [v for v in row_views(run)[0] if v.request == request]
    if not all(v.consistent for v in views):
        return None, None  # a corrupted cache (see I2) makes the origin ambiguous
    at = len(run.case.prompts[request]) + index
    if views and not any(v.cached for v in views):  # cache-free: the first call reaching index at - 1 decides it
        decider = next((v.call for v in views if len(v.stream) >= at), None)
        return decider, next((v for v in reversed(views) if len(v.stream) > at), None)
    cached = next((v for v in views if v.past > at), None)
    before = [v for v in views if cached is None or v.call < cached.call]
    deciders = [v.call for v in before if v.past != at]
    holder = cached or next((v for v in reversed(views) if len(v.stream) > at), None)
    return (deciders[-1] if deciders else None), holder


def check_equivalence(run: Run) -> list[Violation]:
    """One violation per diverging row, placed at the target call that decided the first wrong
    token and the slot where the row's cache then holds that index; what the slot holds is read
    from the same row view I2 judges, never assumed to be the output's token."""
    if run.outputs is None:
        return check_contract(run)
    out = []
    for r in equivalence(run).rows:
        if r.equivalent:
            continue
        i = r.first_divergence
        assert i is not None
        decided, holder = locate(run, r.row, i) if i < len(r.found) else (None, None)
        if holder is None:
            out.append(replace(divergence(r), call=decided))
            continue
        at = len(run.case.prompts[r.row]) + i
        cached_from = holder.call if holder.call != decided else None
        held = holder.stream[at] if cached_from is not None else None
        violation = divergence(r, cached_from, held, holder.cached)
        row = next((v.row for v in row_views(run)[0] if v.call == decided and v.request == r.row), holder.row)
        out.append(replace(violation, call=decided, row=row, slot=holder.slots[at]))
    return out


def divergence(
    r: RowEquivalence, cached_from: int | None = None, held: int | None = None, cached: bool = True
) -> Violation:
    """The first divergence of one request (`r.row` is its id), phrased alike for every subject
    (`cached_from`: the target call from which a decoder's cache holds that index, `held`: the
    token it holds there, as the row view read it; `cached`: False for a cache-free decoder,
    which feeds it back as an input instead)."""
    i = r.first_divergence
    assert i is not None
    notes = f" after {len(r.ties)} numerical tie(s) at {list(r.ties)}" if r.ties else ""
    if i < len(r.found):
        found = f"token {r.found[i]} at index {i}{notes}"
        if cached_from is not None and held == r.found[i]:
            kept = "the cache holds it" if cached else "fed back as an input"
            found += f" ({kept} from target call {cached_from})"
        elif cached_from is not None:
            kept = f"the cache holds token {held} there" if cached else f"token {held} fed back there"
            found += f" ({kept} from target call {cached_from})"
    else:
        found = f"the output ending ({r.found_stop}) after {len(r.found)} tokens"
    ref = r.reference
    expected = f"token {ref[i]}" if i < len(ref) else f"the output ending ({r.expected_stop})"
    return Violation(
        "equivalence",
        "first-divergence",
        f"{found} (partial match {r.partial:.2f})",
        f"{expected} at index {i} like the batch-size-1 oracle",
        request=r.row,
        evidence={
            "index": i,
            "found_token": r.found[i] if i < len(r.found) else None,
            "expected_token": ref[i] if i < len(ref) else None,
            "partial": r.partial,
            "ties": list(r.ties),
            "cache_token": held,
        },
    )


def pad_columns_read(run: Run, first: Violation) -> tuple[int, int] | None:
    """(row, pad columns) when the target call that decided a divergence gave the diverging
    request's row trailing pad columns: its last input columns masked, or holding the pad id
    past the request's own tokens (right padding). The logits at the batch's last column are
    then a pad's, not the row's; None when the row ends in its own token."""
    if first.call is None or first.request is None or run.outputs is None:
        return None
    view = next((v for v in row_views(run)[0] if v.call == first.call and v.request == first.request), None)
    call = next((c for c in run.recording.target_calls if c.index == first.call), None)
    if view is None or call is None or call.input_ids is None or call.input_ids.dim() != 2:
        return None
    ids = call.input_ids[view.row].tolist()  # [T]
    width = len(ids)
    mask = fit_mask(call.attention_mask, call.input_ids.shape[0], call.past_length + width)[view.row, -width:]  # [T]
    own = common_prefix(view.stream, run.case.prompts[first.request] + tuple(run.outputs[first.request]))
    index = view.past + int(mask.sum()) - 1  # stream index of the last attended input
    pads = 0
    for column in reversed(range(width)):
        if bool(mask[column]):
            if ids[column] != run.case.pad_token_id or index < own:
                break
            index -= 1
        pads += 1
    return (view.row, pads) if pads else None
