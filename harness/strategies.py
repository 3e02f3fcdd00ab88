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

from specaudit.case import Case
from specaudit.fixtures import VOCAB_SIZE
from specaudit.fixtures.pairs import check_model, is_exact
from specaudit.runner import oracle_continuation

SCHEDULES = ("all-accept", "all-reject", "ragged-per-row", "ragged-per-round")
SCHEDULE_DRAWS = SCHEDULES + ("ragged-per-row", "ragged-per-round")  # ragged acceptance twice as often
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


@dataclass(frozen=True)
class Row:
    """One drawn row: a new prompt with its acceptance rounds, or a duplicate of an earlier row."""

    prompt: tuple[int, ...] | None
    first: bool = False  # whether the draft is right at generated index 0
    rounds: tuple[int, ...] = ()  # accepted drafts per round, cycled
    duplicate_of: int = 0  # when prompt is None: index (mod rows so far) of the row it repeats


def rounds_for(kind: str, k: int) -> st.SearchStrategy[tuple[int, ...]]:
    if kind == "all-accept":
        return st.just((k,))
    if kind == "all-reject":
        return st.just((0,))
    if kind == "ragged-per-row":
        return st.integers(0, k).map(lambda a: (a,))
    return st.lists(st.integers(0, k), min_size=1, max_size=6).map(tuple)


def row_strategy(bounds: Bounds, length: int | None, kind: str, k: int) -> st.SearchStrategy[Row]:
    """A row of the batch; rows are drawn as one list so the shrinker can delete any of them."""
    token = st.integers(0, VOCAB_SIZE - 1)
    lo, hi = (length, length) if length is not None else (1, bounds.prompt_len)
    fresh = st.builds(
        Row,
        prompt=st.lists(token, min_size=lo, max_size=hi).map(tuple),
        first=st.booleans() if kind.startswith("ragged") else st.just(kind == "all-accept"),
        rounds=rounds_for(kind, k),
    )
    duplicate = st.builds(Row, prompt=st.none(), duplicate_of=st.integers(0, bounds.rows - 1))
    return st.one_of(fresh, fresh, duplicate)  # two in three rows are new prompts


def resolve_rows(rows: list[Row]) -> list[Row]:
    """Duplicates become copies of the row they repeat (a leading one, with nothing to repeat,
    the simplest row); a prompt drawn twice keeps its first schedule, since the draft cannot
    tell identical prompts apart."""
    out: list[Row] = []
    first: dict[tuple[int, ...], Row] = {}
    for row in rows:
        if row.prompt is None:
            row = out[row.duplicate_of % len(out)] if out else Row((0,), False, (0,))
        out.append(first.setdefault(row.prompt, row))  # type: ignore[arg-type]
    return out


def pattern_from_rounds(first: bool, rounds: tuple[int, ...] | list[int], horizon: int) -> tuple[bool, ...]:
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
    kind = draw(st.sampled_from(SCHEDULE_DRAWS), label="schedule")
    k = draw(st.integers(1, 8), label="K")
    max_new = draw(st.integers(1, bounds.max_new_tokens), label="max_new_tokens")
    horizon = max_new + k + 2
    length = draw(st.none() | st.integers(1, bounds.prompt_len), label="equal length")
    rows = resolve_rows(draw(st.lists(row_strategy(bounds, length, kind, k), min_size=1, max_size=bounds.rows)))
    prompts = tuple(row.prompt for row in rows if row.prompt is not None)
    accept = tuple(pattern_from_rounds(row.first, row.rounds, horizon) for row in rows)
    distinct = set(prompts)
    assume(not ambiguous(model, dtype, distinct, horizon))
    by_prompt = dict(zip(prompts, accept))
    event(f"schedule: {kind}")
    event("batch: " + ("equal lengths" if len({len(p) for p in prompts}) == 1 else "ragged lengths"))
    if len(distinct) < len(prompts):
        event("batch: duplicate prompts")
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
