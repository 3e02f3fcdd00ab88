"""Hypothesis strategies for cases: batch compositions, padding, acceptance schedules, EOS.

Ragged states are produced on purpose: per-row and per-round acceptance counts are drawn,
and the scripted draft turns them into exactly that acceptance. EOS is placed by picking
the token the oracle produces at a chosen index (inside an accepted draft block, at a bonus
token, at the last allowed position), so its position is controlled, not left to chance.
"""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import assume, event
from hypothesis import strategies as st

from fixtures import VOCAB_SIZE
from fixtures.pairs import check_model, is_exact
from harness.case import Case
from harness.runner import oracle_continuation

SCHEDULES = ("all-accept", "all-reject", "ragged-per-row", "ragged-per-round")
EOS_PLACEMENTS = ("none", "inside-accepted-block", "bonus-token", "last-position", "any-token")
PAD_CHOICES = ("fresh", "prompt-token", "eos")


@dataclass(frozen=True)
class Bounds:
    """Size limits: the exact model is cheap, the tiny real ones pay per forward."""

    rows: int
    prompt_len: int
    max_new_tokens: int
    extra_pad_columns: int


def bounds_for(model: str) -> Bounds:
    return Bounds(16, 64, 24, 3) if is_exact(model) else Bounds(6, 16, 10, 2)


@st.composite
def batch_prompts(draw: st.DrawFn, bounds: Bounds) -> tuple[tuple[int, ...], ...]:
    """1..rows prompts, ragged or equal lengths, with duplicate prompts mixed in."""
    rows = draw(st.integers(1, bounds.rows), label="rows")
    equal = draw(st.booleans(), label="equal lengths")
    token = st.integers(0, VOCAB_SIZE - 1)
    length = st.integers(1, bounds.prompt_len)
    fixed = draw(length, label="length") if equal else None
    prompts: list[tuple[int, ...]] = []
    for _ in range(rows):
        if prompts and draw(st.integers(0, 4), label="duplicate?") == 0:
            prompts.append(draw(st.sampled_from(prompts), label="duplicate of"))
            continue
        n = fixed if fixed is not None else draw(length, label="length")
        prompts.append(tuple(draw(st.lists(token, min_size=n, max_size=n), label="prompt")))
    if len(set(prompts)) < len(prompts):
        event("batch: duplicate prompts")
    event("batch: " + ("equal lengths" if len({len(p) for p in prompts}) == 1 else "ragged lengths"))
    return tuple(prompts)


def pattern_from_rounds(first: bool, rounds: list[int], horizon: int) -> tuple[bool, ...]:
    """Accept flags per generated index from per-round counts.

    With the usual prefill (index 0 comes from the target), round j starts at b_j with
    b_0 = 1 and b_{j+1} = b_j + a_j + 1: a_j accepted drafts, then the bonus index.
    """
    flags = [first]
    j = 0
    while len(flags) < horizon:
        flags += [True] * rounds[j % len(rounds)] + [False]
        j += 1
    return tuple(flags[:horizon])


@st.composite
def acceptance(draw: st.DrawFn, distinct: int, k: int, horizon: int) -> tuple[str, list[tuple[bool, ...]]]:
    """One accept pattern per distinct prompt, following a schedule kind."""
    kind = draw(st.sampled_from(SCHEDULES), label="schedule")
    patterns = []
    for _ in range(distinct):
        if kind == "all-accept":
            rounds = [k]
        elif kind == "all-reject":
            rounds = [0]
        elif kind == "ragged-per-row":
            rounds = [draw(st.integers(0, k), label="accepted per round")]
        else:
            rounds = draw(st.lists(st.integers(0, k), min_size=1, max_size=6), label="accepted per round")
        first = kind != "all-reject" and (kind == "all-accept" or draw(st.booleans(), label="accept index 0"))
        patterns.append(pattern_from_rounds(first, rounds, horizon))
    return kind, patterns


def round_counts(pattern: tuple[bool, ...], k: int, limit: int) -> list[tuple[int, int]]:
    """(start, accepted) of each round a prefill-first decoder runs, up to `limit` tokens."""
    out, b = [], 1
    while b < limit:
        a = 0
        while a < k and b + a < len(pattern) and pattern[b + a]:
            a += 1
        out.append((b, a))
        b += a + 1
    return out


def eos_index(draw: st.DrawFn, placement: str, pattern: tuple[bool, ...], k: int, max_new: int) -> int | None:
    """The generated index at which to put EOS for one row, by placement kind."""
    rounds = round_counts(pattern, k, max_new)
    if placement == "last-position":
        return max_new - 1
    if placement == "inside-accepted-block":
        inside = [b + i for b, a in rounds for i in range(a) if b + i < max_new]
        return draw(st.sampled_from(inside), label="eos index") if inside else None
    if placement == "bonus-token":
        bonus = [0] + [b + a for b, a in rounds if b + a < max_new]
        return draw(st.sampled_from(bonus), label="eos index")
    return None


def ambiguous(model: str, dtype: str, prompts: set[tuple[int, ...]], horizon: int) -> bool:
    """True if one prompt plus its oracle continuation starts with another, distinct prompt:
    then no model, scripted or real, can tell the two rows apart by content."""
    for a in prompts:
        for b in prompts:
            if len(a) < len(b) and b[: len(a)] == a:
                cont = oracle_continuation(model, dtype, a, horizon).tokens
                if b[len(a) :] == cont[: len(b) - len(a)]:
                    return True
    return False


@st.composite
def cases(draw: st.DrawFn, model: str = "transparent", draft: str = "scripted", dtype: str = "float64") -> Case:
    """A whole case for `model`: batch, padding, schedule, K, limits and EOS."""
    check_model(model, draft, dtype)
    bounds = bounds_for(model)
    prompts = draw(batch_prompts(bounds), label="prompts")
    k = draw(st.integers(1, 8), label="K")
    max_new = draw(st.integers(1, bounds.max_new_tokens), label="max_new_tokens")
    horizon = max_new + k + 2
    distinct = sorted(set(prompts))
    assume(not ambiguous(model, dtype, set(distinct), horizon))
    kind, patterns = draw(acceptance(len(distinct), k, horizon), label="acceptance")
    by_prompt = dict(zip(distinct, patterns))
    accept = tuple(by_prompt[p] for p in prompts)
    event(f"schedule: {kind}")
    rounds = [round_counts(by_prompt[p], k, max_new) for p in distinct]
    if len({r[0][1] for r in rounds if r}) > 1:
        event("acceptance: ragged across rows")
    if any(len({a for _, a in r}) > 1 for r in rounds):
        event("acceptance: ragged across rounds")

    placement = draw(st.sampled_from(EOS_PLACEMENTS), label="eos placement")
    eos: int | None = None
    if placement == "any-token":
        eos = draw(st.integers(0, VOCAB_SIZE - 1), label="eos")
    elif placement != "none":
        row = draw(st.integers(0, len(prompts) - 1), label="eos row")
        index = eos_index(draw, placement, accept[row], k, max_new)
        if index is not None:
            eos = oracle_continuation(model, dtype, prompts[row], horizon).tokens[index]
            first = oracle_continuation(model, dtype, prompts[row], horizon).tokens.index(eos)
            event(f"eos: {placement}" if first == index else "eos: earlier than placed")
    if eos is None:
        event("eos: none")

    pad_kind = draw(st.sampled_from(PAD_CHOICES), label="pad choice")
    if pad_kind == "prompt-token":
        pad = draw(st.sampled_from(sorted({t for p in prompts for t in p})), label="pad")
        event("pad: collides with a prompt token")
    elif pad_kind == "eos" and eos is not None:
        pad = eos
        event("pad: equals eos")
    else:
        pad = draw(st.integers(0, VOCAB_SIZE - 1), label="pad")
    extra = draw(st.integers(0, bounds.extra_pad_columns), label="extra pad columns")
    return Case(prompts, accept, k, max_new, eos, pad, extra, model, draft, dtype)
