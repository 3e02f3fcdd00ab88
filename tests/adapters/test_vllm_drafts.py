"""Drafts shaped on purpose (`specaudit.adapters.vllm.drafts`) and the white box's drawn K.

Pure: the shape itself and the strategy, without vLLM. What the shape does inside a vLLM
engine is tested under the vLLM venv (tests/adapters/test_vllm_observer.py).
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings

from specaudit.adapters.vllm.drafts import DRAFTS_ENV, DraftShape, parse_shape, shape_from_env
from specaudit.adapters.vllm.whitebox import PlannedRequest, Shape, Workload, workloads

TOKENS = (5, 6, 7, 8)


def test_k_cuts_the_drafts_and_none_keeps_the_engines() -> None:
    drafts = [9, 10, 11, 12, 13]
    assert DraftShape(k=1).shape(TOKENS, drafts) == [9]
    assert DraftShape(k=3).shape(TOKENS, drafts) == [9, 10, 11]
    assert DraftShape(k=7).shape(TOKENS, drafts) == DraftShape().shape(TOKENS, drafts) == drafts


@pytest.mark.parametrize("rate", [0.1, 0.3, 0.7])
def test_the_wrong_share_is_the_rate_and_each_spoiled_draft_differs(rate: float) -> None:
    """Over 2000 single drafts at different positions, about `rate` are replaced, each by another id."""
    shape = DraftShape(disagree=rate, seed=3)
    spoiled = 0
    for n in range(2000):
        tokens = (1,) * n + (n % 50,)
        (draft,) = shape.shape(tokens, [n % 50])
        spoiled += draft != n % 50
    assert abs(spoiled / 2000 - rate) < 0.04, spoiled


def test_shaping_is_deterministic_and_depends_on_the_seed() -> None:
    drafts = list(range(20, 60))
    first = DraftShape(disagree=0.5, seed=1).shape(TOKENS, drafts)
    assert first == DraftShape(disagree=0.5, seed=1).shape(TOKENS, drafts) != drafts
    assert first != DraftShape(disagree=0.5, seed=2).shape(TOKENS, drafts)
    assert DraftShape(disagree=1.0).shape(TOKENS, [0, 3]) == [1, 2]  # 0 has no id below it
    assert DraftShape(disagree=0.0).shape(TOKENS, drafts) == drafts


def test_ragged_drafts_cut_each_request_to_a_count_of_its_own() -> None:
    """`ragged`: a request's drafts cut to 1..what it proposed, by a hash of its length and last token,
    so requests verifying together carry different draft counts, the same ones on a replay."""
    drafts = list(range(20, 27))
    shape = DraftShape(ragged=True)
    counts = [len(shape.shape((5,) * n + (n % 9,), drafts)) for n in range(1, 200)]
    assert set(counts) == set(range(1, 8)), sorted(set(counts))
    assert all(shape.shape((5,) * n, drafts) == drafts[: len(shape.shape((5,) * n, drafts))] for n in range(1, 50))
    assert counts == [len(shape.shape((5,) * n + (n % 9,), drafts)) for n in range(1, 200)]
    assert not shape.inert and DraftShape().shape(TOKENS, drafts) == drafts
    assert parse_shape("ragged=1,k=4") == DraftShape(k=4, ragged=True) and not parse_shape("ragged=0").ragged


def test_bad_shapes_are_refused_with_what_was_given() -> None:
    with pytest.raises(ValueError, match="disagree must be in"):
        DraftShape(disagree=1.5)
    with pytest.raises(ValueError, match="k must be >= 1"):
        DraftShape(k=0)
    with pytest.raises(ValueError, match="expected disagree=RATE"):
        parse_shape("disagree=0.3,K=4")
    assert parse_shape(" k=4, disagree=0.25 ,seed=2") == DraftShape(0.25, 4, seed=2)
    assert parse_shape("").inert and not DraftShape(k=7).inert


def test_the_plugin_is_inert_without_its_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    """No variable, or an empty one: nothing imported, nothing patched (vLLM is absent in this venv)."""
    for value in (None, ""):
        if value is None:
            monkeypatch.delenv(DRAFTS_ENV, raising=False)
        else:
            monkeypatch.setenv(DRAFTS_ENV, value)
        assert shape_from_env() is None


def test_the_workloads_k_travels_in_the_payload() -> None:
    workload = Workload((PlannedRequest((5, 6), 0, 3, name="a"), PlannedRequest((7,), 1, 4, name="b")), None, k=2)
    assert workload.to_payload()["k"] == 2 and Workload.from_payload(workload.to_payload()) == workload


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads(Shape(vocab=64, block_size=32, max_prompt=40, max_tokens=20, max_k=7)))
def test_the_strategy_draws_the_workloads_k_within_the_engines(workload: Workload) -> None:
    assert workload.k is not None and 1 <= workload.k <= 7, workload


@settings(max_examples=20, deadline=None)
@given(workloads(Shape(vocab=64, block_size=32, max_prompt=40, max_tokens=20)))
def test_without_speculation_no_k_is_drawn(workload: Workload) -> None:
    assert workload.k is None, workload


def test_a_shrunk_case_keeps_a_margin_over_its_tolerance() -> None:
    """While shrinking, a kv-entry failure within `SHRINK_MARGIN` times its tolerance is not taken
    as the smaller case (it may not fail again elsewhere): `clear_margin` is the search's `keep`
    (`search.drawn`, whose shrinking tests/search/test_drawn.py holds); a rule without a tolerance
    is never held back. The probe hands the search each workload's violations (None: it passes)
    and counts drawn examples apart from shrinks."""
    from specaudit.adapters.vllm import whitebox as wb
    from specaudit.contracts.violation import Violation

    def kv(distance: float) -> Violation:
        evidence = {"kv_distance": distance, "kv_bound": 1e-3}
        return Violation("paged", "kv-entry", "differs", "within", 0, evidence=evidence)

    class Scripted(wb.Probe):
        answers: list[list[Violation]]

        def judge_workload(self, workload: Workload, shrinking: bool = False) -> list[Violation]:
            return self.answers.pop(0)

    probe = Scripted(None, None, None, wb.WhiteBoxResult({}, wb.EngineOptions()))
    big, small = Workload((PlannedRequest((5,) * 9, 0, 4),)), Workload((PlannedRequest((5,), 0, 4),))
    probe.answers = [[kv(1.1e-3)], []]
    assert probe(big, False) == ([kv(1.1e-3)], None) and probe(small, True) == (None, None)
    assert (probe.result.examples, probe.result.shrink_runs) == (1, 1)
    assert wb.clear_margin(kv(wb.SHRINK_MARGIN * 1e-3)) and not wb.clear_margin(kv(1.23e-3))
    assert wb.clear_margin(Violation("paged", "greedy-commit", "x", "y", 0)) and not wb.clear_margin(kv(2e-3))
