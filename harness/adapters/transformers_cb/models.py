"""The models transformers CB runs and is judged against, and the tokens they produce.

The engine gets a private copy of the built-in tiny Llama (it switches the attention
implementation while it runs); the batch-size-1 oracle gets the shared, untouched one with the
same weights. The settings pin the one path the observer can read: synchronous, eager, varlen.
"""

from __future__ import annotations

import copy
import functools
from collections import Counter

import torch


def engine_model(seed: int = 0) -> torch.nn.Module:
    """A private float32 copy of the built-in tiny Llama: the engine switches its attention
    implementation while it runs, so it never gets the shared fixture."""
    from specaudit.fixtures.tiny import build_tiny

    return copy.deepcopy(build_tiny("llama", dtype=torch.float32, seed=seed))


def oracle_model(seed: int = 0) -> torch.nn.Module:
    """The same weights, shared and untouched: the batch-size-1 oracle's target."""
    from specaudit.fixtures.tiny import build_tiny

    return build_tiny("llama", dtype=torch.float32, seed=seed)


def likely_tokens(seed: int = 0, count: int = 6) -> tuple[int, ...]:
    """Tokens the tiny Llama produces often (greedy from a few prompts): EOS ids that actually stop."""
    return _likely(seed, count)


@functools.cache
def _likely(seed: int, count: int) -> tuple[int, ...]:
    from specaudit.reference.oracle import greedy_oracle

    target, seen = oracle_model(seed), Counter()
    with torch.no_grad():
        for start in (1, 17, 40, 77, 101):
            prompt = (start, start + 1, start + 2)
            seen.update(greedy_oracle(target, prompt, max_new_tokens=12, eos_token_id=None).tokens)
    return tuple(t for t, _ in seen.most_common(count))


@functools.lru_cache(maxsize=1024)
def continuation(prompt: tuple[int, ...], seed: int = 0) -> tuple[int, ...]:
    """The tiny Llama's greedy continuation of `prompt` (8 tokens): EOS ids that stop that request."""
    from specaudit.reference.oracle import greedy_oracle

    with torch.no_grad():
        return greedy_oracle(oracle_model(seed), prompt, max_new_tokens=8, eos_token_id=None).tokens
