"""Token preservation judges drafts by what the draft proposed, not by what the target attends.

A target that verifies by decoding greedily itself (`tests.decoders.generate_verify`: Hugging
Face `generate` from the committed context every round, no cache kept between rounds) attends
its own tokens past the committed ones. Those are not drafts: the decoder is slower, not wrong,
and must pass on every built-in model. The controls: every planted bug of the catalog that
token preservation is the first to catch still fails it with its rule, and so does the same
`generate` verifier whose draft drafts from a stale context (its output right, its drafts not).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import pytest

from specaudit.checks import check_equivalence, check_i1, check_i2, check_token_preservation
from specaudit.contracts.case import Case
from specaudit.contracts.violation import Violation
from specaudit.reference.mutants import CATALOG
from specaudit.running.instrument import Recording
from specaudit.running.runner import Derived, oracle_continuation, run_case
from tests.decoders.generate_verify import GenerateVerify, GenerateVerifyStaleDraft

GENERATE_VERIFY = "tests.decoders.generate_verify:GenerateVerify"
MODELS = ("transparent", "llama", "qwen3", "gpt2")


def pattern(flags: str, length: int = 40) -> tuple[bool, ...]:
    """An accept pattern from a string of 0/1, repeated to `length`."""
    return tuple(flags[i % len(flags)] == "1" for i in range(length))


def lone_case(model: str) -> Case:
    """The audit's minimal false alarm: one row, every draft rejected (each round keeps the target's token)."""
    return Case(((0,),), (pattern("0"),), 2, 3, None, 0, model=model)


def ragged_case(model: str) -> Case:
    """Rows of different lengths that accept different counts each round, and a pad-valued prompt token."""
    return Case(((3, 1, 4), (6,), (0, 5)), (pattern("1101"), pattern("0"), pattern("011")), 3, 8, None, 0, model=model)


def eos_case(model: str) -> Case:
    """EOS inside an accepted block for row 0: `generate` pads the finished row while row 1 goes on."""
    prompts = ((3, 1, 4), (11,))
    eos = oracle_continuation(model, "float64", prompts[0], 3).tokens[2]
    return Case(prompts, (pattern("1"), pattern("10")), 4, 9, eos, 0, model=model)


CASES: dict[str, Callable[[str], Case]] = {"lone": lone_case, "ragged": ragged_case, "eos": eos_case}


def rendered(violations: list[Violation]) -> list[str]:
    return [v.render() for v in violations]


# ---------------------------------------------------------------------------------------
# A target that verifies with its own `generate`


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("model", MODELS)
def test_generate_verifier_keeps_every_scheduled_draft(model: str, name: str) -> None:
    """The target's own tokens past the committed ones are not drafts: a `generate` verifier passes."""
    case = CASES[name](model)
    run = run_case(GENERATE_VERIFY, case, factory=GenerateVerify)
    assert run.error is None, run.error
    assert [tuple(o) for o in run.outputs or []] == [o.tokens for o in run.oracle]
    assert rendered(check_token_preservation(run)) == []
    assert rendered(check_i1(run) + check_i2(run) + check_equivalence(run)) == []
    # the target decoded past the committed tokens itself: only `generate`'s own steps have a cache
    assert any(call.past_length > 0 for call in run.recording.target_calls)


def test_generate_verifier_with_a_stale_draft_fails() -> None:
    """The same verifier, its draft drafting without the newest token: the output is right, but
    the draft was asked after the committed sequence and got the scheduled drafts right, so the
    round verified them, and the next round re-feeds fewer tokens than were verified."""
    case = Case(((3, 1, 4),), (pattern("1"),), 3, 8, None, 0)
    run = run_case("tests.decoders.generate_verify:GenerateVerifyStaleDraft", case, factory=GenerateVerifyStaleDraft)
    assert run.error is None and rendered(check_equivalence(run)) == []
    found = check_token_preservation(run)
    assert found and found[0].rule == "verified-kept", rendered(found)
    first = found[0]
    assert first.evidence["accepted"] < first.evidence["scheduled"], first.render()
    assert first.found.startswith("a call without a cache re-feeding"), first.render()


# ---------------------------------------------------------------------------------------
# The planted bugs token preservation is the first to catch: each still fails with its rule


PLANTED: dict[str, tuple[Case, str]] = {
    "draft_cache_not_rolled_back": (
        Case(((3, 1, 4),), (pattern("1101111111"),), 2, 6, None, 0),
        "accepted-as-scheduled",
    ),
    "acceptance_one_short": (Case(((3, 1, 4),), (pattern("1"),), 2, 8, None, 0), "verified-kept"),
    "draft_without_mask": (
        Case(((3, 1, 4), (6,)), (pattern("1"), pattern("1")), 2, 6, None, 0),
        "accepted-as-scheduled",
    ),
    "crop_to_shortest": (Case(((3, 1, 4), (6,)), (pattern("1"), pattern("0")), 2, 6, None, 0), "verified-kept"),
}


def test_every_planted_preservation_bug_has_a_case() -> None:
    """Each catalog bug whose first check is token preservation is pinned below."""
    expected = {name for name, mutant in CATALOG.items() if mutant.bug.first_check == "token-preservation"}
    assert set(PLANTED) == expected


@pytest.mark.parametrize("name", list(PLANTED))
def test_planted_preservation_bug_still_fails(name: str) -> None:
    """An output-equivalent planted bug fails token preservation, and only it, with its rule."""
    case, rule = PLANTED[name]
    run = run_case(f"specaudit.reference.mutants:{name}", case)
    assert run.error is None, run.error
    assert rendered(check_equivalence(run)) == []
    found = check_token_preservation(run)
    assert found and found[0].rule == rule, rendered(found)


# ---------------------------------------------------------------------------------------
# The hint says which way the count is off


def test_a_lower_count_is_hinted_as_lower() -> None:
    """A draft that saw a rejected token makes fewer drafts accepted: the hint says lower."""
    case, _ = PLANTED["draft_cache_not_rolled_back"]
    first = check_token_preservation(run_case("specaudit.reference.mutants:draft_cache_not_rolled_back", case))[0]
    assert first.evidence["accepted"] < first.evidence["scheduled"]
    assert "a lower count means" in first.expected and "a higher count" not in first.expected


def test_a_higher_count_is_hinted_as_higher() -> None:
    """Without the draft's evidence the target's own tokens read as drafts, more than the
    schedule accepts: the hint then says higher, not lower."""
    run = run_case(GENERATE_VERIFY, lone_case("transparent"), factory=GenerateVerify)
    blind = [replace(call, proposals=None) for call in run.recording.draft_calls]
    recording = Recording(run.recording.target_calls, blind, run.recording.forwards, run.recording.unobserved)
    found = check_token_preservation(replace(run, recording=recording, derived=Derived()))
    first = next(v for v in found if v.rule == "accepted-as-scheduled")
    assert first.evidence["accepted"] > first.evidence["scheduled"], first.render()
    assert "a higher count means" in first.expected and "a lower count" not in first.expected


def test_direction_names_each_way() -> None:
    from specaudit.checks.preservation import direction

    assert direction(3, 1).startswith("a higher count") and direction(0, 2).startswith("a lower count")
