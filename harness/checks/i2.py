"""I2, position/KV correspondence: each row attends exactly its request's tokens at 0, 1, 2, ...

Per row of every target call (bound to its request by `specaudit.checks.rows`): the attended
past slots hold the request's prompt and verified tokens at positions 0..m-1 (or, in a
later chunk of one verification round, that round's earlier inputs); the current inputs sit
at positions m, m + 1, ...; and a round's first input is the request's next token: its
pending token, or the prompt's last token kept pending by the prefill. Masked slots may hold
anything.
"""

from __future__ import annotations

from specaudit.checks.contract import check_contract
from specaudit.checks.rows import Fault, RowView, follow_rows
from specaudit.runner import Run
from specaudit.violation import Violation

EVIDENCE = ("found_token", "found_position", "expected_token", "expected_position")


def describe(fault: Fault, pad: int) -> tuple[str, str]:
    """(found, expected) in words, from the fault's fields."""
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
    if fault.found_token is None:
        if fault.expected_token is None:
            return f"an extra attended slot {fault.slot}", expected
        return (
            f"slot {fault.slot} whose K/V differ from the batch-size-1 run by up to {fault.kv_difference:.3g}",
            f"the K/V of {expected}",
        )
    note = " (the pad id)" if fault.found_token == pad else ""
    found = f"slot {fault.slot} holding token {fault.found_token}{note} at position {fault.found_position}"
    if fault.rule == "row-identity":
        found += f", the history of request {fault.other}"
    if fault.rule == "input-token":
        entry = f"first input (slot {fault.slot}) holding token {fault.found_token}{note}"
        found = f"{entry} at position {fault.found_position}"
        if fault.other is not None:
            found += f", the next token of request {fault.other}"
        expected += " (the request's next token)"
    return found, expected


def violation(fault: Fault, pad: int) -> Violation:
    found, expected = describe(fault, pad)
    evidence = {key: getattr(fault, key) for key in EVIDENCE}
    evidence["other_request"] = fault.other
    return Violation("I2", fault.rule, found, expected, fault.call, fault.row, fault.slot, fault.request, evidence)


def row_views(run: Run) -> tuple[list[RowView], list[Violation]]:
    """Every row of every target call bound to its request, and the I2 violations (memoized)."""
    if "views" not in run.memo:
        trace = follow_rows(run)
        pad = run.case.pad_token_id
        run.memo["views"] = list(trace.views), [violation(f, pad) for f in trace.faults]
    return run.memo["views"]


def check_i2(run: Run) -> list[Violation]:
    if run.outputs is None:
        return check_contract(run)
    return row_views(run)[1]
