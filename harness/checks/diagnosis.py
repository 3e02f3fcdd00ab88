"""One report per run: each check's status, and for a failing run its first violated check,
where, and the paper's signature.

The checks, their order, when each applies and how a violation maps to a signature all live
in the registry (`specaudit.checks.registry`, which lists the signatures); this module only puts
the report together.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from specaudit.checks import equivalence
from specaudit.checks.registry import (
    CHECK_ORDER,
    CHECKS,
    NOT_APPLICABLE,
    SIGNATURES,
    all_violations,
    evaluate,
    first_signature,
    i1_signature,
    i2_signature,
    single_row,
)
from specaudit.contracts.case import Case
from specaudit.contracts.violation import Violation, render
from specaudit.running.runner import Run

__all__ = [
    "CHECKS",
    "CHECK_ORDER",
    "SIGNATURES",
    "Diagnosis",
    "Finding",
    "all_violations",
    "diagnose",
    "i1_signature",
    "i2_signature",
    "single_row",
]


@dataclass(frozen=True)
class Finding:
    """Where a failing subject first went wrong, as every subject's diagnosis says it (a decoder
    run's, an engine's): the first violation, the signature the registry maps it to and why, and
    for an engine the step it broke at."""

    first: Violation
    signature: str
    reason: str
    step: int | None = None  # an engine's step() calls so far, the failing one included (0: before any)

    @property
    def first_check(self) -> str:
        return self.first.check

    @property
    def rule(self) -> str:
        return self.first.rule

    @property
    def request(self) -> int | None:
        return self.first.request

    def where(self) -> dict[str, int | None]:
        """The engine step, then the first violation's place (target call, request, row, slot)."""
        first = self.first
        return {"step": self.step, "call": first.call, "request": first.request, "row": first.row, "slot": first.slot}

    def render(self) -> str:
        names = {"call": "target call"}
        at = ", ".join(f"{names.get(k, k)} {v}" for k, v in self.where().items() if v is not None)
        return (
            f"first violated check: {self.first_check} ({self.rule}){f' at {at}' if at else ''}; "
            f"signature: {self.signature} ({self.reason})"
        )

    def to_json(self) -> dict[str, Any]:
        return {"first_check": self.first_check, "rule": self.rule, **self.where(), "signature": self.signature,
                "reason": self.reason}  # fmt: skip


@dataclass(frozen=True)
class Diagnosis:
    decoder: str
    case: Case
    passed: bool
    verdict: str  # "exact", "equivalent modulo numerics (...)", "diverged", or "violated" (output fine, check broken)
    first_check: str | None
    first: Violation | None
    signature: str | None
    reason: str
    exact_match: float
    partial_match: float
    ties: int
    violations: tuple[Violation, ...]
    checks: tuple[tuple[str, str], ...] = ()  # (check, "pass" | "fail" | "not applicable"), in registry order
    not_applicable: tuple[tuple[str, str], ...] = ()  # (check, why) for the checks that could not judge the run

    @property
    def finding(self) -> Finding | None:
        """The failure's first violation and signature, in the shape an engine's diagnosis has."""
        if self.first is None or self.signature is None:
            return None
        return Finding(self.first, self.signature, self.reason)

    def to_json(self) -> dict[str, Any]:
        return {
            "decoder": self.decoder,
            "case": self.case.to_json(),
            "passed": self.passed,
            "verdict": self.verdict,
            "first_check": self.first_check,
            "first": asdict(self.first) if self.first else None,
            "signature": self.signature,
            "reason": self.reason,
            "exact_match": self.exact_match,
            "partial_match": self.partial_match,
            "ties": self.ties,
            "checks": dict(self.checks),
            "not_applicable": dict(self.not_applicable),
            "violations": [asdict(v) for v in self.violations],
        }

    def render(self) -> str:
        head = f"{self.decoder}: {'PASS' if self.passed else 'FAIL'} ({self.verdict})"
        lines = [head, f"  case: {self.case!r}"]
        lines.append(f"  exact match {self.exact_match:.2f}, partial match {self.partial_match:.2f}, ties {self.ties}")
        why = dict(self.not_applicable)
        statuses = [f"{name} {status}" + (f" ({why[name]})" if name in why else "") for name, status in self.checks]
        if statuses:
            lines.append("  checks: " + ", ".join(statuses))
        if self.finding is not None:
            lines.append(f"  {self.finding.render()}")
            lines += ["  " + line for line in render(list(self.violations)).splitlines()]
        return "\n".join(lines)


def diagnose(run: Run) -> Diagnosis:
    """Every check's status and, if the run failed, its first violated check and signature."""
    evaluation = evaluate(run)
    violations = tuple(evaluation.violations)
    eq = equivalence(run) if run.outputs is not None else None
    exact, partial, ties = (eq.exact_match, eq.partial_match, eq.ties) if eq else (0.0, 0.0, 0)
    verdict = eq.verdict if eq is not None else "contract broken"
    statuses = evaluation.statuses
    skipped = tuple((o.check, o.why) for o in evaluation.outcomes if o.status == NOT_APPLICABLE)
    found = first_signature(run)
    if found is None:
        signature, reason = ("numerical-tie", f"{ties} divergence(s) at numerical ties only") if ties else (None, "")
        return Diagnosis(
            run.decoder,
            run.case,
            True,
            verdict,
            None,
            None,
            signature,
            reason,
            exact,
            partial,
            ties,
            (),
            checks=statuses,
            not_applicable=skipped,
        )
    first, (signature, reason) = found
    if verdict == "exact" and first.check != "contract":
        verdict = "violated"
    return Diagnosis(
        run.decoder,
        run.case,
        False,
        verdict,
        first.check,
        first.violations[0],
        signature,
        reason,
        exact,
        partial,
        ties,
        violations,
        statuses,
        skipped,
    )
