"""`search.drawn`, the search every engine adapter shares (vLLM's and transformers-cb's white boxes,
OpenVINO): a failure is shrunk only to smaller workloads failing the same way with a clear margin,
the budget ends drawing and shrinking, and Hypothesis's Flaky comes back beside the failure kept."""

from __future__ import annotations

from hypothesis import strategies as st

from specaudit.contracts.violation import Violation
from specaudit.search.drawn import drawn_search


def kv(distance: float) -> Violation:
    return Violation("paged", "kv-entry", "differs", "within", 0, evidence={"kv_distance": distance, "kv_bound": 1e-3})


def margin(v: Violation) -> bool:
    return v.evidence.get("kv_distance", 1.0) >= 4e-3


def test_a_failure_shrinks_only_to_the_same_rule_with_a_clear_margin() -> None:
    """Workloads are ints: 100..299 fail kv-entry at 1.2 times its tolerance, 300 and up at 4 times;
    the shrunk case is 300 when the first failure drawn was past it (the close ones are not taken),
    else the first failure itself. A different rule below 100 is never the case shrunk to."""
    judged: list[int] = []

    def judge(n: int, shrinking: bool) -> tuple[list[Violation] | None, int]:
        judged.append(n)
        if n >= 100:
            return [kv(4e-3 if n >= 300 else 1.2e-3)], n
        if n >= 50:
            return [Violation("paged", "greedy-commit", "x", "y", 0)], n
        return None, n

    found = drawn_search(st.integers(0, 1000), judge, examples=200, seed=0, keep=margin)
    assert found.failure is not None and found.error is None
    first = next(n for n in judged if n >= 50)
    kept = found.failure.workload
    if first >= 300:
        assert kept == 300 and found.failure.violations[0].evidence["kv_distance"] == 4e-3
    elif first >= 100:
        assert kept == first, (first, kept)
    else:
        assert kept == 50, (first, kept)
    assert found.failure.evidence == kept


def test_no_budget_left_judges_nothing_and_a_flaky_failure_is_kept_with_the_error() -> None:
    calls: list[int] = []

    def judge(n: int, shrinking: bool) -> tuple[list[Violation] | None, None]:
        calls.append(n)
        return ([kv(1.0)] if len(calls) == 1 else None), None

    assert drawn_search(st.integers(0, 9), judge, examples=5, seed=0, seconds=0.0).failure is None and not calls
    found = drawn_search(st.integers(0, 9), judge, examples=5, seed=0)  # fails once, never again: Flaky
    assert found.failure is not None and found.failure.workload == calls[0] and found.error is not None


def test_fixed_workloads_are_judged_first_and_count_among_the_examples() -> None:
    """`first` reaches what the draws may miss: judged before any draw, within `examples`. One that
    fails is kept, unshrunk, unless a draw fails the same way: that draw is shrunk in its place."""
    calls: list[int] = []

    def judge(n: int, shrinking: bool) -> tuple[list[Violation] | None, None]:
        calls.append(n)
        return ([kv(1.0)] if n == -7 or n >= 5 else None), None

    assert drawn_search(st.integers(0, 4), judge, examples=3, seed=0, first=[-1, -2]).failure is None
    assert calls[:2] == [-1, -2] and len(calls) == 3 and 0 <= calls[2] <= 4
    calls.clear()
    found = drawn_search(st.integers(0, 4), judge, examples=3, seed=0, first=[-7, -1])
    assert found.failure is not None and found.failure.workload == -7 and calls[:1] == [-7] and -1 not in calls
    found = drawn_search(st.integers(0, 100), judge, examples=50, seed=0, first=[-7])
    assert found.failure is not None and found.failure.workload == 5, found  # a draw of the same failure, shrunk
    assert drawn_search(st.integers(0, 4), judge, examples=1, seed=0, first=[-1, -2]).failure is None
