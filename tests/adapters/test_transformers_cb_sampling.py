"""transformers' continuous batching sampling (`do_sample=True`) in `make audit`: its item passes
on unpatched transformers, judged against the exact distribution, and a sampler at the wrong
temperature fails it."""

from __future__ import annotations

import pytest

from specaudit.adapters.transformers_cb.sampling import CB_SAMPLING, NEW_TOKENS, PER_PROMPT, PROMPTS, run_sampling
from specaudit.audits.subject import Item
from specaudit.audits.transformers_cb import MODEL, SAMPLING_SPEC, run_transformers_cb
from specaudit.checks.registry import PAGED
from tests.adapters.test_transformers_cb import needs_cb


@needs_cb
def test_sampled_continuous_batching_is_lossless_in_distribution() -> None:
    """Every request of `generate_batch` with do_sample runs to its limit and the pooled fit passes."""
    verdict = run_transformers_cb(Item(SAMPLING_SPEC, MODEL, False, 1, 0, kind="transformers-cb"))
    entry = verdict.report_entry()
    assert verdict.passed and verdict.as_expected, entry.get("verdict")
    assert entry["kind"] == PAGED and entry["subject"]["workload"] == "sampling" and "samples" not in entry
    assert entry["tokens"] == len(PROMPTS) * PER_PROMPT * NEW_TOKENS and entry["sampling"]["top_k"] == CB_SAMPLING.top_k
    assert not entry["flat"] and entry["fit"]["distance"] < entry["fit"]["bound"], entry["fit"]


@needs_cb
def test_a_sampler_at_twice_the_temperature_fails_the_fit(monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine's sampler drawing from its processed scores halved (temperature 2T): the tokens
    come from a flatter p than the target's, and the pooled fit rejects."""
    from transformers.generation.continuous_batching.model_runner import ModelRunner

    original = ModelRunner._sample
    monkeypatch.setattr(ModelRunner, "_sample", lambda self, scores, out: original(self, scores / 2, out))
    verdict = run_sampling(0)
    assert [v.rule for v in verdict.violations] == ["pooled-fit"], verdict.verdict
    assert verdict.fit.below < verdict.fit.at, "a hotter sampler should give too few of p's likelier tokens"
