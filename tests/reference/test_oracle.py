"""The oracle is right: it equals greedy decoding worked out by hand, and HF's own greedy `generate()`."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

from specaudit.fixtures.tiny import build_tiny
from specaudit.fixtures.transparent import TOP1_GAP, TransparentLM, transparent_target
from specaudit.reference.oracle import answer_oracle, greedy_oracle, top_margin, truncate

PROMPTS: tuple[tuple[int, ...], ...] = ((3, 1, 4), (0,), (127, 127, 5, 9, 2, 6, 5))


@pytest.fixture(scope="module")
def target() -> TransparentLM:
    return transparent_target()


@torch.no_grad()
def greedy_by_hand(model: torch.nn.Module, prompt: tuple[int, ...], steps: int) -> list[int]:
    """Greedy decoding without a cache: every step re-reads the whole sequence at batch size 1."""
    sequence = list(prompt)
    for _ in range(steps):
        ids = torch.tensor([sequence])  # [1, n]
        positions = torch.arange(len(sequence))[None]  # [1, n]
        logits = model(input_ids=ids, attention_mask=torch.ones_like(ids), position_ids=positions).logits  # [1, n, V]
        sequence.append(int(logits[0, -1].argmax()))
    return sequence[len(prompt) :]


@torch.no_grad()
def hf_greedy(model: torch.nn.Module, prompt: tuple[int, ...], steps: int, eos: int | None = None) -> tuple[int, ...]:
    """The new tokens of HF's own greedy `generate(do_sample=False)` at batch size 1."""
    ids = torch.tensor([prompt])
    kwargs = {} if eos is None else {"eos_token_id": eos}
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=steps, do_sample=False, pad_token_id=0, **kwargs
    )
    return tuple(out[0, len(prompt) :].tolist())


def first_new_index(tokens: tuple[int, ...], minimum: int) -> int:
    """The first index >= minimum whose token does not occur earlier (a clean place for EOS)."""
    return next(i for i in range(minimum, len(tokens)) if tokens[i] not in tokens[:i])


@pytest.mark.parametrize("prompt", PROMPTS)
def test_oracle_equals_greedy_by_hand(target: TransparentLM, prompt: tuple[int, ...]) -> None:
    """Without EOS the oracle's tokens are the cache-free step-by-step argmax, stopped by the limit."""
    result = greedy_oracle(target, prompt, max_new_tokens=9, eos_token_id=None)
    assert list(result.tokens) == greedy_by_hand(target, prompt, 9)
    assert result.stop == "length"


@pytest.mark.parametrize("prompt", PROMPTS)
def test_oracle_equals_hf_generate_on_transparent_model(target: TransparentLM, prompt: tuple[int, ...]) -> None:
    """The oracle equals the transparent model's own HF greedy `generate()`."""
    assert greedy_oracle(target, prompt, max_new_tokens=7, eos_token_id=None).tokens == hf_greedy(target, prompt, 7)


@pytest.mark.parametrize("prompt", PROMPTS)
def test_oracle_stops_at_eos_inclusive(target: TransparentLM, prompt: tuple[int, ...]) -> None:
    """With EOS, the oracle ends at its first occurrence, EOS included, stop reason 'eos'."""
    blind = tuple(greedy_by_hand(target, prompt, 16))
    index = first_new_index(blind, 2)
    result = greedy_oracle(target, prompt, max_new_tokens=16, eos_token_id=blind[index])
    assert result.tokens == blind[: index + 1]
    assert result.stop == "eos"
    assert result.tokens[-1] == blind[index] and blind[index] not in result.tokens[:-1]


def test_oracle_eos_as_first_token(target: TransparentLM) -> None:
    """EOS as the very first generated token gives a one-token output with stop 'eos'."""
    first = greedy_by_hand(target, PROMPTS[0], 1)[0]
    result = greedy_oracle(target, PROMPTS[0], max_new_tokens=5, eos_token_id=first)
    assert result.tokens == (first,) and result.stop == "eos"


def test_oracle_eos_at_the_limit_is_eos(target: TransparentLM) -> None:
    """EOS produced exactly at the last allowed index reports 'eos', not 'length'."""
    blind = tuple(greedy_by_hand(target, PROMPTS[2], 16))
    index = first_new_index(blind, 3)
    result = greedy_oracle(target, PROMPTS[2], max_new_tokens=index + 1, eos_token_id=blind[index])
    assert result.tokens == blind[: index + 1] and result.stop == "eos"


def test_oracle_eos_beyond_the_limit_is_length(target: TransparentLM) -> None:
    """EOS that would come after max_new_tokens does not shorten the output: stop 'length'."""
    blind = tuple(greedy_by_hand(target, PROMPTS[0], 16))
    index = first_new_index(blind, 4)
    result = greedy_oracle(target, PROMPTS[0], max_new_tokens=index, eos_token_id=blind[index])
    assert result.tokens == blind[:index] and result.stop == "length"


@pytest.mark.parametrize("limit", [1, 2, 5])
def test_oracle_length_limit(target: TransparentLM, limit: int) -> None:
    """max_new_tokens = n yields exactly n tokens, stop 'length', when EOS never appears."""
    result = greedy_oracle(target, PROMPTS[1], max_new_tokens=limit, eos_token_id=None)
    assert len(result.tokens) == limit and result.stop == "length"
    assert len(result.margins) == limit


@pytest.mark.parametrize("prompt", PROMPTS)
def test_oracle_margins_are_the_top1_gap(target: TransparentLM, prompt: tuple[int, ...]) -> None:
    """On the transparent model every step's top-1/top-2 margin is exactly TOP1_GAP."""
    result = greedy_oracle(target, prompt, max_new_tokens=6, eos_token_id=None)
    assert result.margins == (TOP1_GAP,) * 6


def test_top_margin() -> None:
    """top_margin is the top-1 minus the top-2 logit, whatever their positions."""
    assert top_margin(torch.tensor([0.5, 3.0, -1.0, 2.25])) == pytest.approx(0.75)
    assert top_margin(torch.tensor([1.0, 1.0, 0.0])) == 0.0


@pytest.mark.parametrize(
    ("continuation", "max_new_tokens", "eos", "expected"),
    [
        ((5, 6, 7, 8), 3, None, ((5, 6, 7), "length")),
        ((5, 6, 7, 8), 4, 6, ((5, 6), "eos")),
        ((5, 6, 7, 6), 4, 6, ((5, 6), "eos")),  # the first EOS wins
        ((5, 6, 7, 8), 3, 7, ((5, 6, 7), "eos")),  # EOS at the last allowed index
        ((5, 6, 7, 8), 3, 8, ((5, 6, 7), "length")),  # EOS past the limit
        ((5, 6, 7, 8), 4, 5, ((5,), "eos")),
        ((5, 6), 4, 9, ((5, 6), "length")),  # EOS absent
        ((5, 6, 7), 1, None, ((5,), "length")),
        ((0, 1, 2), 3, 0, ((0,), "eos")),  # token id 0 is a valid EOS
    ],
)
def test_truncate(
    continuation: tuple[int, ...], max_new_tokens: int, eos: int | None, expected: tuple[tuple[int, ...], str]
) -> None:
    """truncate cuts at max_new_tokens, then at the first EOS (included); 'eos' only if EOS is kept."""
    assert truncate(continuation, max_new_tokens=max_new_tokens, eos_token_id=eos) == expected


@pytest.mark.parametrize("limit", [1, 3, 8])
def test_truncate_of_blind_continuation_equals_oracle(target: TransparentLM, limit: int) -> None:
    """Truncating an EOS-blind continuation gives what the oracle returns with that EOS and limit."""
    prompt = PROMPTS[2]
    blind = greedy_oracle(target, prompt, max_new_tokens=12, eos_token_id=None).tokens
    for eos in sorted(set(blind)) + [None]:
        direct = greedy_oracle(target, prompt, max_new_tokens=limit, eos_token_id=eos)
        assert truncate(blind, max_new_tokens=limit, eos_token_id=eos) == (direct.tokens, direct.stop)


@pytest.mark.parametrize("prompt", [(3, 1, 4, 1, 5), (42,)])
def test_oracle_equals_hf_generate_on_tiny_llama(prompt: tuple[int, ...]) -> None:
    """On a tiny random-weight Llama the oracle equals HF's greedy generate(do_sample=False)."""
    model = build_tiny("llama")
    expected = hf_greedy(model, prompt, 10)
    result = greedy_oracle(model, prompt, max_new_tokens=10, eos_token_id=None)
    assert result.tokens == expected and result.stop == "length"
    assert all(m > 0 for m in result.margins)


def test_oracle_eos_equals_hf_generate_on_tiny_llama() -> None:
    """With an EOS id, the oracle stops where HF's greedy generate() stops, EOS included."""
    model = build_tiny("llama")
    prompt = (3, 1, 4, 1, 5)
    blind = greedy_oracle(model, prompt, max_new_tokens=10, eos_token_id=None).tokens
    eos = blind[first_new_index(blind, 3)]
    result = greedy_oracle(model, prompt, max_new_tokens=10, eos_token_id=eos)
    assert result.tokens == hf_greedy(model, prompt, 10, eos)
    assert result.stop == "eos" and result.tokens[-1] == eos


@contextmanager
def forwards(model: torch.nn.Module) -> Iterator[list[int]]:
    """Counts the model's forwards inside the block; the hook goes with it (the tiny models are
    shared: a hook left behind is seen by every later test in the process)."""
    calls: list[int] = []
    handle = model.register_forward_pre_hook(lambda *_: calls.append(1))
    try:
        yield calls
    finally:
        handle.remove()


ANSWERS = {
    "right": lambda right: right,
    "diverges-at-3": lambda right: right[:3] + ((right[3] + 1) % 64,) + right[4:],
    "wrong-first": lambda right: ((right[0] + 1) % 64,) + right[1:],
    "short": lambda right: right[:4],
    "long": lambda right: right + right,
    "empty": lambda right: (),
}


@pytest.mark.parametrize("answer", ANSWERS)
@pytest.mark.parametrize("model_name", ["llama", "qwen3"])
def test_answer_oracle_equals_greedy_oracle(model_name: str, answer: str) -> None:
    """Whatever the answer it checks, the teacher-forced oracle returns the step-by-step oracle's result."""
    model = build_tiny(model_name)
    prompt = (3, 1, 4, 1, 5)
    expected = greedy_oracle(model, prompt, max_new_tokens=10, eos_token_id=None)
    given = ANSWERS[answer](expected.tokens)
    found = answer_oracle(model, prompt, given, max_new_tokens=10, eos_token_id=None)
    assert found.tokens == expected.tokens and found.stop == expected.stop, f"answer {given}"
    assert found.margins == pytest.approx(expected.margins, rel=1e-6, abs=1e-9)


def test_answer_oracle_stops_at_eos_like_greedy_oracle() -> None:
    """An answer that runs on past EOS (an engine told to ignore it) is cut where the oracle stops."""
    model = build_tiny("llama")
    prompt = (3, 1, 4, 1, 5)
    blind = greedy_oracle(model, prompt, max_new_tokens=10, eos_token_id=None).tokens
    eos = blind[first_new_index(blind, 3)]
    expected = greedy_oracle(model, prompt, max_new_tokens=10, eos_token_id=eos)
    found = answer_oracle(model, prompt, blind, max_new_tokens=10, eos_token_id=eos)
    assert (found.tokens, found.stop) == (expected.tokens, "eos")


def test_a_right_answer_costs_one_forward() -> None:
    """The point of the teacher-forced oracle: one forward where the step-by-step one needs one per token."""
    model = build_tiny("llama")
    prompt = (3, 1, 4, 1, 5)
    right = greedy_oracle(model, prompt, max_new_tokens=12, eos_token_id=None).tokens
    with forwards(model) as calls:
        answer_oracle(model, prompt, right, max_new_tokens=12, eos_token_id=None)
    assert len(calls) == 1, f"{len(calls)} forwards for a right 12-token answer, expected 1"
