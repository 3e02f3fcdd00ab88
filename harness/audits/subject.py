"""What the audit needs of one kind of subject (`SubjectDriver`) and one unit of its work (`Item`).

Apart from `specaudit.audits.plan`, which lists the drivers, so that a driver's own module
(`specaudit.audits.transformers_cb`) builds its items without importing the plan.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from specaudit.audits.verdict import Progress, Verdict
from specaudit.config.settings import AuditSettings, GateSettings
from specaudit.config.xfails import KnownFailures
from specaudit.contracts import subjects
from specaudit.search.driver import SHRINK_BUDGET


@dataclass(frozen=True)
class Item:
    """One independent search of the audit: a subject of `kind` (a `SubjectDriver`'s) on a model."""

    spec: str
    model: str
    expect_failure: bool
    examples: int
    seed: int
    kind: str = subjects.DECODER.name  # a row of `contracts.subjects.KINDS`, its driver's
    known: KnownFailures = field(default_factory=KnownFailures)
    shrink_budget: int = SHRINK_BUDGET
    strict_efficiency: bool = False  # --strict-efficiency: an efficiency finding fails a decoder


Run = Callable[[Item, Progress | None], Verdict]
"""One item to its verdict; the progress is the kind's own when the item runs in this process."""


@dataclass(frozen=True)
class SubjectDriver:
    """What the audit and the gate need of one kind of subject (see the module docstring)."""

    kind: str
    audit_plan: Callable[[AuditSettings], list[Item]]
    gate_plan: Callable[[GateSettings], list[Item]]
    load: Callable[[str], Any]
    run: Run
    table: Callable[[list[Any]], str]
    headline: Callable[[list[Item]], str]  # the audit's first line's words for this kind's items
    cost: float = 1.0  # an item's cost against a decoder's on the same model (only the start order uses it)

    def __post_init__(self) -> None:
        subjects.named(self.kind)  # a kind the one table lacks fails here, when the driver is made
