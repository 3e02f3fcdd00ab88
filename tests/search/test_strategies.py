"""Meta-tests of the case strategies (in the style of array-api-tests' meta/): every label the
strategies promise is reached within a bounded number of drawn cases, drawn cases stay inside
their cost limits, and a drawn case's repr evaluates back to the case. No decoder runs here."""

from __future__ import annotations

import importlib
from collections import Counter
from collections.abc import Callable

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from specaudit.contracts.case import Case
from specaudit.running.runner import _continuation, evict_models
from specaudit.search.determinism import without_local_constants
from specaudit.search.driver import search
from specaudit.search.strategies import (
    EXACT_BOUNDS,
    REAL_BOUNDS,
    cases,
    collected_labels,
    pattern_from_rounds,
    round_counts,
)

EXACT_BUDGET = 300  # drawn cases on the transparent model (about 10 s)
REAL_BUDGET = 80  # drawn cases on a tiny real model (the oracle runs for EOS placement)


def draw_labels(model: str, budget: int, check: Callable[[Case], None] = lambda case: None) -> Counter[str]:
    """Labels of `budget` derandomized cases for `model`, each also passed to `check`."""

    @settings(
        max_examples=budget,
        derandomize=True,
        database=None,
        deadline=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(data=st.data())
    def draw(data: st.DataObject) -> None:
        check(data.draw(cases(model), label="case"))

    with collected_labels() as seen, without_local_constants():  # the same draws whatever the worker imported
        draw()
    return seen


def missing(seen: Counter[str], wanted: dict[str, int]) -> dict[str, str]:
    return {name: f"got {seen[name]}, but should be >= {n}" for name, n in wanted.items() if seen[name] < n}


EXACT_LABELS = {
    # the scale branch: most cases stay small, the big shapes come now and then
    "shape: small": EXACT_BUDGET // 4,
    "shape: wide": 5,
    "shape: long": 10,
    "shape: deep": 10,
    "rows>16": 5,
    "rows>32": 1,
    "prompt>256": 10,
    "position>256": 10,
    "max_new_tokens>24": 10,
    "K>=8": 20,
    "K>8": 10,
    "extra pad columns>3": 10,
    # acceptance: every "accept i, then reject" up to K, deep ones, ragged mixes
    **{f"accept-i-then-reject:i={i}": 10 for i in range(9)},
    **{f"accept-i-then-reject:i={i}": 1 for i in (9, 10, 11)},
    "accept-all-K": 20,
    "rejection after >=3 accepted": 30,
    "acceptance: ragged across rows": 30,
    "acceptance: ragged across rounds": 30,
    **{f"schedule: {kind}": 10 for kind in ("all-accept", "all-reject", "ragged-per-row", "ragged-per-round")},
    "schedule: every-depth": 10,
    # batch, EOS and pad corner cases
    "batch: duplicate prompts": 10,
    "batch: equal lengths": 10,
    "batch: ragged lengths": 10,
    "eos: inside-accepted-block": 5,
    "eos: bonus-token": 5,
    "eos: last-position": 5,
    "eos: none": 10,
    "pad: collides with a prompt token": 10,
    "pad: equals eos": 10,
}


def test_every_label_is_reached_on_the_transparent_model() -> None:
    """Within EXACT_BUDGET cases: the big shapes, every acceptance depth, the EOS/pad corners."""
    seen = draw_labels("transparent", EXACT_BUDGET)
    assert not missing(seen, EXACT_LABELS), missing(seen, EXACT_LABELS)
    drawn = seen["draft:scripted"]
    assert seen["shape: small"] > drawn // 3, f"got {seen['shape: small']} small cases of {drawn}, but most stay small"


REAL_LABELS = {
    "dtype:float64": 5,
    "dtype:float32": 5,
    "dtype:bfloat16": 5,
    "draft:scripted": 10,
    "draft:tiny": 10,
    "position>256": 2,
    "K>=8": 5,
    "accept-i-then-reject:i=0": 5,
    "rejection after >=3 accepted": 1,
}


@pytest.mark.parametrize("model", ["llama", "gpt2"])
def test_every_label_is_reached_on_a_tiny_real_model(model: str) -> None:
    """Within REAL_BUDGET cases: all three dtypes, both drafts, and (sparsely) the big shapes."""
    evict_models()  # the draws consult the oracle: start from freshly built models, whatever ran before
    _continuation.cache_clear()
    seen = draw_labels(model, REAL_BUDGET)
    assert not missing(seen, REAL_LABELS), missing(seen, REAL_LABELS)
    drawn = seen["draft:scripted"] + seen["draft:tiny"]
    assert seen["shape: small"] > drawn // 2, f"got {seen['shape: small']} small cases of {drawn}, but should be most"


def test_real_draft_cases_carry_no_schedule_labels() -> None:
    """Acceptance labels describe the scripted draft's schedule; with the tiny draft there is none."""

    def only_scripted(case: Case) -> None:
        assert case.model == "qwen3" and case.draft in ("scripted", "tiny"), repr(case)

    seen = draw_labels("qwen3", 30, only_scripted)
    schedules = sum(n for name, n in seen.items() if name.startswith("schedule: "))
    assert schedules == seen["draft:scripted"], f"got {schedules} schedule labels, but should be one per scripted case"


@pytest.mark.parametrize(("model", "bounds"), [("transparent", EXACT_BOUNDS), ("gpt2", REAL_BOUNDS)])
def test_drawn_cases_stay_within_their_bounds(model: str, bounds: dict) -> None:
    """No case is bigger than the largest shape allows (what keeps the suite's cost bounded)."""
    limit = {field: max(getattr(b, field) for b in bounds.values()) for field in ("rows", "prompt_len", "k")}
    limit["max_new_tokens"] = max(b.max_new_tokens for b in bounds.values())
    limit["extra_pad_columns"] = max(b.extra_pad_columns for b in bounds.values())
    most_cells = max(b.rows * b.prompt_len for b in bounds.values())

    def within(case: Case) -> None:
        got = {
            "rows": case.batch_size,
            "prompt_len": max(map(len, case.prompts)),
            "k": case.num_draft_tokens,
            "max_new_tokens": case.max_new_tokens,
            "extra_pad_columns": case.extra_pad_columns,
        }
        over = {
            field: f"got {got[field]}, but should be <= {limit[field]}" for field in got if got[field] > limit[field]
        }
        assert not over, f"{over} in {case!r}"
        cells = case.batch_size * max(map(len, case.prompts))  # a wide batch never has long prompts too
        assert cells <= most_cells, f"got a {case.batch_size} x {max(map(len, case.prompts))} batch"

    draw_labels(model, 60 if model == "transparent" else 20, within)


@pytest.mark.parametrize("depths", [(0, 1, 2, 3, 4), (4, 0, 3, 1, 2), (2, 4, 1)])
def test_every_depth_schedule_is_followed_round_by_round(depths: tuple[int, ...]) -> None:
    """The pattern a schedule builds makes a prefill-first decoder accept exactly those counts."""
    pattern = pattern_from_rounds(False, depths, 64)
    rounds = round_counts(pattern, 4, 1 + sum(a + 1 for a in depths))
    assert [a for _, a in rounds] == list(depths), f"got {rounds}, but should accept {depths}"


def test_repr_evaluates_to_the_same_case() -> None:
    """`eval(repr(case)) == case` with `Case` in scope, so a found case can be pinned with @example."""
    case = Case(((3, 1, 4), (1, 5)), ((True, False, True), (False,)), 3, 8, None, 0, 2, "llama", "tiny", "bfloat16")
    text = repr(case)
    assert eval(text, {"Case": Case}) == case, text
    assert "accept=('101', '0')" in text and "prompts=((3, 1, 4), (1, 5))" in text, f"got {text}, not readable"

    def round_trips(drawn: Case) -> None:
        back = eval(repr(drawn), {"Case": Case})
        assert back == drawn and hash(back) == hash(drawn), f"got {back!r}, but should be {drawn!r}"

    draw_labels("transparent", 40, round_trips)
    draw_labels("gpt2", 10, round_trips)


def test_case_rejects_a_malformed_pattern_text() -> None:
    """Pattern text is 0s and 1s only: a typo in a pinned case is an error, not a silent reject-all."""
    with pytest.raises(ValueError, match="written with 0 and 1"):
        Case(((1, 2),), ("1x1",), 2, 4, None, 0)


def test_a_seed_draws_the_same_cases_whatever_was_imported_before(tmp_path, monkeypatch) -> None:
    """Hypothesis draws literals of the local modules imported so far; the search must not, or a
    seed's cases (and the kill table, and CI) would depend on which tests ran first on a worker."""

    def drawn() -> list[Case]:
        seen: list[Case] = []
        search(
            "specaudit.reference.eqspec:EqSpec",
            "transparent",
            max_examples=8,
            seed=3,
            on_run=lambda run: seen.append(run.case),
        )
        return seen

    before = drawn()
    literals = ", ".join(str(n) for n in range(3, 128, 2))  # token ids, lengths, drafts per round
    (tmp_path / "decoder_with_literals.py").write_text(f"LITERALS = [{literals}]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.import_module("decoder_with_literals")
    assert drawn() == before
