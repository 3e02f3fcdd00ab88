"""The audit loop on the built-in models: verdicts, per-check statuses, progress and the table.

`specaudit audit` and `specaudit gate` both run `audit_model` for each decoder x model:
Hypothesis-generated cases until the first failure (`specaudit.search.driver`), every check on every
run, the failing case shrunk and diagnosed. A `Verdict` accumulates what the runs measured
and, per check of the registry, its status over the runs: "fail" if any run failed it,
"xfail" if its only failures are listed known failures, "pass" if some run passed it and
none failed, "n/a" if it applied to no run (`specaudit.checks.registry.combined`, plus xfail).
"""

from __future__ import annotations

import functools
import json
import statistics
import sys
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

from specaudit.artifacts.report import entry, first_fields, write_report
from specaudit.artifacts.reproducer import EVIDENCE_LIMIT, identifier, write_engine_failure, write_failure
from specaudit.checks import equivalence
from specaudit.checks.coverage import Coverage, coverage_of_run
from specaudit.checks.diagnosis import Diagnosis, Finding, diagnose
from specaudit.checks.registry import FAIL, NOT_APPLICABLE, Evaluation, evaluate
from specaudit.config.settings import AuditSettings
from specaudit.config.xfails import KnownFailures
from specaudit.contracts.builtins import DEFAULT_DECODERS
from specaudit.contracts.case import Case
from specaudit.contracts.decoder import load_decoder
from specaudit.contracts.engine import load_engine
from specaudit.contracts.errors import UsageError
from specaudit.contracts.violation import Violation, render
from specaudit.reference.engine_mutants import ENGINE_CATALOG
from specaudit.reference.mutants import CATALOG
from specaudit.running.runner import Run, run_case
from specaudit.search.ddmin import MinimizedOps, ReproducerPasses, minimize_ops
from specaudit.search.driver import MINIMIZE_BUDGET, SHRINK_BUDGET, search
from specaudit.search.engine_machine import DEFAULT_ENGINES, MachineRun, run_machine
from specaudit.search.engine_replay import diagnose_engine
from specaudit.search.jobs import default_jobs, run_all

PLANTED_BUG_EXAMPLES = 300
"""Search budget for a planted bug: the search stops at its first failure, so this is a bound."""

PLANTED_SHRINK_BUDGET = 30
"""Hypothesis shrink runs for a planted bug (a decoder under test gets the search's 150). Its
shrinker costs far more than the runs on the long cases some bugs are first caught on; with
delta debugging after it every planted bug still shrinks to the rows its catalog entry
expects (one, two when it needs a batch), 22 of 31 to the very case 150 runs give, at a third
of the time (bench/results/audit_time.md)."""

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
    instrumentation_overhead: float | None = None  # None: no run long enough to time (`long_enough`)
    overhead_basis: dict[str, int] | None = None  # the run it was timed on: rows, target calls, generated tokens
    diagnosis: Diagnosis | None = None  # the first failure's (the simplest found first)
    failures: list[Diagnosis] = field(default_factory=list)  # every distinct failure, `diagnosis` first
    checks: dict[str, str] = field(default_factory=dict)  # check -> "pass" / "fail" / "xfail" / "n/a"
    known: set[tuple[str, str]] = field(default_factory=set)  # (check, rule) of known failures met
    coverage: Coverage = field(default_factory=Coverage)  # what the runs exercised (`checks.coverage`)

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
        """Fold one run in: its rows, its speed, its check statuses, the known failures it met and
        what it exercised."""
        self.examples += 1
        self.checks = merge_statuses([self.checks, statuses])
        self.coverage = self.coverage.merge(coverage_of_run(run))
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
        return entry("decoder", subject, self.passed, first, signature, self.to_json(), self.coverage)


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
            if len(verdict.failures) > 1:
                signatures = ", ".join(str(f.signature) for f in verdict.failures)
                status = f"FAIL ({len(verdict.failures)} distinct failures: {signatures})"
            line = f"[{self.done}/{self.total}] {verdict.decoder} on {verdict.model}: {status}, {outcome}"
            print(("\r" if self.tty else "") + f"{line:<100}", file=sys.stderr, flush=True)


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


def overhead_line(verdicts: list[Verdict]) -> str:
    """The median overhead over the verdicts timed on a long enough run, or why there is none."""
    timed = [v.instrumentation_overhead for v in verdicts if v.instrumentation_overhead is not None]
    least = ", ".join(f"{n} {k.replace('_', ' ')}" for k, n in OVERHEAD_BASIS.items())
    if not timed:
        return f"instrumentation overhead: n/a (run too short: no run of at least {least} to time)"
    return (
        f"instrumentation overhead (hooked vs plain run of one case each): median {100 * median(timed):.0f}% "
        f"over {len(timed)} of {len(verdicts)} verdicts (timed on runs of at least {least})"
    )


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
) -> Verdict:
    """Every check on up to `examples` generated cases; each distinct failure that is not a known
    one (up to MAX_FAILURES; the first alone for a planted bug, which only has to be caught) is
    shrunk (within the two budgets, see `specaudit.search.driver`) and diagnosed. The first case
    long enough to time also runs without hooks, to measure the instrumentation's cost."""
    factory = load_decoder(spec)
    verdict = Verdict(spec, model, expect_failure)
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
        verdict.record(run, run_statuses(evaluation, is_known), known_here)
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
    verdict.failures = distinct([diagnose(run_case(spec, f.minimal, factory=factory)) for f in result.failures])
    verdict.diagnosis = verdict.failures[0] if verdict.failures else None
    verdict.seconds = result.seconds
    return verdict


MAX_FAILURES = 8
"""Distinct failures one decoder x model search reports at most (`search`'s `max_failures`)."""


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


def failure_name(v: Verdict, index: int) -> str:
    """The reproducer's name of a verdict's `index`-th failure: the first keeps the plain name."""
    return f"{v.decoder}-{v.model}" + (f"-failure{index + 1}" if index else "")


def failure_json(d: Diagnosis, name: str) -> dict[str, Any]:
    """One distinct failure in report.json: its first violation, signature and reproducer file
    (under DIR/repro), then its whole diagnosis."""
    file = f"{identifier(name)}.json"
    return {"first": first_fields(d.first), "signature": d.signature, "reproducer": file, "diagnosis": d.to_json()}


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
    if settings.engines:
        return []  # `--engine` alone audits the engines only
    plan = [(spec, False, model) for spec in DEFAULT_DECODERS for model in settings.models]
    for spec, models in planted_bugs():
        model = next((m for m in models if m in settings.models), None)
        if model is not None:
            plan.append((spec, True, model))
    return plan


def verdict_word(passed: bool, coverage: Coverage) -> str:
    """PASS, FAIL, or a pass that exercised little, with why: "PASS (no ragged round)"."""
    if not passed:
        return "FAIL"
    return f"PASS ({coverage.flags[0]})" if coverage.flags else "PASS"


COVERAGE_LEGEND = (
    "coverage = rounds (target calls after the prefill) in which rows accepted different numbers of drafts / "
    "all rounds, largest batch B, draft lengths K, highest position id, rows finished early, prompts holding "
    "the pad id, EOS stops (specaudit.checks.coverage)"
)


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def format_table(verdicts: list[Verdict]) -> str:
    """The forensic table (the paper's Table 2, with a diagnosis in every row, and what each
    verdict exercised), then each check's status per decoder x model."""
    words = {id(v): verdict_word(v.passed, v.coverage) for v in verdicts}
    w = max([9, *map(len, words.values())])
    header = (
        f"{'decoder':<44} {'model':<11} {'cases':>5} {'exact':>6} {'partial':>7} {'tok/s':>7} {'align%':>6}  "
        f"{'verdict':<{w}} {'first check':<18} {'signature':<17} {'expected':<8}  coverage"
    )
    lines = [header, "-" * len(header)]
    for v in verdicts:
        j = v.report_entry()
        lines.append(
            f"{v.decoder:<44} {v.model:<11} {v.examples:>5} {_fmt(j['exact_match'], '.2f'):>6} "
            f"{_fmt(j['partial_match'], '.2f'):>7} {_fmt(j['tokens_per_second'], '.0f'):>7} "
            f"{_fmt(None if j['outside_models_share'] is None else 100 * j['outside_models_share'], '.0f'):>6}  "
            f"{words[id(v)]:<{w}} {(j['first'] or {}).get('check') or '':<18} "
            f"{j['signature'] or '':<17} {'yes' if v.as_expected else 'NO':<8}  {v.coverage.summary()}"
        )
        lines += [more_failure_line(v, i, w) for i in range(1, len(v.failures))]
    lines.append(overhead_line(verdicts))
    lines.append("align% = share of decoder time outside model forwards (realignment, acceptance, bookkeeping)")
    lines.append(COVERAGE_LEGEND)
    lines += ["", *check_table(verdicts)]
    for v in verdicts:
        if v.known:
            lines.append(
                f"{v.decoder} on {v.model}: known failures met: " + ", ".join(f"{c} {r}" for c, r in sorted(v.known))
            )
        if v.diagnosis is not None and not v.expect_failure:
            for i, d in enumerate(v.failures or [v.diagnosis]):
                of = f" (failure {i + 1} of {len(v.failures)})" if len(v.failures) > 1 else ""
                lines += ["", f"{v.decoder} on {v.model}: minimal failing case{of}"]
                lines += ["  " + line for line in d.render().splitlines()[1:]]
    return "\n".join(lines)


def more_failure_line(v: Verdict, index: int, width: int) -> str:
    """A row under a verdict's for its `index`-th distinct failure: its first check, rule and signature."""
    d = v.failures[index]
    label = f"  + failure {index + 1} of {len(v.failures)}"
    rule = f" ({d.first.rule})" if d.first is not None else ""
    return (
        f"{label:<44} {v.model:<11} {'':>5} {'':>6} {'':>7} {'':>7} {'':>6}  {'FAIL':<{width}} "
        + (f"{(d.first_check or '') + rule:<18} {d.signature or '':<17}").rstrip()
    )


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


def write_outputs(directory: Path, verdicts: list[Verdict], engines: list[EngineVerdict]) -> None:
    """DIR/report.json (decoders, then engines) and, per distinct failure, its reproducer and
    regression test under DIR/repro (`failure_name`)."""
    write_report(directory, "audit", [v.report_entry() for v in [*verdicts, *engines]])
    write_engine_outputs(directory / "repro", engines, "shrunk by specaudit audit")
    for v in verdicts:
        for i, d in enumerate(v.failures or ([v.diagnosis] if v.diagnosis is not None else [])):
            write_failure(directory / "repro", failure_name(v, i), d, "shrunk by specaudit audit")


# ---------------------------------------------------------------------------------------
# Engines: the engine state machine (`specaudit.search.engine_machine`), one verdict per engine


ENGINE_STEPS = 12
"""Rules per generated run of the engine state machine (the conformance suite's)."""

PLANTED_ENGINE_EXAMPLES = 30
"""Search budget for a planted engine bug (the `ci` profile's): a bound, the run stops at the first failure."""

ENGINE_MINIMIZE_BUDGET = 200
"""Replays `minimize_ops` may spend on a failing engine's rules after the machine's own shrinking."""


@dataclass
class EngineVerdict:
    """One engine through the state machine: the run, and its failure's rules delta-debugged."""

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
        if self.minimized is not None:
            return self.minimized.reproducer
        return None if self.run.failure is None else self.run.failure.reproducer

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
            "kind": "engine",
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
        return entry("engine", subject, self.passed, first, signature, self.to_json(), self.run.coverage)


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
    if failure is not None and failure.reproducer["ops"]:
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


def mark_known(v: EngineVerdict, known: KnownFailures) -> None:
    """Record the engine's failure as known when `known` lists every one of its violations."""
    listed = [known.matches(v.engine, v.model, x.check, x.rule) for x in v.violations]  # marks every match used
    if listed and all(listed):
        v.known = tuple(sorted({(x.check, x.rule) for x in v.violations}))


def engine_word(v: EngineVerdict) -> str:
    return "XFAIL" if v.known else verdict_word(v.passed, v.run.coverage)


def engine_line(v: EngineVerdict, width: int, verdict_width: int = 7) -> str:
    j = v.report_entry()
    first = j["first"] or {}
    ragged = v.run.events.get("admission into a batch with ragged acceptance")
    return (
        f"{v.engine:<{width}} {v.model:<11} {v.run.runs:>5} {v.run.seconds:>6.1f} {_fmt(ragged, '.2f'):>6}  "
        f"{engine_word(v):<{verdict_width}} {first.get('check') or '':<12} {first.get('rule') or '':<18} "
        f"{j['signature'] or '':<17} {_fmt(j['minimized_rules'], 'd'):>5}  {'yes' if v.as_expected else 'NO':<8}  "
        f"{v.run.coverage.summary()}"
    )


def format_engine_table(verdicts: list[EngineVerdict]) -> str:
    """Engines: runs, time, share of runs with an admission into a ragged batch, the verdict,
    the first broken check, rule and signature, and the length of the minimized rule sequence."""
    width = max([28, *(len(v.engine) for v in verdicts)])
    w = max([7, *(len(engine_word(v)) for v in verdicts)])
    header = (
        f"{'engine (state machine)':<{width}} {'model':<11} {'runs':>5} {'sec':>6} {'ragged':>6}  "
        f"{'verdict':<{w}} {'first check':<12} {'rule':<18} {'signature':<17} {'rules':>5}  {'expected':<8}  coverage"
    )
    lines = [header, "-" * len(header), *(engine_line(v, width, w) for v in verdicts)]
    lines.append(
        "ragged = share of runs with an admission into a batch with ragged acceptance; "
        "rules = length of the minimized failing rule sequence"
    )
    lines.append(COVERAGE_LEGEND + "; arrivals while others ran, aborts, duplicate prompts, rows reused")
    for v in verdicts:
        if v.known:
            lines.append(f"{v.engine} on {v.model}: known failures met: " + ", ".join(f"{c} {r}" for c, r in v.known))
        elif v.violations and not v.expect_failure:
            lines += [
                "",
                f"{v.engine} on {v.model}: minimal failing rule sequence"
                f" ({len((v.reproducer or {}).get('ops', []))} rules)",
            ]
            lines += ["  " + line for line in render(v.violations).splitlines()]
            lines.append("  reproducer: " + json.dumps(v.reproducer))
    return "\n".join(lines)


def engine_file_name(v: EngineVerdict) -> str:
    return f"{v.engine}-{v.model}-engine"


def write_engine_outputs(directory: Path, verdicts: list[EngineVerdict], summary: str) -> list[Path]:
    """Per failing engine, its reproducer and regression test under `directory`."""
    paths = []
    for v in verdicts:
        if v.reproducer is not None:
            paths += write_engine_failure(directory, engine_file_name(v), v.reproducer, v.violations, summary)
    return paths


def finish_engine(v: EngineVerdict, index: int, total: int, quiet: bool) -> None:
    if not quiet:
        outcome = "as expected" if v.as_expected else "UNEXPECTED"
        first = v.violations[0] if v.violations else None
        status = "PASS" if first is None else f"FAIL ({first.check} {first.rule})"
        line = f"[{index}/{total}] engine {v.engine} on {v.model}: {status}, {outcome}"
        print(line, file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------
# The run: every item of both plans, in worker processes, the results in plan order


@dataclass(frozen=True)
class Item:
    """One independent search of the audit: a decoder (or, with `engine`, an engine) on a model."""

    spec: str
    model: str
    expect_failure: bool
    examples: int
    seed: int
    engine: bool = False
    known: KnownFailures = field(default_factory=KnownFailures)
    shrink_budget: int = SHRINK_BUDGET


def audit_items(settings: AuditSettings) -> list[Item]:
    """The decoder plan, then the engine plan, with each item's search budgets."""
    items, known = [], settings.xfails
    for spec, expect_failure, model in audit_plan(settings):
        budget = max(settings.examples, PLANTED_BUG_EXAMPLES) if expect_failure else settings.examples
        shrink = PLANTED_SHRINK_BUDGET if expect_failure else SHRINK_BUDGET
        items.append(Item(spec, model, expect_failure, budget, settings.seed, known=known, shrink_budget=shrink))
    for spec, expect_failure, model in engine_plan(settings):
        budget = max(settings.examples, PLANTED_ENGINE_EXAMPLES) if expect_failure else settings.examples
        items.append(Item(spec, model, expect_failure, budget, settings.seed, engine=True))
    return items


def run_item(item: Item, progress: Progress | None = None) -> tuple[Verdict | EngineVerdict, list[int]]:
    """One item's verdict and the known-failure entries it matched (a worker's copy of them).
    Planted engine bugs skip Hypothesis's shrinking (seconds each) and are shrunk by `minimize_ops` alone."""
    if item.engine:
        shrink = not item.expect_failure
        verdict = audit_engine(
            item.spec, item.examples, item.seed, expect_failure=item.expect_failure, shrink=shrink, model=item.model
        )
        return verdict, []
    decoder = audit_model(
        item.spec,
        item.model,
        item.examples,
        item.seed,
        progress=progress,
        expect_failure=item.expect_failure,
        known=item.known,
        shrink_budget=item.shrink_budget,
    )
    return decoder, sorted(item.known.used)


MODEL_COST = {"transparent": 1.0}
"""Rough cost of an item by model, so that the slow ones start first and no worker is left with
a long one at the end: the tiny real models cost about 5x the transparent one, an engine about a
tenth of a decoder (bench/results/audit_time.md). Only the start order depends on it."""


def item_cost(item: Item) -> float:
    return MODEL_COST.get(item.model, 5.0) / (10.0 if item.engine else 1.0)


class Runs(Protocol):
    """What `run_items` reads of a command's settings (the audit's, the gate's)."""

    jobs: int | None  # worker processes; None: one per available core
    quiet: bool
    xfails: KnownFailures  # the entries the workers matched are marked used in it


def run_items(items: list[Item], settings: Runs) -> list[Verdict | EngineVerdict]:
    """Every item on `settings.jobs` workers; progress lines as each finishes, results in plan order."""
    decoders = sum(not item.engine for item in items)
    progress = Progress(decoders, enabled=not settings.quiet)
    engines_done = 0

    def on_done(index: int, result: tuple[Verdict | EngineVerdict, list[int]]) -> None:
        nonlocal engines_done
        verdict, used = result
        settings.xfails.mark_used(used)
        if isinstance(verdict, EngineVerdict):
            engines_done += 1
            finish_engine(verdict, engines_done, len(items) - decoders, settings.quiet)
        else:
            progress.finish_item(verdict)

    jobs = settings.jobs or default_jobs()
    fn = run_item if jobs > 1 else functools.partial(run_item, progress=progress)
    return [verdict for verdict, _ in run_all(fn, items, jobs, on_done, first=item_cost)]


def run_audit(settings: AuditSettings) -> int:
    """`specaudit audit`: exit 0 when every verdict is as expected, 1 otherwise."""
    plan = audit_plan(settings)
    for spec in dict.fromkeys(spec for spec, _, _ in plan):
        load_decoder(spec)  # an unloadable decoder is a usage error before anything runs
    for spec in dict.fromkeys(spec for spec, _, _ in engine_plan(settings)):
        load_engine(spec)
    left_out = [
        spec for spec, models in planted_bugs() if not settings.decoders and not set(models) & set(settings.models)
    ]
    engine_specs = engine_plan(settings)
    print(
        "specaudit audit: "
        + (f"{len(plan)} decoder/model pairs ({len({s for s, _, _ in plan})} decoders), " if plan else "")
        + (f"{len(engine_specs)} engine(s) through the engine state machine, " if engine_specs else "")
        + f"up to {settings.examples} cases each, seed {settings.seed}"
        + (
            f"\n  planted bugs left out (they show only on models not asked for): {', '.join(left_out)}"
            if left_out
            else ""
        ),
        flush=True,
    )
    results = run_items(audit_items(settings), settings)
    verdicts = [v for v in results if isinstance(v, Verdict)]
    engines = [v for v in results if isinstance(v, EngineVerdict)]
    for engine in engines:
        mark_known(engine, settings.xfails)
    if verdicts:
        print(format_table(verdicts))
    if engines:
        print(("\n" if verdicts else "") + format_engine_table(engines))
    if settings.out is not None:
        try:
            write_outputs(settings.out, verdicts, engines)
        except OSError as exc:
            raise UsageError(f"cannot write to --out {settings.out}: {exc.strerror or exc}") from None
        print(f"report: {settings.out / 'report.json'}; reproducers under {settings.out / 'repro'}")
    wrong = [v for v in [*verdicts, *engines] if not v.as_expected]
    print(f"\n{len(verdicts) + len(engines) - len(wrong)} as expected, {len(wrong)} not")
    for line in settings.xfails.unused_lines():  # stale or too narrow entries: told, not fatal
        print(line)
    return 1 if wrong else 0
