"""Rows of a batch are independent samples: correlated rows are a batch bug.

Two rows of one prompt are paired (disjoint pairs, in row order, in every run). While their
histories are identical, independent rows emit the same next token with probability
c = sum_x p(x)^2 (p given that shared history); rows that share a uniform, a residual or a
generator collide far more often. The collisions feed a test martingale (`numerics.fit.
collision_evalue`), rejected at 1 / TEST_ALPHA: a false alarm with probability <= TEST_ALPHA.
Marginally right rows that copy each other fail here, and first: the fits assume independent
tokens, so correlated rows are the cause, and a fit's rejection on them an effect.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from specaudit.checks.distribution import TEST_ALPHA
from specaudit.contracts.violation import Violation
from specaudit.numerics.fit import collision_evalue
from specaudit.running.sampling import SampledRun


@dataclass(frozen=True)
class Comparison:
    """Two rows at one index of identical histories: did they emit the same token, against what chance."""

    run: int
    rows: tuple[int, int]
    index: int
    collided: bool
    chance: float  # sum_x p(x)^2 given the shared history


def paired_rows(prompts: tuple[tuple[int, ...], ...]) -> list[tuple[int, int]]:
    """Disjoint pairs of rows holding the same prompt, in row order."""
    by_prompt: dict[tuple[int, ...], list[int]] = defaultdict(list)
    for row, prompt in enumerate(prompts):
        by_prompt[prompt].append(row)
    return [(rows[i], rows[i + 1]) for rows in by_prompt.values() for i in range(0, len(rows) - 1, 2)]


def has_pairs(sampled: SampledRun) -> bool:
    return bool(paired_rows(sampled.case.case.prompts))


def comparisons(sampled: SampledRun) -> list[Comparison]:
    found = []
    for i, run in enumerate(sampled.runs):
        if run.outputs is None:
            continue
        for a, b in paired_rows(run.case.prompts):
            first, second = run.outputs[a], run.outputs[b]
            chances = (sampled.distribution(i, a) ** 2).sum(-1).tolist()  # [n]
            for n in range(min(len(first), len(second))):
                if first[:n] != second[:n]:
                    break
                if chances[n] < 1 - 1e-12:  # a certain token says nothing about dependence
                    found.append(Comparison(i, (a, b), n, first[n] == second[n], chances[n]))
    return found


def check_row_independence(sampled: SampledRun) -> list[Violation]:
    seen = comparisons(sampled)
    evalue = collision_evalue([c.collided for c in seen], [c.chance for c in seen])
    if evalue < 1 / TEST_ALPHA:
        return []
    collided = [c for c in seen if c.collided]
    expected = sum(c.chance for c in seen)
    first = collided[0]
    return [
        Violation(
            "row-independence",
            "rows-correlated",
            f"rows of one prompt emitting the same token {len(collided)} times in {len(seen)} comparisons of "
            f"identical histories, where independent rows would about {expected:.1f} times (evidence {evalue:.3g})",
            f"independent rows: evidence below {1 / TEST_ALPHA:.3g} (false alarm <= {TEST_ALPHA:.0e})",
            request=first.rows[0],
            evidence={
                "run": first.run,
                "rows": list(first.rows),
                "index": first.index,
                "comparisons": len(seen),
                "collisions": len(collided),
                "expected": expected,
                "evalue": evalue,
            },  # fmt: skip
        )
    ]
