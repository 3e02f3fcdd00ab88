"""I2 on real models with a measured noise floor, and its reference K/V from the oracle's own cache.

With `Run.noise` set, a past slot is judged by which entry it holds: within KV_NOISE_MULTIPLE x
the floor's kv_max of its expected batch-size-1 entry, and nearer to it than to the
alternatives a bug would put there. The reference entries come from the oracle's kept cache
for rows that match the oracle, so those rows cost no batch-size-1 forward.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
import torch

from specaudit.adapters.realmodel import run_real
from specaudit.checks import check_i2
from specaudit.checks.kv import KV_NOISE_MULTIPLE, flat_cache
from specaudit.checks.rows import follow_rows
from specaudit.contracts.case import Case
from specaudit.models.compat import cache_layers
from specaudit.models.loading import load_pair, save_tiny_pair
from specaudit.numerics.calibration import NoiseFloor
from specaudit.reference.eqspec import EqSpec
from specaudit.reference.oracle import greedy_oracle, kv_rows, reference_kv
from specaudit.running.runner import Derived, Run, run_case
from specaudit.search.strategies import pattern_from_rounds

EQSPEC = "specaudit.reference.eqspec:EqSpec"
PROMPTS = ["Hello world", "The quick brown fox", "abc", "zz top x"]
NOISE = 1e-3  # the K/V perturbation of `NoisyEqSpec`: far above float64's fixed tolerance (1e-9)


def floor(kv_max: float) -> NoiseFloor:
    """A noise floor with this K/V maximum (the logit fields do not matter to I2)."""
    return NoiseFloor(
        model="tiny", dtype="float64", device="cpu", steps=1, logit_p50=0.0, logit_p99=0.0, logit_max=0.0,
        kv_p99=kv_max, kv_max=kv_max, kv_scale=1.0, margin_p50=1.0,
    )  # fmt: skip


def pattern(flags: str, length: int = 40) -> tuple[bool, ...]:
    return tuple(flags[i % len(flags)] == "1" for i in range(length))


class NoisyEqSpec(EqSpec):
    """EQSPEC whose target cache picks up bounded noise after the prefill, as batched low-precision
    arithmetic would: every prompt entry moves by up to NOISE. A correct decoder, numerically."""

    def prefill(self, target: Any, draft: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> Any:
        state, first = super().prefill(target, draft, input_ids, attention_mask)
        gen = torch.Generator().manual_seed(0)
        for k, v in cache_layers(state.target_cache):
            for x in (k, v):
                x.add_((torch.rand(x.shape, generator=gen, dtype=x.dtype) * 2 - 1) * NOISE)
        return state, first


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory):
    return load_pair(*save_tiny_pair(tmp_path_factory.mktemp("tiny-llama")))


def noisy(run: Run, kv_max: float) -> Run:
    """The same run judged against a noise floor (nothing memoized from an earlier judgement)."""
    return replace(run, noise=floor(kv_max), derived=Derived())


# ---------------------------------------------------------------------------------------
# The noise floor


def test_noise_within_the_floor_passes_where_the_fixed_tolerance_fails() -> None:
    """K/V moved by measured-size noise pass I2 with the floor set, and fail the fixed float64 tolerance."""
    case = Case(((3, 1, 4, 1, 5), (9, 2, 6)), (pattern("10"), pattern("1")), 3, 8, None, 0, model="llama")
    run = run_case("tests:NoisyEqSpec", case, factory=NoisyEqSpec)
    assert run.error is None, run.error
    fixed = check_i2(run)
    assert fixed and fixed[0].rule == "attends-wrong-slot", [v.render() for v in fixed]
    assert "beyond the dtype's fixed tolerance" in fixed[0].found and fixed[0].evidence["kv_bound"] is None
    judged = check_i2(noisy(run, NOISE))
    assert judged == [], [v.render() for v in judged]


@pytest.mark.parametrize("name", ["rejected_kv_attended", "cache_rows_permuted"])
def test_planted_kv_drift_is_caught_with_the_floor_set(name: str) -> None:
    """A planted KV-drift bug still fails I2 against a noise floor, and the evidence names the margin."""
    case = Case(((5,), (7, 8, 9)), (pattern("1"), pattern("0")), 2, 6, None, 0, model="llama")
    run = run_case(f"specaudit.reference.mutants:{name}", case)
    found = check_i2(noisy(run, NOISE))
    drift = [v for v in found if v.rule == "attends-wrong-slot"]  # cache_rows_permuted shows an input-token first
    assert drift, f"{name}: got {[v.render() for v in found]}"
    evidence = drift[0].evidence
    assert evidence["kv_bound"] == pytest.approx(KV_NOISE_MULTIPLE * NOISE)
    assert evidence["kv_distance"] > evidence["kv_bound"], evidence
    assert evidence["nearest_alternative"] is not None and evidence["nearest_distance"] is not None, evidence
    assert "beyond the noise bound" in drift[0].found and "nearest alternative: " in drift[0].found
    if name == "cache_rows_permuted":  # the row holds the other request's cache: that is the nearest entry
        assert evidence["nearest_request"] not in (None, drift[0].request), evidence
        assert evidence["nearest_distance"] <= evidence["kv_bound"], evidence


def test_a_slot_nearer_to_another_requests_entry_fails_within_the_bound() -> None:
    """A slot within the noise bound of its expected entry but nearer to another request's entry
    fails on the margin, naming that request."""
    case = Case(((5, 6, 7), (8, 9, 10)), (pattern("1"), pattern("1")), 2, 4, None, 0, model="llama")
    run = run_case(EQSPEC, case)
    views = [v for v in follow_rows(run).views if v.past >= 3]
    mine = next(v for v in views if v.request == 0)
    theirs = next(v for v in views if v.request == 1 and v.call == mine.call)
    call = run.recording.target_calls[mine.call]
    index = 2  # the prompts differ from index 0: the entries at index 2 are distinct
    slot, other = mine.slots[index], theirs.slots[index]
    flat = flat_cache(call.cache_after, torch.float64)
    spread = float((flat[mine.row, slot] - flat[theirs.row, other]).abs().max())
    for k, v in call.cache_after:  # 45% expected, 55% the other request's: within 0.55 spread, nearer to theirs
        for x in (k, v):
            x[mine.row, :, slot] = 0.45 * x[mine.row, :, slot] + 0.55 * x[theirs.row, :, other]
    bound = 0.75 * spread  # the other entry is 1.33 bounds away: it competes
    (first, *_) = check_i2(noisy(run, bound / KV_NOISE_MULTIPLE))
    assert (first.rule, first.call, first.row, first.slot) == ("attends-wrong-slot", mine.call, mine.row, slot)
    evidence = first.evidence
    assert evidence["kv_distance"] == pytest.approx(0.55 * spread, rel=1e-6) and evidence["kv_distance"] <= bound
    assert evidence["nearest_request"] == 1 and evidence["nearest_distance"] == pytest.approx(0.45 * spread, rel=1e-6)
    assert "within the noise bound" in first.found and "request 1's entry at position 2" in first.found


# ---------------------------------------------------------------------------------------
# The reference from the oracle's own cache


def test_oracle_keeps_its_cache_as_the_reference_kv(pair) -> None:
    """The kept cache holds the batch-size-1 entries of prompt + tokens; the result compares as before."""
    target = pair[0]
    prompt = (5, 17, 3, 99)
    kept = greedy_oracle(target, prompt, max_new_tokens=5, eos_token_id=None, keep_kv=True)
    plain = greedy_oracle(target, prompt, max_new_tokens=5, eos_token_id=None)
    assert kept == plain and hash(kept) == hash(plain) and "kv" not in repr(kept)
    assert kept.kv is not None and plain.kv is None
    rerun = reference_kv(target, prompt + kept.tokens)
    assert kept.kv.shape == (len(prompt) + 5, kv_rows(rerun).shape[1])
    torch.testing.assert_close(kept.kv, kv_rows(rerun), rtol=1e-9, atol=1e-9)


class Forwards:
    """Counts the target's forwards while the checks run."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.count = 0
        self.handle = model.register_forward_pre_hook(self.pre)

    def pre(self, *_: Any) -> None:
        self.count += 1


def verdicts(run: Run) -> list[tuple[Any, ...]]:
    return [(v.rule, v.call, v.row, v.slot, v.request) for v in check_i2(run)]


@pytest.mark.parametrize("decoder", [EQSPEC, "specaudit.reference.mutants:rejected_kv_attended"])
def test_oracle_cache_reference_gives_the_rerun_verdicts(pair, decoder: str) -> None:
    """I2 from the oracle's kept cache gives the verdicts of the batch-size-1 re-run reference,
    and rows that match the oracle cost no batch-size-1 forward."""
    target, draft, tokenizer = pair
    (run,) = run_real(
        decoder, target, draft, tokenizer, PROMPTS, batch_size=4, num_draft_tokens=3, max_new_tokens=8,
        sample_rate=1.0, baseline=False,
    )  # fmt: skip
    assert all(o.kv is not None for o in run.oracle)
    matching = sum(list(o.tokens) == out for o, out in zip(run.oracle, run.outputs or []))
    old = replace(run, oracle=[replace(o, kv=None) for o in run.oracle], derived=Derived())
    counter = Forwards(run.target)
    try:
        kept = verdicts(run)
        spent_kept = counter.count
        counter.count = 0
        rerun = verdicts(old)
        spent_rerun = counter.count
    finally:
        counter.handle.remove()
    assert kept == rerun
    assert spent_rerun >= len(PROMPTS)  # the old path: one batch-size-1 forward per row sequence
    if decoder == EQSPEC:
        assert matching == len(PROMPTS) and kept == [] and spent_kept == 0
    else:
        assert kept and spent_kept <= 1 + len(PROMPTS) - matching  # the pad's entry, diverged rows


def test_run_real_passes_the_noise_floor_to_every_run(pair) -> None:
    """`run_real(noise=...)` sets it on each batch's run and on its batch-size-1 re-runs; so does a
    floor set on the run afterwards."""
    target, draft, tokenizer = pair
    runs = run_real(
        EQSPEC, target, draft, tokenizer, PROMPTS[:3], batch_size=2, num_draft_tokens=3, max_new_tokens=6,
        sample_rate=1.0, baseline=False, noise=floor(NOISE),
    )  # fmt: skip
    assert len(runs) == 2 and all(r.noise == floor(NOISE) for r in runs)
    alone = replace(runs[0].case, prompts=runs[0].case.prompts[:1], accept=runs[0].case.accept[:1])
    again = runs[0].rerun(alone)
    assert again.noise == floor(NOISE) and check_i2(again) == []
    runs[1].noise = floor(2 * NOISE)  # a floor set on the run afterwards reaches its re-runs too
    assert runs[1].rerun(alone).noise == floor(2 * NOISE)


def test_rows_stay_bound_across_unsampled_calls() -> None:
    """Real-model mode samples which calls keep a snapshot; the calls without one still bind rows to
    requests (a row finishing at EOS compacts the batch between two sampled calls)."""
    prompts = ((5, 9, 2, 7), (11, 3), (3, 3, 8, 1, 4), (40, 41))
    accept = tuple(pattern_from_rounds(True, (r,), 20) for r in (0, 2, 1, 2))
    base = Case(prompts, accept, 2, 8, None, 0, model="llama", dtype="float32")
    eos = run_case(EQSPEC, base).oracle[0].tokens[2]  # row 0 stops after 3 tokens, the others run on
    run = run_case(EQSPEC, replace(base, eos_token_id=eos))
    assert run.outputs is not None and len(run.outputs[0]) == 3 and all(len(o) == 8 for o in run.outputs[1:])
    for call in run.recording.target_calls[1::2]:  # as an I2 sampler leaves them
        call.sampled, call.cache_after = False, ()
    assert check_i2(run) == []
