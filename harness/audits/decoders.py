"""Decoders on the built-in models: the search, its verdict, the instrumentation's cost, the plan.

`specaudit audit` and `specaudit gate` both run `audit_model` for each decoder x model:
Hypothesis-generated cases until the first failure (`specaudit.search.driver`), every check on every
run, the failing case shrunk and diagnosed. A `DecoderVerdict` accumulates what the runs measured
and, per check of the registry, its status over the runs: "fail" if any run failed it,
"xfail" if its only failures are listed known failures, "pass" if some run passed it and
none failed, "n/a" if it applied to no run (`specaudit.checks.registry.combined`, plus xfail).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from specaudit.artifacts.report import entry, first_fields
from specaudit.artifacts.reproducer import identifier
from specaudit.artifacts.tables import decoder_table
from specaudit.audits.regression import write_failure
from specaudit.audits.verdict import (
    Progress,
    efficiency_only,
    level_of,
    median,
    merge_statuses,
    minimal_case_statuses,
    run_statuses,
)
from specaudit.checks import equivalence
from specaudit.checks.coverage import Coverage, coverage_of_run
from specaudit.checks.diagnosis import Diagnosis, Finding, diagnose
from specaudit.checks.registry import evaluate
from specaudit.config.settings import AuditSettings
from specaudit.config.xfails import KnownFailures
from specaudit.contracts import subjects
from specaudit.contracts.builtins import DEFAULT_DECODERS
from specaudit.contracts.case import Case
from specaudit.contracts.decoder import load_decoder
from specaudit.contracts.sampling import declares_sampling
from specaudit.contracts.violation import Violation
from specaudit.reference.mutants import CATALOG
from specaudit.running.runner import Run, run_case
from specaudit.search.driver import MINIMIZE_BUDGET, SHRINK_BUDGET, search

PLANTED_BUG_EXAMPLES = 300
"""Search budget for a planted bug: the search stops at its first failure, so this is a bound."""

REPORT_KIND = str(subjects.DECODER.report)
"""The kind of a decoder's report entry (`contracts.subjects.DECODER`)."""
PLANTED_SHRINK_BUDGET = 30
"""Hypothesis shrink runs for a planted bug (a decoder under test gets the search's 150). Its
shrinker costs far more than the runs on the long cases some bugs are first caught on; with
delta debugging after it every planted bug still shrinks to the rows its catalog entry
expects (one, two when it needs a batch), 22 of 31 to the very case 150 runs give, at a third
of the time (bench/results/audit_time.md)."""

MAX_FAILURES = 8
"""Distinct failures one decoder x model search reports at most (`search`'s `max_failures`)."""


@dataclass
class DecoderVerdict:
    """One decoder on one model: what ran, each check's status and, on a failure that is not
    a known one, the diagnosis of its minimal case."""

    kind: ClassVar[str] = subjects.DECODER.name

    decoder: str
    model: str
    expect_failure: bool = False  # a planted bug: the audit passes when it is caught
    examples: int = 0
    measured: int = 0  # the cases whose run returned outputs: what exact and partial match are over
    seconds: float = 0.0
    exact_rows: int = 0
    rows: int = 0
    partial_sum: float = 0.0
    tokens_per_second: list[float] = field(default_factory=list)
    outside_share: list[float] = field(default_factory=list)
    instrumentation_overhead: float | None = None  # None: no run long enough to time (`long_enough`)
    overhead_basis: dict[str, int] | None = None  # the run it was timed on: rows, target calls, generated tokens
    diagnosis: Diagnosis | None = None  # the first failure's (the simplest found first)
    failures: list[Diagnosis] = field(default_factory=list)  # every distinct failure, `diagnosis` first
    checks: dict[str, str] = field(default_factory=dict)  # check -> "pass" / "fail" / "xfail" / "n/a"
    known: set[tuple[str, str]] = field(default_factory=set)  # (check, rule) of known failures met
    coverage: Coverage = field(default_factory=Coverage)  # what the runs exercised (`checks.coverage`)
    strict_efficiency: bool = False  # --strict-efficiency: an efficiency finding fails the verdict

    @property
    def level(self) -> str:
        """ "fail" if a failure breaks correctness, "efficiency" if every one is a finding of cost
        (token preservation alone: the output and invariants hold), else "pass"."""
        return level_of(d.violations for d in self.diagnoses())

    @property
    def passed(self) -> bool:
        return self.level == "pass" or (self.level == "efficiency" and not self.strict_efficiency)

    @property
    def as_expected(self) -> bool:
        """A planted bug is as expected when reported at any level (a planted token-preservation
        bug at "efficiency"); anything else when it passed."""
        return self.level != "pass" if self.expect_failure else self.passed

    def fatal(self) -> list[Diagnosis]:
        """The failures that fail the verdict: those of correctness, and the efficiency findings
        under --strict-efficiency (correctness first: `audit_model` orders them)."""
        return [d for d in self.diagnoses() if self.strict_efficiency or not efficiency_only(d.violations)]

    @property
    def exact_match(self) -> float | None:
        return self.exact_rows / self.rows if self.rows else None

    def record(self, run: Run, statuses: dict[str, str], known: list[Violation]) -> None:
        """Fold one run in: its rows, its speed, its check statuses, the known failures it met and
        what it exercised."""
        self.examples += 1
        self.checks = merge_statuses([self.checks, statuses])
        self.coverage = self.coverage.merge(coverage_of_run(run))
        self.known.update((v.check, v.rule) for v in known)
        if run.outputs is None:
            return
        self.measured += 1
        rows = equivalence(run).rows
        self.rows += len(rows)
        self.exact_rows += sum(r.exact for r in rows)
        self.partial_sum += sum(r.partial for r in rows)
        self.tokens_per_second.append(run.tokens_per_second)
        self.outside_share.append(run.outside_models_share)

    def take_failures(self, found: list[Diagnosis], known: Callable[[Violation], bool]) -> None:
        """The minimal cases' diagnoses, one per failure class, correctness failures first; their check
        statuses are folded into the verdict's, so that the checks table and each minimal case under
        it say the same (a minimal case is a run of its own, which the search's runs need not include)."""
        self.failures = sorted(distinct(found), key=lambda d: efficiency_only(d.violations))
        for d in self.failures:
            self.checks = merge_statuses([self.checks, minimal_case_statuses(d.checks, d.violations, known)])
        self.diagnosis = self.failures[0] if self.failures else None

    def to_json(self) -> dict[str, Any]:
        return {
            "decoder": self.decoder,
            "model": self.model,
            "expect_failure": self.expect_failure,
            "as_expected": self.as_expected,
            "cases": self.examples,
            "measured_cases": self.measured,
            "exact_rows": self.exact_rows,
            "rows": self.rows,
            "seconds": round(self.seconds, 3),
            "exact_match": self.exact_match,
            "partial_match": self.partial_sum / self.rows if self.rows else None,
            "tokens_per_second": median(self.tokens_per_second),
            "outside_models_share": median(self.outside_share),
            "instrumentation_overhead": self.instrumentation_overhead,
            "instrumentation_overhead_basis": self.overhead_basis,
            "checks": dict(self.checks),
            "known_failures": [{"check": c, "rule": r} for c, r in sorted(self.known)],
            "diagnosis": self.diagnosis.to_json() if self.diagnosis else None,
            "failures": [failure_json(d, failure_name(self, i)) for i, d in enumerate(self.failures)],
            "coverage": self.coverage.to_json(),
        }

    @property
    def finding(self) -> Finding | None:
        """Where the minimal case first went wrong, the shape an engine verdict's diagnosis has."""
        return None if self.diagnosis is None else self.diagnosis.finding

    def report_entry(self) -> dict[str, Any]:
        f, subject = self.finding, {"decoder": self.decoder, "model": self.model}
        first, signature = (f.first, f.signature) if f else (None, None)
        return entry(REPORT_KIND, subject, self.passed, first, signature, self.to_json(), self.coverage, self.level)

    def diagnoses(self) -> list[Diagnosis]:
        """Every distinct failure found, the first first ([] when it passed)."""
        return self.failures or ([self.diagnosis] if self.diagnosis is not None else [])

    def details(self) -> list[str]:
        """Each unexpected failure's minimal case, rendered with its evidence."""
        if self.diagnosis is None or self.expect_failure:
            return []
        lines: list[str] = []
        for i, d in enumerate(self.diagnoses()):
            of = f" (failure {i + 1} of {len(self.failures)})" if len(self.failures) > 1 else ""
            waste = efficiency_only(d.violations) and not self.strict_efficiency
            what = "efficiency finding (not fatal), minimal case" if waste else "minimal failing case"
            lines += ["", f"{self.decoder} on {self.model}: {what}{of}"]
            lines += ["  " + line for line in d.render().splitlines()[1:]]
        return lines

    def status(self) -> str:
        d, word = self.diagnosis, "EFFICIENCY" if self.passed else "FAIL"
        status = "PASS" if d is None else f"{word} ({d.signature})"
        if len(self.failures) > 1:
            signatures = ", ".join(str(f.signature) for f in self.failures)
            status = f"{word} ({len(self.failures)} distinct failures: {signatures})"
        return f"{self.decoder} on {self.model}: {status}"

    def write_reproducers(self, directory: Path, summary: str) -> list[Path]:
        """Per distinct failure, its reproducer and regression test (`failure_name`)."""
        return [
            p
            for i, d in enumerate(self.diagnoses())
            for p in write_failure(directory, failure_name(self, i), d, summary)
        ]

    def mark_known(self, known: KnownFailures) -> None:
        """Nothing: the search matched its known failures in the worker, and went on past them."""


def format_table(verdicts: list[DecoderVerdict]) -> str:
    """The decoders' table (`specaudit.artifacts.tables.decoder_table`) from their report entries."""
    return decoder_table([v.report_entry() for v in verdicts], [v.details() for v in verdicts], OVERHEAD_BASIS)


# ---------------------------------------------------------------------------------------
# What the instrumentation costs, timed on one long enough run per verdict

OVERHEAD_BASIS = {"target_calls": 3, "generated_tokens": 8}
"""The least a run must do to be timed: a run that breaks the contract or ends after a round or
two measures start-up and timer noise (-56%, 100%), not the instrumentation."""


def overhead_basis(run: Run) -> dict[str, int] | None:
    """What `run` did (rows, target calls, generated tokens) if it is long enough to time the
    instrumentation on (`OVERHEAD_BASIS`), else None."""
    basis = {
        "rows": run.case.batch_size,
        "target_calls": len(run.recording.target_calls),
        "generated_tokens": run.generated_tokens,
    }
    enough = run.error is None and all(basis[k] >= least for k, least in OVERHEAD_BASIS.items())
    return basis if enough else None


def instrumentation_overhead(spec: str, case: Case, factory: Any, repeats: int = 2) -> float:
    """Hooked over plain decoder time on one case, minus 1: the best of `repeats` interleaved
    pairs, timed warm (after the search's own run of the case), so one stall does not decide it.
    Never negative: a hooked run faster than the plain one is timer noise."""
    plain, hooked = [], []
    for _ in range(repeats):
        plain.append(run_case(spec, case, factory=factory, instrumented=False).seconds)
        hooked.append(run_case(spec, case, factory=factory).seconds)
    return max(0.0, min(hooked) / max(min(plain), 1e-9) - 1.0)


# ---------------------------------------------------------------------------------------
# The search of one decoder on one model


def audit_model(
    spec: str,
    model: str,
    examples: int,
    seed: int,
    *,
    progress: Progress | None = None,
    expect_failure: bool = False,
    known: KnownFailures | None = None,
    shrink_budget: int = SHRINK_BUDGET,
    minimize_budget: int = MINIMIZE_BUDGET,
    strict_efficiency: bool = False,
) -> DecoderVerdict:
    """Every check on up to `examples` generated cases; each distinct failure that is not a known
    one (up to MAX_FAILURES; the first alone for a planted bug, which only has to be caught) is
    shrunk (within the two budgets, see `specaudit.search.driver`) and diagnosed. The first case
    long enough to time also runs without hooks, to measure the instrumentation's cost. Failures
    of correctness come first, efficiency findings after (`DecoderVerdict.level`)."""
    factory = load_decoder(spec)
    verdict = DecoderVerdict(spec, model, expect_failure, strict_efficiency=strict_efficiency)
    known = known or KnownFailures()

    def is_known(v: Violation) -> bool:
        return known.matches(spec, model, v.check, v.rule)

    def on_run(run: Run) -> None:
        basis = overhead_basis(run) if verdict.overhead_basis is None else None
        if basis is not None:
            verdict.overhead_basis = basis
            verdict.instrumentation_overhead = instrumentation_overhead(spec, run.case, factory)
        evaluation = evaluate(run)
        known_here = [v for v in evaluation.violations if is_known(v)]
        verdict.record(run, run_statuses(evaluation, is_known, len(run.recording.target_calls)), known_here)
        if progress:
            progress.tick(f"{spec} on {model}: {verdict.examples} cases")

    result = search(
        spec,
        model,
        max_examples=examples,
        seed=seed,
        factory=factory,
        shrink_budget=shrink_budget,
        minimize_budget=minimize_budget,
        on_run=on_run,
        counts=lambda v: not is_known(v),
        max_failures=1 if expect_failure else MAX_FAILURES,
    )
    verdict.take_failures([diagnose(run_case(spec, f.minimal, factory=factory)) for f in result.failures], is_known)
    verdict.seconds = result.seconds
    return verdict


def distinct(diagnoses: list[Diagnosis]) -> list[Diagnosis]:
    """The failing diagnoses, one per (check, rule, signature), in the order found."""
    seen: set[tuple[str | None, ...]] = set()
    out = []
    for d in diagnoses:
        key = (d.first_check, d.first.rule if d.first else None, d.signature)
        if key not in seen:
            seen.add(key)
            out.append(d)
    return out


def failure_name(v: DecoderVerdict, index: int) -> str:
    """The reproducer's name of a verdict's `index`-th failure: the first keeps the plain name."""
    return f"{v.decoder}-{v.model}" + (f"-failure{index + 1}" if index else "")


def failure_json(d: Diagnosis, name: str) -> dict[str, Any]:
    """One distinct failure in report.json: its first violation, signature and reproducer file
    (under DIR/repro), then its whole diagnosis."""
    file = f"{identifier(name)}.json"
    level = "efficiency" if efficiency_only(d.violations) else "fail"
    return {"first": first_fields(d.first), "signature": d.signature, "level": level, "reproducer": file,
            "diagnosis": d.to_json()}  # fmt: skip


# ---------------------------------------------------------------------------------------
# The plan: which decoders on which models


def planted_bugs() -> list[tuple[str, tuple[str, ...]]]:
    """Every planted bug's spec and the models it shows on (the first is where to search)."""
    return [(f"specaudit.reference.mutants:{name}", cls.bug.models) for name, cls in CATALOG.items()]


def audit_plan(settings: AuditSettings) -> list[tuple[str, bool, str]]:
    """(decoder, expect_failure, model) in run order. Decoders the user names run on every
    model asked for. The default audit runs the reference decoders the same way, and each
    planted bug once, on the first model it shows on among those asked for (the exact model
    for most: it names slots and is fast); a bug none of them can show is left out."""
    if settings.decoders:  # a decoder that samples is judged in distribution (`audits.sampling`)
        greedy = [spec for spec in settings.decoders if not declares_sampling(load_decoder(spec))]
        return [(spec, False, model) for spec in greedy for model in settings.models]
    if settings.engines:
        return []  # `--engine` alone audits the engines only
    plan = [(spec, False, model) for spec in DEFAULT_DECODERS for model in settings.models]
    for spec, models in planted_bugs():
        model = next((m for m in models if m in settings.models), None)
        if model is not None:
            plan.append((spec, True, model))
    return plan


def left_out(settings: AuditSettings) -> list[str]:
    """The planted bugs the default audit leaves out: they show only on models not asked for."""
    if settings.decoders:
        return []
    return [spec for spec, models in planted_bugs() if not set(models) & set(settings.models)]
