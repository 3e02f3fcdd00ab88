"""Hypothesis strategies for cases: batch compositions, padding, acceptance schedules, EOS,
scale, dtype and draft.

Ragged states are produced on purpose: per-row and per-round acceptance counts are drawn,
and the scripted draft turns them into exactly that acceptance ("accept i, then reject" for
every i up to K is drawn often, in ragged mixes across rows and rounds). EOS is placed by
picking the token the oracle produces at a chosen index (inside an accepted draft block, at a
bonus token, at the last allowed position), so its position is controlled, not left to chance.

Most cases are small; a "shape" branch now and then draws a wide batch (more than 16 rows), long
prompts (positions past 256) or a deep one (many new tokens, K up to 12, more pad columns), so
bugs past a chunk size or a fixed capacity are reachable. Tiny real models are drawn in float64,
float32 and bfloat16, with the scripted draft and with their own tiny draft. Everything drawn is
labelled with `hypothesis.event()` (see `label`), and `collected_labels` lets the strategy
meta-tests count the labels without running a decoder.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from hypothesis import assume, event
from hypothesis import strategies as st

from specaudit.contracts.case import Case
from specaudit.fixtures import VOCAB_SIZE
from specaudit.fixtures.pairs import check_model, is_exact
from specaudit.running.runner import oracle_continuation

SCHEDULES = ("all-accept", "all-reject", "ragged-per-row", "ragged-per-round", "every-depth")
SCHEDULE_DRAWS = SCHEDULES + ("ragged-per-row", "ragged-per-round", "every-depth")  # ragged ones twice as often
EOS_PLACEMENTS = ("none", "inside-accepted-block", "bonus-token", "last-position", "any-token")
PAD_CHOICES = ("fresh", "prompt-token", "eos")
SHAPES = ("small", "wide", "long", "deep")
REAL_DTYPES = ("float64", "float32", "bfloat16")
REAL_DRAFTS = ("scripted", "tiny")


@dataclass(frozen=True)
class Bounds:
    """Size limits of one shape: the exact model is cheap, the tiny real ones pay per forward."""

    rows: int
    prompt_len: int
    max_new_tokens: int
    extra_pad_columns: int
    k: int = 8
    min_rows: int = 1
    min_prompt_len: int = 1


EXACT_BOUNDS = {
    "small": Bounds(16, 64, 24, 3),
    "wide": Bounds(64, 24, 24, 8, 12, min_rows=17),
    "long": Bounds(4, 512, 64, 8, 12, min_prompt_len=240),
    "deep": Bounds(16, 64, 64, 8, 12),
}
REAL_BOUNDS = {
    "small": Bounds(6, 16, 10, 2),
    "wide": Bounds(20, 6, 8, 4, 12, min_rows=17),
    "long": Bounds(3, 320, 24, 4, 12, min_prompt_len=257),
    "deep": Bounds(4, 16, 24, 4, 12),
}
SHAPE_ODDS = {True: (10, 2, 3, 2), False: (20, 1, 4, 1)}
"""Per is_exact(model), relative odds of SHAPES: most cases stay small (measured: about 60% on
the exact model, 75% on the tiny real ones, whose big shapes are sparse to keep their cost bounded)."""


def draw_weighted(draw: st.DrawFn, options: tuple[str, ...], odds: tuple[int, ...], label: str) -> str:
    """One of `options` by relative `odds`, from one integer draw; it shrinks towards the first.

    Hypothesis favours low tickets (the first option) well beyond the odds, so callers' odds are
    set from the measured shares (tests/search/test_strategies.py checks the labels they lead to)."""
    ticket = draw(st.integers(0, sum(odds) - 1), label=label)
    for option, n in zip(options, odds):
        if ticket < n:
            return option
        ticket -= n
    raise AssertionError("unreachable: the ticket is below the sum of the odds")


def bounds_for(model: str, shape: str = "small") -> Bounds:
    return (EXACT_BOUNDS if is_exact(model) else REAL_BOUNDS)[shape]


_SINKS: list[Counter[str]] = []


def label(name: str) -> None:
    """`hypothesis.event(name)`, also counted by any open `collected_labels()`."""
    event(name)
    for sink in _SINKS:
        sink[name] += 1


@contextmanager
def collected_labels() -> Iterator[Counter[str]]:
    """Count the labels of every case drawn inside the block (for the strategy meta-tests)."""
    sink: Counter[str] = Counter()
    _SINKS.append(sink)
    try:
        yield sink
    finally:
        _SINKS.remove(sink)


@dataclass(frozen=True)
class DrawnRow:
    """One drawn row: a new prompt with its acceptance rounds, or a duplicate of an earlier row."""

    prompt: tuple[int, ...] | None
    first: bool = False  # whether the draft is right at generated index 0
    rounds: tuple[int, ...] = ()  # accepted drafts per round, cycled
    duplicate_of: int = 0  # when prompt is None: index (mod rows so far) of the row it repeats


def rounds_for(kind: str, k: int) -> st.SearchStrategy[tuple[int, ...]]:
    """Accepted drafts per round; "every-depth" visits every depth 0..K once, in a drawn order,
    so each row of the batch goes through "accept i, then reject" in its own order."""
    if kind == "all-accept":
        return st.just((k,))
    if kind == "all-reject":
        return st.just((0,))
    if kind == "ragged-per-row":
        return st.integers(0, k).map(lambda a: (a,))
    if kind == "every-depth":
        return st.permutations(range(k + 1)).map(tuple)
    return st.lists(st.integers(0, k), min_size=1, max_size=6).map(tuple)


def row_strategy(bounds: Bounds, length: int | None, kind: str, k: int) -> st.SearchStrategy[DrawnRow]:
    """A row of the batch; rows are drawn as one list so the shrinker can delete any of them."""
    token = st.integers(0, VOCAB_SIZE - 1)
    lo, hi = (length, length) if length is not None else (bounds.min_prompt_len, bounds.prompt_len)
    fresh = st.builds(
        DrawnRow,
        prompt=st.lists(token, min_size=lo, max_size=hi).map(tuple),
        first=st.booleans() if kind not in ("all-accept", "all-reject") else st.just(kind == "all-accept"),
        rounds=rounds_for(kind, k),
    )
    duplicate = st.builds(DrawnRow, prompt=st.none(), duplicate_of=st.integers(0, bounds.rows - 1))
    return st.one_of(fresh, fresh, duplicate)  # two in three rows are new prompts


def resolve_rows(rows: list[DrawnRow]) -> list[DrawnRow]:
    """Duplicates become copies of the row they repeat (a leading one, with nothing to repeat,
    the simplest row); a prompt drawn twice keeps its first schedule, since the draft cannot
    tell identical prompts apart."""
    out: list[DrawnRow] = []
    first: dict[tuple[int, ...], DrawnRow] = {}
    for row in rows:
        if row.prompt is None:
            row = out[row.duplicate_of % len(out)] if out else DrawnRow((0,), False, (0,))
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


def scale_labels(case: Case) -> list[str]:
    """Labels for the sizes past the small shape's limits (the blind spots of a small-only search)."""
    positions = max(map(len, case.prompts)) + case.max_new_tokens - 1  # position of the last output token
    marks = [
        ("rows>16", case.batch_size > 16),
        ("rows>32", case.batch_size > 32),
        ("prompt>256", max(map(len, case.prompts)) > 256),
        ("position>256", positions > 256),
        ("max_new_tokens>24", case.max_new_tokens > 24),
        ("K>=8", case.num_draft_tokens >= 8),
        ("K>8", case.num_draft_tokens > 8),
        ("extra pad columns>3", case.extra_pad_columns > 3),
    ]
    return [name for name, hit in marks if hit]


def acceptance_labels(rounds: list[list[tuple[int, int]]], k: int) -> list[str]:
    """Per-round acceptance depths the scripted draft produces, over the distinct prompts' rounds."""
    depths = {a for r in rounds for _, a in r}
    out = [f"accept-i-then-reject:i={a}" for a in sorted(depths) if a < k]
    if k in depths:
        out.append("accept-all-K")
    if any(3 <= a < k for a in depths) and k >= 4:
        out.append("rejection after >=3 accepted")
    if len({r[0][1] for r in rounds if r}) > 1:
        out.append("acceptance: ragged across rows")
    if any(len({a for _, a in r}) > 1 for r in rounds):
        out.append("acceptance: ragged across rounds")
    return out


def draw_eos(
    draw: st.DrawFn,
    model: str,
    dtype: str,
    prompts: tuple[tuple[int, ...], ...],
    accept: tuple[tuple[bool, ...], ...],
    k: int,
    max_new: int,
) -> int | None:
    """The EOS id, placed by kind: at an index inside an accepted block, at a bonus token, ..."""
    horizon = max_new + k + 2
    placement = draw(st.sampled_from(EOS_PLACEMENTS), label="eos placement")
    eos: int | None = None
    if placement == "any-token":
        eos = draw(st.integers(0, VOCAB_SIZE - 1), label="eos")
    elif placement != "none":
        row = draw(st.integers(0, len(prompts) - 1), label="eos row")
        index = eos_index(draw, placement, accept[row], k, max_new)
        if index is not None:
            tokens = oracle_continuation(model, dtype, prompts[row], horizon).tokens
            eos = tokens[index]
            label(f"eos: {placement}" if tokens.index(eos) == index else "eos: earlier than placed")
    if eos is None:
        label("eos: none")
    return eos


def draw_pad(draw: st.DrawFn, prompts: tuple[tuple[int, ...], ...], eos: int | None) -> int:
    """A fresh pad id, one that is also a real prompt token, or the EOS id."""
    pad_kind = draw(st.sampled_from(PAD_CHOICES), label="pad choice")
    if pad_kind == "prompt-token":
        label("pad: collides with a prompt token")
        return draw(st.sampled_from(sorted({t for p in prompts for t in p})), label="pad")
    if pad_kind == "eos" and eos is not None:
        label("pad: equals eos")
        return eos
    return draw(st.integers(0, VOCAB_SIZE - 1), label="pad")


@st.composite
def cases(draw: st.DrawFn, model: str = "transparent", draft: str | None = None, dtype: str | None = None) -> Case:
    """A whole case for `model`: shape, batch, padding, schedule, K, limits and EOS, and for the
    tiny real models the dtype and draft too (drawn unless given)."""
    exact = is_exact(model)
    check_model(model, draft or "scripted", dtype or "float64")
    shape = draw_weighted(draw, SHAPES, SHAPE_ODDS[exact], "shape")
    bounds = bounds_for(model, shape)
    kind = draw(st.sampled_from(SCHEDULE_DRAWS), label="schedule")
    k = draw(st.integers(1, bounds.k) | st.integers(max(1, bounds.k - 4), bounds.k), label="K")  # deep K often
    max_new = draw(st.integers(1, bounds.max_new_tokens), label="max_new_tokens")
    horizon = max_new + k + 2
    lengths = st.integers(bounds.min_prompt_len, bounds.prompt_len)
    length = draw(st.none() | lengths, label="equal length")
    rows = st.lists(row_strategy(bounds, length, kind, k), min_size=bounds.min_rows, max_size=bounds.rows)
    rows = resolve_rows(draw(rows, label="rows"))
    prompts = tuple(row.prompt for row in rows if row.prompt is not None)
    accept = tuple(pattern_from_rounds(row.first, row.rounds, horizon) for row in rows)
    distinct = set(prompts)
    # Odds skewed against float64 and the scripted draft: Hypothesis favours the first option.
    draft = draft or ("scripted" if exact else draw_weighted(draw, REAL_DRAFTS, (2, 3), "draft"))
    dtype = dtype or ("float64" if exact else draw_weighted(draw, REAL_DTYPES, (1, 2, 3), "dtype"))
    check_model(model, draft, dtype)
    assume(not ambiguous(model, dtype, distinct, horizon))
    by_prompt = dict(zip(prompts, accept))
    for name in (f"shape: {shape}", f"dtype:{dtype}", f"draft:{draft}"):
        label(name)
    label("batch: " + ("equal lengths" if len({len(p) for p in prompts}) == 1 else "ragged lengths"))
    if len(distinct) < len(prompts):
        label("batch: duplicate prompts")
    if draft == "scripted":  # a real draft's acceptance is its own, not the schedule's
        label(f"schedule: {kind}")
        for name in acceptance_labels([round_counts(by_prompt[p], k, max_new) for p in distinct], k):
            label(name)

    eos = draw_eos(draw, model, dtype, prompts, accept, k, max_new)
    pad = draw_pad(draw, prompts, eos)
    extra = draw(st.integers(0, bounds.extra_pad_columns), label="extra pad columns")
    case = Case(prompts, accept, k, max_new, eos, pad, extra, model, draft, dtype)
    for name in scale_labels(case):
        label(name)
    return case
