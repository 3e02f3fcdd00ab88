"""One report per failing run: the first violated check, where, and the paper's signature.

Signatures (paper, sections 4.2 and 6):
  position-id      wrong position ids or misaligned batches; diverges at the first ragged
                   round, low exact and low partial match;
  kv-drift         stale, rejected or pad entries attended; high partial, low exact match;
  bonus            a wrong token choice that shows even at batch size 1 (sampling/bonus error);
  numerical-tie    only divergences at steps whose oracle margin is within the dtype's tolerance;
  output-equivalent  output right, but an invariant or token preservation is broken;
  bookkeeping      output-level errors without a broken invariant (EOS, length, row order);
  contract         the decoder broke the decoder contract.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from typing import Any

from specaudit.case import Case
from specaudit.checks import (
    check_contract,
    check_equivalence,
    check_i1,
    check_i2,
    check_token_preservation,
    equivalence,
)
from specaudit.runner import Run, run_case
from specaudit.violation import Violation, render

CHECK_ORDER = ("contract", "I1", "I2", "equivalence", "token-preservation")
SIGNATURES = ("position-id", "kv-drift", "bonus", "numerical-tie", "output-equivalent", "bookkeeping", "contract")


@dataclass(frozen=True)
class Diagnosis:
    decoder: str
    case: Case
    passed: bool
    verdict: str  # "exact", "equivalent modulo N tie(s)", "diverged", or "violated" (output fine, check broken)
    first_check: str | None
    first: Violation | None
    signature: str | None
    reason: str
    exact_match: float
    partial_match: float
    ties: int
    violations: tuple[Violation, ...]

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
            "violations": [asdict(v) for v in self.violations],
        }

    def render(self) -> str:
        head = f"{self.decoder}: {'PASS' if self.passed else 'FAIL'} ({self.verdict})"
        lines = [head, f"  case: {self.case!r}"]
        lines.append(f"  exact match {self.exact_match:.2f}, partial match {self.partial_match:.2f}, ties {self.ties}")
        if not self.passed:
            lines.append(f"  first violated check: {self.first_check}; signature: {self.signature} ({self.reason})")
            lines += ["  " + line for line in render(list(self.violations)).splitlines()]
        return "\n".join(lines)


def all_violations(run: Run) -> list[Violation]:
    """Every check's evidence, ordered by check, then by target call."""
    found = check_contract(run)
    if not found:
        for check in (check_i1, check_i2, check_equivalence, check_token_preservation):
            found += check(run)
    return sorted(found, key=lambda v: (CHECK_ORDER.index(v.check), v.call if v.call is not None else 1 << 30))


_SLOT = re.compile(r"holding token (\d+).* at position (\d+)")
_WANT = re.compile(r"token (\d+) at position (\d+)")


def i2_signature(first: Violation) -> tuple[str, str]:
    if first.rule == "position-ids":
        return "position-id", "a current input is fed at the wrong position"
    found, want = _SLOT.search(first.found), _WANT.search(first.expected)
    if found and want and int(found.group(2)) < int(want.group(2)):
        return "kv-drift", "an extra slot (stale, rejected or pad) is attended among the row's own"
    if found and want and found.group(1) == want.group(1) and found.group(2) != want.group(2):
        return "position-id", "the right token sits at the wrong position"
    return "kv-drift", "a slot holding another token (stale, rejected or pad) is attended"


def i1_signature(first: Violation) -> tuple[str, str]:
    if first.rule in ("position-shape",):
        return "position-id", f"position ids do not fit the batch ({first.rule})"
    return "kv-drift", f"the mask or cache does not fit the batch, so other slots are attended ({first.rule})"


def equivalence_signature(run: Run, violations: list[Violation]) -> tuple[str, str]:
    row = next(r for r in equivalence(run).rows if not r.equivalent)
    reference = row.reference
    if row.found[: len(reference)] == reference[: len(row.found)]:
        return "bookkeeping", f"row {row.row} stops at the wrong place ({row.found_stop} vs {row.expected_stop})"
    if any(v.rule == "verified-kept" for v in violations):
        return "kv-drift", "verified tokens' KV was dropped from the cache and the output went wrong"
    alone = single_row(run.case, row.row)
    rerun_on = getattr(run, "rerun", None)  # real-model runs know how to re-run themselves
    if rerun_on is not None:
        rerun = rerun_on(alone)
    else:
        rerun = run_case(run.decoder, alone, factory=None if run.instance is None else type(run.instance))
    seen = all_violations(rerun) if rerun.outputs is not None else []
    if seen and seen[0].check in ("I1", "I2"):  # a sampled-out call hid it in the batch run
        signature, why = (i1_signature if seen[0].check == "I1" else i2_signature)(seen[0])
        return signature, f"{why}; seen when row {row.row} runs alone: {seen[0].render()}"
    if rerun.outputs is not None and not all(r.equivalent for r in equivalence(rerun).rows):
        return "bonus", "the wrong token appears even at batch size 1"
    return "bookkeeping", "the output goes wrong only in a batch, with every invariant intact"


def single_row(case: Case, row: int) -> Case:
    return Case(
        (case.prompts[row],),
        (case.accept[row],),
        case.num_draft_tokens,
        case.max_new_tokens,
        case.eos_token_id,
        case.pad_token_id,
        0,
        case.model,
        case.draft,
        case.dtype,
    )


def diagnose(run: Run) -> Diagnosis:
    """The run's verdict and, if it failed, its first violated check and signature."""
    violations = all_violations(run)
    eq = equivalence(run) if run.outputs is not None else None
    exact, partial, ties = (eq.exact_match, eq.partial_match, eq.ties) if eq else (0.0, 0.0, 0)
    verdict = eq.verdict if eq is not None else "contract broken"
    if not violations:
        signature, reason = ("numerical-tie", f"{ties} divergence(s) at numerical ties only") if ties else (None, "")
        return Diagnosis(run.decoder, run.case, True, verdict, None, None, signature, reason, exact, partial, ties, ())
    first = violations[0]
    if first.check == "contract":
        signature, reason = "contract", first.rule
    elif first.check == "I1":
        signature, reason = i1_signature(first)
    elif first.check == "I2":
        signature, reason = i2_signature(first)
    elif first.check == "equivalence":
        signature, reason = equivalence_signature(run, violations)
    else:
        signature, reason = "output-equivalent", "the output is right but drafts were lost or kept wrongly"
    if verdict == "exact" and first.check != "contract":
        verdict = "violated"
    return Diagnosis(
        run.decoder,
        run.case,
        False,
        verdict,
        first.check,
        first,
        signature,
        reason,
        exact,
        partial,
        ties,
        tuple(violations),
    )
