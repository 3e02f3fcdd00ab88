"""Hypothesis over `cb_workloads` (`search.drawn`): every example run and judged; a new failure
shrunk to a minimal workload failing the same way.

Seeded and without a database, so an audit's search is the same on every machine. A failure
that a known transformers defect explains (`defects.known_defects`) is counted, not raised:
shrinking it would only find the known defect again.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from specaudit.adapters.transformers_cb.defects import known_defects
from specaudit.adapters.transformers_cb.driver import run_workload
from specaudit.adapters.transformers_cb.exercised import coverage, preemptions
from specaudit.adapters.transformers_cb.strategies import cb_workloads
from specaudit.adapters.transformers_cb.verdict import CbVerdict, verdict_of
from specaudit.adapters.transformers_cb.workload import ENTRY_POINTS, CbWorkload
from specaudit.checks.coverage import Coverage
from specaudit.contracts.violation import Violation
from specaudit.search.drawn import drawn_search


@dataclass
class Search:
    """What a Hypothesis search over `cb_workloads` found."""

    failing: CbVerdict | None = None  # the shrunk failure (None: every example passed, or failed by a known defect)
    examples: int = 0  # examples run, shrinking's included
    coverage: Coverage = field(default_factory=Coverage)  # merged over the examples
    known: dict[str, int] = field(default_factory=dict)  # known defect -> examples it explained
    preemptions: int = 0  # incarnations after a preemption, over the examples

    def add(self, verdict: CbVerdict) -> tuple[str, ...]:
        """One example's verdict folded in; the known defects that explain its failure (() if none)."""
        self.examples += 1
        self.coverage = self.coverage.merge(coverage(verdict))
        self.preemptions += preemptions(verdict.run.trace)
        known = known_defects(verdict) if not verdict.passed else ()
        for name in known:
            self.known[name] = self.known.get(name, 0) + 1
        return known


def search(seed: int, examples: int, entries: Sequence[str] = ENTRY_POINTS) -> Search:
    """Hypothesis over `cb_workloads` (seeded, no database; `search.drawn`, the search every engine
    adapter shares): every example judged; a failure no known defect explains is shrunk to a
    minimal workload failing the same way (same first check and rule)."""
    found = Search()

    def judge(workload: CbWorkload, shrinking: bool) -> tuple[list[Violation] | None, CbVerdict]:
        verdict = verdict_of(run_workload(workload))
        failing = not found.add(verdict) and not verdict.passed
        return (verdict.violations if failing else None), verdict

    searched = drawn_search(cb_workloads(entries), judge, examples, seed)
    if searched.failure is None and searched.error is not None:
        raise searched.error
    found.failing = None if searched.failure is None else searched.failure.evidence
    return found
