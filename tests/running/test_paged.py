"""Preemption followed one way for every paged engine: `running.paged.incarnations` splits a
preempted request into `a`, `a~1`, `a~2`, ... and `PagedTrace` maps trace ids back to requests
(transformers-cb traces written before named them `a#1`; those still read)."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

from specaudit.running.paged import RESUMED, PagedCall, PagedTrace, incarnations


def call(step: int, ids: Sequence[str]) -> PagedCall:
    """A forward whose layout does not matter here: one query token per request."""
    n = len(ids)
    return PagedCall(
        step - 1,
        step,
        tuple(ids),
        torch.zeros(n, dtype=torch.long),  # [N]
        torch.zeros(n, dtype=torch.long),  # [N]
        torch.arange(n + 1),  # [R + 1]
        torch.ones(n, dtype=torch.long),  # [R]
        torch.arange(n),  # [N]
        torch.zeros(n, 1, dtype=torch.long),  # [R, 1]
        4,
    )


def raw_trace() -> tuple[PagedTrace, dict[str, list[int]]]:
    """By the caller's ids: `a` runs steps 1-2, is preempted by step 3's scheduling, resumes in
    step 4, is preempted again by step 6's and resumes in 7; `b` runs throughout and is aborted."""
    runs = {1: "ab", 2: "ab", 3: "b", 4: "ab", 5: "ab", 6: "b", 7: "a"}
    outputs = {"a": (11, 12, 13, 14, 15, 16), "b": (21, 22, 23, 24, 25, 26)}
    done = {"a": [1, 2, 2, 3, 4, 4, 6], "b": [1, 2, 3, 4, 5, 6, 6]}  # outputs after each step
    commits = tuple({r: outputs[r][: done[r][s - 1]] for r in "ab"} for s in runs)
    trace = PagedTrace(
        tuple(call(s, list(ids)) for s, ids in runs.items()),
        {"a": (1, 2), "b": (3,)},
        {"a": 0, "b": 0},
        {"a": 7, "b": 6},
        frozenset({"b"}),
        commits,
    )
    return trace, {"a": [3, 6]}


def test_a_trace_without_preemptions_is_unchanged() -> None:
    """Nothing preempted (or only requests the trace does not hold): the same trace back."""
    trace, _ = raw_trace()
    assert incarnations(trace, {}) is trace
    assert incarnations(trace, {"zz": [2], "a": []}) is trace


def test_each_preemption_starts_an_incarnation_with_everything_committed_as_prompt() -> None:
    """`a` leaves after the step before each preemption, `a~k` arrives then with `a`'s prompt and
    all of its outputs so far as prompt, and runs (by name) in the forwards after it."""
    raw, preempted = raw_trace()
    trace = incarnations(raw, preempted)
    assert list(trace.prompts) == ["a", "b", f"a{RESUMED}1", "a~2"], "arrival order: resumed ones last"
    assert trace.prompts["a~1"] == (1, 2, 11, 12) and trace.prompts["a~2"] == (1, 2, 11, 12, 13, 14)
    assert (trace.left["a"], trace.arrivals["a~1"], trace.left["a~1"], trace.arrivals["a~2"]) == (2, 2, 5, 5)
    assert trace.left["a~2"] == 7 and trace.left["b"] == 6 and trace.aborted == {"b"}
    assert [c.request_ids for c in trace.calls] == [
        ("a", "b"), ("a", "b"), ("b",), ("a~1", "b"), ("a~1", "b"), ("b",), ("a~2",)
    ]  # fmt: skip
    assert trace.commits[1] == {"a": (11, 12), "a~1": (), "b": (21, 22)}
    assert trace.commits[-1] == {"a": (11, 12), "a~1": (13, 14), "a~2": (15, 16), "b": raw.commits[-1]["b"]}
    for step in range(1, len(raw.commits) + 1):  # an incarnation's prompt and outputs are the request's
        for name in trace.incarnations_of("a"):
            if name in trace.commits[step - 1] and trace.live(name, step):
                assert trace.committed(name, step) == raw.committed("a", step)[: len(trace.committed(name, step))]


def test_an_aborted_request_is_aborted_in_its_last_incarnation() -> None:
    """The abort belongs to the incarnation that was running; it never leaves before it arrived."""
    raw, _ = raw_trace()
    aborted = PagedTrace(raw.calls, raw.prompts, raw.arrivals, {"a": 4, "b": 6}, frozenset({"a"}), raw.commits)
    trace = incarnations(aborted, {"a": [3, 6]})
    assert trace.aborted == {"a~2"}
    assert trace.left["a~2"] == trace.arrivals["a~2"] == 5, "left before it arrived"


def test_trace_ids_map_back_to_their_request() -> None:
    """`request_of`, `resumed`, `incarnations_of` and `preemptions` read both namings; an id that
    merely looks like an incarnation (its base is not a request of the trace) is its own request."""
    raw, preempted = raw_trace()
    trace = incarnations(raw, preempted)
    assert [trace.request_of(t) for t in trace.prompts] == ["a", "b", "a", "a"]
    assert [trace.resumed(t) for t in trace.prompts] == [False, False, True, True]
    assert trace.incarnations_of("a") == ["a", "a~1", "a~2"] and trace.incarnations_of("b") == ["b"]
    assert trace.preemptions() == 2 and raw.preemptions() == 0
    legacy = PagedTrace((), {"r0": (1,), "r0#1": (1, 2), "x~1": (3,)}, {}, {}, frozenset(), ())
    assert legacy.incarnations_of("r0") == ["r0", "r0#1"] and legacy.request_of("r0#1") == "r0"
    assert legacy.request_of("x~1") == "x~1" and not legacy.resumed("x~1") and legacy.preemptions() == 1


@pytest.mark.parametrize("steps", [[3], [3, 3], [6, 3]])
def test_preemption_steps_are_read_as_a_set_in_order(steps: list[int]) -> None:
    """The same step twice (seen twice by the observer) or out of order: one split per step."""
    raw, _ = raw_trace()
    names = list(incarnations(raw, {"a": steps}).prompts)
    assert names == (["a", "b", "a~1"] if set(steps) == {3} else ["a", "b", "a~1", "a~2"])
