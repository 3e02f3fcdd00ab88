"""Sampling decoders in `make audit`: lossless in distribution, judged over drawn sampling cases.

Its items: the reference sampling designs (they must pass) and every planted sampling bug of
`specaudit.reference.sampling_mutants` (each must be caught); with --decoder, the named decoders
that declare `samples = True` (the greedy driver leaves them out). Each item is one search
(`search.sampling.search_sampling`) whose cases are judged by the registry's sampling-decoder
checks; every failure is shrunk, written as a `sampling-case` reproducer that `specaudit replay`
runs again, and reported with its role. One verdict's false-alarm probability is stated
(`numerics.fit.ALPHA`), and so is its power: the smallest shift its best-sampled case detects.
"""

from __future__ import annotations

import functools
from dataclasses import asdict
from pathlib import Path
from typing import Any

from specaudit.artifacts.report import entry
from specaudit.artifacts.reproducer import Reproducer, save, violations_evidence
from specaudit.artifacts.tables import sampling_entries_table
from specaudit.audits.subject import Item, SubjectDriver
from specaudit.audits.verdict import EntryVerdict, Progress, Verdict
from specaudit.checks.coverage import Coverage, coverage_of_runs
from specaudit.checks.distribution import fits
from specaudit.checks.registry import DECODER, SAMPLER, check_named, decided, order_for
from specaudit.config.settings import AuditSettings, GateSettings
from specaudit.contracts import subjects
from specaudit.contracts.decoder import load_decoder
from specaudit.contracts.errors import UsageError
from specaudit.contracts.sampling import declares_sampling
from specaudit.numerics.fit import ALPHA, POWER
from specaudit.running.sampling import SampledRun
from specaudit.search.sampling import FailureClass, SamplingFound, SamplingSearch, search_sampling

KIND = subjects.SAMPLING_DECODER.name
REPORT_KIND, REPRODUCER_KIND = str(subjects.SAMPLING_DECODER.report), str(subjects.SAMPLING_DECODER.reproducer)
MODEL = "transparent"
DESIGNS = (
    "specaudit.reference.plain_sampling:PlainSampling",
    "specaudit.reference.sampling:SpecSampling",
    "specaudit.reference.sampling:PerRowSampling",
    "specaudit.reference.sampling:GumbelSpec",
    "specaudit.reference.sampling:EqualitySpec",
    "specaudit.reference.sampling:RecomputeSampling",
)
"""The correct sampling designs the default audit holds to a pass, each built differently."""
EXAMPLES = 6
"""Sampled cases per correct design (each case is several seeded runs)."""
PLANTED_EXAMPLES = 30
"""Sampled cases a planted sampling bug may take to be caught (a bound; most need a few)."""
MAX_FAILURES = 4
"""Distinct failure classes a decoder under test is searched for (each set aside once shrunk)."""


@functools.cache
def samples(spec: str) -> bool:
    """Does `spec` name a decoder that declares `samples = True` (on its class, or its factory)?"""
    return declares_sampling(load_decoder(spec))


def planted() -> list[str]:
    from specaudit.reference.sampling_mutants import CATALOG

    return [f"specaudit.reference.sampling_mutants:{cls.__name__}" for cls in CATALOG.values()]


def audit_items(settings: AuditSettings) -> list[Item]:
    if settings.decoders:
        return [Item(s, MODEL, False, settings.examples, settings.seed, kind=KIND) for s in settings.decoders
                if samples(s)]  # fmt: skip
    if settings.engines:
        return []
    examples = min(settings.examples, EXAMPLES)
    designs = [Item(spec, MODEL, False, examples, settings.seed, kind=KIND) for spec in DESIGNS]
    bugs = [Item(spec, MODEL, True, PLANTED_EXAMPLES, settings.seed, kind=KIND) for spec in planted()]
    return designs + bugs


def gate_items(settings: GateSettings) -> list[Item]:
    """None: the gate's thresholds and JUnit cases are a greedy decoder's; a sampling decoder is refused."""
    sampling = [s for s in settings.decoders if samples(s)]
    if sampling:
        raise UsageError(f"{', '.join(sampling)} samples: the gate judges greedy decoders; run `specaudit audit "
                         "--decoder` for a verdict in distribution (docs/sampling.md)")  # fmt: skip
    return []


def run_sampling(item: Item, progress: Progress | None = None) -> Verdict:
    coverage: list[Coverage] = []
    powers: list[dict[str, tuple[int, float]]] = []

    def seen(sampled: SampledRun) -> None:
        coverage.append(coverage_of_runs(sampled.runs))
        powers.append({role: (f.n, f.shift) for role, f in fits(sampled).items()})

    # a planted bug's search ends once a sampling check has caught it (with its role); another's looks for every class
    enough = sampling_check if item.expect_failure else None
    result = search_sampling(item.spec, max_examples=item.examples, seed=item.seed, on_run=seen,
                             max_failures=MAX_FAILURES, enough=enough)  # fmt: skip
    return verdict_of(item, result, functools.reduce(Coverage.merge, coverage, Coverage()), powers)


def sampling_check(found: FailureClass) -> bool:
    """A class of the checks only a sampling decoder has (not the contract's, I1's or I2's)."""
    return found[0] in order_for(SAMPLER) and found[0] not in order_for(DECODER)


def verdict_of(item: Item, result: SamplingSearch, coverage: Coverage, powers: list[dict[str, Any]]) -> EntryVerdict:
    first = result.failures[0] if result.failures else None
    violation = first.violation if first else None
    signature = None
    if violation is not None:
        signature = decided(check_named(violation.check).signature(violation, None), None)[0]
    tokens = {role: sum(p[role][0] for p in powers) for role in ("all", "plain", "draft", "bonus")}
    best = min(powers, key=lambda p: p["all"][1], default=None)
    figures = {
        "cases": result.cases_run,
        "seconds": round(result.seconds, 2),
        "tokens": tokens,
        "alpha": ALPHA,
        "power": POWER,
        "best_case": {"tokens": best["all"][0], "shift": best["all"][1]} if best else None,
        "failures": [failure_json(f) for f in result.failures],
    }
    subject = {REPORT_KIND: item.spec, "model": item.model}
    report = entry(REPORT_KIND, subject, not result.found, violation, signature, figures, coverage)
    lines = [f"  {f.minimal!r}\n    {f.violation.render()}" for f in result.failures]
    return EntryVerdict(KIND, report, item.expect_failure, lines, writer=functools.partial(write, item.spec, result))


def failure_json(found: SamplingFound) -> dict[str, Any]:
    first = found.violation
    case = found.minimal
    return {
        "check": first.check,
        "rule": first.rule,
        "role": "all" if first.rule == "pooled-fit" else first.evidence.get("role") or first.evidence.get("token_role"),
        "accepted_before": first.evidence.get("slot", first.evidence.get("accepted_before")),
        "message": first.render(),
        "rows": case.case.batch_size,
        "prompts": len(set(case.case.prompts)),
        "runs": case.runs,
        "max_new_tokens": case.case.max_new_tokens,
        "tokens": first.evidence.get("n"),
        "case": repr(case),
        "examples": found.examples,
        "shrink_runs": found.shrink_runs,
    }


def reproducer(spec: str, found: SamplingFound) -> Reproducer:
    violations = [asdict(v) for v in found.evaluation.violations]
    return Reproducer(REPRODUCER_KIND, {"decoder": spec}, {"case": found.minimal.to_json()},
                      violations_evidence(violations))  # fmt: skip


def write(spec: str, result: SamplingSearch, directory: Path, summary: str) -> list[Path]:
    name = spec.rsplit(":", 1)[-1]
    return [save(directory, f"sampling_{name}_{i}", reproducer(spec, f)) for i, f in enumerate(result.failures)]


def table(verdicts: list[Any]) -> str:
    return sampling_entries_table([v.report_entry() for v in verdicts], [v.details() for v in verdicts])


def headline(items: list[Item]) -> str:
    return f"{len(items)} sampling decoder(s) judged in distribution, "


SAMPLING = SubjectDriver(KIND, audit_items, gate_items, load_decoder, run_sampling, table, headline, 2.0)
