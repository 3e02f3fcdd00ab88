"""Workloads for transformers CB under Hypothesis: where paged engines go wrong, drawn on purpose.

Prompts and outputs cross page boundaries at small page sizes, requests share prefixes or repeat
a prompt (prefix sharing's de-duplication), the manager's requests arrive late and are
cancelled, EOS is a token the model actually produces, small `max_batch_tokens` chunk prefills
and a cache sized for the largest request alone forces preemption. Each helper draws one part,
in a fixed order, so a seed gives the same workloads and shrinking works part by part.
"""

from __future__ import annotations

from collections.abc import Sequence

from hypothesis import strategies as st

from specaudit.adapters.transformers_cb.models import continuation, likely_tokens
from specaudit.adapters.transformers_cb.workload import ENTRY_POINTS, CbRequest, CbWorkload

TOKENS = st.integers(1, 127)
"""Prompt tokens: the tiny Llama's vocabulary, without 0 (`generate`'s pad)."""


@st.composite
def cb_workloads(draw: st.DrawFn, entries: Sequence[str] = ENTRY_POINTS, seed: int = 0) -> CbWorkload:
    """A workload for one entry point: prompts crossing page boundaries at small page sizes,
    duplicates and shared prefixes, mixed limits, arrivals and aborts (the manager), EOS among
    likely tokens and the first request's own continuation, chunked prefill (small
    `max_batch_tokens`), preemption (a small cache) and prefix sharing on and off."""
    entry = draw(st.sampled_from(tuple(entries)))
    page = draw(st.sampled_from((4, 8, 16)))
    prompts = draw(cb_prompts(page))
    requests = draw(cb_requests(prompts, entry, page))
    blocks = draw(cache_blocks(requests, page))
    return CbWorkload(
        requests,
        entry,
        page,
        blocks,
        draw(st.sampled_from((4, 8, 16, 64))),
        draw(st.booleans()),
        draw(st.none() | st.sampled_from(likely_tokens(seed) + continuation(requests[0].prompt, seed))),
        seed,
    )


@st.composite
def cb_prompts(draw: st.DrawFn, page: int) -> list[tuple[int, ...]]:
    """1-4 prompts of up to two pages each: fresh, a shared prefix plus a tail, or a duplicate."""
    n = draw(st.integers(1, 4))
    shared = tuple(draw(st.lists(TOKENS, min_size=1, max_size=2 * page)))
    prompts: list[tuple[int, ...]] = []
    for _ in range(n):
        kind = draw(st.sampled_from(("fresh", "shared", "duplicate")))
        tail = tuple(draw(st.lists(TOKENS, min_size=1, max_size=2 * page)))
        if kind == "duplicate" and prompts:
            prompts.append(draw(st.sampled_from(prompts)))
        else:
            prompts.append(shared + tail if kind == "shared" else tail)
    return prompts


@st.composite
def cb_requests(draw: st.DrawFn, prompts: list[tuple[int, ...]], entry: str, page: int) -> tuple[CbRequest, ...]:
    """The prompts as requests. Only the manager takes a limit per request, an arrival and an
    abort; `generate_batch` and `generate` take one limit for all, at once, never cancelled."""
    one_limit = draw(st.integers(1, 2 * page))
    manager = entry == "manager"
    requests = []
    for i, prompt in enumerate(prompts):
        limit = draw(st.integers(1, 2 * page)) if manager else one_limit
        arrival = draw(st.integers(0, 6)) if manager else 0
        abort = draw(st.none() | st.integers(arrival + 1, arrival + 10)) if manager else None
        requests.append(CbRequest(f"r{i}", prompt, limit, arrival, abort))
    return tuple(requests)


@st.composite
def cache_blocks(draw: st.DrawFn, requests: tuple[CbRequest, ...], page: int) -> int:
    """The cache's blocks: room for the largest request alone (+2, so it preempts the others) or
    for all of them (+4)."""
    need = [-(-(len(r.prompt) + r.max_new_tokens) // page) for r in requests]
    small = draw(st.booleans())
    return max(need) + 2 if small else sum(need) + 4
