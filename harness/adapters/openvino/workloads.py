"""Workloads the OpenVINO audit draws: prompts (random, repeated motifs so that prompt lookup
drafts, or sharing another prompt's prefix so that prefix caching hits), per-request limits,
K and arrival steps, cancels, an EOS the target emits part-way, and stop strings taken from the
oracle's own continuation (so that they complete inside accepted runs), some with a limit one or two
tokens past the stop's last token (a stop and `max_new_tokens` inside one accepted run)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hypothesis import strategies as st

FIRST_TOKEN = 4
"""Prompts avoid the tiny tokenizer's specials (pad, bos, eos, unk)."""
MAX_PROMPT = 40
MAX_LONG = 48
"""The longest prompt drawn to pass a configuration's token budget (`prompt_after`'s "long"): one per
workload at most, so a step's tokens stay within `defects.WHOLE_BUDGET`."""
MAX_LIMIT = 24
MAX_ARRIVAL = 6
MAX_K = 7
MAX_STOP_TOKENS = 3

StopSpec = tuple[int, int, int, int, bool]
"""(start, n, head, tail, include): the stop string is the text of the oracle's tokens
start..start+n-1 less `head` characters at its start (one token only) and `tail` at its end
(`checks.stops.stop_from`); `include`: include_stop_str_in_output."""


@dataclass(frozen=True)
class Workload:
    """Requests 0..n-1: prompt, max_new_tokens, K, arrival step, cancel step after arrival (None: never);
    `eos_at`: the EOS is request 0's oracle token at that index (None: no EOS); `stops`: per request
    a `StopSpec` or None (empty: none at all)."""

    prompts: tuple[tuple[int, ...], ...]
    limits: tuple[int, ...]
    ks: tuple[int, ...]
    arrivals: tuple[int, ...]
    cancels: tuple[int | None, ...]
    eos_at: int | None = None
    stops: tuple[StopSpec | None, ...] = ()

    def stop(self, request: int) -> StopSpec | None:
        return self.stops[request] if request < len(self.stops) else None

    def to_json(self) -> dict[str, Any]:
        return {k: [list(p) for p in v] if k == "prompts" else (list(v) if isinstance(v, tuple) else v)
                for k, v in self.__dict__.items()}  # fmt: skip

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Workload:
        stops = tuple(None if s is None else (int(s[0]), int(s[1]), int(s[2]), int(s[3]), bool(s[4]))
                      for s in data.get("stops") or ())  # fmt: skip
        return cls(tuple(tuple(int(t) for t in p) for p in data["prompts"]), tuple(data["limits"]), tuple(data["ks"]),
                   tuple(data["arrivals"]), tuple(data["cancels"]), data.get("eos_at"), stops)  # fmt: skip

    def size(self) -> str:
        tokens = sum(len(p) for p in self.prompts)
        stops = sum(s is not None for s in self.stops)
        return f"{len(self.prompts)} requests, {tokens} prompt tokens, limits {list(self.limits)}, {stops} stop strings"


def tokens(vocab: int, low: int, high: int) -> st.SearchStrategy[list[int]]:
    return st.lists(st.integers(FIRST_TOKEN, vocab - 1), min_size=low, max_size=high)


@st.composite
def prompt_after(
    draw: st.DrawFn, earlier: list[tuple[int, ...]], vocab: int, budget: int | None = None
) -> tuple[int, ...]:  # fmt: skip
    """A random prompt, a repeated motif (prompt lookup finds its continuation in it), another
    prompt's prefix with a new tail (a prefix-cache hit once the prefix fills a block), or, given the
    configuration's token `budget` below `MAX_LONG`, a prompt just past it (its prefill is chunked:
    random lengths up to `MAX_PROMPT` seldom pass a budget of 32)."""
    long = budget is not None and budget < MAX_LONG and all(len(p) <= budget for p in earlier)
    kinds = ["random", "motif"] + (["shared"] if earlier else []) + (["long"] if long else [])
    kind = draw(st.sampled_from(kinds))
    if kind == "random":
        return tuple(draw(tokens(vocab, 1, MAX_PROMPT)))
    if kind == "long":
        assert budget is not None
        return tuple(draw(tokens(vocab, budget + 1, min(budget + 8, MAX_LONG))))
    if kind == "motif":
        motif = draw(tokens(vocab, 1, 4))
        head = draw(tokens(vocab, 0, 4))
        return tuple((head + motif * draw(st.integers(2, 10)))[:MAX_PROMPT])
    source = earlier[draw(st.integers(0, len(earlier) - 1))]
    cut = draw(st.integers(1, len(source)))
    return tuple((list(source[:cut]) + draw(tokens(vocab, 0, 6)))[:MAX_PROMPT])


@st.composite
def workloads(
    draw: st.DrawFn, vocab: int, max_requests: int = 6, stops: bool = True, budget: int | None = None
) -> Workload:  # fmt: skip
    """A drawn workload; `stops`: some requests carry a stop string (all but `audit-openvino
    --no-stop-strings`); `budget`: the configuration's token budget, which one prompt may pass."""
    n = draw(st.integers(1, max_requests))
    prompts: list[tuple[int, ...]] = []
    for _ in range(n):
        prompts.append(draw(prompt_after(prompts, vocab, budget)))
    limits = [draw(st.integers(1, MAX_LIMIT)) for _ in range(n)]
    specs: list[StopSpec | None] = []
    for i in range(n):
        spec = draw(stop_spec(limits[i])) if stops and draw(st.integers(0, 2)) == 0 else None
        specs.append(spec)
        if spec is not None and draw(st.booleans()):  # the limit one or two tokens past the stop's last token
            limits[i] = spec[0] + spec[1] - 1 + draw(st.integers(1, 2))
    ks = [draw(st.integers(1, MAX_K)) for _ in range(n)]
    arrivals = [draw(st.integers(0, MAX_ARRIVAL)) for _ in range(n)]
    cancels = [draw(st.none() | st.integers(0, 8)) if draw(st.integers(0, 4)) == 0 else None for _ in range(n)]
    eos_at = draw(st.none() | st.integers(1, MAX_LIMIT - 1))
    return Workload(tuple(prompts), tuple(limits), tuple(ks), tuple(arrivals), tuple(cancels), eos_at, tuple(specs))


@st.composite
def stop_spec(draw: st.DrawFn, limit: int) -> StopSpec:
    """One to three tokens' text starting within the limit, sometimes less a character or two at
    either end (at its start only for one token, so it never starts inside a token and ends in a later one)."""
    n = draw(st.integers(1, MAX_STOP_TOKENS))
    start = draw(st.integers(0, max(limit - 1, 0)))
    head = draw(st.integers(0, 2)) if n == 1 else 0
    return start, n, head, draw(st.integers(0, 2)), draw(st.booleans())


def exercised(workload: Workload, budget: int) -> dict[str, int]:
    """What a workload draws of the features a configuration may enable, by construction (the step
    API reports no scheduling): prompts longer than the token budget (their prefill is chunked),
    prompts sharing a prefix with one added no later (a prefix-cache lookup that can hit), cancels,
    stop strings, and requests of different K in one workload (ragged verification possible)."""
    prompts, arrivals = workload.prompts, workload.arrivals
    earlier = [[q for j, q in enumerate(prompts) if j != i and arrivals[j] <= arrivals[i]] for i in range(len(prompts))]
    return {
        "chunked prefill": sum(len(p) > budget for p in prompts),
        "shared prefix": sum(any(q[0] == p[0] for q in before) for p, before in zip(prompts, earlier)),
        "cancel": sum(c is not None for c in workload.cancels),
        "stop string": sum(s is not None for s in workload.stops),
        "mixed K": int(len(set(workload.ks)) > 1),
    }


def unexercised(counts: dict[str, int], budget: int, prefix_caching: bool, speculative: bool) -> list[str]:
    """The features a configuration enables that its draws never reached (`exercised`, summed)."""
    enabled = ["cancel", "stop string"]
    enabled += ["chunked prefill"] if budget < MAX_LONG else []
    enabled += ["shared prefix"] if prefix_caching else []
    enabled += ["mixed K"] if speculative else []
    return [name for name in enabled if counts.get(name, 0) == 0]
