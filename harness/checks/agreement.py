"""The run's rows against the batch-size-1 oracle: the facts equivalence reports and I2 reads.

Tie-aware: a divergence is a numerical tie when the two tokens are within the noise batched
arithmetic can cause, and the comparison then re-syncs onto the decoder's token. On real
models the noise is measured (`Run.noise`, a `specaudit.numerics.calibration.NoiseFloor`) and the
two tokens' logits are compared in a higher-precision teacher-forced score of the shared
prefix (`judge_divergence`); on the built-in models, whose measured noise is nil, the
oracle's top-1/top-2 margin is held to the dtype's rounding tolerance.

A module of its own (no row binding imported) so that the row follower can read each request
against the same re-synced oracle the equivalence check reports (`specaudit.checks.rows`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from specaudit.checks.cache import cached
from specaudit.numerics.calibration import Witness
from specaudit.numerics.tolerance import DTYPES, TIE_TOLERANCE
from specaudit.reference.oracle import OracleResult
from specaudit.running.record import Entry
from specaudit.running.runner import Run


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token sequences."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


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
    complete: bool = True  # False: the oracle was cut at the first divergence (`answer_oracle(cut=True)`)

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
        """Common prefix over oracle length (the paper's partial match). A cut oracle's length past
        its divergence is unknown: the longer of it and the output stands in for it, so the figure
        never rises above 1 nor credits the cut for a short output."""
        whole = len(self.expected) if self.complete else max(len(self.expected), len(self.found))
        return common_prefix(self.found, self.expected) / max(whole, 1)


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


def witness(run: Run, prefix: tuple[int, ...], index: int, found: int, expected: int, margin: float) -> Witness:
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


TieJudge = Callable[[tuple[int, ...], int, int, int, float], Witness]  # (prefix, index, found, expected, margin)


def tie_aware(
    found: tuple[int, ...],
    oracle: OracleResult,
    prompt: tuple[int, ...],
    max_new_tokens: int,
    eos: int | None,
    judge_tie: TieJudge,
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
    judge_tie: TieJudge,
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
    return RowEquivalence(
        entry.request, oracle.tokens, found, oracle.stop, stop, diverged, ties, resynced, judged, oracle.complete
    )


def compare_row(run: Run, r: int) -> RowEquivalence:
    """One row of a decoder run, its ties judged by `witness` (the run's noise floor or the oracle margin)."""
    return compare_request(
        run.record.entries[r],
        run.case.eos_token_id,
        lambda prefix, index, got, want, margin: witness(run, prefix, index, got, want, margin),
        run.oracle_from,
    )


def equivalence(run: Run) -> Equivalence:
    assert run.outputs is not None
    outputs = run.outputs
    return cached(run, "equivalence", "equivalence",
                  lambda: Equivalence(tuple(compare_row(run, r) for r in range(len(outputs)))))  # fmt: skip
