"""Hypothesis over `cb_workloads`: every example run and judged; a new failure shrunk to a minimal workload.

Seeded and without a database, so an audit's search is the same on every machine. A failure
that a known transformers defect explains (`defects.known_defects`) is counted, not raised:
shrinking it would only find the known defect again.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from hypothesis import HealthCheck, given, settings
from hypothesis import seed as hypothesis_seed

from specaudit.adapters.transformers_cb.defects import known_defects
from specaudit.adapters.transformers_cb.driver import run_workload
from specaudit.adapters.transformers_cb.exercised import coverage, preemptions
from specaudit.adapters.transformers_cb.strategies import cb_workloads
from specaudit.adapters.transformers_cb.verdict import CbVerdict, verdict_of
from specaudit.adapters.transformers_cb.workload import ENTRY_POINTS, CbWorkload
from specaudit.checks.coverage import Coverage


class CbFailure(Exception):
    """A failing verdict raised out of the property, so Hypothesis shrinks its workload."""

    def __init__(self, verdict: CbVerdict) -> None:
        super().__init__(verdict.render())
        self.verdict = verdict


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
    """Hypothesis over `cb_workloads` (seeded, no database): every example judged; a failure no
    known defect explains is shrunk to a minimal workload."""
    found = Search()

    @hypothesis_seed(seed)
    @settings(max_examples=examples, database=None, deadline=None, derandomize=False,
              suppress_health_check=list(HealthCheck), print_blob=False)  # fmt: skip
    @given(cb_workloads(entries))
    def prop(workload: CbWorkload) -> None:
        verdict = verdict_of(run_workload(workload))
        if not found.add(verdict) and not verdict.passed:
            raise CbFailure(verdict)

    try:
        prop()
    except CbFailure as failure:
        found.failing = failure.verdict
    return found
