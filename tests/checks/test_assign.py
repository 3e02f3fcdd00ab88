"""The one matching of rows to requests (`checks.rows.assign`), a decoder's and an engine's."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specaudit.checks.rows import assign


def test_best_pairs_first_when_every_pair_is_allowed() -> None:
    """A decoder's scores allow every pair: the greedy matching, best pair first, one to one."""
    score = torch.tensor([[3.0, 9.0, 1.0], [8.0, 7.0, 2.0]])  # [B=2, R=3]
    assert assign(score) == [(0, 1), (1, 0)]
    assert assign(score.T.contiguous()) == [(0, 1), (1, 0)]  # more rows than requests: one row left over


def test_a_row_left_over_reroutes_an_earlier_one() -> None:
    """Row 0 prefers request 0, row 1 may hold request 0 only: greedy alone leaves row 1 unbound;
    the augmenting path moves row 0 to its second choice (an engine's duplicate prompts)."""
    score = torch.tensor([[5.0, 4.0], [5.0, -1.0]])
    assert assign(score) == [(0, 1), (1, 0)]


def test_disallowed_pairs_never_bind() -> None:
    """Negative scores are not candidates: a row with none stays unbound, nothing is forced."""
    score = torch.tensor([[2.0, -1.0], [-1.0, -1.0], [1.0, -1.0]])
    assert assign(score) == [(0, 0)]


def maximum_matching(allowed: list[list[bool]]) -> int:
    """The largest one-to-one matching by brute force over the rows' choices (small sizes only)."""
    requests = len(allowed[0]) if allowed else 0

    def best(b: int, taken: frozenset[int]) -> int:
        if b == len(allowed):
            return 0
        skip = best(b + 1, taken)
        take = [1 + best(b + 1, taken | {r}) for r in range(requests) if allowed[b][r] and r not in taken]
        return max([skip, *take])

    return best(0, frozenset())


def greedy(score: torch.Tensor) -> list[tuple[int, int]]:
    """Best pairs first, one to one, nothing else: the decoder's matching before it was shared."""
    rows, taken, pairs = set(), set(), []
    for k in torch.argsort(score.flatten(), descending=True, stable=True).tolist():
        b, r = divmod(k, score.shape[1])
        if score[b, r] >= 0 and b not in rows and r not in taken:
            rows.add(b)
            taken.add(r)
            pairs.append((b, r))
    return sorted(pairs)


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 5), st.integers(1, 5), st.data())
def test_as_many_rows_bound_as_any_matching_allows(batch: int, requests: int, data: st.DataObject) -> None:
    """Against brute force: the matching is maximum, one to one, on allowed pairs only; and where
    every pair is allowed (a decoder's scores) it is exactly the greedy matching."""
    cells = st.one_of(st.just(-1.0), st.integers(0, 6).map(float))
    score = torch.tensor(data.draw(st.lists(st.lists(cells, min_size=requests, max_size=requests), min_size=batch,
                                            max_size=batch)))  # fmt: skip
    pairs = assign(score)
    assert len({b for b, _ in pairs}) == len({r for _, r in pairs}) == len(pairs), pairs
    assert all(score[b, r] >= 0 for b, r in pairs), pairs
    assert len(pairs) == maximum_matching((score >= 0).tolist()), (score, pairs)
    dense = score.abs()
    assert assign(dense) == greedy(dense), dense
