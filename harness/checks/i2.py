"""I2, position/KV correspondence: each row attends exactly its request's tokens at 0, 1, 2, ...

Per row of every target call (bound to its request by `specaudit.checks.rows`): the attended
past slots hold the request's prompt and verified tokens at positions 0..m-1 (or, in a
later chunk of one verification round, that round's earlier inputs); the current inputs sit
at positions m, m + 1, ...; and a round's first input is the request's next token: its
pending token, or the prompt's last token kept pending by the prefill. Masked slots may hold
anything.

On a real model a past slot is judged by its K/V (see `specaudit.checks.kv`): against the
dtype's fixed tolerance, or, with a measured noise floor, by which entry it holds, with a
margin against that noise. The violation then carries the margin: the distance to the
expected entry, the bound, and the nearest alternative entry (which, and how far).
"""

from __future__ import annotations

from collections.abc import Sequence

from specaudit.checks.cache import cached
from specaudit.checks.contract import check_contract
from specaudit.checks.rows import Fault, RowView, follow_rows
from specaudit.contracts.violation import Violation
from specaudit.running.runner import Run

EVIDENCE = ("found_token", "found_position", "expected_token", "expected_position")


def pad_note(fault: Fault, pad: int, prompt: Sequence[int] = ()) -> str:
    """What the found token is when it equals the pad id: a pad; where the request's own prompt holds
    the pad id (a prompt may hold it as a real token), the slot may be that token, at that position or
    shifted, and the message says so rather than send the user after padding."""
    if fault.found_token != pad:
        return ""
    position = fault.found_position
    if position is not None and 0 <= position < len(prompt) and prompt[position] == pad:
        return " (the pad id, which the request's prompt also holds at that position)"
    held = [i for i, token in enumerate(prompt) if token == pad]
    if held:
        return f" (the pad id, or the request's prompt token at position {held[0]}, which is the pad id too)"
    return " (the pad id)"


def describe(fault: Fault, pad: int, prompt: Sequence[int] = ()) -> tuple[str, str]:
    """(found, expected) in words, from the fault's fields; `prompt`: the request's own, where known."""
    if fault.expected_token is None:
        expected = "nothing attended"
    else:
        expected = f"token {fault.expected_token} at position {fault.expected_position}"
    if fault.rule == "cache-readable":
        return "a target call whose output has no cache", "a cache"
    if fault.rule == "position-ids":
        entry = f"current input {fault.input} (slot {fault.slot}, token {fault.found_token})"
        found = f"{entry} at position {fault.found_position}"
        return found, f"position {fault.expected_position}"
    if fault.rule in ENGINE_ROW_RULES or (fault.rule == "row-identity" and fault.request is None):
        return engine_row(fault, pad_note(fault, pad, prompt))
    if fault.found_token is None:
        if fault.expected_token is None:
            return f"an extra attended slot {fault.slot}", expected
        found = f"slot {fault.slot} whose K/V differ from the batch-size-1 run by up to {fault.kv_difference:.3g}"
        return found + kv_margin(fault), f"the K/V of {expected}"
    note = pad_note(fault, pad, prompt)
    found = f"slot {fault.slot} holding token {fault.found_token}{note} at position {fault.found_position}"
    if fault.rule == "row-identity":
        found += f", the history of request {fault.other}"
    if fault.rule == "history-token":
        entry = f"input {fault.input} (slot {fault.slot}) holding token {fault.found_token}{note}"
        found = f"{entry} at position {fault.found_position}"
        if fault.other is not None:
            found += f", the history of request {fault.other}"
        return found, expected + " (the request's committed history, re-fed without a cache)"
    if fault.rule == "input-token":
        entry = f"first input (slot {fault.slot}) holding token {fault.found_token}{note}"
        found = f"{entry} at position {fault.found_position}"
        if fault.other is not None:
            found += f", the next token of request {fault.other}"
        expected += " (the request's next token)"
    return found, expected


ENGINE_ROW_RULES = frozenset({"retired-row", "duplicate-row"})


def engine_row(fault: Fault, note: str) -> tuple[str, str]:
    """An engine's row that is no live request's own: a retired request's, a second row of one
    request, or no request's history at all (`checks.rows.RowFollower.unbound`); each
    judged at the row's first entry."""
    if fault.found_token is not None:
        found = f"slot {fault.slot} holding token {fault.found_token}{note} at position {fault.found_position}"
    elif fault.request is None:
        found = f"slot {fault.slot} whose K/V are no tracked request's history"
    else:
        entry = f"request {fault.request}'s entry at position 0"
        found = f"slot {fault.slot} holding {entry} (K/V within {fault.kv_difference:.3g})"
    if fault.rule == "retired-row":
        return (
            f"{found}; the row holds request {fault.request}, {fault.left} before this step",
            "rows of live requests only",
        )
    if fault.rule == "duplicate-row":
        return found, f"request {fault.request} in one row only (also row {fault.holder})"
    return found, "the first token of a live request's prompt"


def kv_margin(fault: Fault) -> str:
    """The margin in words: the bound (or the fixed tolerance) and the nearest alternative entry."""
    distance = fault.kv_difference or 0.0
    if fault.kv_bound is None:
        text = " (beyond the dtype's fixed tolerance"
    elif distance > fault.kv_bound:
        text = f" (beyond the noise bound {fault.kv_bound:.3g}"
    else:
        text = f" (within the noise bound {fault.kv_bound:.3g}, but nearer to an alternative"
    if fault.nearest is None:
        return text + "; no alternative entry at hand)"
    token = "" if fault.nearest.token is None else f", token {fault.nearest.token}"
    return text + f"; nearest alternative: {fault.nearest.label}{token}, at {fault.nearest_distance:.3g})"


def kv_evidence(fault: Fault) -> dict[str, object]:
    """The K/V margin as evidence fields (real models only)."""
    alternative = fault.nearest
    return {
        "kv_distance": fault.kv_difference,
        "kv_bound": fault.kv_bound,
        "nearest_alternative": None if alternative is None else alternative.label,
        "nearest_distance": fault.nearest_distance,
        "nearest_token": None if alternative is None else alternative.token,
        "nearest_position": None if alternative is None else alternative.position,
        "nearest_request": None if alternative is None else alternative.request,
    }


def violation(fault: Fault, pad: int, prompts: Sequence[Sequence[int]] = ()) -> Violation:
    """`prompts`: each request's prompt (a decoder's case), so a prompt's own token equal to the pad id
    is not called a pad."""
    prompt = prompts[fault.request] if fault.request is not None and fault.request < len(prompts) else ()
    found, expected = describe(fault, pad, prompt)
    evidence = {key: getattr(fault, key) for key in EVIDENCE}
    evidence["other_request"] = fault.other
    if fault.kv_difference is not None:
        evidence.update(kv_evidence(fault))
    return Violation("I2", fault.rule, found, expected, fault.call, fault.row, fault.slot, fault.request, evidence)


def row_views(run: Run) -> tuple[list[RowView], list[Violation]]:
    """Every row of every target call bound to its request, and the I2 violations (memoized)."""

    def views() -> tuple[list[RowView], list[Violation]]:
        trace = follow_rows(run)
        return list(trace.views), [violation(f, run.case.pad_token_id, run.case.prompts) for f in trace.faults]

    return cached(run, "I2", "views", views)


def check_i2(run: Run) -> list[Violation]:
    if run.outputs is None:
        return check_contract(run)
    return row_views(run)[1]
