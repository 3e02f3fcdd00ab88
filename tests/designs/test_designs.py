"""Decoders written here, built differently from the references, judged as any user's would be."""

from __future__ import annotations

import pytest

from specaudit.checks import registry
from specaudit.checks.i2 import check_i2
from specaudit.contracts.case import Case

RAGGED = dict(draft="scripted", dtype="float64", eos_token_id=None, pad_token_id=0, extra_pad_columns=0)


def ragged(model: str) -> Case:
    """Two rows whose first drafts are rejected in some rounds: split verification wastes call B there."""
    return Case(
        model=model, num_draft_tokens=3, max_new_tokens=9, prompts=((5, 6, 7), (9,)), accept=("0110", "1011"), **RAGGED
    )


def statuses(spec: str, case: Case) -> dict[str, str]:
    from specaudit.running.runner import run_case

    return dict(registry.evaluate(run_case(spec, case)).statuses)


@pytest.mark.parametrize("model", ["transparent", "llama"])
@pytest.mark.parametrize("cls", ["SplitVerify", "SplitVerifyUncached"])
def test_split_verification_passes(cls: str, model: str) -> None:
    """A verification split over two forwards, the second wasted after a known correction, passes
    every check: its wasted forward's logits choose no committed token."""
    found = statuses(f"tests.designs.split_verify:{cls}", ragged(model))
    failing = {check: status for check, status in found.items() if status == "fail"}
    assert not failing, f"{cls} on {model}: got {failing}, but should pass every check"


def test_split_verification_that_uses_the_wasted_forward_fails_i2() -> None:
    """The control: once the forward over a rejected draft chooses a committed token, its input at
    that position is an I2 'input-token' fault again."""
    from specaudit.running.runner import run_case

    run = run_case("tests.designs.split_verify:SplitVerifyKeepsWasted", ragged("transparent"))
    rules = {v.rule for v in check_i2(run)}
    assert "input-token" in rules, f"got I2 rules {rules}, but should report 'input-token' on the wasted forward"


def shared_prefixes(model: str) -> Case:
    """Three requests whose prompts share prefixes: a prefix cache crops into the next one's prompt."""
    return Case(
        model=model,
        num_draft_tokens=2,
        max_new_tokens=6,
        prompts=((5, 6, 7, 8), (5, 6, 7, 9), (5, 6)),
        accept=("0101", "1101", "0011"),
        **RAGGED,
    )


@pytest.mark.parametrize("model", ["transparent", "llama"])
@pytest.mark.parametrize("cls", ["prefix_reuse:PrefixReuse", "library_style:LibraryStyle"])
def test_prefix_reuse_and_library_style_pass(cls: str, model: str) -> None:
    """One cache carried across requests, cropped to the prefix the next prompt shares, passes
    every check; so does a decoder that refuses unknown model types and attention implementations."""
    found = statuses(f"tests.designs.{cls}", shared_prefixes(model))
    failing = {check: status for check, status in found.items() if status == "fail"}
    assert not failing, f"{cls} on {model}: got {failing}, but should pass every check"


def test_recomputed_verified_token_is_counted_without_negative_numbers() -> None:
    """A verified token cropped and recomputed is a token-preservation finding whose message counts
    what the cache holds: never 'a cache holding -1 generated tokens'."""
    from specaudit.checks.preservation import check_token_preservation
    from specaudit.running.runner import run_case

    run = run_case("tests.designs.prefix_reuse:PrefixReuseRecompute", shared_prefixes("transparent"))
    found = check_token_preservation(run)
    assert found and {v.rule for v in found} == {"verified-kept"}, [v.render() for v in found]
    for v in found:
        assert "-" not in v.found + v.expected.split(":")[0], f"got {v.found!r} / {v.expected!r}: a negative count"
        assert v.evidence["accepted"] >= 0, v.evidence


@pytest.mark.parametrize("model", ["transparent", "llama", "qwen3", "gpt2"])
def test_builtin_models_are_admitted_by_a_library(model: str) -> None:
    """Every built-in model, float64 included, passes a library's model_type and attention checks."""
    import torch

    from specaudit.fixtures.tiny import build_tiny
    from specaudit.fixtures.transparent import transparent_target
    from tests.designs.library_style import admit

    admit(transparent_target() if model == "transparent" else build_tiny(model, dtype=torch.float64))


def padded_rows(model: str) -> Case:
    """Two prompts of different lengths: the shorter row is left-padded in every recomputed round."""
    return Case(
        model=model,
        num_draft_tokens=3,
        max_new_tokens=9,
        prompts=((5, 6, 7, 8), (9, 10)),
        accept=("0110", "1011"),
        **RAGGED,
    )


@pytest.mark.parametrize("model", ["transparent", "llama", "qwen3", "gpt2"])
def test_layer_by_layer_runner_passes(model: str) -> None:
    """A runner that calls the embedding, each decoder layer, the norm and the LM head itself is
    observed below the model's forward and passes every check (the transparent model, which has no
    layers, it calls whole)."""
    from specaudit.running.runner import run_case

    run = run_case("tests.designs.layerwise:Layerwise", padded_rows(model))
    entries = {call.entry for call in run.recording.target_calls}
    assert entries == ({"model"} if model == "transparent" else {"layers"}), entries
    failing = {check: status for check, status in registry.evaluate(run).statuses if status != "pass"}
    assert set(failing) <= {"liveness"}, f"layerwise on {model}: got {failing}, but should pass every check"


@pytest.mark.parametrize("model", ["llama", "gpt2"])
def test_layer_by_layer_runner_with_shifted_positions_is_caught_at_its_slot(model: str) -> None:
    """The planted runner's left-padded row 1 feeds token 9 at position 2 (its two pad columns
    counted) in the first forward: I2 names call 0, row 1, slot 2."""
    from specaudit.running.runner import run_case

    run = run_case("tests.designs.layerwise:LayerwiseUnpaddedPositions", padded_rows(model))
    first = check_i2(run)[0]
    assert (first.rule, first.call, first.row, first.slot) == ("position-ids", 0, 1, 2), first.render()
    assert (first.evidence["found_position"], first.evidence["expected_position"]) == (2, 0), first.evidence


def test_a_run_with_no_observed_target_call_is_no_i2_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the layer hooks (the harness before issue 38 item 4) the runner's forwards go unseen:
    I1 fails 'target-called', and I2, which saw nothing, is not applicable rather than a pass."""
    import specaudit.running.instrument as instrument
    from specaudit.running.runner import run_case

    monkeypatch.setattr(instrument, "model_parts", lambda model, base: None)
    run = run_case("tests.designs.layerwise:Layerwise", padded_rows("llama"))
    statuses = dict(registry.evaluate(run).statuses)
    assert (statuses["I1"], statuses["I2"]) == ("fail", "not applicable"), statuses
