"""The decoder contract as a check: a run whose decoder broke it is judged on nothing else."""

from __future__ import annotations

from specaudit.contracts.violation import Violation
from specaudit.running.runner import Run


def check_contract(run: Run) -> list[Violation]:
    if run.error is None:
        return []
    return [run.error.violation()]
