"""The sampling decoders: the correct designs are lossless (a loose goodness-of-fit test on the exact p), every
design and planted sampling bug keeps the contract, and the same test rejects planted bugs (it can fail)."""

from __future__ import annotations

import functools
import math
from typing import Any

import pytest
import torch
from transformers import DynamicCache

from specaudit.contracts.sampling import Sampling, target_distribution
from specaudit.fixtures.sampling import mixture_draft
from specaudit.fixtures.transparent import read_slots, transparent_target
from specaudit.models.compat import cache_layers, call_model, output_cache
from specaudit.reference.planted.sampling import BonusFromDraft, SamplingBug
from specaudit.reference.sampling import (
    EqualitySpec,
    GumbelSpec,
    PerRowSampling,
    RecomputeSampling,
    SpecSampling,
)
from specaudit.reference.sampling_mutants import CATALOG, bonus_mixture

DESIGNS = [SpecSampling, PerRowSampling, GumbelSpec, EqualitySpec, RecomputeSampling]
EVERY = DESIGNS + list(CATALOG.values())
PROMPTS = [[5, 17, 42, 9], [3, 3], [0, 88, 1], [64]]  # ragged: left pads; token 0 (the pad id) once as a real token
SETTINGS = Sampling(0.8, top_k=20)

# The goodness-of-fit test: 512 one-prompt rows (independent samples), K = 2, 4 tokens each. Temperature 1.5 and
# top-k 5 make a missing residual visible (resample_from_p shifts the pooled PIT by ~0.1, twice the bound).
FIT_ROWS, FIT_K, FIT_TOKENS, FIT_ALPHA = 512, 2, 4, 1e-4
FIT_SETTINGS = Sampling(1.5, top_k=5)
FIT_PROMPT = [5, 17, 42, 9]


def batch(prompts: list[list[int]], pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded input_ids and attention_mask [B, T]."""
    width = max(map(len, prompts))
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask


def generate(
    cls: type,
    prompts: list[list[int]],
    seed: int,
    *,
    k: int = 3,
    max_new_tokens: int = 12,
    eos_token_id: int | None = None,
    sampling: Sampling = SETTINGS,
    target: torch.nn.Module | None = None,
) -> list[list[int]]:
    ids, mask = batch(prompts)
    return cls().generate(
        target if target is not None else transparent_target(), mixture_draft(0.5), ids, mask,
        num_draft_tokens=k, max_new_tokens=max_new_tokens, eos_token_id=eos_token_id, pad_token_id=0,
        generator=torch.Generator().manual_seed(seed), **sampling.keywords(),
    )  # fmt: skip


def ids_of(classes: list[type]) -> list[str]:
    return [cls.name for cls in classes]


# ---------------------------------------------------------------------------------------
# The contract


@pytest.mark.parametrize("cls", EVERY, ids=ids_of(EVERY))
def test_outputs_keep_the_contract(cls: type) -> None:
    """Every design and planted bug returns one list per row, at most max_new_tokens long, ending at the first EOS."""
    free = generate(cls, PROMPTS, seed=1)
    assert [len(out) for out in free] == [12] * len(PROMPTS), free
    eos = free[0][0]  # the first token is drawn before EOS matters: row 0 now stops at once
    stopped = generate(cls, PROMPTS, seed=1, eos_token_id=eos)
    assert len(stopped) == len(PROMPTS) and stopped[0] == [eos], stopped
    for out in stopped:
        assert 1 <= len(out) <= 12 and all(isinstance(t, int) and 0 <= t < 128 for t in out), out
        assert eos not in out[:-1] and (out[-1] == eos or len(out) == 12), out


@pytest.mark.parametrize("cls", EVERY, ids=ids_of(EVERY))
def test_a_seed_replays_and_seeds_differ(cls: type) -> None:
    """One generator seed gives one output, whatever the global RNG; another seed gives another."""
    torch.manual_seed(0)
    state = torch.get_rng_state()
    first = generate(cls, PROMPTS, seed=7)
    assert torch.equal(torch.get_rng_state(), state), "generate drew from the global RNG"
    torch.manual_seed(1)
    assert generate(cls, PROMPTS, seed=7) == first
    assert generate(cls, PROMPTS, seed=8) != first


def committed_prefix_violations(calls: list[dict[str, Any]], sequences: list[list[int]], k: int) -> list[str]:
    """Each row of each target call attends its slots at positions 0, 1, 2, ... and, but for the last K (drafts),
    a prefix of some row's prompt + output: its own committed tokens, no pad, no stale draft."""
    found = []
    for index, call in enumerate(calls):
        for b in range(call["mask"].shape[0]):
            seen = call["mask"][b].bool()
            tokens, positions = call["tokens"][b][seen].tolist(), call["positions"][b][seen].tolist()
            if positions != list(range(len(tokens))):
                found.append(f"call {index} row {b}: positions {positions}")
            head = tokens[: max(len(tokens) - k, 0)]
            if not any(seq[: len(head)] == head for seq in sequences):
                found.append(f"call {index} row {b}: attends {tokens}, not a committed prefix")
    return found


def attention_violations(cls: type) -> list[str]:
    """`committed_prefix_violations` of one run of `cls` on PROMPTS, every target forward recorded by a hook."""
    target, calls = transparent_target(), []

    def record(module: Any, args: Any, kwargs: dict[str, Any], output: Any) -> None:
        tokens, positions = read_slots(cache_layers(output_cache(output))[0][0])  # [B, S] each
        calls.append({"mask": kwargs["attention_mask"].clone(), "tokens": tokens.clone(), "positions": positions})

    handle = target.register_forward_hook(record, with_kwargs=True)
    try:
        outputs = generate(cls, PROMPTS, seed=3, target=target)
    finally:
        handle.remove()
    assert len(calls) >= 2
    return committed_prefix_violations(calls, [p + o for p, o in zip(PROMPTS, outputs)], k=3)


@pytest.mark.parametrize("cls", DESIGNS, ids=ids_of(DESIGNS))
def test_every_target_forward_attends_committed_tokens(cls: type) -> None:
    """Every target forward's rows attend their own prompt and committed tokens at positions 0, 1, 2, ... (I2)."""
    assert not attention_violations(cls)


class VerifyOneLate(SpecSampling):
    """Negative control: the verify call one position late."""

    def positions(self, state: Any, mask: torch.Tensor, width: int, role: str) -> torch.Tensor | None:
        return mask.sum(1, keepdim=True) + torch.arange(width) + (role == "target")


class RejectedKept(SpecSampling):
    """Negative control: rejected drafts kept in both caches."""

    def realign(self, state: Any, accepted: torch.Tensor, bonus: torch.Tensor, k: int, finished: torch.Tensor) -> Any:
        return super().realign(state, torch.full_like(accepted, k), bonus, k, finished)


@pytest.mark.parametrize("cls", [VerifyOneLate, RejectedKept], ids=["verify_one_late", "rejected_kept"])
def test_attention_check_fails_on_a_broken_cache(cls: type) -> None:
    """The attention check above reports a wrong position or a stale draft."""
    assert attention_violations(cls)


# ---------------------------------------------------------------------------------------
# Lossless in distribution: a randomized PIT, pooled, against a DKW bound


def exact_probs(prompt: list[int], outputs: list[list[int]], sampling: Sampling) -> tuple[torch.Tensor, torch.Tensor]:
    """p of every emitted token given its row's own prefix (teacher-forced, batch size 1): P [N, V], tokens [N]."""
    target, memo, probs = transparent_target(), {}, []
    with torch.no_grad():
        for out in outputs:
            if tuple(out) not in memo:
                ids = torch.tensor([prompt + out[:-1]])
                logits, _ = call_model(target, ids, torch.ones_like(ids), torch.arange(ids.shape[1])[None],
                                       DynamicCache())  # fmt: skip
                memo[tuple(out)] = target_distribution(logits[0, len(prompt) - 1 :], sampling)  # [n, V]
            probs.append(memo[tuple(out)])
    return torch.cat(probs), torch.tensor([t for out in outputs for t in out])


def randomized_pit(p: torch.Tensor, tokens: torch.Tensor, seed: int = 0) -> torch.Tensor:
    """u = P(X before x) + U p(x), tokens ordered by decreasing p: exactly U(0, 1) for x ~ p. [N]"""
    values, order = p.sort(dim=-1, descending=True, stable=True)  # [N, V]
    rank = order.argsort(dim=-1).gather(-1, tokens[:, None])  # [N, 1]
    before = (values.cumsum(-1) - values).gather(-1, rank)[:, 0]
    noise = torch.rand(tokens.numel(), generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return before + noise * p.gather(-1, tokens[:, None])[:, 0]


def fit_verdict(cls: type, seed: int = 0) -> tuple[float, float, int]:
    """(sup |F_n - F| of the pooled PIT, its DKW bound at FIT_ALPHA, emitted tokens with p = 0)."""
    outputs = generate(cls, [FIT_PROMPT] * FIT_ROWS, seed, k=FIT_K, max_new_tokens=FIT_TOKENS, sampling=FIT_SETTINGS)
    p, tokens = exact_probs(FIT_PROMPT, outputs, FIT_SETTINGS)
    u = randomized_pit(p, tokens).sort().values
    n = u.numel()
    i = torch.arange(1, n + 1, dtype=torch.float64)
    distance = max(float((i / n - u).max()), float((u - (i - 1) / n).max()))
    bound = math.sqrt(math.log(2 / FIT_ALPHA) / (2 * n))
    return distance, bound, int((p.gather(-1, tokens[:, None]) == 0).sum())


@pytest.mark.parametrize("cls", DESIGNS, ids=ids_of(DESIGNS))
def test_correct_design_is_lossless(cls: type) -> None:
    """A correct design's tokens fit the target's exact p (pooled PIT within the DKW bound, no p = 0 token)."""
    distance, bound, impossible = fit_verdict(cls)
    assert impossible == 0, f"{impossible} emitted tokens have p = 0"
    assert distance <= bound, f"sup |F_n - F| = {distance:.4f} > {bound:.4f} (alpha {FIT_ALPHA})"


@pytest.mark.parametrize("name", ["sampled_bonus_from_draft", "resample_from_p", "acceptance_inverted"])
def test_fit_rejects_a_planted_bug(name: str) -> None:
    """The same test rejects a planted sampling bug: a p = 0 token, or the PIT outside the bound."""
    distance, bound, impossible = fit_verdict(CATALOG[name])
    assert impossible > 0 or distance > bound, (distance, bound)


# ---------------------------------------------------------------------------------------
# The catalog


def test_catalog_entries_describe_themselves() -> None:
    """Every planted sampling bug is a named, documented SpecSampling subclass with a well-formed SamplingBug."""
    assert len(CATALOG) >= 12
    for key, cls in CATALOG.items():
        assert issubclass(cls, SpecSampling) and cls.samples is True and cls.__doc__
        assert key == cls.name or (key == "bonus_mixture" and cls.name == "bonus_mixture_0.5")
        bug = cls.bug
        assert isinstance(bug, SamplingBug) and bug.description and bug.seen_in in ("public trackers", "—")
        assert bug.role in ("plain", "draft", "bonus") and bug.check in ("distribution", "row-independence")


@pytest.mark.parametrize("name", sorted(CATALOG), ids=sorted(CATALOG))
def test_needs_batch_means_invisible_alone(name: str) -> None:
    """A bug that needs a batch emits exactly SpecSampling's tokens for one row; every other bug differs there."""
    cls = CATALOG[name]
    alone = ((prompt, seed) for seed in range(2) for prompt in PROMPTS[:2])
    same = all(generate(cls, [prompt], seed, k=1) == reference_alone(tuple(prompt), seed) for prompt, seed in alone)
    assert same == cls.bug.needs_batch


@functools.cache
def reference_alone(prompt: tuple[int, ...], seed: int) -> list[list[int]]:
    """SpecSampling on one row, K = 1 (bonus tokens common), computed once per worker."""
    return generate(SpecSampling, [list(prompt)], seed, k=1)


def test_bonus_mixture_dial_ends() -> None:
    """The dial's ends are the correct decoder (e = 0) and the bonus-from-draft bug (e = 1), draw for draw."""
    assert bonus_mixture(0.25).name == "bonus_mixture_0.25" and bonus_mixture(0.25) is bonus_mixture(0.25)
    assert CATALOG["bonus_mixture"] is bonus_mixture(0.5)
    assert generate(bonus_mixture(0.0), PROMPTS, seed=5) == generate(SpecSampling, PROMPTS, seed=5)
    assert generate(bonus_mixture(1.0), PROMPTS, seed=5) == generate(BonusFromDraft, PROMPTS, seed=5)
