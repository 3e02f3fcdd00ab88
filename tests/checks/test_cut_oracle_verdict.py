"""A black box's verdict is the same whether its answers are judged against the full oracle or the
one cut at the first divergence (`answer_oracle(cut=True)`): the same violations (check, rule,
request, index, found and expected tokens), on right answers, early and late divergences, EOS, a
short answer and a numerical tie re-synced."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from specaudit.checks.outputs import OutputEvidence
from specaudit.checks.registry import BLACK_BOX, evaluate
from specaudit.fixtures.tiny import build_tiny
from specaudit.reference.oracle import OracleResult, answer_oracle, greedy_oracle
from specaudit.running.record import Entry, Record

PROMPT = (3, 1, 4, 1, 5)
LIMIT = 16
TIE_AT = 6  # the generated index at which `TiedLM` offers a numerical tie


class TiedLM(torch.nn.Module):
    """The tiny Llama with one near-tie planted: the logits that choose generated index TIE_AT put
    the runner-up token 1e-5 under the top one (within float32's tie tolerance), nowhere else."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.config = inner.config

    def forward(self, **kwargs: Any) -> Any:
        out = self.inner(**kwargs)
        logits, positions = out.logits, kwargs["position_ids"]  # [1, T', V], [1, T]
        at = len(PROMPT) + TIE_AT - 1  # the position whose logits choose generated index TIE_AT
        for t in range(logits.shape[1]):
            if int(positions[0, positions.shape[1] - logits.shape[1] + t]) == at:
                row = logits[0, t]  # [V]
                top = row.topk(2)
                row[top.indices[1]] = top.values[0] - 1e-5
        return out


def verdict(model: torch.nn.Module, answer: tuple[int, ...], eos: int | None, cut: bool) -> list[tuple[Any, ...]]:
    """evaluate(BLACK_BOX, ...) of one answer against its answer oracle, as comparable tuples."""
    with torch.no_grad():
        oracle = answer_oracle(model, PROMPT, answer, max_new_tokens=LIMIT, eos_token_id=eos, cut=cut)

    def oracle_from(prefix: tuple[int, ...], n: int) -> OracleResult:
        with torch.no_grad():
            return greedy_oracle(model, prefix, max_new_tokens=n, eos_token_id=eos)

    record = Record("cut-test", "black box", "calls", eos)
    record.admit(Entry(0, PROMPT, LIMIT, oracle, list(answer), 0, 0))
    found = evaluate(BLACK_BOX, OutputEvidence(record, "float32", oracle_from)).violations
    keys = ("index", "found_token", "expected_token")
    return [(v.check, v.rule, v.request) + tuple(v.evidence.get(k) for k in keys) for v in found]


def wrong_at(tokens: tuple[int, ...], i: int) -> tuple[int, ...]:
    return tokens[:i] + ((tokens[i] + 1) % 64,) + tokens[i + 1 :]


ANSWERS = {
    "right": lambda right, eos: right,
    "early": lambda right, eos: wrong_at(right, 1),
    "late": lambda right, eos: wrong_at(right, len(right) - 2),
    "short": lambda right, eos: right[:5],
    "eos-too-early": lambda right, eos: right[:3] + (eos,),
    "past-eos": lambda right, eos: right + (7, 7),
}


@pytest.mark.parametrize("eos_at", [None, 9])
@pytest.mark.parametrize("answer", ANSWERS)
def test_cut_and_full_oracles_give_one_verdict(answer: str, eos_at: int | None) -> None:
    model = build_tiny("llama")
    blind = greedy_oracle(model, PROMPT, max_new_tokens=LIMIT, eos_token_id=None).tokens
    eos = blind[eos_at] if eos_at is not None else blind[-1]  # an EOS greedy meets (or only at the end)
    right = greedy_oracle(model, PROMPT, max_new_tokens=LIMIT, eos_token_id=eos if eos_at else None).tokens
    given = ANSWERS[answer](right, eos)[:LIMIT]
    judged_eos = eos if eos_at is not None else None
    full, cut = verdict(model, given, judged_eos, cut=False), verdict(model, given, judged_eos, cut=True)
    assert cut == full, f"answer {given}: cut oracle {cut}, full oracle {full}"
    if answer in ("early", "late"):
        assert full and full[0][:2] == ("equivalence", "first-divergence"), f"answer {given}: {full}"


@pytest.mark.parametrize("after", [None, LIMIT - 2])
def test_a_tie_at_the_divergence_is_judged_alike(after: int | None) -> None:
    """The answer takes the other side of the planted tie (then greedy from there, or wrong again at
    `after`): the cut oracle keeps greedy's token and margin there, so the tie is judged and re-synced."""
    model = TiedLM(build_tiny("llama"))
    right = greedy_oracle(model, PROMPT, max_new_tokens=LIMIT, eos_token_id=None)
    assert right.margins[TIE_AT] < 1e-4, f"planted tie has margin {right.margins[TIE_AT]}"
    with torch.no_grad():
        ids = torch.tensor([PROMPT + right.tokens[:TIE_AT]])  # [1, n]
        logits = model(input_ids=ids, position_ids=torch.arange(ids.shape[1])[None]).logits[0, -1]  # [V]
    other = int(logits.topk(2).indices[1])
    rest = greedy_oracle(model, PROMPT + right.tokens[:TIE_AT] + (other,), max_new_tokens=LIMIT - TIE_AT - 1,
                         eos_token_id=None).tokens  # fmt: skip
    given = right.tokens[:TIE_AT] + (other,) + rest
    given = given if after is None else wrong_at(given, after)
    full, cut = verdict(model, given, None, cut=False), verdict(model, given, None, cut=True)
    assert cut == full, f"answer {given}: cut oracle {cut}, full oracle {full}"
    assert [v[3] for v in full] == ([] if after is None else [after]), f"answer {given}: {full}"


def test_partial_match_of_a_cut_oracle_counts_the_longer() -> None:
    """A cut oracle's length is unknown past the cut: the partial match divides by the longer of it
    and the output; a complete oracle's figure is its own length, as before."""
    from specaudit.checks.agreement import RowEquivalence

    found = (1, 2, 3, 9, 9, 9, 9, 9)
    cut = RowEquivalence(0, (1, 2, 3, 4), found, "cut", "length", 3, complete=False)
    whole = RowEquivalence(0, (1, 2, 3, 4), found, "length", "length", 3)
    assert (cut.partial, whole.partial) == (3 / 8, 3 / 4), f"partial {cut.partial} (cut), {whole.partial} (complete)"
