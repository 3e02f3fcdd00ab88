"""The instrumentation overhead is timed only on a run long enough to mean something, never
printed negative, and kept in report.json with the run it was timed on."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest

from specaudit.audits import decoders as audit
from specaudit.audits.decoders import OVERHEAD_BASIS, audit_model, format_table, overhead_basis
from specaudit.audits.decoders import DecoderVerdict as Verdict
from specaudit.contracts.case import Case
from specaudit.running.runner import run_case

EQSPEC = "specaudit.reference.eqspec:EqSpec"
ACCEPT = (True,) * 40


def test_a_short_run_is_no_basis_and_a_long_one_is() -> None:
    """One token, or a contract break, is too little to time; a few rounds of tokens are enough."""
    short = run_case(EQSPEC, Case(((1, 2, 3),), (ACCEPT,), 2, 1, None, 0))
    assert overhead_basis(short) is None
    broken = run_case("specaudit.reference.mutants:forward_bypass", Case(((1, 2, 3),), (ACCEPT,), 2, 12, None, 0))
    assert broken.error is not None and overhead_basis(broken) is None
    long = run_case(EQSPEC, Case(((1, 2, 3), (4, 5)), (ACCEPT, ACCEPT), 2, 12, None, 0))
    basis = overhead_basis(long)
    assert basis is not None and basis["rows"] == 2 and basis["generated_tokens"] == 24
    assert all(basis[k] >= least for k, least in OVERHEAD_BASIS.items()), basis


@dataclass
class Timed:
    seconds: float


def test_a_hooked_run_faster_than_the_plain_one_is_never_negative(monkeypatch: pytest.MonkeyPatch) -> None:
    """Timer noise (hooked 0.44 s against plain 1 s, '-56%') is reported as 0%, not below."""

    def fake_run(spec: str, case: Case, factory: Any = None, instrumented: bool = True) -> Timed:
        return Timed(0.44 if instrumented else 1.0)

    monkeypatch.setattr(audit, "run_case", fake_run)
    assert audit.instrumentation_overhead(EQSPEC, Case(((1,),), (ACCEPT,), 1, 1, None, 0), None) == 0.0


def test_runs_that_fail_early_print_no_overhead() -> None:
    """A decoder failing on every case at once (contract) leaves the overhead unmeasured: n/a in
    the table, None in report.json with no basis; a passing decoder's is timed, with its basis."""
    early = audit_model("specaudit.reference.mutants:forward_bypass", "transparent", 3, 0, expect_failure=True)
    assert early.instrumentation_overhead is None and early.overhead_basis is None
    assert early.to_json()["instrumentation_overhead"] is None
    (line,) = [line for line in format_table([early]).splitlines() if line.startswith("instrumentation overhead")]
    assert line.startswith("instrumentation overhead: n/a (run too short") and "%" not in line, line
    good = audit_model(EQSPEC, "transparent", 3, 0)
    document = good.to_json()
    assert document["instrumentation_overhead"] is not None and document["instrumentation_overhead"] >= 0
    assert document["instrumentation_overhead_basis"] == good.overhead_basis and good.overhead_basis
    assert "median" in format_table([early, good]) and "over 1 of 2 verdicts" in format_table([early, good])


def test_a_verdict_without_a_basis_reads_as_not_measured() -> None:
    verdict = Verdict(EQSPEC, "transparent")
    assert verdict.to_json()["instrumentation_overhead_basis"] is None
