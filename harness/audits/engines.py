"""Engines through the engine state machine (`specaudit.search.engine_machine`): the driver, its
verdict and the plan.

`audit_engine` runs the machine on an engine and a built-in model; a failure (Hypothesis's
shrinking, unless off) is then delta-debugged to the shortest rule sequence that still fails
(`specaudit.search.ddmin.minimize_ops`).
"""

from __future__ import annotations

import functools
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, ClassVar

from specaudit.artifacts.report import entry
from specaudit.artifacts.reproducer import EVIDENCE_LIMIT
from specaudit.artifacts.tables import engine_table, rules_block
from specaudit.audits.regression import write_engine_failure
from specaudit.checks.diagnosis import Finding
from specaudit.config.settings import AuditSettings
from specaudit.config.xfails import KnownFailures
from specaudit.contracts import subjects
from specaudit.contracts.violation import Violation, render
from specaudit.reference.engine_mutants import ENGINE_CATALOG
from specaudit.search.ddmin import MinimizedOps, ReproducerPasses, minimize_ops
from specaudit.search.engine_machine import DEFAULT_ENGINES, MachineRun, run_machine
from specaudit.search.engine_replay import diagnose_engine

REPORT_KIND = str(subjects.ENGINE.report)
"""The kind of an engine's report entry (`contracts.subjects.ENGINE`)."""
ENGINE_STEPS = 12
"""Rules per generated run of the engine state machine (the conformance suite's)."""

PLANTED_ENGINE_EXAMPLES = 30
"""Search budget for a planted engine bug (the `ci` profile's): a bound, the run stops at the first failure."""

ENGINE_MINIMIZE_BUDGET = 200
"""Replays `minimize_ops` may spend on a failing engine's rules after the machine's own shrinking."""


@dataclass
class EngineVerdict:
    """One engine through the state machine: the run, and its failure's rules delta-debugged."""

    kind: ClassVar[str] = subjects.ENGINE.name

    engine: str
    run: MachineRun
    expect_failure: bool = False  # a planted engine bug: the audit passes when it is caught
    minimized: MinimizedOps | None = None
    model: str = "transparent"
    known: tuple[tuple[str, str], ...] = ()  # (check, rule) when --xfails lists every violation

    @property
    def passed(self) -> bool:
        return self.run.passed or bool(self.known)

    @property
    def as_expected(self) -> bool:
        return self.passed != self.expect_failure

    @property
    def reproducer(self) -> dict[str, Any] | None:
        """The rules kept, in their JSON form (what report.json and the reproducer writers take)."""
        if self.minimized is not None:
            return self.minimized.reproducer.to_json()
        return None if self.run.failure is None else self.run.failure.reproducer.to_json()

    @property
    def violations(self) -> list[Violation]:
        if self.minimized is not None:
            return self.minimized.violations
        return [] if self.run.failure is None else self.run.failure.violations

    @functools.cached_property
    def diagnosis(self) -> Finding | None:
        """The failure's diagnosis (first check, where, signature) on the reproducer kept."""
        return diagnose_engine(self.violations, self.reproducer) if self.violations and self.reproducer else None

    def to_json(self) -> dict[str, Any]:
        first = self.violations[0] if self.violations else None
        return {
            "kind": REPORT_KIND,
            "engine": self.engine,
            "model": self.model,
            "expect_failure": self.expect_failure,
            "as_expected": self.as_expected,
            "runs": self.run.runs,
            "rules": self.run.rules,
            "seconds": round(self.run.seconds, 3),
            "runs_to_failure": self.run.runs_to_failure,
            "shrunk_rules": self.run.shrunk_rules,
            "minimized_rules": None if self.reproducer is None else len(self.reproducer["ops"]),
            "first_check": first.check if first else None,
            "rule": first.rule if first else None,
            "diagnosis": None if self.diagnosis is None else self.diagnosis.to_json(),
            "events": {what: round(share, 3) for what, share in self.run.events.items()},
            "violations": [asdict(v) for v in self.violations[:EVIDENCE_LIMIT]],
            "known_failures": [{"check": c, "rule": r} for c, r in self.known],
            "reproducer": self.reproducer,
            "coverage": self.run.coverage.to_json(),
        }

    @property
    def finding(self) -> Finding | None:
        return self.diagnosis

    def report_entry(self) -> dict[str, Any]:
        f, subject = self.finding, {"engine": self.engine, "model": self.model}
        first, signature = (f.first, f.signature) if f else (None, None)
        return entry(REPORT_KIND, subject, self.passed, first, signature, self.to_json(), self.run.coverage)

    def details(self) -> list[str]:
        """An unexpected failure's minimal rule sequence: its violations and its rules."""
        if self.known or not self.violations or self.expect_failure:
            return []
        return rules_block(self.report_entry(), render(self.violations))

    def status(self) -> str:
        first = self.violations[0] if self.violations else None
        status = "PASS" if first is None else f"FAIL ({first.check} {first.rule})"
        return f"engine {self.engine} on {self.model}: {status}"

    def file_name(self) -> str:
        return f"{self.engine}-{self.model}-engine"

    def write_reproducers(self, directory: Path, summary: str) -> list[Path]:
        """Its minimal rule sequence's reproducer and regression test ([] when it passed)."""
        if self.reproducer is None:
            return []
        return write_engine_failure(directory, self.file_name(), self.reproducer, self.violations, summary)

    def mark_known(self, known: KnownFailures) -> None:
        """Record the failure as known when `known` lists every one of its violations."""
        listed = [known.matches(self.engine, self.model, x.check, x.rule) for x in self.violations]  # marks used
        if listed and all(listed):
            self.known = tuple(sorted({(x.check, x.rule) for x in self.violations}))


def format_engine_table(verdicts: list[EngineVerdict]) -> str:
    """The engines' table (`specaudit.artifacts.tables.engine_table`) from their report entries."""
    return engine_table([v.report_entry() for v in verdicts], [v.details() for v in verdicts])


def audit_engine(
    spec: str,
    examples: int,
    seed: int,
    *,
    expect_failure: bool = False,
    shrink: bool = True,
    model: str = "transparent",
) -> EngineVerdict:
    """The state machine on `spec` and a built-in `model` (Hypothesis shrinks a failure unless
    `shrink` is off), then the failing rules delta-debugged (`minimize_ops`): a reproducer as
    short as both can make it."""
    run = run_machine(spec, examples, ENGINE_STEPS, seed=seed, shrink=shrink, model=model)
    verdict = EngineVerdict(spec, run, expect_failure, model=model)
    failure = verdict.run.failure
    if failure is not None and failure.reproducer.ops:
        try:
            verdict.minimized = minimize_ops(failure.reproducer, ENGINE_MINIMIZE_BUDGET)
        except ReproducerPasses:
            pass  # the failure did not replay alone (a flaky engine): keep the machine's own
    return verdict


def planted_engine_bugs() -> list[str]:
    return [f"specaudit.reference.engine_mutants:{name}" for name in ENGINE_CATALOG]


def engine_plan(settings: AuditSettings) -> list[tuple[str, bool, str]]:
    """(engine, expect_failure, model) in run order: the engines named with --engine on every
    model; with neither --decoder nor --engine, the reference engines on every model (must
    pass) and the planted engine bugs on the first model (must be caught); with --decoder alone, none."""
    if settings.engines:
        return [(spec, False, model) for spec in settings.engines for model in settings.models]
    if settings.decoders:
        return []
    planted = [(spec, True, settings.models[0]) for spec in planted_engine_bugs()]
    return [(spec, False, model) for spec in DEFAULT_ENGINES for model in settings.models] + planted
