"""Equivalence with the batch-size-1 oracle: identical tokens, length and stop reason.

Tie-aware: a divergence is a numerical tie when the two tokens are within the noise batched
arithmetic can cause, and the comparison then re-syncs onto the decoder's token. On real
models the noise is measured (`Run.noise`, a `specaudit.numerics.calibration.NoiseFloor`) and the
two tokens' logits are compared in a higher-precision teacher-forced score of the shared
prefix (`judge_divergence`); on the built-in models, whose measured noise is nil, the
oracle's top-1/top-2 margin is held to the dtype's rounding tolerance.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from specaudit.checks.contract import check_contract
from specaudit.checks.i2 import row_views
from specaudit.checks.rows import RowView, common_prefix
from specaudit.contracts.violation import Violation
from specaudit.numerics.calibration import Witness
from specaudit.numerics.tolerance import DTYPES, TIE_TOLERANCE
from specaudit.reference.oracle import OracleResult
from specaudit.running.record import Entry
from specaudit.running.runner import Run


@dataclass(frozen=True)
class RowEquivalence:
    row: int
    expected: tuple[int, ...]  # the batch-size-1 oracle
    found: tuple[int, ...]
    expected_stop: str
    found_stop: str
    first_divergence: int | None  # first divergence that is not a numerical tie; None if equivalent
    ties: tuple[int, ...] = ()  # indices where the decoder took the other side of a tie
    resynced: tuple[int, ...] | None = None  # the oracle re-synced across those ties (None: no ties)
    judged: tuple[Witness, ...] = ()  # every divergence judged, ties and the one that is not

    @property
    def reference(self) -> tuple[int, ...]:
        """What the decoder is held to: the oracle, re-synced at each tie."""
        return self.expected if self.resynced is None else self.resynced

    @property
    def exact(self) -> bool:
        return self.found == self.expected

    @property
    def equivalent(self) -> bool:
        return self.first_divergence is None

    @property
    def verdict(self) -> str:
        if self.exact:
            return "exact"
        return f"equivalent modulo {len(self.ties)} tie(s)" if self.equivalent else "diverged"

    def numerics(self) -> str:
        """The ties in words: at which steps, by what margin against which bound, judged by whom."""
        return ", ".join(
            f"step {w.index} (gap {w.margin:.3g} <= {w.bound:.3g}, {w.witness_dtype})"
            for w in self.judged
            if w.numerical
        )

    @property
    def partial(self) -> float:
        """Common prefix over oracle length (the paper's partial match)."""
        return common_prefix(self.found, self.expected) / max(len(self.expected), 1)


@dataclass(frozen=True)
class Equivalence:
    rows: tuple[RowEquivalence, ...]

    @property
    def exact_match(self) -> float:
        return sum(r.exact for r in self.rows) / max(len(self.rows), 1)

    @property
    def partial_match(self) -> float:
        return sum(r.partial for r in self.rows) / max(len(self.rows), 1)

    @property
    def ties(self) -> int:
        return sum(len(r.ties) for r in self.rows)

    @property
    def verdict(self) -> str:
        if all(r.exact for r in self.rows):
            return "exact"
        if all(r.equivalent for r in self.rows):
            rows = sum(not r.exact for r in self.rows)
            return f"equivalent modulo numerics ({self.ties} tie(s) in {rows} row(s))"
        return "diverged"


def stop_reason(tokens: list[int] | tuple[int, ...], max_new_tokens: int, eos: int | None) -> str:
    if tokens and eos is not None and tokens[-1] == eos:
        return "eos"
    return "length" if len(tokens) >= max_new_tokens else "short"


def judge(run: Run, prefix: tuple[int, ...], index: int, found: int, expected: int, margin: float) -> Witness:
    """Is the decoder's `found` instead of the oracle's `expected` at `index` a numerical tie?

    With a measured noise floor: gap = logit(expected) - logit(found) in the witness's higher
    precision, scored on the shared prefix; a tie when gap <= the floor's logit bound.
    Without one: the oracle's own top-1/top-2 margin against the dtype's rounding tolerance.
    """
    if run.noise is None:
        return margin_witness(index, margin, run.case.dtype)
    return run.score_divergence(prefix, index, found, expected)


def margin_witness(index: int, margin: float, dtype: str) -> Witness:
    """A tie by the oracle's own top-1/top-2 margin against the dtype's rounding tolerance."""
    return Witness(index, margin, TIE_TOLERANCE[DTYPES[dtype]], f"{dtype} oracle margin")


Judge = Callable[[tuple[int, ...], int, int, int, float], Witness]  # (prefix, index, found, expected, margin)


def tie_aware(
    found: tuple[int, ...],
    oracle: OracleResult,
    prompt: tuple[int, ...],
    max_new_tokens: int,
    eos: int | None,
    judge_tie: Judge,
    oracle_from: Callable[[tuple[int, ...], int], OracleResult],
) -> tuple[tuple[int, ...], tuple[Witness, ...], int]:
    """(the reference `found` is held to, every divergence judged, the first index where they
    part). A decoder's row and an engine's request are compared by this one loop.

    At a divergence `judge_tie` finds within the noise the subject merely took the other side of
    a numerical tie: the reference re-syncs onto its token (the oracle continues from its prefix)
    and the comparison goes on. Any other divergence is a bug.
    """
    reference, margins, judged = oracle.tokens, oracle.margins, []
    i = common_prefix(found, reference)
    while i < min(len(found), len(reference)) and found[i] != eos:
        judged.append(judge_tie(prompt + found[:i], i, found[i], reference[i], margins[i]))
        if not judged[-1].numerical:
            break
        rest = max(max_new_tokens - i - 1, 0)
        resync = oracle_from(prompt + found[: i + 1], rest) if rest else None
        reference = found[: i + 1] + (resync.tokens if resync else ())
        margins = margins[: i + 1] + (resync.margins if resync else ())
        i = common_prefix(found, reference)
    return reference, tuple(judged), i


def compare_request(
    entry: Entry,
    eos: int | None,
    judge_tie: Judge,
    oracle_from: Callable[[tuple[int, ...], int], OracleResult],
) -> RowEquivalence:
    """Tie-aware comparison of one request of a record (`running.record`: a decoder's row, an
    engine's request, a black box's answer) with its oracle (`tie_aware`)."""
    found, oracle = tuple(entry.tokens), entry.oracle
    reference, judged, i = tie_aware(found, oracle, entry.prompt, entry.max_new_tokens, eos, judge_tie, oracle_from)
    ties = tuple(w.index for w in judged if w.numerical)
    stop = stop_reason(found, entry.max_new_tokens, eos)
    diverged = None if found == reference else i
    resynced = reference if ties else None
    return RowEquivalence(entry.request, oracle.tokens, found, oracle.stop, stop, diverged, ties, resynced, judged)


def compare_row(run: Run, r: int) -> RowEquivalence:
    """One row of a decoder run, its ties judged by `judge` (the run's noise floor or the oracle margin)."""
    return compare_request(
        run.record.entries[r],
        run.case.eos_token_id,
        lambda prefix, index, got, want, margin: judge(run, prefix, index, got, want, margin),
        run.oracle_from,
    )


def equivalence(run: Run) -> Equivalence:
    assert run.outputs is not None
    if run.derived.equivalence is None:
        run.derived.equivalence = Equivalence(tuple(compare_row(run, r) for r in range(len(run.outputs))))
    return run.derived.equivalence


def locate(run: Run, request: int, index: int) -> tuple[int | None, RowView | None]:
    """Where generated token `index` of `request` came from.

    Returns the target call that decided it (the last call before the token sits in the
    cache, not counting a call that merely feeds it back as the pending token) and the first
    view that holds it in the cache (or, for a last token, the last view that attends it).
    """
    views = [v for v in row_views(run)[0] if v.request == request]
    if not all(v.consistent for v in views):
        return None, None  # a corrupted cache (see I2) makes the origin ambiguous
    at = len(run.case.prompts[request]) + index
    cached = next((v for v in views if v.past > at), None)
    before = [v for v in views if cached is None or v.call < cached.call]
    deciders = [v.call for v in before if v.past != at]
    holder = cached or next((v for v in reversed(views) if len(v.stream) > at), None)
    return (deciders[-1] if deciders else None), holder


def check_equivalence(run: Run) -> list[Violation]:
    """One violation per diverging row, placed at the target call that decided the first wrong
    token and the slot where that token then enters the cache."""
    if run.outputs is None:
        return check_contract(run)
    out = []
    for r in equivalence(run).rows:
        if r.equivalent:
            continue
        i = r.first_divergence
        assert i is not None
        decided, holder = locate(run, r.row, i) if i < len(r.found) else (None, None)
        if holder is None:
            out.append(replace(divergence(r), call=decided))
            continue
        cached_from = holder.call if holder.call != decided else None
        slot = holder.slots[len(run.case.prompts[r.row]) + i]
        out.append(replace(divergence(r, cached_from), call=decided, row=holder.row, slot=slot))
    return out


def divergence(r: RowEquivalence, cached_from: int | None = None) -> Violation:
    """The first divergence of one request (`r.row` is its id), phrased alike for every subject
    (`cached_from`: the target call from which a decoder's cache holds the wrong token)."""
    i = r.first_divergence
    assert i is not None
    notes = f" after {len(r.ties)} numerical tie(s) at {list(r.ties)}" if r.ties else ""
    if i < len(r.found):
        found = f"token {r.found[i]} at index {i}{notes}"
        if cached_from is not None:
            found += f" (the cache holds it from target call {cached_from})"
    else:
        found = f"the output ending ({r.found_stop}) after {len(r.found)} tokens"
    ref = r.reference
    expected = f"token {ref[i]}" if i < len(ref) else f"the output ending ({r.expected_stop})"
    return Violation(
        "equivalence",
        "first-divergence",
        f"{found} (partial match {r.partial:.2f})",
        f"{expected} at index {i} like the batch-size-1 oracle",
        request=r.row,
        evidence={
            "index": i,
            "found_token": r.found[i] if i < len(r.found) else None,
            "expected_token": ref[i] if i < len(ref) else None,
            "partial": r.partial,
            "ties": list(r.ties),
        },
    )
