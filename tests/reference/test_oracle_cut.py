"""The cut oracle (`answer_oracle(cut=True)`): a wrong answer costs no more forwards than a right one,
and the oracle it returns is the full one up to and including the first divergence."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

from specaudit.fixtures.tiny import build_tiny
from specaudit.reference.oracle import answer_oracle, greedy_oracle

PROMPT = (3, 1, 4, 1, 5)
LIMIT = 24


@contextmanager
def counted(model: torch.nn.Module) -> Iterator[list[int]]:
    """Counts the model's forwards inside the block (the hook goes with it: the tiny models are shared)."""
    calls: list[int] = []
    handle = model.register_forward_pre_hook(lambda *_: calls.append(1))
    try:
        yield calls
    finally:
        handle.remove()


def wrong_at(tokens: tuple[int, ...], i: int) -> tuple[int, ...]:
    return tokens[:i] + ((tokens[i] + 1) % 64,) + tokens[i + 1 :]


@pytest.mark.parametrize("at", [1, 4])
def test_a_diverged_answer_costs_a_few_forwards_when_cut(at: int) -> None:
    """Full: one forward per token past the divergence (about LIMIT - at). Cut: the proof and one step."""
    model = build_tiny("llama")
    right = greedy_oracle(model, PROMPT, max_new_tokens=LIMIT, eos_token_id=None).tokens
    answer = wrong_at(right, at)
    with counted(model) as full:
        answer_oracle(model, PROMPT, answer, max_new_tokens=LIMIT, eos_token_id=None)
    with counted(model) as cut:
        answer_oracle(model, PROMPT, answer, max_new_tokens=LIMIT, eos_token_id=None, cut=True)
    assert len(cut) <= 2, f"{len(cut)} forwards for an answer wrong at index {at} with cut=True, expected <= 2"
    assert len(full) >= LIMIT - at, f"{len(full)} forwards for the full oracle, expected >= {LIMIT - at}"


@pytest.mark.parametrize("at", [0, 3, LIMIT - 2])
def test_the_cut_oracle_is_the_full_one_through_the_divergence(at: int) -> None:
    """Tokens and margins equal the full oracle's up to and including index `at`, and it says it is cut."""
    model = build_tiny("llama")
    full = greedy_oracle(model, PROMPT, max_new_tokens=LIMIT, eos_token_id=None)
    found = answer_oracle(model, PROMPT, wrong_at(full.tokens, at), max_new_tokens=LIMIT, eos_token_id=None, cut=True)
    assert found.tokens == full.tokens[: at + 1], f"cut oracle {found.tokens} vs full {full.tokens} at {at}"
    assert found.margins == pytest.approx(full.margins[: at + 1], rel=1e-6, abs=1e-9)
    assert (found.stop, found.complete) == ("cut", False)


def test_a_short_answer_gets_greedys_next_token() -> None:
    """An answer that stops early is cut one token past its end: the token greedy would have given."""
    model = build_tiny("llama")
    full = greedy_oracle(model, PROMPT, max_new_tokens=LIMIT, eos_token_id=None)
    found = answer_oracle(model, PROMPT, full.tokens[:5], max_new_tokens=LIMIT, eos_token_id=None, cut=True)
    assert (found.tokens, found.complete) == (full.tokens[:6], False)


@pytest.mark.parametrize("answer", ["right", "long"])
def test_an_answer_reaching_the_oracles_end_is_complete(answer: str) -> None:
    """Where greedy itself stops inside the answer (limit or EOS), the cut oracle is the full one."""
    model = build_tiny("llama")
    blind = greedy_oracle(model, PROMPT, max_new_tokens=LIMIT, eos_token_id=None).tokens
    eos = blind[8]
    full = greedy_oracle(model, PROMPT, max_new_tokens=LIMIT, eos_token_id=eos)
    given = full.tokens if answer == "right" else blind
    found = answer_oracle(model, PROMPT, given, max_new_tokens=LIMIT, eos_token_id=eos, cut=True)
    assert (found.tokens, found.stop, found.complete) == (full.tokens, full.stop, True)
