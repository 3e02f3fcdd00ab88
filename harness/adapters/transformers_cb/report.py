"""transformers CB's report entries: one per judged run, one per Hypothesis search.

Entries are of the registry's paged-engine subject (`checks.registry.PAGED`, report kind
"paged engine"), as vLLM's white box is, so a reader finds both paged engines' verdicts, first
violations and coverage in the same fields; the figures after them are this engine's own.
"""

from __future__ import annotations

from typing import Any

from specaudit.adapters.transformers_cb.exercised import coverage, preemptions
from specaudit.adapters.transformers_cb.hypothesis_search import Search
from specaudit.adapters.transformers_cb.verdict import CbVerdict
from specaudit.adapters.transformers_cb.workload import ENGINE, workload_json
from specaudit.artifacts.report import entry
from specaudit.contracts.subjects import TRANSFORMERS_CB

KIND = TRANSFORMERS_CB.report
"""The report kind of every entry ("paged engine", the subject the registry judged)."""


def report_entry(verdict: CbVerdict, subject: dict[str, Any], reproducer: str | None = None) -> dict[str, Any]:
    """One judged run (a smoke workload): its verdict, timings, statuses and the workload itself;
    `reproducer` is the file a failure was written to."""
    figures = {
        "forwards": len(verdict.run.trace.calls),
        "preemptions": preemptions(verdict.run.trace),
        "engine_seconds": round(verdict.run.seconds, 3),
        "judge_seconds": round(verdict.judge_seconds, 3),
        "statuses": dict(verdict.evaluation.statuses),
        "workload_spec": workload_json(verdict.run.workload),
    }
    if reproducer is not None:
        figures["reproducer"] = reproducer
    full = {"engine": ENGINE, "target": "llama", **subject}
    return entry(KIND, full, verdict.passed, verdict.first, None, figures, coverage(verdict))


def search_entry(
    found: Search, seed: int, seconds: float, known: dict[str, str], reproducer: str | None = None
) -> dict[str, Any]:
    """A Hypothesis search over every entry point: examples, time, preemptions, the known
    transformers defects it met (`known`: name -> reproducer), and a failure's minimal workload."""
    subject = {"engine": ENGINE, "entry_point": "all", "target": "llama", "workload": "hypothesis", "seed": seed}
    figures: dict[str, Any] = {"examples": found.examples, "seconds": round(seconds, 2)}
    figures |= {"preemptions": found.preemptions, "known_failures": found.known, "known_defects": known}
    if found.failing is None:
        return entry(KIND, subject, True, None, None, figures, found.coverage)
    figures["minimal_workload"] = workload_json(found.failing.run.workload)
    if reproducer is not None:
        figures["reproducer"] = reproducer
    return entry(KIND, subject, False, found.failing.first, None, figures, found.coverage)
