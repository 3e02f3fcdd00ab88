"""The decoder's row follower on an engine's calls (`RowFollower.visit` with a `Book`): rows bind
one to one to the live requests whose histories they hold, twins (one prompt) take one row each,
idle rows are skipped, and a row left over is a fault of its own (retired-row, duplicate-row,
row-identity)."""

from __future__ import annotations

import torch

from specaudit.checks.rows import Book, Fault, RowFollower
from specaudit.fixtures.transparent import transparent_target
from specaudit.running.instrument import instrument

PAD = 0
PROMPT = (5, 6, 7)


def prefill(
    rows: list[tuple[int, ...]], requests: list[tuple[int, ...]], book: Book
) -> tuple[list[Fault], RowFollower]:
    """One prefill call of `rows` (left-padded) on the transparent target, judged as an engine's
    call with `requests` added (each read against its prompt)."""
    width = max(len(r) for r in rows)
    ids = torch.tensor([[PAD] * (width - len(r)) + list(r) for r in rows])  # [B, T]
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])  # [B, T]
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    target = transparent_target()
    with instrument(target, None) as recording, torch.no_grad():
        target(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True)
    follower = RowFollower(True, 1, PAD, recording.target_calls)
    follower.add(requests, requests)
    follower.visit(recording.target_calls[0], book)
    return follower.faults, follower


def live(*requests: int) -> Book:
    return Book(frozenset(requests), {r: len(PROMPT) for r in requests})


def test_twins_take_one_row_each() -> None:
    """Two live requests with one prompt, two rows holding it: each row binds a request of its own."""
    faults, follower = prefill([PROMPT, PROMPT], [PROMPT, PROMPT], live(0, 1))
    assert faults == [], faults
    assert sorted(v.request for v in follower.views) == [0, 1]


def test_a_row_left_over_holds_a_retired_request_else_a_duplicate() -> None:
    """Two rows holding one prompt, one of its two requests retired: the second row is retired-row;
    with the prompt's only request live, the second row is duplicate-row, held by the first."""
    faults, _ = prefill([PROMPT, PROMPT], [PROMPT, PROMPT], live(0))
    assert [(f.rule, f.row, f.request) for f in faults] == [("retired-row", 1, 1)], faults
    faults, _ = prefill([PROMPT, PROMPT], [PROMPT], live(0))
    assert [(f.rule, f.row, f.request, f.holder) for f in faults] == [("duplicate-row", 1, 0, 0)], faults


def test_a_row_of_no_request_is_row_identity_and_an_idle_row_is_skipped() -> None:
    """A row holding no request's history is row-identity with no request; a pad-only row is idle."""
    faults, follower = prefill([PROMPT, (9, 9), (PAD, PAD)], [PROMPT], live(0))
    assert [(f.rule, f.row, f.request) for f in faults] == [("row-identity", 1, None)], faults
    assert [v.row for v in follower.views] == [0]
