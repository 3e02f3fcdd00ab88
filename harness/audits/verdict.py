"""One verdict protocol for every subject an audit judges, and the per-check statuses over runs.

A decoder on a built-in model (`specaudit.audits.decoders.DecoderVerdict`), an engine through the
state machine (`specaudit.audits.engines.EngineVerdict`), and any further subject kind (a paged
engine, a black box) answer the same questions: did it pass, was that what the plan expected,
what is its report entry (`specaudit.artifacts.report.entry`: the shared verdict fields, then the
kind's own figures), what evidence to print under its kind's table, and which reproducers to
write. The audit, the gate, the tables and report.json read verdicts through this protocol only.
"""

from __future__ import annotations

import statistics
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from specaudit.artifacts.report import LEVELS
from specaudit.checks.registry import CHECKS, FAIL, NOT_APPLICABLE, Evaluation, check_named
from specaudit.config.xfails import KnownFailures
from specaudit.contracts.violation import Violation


class Verdict(Protocol):
    """One subject on one model (or configuration), judged."""

    kind: str  # the report entry's kind and the plan's subject kind ("decoder", "engine", ...)
    expect_failure: bool  # a planted bug: the audit passes when it is caught

    @property
    def passed(self) -> bool: ...

    @property
    def as_expected(self) -> bool: ...

    def report_entry(self) -> dict[str, Any]:
        """report.json's entry; the tables and the JUnit testcase are rendered from it."""
        ...

    def details(self) -> list[str]:
        """Lines under the kind's table: the evidence of an unexpected failure ([] when none)."""
        ...

    def status(self) -> str:
        """The progress line's words: "X on MODEL: PASS", "engine X on MODEL: FAIL (I2 rule)"."""
        ...

    def write_reproducers(self, directory: Path, summary: str) -> list[Path]:
        """Each failure's reproducer (and regression test) under `directory`; the paths written."""
        ...

    def mark_known(self, known: KnownFailures) -> None:
        """Take the known failures the parent process matches after the run (an engine's); a
        subject whose worker matched its own (a decoder's search) does nothing."""
        ...


Writer = Callable[[Path, str], list[Path]]
"""(directory, summary) -> the reproducer files written there."""


@dataclass
class EntryVerdict:
    """A verdict made of a report entry: what a driver that returns report entries gives the audit
    (a paged engine, a black box). `kind` is its `SubjectDriver`'s (the entry's own kind may be a
    broader one, "engine"); `details` the lines under its table; `writer` its reproducers."""

    kind: str
    entry: dict[str, Any]
    expect_failure: bool = False
    lines: list[str] = field(default_factory=list)
    writer: Writer | None = None
    label: str = ""  # the progress line's name for it (default: `subject_name` of the entry)

    @property
    def passed(self) -> bool:
        return bool(self.entry["passed"])

    @property
    def as_expected(self) -> bool:
        return self.passed != self.expect_failure

    def report_entry(self) -> dict[str, Any]:
        return dict(self.entry, expect_failure=self.expect_failure, as_expected=self.as_expected)

    def details(self) -> list[str]:
        return [] if self.passed or self.expect_failure else list(self.lines)

    def status(self) -> str:
        first = self.entry.get("first") or {}
        status = "PASS" if self.passed else f"FAIL ({first.get('check')} {first.get('rule')})"
        return f"{self.kind} {self.label or subject_name(self.entry)}: {status}"

    def write_reproducers(self, directory: Path, summary: str) -> list[Path]:
        return [] if self.writer is None else self.writer(directory, summary)

    def mark_known(self, known: KnownFailures) -> None:
        """Nothing: a driver that knows of known failures says so in its entries."""


EFFICIENCY_CHECKS = frozenset(check.name for check in CHECKS if check.cost)
"""Checks of a design's cost, not of its correctness (the registry's `Check.cost`; the paper: token
preservation is what a design keeps of the work done; output equivalence and the invariants are
what it must get right). A finding of these alone is its own verdict level, "efficiency": reported,
not fatal unless --strict-efficiency asks."""


def efficiency_only(violations: Iterable[Violation]) -> bool:
    """Whether these violations are an efficiency finding: some, and every one of an efficiency check."""
    return cost_checks_only(v.check for v in violations)


def cost_checks_only(checks: Iterable[str]) -> bool:
    """Some checks, every one of them an efficiency check (`EFFICIENCY_CHECKS`)."""
    names = set(checks)
    return bool(names) and names <= EFFICIENCY_CHECKS


def level_of(failures: Iterable[Iterable[Violation]]) -> str:
    """The level of a verdict whose failures (each its minimal case's violations) are these:
    "fail" if one breaks correctness, "efficiency" if all are efficiency findings, else "pass"."""
    kinds = ["efficiency" if efficiency_only(f) else "fail" for f in failures]
    return max(kinds, key=LEVELS.index, default="pass")


def subject_name(entry: dict[str, Any]) -> str:
    """ "X on MODEL" from an entry's subject (its kind's key, else its first value)."""
    subject = entry["subject"]
    name = subject.get(entry["kind"], next(iter(subject.values()), "?"))
    return f"{name} on {subject['model']}" if "model" in subject else str(name)


STATUS_RANK = {"n/a": 0, "pass": 1, "xfail": 2, "efficiency": 3, "fail": 4}
"""Aggregation over runs: the highest rank seen wins (one failing run fails the check). An
efficiency check's failure reads "efficiency" (`EFFICIENCY_CHECKS`)."""


def status_word(check: str, status: str, violations: Sequence[Violation], known: Callable[[Violation], bool]) -> str:
    """One check's status in the table's words: "pass", "fail", "n/a", "xfail" for a failed check
    whose violations are all known failures, "efficiency" for a failed efficiency check."""
    if status == NOT_APPLICABLE:
        return "n/a"
    if status == FAIL and violations and all(known(v) for v in violations):
        return "xfail"
    return "efficiency" if status == FAIL and check in EFFICIENCY_CHECKS else status


def run_statuses(
    evaluation: Evaluation, known: Callable[[Violation], bool], target_calls: int | None = None
) -> dict[str, str]:
    """One run's check statuses (`status_word`). A check judged on every target call reads "n/a",
    not "pass", on a run whose `target_calls` is 0: it saw nothing to judge."""
    out = {}
    for outcome in evaluation.outcomes:
        status = status_word(outcome.check, outcome.status, outcome.violations, known)
        if target_calls == 0 and status == "pass" and check_named(outcome.check).per_call:
            status = "n/a"
        out[outcome.check] = status
    return out


def minimal_case_statuses(
    checks: Iterable[tuple[str, str]], violations: Iterable[Violation], known: Callable[[Violation], bool]
) -> dict[str, str]:
    """A minimal case's check statuses (`Diagnosis.checks`, `.violations`) in `status_word`'s words:
    merged into the verdict's, so that its checks table and the minimal case under it say the same
    (the minimal case is re-run to be diagnosed, and the table must count that run too)."""
    violations = list(violations)
    return {check: status_word(check, status, [v for v in violations if v.check == check], known)
            for check, status in checks}  # fmt: skip


def merge_statuses(per_run: Iterable[dict[str, str]]) -> dict[str, str]:
    """Each check over the runs: the highest `STATUS_RANK` seen ("not applicable" reads "n/a")."""
    merged: dict[str, str] = {}
    for statuses in per_run:
        for check, status in statuses.items():
            status = "n/a" if status == NOT_APPLICABLE else status
            merged[check] = max(merged.get(check, "n/a"), status, key=STATUS_RANK.__getitem__)
    return merged


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


class Progress:
    """One subject kind's progress on stderr: a one-line bar while a search runs (`tick`, on a
    terminal) and a line per finished verdict."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.total, self.done, self.enabled = total, 0, enabled
        self.tty = sys.stderr.isatty()

    def tick(self, label: str) -> None:
        if self.enabled and self.tty:
            filled = int(20 * self.done / max(self.total, 1))
            bar = "#" * filled + "-" * (20 - filled)
            print(f"\r[{bar}] {self.done}/{self.total} {label[:70]:<70}", end="", file=sys.stderr, flush=True)

    def finish_item(self, verdict: Verdict) -> None:
        self.done += 1
        if self.enabled:
            outcome = "as expected" if verdict.as_expected else "UNEXPECTED"
            line = f"[{self.done}/{self.total}] {verdict.status()}, {outcome}"
            print(("\r" if self.tty else "") + f"{line:<100}", file=sys.stderr, flush=True)
