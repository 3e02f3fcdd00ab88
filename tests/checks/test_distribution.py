"""Lossless in distribution: the target distribution's definition, the fit and its stated rates, token
roles, the sampling checks' negative controls, and the invariants judged on every sampled forward."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest
import torch
from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from specaudit.checks.distribution import TEST_ALPHA, fits, sampled_tokens
from specaudit.checks.registry import FAIL, PASS, SAMPLER, check_named, evaluate
from specaudit.contracts.case import Case
from specaudit.contracts.sampling import Sampling, SamplingCase, target_distribution
from specaudit.numerics.fit import collision_evalue, detectable_shift, ks_fit, randomized_pit, threshold
from specaudit.reference.plain_sampling import PlainSampling
from specaudit.reference.sampling import SpecSampling
from specaudit.running.sampling import run_sampling_case

SPEC = "specaudit.reference.sampling:SpecSampling"
PLAIN = "specaudit.reference.plain_sampling:PlainSampling"
MUTANTS = "specaudit.reference.sampling_mutants"
HERE = "tests.checks.test_distribution"


def sampling_case(
    prompts: tuple[tuple[int, ...], ...], sampling: Sampling, *, k: int = 2, tokens: int = 12, runs: int = 4,
    disagree: float = 0.5, seed: int = 3, eos: int | None = None,
) -> SamplingCase:  # fmt: skip
    case = Case(prompts, tuple(() for _ in prompts), k, tokens, eos, 0, model="transparent", draft="mixture")
    return SamplingCase(case, sampling, disagree, runs, seed)


MANY_OF_ONE = sampling_case(((5, 6, 7),) * 8, Sampling(0.7, top_k=20))
RAGGED = sampling_case(((5, 6, 7), (9,), (5, 6, 7), (9,), (11, 12), (11, 12)), Sampling(1.0, top_p=0.9))


# ---------------------------------------------------------------------------------------
# The target distribution: Hugging Face's processors, in their order


@pytest.mark.parametrize("sampling", [Sampling(0.7), Sampling(1.3, top_k=7), Sampling(0.5, top_p=0.8),
                                      Sampling(0.9, top_k=30, top_p=0.6)])  # fmt: skip
def test_target_distribution_is_hugging_faces_on_tie_free_logits(sampling: Sampling) -> None:
    logits = torch.randn(4, 128, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * 3
    scores = TemperatureLogitsWarper(sampling.temperature)(None, logits.clone())
    if sampling.top_k:
        scores = TopKLogitsWarper(sampling.top_k)(None, scores)
    if sampling.top_p is not None:
        scores = TopPLogitsWarper(sampling.top_p)(None, scores)
    assert torch.allclose(target_distribution(logits, sampling), torch.softmax(scores, -1), atol=1e-12)


def test_ties_at_a_boundary_are_kept_whole_and_one_token_always_survives() -> None:
    logits = torch.tensor([[3.0, 2.0, 2.0, 1.0, 0.0]], dtype=torch.float64)
    assert (target_distribution(logits, Sampling(1.0, top_k=2)) > 0).tolist() == [[True, True, True, False, False]]
    p = target_distribution(logits, Sampling(1.0, top_p=0.5))  # the top token holds ~0.5: the tie after it stays out
    assert (p > 0).sum() in (1, 3) and p[0, 0] > 0
    assert (target_distribution(logits, Sampling(1.0, top_p=1e-9)) > 0).sum() == 1


def test_sampling_settings_are_validated() -> None:
    for bad in (dict(temperature=0.0), dict(top_k=-1), dict(top_p=0.0), dict(top_p=1.5)):
        with pytest.raises(ValueError):
            Sampling(**bad)  # type: ignore[arg-type]


def test_sampling_case_round_trips_through_json() -> None:
    assert SamplingCase.from_json(RAGGED.to_json()) == RAGGED
    assert len({RAGGED.run_seed(i) for i in range(RAGGED.runs)}) == RAGGED.runs


# ---------------------------------------------------------------------------------------
# The fit: exact under the null, its stated rates, and power


def test_randomized_pit_of_exact_samples_is_uniform_and_a_shift_is_seen() -> None:
    g = torch.Generator().manual_seed(1)
    probs = torch.softmax(torch.randn(4000, 50, generator=g, dtype=torch.float64) * 2, -1)  # [n, V]
    exact = torch.multinomial(probs, 1, generator=g)[:, 0]
    u = torch.rand(4000, generator=g, dtype=torch.float64)
    assert not ks_fit(randomized_pit(probs, exact, u), 1e-6).rejects
    sharper = torch.multinomial(torch.softmax(torch.log(probs) * 1.5, -1), 1, generator=g)[:, 0]
    fit = ks_fit(randomized_pit(probs, sharper, u), 1e-6)
    assert fit.rejects and fit.direction == "too many of p's likelier tokens"


def test_the_stated_bounds() -> None:
    assert threshold(1000, 1e-6) == pytest.approx(math.sqrt(math.log(2e6) / 2000))
    assert detectable_shift(1000, 1e-6) == pytest.approx(threshold(1000, 1e-6) + threshold(1000, 0.05))
    assert not ks_fit([], 1e-6).rejects and math.isinf(ks_fit([], 1e-6).bound)
    fit = ks_fit(np.linspace(0.5, 1, 100, endpoint=False), 0.01)  # every value in the upper half
    assert fit.distance == pytest.approx(0.5) and fit.rejects


def test_false_alarms_stay_under_the_stated_rate_on_exact_uniforms() -> None:
    """At a larger alpha, where a rate can be seen: 400 samples of 200 uniforms rejected at most at
    rate alpha (DKW-Massart is nearly tight there), within three binomial standard deviations."""
    g = np.random.default_rng(7)
    rejections = sum(ks_fit(g.random(200), 0.05).rejects for _ in range(400))
    assert rejections <= 0.05 * 400 + 3 * math.sqrt(400 * 0.05 * 0.95)
    assert sum(ks_fit(g.random(200), 1e-3).rejects for _ in range(400)) <= 2


def test_collisions_of_independent_rows_stay_small_and_copies_do_not() -> None:
    g = np.random.default_rng(3)
    chances = [0.2] * 300
    independent = collision_evalue(list(g.random(300) < 0.2), chances)
    assert independent < 1 / TEST_ALPHA
    assert collision_evalue([True] * 60, [0.2] * 60) > 1 / TEST_ALPHA


# ---------------------------------------------------------------------------------------
# Roles and the correct designs


def test_roles_of_a_speculative_run_name_drafts_bonuses_and_plain_steps() -> None:
    tokens = sampled_tokens(run_sampling_case(SPEC, RAGGED))
    roles = {(t.role.role, t.role.slot) for t in tokens}
    assert ("plain", 0) in roles and ("draft", 0) in roles and ("draft", 1) in roles and ("bonus", 2) in roles
    assert all(t.role.role != "unknown" for t in tokens)
    accepted = [t for t in tokens if t.role.role == "draft" and t.role.accepted]
    assert accepted and len(accepted) < sum(t.role.role == "draft" for t in tokens)


def test_a_decoder_without_drafts_has_only_plain_steps() -> None:
    assert {t.role.role for t in sampled_tokens(run_sampling_case(PLAIN, RAGGED))} == {"plain"}


@pytest.mark.parametrize("design", ["SpecSampling", "PerRowSampling", "GumbelSpec", "EqualitySpec",
                                    "RecomputeSampling"])  # fmt: skip
def test_every_correct_design_passes_every_sampling_check(design: str) -> None:
    for scase in (MANY_OF_ONE, RAGGED):
        evaluation = evaluate(SAMPLER, run_sampling_case(f"specaudit.reference.sampling:{design}", scase))
        assert evaluation.passed, evaluation.violations
        assert dict(evaluation.statuses)["distribution"] == PASS


def test_a_sampled_verdict_is_deterministic_for_its_seed() -> None:
    first, second = (run_sampling_case(SPEC, RAGGED) for _ in range(2))
    assert [r.outputs for r in first.runs] == [r.outputs for r in second.runs]
    assert [t.u for t in sampled_tokens(first)] == [t.u for t in sampled_tokens(second)]
    other = run_sampling_case(SPEC, replace(RAGGED, seed=4))
    assert [r.outputs for r in other.runs] != [r.outputs for r in first.runs]


def test_power_is_stated_per_role() -> None:
    tested = fits(run_sampling_case(SPEC, MANY_OF_ONE))
    assert tested["all"].n == sum(tested[role].n for role in ("plain", "draft", "bonus"))
    assert tested["all"].shift < tested["bonus"].shift


# ---------------------------------------------------------------------------------------
# Negative controls: each sampling check fails on a planted bug the reference passes


def test_the_distribution_check_catches_a_bonus_from_the_draft_with_its_role() -> None:
    scase = sampling_case(((5, 6, 7),) * 8, Sampling(0.4), k=1, tokens=16, runs=6, disagree=0.8)
    evaluation = evaluate(SAMPLER, run_sampling_case(f"{MUTANTS}:sampled_bonus_from_draft", scase))
    assert evaluation.outcome("distribution").status == FAIL
    first = evaluation.outcome("distribution").violations[0]
    assert first.rule in ("role-fit", "impossible-token")
    assert first.evidence.get("role", first.evidence.get("token_role")) == "bonus", first.render()
    assert check_named("distribution").signature(first, None)[0] == "sampling"
    assert evaluate(SAMPLER, run_sampling_case(SPEC, scase)).passed


def test_a_token_outside_top_k_is_impossible() -> None:
    scase = sampling_case(((5, 6, 7),) * 2, Sampling(1.0, top_k=3), runs=2)
    evaluation = evaluate(SAMPLER, run_sampling_case(f"{HERE}:WithoutTopK", scase))
    assert [v.rule for v in evaluation.outcome("distribution").violations][0] == "impossible-token"


def test_the_independence_check_catches_rows_that_share_their_uniforms() -> None:
    evaluation = evaluate(SAMPLER, run_sampling_case(f"{MUTANTS}:shared_uniforms", MANY_OF_ONE))
    assert evaluation.outcome("row-independence").status == FAIL
    assert evaluation.outcome("row-independence").violations[0].rule == "rows-correlated"
    assert evaluation.outcome("row-independence").status == FAIL
    assert evaluate(SAMPLER, run_sampling_case(SPEC, MANY_OF_ONE)).outcome("row-independence").status == PASS


def test_independence_is_not_applicable_without_two_rows_of_one_prompt() -> None:
    scase = sampling_case(((5, 6, 7), (9,)), Sampling(1.0))
    assert evaluate(SAMPLER, run_sampling_case(SPEC, scase)).outcome("row-independence").status == "not applicable"


def test_a_row_that_stops_early_is_caught() -> None:
    evaluation = evaluate(SAMPLER, run_sampling_case(f"{HERE}:StopsEarly", RAGGED))
    assert "stops-early" in [v.rule for v in evaluation.outcome("distribution").violations]


def test_i2_judges_every_forward_of_a_sampled_run() -> None:
    evaluation = evaluate(SAMPLER, run_sampling_case(f"{HERE}:VerifyOffByOne", RAGGED))
    i2 = evaluation.outcome("I2")
    assert i2.status == FAIL and "run" in i2.violations[0].evidence and i2.violations[0].found.startswith("run 0:")


class WithoutTopK(PlainSampling):
    """Samples from the target without top-k: tokens outside p's support come out."""

    def generate(self, *args: object, top_k: int | None = None, **kwargs: object) -> list[list[int]]:
        return super().generate(*args, **kwargs)  # type: ignore[arg-type]


class StopsEarly(PlainSampling):
    def generate(self, *args: object, max_new_tokens: int, **kwargs: object) -> list[list[int]]:
        out = super().generate(*args, max_new_tokens=max_new_tokens, **kwargs)  # type: ignore[arg-type]
        return [row[:-1] if len(row) > 1 else row for row in out]


class VerifyOffByOne(SpecSampling):
    """The verify call's positions one past where they belong (a greedy bug, under sampling)."""

    def positions(self, state: object, mask: torch.Tensor, width: int, role: str) -> torch.Tensor:
        shift = 1 if role == "target" else 0
        return mask.sum(1, keepdim=True) + shift + torch.arange(width)
