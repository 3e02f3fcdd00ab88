"""Workloads the OpenVINO audit draws: prompts (random, repeated motifs so that prompt lookup
drafts, or sharing another prompt's prefix so that prefix caching hits), per-request limits,
K and arrival steps, cancels, and an EOS the target emits part-way."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hypothesis import strategies as st

FIRST_TOKEN = 4
"""Prompts avoid the tiny tokenizer's specials (pad, bos, eos, unk)."""
MAX_PROMPT = 40
MAX_LIMIT = 24
MAX_ARRIVAL = 6
MAX_K = 7


@dataclass(frozen=True)
class Workload:
    """Requests 0..n-1: prompt, max_new_tokens, K, arrival step, cancel step after arrival (None: never);
    `eos_at`: the EOS is request 0's oracle token at that index (None: no EOS)."""

    prompts: tuple[tuple[int, ...], ...]
    limits: tuple[int, ...]
    ks: tuple[int, ...]
    arrivals: tuple[int, ...]
    cancels: tuple[int | None, ...]
    eos_at: int | None = None

    def to_json(self) -> dict[str, Any]:
        return {k: [list(p) for p in v] if k == "prompts" else (list(v) if isinstance(v, tuple) else v)
                for k, v in self.__dict__.items()}  # fmt: skip

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Workload:
        return cls(tuple(tuple(int(t) for t in p) for p in data["prompts"]), tuple(data["limits"]), tuple(data["ks"]),
                   tuple(data["arrivals"]), tuple(data["cancels"]), data.get("eos_at"))  # fmt: skip

    def size(self) -> str:
        tokens = sum(len(p) for p in self.prompts)
        return f"{len(self.prompts)} requests, {tokens} prompt tokens, limits {list(self.limits)}"


def tokens(vocab: int, low: int, high: int) -> st.SearchStrategy[list[int]]:
    return st.lists(st.integers(FIRST_TOKEN, vocab - 1), min_size=low, max_size=high)


@st.composite
def prompt_after(draw: st.DrawFn, earlier: list[tuple[int, ...]], vocab: int) -> tuple[int, ...]:
    """A random prompt, a repeated motif (prompt lookup finds its continuation in it) or another
    prompt's prefix with a new tail (a prefix-cache hit once the prefix fills a block)."""
    kinds = ["random", "motif"] + (["shared"] if earlier else [])
    kind = draw(st.sampled_from(kinds))
    if kind == "random":
        return tuple(draw(tokens(vocab, 1, MAX_PROMPT)))
    if kind == "motif":
        motif = draw(tokens(vocab, 1, 4))
        head = draw(tokens(vocab, 0, 4))
        return tuple((head + motif * draw(st.integers(2, 10)))[:MAX_PROMPT])
    source = earlier[draw(st.integers(0, len(earlier) - 1))]
    cut = draw(st.integers(1, len(source)))
    return tuple((list(source[:cut]) + draw(tokens(vocab, 0, 6)))[:MAX_PROMPT])


@st.composite
def workloads(draw: st.DrawFn, vocab: int, max_requests: int = 6) -> Workload:
    n = draw(st.integers(1, max_requests))
    prompts: list[tuple[int, ...]] = []
    for _ in range(n):
        prompts.append(draw(prompt_after(prompts, vocab)))
    limits = [draw(st.integers(1, MAX_LIMIT)) for _ in range(n)]
    ks = [draw(st.integers(1, MAX_K)) for _ in range(n)]
    arrivals = [draw(st.integers(0, MAX_ARRIVAL)) for _ in range(n)]
    cancels = [draw(st.none() | st.integers(0, 8)) if draw(st.integers(0, 4)) == 0 else None for _ in range(n)]
    eos_at = draw(st.none() | st.integers(1, MAX_LIMIT - 1))
    return Workload(tuple(prompts), tuple(limits), tuple(ks), tuple(arrivals), tuple(cancels), eos_at)
