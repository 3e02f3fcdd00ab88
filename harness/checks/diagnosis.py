"""One report per run: each check's status, and for a failing run its first violated check,
where, and the paper's signature.

The violations are shown cause first: those whose effect can reach a committed token (the
output's own divergence, a fault on a forward whose logits chose committed tokens) before those
the evidence shows change none, such as a mask one column too long that the model trims to the
very mask it should have had. "First" is the first violation that reaches the output, in the
registry's order; only where none does is it the registry's first.

The checks, their order, when each applies and how a violation maps to a signature all live
in the registry (`specaudit.checks.registry`, which lists the signatures); this module only puts
the report together.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass, replace
from typing import Any

from specaudit.checks import equivalence
from specaudit.checks.i2 import row_views
from specaudit.checks.registry import (
    CHECK_ORDER,
    CHECKS,
    NOT_APPLICABLE,
    SIGNATURES,
    CheckOutcome,
    Signature,
    all_violations,
    check_named,
    decided,
    evaluate,
    first_failing,
    i1_signature,
    i2_signature,
    outcome_of,
    single_row,
    violations_in_order,
)
from specaudit.contracts.case import Case
from specaudit.contracts.violation import Violation
from specaudit.fixtures.pairs import is_exact
from specaudit.running.runner import Run

__all__ = [
    "CHECKS",
    "CHECK_ORDER",
    "SIGNATURES",
    "Diagnosis",
    "Finding",
    "all_violations",
    "diagnose",
    "first_cause",
    "i1_signature",
    "i2_signature",
    "reaches_output",
    "single_row",
]

SILENT = "changes no committed token"
"""Said after a shown violation whose effect the evidence shows reaches no committed token."""


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
    silent: tuple[Violation, ...] = ()  # those of `violations` (last there) that change no committed token

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
            "changes_no_committed_token": [i for i, v in enumerate(self.violations) if self.is_silent(v)],
        }

    def is_silent(self, violation: Violation) -> bool:
        return any(violation is v for v in self.silent)

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
            lines += ["  " + line for line in self.rendered_violations()]
        return "\n".join(lines)

    def rendered_violations(self, limit: int = 8) -> list[str]:
        """The violations, cause first, each that changes no committed token saying so."""
        lines = [v.render() + (f" ({SILENT})" if self.is_silent(v) else "") for v in self.violations[:limit]]
        if len(self.violations) > limit:
            lines.append(f"... and {len(self.violations) - limit} more")
        return lines


def reaches_output(run: Run, violation: Violation) -> bool:
    """Whether `violation`'s effect can reach a committed token; False only where the evidence
    shows it cannot. Everything reaches but a mask of the wrong width (I1 'mask-shape') that the
    model trims to exactly what each row should attend (`trimmed_mask_right`). The output's own
    divergence reaches it; so do I2's faults, already held to forwards whose logits can have
    chosen a committed token (`checks.rows.without_wasted`)."""
    if violation.check != "I1" or violation.rule != "mask-shape" or violation.call is None:
        return True
    return not trimmed_mask_right(run, violation.call)


def trimmed_mask_right(run: Run, index: int) -> bool:
    """Whether target call `index`'s mask, as the model applied it, attends exactly each row's own
    history: an exact model (which keeps a wrong-width mask's last P + T columns, as the row views
    read it: `fixtures.transparent.fit_mask`), no other I1 breach at the call, and I2 judged every
    row of it and found none. The width then changed nothing attended, so no logit."""
    call = next((c for c in run.recording.target_calls if c.index == index), None)
    if call is None or call.input_ids is None or not call.sampled or not is_exact(run.case.model):
        return False
    if any(v.call == index and v.rule != "mask-shape" for v in outcome_of("I1", run).violations):
        return False
    i2 = outcome_of("I2", run)
    if i2.status == NOT_APPLICABLE or any(v.call == index for v in i2.violations):
        return False
    bound = {view.row for view in row_views(run)[0] if view.call == index}
    return bound == set(range(call.input_ids.shape[0]))


def cause_first(run: Run, violations: Iterable[Violation]) -> tuple[list[Violation], list[Violation]]:
    """(those that reach the output, those that change no committed token), each in the order given."""
    reaching: list[Violation] = []
    silent: list[Violation] = []
    for v in violations:
        (reaching if reaches_output(run, v) else silent).append(v)
    return reaching, silent


def first_cause(run: Run, through: str | None = None) -> tuple[CheckOutcome, Signature] | None:
    """`registry.first_signature` held to the cause: the first violation (up to check `through`)
    whose effect reaches the output, or the first of all where none does; its check's outcome
    (that violation first) and the signature it maps to. The diagnosis's first violation, so a
    shrinker that keeps a failure class must read this, not the registry's first."""
    first = first_failing(run, through)
    if first is None:
        return None
    cause = next((v for v in violations_in_order(run, through) if reaches_output(run, v)), first.violations[0])
    outcome = outcome_of(cause.check, run)
    ordered = (cause, *(v for v in outcome.violations if v is not cause))
    return replace(outcome, violations=ordered), decided(check_named(cause.check).signature(cause, run), run)


def diagnose(run: Run) -> Diagnosis:
    """Every check's status and, if the run failed, its first violated check and signature: the
    violations cause first (`first_cause`), those that change no committed token last."""
    evaluation = evaluate(run)
    eq = equivalence(run) if run.outputs is not None else None
    exact, partial, ties = (eq.exact_match, eq.partial_match, eq.ties) if eq else (0.0, 0.0, 0)
    verdict = eq.verdict if eq is not None else "contract broken"
    statuses = evaluation.statuses
    skipped = tuple((o.check, o.why) for o in evaluation.outcomes if o.status == NOT_APPLICABLE)
    found = first_cause(run)
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
    reaching, silent = cause_first(run, evaluation.violations)
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
        tuple(reaching + silent),
        statuses,
        skipped,
        tuple(silent),
    )
