"""What specaudit found in public batched speculative samplers (tests/wild), pinned on the reproducers it wrote.

The findings and their standalone confirmations: bench/results/sampling_wild.md. A reproducer replays its seeded runs
(`specaudit.commands.replay.replay`), so each verdict here is deterministic.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from specaudit.checks.registry import SAMPLER, evaluate
from specaudit.commands.replay import replay
from specaudit.contracts.case import Case
from specaudit.contracts.decoder import load_decoder
from specaudit.contracts.sampling import Sampling, SamplingCase
from specaudit.running.sampling import run_sampling_case

DATA = Path(__file__).parent / "data"
LUCIDRAINS = "tests.wild.lucidrains:LucidrainsSpeculativeDecoding"
BATCHSPEC = "tests.wild.batchspec:BatchSpecStandalone"

pytestmark = pytest.mark.slow  # about ten seconds: every case runs its decoder several times


def role(violation) -> str | None:
    return violation.evidence.get("token_role")


@pytest.mark.parametrize(
    "file, check, rule, token_role",
    [
        # BatchSpec verifies against top-p-then-top-k while it samples top-k-then-top-p
        ("batchspec_impossible_token.json", "distribution", "impossible-token", "draft"),
        ("batchspec_role_fit.json", "distribution", "impossible-token", "draft"),  # the same defect, found again
        # Pleto: argmax draws under a random acceptance, a position read with the wrong index
        ("pleto_impossible_token.json", "distribution", "impossible-token", "draft"),
        ("pleto_rows_correlated.json", "row-independence", "rows-correlated", None),
        ("pleto_role_fit_draft.json", "distribution", "role-fit", None),
        ("pleto_role_fit_bonus.json", "distribution", "role-fit", None),
    ],
)
def test_defect_replays(file: str, check: str, rule: str, token_role: str | None) -> None:
    result = replay(DATA / file)
    assert not result.passed
    first = result.evaluation.violations[0]
    assert (first.check, first.rule) == (check, rule)
    if token_role is not None:
        assert role(first) == token_role


def test_pleto_bonus_role_is_off_too() -> None:
    """The bonus (argmax of p at the batch's last column) is judged off on its own, beside the draft-place tokens."""
    violations = replay(DATA / "pleto_role_fit_bonus.json").evaluation.violations
    assert {(v.rule, role(v)) for v in violations} == {("role-fit", "draft"), ("role-fit", "bonus")}


def judge(decoder: str, sampling: Sampling, eos_token_id: int | None) -> list:
    """A ragged batch with twins (two prompts, left pads), K = 3, four seeded runs: the sampling verdict."""
    case = Case(
        prompts=((22, 51, 12),) * 3 + ((107,),) * 3, accept=("",) * 6, num_draft_tokens=3, max_new_tokens=6,
        eos_token_id=eos_token_id, pad_token_id=0, draft="sampling",
    )  # fmt: skip
    run = run_sampling_case(
        decoder, SamplingCase(case, sampling, disagree=0.6, runs=4, seed=3), factory=load_decoder(decoder)
    )
    return evaluate(SAMPLER, run).violations


def test_lucidrains_passes_without_eos() -> None:
    """lucidrains' sampler is lossless: with no EOS to stop a row early, every check passes (top-k and top-p on)."""
    assert judge(LUCIDRAINS, Sampling(0.8, 7, 0.9), None) == []


@pytest.mark.parametrize("sampling", [Sampling(0.8, 7, None), Sampling(0.8, None, 0.9)])
def test_batchspec_passes_with_one_filter(sampling: Sampling) -> None:
    """BatchSpec's two filter orders agree when only one of top-k, top-p is on: its defect needs both."""
    assert judge(BATCHSPEC, sampling, None) == []


@pytest.mark.parametrize(
    "file", ["lucidrains_i2_history_token_false_alarm.json", "control_past_eos_i2_false_alarm.json"]
)
def test_rows_past_eos_are_not_foreign(file: str) -> None:
    """Both decoders attend only their own tokens (confirmed without specaudit): they pass. A row run
    past its EOS beside a twin (a row of its prompt) was bound to the twin, a false I2 alarm, until a
    sampled run's I2 stopped holding one twin's row to the other's history (`registry.sampled_i2`)."""
    assert replay(DATA / file).passed
