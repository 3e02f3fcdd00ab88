"""The audit loop on the built-in models: verdicts, per-check statuses, progress and the table.

`specaudit audit` and `specaudit gate` both run `audit_model` for each decoder x model:
Hypothesis-generated cases until the first failure (`specaudit.search`), every check on every
run, the failing case shrunk and diagnosed. A `Verdict` accumulates what the runs measured
and, per check of the registry, its status over the runs: "fail" if any run failed it,
"xfail" if its only failures are listed known failures, "pass" if some run passed it and
none failed, "n/a" if it applied to no run (`specaudit.registry.combined`, plus xfail).
"""

from __future__ import annotations

import json
import statistics
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specaudit.case import Case
from specaudit.checks import equivalence
from specaudit.contract import load_decoder
from specaudit.diagnosis import Diagnosis, diagnose
from specaudit.errors import UsageError
from specaudit.models import DEFAULT_DECODERS
from specaudit.reference.mutants import CATALOG
from specaudit.registry import FAIL, NOT_APPLICABLE, Evaluation, evaluate
from specaudit.reproducer import write_failure
from specaudit.runner import Run, run_case
from specaudit.search import search
from specaudit.settings import AuditSettings
from specaudit.violation import Violation
from specaudit.xfails import KnownFailures

PLANTED_BUG_EXAMPLES = 300
"""Search budget for a planted bug: the search stops at its first failure, so this is a bound."""

STATUS_RANK = {"n/a": 0, "pass": 1, "xfail": 2, "fail": 3}
"""Aggregation over runs: the highest rank seen wins (one failing run fails the check)."""


def run_statuses(evaluation: Evaluation, known: Callable[[Violation], bool]) -> dict[str, str]:
    """One run's check statuses in the table's words: "pass", "fail", "n/a", and "xfail" for a
    failed check whose violations are all known failures."""
    out = {}
    for outcome in evaluation.outcomes:
        status = "n/a" if outcome.status == NOT_APPLICABLE else outcome.status
        if outcome.status == FAIL and all(known(v) for v in outcome.violations):
            status = "xfail"
        out[outcome.check] = status
    return out


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


@dataclass
class Verdict:
    """One decoder on one model: what ran, each check's status and, on a failure that is not
    a known one, the diagnosis of its minimal case."""

    decoder: str
    model: str
    expect_failure: bool = False  # a planted bug: the audit passes when it is caught
    examples: int = 0
    seconds: float = 0.0
    exact_rows: int = 0
    rows: int = 0
    partial_sum: float = 0.0
    tokens_per_second: list[float] = field(default_factory=list)
    outside_share: list[float] = field(default_factory=list)
    instrumentation_overhead: float | None = None
    diagnosis: Diagnosis | None = None
    checks: dict[str, str] = field(default_factory=dict)  # check -> "pass" / "fail" / "xfail" / "n/a"
    known: set[tuple[str, str]] = field(default_factory=set)  # (check, rule) of known failures met

    @property
    def passed(self) -> bool:
        return self.diagnosis is None

    @property
    def as_expected(self) -> bool:
        return self.passed != self.expect_failure

    @property
    def exact_match(self) -> float | None:
        return self.exact_rows / self.rows if self.rows else None

    def record(self, run: Run, statuses: dict[str, str], known: list[Violation]) -> None:
        """Fold one run in: its rows, its speed, its check statuses and the known failures it met."""
        self.examples += 1
        self.checks = merge_statuses([self.checks, statuses])
        self.known.update((v.check, v.rule) for v in known)
        if run.outputs is None:
            return
        rows = equivalence(run).rows
        self.rows += len(rows)
        self.exact_rows += sum(r.exact for r in rows)
        self.partial_sum += sum(r.partial for r in rows)
        self.tokens_per_second.append(run.tokens_per_second)
        self.outside_share.append(run.outside_models_share)

    def to_json(self) -> dict[str, Any]:
        return {
            "decoder": self.decoder,
            "model": self.model,
            "expect_failure": self.expect_failure,
            "as_expected": self.as_expected,
            "cases": self.examples,
            "seconds": round(self.seconds, 3),
            "exact_match": self.exact_match,
            "partial_match": self.partial_sum / self.rows if self.rows else None,
            "tokens_per_second": median(self.tokens_per_second),
            "outside_models_share": median(self.outside_share),
            "instrumentation_overhead": self.instrumentation_overhead,
            "checks": dict(self.checks),
            "known_failures": [{"check": c, "rule": r} for c, r in sorted(self.known)],
            "diagnosis": self.diagnosis.to_json() if self.diagnosis else None,
        }


class Progress:
    """A one-line progress bar on stderr (a line per finished item when not a terminal)."""

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
            d = verdict.diagnosis
            status = "PASS" if d is None else f"FAIL ({d.signature})"
            line = f"[{self.done}/{self.total}] {verdict.decoder} on {verdict.model}: {status}, {outcome}"
            print(("\r" if self.tty else "") + f"{line:<100}", file=sys.stderr, flush=True)


def instrumentation_overhead(spec: str, case: Case, factory: Any, repeats: int = 2) -> float:
    """Hooked over plain decoder time on one case, minus 1: the best of `repeats` interleaved
    pairs, timed warm (after the search's own run of the case), so one stall does not decide it."""
    plain, hooked = [], []
    for _ in range(repeats):
        plain.append(run_case(spec, case, factory=factory, instrumented=False).seconds)
        hooked.append(run_case(spec, case, factory=factory).seconds)
    return min(hooked) / max(min(plain), 1e-9) - 1.0


def audit_model(
    spec: str,
    model: str,
    examples: int,
    seed: int,
    *,
    progress: Progress | None = None,
    expect_failure: bool = False,
    known: KnownFailures | None = None,
) -> Verdict:
    """Every check on up to `examples` generated cases; the first failure that is not a known
    one is shrunk and diagnosed. The first case also runs without hooks, to measure the
    instrumentation's cost."""
    factory = load_decoder(spec)
    verdict = Verdict(spec, model, expect_failure)
    known = known or KnownFailures()

    def is_known(v: Violation) -> bool:
        return known.matches(spec, model, v.check, v.rule)

    def on_run(run: Run) -> None:
        if verdict.instrumentation_overhead is None:
            verdict.instrumentation_overhead = instrumentation_overhead(spec, run.case, factory)
        evaluation = evaluate(run)
        known_here = [v for v in evaluation.violations if is_known(v)]
        verdict.record(run, run_statuses(evaluation, is_known), known_here)
        if progress:
            progress.tick(f"{spec} on {model}: {verdict.examples} cases")

    result = search(
        spec, model, max_examples=examples, seed=seed, factory=factory, on_run=on_run, counts=lambda v: not is_known(v)
    )
    if result.minimal is not None:
        verdict.diagnosis = diagnose(run_case(spec, result.minimal, factory=factory))
    verdict.seconds = result.seconds
    return verdict


def planted_bugs() -> list[tuple[str, tuple[str, ...]]]:
    """Every planted bug's spec and the models it shows on (the first is where to search)."""
    return [(f"specaudit.reference.mutants:{name}", cls.bug.models) for name, cls in CATALOG.items()]


def audit_plan(settings: AuditSettings) -> list[tuple[str, bool, str]]:
    """(decoder, expect_failure, model) in run order. Decoders the user names run on every
    model asked for. The default audit runs the reference decoders the same way, and each
    planted bug once, on the first model it shows on among those asked for (the exact model
    for most: it names slots and is fast); a bug none of them can show is left out."""
    if settings.decoders:
        return [(spec, False, model) for spec in settings.decoders for model in settings.models]
    plan = [(spec, False, model) for spec in DEFAULT_DECODERS for model in settings.models]
    for spec, models in planted_bugs():
        model = next((m for m in models if m in settings.models), None)
        if model is not None:
            plan.append((spec, True, model))
    return plan


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def format_table(verdicts: list[Verdict]) -> str:
    """The forensic table (the paper's Table 2, with a diagnosis in every row), then each
    check's status per decoder x model."""
    header = (
        f"{'decoder':<44} {'model':<11} {'cases':>5} {'exact':>6} {'partial':>7} {'tok/s':>7} {'align%':>6}  "
        f"{'verdict':<9} {'first check':<18} {'signature':<17} expected"
    )
    lines = [header, "-" * len(header)]
    for v in verdicts:
        j = v.to_json()
        d = v.diagnosis
        lines.append(
            f"{v.decoder:<44} {v.model:<11} {v.examples:>5} {_fmt(j['exact_match'], '.2f'):>6} "
            f"{_fmt(j['partial_match'], '.2f'):>7} {_fmt(j['tokens_per_second'], '.0f'):>7} "
            f"{_fmt(None if j['outside_models_share'] is None else 100 * j['outside_models_share'], '.0f'):>6}  "
            f"{'PASS' if d is None else 'FAIL':<9} {(d.first_check or '') if d else '':<18} "
            f"{(d.signature or '') if d else '':<17} {'yes' if v.as_expected else 'NO'}"
        )
    overheads = [v.instrumentation_overhead for v in verdicts if v.instrumentation_overhead is not None]
    if overheads:
        lines.append(
            f"instrumentation overhead (hooked vs plain run of one case each): median {100 * median(overheads):.0f}%"
        )
    lines.append("align% = share of decoder time outside model forwards (realignment, acceptance, bookkeeping)")
    lines += ["", *check_table(verdicts)]
    for v in verdicts:
        if v.known:
            lines.append(
                f"{v.decoder} on {v.model}: known failures met: " + ", ".join(f"{c} {r}" for c, r in sorted(v.known))
            )
        if v.diagnosis is not None and not v.expect_failure:
            lines += ["", f"{v.decoder} on {v.model}: minimal failing case"]
            lines += ["  " + line for line in v.diagnosis.render().splitlines()[1:]]
    return "\n".join(lines)


def check_table(verdicts: list[Verdict]) -> list[str]:
    """Each check's status over the runs, per decoder x model (FAIL in capitals)."""
    checks = list(dict.fromkeys(c for v in verdicts for c in v.checks))
    widths = [max(len(c), 5) for c in checks]
    header = f"{'checks':<44} {'model':<11} " + " ".join(f"{c:<{w}}" for c, w in zip(checks, widths))
    lines = [header, "-" * len(header)]
    for v in verdicts:
        cells = []
        for c, w in zip(checks, widths):
            status = v.checks.get(c, "n/a")
            cells.append(f"{'FAIL' if status == 'fail' else status:<{w}}")
        lines.append(f"{v.decoder:<44} {v.model:<11} " + " ".join(cells))
    return lines


def write_outputs(directory: Path, verdicts: list[Verdict]) -> None:
    """DIR/report.json and, per failure, its reproducer and regression test under DIR/repro."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "report.json").write_text(json.dumps([v.to_json() for v in verdicts], indent=1) + "\n")
    for v in verdicts:
        if v.diagnosis is not None:
            write_failure(directory / "repro", f"{v.decoder}-{v.model}", v.diagnosis, "shrunk by specaudit audit")


def run_audit(settings: AuditSettings) -> int:
    """`specaudit audit`: exit 0 when every verdict is as expected, 1 otherwise."""
    plan = audit_plan(settings)
    for spec in dict.fromkeys(spec for spec, _, _ in plan):
        load_decoder(spec)  # an unloadable decoder is a usage error before anything runs
    left_out = [
        spec for spec, models in planted_bugs() if not settings.decoders and not set(models) & set(settings.models)
    ]
    print(
        f"specaudit audit: {len(plan)} decoder/model pairs ({len({s for s, _, _ in plan})} decoders), "
        f"up to {settings.examples} cases each, seed {settings.seed}"
        + (
            f"\n  planted bugs left out (they show only on models not asked for): {', '.join(left_out)}"
            if left_out
            else ""
        ),
        flush=True,
    )
    progress = Progress(len(plan), enabled=not settings.quiet)
    verdicts = []
    for spec, expect_failure, model in plan:
        budget = max(settings.examples, PLANTED_BUG_EXAMPLES) if expect_failure else settings.examples
        verdict = audit_model(spec, model, budget, settings.seed, progress=progress, expect_failure=expect_failure)
        progress.finish_item(verdict)
        verdicts.append(verdict)
    print(format_table(verdicts))
    if settings.out is not None:
        try:
            write_outputs(settings.out, verdicts)
        except OSError as exc:
            raise UsageError(f"cannot write to --out {settings.out}: {exc.strerror or exc}") from None
        print(f"report: {settings.out / 'report.json'}; reproducers under {settings.out / 'repro'}")
    wrong = [v for v in verdicts if not v.as_expected]
    print(f"\n{len(verdicts) - len(wrong)} as expected, {len(wrong)} not")
    return 1 if wrong else 0
