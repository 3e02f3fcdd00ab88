"""The decoder contract as a check: a run whose decoder broke it is judged on nothing else."""

from __future__ import annotations

from specaudit.runner import Run
from specaudit.violation import Violation


def check_contract(run: Run) -> list[Violation]:
    if run.error is None:
        return []
    return [Violation("contract", run.error.rule, run.error.found, run.error.expected, evidence=run.error.evidence)]
